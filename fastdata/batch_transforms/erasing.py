"""Erasing batch transforms: Cutout's squares and RandomErasing's rectangles, drawn per sample."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..checks import check_integer
from .arguments import probability, set_field, value_range
from .base import BatchTransform
from .ops import constant, rand


@dataclass(frozen=True)
class Cutout(BatchTransform):
    """Zero ``holes`` squares of ``size`` x ``size`` pixels in each image (DeVries & Taylor, 2017).

    Zero in normalized space is the channel mean. Each square's center is uniform over the image and the
    square is clipped at the border (as the paper's code), so a hole near an edge is smaller.

    Args:
        size: side of each square in pixels.
        holes: squares per image (they may overlap).
        p: probability that an image gets its holes (drawn per sample).
    """

    size: int
    holes: int = 1
    p: float = 1.0

    def __post_init__(self):
        for name in ("size", "holes"):
            set_field(self, name, check_integer(f"Cutout: {name}", getattr(self, name), minimum=1))
        set_field(self, "p", probability("Cutout", "p", self.p))

    def __call__(self, images, labels, generator):
        n, _, h, w = images.shape
        if not images.numel():   # an empty batch, maybe (0, C, 0, 0): nothing to cut, no center to draw
            return images, labels
        dev = images.device
        top = torch.randint(0, h, (n, self.holes), generator=generator, device=dev) - self.size // 2
        left = torch.randint(0, w, (n, self.holes), generator=generator, device=dev) - self.size // 2
        apply = rand(n, generator, dev) < self.p
        ys, xs = torch.arange(h, device=dev), torch.arange(w, device=dev)
        rows = (ys >= top[..., None]) & (ys < top[..., None] + self.size)      # (n, holes, h)
        cols = (xs >= left[..., None]) & (xs < left[..., None] + self.size)    # (n, holes, w)
        mask = (rows[..., :, None] & cols[..., None, :]).any(1) & apply.view(-1, 1, 1)
        return torch.where(mask.unsqueeze(1), 0.0, images), labels


@dataclass(frozen=True)
class RandomErasing(BatchTransform):
    """Erase one random rectangle per image with probability ``p``: torchvision's RandomErasing, drawn
    per sample (torchvision's, given a batch, erases the same box in every image).

    As torchvision: the box's area is ``scale`` x the image's, its aspect ratio log-uniform in
    ``ratio``; up to 10 tries for a box that fits, none erased if none does; the position is uniform.

    Args:
        p: probability that an image is erased.
        scale: (min, max) fraction of the image's area.
        ratio: (min, max) aspect ratio (height / width) of the box.
        value: what the box is filled with, in normalized units: a number (0, the default, is the
            mean), one number per channel, or ``"random"`` (standard-normal noise per pixel, i.e. noise
            of the data's own spread).
    """

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: float | tuple | str = 0.0

    TRIES: ClassVar[int] = 10

    def __post_init__(self):
        set_field(self, "p", probability("RandomErasing", "p", self.p))
        set_field(self, "scale", value_range("RandomErasing", "scale", self.scale, high=1.0))
        set_field(self, "ratio", value_range("RandomErasing", "ratio", self.ratio))
        if self.ratio[0] <= 0:
            raise ValueError(f"RandomErasing: ratio must be > 0, got {self.ratio}")
        v = self.value
        if isinstance(v, str):
            if v != "random":
                raise ValueError(f"RandomErasing: value must be a number, one number per channel or "
                                 f"'random', got {v!r}")
        elif isinstance(v, (tuple, list)) and v and all(isinstance(x, numbers.Real) and not isinstance(x, bool)
                                                         for x in v):
            set_field(self, "value", tuple(float(x) for x in v))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            set_field(self, "value", float(v))
        else:
            raise ValueError(f"RandomErasing: value must be a number, one number per channel or 'random', "
                             f"got {v!r}")

    def __call__(self, images, labels, generator):
        n, c, h, w = images.shape
        dev = images.device
        if isinstance(self.value, tuple) and len(self.value) not in (1, c):
            raise ValueError(f"RandomErasing: value has {len(self.value)} numbers but the batch has {c} "
                             f"channel(s)")
        tries = self.TRIES
        area = torch.empty((n, tries), device=dev).uniform_(*self.scale, generator=generator) * (h * w)
        log_ratio = torch.empty((n, tries), device=dev).uniform_(
            math.log(self.ratio[0]), math.log(self.ratio[1]), generator=generator)
        aspect = log_ratio.exp()
        eh = torch.round(torch.sqrt(area * aspect))   # round half to even, as Python's round()
        ew = torch.round(torch.sqrt(area / aspect))
        fits = (eh < h) & (ew < w)
        # The first try that fits, per sample, without leaving the device.
        first = torch.where(fits, torch.arange(tries, device=dev), tries).amin(1, keepdim=True).clamp_(max=tries - 1)
        eh, ew = eh.gather(1, first).squeeze(1), ew.gather(1, first).squeeze(1)
        apply = (rand(n, generator, dev) < self.p) & fits.any(1)
        top = (rand(n, generator, dev) * (h - eh + 1)).floor_()
        left = (rand(n, generator, dev) * (w - ew + 1)).floor_()
        ys, xs = torch.arange(h, device=dev), torch.arange(w, device=dev)
        rows = (ys >= top[:, None]) & (ys < (top + eh)[:, None])
        cols = (xs >= left[:, None]) & (xs < (left + ew)[:, None])
        mask = (rows[:, :, None] & cols[:, None, :] & apply.view(-1, 1, 1)).unsqueeze(1)
        if self.value == "random":
            noise = torch.randn(images.shape, generator=generator, device=dev, dtype=images.dtype)
            return torch.where(mask, noise, images), labels
        if isinstance(self.value, tuple) and len(self.value) > 1:
            return torch.where(mask, constant(self.value, images, images.dtype), images), labels
        fill = self.value[0] if isinstance(self.value, tuple) else self.value
        return torch.where(mask, fill, images), labels
