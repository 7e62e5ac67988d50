"""Sources: MNIST's IDX files, synthetic digits, image folders, the photo generator."""
import gzip
import os
import struct

import numpy as np
import pytest
from PIL import Image

from fastdata.datasets import MNIST, ArraySource, ImageFolder, SyntheticDigits, as_source, make_image_folder


def write_idx(path, array, compress=False):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_reads_torchvisions_layout(tmp_path, compress):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (50, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 50, dtype=np.uint8)
    write_idx(raw / "t10k-images-idx3-ubyte", images, compress)
    write_idx(raw / "t10k-labels-idx1-ubyte", labels, compress)
    ds = MNIST(tmp_path, train=False, download=False)
    assert len(ds) == 50 and ds.image_shape == (28, 28, 1)
    np.testing.assert_array_equal(ds.images[..., 0], images)
    np.testing.assert_array_equal(ds.labels, labels)
    assert ds.labels.dtype == np.int64 and ds.mean == (0.1307,)


def test_mnist_missing_names_the_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"MNIST/raw/train-images-idx3-ubyte\[\.gz\]"):
        MNIST(tmp_path, train=True, download=False)


def test_synthetic_digits_are_deterministic_and_varied():
    a, b = SyntheticDigits(500, seed=1), SyntheticDigits(500, seed=1)
    np.testing.assert_array_equal(a.images, b.images)
    assert not np.array_equal(a.images, SyntheticDigits(500, seed=2).images)
    assert not np.array_equal(a.images, SyntheticDigits(500, seed=1, train=False).images)
    assert np.bincount(a.labels).tolist() == [50] * 10
    # Two drawings of the same digit differ: the task is not a lookup.
    same = a.images[a.labels == 3].astype(np.float32)
    assert np.abs(same[0] - same[1]).mean() > 10
    # Digits are drawn: bright strokes on a dark ground, some ink in every image.
    assert (a.images.reshape(500, -1).max(1) > 100).all()
    assert 0.05 < a.images.mean() / 255 < 0.3


def test_image_folder_sorts_classes_and_labels_files(tmp_path):
    for cls, n in (("zebra", 2), ("ant", 3)):
        (tmp_path / cls).mkdir()
        for i in range(n):
            Image.new("RGB", (8, 8)).save(tmp_path / cls / f"{i}.JPG")
    (tmp_path / "ant" / "notes.txt").write_text("not an image")
    ds = ImageFolder(tmp_path)
    assert ds.classes == ["ant", "zebra"] and len(ds) == 5
    assert ds.labels.tolist() == [0, 0, 0, 1, 1]
    assert all(p.endswith(".JPG") for p in ds.paths)


def test_make_image_folder_looks_like_imagenet(tmp_path):
    root = make_image_folder(tmp_path, classes=2, per_class=4, seed=3)
    sizes, dims = [], []
    for dirpath, _, files in os.walk(root):
        for f in files:
            sizes.append(os.path.getsize(os.path.join(dirpath, f)))
            with Image.open(os.path.join(dirpath, f)) as im:
                assert im.format == "JPEG" and im.mode == "RGB"
                dims.append(sorted(im.size))
    assert len(sizes) == 8
    assert all(60_000 < s < 150_000 for s in sizes), sizes
    assert all(300 <= short <= 400 and 400 <= long <= 500 for short, long in dims), dims


def test_as_source_accepts_arrays_and_rejects_others():
    src = as_source((np.zeros((4, 5, 5), np.uint8), np.arange(4)))
    assert isinstance(src, ArraySource) and src.channels == 1
    with pytest.raises(TypeError, match="cannot load from int"):
        as_source(3)
    with pytest.raises(TypeError, match="images must be uint8"):
        ArraySource(np.zeros((4, 5, 5), np.float32), np.arange(4))
