"""Shared test data: every test makes its own, nothing is downloaded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdata import available_backends
from fastdata.datasets import ArraySource, make_image_folder

BACKENDS = [b for b in available_backends()]
CONCRETE = [b for b in BACKENDS if b != "auto"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]

MEAN, STD = (0.5,), (0.25,)


def label_of(ids):
    """The label written for sample id i: any fixed function works; this one is not the identity."""
    return (np.asarray(ids) * 7 + 3) % 10


def indexed_source(n: int = 1000, size: int = 8, channels: int = 1) -> ArraySource:
    """Samples whose pixels encode their id: pixel (0,0) = id % 256, (0,1) = id // 256, then a
    gradient that is the same for all. Labels are label_of(id)."""
    assert n < 65536
    ids = np.arange(n)
    images = np.tile(np.linspace(40, 200, size * size, dtype=np.uint8).reshape(size, size, 1),
                     (n, 1, 1, channels))
    images[:, 0, 0, :] = (ids % 256)[:, None]
    images[:, 0, 1, :] = (ids // 256)[:, None]
    return ArraySource(images, label_of(ids), mean=MEAN * channels, std=STD * channels, name="indexed")


def decode_ids(images: torch.Tensor, mean=MEAN[0], std=STD[0]) -> np.ndarray:
    """Invert the normalization of indexed_source batches and read the ids back."""
    x = images.float().cpu()[:, 0, 0, :2] * std + mean
    px = torch.round(x * 255).long().numpy()
    return px[:, 0] + 256 * px[:, 1]


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory):
    """A small ImageNet-like JPEG folder: 3 classes x 6 photos of ~450x350 px."""
    return make_image_folder(tmp_path_factory.mktemp("photos"), classes=3, per_class=6, seed=1)
