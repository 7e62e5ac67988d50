"""Reliability, endurance: epochs with persistent workers leak nothing.

Memory (RSS), open file descriptors and threads of the main process and its workers, read from /proc,
must stay flat after the first epoch (which pays for warm-up: worker start, allocator pools, DALI's
pipeline). A leak of one batch per epoch, one pipe per epoch or one thread per epoch shows up here.
"""
from __future__ import annotations

import gc

import pytest
import torch

from conftest import DEVICES, backend_params, indexed_source
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, make_image_folder
from procs import usage


@pytest.fixture(scope="module")
def endurance_photos(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("endure"), classes=2, per_class=24, seed=5,
                             size_range=((90, 120), (70, 100)))


def run_epochs(loader, epochs, device):
    """Usage after each epoch (and the device's allocated bytes)."""
    out = []
    for _ in range(epochs):
        total = 0.0
        for x, y in loader:
            total += float(x[:, :, 0, 0].sum())  # touch the batch like a consumer would
        gc.collect()
        u = usage()
        u["device"] = torch.cuda.memory_allocated(device) if device == "cuda" else 0
        out.append(u)
    return out


def assert_flat(history, what):
    first, last = history[0], history[-1]
    for key in ("rss", "fds", "threads", "procs", "device"):
        a, b = first[key], last[key]
        # 5% after the first epoch; fds/threads/procs are small integers: allow no growth beyond that
        limit = a * 1.05 if key in ("rss", "device") else a + max(1, int(a * 0.05))
        assert b <= limit, f"{what}: {key} grew from {a} to {b} after the first epoch ({history})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", backend_params())
def test_array_epochs_are_flat(backend, device):
    src = indexed_source(6000, size=28)
    loader = make_loader(src, backend, batch_size=100, device=device, num_workers=2, seed=1,
                         persistent_workers=True) if backend in ("torch", "prefetch") else \
        make_loader(src, backend, batch_size=100, device=device, num_workers=2, seed=1)
    history = run_epochs(loader, 4, device)
    assert history[0]["procs"] == (3 if backend in ("torch", "prefetch") else 1), history[0]
    assert_flat(history, f"{backend} arrays")
    loader.close()


@pytest.mark.parametrize("backend", backend_params())
def test_photo_epochs_are_flat(backend, endurance_photos):
    src = ImageFolder(endurance_photos)
    kw = dict(batch_size=8, device="cpu", num_workers=2, seed=1, augment=Augmentation.imagenet_train(size=64))
    if backend == "memory":
        kw["cache_size"] = 72   # a memory option
    if backend in ("torch", "prefetch"):
        kw["persistent_workers"] = True
    loader = make_loader(src, backend, **kw)
    history = run_epochs(loader, 4, "cpu")
    assert_flat(history, f"{backend} photos")
    loader.close()
