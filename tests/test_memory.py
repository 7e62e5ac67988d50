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
def test_cache_lives_on_the_gpu():
    loader = make_loader(SyntheticDigits(1000), "memory", batch_size=100, device="cuda")
    assert loader.cache.is_cuda
    x, y = next(iter(loader))
    assert x.is_cuda and y.is_cuda


def test_uint8_path_when_the_normalized_cache_does_not_fit(monkeypatch):
    """Digits are cached normalized when that fits; otherwise as uint8 (4x smaller) with the same output."""
    import fastdata.backends.memory as memory

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
