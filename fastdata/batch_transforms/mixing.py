"""Mixing batch transforms: MixUp and CutMix, which turn the labels into soft targets."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from ..checks import check_integer
from .arguments import check_class_count, positive, set_field
from .base import BatchTransform, host_rng
from .ops import mix, soft_targets


class _Mixing(BatchTransform):
    """MixUp and CutMix: one lambda per batch, each image mixed with its neighbour (the batch rolled by
    one, as torchvision v2 does), labels as soft float32 targets."""

    soft_labels = True

    def _check(self, owner):
        if self.alpha == 0 and not isinstance(self.alpha, bool):
            # timm's Mixup reads alpha 0 as "this kind of mixing off"; Beta(0, 0) is no distribution
            raise ValueError(f"{owner}: alpha must be a number > 0, got {float(self.alpha)!r} (timm's alpha=0 "
                             f"means this mixing is off): to turn {owner} off, leave {owner} out of "
                             f"batch_transforms (or out of the OneOf)")
        set_field(self, "alpha", positive(owner, "alpha", self.alpha))
        if isinstance(self.label_smoothing, bool) or not isinstance(self.label_smoothing, numbers.Real) \
                or not 0 <= self.label_smoothing < 1:
            raise ValueError(f"{owner}: label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        set_field(self, "label_smoothing", float(self.label_smoothing))
        set_field(self, "num_classes", check_integer(f"{owner}: num_classes", self.num_classes, minimum=1,
                                                     optional=True))

    def bind(self, context):
        if self.num_classes is not None:
            check_class_count(self, context)
            return self
        if not context.num_classes:
            # A Dataset with neither .classes nor .targets: its class count is unknown until every label
            # has been read, and soft labels need it now.
            raise ValueError(f"{type(self).__name__} needs the number of classes, and the source does not know "
                             f"it (a Dataset without .classes or .targets): give "
                             f"{type(self).__name__}(..., num_classes=N), or pass "
                             f"fastdata.datasets.DatasetSource(dataset, num_classes=N) to make_loader")
        return dataclasses.replace(self, num_classes=context.num_classes)

    def _targets(self, labels):
        if labels.ndim == 1 and self.num_classes is None:
            raise ValueError(f"{type(self).__name__} needs num_classes to make soft labels: use it in a "
                             f"loader's batch_transforms, a BatchPipeline, or give num_classes=")
        return soft_targets(labels, self.num_classes, self.label_smoothing)


@dataclass(frozen=True)
class MixUp(_Mixing):
    """MixUp (Zhang et al., 2018): ``lam * x + (1 - lam) * x_rolled``, ``lam ~ Beta(alpha, alpha)`` once
    per batch; labels become the same mix of (label-smoothed) one-hot targets.

    Args:
        alpha: the Beta distribution's parameter (0.2 mixes a little, 1.0 uniformly).
        label_smoothing: ε of the one-hot targets before mixing: ``(1 - ε) one_hot + ε / num_classes``.
            Applied where integer labels become soft; soft labels from an earlier transform are mixed
            as they are. One list's targets get one smoothing: every mixing transform in it (a OneOf's
            branches too) gives the same value, else the loader refuses them; a OneOf's unmixed batches
            get it as well.
        num_classes: None (the default) takes the loader's source's.
    """

    alpha: float = 1.0
    label_smoothing: float = 0.0
    num_classes: int | None = None

    def __post_init__(self):
        self._check("MixUp")

    def __call__(self, images, labels, generator):
        targets = self._targets(labels)
        lam = float(host_rng(generator).beta(self.alpha, self.alpha))
        return mix(images, images.roll(1, 0), lam), mix(targets, targets.roll(1, 0), lam)


@dataclass(frozen=True)
class CutMix(_Mixing):
    """CutMix (Yun et al., 2019), as torchvision v2: one box per batch, pasted from the neighbouring
    image (the batch rolled by one); the labels mix by the area actually pasted.

    ``lam ~ Beta(alpha, alpha)``; the box has sides ``sqrt(1 - lam)`` x the image's around a uniform
    center, clipped at the border; the original image's weight is then 1 - (pasted area / image area).

    Args:
        alpha: the Beta distribution's parameter.
        label_smoothing: as MixUp's.
        num_classes: None (the default) takes the loader's source's.
    """

    alpha: float = 1.0
    label_smoothing: float = 0.0
    num_classes: int | None = None

    def __post_init__(self):
        self._check("CutMix")

    def __call__(self, images, labels, generator):
        targets = self._targets(labels)
        h, w = images.shape[-2:]
        if not images.numel():   # an empty batch, maybe (0, C, 0, 0): no box to draw in it
            return images, targets
        rng = host_rng(generator)
        lam = float(rng.beta(self.alpha, self.alpha))
        cx, cy = int(rng.integers(w)), int(rng.integers(h))
        r = 0.5 * math.sqrt(1.0 - lam)
        rw, rh = int(r * w), int(r * h)
        x1, x2, y1, y2 = max(cx - rw, 0), min(cx + rw, w), max(cy - rh, 0), min(cy + rh, h)
        out = images.clone()  # keeps the memory format; the input is never written
        out[:, :, y1:y2, x1:x2] = images[:, :, y1:y2, x1:x2].roll(1, 0)
        kept = 1.0 - (x2 - x1) * (y2 - y1) / (w * h)
        return out, mix(targets, targets.roll(1, 0), kept)

