"""decode: ids → uint8 images and the ids kept; one counter (loader.skipped) and one warning."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from conftest import CONCRETE, indexed_source
from fastdata import Augmentation, make_loader
from fastdata.datasets import DatasetSource, ImageFolder, make_image_folder
from fastdata.decode import BatchDecoder, decode, warn_skipped
from fastdata.errors import DecodeError

EVAL = Augmentation(crop="center", size=16, resize=16)


@pytest.fixture(scope="module")
def folder_with_a_bad_file(tmp_path_factory):
    """2 classes x 3 small JPEGs plus one empty .jpg (id 3: it sorts first in class_001)."""
    root = make_image_folder(tmp_path_factory.mktemp("photos"), classes=2, per_class=3, seed=1,
                             size_range=((40, 50), (30, 40)))
    (root / "class_001" / "img_00000_bad.jpg").write_bytes(b"")
    return root


def test_files_skip_returns_the_kept_ids_in_order(folder_with_a_bad_file):
    src = ImageFolder(folder_with_a_bad_file)
    bad = [i for i, p in enumerate(src.paths) if p.endswith("_bad.jpg")]
    assert len(src) == 7 and len(bad) == 1
    d = decode(src, np.arange(7), EVAL, np.random.default_rng(0), on_error="skip")
    assert d.kept.tolist() == [i for i in range(7) if i != bad[0]]
    assert d.images.shape == (6, 16, 16, 3) and d.images.dtype == np.uint8
    assert np.array_equal(d.labels, src.labels[d.kept])
    with pytest.raises(DecodeError, match="_bad.jpg"):
        decode(src, np.arange(7), EVAL, np.random.default_rng(0), on_error="raise")


def test_arrays_and_datasets_keep_every_id():
    src = indexed_source(20, size=8)
    ids = np.array([5, 1, 7])
    d = decode(src, ids, Augmentation(), np.random.default_rng(0))
    assert d.kept.tolist() == [5, 1, 7] and np.array_equal(d.images, src.images[ids])
    chw = torch.from_numpy(src.images).permute(0, 3, 1, 2)    # a torch Dataset returns (C, H, W)
    ds = torch.utils.data.TensorDataset(chw, torch.from_numpy(src.labels))
    d2 = decode(DatasetSource(ds), ids, Augmentation(), np.random.default_rng(0))
    assert d2.kept.tolist() == [5, 1, 7] and np.array_equal(d2.images, d.images)
    assert np.array_equal(d2.labels, d.labels)


def test_a_skipped_file_does_not_change_the_other_files_pixels(folder_with_a_bad_file, tmp_path):
    """The decoder draws per file in order; a bad file without a header draws nothing, so the good
    files get the same random crops as in a folder without it."""
    src = ImageFolder(folder_with_a_bad_file)
    rrc = Augmentation(crop="random_resized", size=16, hflip=0.5)
    with_bad = decode(src, np.arange(7), rrc, np.random.default_rng(3), on_error="skip")
    good = with_bad.kept
    alone = decode(src, good, rrc, np.random.default_rng(3))
    assert np.array_equal(with_bad.images, alone.images)


def test_the_batch_decoder_refuses_a_bad_on_error_and_photos_without_a_fixed_size(folder_with_a_bad_file):
    src = ImageFolder(folder_with_a_bad_file)
    with pytest.raises(ValueError, match=r"on_error must be one of \['raise', 'skip'\]"):
        BatchDecoder(src, EVAL, on_error="ignore")
    with pytest.raises(ValueError, match="crop that fixes the output size"):
        BatchDecoder(src, Augmentation(crop="translate", pad=2))
    images, labels, kept = BatchDecoder(src, EVAL, "skip")[(np.arange(7), 0)]
    assert len(images) == len(labels) == len(kept) == 6


def test_one_warning_text():
    with pytest.warns(RuntimeWarning, match=r"^torch: skipped 2 undecodable sample\(s\) in epoch 3 "
                                            r"\(on_error='skip'\)$"):
        warn_skipped("torch", 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_skipped("torch", 0, 3)   # nothing skipped: no warning


@pytest.mark.parametrize("backend", CONCRETE)
def test_every_backend_counts_skips_in_loader_skipped_and_warns_once_per_epoch(backend,
                                                                              folder_with_a_bad_file):
    """memory included: its cache-time skips are missing from every epoch, so every epoch reports them."""
    for epoch in range(2):
        if epoch == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                loader = make_loader(ImageFolder(folder_with_a_bad_file), backend, batch_size=4, train=False,
                                     device="cpu", num_workers=0, augment=EVAL, on_error="skip")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            n = sum(len(y) for _, y in loader)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert n == 6 and loader.skipped == 1, (backend, epoch, n, loader.skipped)
        assert messages == [f"{backend}: skipped 1 undecodable sample(s) in epoch {epoch} (on_error='skip')"]
    loader.close()
