"""Extending fastdata as a user does: a Source of one's own, a backend of one's own, a batch transform of
one's own. Each either works on every backend that claims to take it, with the contract held, or is
refused when the loader (or the registry row) is made, naming the problem and the fix."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import BACKENDS as INSTALLED
from fastdata import Augmentation, make_loader
from fastdata.datasets import IMAGENET_MEAN, IMAGENET_STD, Source, SourceKind

CPU_BACKENDS = [b for b in INSTALLED if b != "prefetch"]   # prefetch is torch's on the CPU


def _jpeg(seed: int, size=(40, 52)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


class Blobs(Source):
    """What a user writes after docs/sources.md's table: photos held in a dict of name -> bytes."""

    kind = SourceKind.FILES

    def __init__(self, blobs: dict, labels):
        self.keys = sorted(blobs)
        self.blobs = blobs
        self.labels = labels
        self.num_classes, self.channels, self.name = 3, 3, "blobs"
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD

    def read_stamped(self, i):
        data = self.blobs[self.keys[i]]
        return data, len(data)

    def sample_name(self, i):
        return f"blobs:{self.keys[i]}"


@pytest.fixture(scope="module")
def blobs():
    return {f"{i:02d}.jpg": _jpeg(i) for i in range(12)}


SMALL = Augmentation.imagenet_eval(size=32)   # a recipe of its own: these tests are not about the default


def _batches(source, backend, **kwargs):
    kwargs = {"batch_size": 4, "device": "cpu", "num_workers": 0, "quiet": True, "augment": SMALL, **kwargs}
    loader = make_loader(source, backend, **kwargs)
    return loader, list(loader)


# ------------------------------------------------------------------------------------------ sources
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_photo_source_without_a_recipe_of_its_own_gets_the_photo_recipe(blobs, backend):
    # Source.default_augmentation was none for every kind: a FILES source following the docs' table was
    # refused by every backend ("holds photos of different sizes ... needs a crop").
    _, out = _batches(Blobs(blobs, np.arange(12) % 3), backend, augment=None)
    assert [tuple(x.shape) for x, _ in out] == [(4, 3, 224, 224)] * 3


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float64])
def test_labels_of_another_integer_dtype_come_out_int64(blobs, backend, dtype):
    # int32 labels came out int32 (torch, memory) and whole floats float64: the contract says int64.
    _, out = _batches(Blobs(blobs, (np.arange(12) % 3).astype(dtype)), backend)
    assert all(y.dtype == torch.int64 for _, y in out)
    assert torch.cat([y for _, y in out]).sort().values.tolist() == sorted((np.arange(12) % 3).tolist())


@pytest.mark.parametrize("labels, error, message", [
    (np.array(["cat", "dog", "cow"] * 4), TypeError, r"Blobs.labels holds names .*'cat'.*classes.index"),
    (np.arange(12) % 3 + 0.5, ValueError, r"Blobs.labels must be integers >= 0; Blobs.labels\[0\] is 0.5"),
    (np.arange(12), ValueError, r"Blobs.labels must be integers in \[0, 3\).*Blobs.labels\[3\] is 3"),
    (list(np.arange(12) % 3), None, None),
])
def test_labels_that_are_names_fractions_or_out_of_range_are_refused_when_the_loader_is_made(blobs, labels, error,
                                                                                             message):
    source = Blobs(blobs, labels)
    if error is None:   # a list of ints is labels
        loader, out = _batches(source, "torch")
        assert len(out) == 3
        return
    with pytest.raises(error, match=message):
        make_loader(source, "torch", batch_size=4, device="cpu", num_workers=0, augment=SMALL)


@pytest.mark.parametrize("length", [16, 8])
def test_a_len_that_disagrees_with_the_labels_is_refused(blobs, length):
    # 16: an IndexError from inside a batch; 8: a third of the samples silently never read.
    class Lying(Blobs):
        def __len__(self):
            return length

    with pytest.raises(ValueError, match=rf"len\(Lying\) is {length} but Lying.labels has 12"):
        make_loader(Lying(blobs, np.arange(12) % 3), "torch", batch_size=4, device="cpu", num_workers=0,
                    augment=SMALL)


def test_a_missing_attribute_is_named_with_what_a_source_sets(blobs):
    source = Blobs(blobs, np.arange(12) % 3)
    del source.mean
    with pytest.raises(TypeError, match=r"Blobs has no mean: a Source sets labels.*docs/sources.md"):
        make_loader(source, "torch", batch_size=4, device="cpu", num_workers=0, augment=SMALL)


def test_a_photo_source_declaring_one_channel_is_refused(blobs):
    # Photos decode to RGB: a FILES source saying channels=1 got 3-channel batches under a 1-value mean.
    source = Blobs(blobs, np.arange(12) % 3)
    source.channels, source.mean, source.std = 1, (0.5,), (0.25,)
    with pytest.raises(ValueError, match=r"Blobs has channels=1.*decodes to RGB.*channels = 3"):
        make_loader(source, "torch", batch_size=4, device="cpu", num_workers=0, augment=SMALL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_source_that_overrides_read_alone_is_read(blobs, backend):
    # docs/sources.md names read(i) first; a source giving only read() was told it "holds decoded
    # pixels ... not encoded files" at the first batch.
    class ReadOnly(Blobs):
        read_stamped = Source.read_stamped

        def read(self, i):
            return self.blobs[self.keys[i]]

    _, out = _batches(ReadOnly(blobs, np.arange(12) % 3), backend)
    assert len(out) == 3
