"""Empty batches keep the loader's shape on every backend: with drop_last=False under several ranks, a
rank's share of a short last step can be 0 samples, and that batch must be (0, C, H, W) like every other
batch of the loader (a batch transform, a model's forward or an all-gather of every rank's batch needs it),
not (0, C, 0, 0)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import backend_params
from fastdata import Augmentation, make_loader
from fastdata.batch_transforms import Cutout
from fastdata.datasets import ArraySource, ImageFolder

H, W = 8, 6


class _Photos(torch.utils.data.Dataset):
    """A Dataset of RGB PIL photos (the torch/prefetch backends' own kind of source)."""

    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.images = [Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)) for _ in range(n)]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i % 2


def _arrays(n):
    return ArraySource(np.random.default_rng(0).integers(0, 256, (n, H, W, 3), dtype=np.uint8), np.arange(n) % 2)


def _folder(n, root):
    for i in range(n):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (W + i, H + i), (20 * i, 0, 0)).save(root / f"c{i % 2}" / f"{i}.png")
    return ImageFolder(root)


SOURCES = {
    "dataset": (_Photos, None, (3, H, W)),
    "arrays": (_arrays, None, (3, H, W)),
    "folder": (_folder, Augmentation(crop="center", size=4, resize=4), (3, 4, 4)),
}


def _shapes(kind, backend, n, rank, tmp_path, **kw):
    make, augment, _ = SOURCES[kind]
    src = make(n, tmp_path) if kind == "folder" else make(n)
    loader = make_loader(src, backend, batch_size=2, rank=rank, world_size=4, train=False, drop_last=False,
                         device="cpu", num_workers=0, augment=augment, quiet=True, **kw)
    return [(tuple(x.shape), tuple(y.shape)) for x, y in loader]


def _reads(backend, kind) -> bool:
    return kind == "dataset" and backend in ("memory", "dali")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_ranks_empty_last_batch_has_the_loaders_shape(backend, kind, tmp_path):
    """9 samples, batch_size 2, 4 ranks: rank 1's second batch is empty, after a full one."""
    if _reads(backend, kind):
        pytest.skip(f"{backend} does not read a torch Dataset")
    c, h, w = SOURCES[kind][2]
    shapes = _shapes(kind, backend, 9, 1, tmp_path, batch_transforms=[Cutout(2)])
    assert shapes == [((2, c, h, w), (2,)), ((0, c, h, w), (0,))], shapes


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_rank_whose_only_batch_is_empty_has_the_loaders_shape(backend, kind, tmp_path):
    """3 samples, batch_size 2, 4 ranks: rank 3's one batch is empty, before any batch showed the size.

    Needs the loader to tell its Normalizer the output size (``normalizer.size =
    augment.output_size(source, augment)`` in ``Loader.__init__``)."""
    if _reads(backend, kind):
        pytest.skip(f"{backend} does not read a torch Dataset")
    c, h, w = SOURCES[kind][2]
    shapes = _shapes(kind, backend, 3, 3, tmp_path, batch_transforms=[Cutout(2)])
    assert shapes == [((0, c, h, w), (0,))], shapes
