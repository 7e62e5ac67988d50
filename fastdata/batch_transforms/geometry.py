"""Geometric batch transforms: per-sample flips."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .arguments import probability, set_field
from .base import BatchTransform
from .ops import rand


@dataclass(frozen=True)
class _RandomFlip(BatchTransform):
    """Flip each image along ``_DIM`` with probability ``p`` (drawn per sample)."""

    p: float = 0.5
    _DIM: ClassVar[int] = -1

    def __post_init__(self):
        set_field(self, "p", probability(type(self).__name__, "p", self.p))

    def __call__(self, images, labels, generator):
        flip = rand(images.shape[0], generator, images.device) < self.p
        return torch.where(flip.view(-1, 1, 1, 1), images.flip(self._DIM), images), labels


@dataclass(frozen=True)
class RandomHorizontalFlip(_RandomFlip):
    """Flip each image left-right with probability ``p`` (drawn per sample).

    Args:
        p: probability of a flip.
    """

    _DIM: ClassVar[int] = -1


@dataclass(frozen=True)
class RandomVerticalFlip(_RandomFlip):
    """Flip each image upside down with probability ``p`` (drawn per sample).

    Args:
        p: probability of a flip.
    """

    _DIM: ClassVar[int] = -2

