"""memory backend: identical digits to the torch backend, exact evaluation crops from the photo cache."""
import numpy as np
import pytest
import torch

from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, SyntheticDigits


def test_digit_batches_equal_the_torch_backends():
    # Same per-batch seeds and the same numpy draws: translation is bit-identical across the backends.
    src = SyntheticDigits(1200, seed=4)
    a = make_loader(src, "torch", batch_size=100, device="cpu", num_workers=0, seed=9)
    b = make_loader(src, "memory", batch_size=100, device="cpu", seed=9)
    for epoch in range(2):
        for (xa, ya), (xb, yb) in zip(a, b):
            torch.testing.assert_close(xa, xb, rtol=0, atol=1e-6)
            assert torch.equal(ya, yb)


def test_photo_cache_is_uint8_at_cache_size(photo_folder):
    loader = make_loader(ImageFolder(photo_folder), "memory", batch_size=6, device="cpu", cache_size=128,
                         augment=Augmentation.imagenet_train(size=96))
    assert loader.cache.dtype == torch.uint8 and loader.cache.shape == (18, 128, 128, 3)
    x, _ = next(iter(loader))
    assert x.shape == (6, 3, 96, 96)


def test_eval_crop_from_cache_matches_torchvision(photo_folder):
    from PIL import Image
    from torchvision import transforms as T

    src = ImageFolder(photo_folder)
    x = torch.cat([x for x, _ in make_loader(src, "memory", batch_size=6, train=False, device="cpu")])
    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(src.mean, src.std)])
    ref = torch.stack([tf(Image.open(p).convert("RGB")) for p in src.paths])
    assert (x - ref).abs().mean() < 0.03


def test_hflip_on_the_device_mirrors_exactly():
    src = SyntheticDigits(100, seed=1)
    flip = Augmentation(hflip=1.0)
    a = torch.cat([x for x, _ in make_loader(src, "memory", batch_size=50, train=False, augment=flip)])
    b = torch.cat([x for x, _ in make_loader(src, "memory", batch_size=50, train=False)])
    torch.testing.assert_close(a, b.flip(3))


@pytest.mark.cuda
def test_cache_lives_on_the_gpu(photo_folder):
    # Digits take the pre-normalized path (cache is None, ready holds them); photos the uint8 cache.
    digits = make_loader(SyntheticDigits(1000), "memory", batch_size=100, device="cuda")
    assert digits.cache is None and digits.ready.is_cuda
    photos = make_loader(ImageFolder(photo_folder), "memory", batch_size=6, device="cuda", cache_size=128,
                         num_workers=0, augment=Augmentation.imagenet_train(size=96))
    assert photos.cache.is_cuda and photos.cache.dtype == torch.uint8
    for loader in (digits, photos):
        x, y = next(iter(loader))
        assert x.is_cuda and y.is_cuda


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["ready", "uint8"])
def test_gpu_digit_batches_are_bit_identical_to_the_cpu_path(path, monkeypatch):
    from fastdata.backends import memory

    src = SyntheticDigits(1000, seed=3)
    cpu = make_loader(src, "memory", batch_size=100, device="cpu", seed=5)
    if path == "uint8":  # the normalized cache does not fit: the uint8 take + normalize path runs on the GPU
        monkeypatch.setattr(memory, "ready_bytes", lambda *a: 2**62)
    gpu = make_loader(src, "memory", batch_size=100, device="cuda", seed=5)
    assert (gpu.ready is None) == (path == "uint8")
    for epoch in range(2):
        for (xc, yc), (xg, yg) in zip(cpu, gpu):
            assert torch.equal(xc, xg.cpu()) and torch.equal(yc, yg.cpu())


@pytest.mark.cuda
def test_gpu_memory_stays_flat_over_epochs_and_after_a_break(photo_folder):
    for loader in (make_loader(SyntheticDigits(2000), "memory", batch_size=100, device="cuda"),
                   make_loader(ImageFolder(photo_folder), "memory", batch_size=6, device="cuda",
                               cache_size=128, num_workers=0, augment=Augmentation.imagenet_train(size=96))):
        for x, _ in loader:  # warm the caching allocator
            pass
        del x
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for epoch in range(3):
            for x, _ in loader:
                x.sum()
            del x
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == base
        for i, (x, _) in enumerate(loader):
            if i == 1:
                break
        del x
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base


