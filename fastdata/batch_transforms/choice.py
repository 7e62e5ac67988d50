"""OneOf: one of several batch transforms, chosen per batch on the host."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np

from .arguments import agreed_smoothing, check_class_count, set_field
from .base import (
    BatchTransform,
    ImageCallable,
    as_transform,
    child_generator,
    draws_globally,
    global_rngs_seeded,
    host_rng,
)
from .ops import soft_targets
from .validation import check_one


@dataclass(frozen=True)
class OneOf(BatchTransform):
    """Apply one of ``transforms``, chosen per batch (torchvision's RandomChoice): ``OneOf([MixUp(0.8),
    CutMix(1.0)])`` is timm's and torchvision's references' "mixup or cutmix".

    The choice is drawn on the host (no device sync); only the chosen transform runs. If any choice
    makes soft labels, every batch gets soft labels, smoothed by the ``label_smoothing`` its mixing
    branches share (a OneOf whose branches differ is refused): ``OneOf([MixUp(0.8, label_smoothing=0.1),
    lambda x: x], weights=(0.5, 0.5))`` is timm's ``Mixup(prob=0.5, label_smoothing=0.1)``.

    Args:
        transforms: BatchTransforms or plain image callables.
        weights: relative probabilities, one per transform; None → equal.
    """

    transforms: tuple
    weights: tuple | None = None
    num_classes: int | None = None

    def __post_init__(self):
        ts = self.transforms
        if not isinstance(ts, (tuple, list)) or not ts:
            raise ValueError(f"OneOf needs a non-empty list of transforms, got {ts!r}")
        for i, t in enumerate(ts):
            check_one(f"OneOf transforms[{i}]", t)
        set_field(self, "transforms", tuple(ts))
        if self.weights is not None:
            w = self.weights
            if not isinstance(w, (tuple, list)) or len(w) != len(ts) or any(
                    isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0
                    for x in w) or sum(w) <= 0:
                raise ValueError(f"OneOf: weights must be {len(ts)} numbers >= 0 with a positive sum, got {w!r}")
            set_field(self, "weights", tuple(float(x) for x in w))
        agreed_smoothing("OneOf", self.transforms)   # refused now, not at the first batch

    @property
    def label_smoothing(self) -> float:
        """The smoothing its mixing branches share: the targets of the batches it does not mix get it too."""
        return agreed_smoothing("OneOf", self.transforms)

    @property
    def soft_labels(self) -> bool:  # type: ignore[override]
        return any(as_transform(t).soft_labels for t in self.transforms)

    def bind(self, context):
        if self.num_classes is not None:
            check_class_count(self, context)
        return dataclasses.replace(self, transforms=tuple(as_transform(t).bind(context) for t in self.transforms),
                                   num_classes=context.num_classes or self.num_classes)

    def __call__(self, images, labels, generator):
        w = np.asarray(self.weights if self.weights is not None else [1.0] * len(self.transforms))
        k = int(host_rng(generator).choice(len(self.transforms), p=w / w.sum()))
        chosen, g = as_transform(self.transforms[k]), child_generator(generator, k)
        if draws_globally(chosen) and not isinstance(chosen, ImageCallable):
            # A BatchTransform of one's own, seeded as BatchPipeline seeds one at the top level: one
            # drawing from torch.rand() under a OneOf repeated nothing by seed and resumed elsewhere.
            with global_rngs_seeded(images.device, g.initial_seed()):
                images, labels = chosen(images, labels, g)
        else:
            images, labels = chosen(images, labels, g)
        if self.soft_labels and labels.ndim == 1:
            if self.num_classes is None:
                raise ValueError("OneOf needs num_classes to make soft labels: use it in a loader's "
                                 "batch_transforms or a BatchPipeline")
            labels = soft_targets(labels, self.num_classes, self.label_smoothing)
        return images, labels

