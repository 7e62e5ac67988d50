"""Reliability, determinism and sharding, through photos as well as arrays.

Photos that encode their id: each JPEG is one flat colour whose three channels are the id's three
base-6 digits. A flat colour survives JPEG, any crop, any resize and a flip, so ids can be read back
through every backend with the training augmentation on.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import backend_params, label_of
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, SyntheticDigits

LEVELS = 20 + 43 * np.arange(6)          # 20, 63, ..., 235: JPEG's error on a flat colour is ~1-2
N_IDS = 60
CLASSES = 10                               # label_of(id) = (7 id + 3) % 10
PLAIN = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def memory_only(backend: str, **options) -> dict:
    """The memory backend's own options (cache_size) for it, nothing for the others, which refuse them."""
    return options if backend == "memory" else {}
TRAIN_AUG = Augmentation(crop="random_resized", size=16, hflip=0.5)
EVAL_AUG = Augmentation(crop="center", size=16, resize=16)


def colour_of(i: int) -> tuple[int, int, int]:
    return tuple(int(LEVELS[(i // 6 ** k) % 6]) for k in range(3))


def ids_of(images: torch.Tensor) -> np.ndarray:
    """Read ids back from PLAIN-normalized batches (pixel / 255)."""
    mean = images.float().mean(dim=(2, 3)).cpu().numpy() * 255       # (N, 3)
    digits = np.abs(mean[:, :, None] - LEVELS[None, None, :]).argmin(-1)
    assert np.abs(mean - LEVELS[digits]).max() < 8, "a colour is not near any level"
    return digits[:, 0] + 6 * digits[:, 1] + 36 * digits[:, 2]


@pytest.fixture(scope="module")
def id_folder(tmp_path_factory):
    """N_IDS small JPEGs, id i in class folder label_of(i); sizes vary as in a real folder."""
    root = tmp_path_factory.mktemp("ids")
    rng = np.random.default_rng(0)
    for i in range(N_IDS):
        d = root / f"class_{int(label_of(i)):02d}"
        d.mkdir(exist_ok=True)
        h, w = int(rng.integers(20, 40)), int(rng.integers(20, 40))
        Image.fromarray(np.full((h, w, 3), colour_of(i), np.uint8)).save(d / f"id_{i:04d}.jpg", quality=90)
    return root


def read_all(loader):
    """[(ids, labels)] per batch of one epoch."""
    return [(ids_of(x), y.cpu().numpy()) for x, y in loader]


# ------------------------------------------------------------ ids and labels survive every backend
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("backend", backend_params())
def test_ids_and_labels_survive_every_backend_shuffled_and_augmented(backend, train, id_folder):
    src = ImageFolder(id_folder)
    assert len(src) == N_IDS and len(src.classes) == CLASSES
    loader = make_loader(src, backend, batch_size=8, device="cpu", num_workers=2, train=train,
                         shuffle=True, drop_last=False, augment=TRAIN_AUG if train else EVAL_AUG,
                         seed=7, **memory_only(backend, cache_size=16), **PLAIN)
    for epoch in range(2):   # the second epoch of memory reads its cache
        batches = read_all(loader)
        assert len(batches) == len(loader)
        ids = np.concatenate([i for i, _ in batches])
        labels = np.concatenate([y for _, y in batches])
        np.testing.assert_array_equal(np.sort(ids), np.arange(N_IDS))   # all, no duplicates
        np.testing.assert_array_equal(labels, label_of(ids))            # every label is f(id)
        assert not np.array_equal(ids, np.sort(ids)), "shuffle=True must shuffle"


# --------------------------------------------------------------- shards: disjoint, covering, equal
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("backend", backend_params())
def test_image_folder_shards_are_disjoint_covering_and_equal(backend, world, drop_last, id_folder):
    src = ImageFolder(id_folder)
    per_rank = []
    for rank in range(world):
        loader = make_loader(src, backend, batch_size=7, device="cpu", num_workers=0, train=True,
                             augment=TRAIN_AUG, drop_last=drop_last, rank=rank, world_size=world,
                             seed=3, **memory_only(backend, cache_size=16), **PLAIN)
        batches = read_all(loader)
        assert len(batches) == len(loader), "len(loader) must equal the batches yielded"
        for ids, labels in batches:
            np.testing.assert_array_equal(labels, label_of(ids))
        per_rank.append([ids for ids, _ in batches])
    assert len({len(b) for b in per_rank}) == 1, "every rank must run the same number of steps"
    ids = np.concatenate([np.concatenate(b) for b in per_rank])
    assert len(ids) == len(set(ids.tolist())), "shards overlap"
    if drop_last:
        assert len(ids) == (N_IDS // (7 * world)) * 7 * world
        assert all(len(b) == 7 for r in per_rank for b in r)
    else:
        np.testing.assert_array_equal(np.sort(ids), np.arange(N_IDS))


# -------------------------------------------------------------------------- same seed, same pixels
@pytest.mark.parametrize("backend", backend_params())
def test_same_seed_same_pixels_with_training_augmentation(backend, photo_folder):
    src = ImageFolder(photo_folder)
    kw = dict(batch_size=6, device="cpu", num_workers=2, train=True, seed=11,
              augment=Augmentation.imagenet_train(size=48), **memory_only(backend, cache_size=64))

    def two_epochs():
        loader = make_loader(src, backend, **kw)
        return [[(x.clone(), y.clone()) for x, y in loader] for _ in range(2)]

    a, b = two_epochs(), two_epochs()
    for ea, eb in zip(a, b):
        assert len(ea) == len(eb) == 3
        for (xa, ya), (xb, yb) in zip(ea, eb):
            assert torch.equal(ya, yb)
            assert torch.equal(xa, xb), f"{backend}: same seed, different pixels"
    # the augmentation is really random: epoch 1 is not epoch 0 again
    assert not all(torch.equal(x0, x1) for (x0, _), (x1, _) in zip(a[0], a[1]))
    other = make_loader(src, backend, **{**kw, "seed": 12})
    assert not torch.equal(next(iter(other))[0], a[0][0][0]), "another seed must give other crops"


@pytest.mark.parametrize("backend", backend_params())
def test_same_seed_same_order_and_epochs_differ(backend, id_folder):
    src = ImageFolder(id_folder)
    kw = dict(batch_size=10, device="cpu", num_workers=2, train=True, augment=TRAIN_AUG, seed=5,
              **memory_only(backend, cache_size=16), **PLAIN)
    a, b = make_loader(src, backend, **kw), make_loader(src, backend, **kw)
    a0, a1 = np.concatenate([i for i, _ in read_all(a)]), np.concatenate([i for i, _ in read_all(a)])
    b0 = np.concatenate([i for i, _ in read_all(b)])
    np.testing.assert_array_equal(a0, b0)
    assert not np.array_equal(a0, a1), "a new epoch must be a new order"


@pytest.mark.parametrize("backend", backend_params())
def test_digits_with_translation_are_reproducible(backend):
    src = SyntheticDigits(600, seed=3)
    kw = dict(batch_size=100, device="cpu", num_workers=2, train=True, seed=9)
    runs = [[x for x, _ in make_loader(src, backend, **kw)] for _ in range(2)]
    assert len(runs[0]) == 6
    for xa, xb in zip(*runs):
        assert torch.equal(xa, xb), backend


# ------------------------------------------------------- the CIFAR recipe: same pixels on every backend
CIFAR_AUG = Augmentation.cifar_train(pad=4)       # reflect padding, random crop, flip half the time


@pytest.mark.parametrize("backend", backend_params())
def test_cifar_recipe_gives_every_backend_the_torch_backends_pixels(backend):
    """cifar_train on CIFAR-like arrays: for one seed, every backend yields the torch backend's pixels
    (reflect-padded shifts and flips drawn once, by draw_params), run after run, and epochs differ."""
    from fastdata.datasets import ArraySource

    images = np.random.default_rng(8).integers(1, 256, (240, 14, 12, 3), dtype=np.uint8)   # no 0
    src = ArraySource(images, label_of(np.arange(240)), **PLAIN)
    kw = dict(batch_size=48, device="cpu", train=True, seed=13, augment=CIFAR_AUG)

    def two_epochs(name, workers):
        loader = make_loader(src, name, num_workers=workers, **kw, **memory_only(name, cache_size=16))
        return [torch.cat([x.clone() for x, _ in loader]) for _ in range(2)]

    ref = two_epochs("torch", 0)
    got, again = two_epochs(backend, 2), two_epochs(backend, 2)
    for epoch in range(2):
        assert torch.equal(got[epoch], again[epoch]), f"{backend}: same seed, different pixels"
        assert got[epoch].shape == (240, 3, 14, 12)
        # Reflection never shifts black in (the images hold no 0); zero padding would, at ±4 px.
        assert not (got[epoch] == 0).any(), f"{backend}: zeros at the border: not reflect padding"
        torch.testing.assert_close(got[epoch], ref[epoch], rtol=0, atol=1e-6,
                                   msg=lambda m: f"{backend} differs from the torch backend: {m}")
    assert not torch.equal(got[0], got[1]), "epoch 1 must shift and flip differently from epoch 0"