def test_uint8_path_when_the_normalized_cache_does_not_fit(monkeypatch):
    """Digits are cached normalized when that fits; otherwise as uint8 (4x smaller) with the same output."""
    from fastdata.backends import memory

    src = SyntheticDigits(1000, seed=5)
    ready = make_loader(src, "memory", batch_size=100, device="cpu", seed=1)
    assert ready.ready is not None and ready.ready.dtype == torch.float32
    uint8_bytes = memory.cache_bytes(src, ready.config)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(uint8_bytes * 3))  # ready needs 4x
    small = make_loader(src, "memory", batch_size=100, device="cpu", seed=1)
    assert small.ready is None and small.cache.dtype == torch.uint8
    ref = make_loader(src, "torch", batch_size=100, device="cpu", seed=1, num_workers=0)
    for (a, ya), (b, yb), (c, yc) in zip(ready, small, ref):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)
        torch.testing.assert_close(b, c, rtol=0, atol=1e-6)
        assert torch.equal(ya, yc) and torch.equal(yb, yc)


class _CopySpy:
    """Counts host→device uploads: torch.from_numpy / as_tensor / tensor, and .to() given a device."""

    def __init__(self, monkeypatch):
        self.calls = []
        to = torch.Tensor.to

        def spy_to(t, *args, **kwargs):
            if "device" in kwargs or "non_blocking" in kwargs or any(isinstance(a, (str, torch.device))
                                                                        for a in args):
                self.calls.append(("to", args))
            return to(t, *args, **kwargs)

        def counting(name, fn):
            def wrapper(*args, **kwargs):
                self.calls.append((name,))
                return fn(*args, **kwargs)
            return wrapper

        monkeypatch.setattr(torch.Tensor, "to", spy_to)
        for name in ("from_numpy", "as_tensor", "tensor"):
            monkeypatch.setattr(torch, name, counting(name, getattr(torch, name)))


@pytest.mark.parametrize("case", ["ready", "uint8", "photos"])
def test_the_per_batch_path_uploads_nothing(case, monkeypatch, photo_folder):
    """Issue 9.2: a batch's ids and augmentation are uploaded once per epoch; batches are device ops on
    slices. A per-batch torch.from_numpy(...).to(device) (a pageable copy: a host sync on CUDA) fails this."""
    from fastdata.backends import memory

    if case == "photos":
        loader = make_loader(ImageFolder(photo_folder), "memory", batch_size=3, device="cpu", cache_size=64,
                             num_workers=0, augment=Augmentation.imagenet_train(size=32))
    else:
        if case == "uint8":
            monkeypatch.setattr(memory, "ready_bytes", lambda *a: 2**62)
        loader = make_loader(SyntheticDigits(600, seed=2), "memory", batch_size=50, device="cpu",
                             augment=Augmentation(crop="translate", pad=2, hflip=0.5))
        assert (loader.ready is None) == (case == "uint8")
    it = iter(loader)
    next(it)                    # the epoch is prepared (its one upload per kind) with the first batch
    spy = _CopySpy(monkeypatch)
    rest = list(it)
    monkeypatch.undo()
    assert len(rest) == len(loader) - 1
    assert spy.calls == [], f"per-batch uploads: {spy.calls[:5]}"


def test_prepared_epoch_gives_the_same_batches_as_the_torch_backend():
    # The epoch-wide draws keep each batch's rng and order: bit-identical to the torch backend, with flips.
    from conftest import indexed_source

    src = indexed_source(700)
    aug = Augmentation(crop="translate", pad=2, hflip=0.5)
    a = make_loader(src, "torch", batch_size=64, device="cpu", num_workers=0, seed=4, augment=aug,
                    drop_last=False)
    b = make_loader(src, "memory", batch_size=64, device="cpu", seed=4, augment=aug, drop_last=False)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ------------------------------------------------------------------ empty shares (issue 10.6)
