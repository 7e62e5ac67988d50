"""No backend synchronizes the host with the GPU while it hands out batches (CUDA only).

A synchronizing call in the per-batch path (a pageable host→device copy, ``.item()``, ``.tolist()``,
``torch.cuda.synchronize``, a blocking event wait) makes the host wait for the training step queued
before it: Python stops running ahead of the GPU and kernel launches stop overlapping the work. Under
``torch.cuda.set_sync_debug_mode("error")`` torch raises on every such call, so one epoch of every
backend and recipe, run with the mode on while a slow kernel keeps the GPU busy, proves the path clean.

Loader construction is left out (it may upload a cache or build a pipeline once); the epoch, its
start included, is in.
"""
from __future__ import annotations

import pytest
import torch

from conftest import backend_params, indexed_source, sync_debug_error
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder

RECIPES = {
    "arrays-none": ("arrays", Augmentation.none()),
    "digits-translate": ("arrays", Augmentation.digits_train()),
    "arrays-translate-flip": ("arrays", Augmentation(crop="translate", pad=2, hflip=0.5)),
    "photos-random-resized": ("photos", Augmentation.imagenet_train(size=64)),
    "photos-center": ("photos", Augmentation.imagenet_eval(size=64, resize=72)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("backend", backend_params())
def test_an_epoch_makes_no_synchronizing_call(backend, recipe, photo_folder):
    kind, aug = RECIPES[recipe]
    src = indexed_source(2048, size=28, channels=3) if kind == "arrays" else ImageFolder(photo_folder)
    batch = 128 if kind == "arrays" else 4
    loader = make_loader(src, backend, batch_size=batch, device="cuda", augment=aug, num_workers=2,
                         drop_last=False, train=False, **({"cache_size": 72} if backend == "memory" else {}))
    torch.cuda.synchronize()
    seen = 0
    with sync_debug_error():
        for x, y in loader:
            torch.cuda._sleep(2_000_000)  # a "training step": the GPU stays busy while the host goes on
            assert x.is_cuda and y.is_cuda and x.shape[0] == y.shape[0]
            seen += x.shape[0]
    torch.cuda.synchronize()
    assert seen == len(src)
    loader.close()
