"""Colour batch transforms on normalized batches: ColorJitter and RandomGrayscale un-normalize with the
loader's mean/std, apply torchvision's operation per sample and normalize again."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from .arguments import mean_std, probability, set_field, value_range, with_stats
from .base import BatchTransform
from .ops import gray, rand, shift_hue, unnormalize


def _jitter_range(name: str, value) -> tuple[float, float] | None:
    """torchvision's ColorJitter argument: a number v → (max(0, 1 - v), 1 + v), or (min, max); the
    identity range (1, 1) → None (the op is skipped, as torchvision does)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        v = float(value)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"ColorJitter: {name} must be >= 0 or a (min, max) pair, got {value!r}")
        lo, hi = max(0.0, 1.0 - v), 1.0 + v
    elif value is None:
        return None
    else:
        lo, hi = value_range("ColorJitter", name, value)
    return None if lo == hi == 1.0 else (lo, hi)


def _hue_range(value) -> tuple[float, float] | None:
    """torchvision's hue argument: h in [0, 0.5] → (-h, h), or (min, max) inside [-0.5, 0.5]; the
    identity (0, None, (0, 0)) → None (skipped, as torchvision does)."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        h = float(value)
        if not (math.isfinite(h) and 0 <= h <= 0.5):
            raise ValueError(f"ColorJitter: hue must be in [0, 0.5] or a (min, max) pair inside [-0.5, 0.5] "
                             f"(a fraction of the hue circle, as torchvision's), got {value!r}")
        lo, hi = -h, h
    else:
        lo, hi = value_range("ColorJitter", "hue", value, low=-0.5, high=0.5)
    return None if lo == hi == 0.0 else (lo, hi)


@dataclass(frozen=True)
class ColorJitter(BatchTransform):
    """torchvision's ColorJitter (brightness, contrast, saturation, hue), per sample, on normalized batches.

    The images are un-normalized with the loader's mean/std to [0, 1] pixels, jittered exactly as
    torchvision's functional ops do (each clamps to [0, 1]), and normalized again, in float32. Each
    image draws its own factors and its own order of the operations (torchvision draws a random order
    too). The arguments are torchvision's, in its order: ``ColorJitter(0.4, 0.4, 0.4, 0.1)`` ports as
    it is.

    Args:
        brightness, contrast, saturation: v ≥ 0 draws the factor from [max(0, 1 - v), 1 + v]; a
            (min, max) pair gives the range; 0 or (1, 1) leaves the property alone.
        hue: h in [0, 0.5] draws the shift from [-h, h] (a fraction of the hue circle, torchvision's
            ``adjust_hue``: an HSV round trip per pixel); a (min, max) pair inside [-0.5, 0.5] gives
            the range; 0 or None leaves the hue alone. On a grey batch it does nothing, as
            torchvision's. It costs most of the transform: every slot of the random order computes the
            shifted batch (picking per image has no sync-free way to compute only the images it
            concerns).
        mean, std: keyword-only; the batches' normalization; None (the default) takes the loader's.
            Give them only to use the transform outside a loader (in one, others than the loader's
            are refused: the batches are normalized with the loader's).
    """

    brightness: float | tuple = 0.0
    contrast: float | tuple = 0.0
    saturation: float | tuple = 0.0
    hue: float | tuple | None = None
    mean: tuple | None = field(default=None, kw_only=True)
    std: tuple | None = field(default=None, kw_only=True)

    def __post_init__(self):
        set_field(self, "hue", _hue_range(self.hue))
        for name in ("brightness", "contrast", "saturation"):
            set_field(self, name, _jitter_range(name, getattr(self, name)))
        mean, std = mean_std("ColorJitter", self.mean, self.std)
        set_field(self, "mean", mean)
        set_field(self, "std", std)

    def bind(self, context):
        return with_stats(self, context) if self._ops() else self

    def _ops(self):
        return [(k, r) for k, r in enumerate((self.brightness, self.contrast, self.saturation, self.hue))
                if r is not None]

    def __call__(self, images, labels, generator):
        n, c = images.shape[:2]
        dev = images.device
        # Saturation and hue of a one-channel image are the image itself (torchvision returns it unchanged).
        ops = [k for k, _ in self._ops() if not (k in (2, 3) and c == 1)]
        if not ops:
            return images, labels
        if c not in (1, 3) and (1 in ops or 2 in ops or 3 in ops):
            # torchvision refuses them too: a grey level of RGBA or multispectral images is not defined
            raise ValueError(f"ColorJitter: contrast, saturation and hue take RGB (3-channel) or grey batches, "
                             f"got {c} channels (brightness alone takes any)")
        if self.mean is None:
            raise ValueError("ColorJitter needs the batches' mean/std: use it in a loader's batch_transforms, "
                             "a BatchPipeline(..., mean=, std=), or give ColorJitter(..., mean=, std=)")
        # The same draws whatever is enabled (an order key and a factor per operation), so turning one
        # operation on does not change the others' factors. Hue's come after, only with a hue: the
        # draws of a jitter without one are those of the releases that had no hue.
        keys, u = rand(n, generator, dev, 3), rand(n, generator, dev, 3)
        if self.hue is not None:
            keys, u = torch.cat([keys, rand(n, generator, dev, 1)], 1), torch.cat([u, rand(n, generator, dev, 1)], 1)
        ranges = (self.brightness, self.contrast, self.saturation, self.hue)
        x, m, s = unnormalize(self, images)
        # Every operation is torchvision's blend, clamp(f * x + (1 - f) * target, 0, 1), with target 0
        # (brightness), the image's mean grey level (contrast) or its grey image (saturation). So each
        # of the k slots of the per-image random order is one pass over the batch with per-image
        # weights, whichever operation each image does there: no per-image loop, and no operation
        # computed for images that do not do it. (Columns are picked by basic indexing: a list index
        # would upload the list to the device, a blocking copy.) The hue shift is no blend: its images
        # take weight 1 on themselves there, and the shifted batch in their slot.
        f = torch.stack([u[:, k] * (ranges[k][1] - ranges[k][0]) + ranges[k][0] for k in ops], 1)
        hue = ops.index(3) if 3 in ops else None
        if hue is not None:
            shift = f[:, hue].clone()
            f[:, hue] = 1.0
        zero = torch.zeros_like(f[:, 0])
        to_grey = torch.stack([1 - f[:, j] if k == 2 else zero for j, k in enumerate(ops)], 1)
        to_mean = torch.stack([1 - f[:, j] if k == 1 else zero for j, k in enumerate(ops)], 1)
        order = torch.stack([keys[:, k] for k in ops], 1).argsort(1)
        for slot in range(len(ops)):
            pick = order[:, slot:slot + 1]
            out = x * f.gather(1, pick).view(-1, 1, 1, 1)
            if 1 in ops or 2 in ops:
                grey = gray(x) if c == 3 else x
                if 2 in ops:
                    out.add_(grey * to_grey.gather(1, pick).view(-1, 1, 1, 1))
                if 1 in ops:
                    out.add_(grey.mean(dim=(1, 2, 3), keepdim=True) * to_mean.gather(1, pick).view(-1, 1, 1, 1))
            if hue is not None:
                out = torch.where((pick == hue).view(-1, 1, 1, 1), shift_hue(x, shift), out)
            x = out.clamp_(0, 1)
        return x.sub_(m).div_(s).to(images.dtype), labels


@dataclass(frozen=True)
class RandomGrayscale(BatchTransform):
    """Turn each RGB image grey with probability ``p`` (drawn per sample), keeping 3 channels.

    Un-normalizes with the loader's mean/std, takes torchvision's luminance (0.2989 R + 0.587 G +
    0.114 B) and normalizes each channel again with its own statistics. One-channel batches pass as
    they are.

    Args:
        p: probability that an image turns grey.
        mean, std: the batches' normalization; None (the default) takes the loader's (others than
            the loader's are refused).
    """

    p: float = 0.1
    mean: tuple | None = None
    std: tuple | None = None

    def __post_init__(self):
        set_field(self, "p", probability("RandomGrayscale", "p", self.p))
        mean, std = mean_std("RandomGrayscale", self.mean, self.std)
        set_field(self, "mean", mean)
        set_field(self, "std", std)

    def bind(self, context):
        return with_stats(self, context)

    def __call__(self, images, labels, generator):
        n, c = images.shape[:2]
        pick = rand(n, generator, images.device) < self.p
        if c == 1:
            return images, labels
        if c != 3:
            raise ValueError(f"RandomGrayscale needs RGB (3-channel) or grey batches, got {c} channels")
        if self.mean is None:
            raise ValueError("RandomGrayscale needs the batches' mean/std: use it in a loader's "
                             "batch_transforms, a BatchPipeline(..., mean=, std=), or give mean=/std=")
        x, m, s = unnormalize(self, images)
        grey = gray(x).sub(m).div_(s).to(images.dtype)   # (N, 1, H, W) - (1, 3, 1, 1) → (N, 3, H, W)
        return torch.where(pick.view(-1, 1, 1, 1), grey, images), labels