@pytest.mark.parametrize("backend", ["memory", "torch", "prefetch"])
@pytest.mark.parametrize("train", [True, False])
def test_an_empty_last_share_is_an_empty_batch(backend, train, photo_folder, monkeypatch):
    """drop_last=False with fewer samples left than ranks: some ranks' last batch is empty, not a crash."""
    from conftest import decode_ids, indexed_source
    from fastdata.backends import memory

    arrays = indexed_source(7)                           # 7 = 3 ranks x 2 + 1: ranks 1, 2 get nothing
    for uint8 in (False, True):
        if uint8:
            monkeypatch.setattr(memory, "ready_bytes", lambda *a: 2**62)
        seen = []
        for rank in range(3):
            loader = make_loader(arrays, backend, batch_size=2, rank=rank, world_size=3, drop_last=False,
                                 train=train, device="cpu", num_workers=0)
            sizes = [len(y) for x, y in loader]
            assert sizes == [2, 1 if rank == 0 else 0]
            seen += [decode_ids(x) for x, _ in loader]
        assert sorted(np.concatenate(seen)) == list(range(7))
    monkeypatch.undo()
    photos = ImageFolder(photo_folder)                   # 18 = 4 ranks x 4 + 2: ranks 2, 3 get nothing
    aug = Augmentation.imagenet_train(size=32) if train else Augmentation.imagenet_eval(size=32, resize=40)
    total = 0
    for rank in range(4):
        loader = make_loader(photos, backend, batch_size=4, rank=rank, world_size=4, drop_last=False,
                             train=train, device="cpu", num_workers=0, augment=aug,
                             **({"cache_size": 48} if backend == "memory" else {}))
        batches = list(loader)
        assert [len(y) for _, y in batches] == [4, 1 if rank < 2 else 0]
        assert batches[-1][0].shape[1:] == (3, 32, 32)
        total += sum(len(y) for _, y in batches)
    assert total == 18


# ------------------------------------------------------------------ the budget (issue 9.3)
class _FakeCache:
    """Stands in for a live MemoryLoader holding ``footprint`` bytes on ``device``."""

    def __init__(self, device, footprint):
        self.device, self.footprint = torch.device(device), footprint


def test_the_budget_is_total_memory_minus_a_reserve(gpu_16g):
    from fastdata.backends import memory

    gpu = torch.device("cuda", 0)
    assert memory.budget(gpu).limit == 12 * 2**30                 # default reserve: a quarter of 16 GiB
    assert memory.budget(gpu, 0.5).limit == 8 * 2**30
    assert memory.budget(gpu, 2**30).limit == 15 * 2**30          # capped by what is free
    gpu_16g["free"] = 2**30                                      # the model took the rest
    b = memory.budget(gpu)
    assert b.stable == 12 * 2**30 and b.limit == 2**30
    assert "only 1073741824 bytes" in b.explain() and "memory_reserve" in b.explain()
    for bad in (-1, 1.0, 1.5, "1G", True):
        with pytest.raises(ValueError, match="memory_reserve must be"):
            memory.budget(gpu, bad)


def test_two_live_caches_count_against_one_budget(gpu_16g, monkeypatch):
    from types import SimpleNamespace

    from fastdata.backends import memory
    from fastdata.errors import CacheDoesNotFit

    gpu = torch.device("cuda", 0)
    photos = SimpleNamespace(kind="files", __len__=None)
    need = 5 * 2**30
    monkeypatch.setattr(memory, "cache_bytes", lambda source, config: need)
    config = SimpleNamespace(device=gpu)
    memory.check_fits(photos, config)                           # alone: 5 GiB of 12 fits
    train = _FakeCache("cuda:0", 8 * 2**30)
    other_gpu = _FakeCache("cuda:1", 8 * 2**30)                 # another device's cache does not count
    memory._LIVE.add(train)
    memory._LIVE.add(other_gpu)
    assert memory.live_cache_bytes(gpu) == 8 * 2**30
    with pytest.raises(CacheDoesNotFit, match="8589934592 bytes .* held by other live memory caches"):
        memory.check_fits(photos, config)                       # 8 + 5 > 12
    memory._LIVE.discard(train)                                 # closing the other loader frees its share
    memory.check_fits(photos, config)


def test_a_loader_leaves_the_budget_when_closed_or_collected(monkeypatch):
    import gc

    from fastdata.backends import memory

    cpu = torch.device("cpu")
    base = memory.live_cache_bytes(cpu)
    from conftest import indexed_source

    a = make_loader(indexed_source(500), "memory", batch_size=50, device="cpu")
    b = make_loader(indexed_source(300), "memory", batch_size=50, device="cpu")
    assert a.footprint >= a.ready.untyped_storage().nbytes() > 0
    assert memory.live_cache_bytes(cpu) == base + a.footprint + b.footprint
    a.close()
    assert memory.live_cache_bytes(cpu) == base + b.footprint
    del b
    gc.collect()
    assert memory.live_cache_bytes(cpu) == base


def test_memory_imports_no_sibling_backend():
    """Its decoding goes through the shared decode layer (fastdata/decode.py), not another backend."""
    import ast
    from pathlib import Path

    import fastdata.backends.memory as memory

    tree = ast.parse(Path(memory.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert imported <= {"base"}, f"memory imports sibling backend module(s) {sorted(imported - {'base'})}"
