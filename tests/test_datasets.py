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


# ---------------------------------------------------------------- labels are integers >= 0
@pytest.mark.parametrize("labels, match", [
    ([0, 1, 1.7, 2], r"labels\[2\] is 1\.7"),
    ([0, np.nan, 1, 2], r"labels\[1\] is nan"),
    ([0, 1, 2, np.inf], r"labels\[3\] is inf"),
    ([0, -3, 1, 2], r"labels\[1\] is -3"),
    ([0.0, 1.0, 2.0, -1.0], r"labels\[3\] is -1\.0"),
])
def test_labels_must_be_integers_at_least_zero(labels, match):
    with pytest.raises(ValueError, match="labels must be integers >= 0; " + match):
        ArraySource(np.zeros((4, 5, 5), np.uint8), np.asarray(labels))


def test_whole_float_labels_are_accepted_and_strings_refused():
    src = ArraySource(np.zeros((3, 5, 5), np.uint8), np.array([0.0, 2.0, 1.0]))
    assert src.labels.dtype == np.int64 and src.labels.tolist() == [0, 2, 1] and src.num_classes == 3
    with pytest.raises(TypeError, match="labels must be integers"):
        ArraySource(np.zeros((2, 5, 5), np.uint8), np.array(["a", "b"]))


def test_torch_dataset_targets_are_checked_too():
    from fastdata.datasets import DatasetSource

    class Data:
        targets = [0, 1, -1]

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return np.zeros((1, 4, 4), np.uint8), self.targets[i]

    with pytest.raises(ValueError, match=r"Data.targets must be integers >= 0; Data.targets\[2\] is -1"):
        DatasetSource(Data())


# ---------------------------------------------------------------- degenerate arrays and IDX files
def test_zero_pixel_images_are_refused():
    with pytest.raises(ValueError, match="images must have at least one pixel"):
        ArraySource(np.zeros((4, 0, 0), np.uint8), np.arange(4))
    with pytest.raises(ValueError, match="images must have at least one pixel"):
        ArraySource(np.zeros((4, 5, 0, 1), np.uint8), np.arange(4))


def _mnist_files(tmp_path, images_bytes: bytes, labels=None):
    labels = np.arange(3, dtype=np.uint8) if labels is None else labels
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "t10k-images-idx3-ubyte").write_bytes(images_bytes)
    write_idx(raw / "t10k-labels-idx1-ubyte", labels)
    return raw / "t10k-images-idx3-ubyte"


def _header(*shape) -> bytes:
    return struct.pack(">HBB", 0, 8, len(shape)) + struct.pack(">" + "I" * len(shape), *shape)


@pytest.mark.parametrize("body, match", [
    (_header(0, 28, 28), r"holds no items"),
    (_header(3, 0, 0), r"holds 0x0 images; they need at least one pixel"),
    (_header(3, 28, 0), r"holds 28x0 images"),
    (_header(2 ** 32 - 1, 2 ** 32 - 1, 2 ** 32 - 1) + bytes(100), r"is truncated: header says"),
    (_header(3, 65536, 65536) + bytes(3 * 4), r"is truncated: header says"),
    (_header(3, 2, 2) + bytes(3 * 4 + 5), r"does not match its header"),
])
def test_degenerate_idx_files_are_errors_naming_the_path(tmp_path, body, match):
    path = _mnist_files(tmp_path, body)
    with pytest.raises(ValueError, match=f"IDX file '{path}' {match}"):
        MNIST(tmp_path, train=False, download=False)


def test_an_idx_label_file_with_no_labels_names_its_path(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(raw / "t10k-images-idx3-ubyte", np.zeros((2, 4, 4), np.uint8))
    (raw / "t10k-labels-idx1-ubyte").write_bytes(_header(0))
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte' holds no items"):
        MNIST(tmp_path, train=False, download=False)


# ---------------------------------------------------------------- image folders: links and unreadable folders
def _tiny_folder(root, per_class=3):
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / cls / f"{i}.png")
    return root


def test_a_link_back_to_the_root_neither_loops_nor_relabels(tmp_path):
    root = _tiny_folder(tmp_path / "data")
    os.symlink("..", root / "a" / "loop")           # a/loop -> the root
    os.symlink("../b", root / "a" / "to_b")         # another class's folder
    os.symlink("../a", root / "a" / "self")         # its own folder
    ds = ImageFolder(root)
    assert len(ds) == 6 and ds.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert all(f"{os.sep}loop{os.sep}" not in p and f"{os.sep}to_b{os.sep}" not in p for p in ds.paths)


def test_a_linked_sub_folder_is_read_once(tmp_path):
    root = _tiny_folder(tmp_path / "data")
    extra = tmp_path / "outside"
    extra.mkdir()
    Image.new("RGB", (8, 8)).save(extra / "x.png")
    os.symlink(extra, root / "b" / "more")
    os.symlink(extra, root / "b" / "more_again")
    ds = ImageFolder(root)
    assert len(ds) == 7 and ds.labels.tolist().count(1) == 4


def test_a_link_to_an_ancestor_of_the_root_is_an_error_naming_it(tmp_path):
    root = _tiny_folder(tmp_path / "data")
    os.symlink(tmp_path, root / "b" / "up")
    with pytest.raises(ValueError, match=r"folder link '.*b/up' points to .* contains the image folder"):
        ImageFolder(root)


@pytest.mark.parametrize("where", ["root", "class", "sub"])
def test_an_unreadable_folder_is_an_error_naming_it(tmp_path, monkeypatch, where):
    # Tests run as root, which chmod 000 does not stop: the refusal is simulated at os.scandir.
    root = _tiny_folder(tmp_path / "data")
    (root / "b" / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(root / "b" / "sub" / "s.png")
    locked = {"root": root, "class": root / "b", "sub": root / "b" / "sub"}[where]
    real = os.scandir

    def scandir(path="."):
        if os.path.realpath(path) == os.path.realpath(locked):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(PermissionError, match=f"cannot read folder '{locked}'"):
        ImageFolder(root)


# ---------------------------------------------------------------- torch Datasets: one channel count for all
class _Samples:
    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0


def _rgb(seed=0):
    return np.random.default_rng(seed).integers(0, 256, (6, 5, 3), dtype=np.uint8)


def test_a_colour_first_sample_makes_every_sample_rgb():
    import torch

    from fastdata.datasets import DatasetSource

    rgb = _rgb()
    grey = rgb[..., 0]
    src = DatasetSource(_Samples([Image.fromarray(rgb), Image.fromarray(grey)]))
    assert src.channels == 3
    for image in (Image.fromarray(grey), torch.from_numpy(grey), torch.from_numpy(grey)[None],
                  Image.fromarray(grey).convert("P")):
        out = src.as_array(image)
        assert out.dtype == np.uint8 and out.shape == (6, 5, 3)
        np.testing.assert_array_equal(out, np.repeat(grey[..., None], 3, -1))
    np.testing.assert_array_equal(src.as_array(torch.from_numpy(rgb).permute(2, 0, 1)), rgb)
    rgba = np.concatenate([rgb, np.full((6, 5, 1), 7, np.uint8)], -1)
    np.testing.assert_array_equal(src.as_array(Image.fromarray(rgba)), rgb)
    np.testing.assert_array_equal(src.as_array(torch.from_numpy(rgba).permute(2, 0, 1)), rgb)


def test_a_grey_first_sample_refuses_later_colour_unless_told():
    import torch

    from fastdata.datasets import DatasetSource

    rgb, grey = _rgb(), _rgb()[..., 0]
    src = DatasetSource(_Samples([torch.from_numpy(grey), torch.from_numpy(rgb).permute(2, 0, 1)]))
    assert src.channels == 1  # a (H, W) tensor is one channel, not H
    assert src.as_array(torch.from_numpy(grey)).shape == (6, 5, 1)
    for colour in (Image.fromarray(rgb), torch.from_numpy(rgb).permute(2, 0, 1)):
        with pytest.raises(ValueError, match=r"colour sample .* channels=3\) .* channels=1 "):
            src.as_array(colour)
    told = DatasetSource(_Samples([torch.from_numpy(grey)]), channels=1)
    pil = np.asarray(Image.fromarray(rgb).convert("L"))[..., None]
    np.testing.assert_array_equal(told.as_array(Image.fromarray(rgb)), pil)
    np.testing.assert_array_equal(told.as_array(torch.from_numpy(rgb).permute(2, 0, 1)), pil)  # same luma
    assert DatasetSource(_Samples([torch.from_numpy(grey)]), channels=3).channels == 3


def test_as_array_refuses_what_it_cannot_convert():
    import torch

    from fastdata.datasets import DatasetSource

    src = DatasetSource(_Samples([torch.zeros(3, 4, 4, dtype=torch.uint8)]))
    with pytest.raises(TypeError, match="returned a torch.float32 tensor; the torch backend expects PIL"):
        src.as_array(torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match=r"shape \(2, 4, 4\)"):
        src.as_array(torch.zeros(2, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="channels must be 1, 3 or None"):
        DatasetSource(_Samples([torch.zeros(3, 4, 4, dtype=torch.uint8)]), channels=2)


def test_as_label_refuses_what_int_would_change():
    import torch

    from fastdata.datasets import DatasetSource

    src = DatasetSource(_Samples([torch.zeros(1, 4, 4, dtype=torch.uint8)]))
    for good, want in ((3, 3), (np.int64(2), 2), (torch.tensor(4), 4), (5.0, 5), (np.float32(1.0), 1)):
        assert src.as_label(good, 0) == want and type(src.as_label(good, 0)) is int
    for bad in (1.7, float("nan"), -3, "2", True, None, torch.tensor([1, 2])):
        with pytest.raises(ValueError, match=r"_Samples\[7\] returned label .*; labels must be integers >= 0"):
            src.as_label(bad, 7)


def test_the_torch_backend_converts_mixed_channel_samples_as_the_source_decides():
    import torch

    from fastdata import Augmentation, make_loader

    rgb, grey = _rgb(), _rgb()[..., 0]
    colour_first = make_loader(_Samples([Image.fromarray(rgb), Image.fromarray(grey)]), "torch", batch_size=2,
                               num_workers=0, train=False, device="cpu", augment=Augmentation.none(),
                               mean=(0.5,), std=(0.25,))  # the same statistics for every channel
    (x, _), = list(colour_first)
    assert x.shape == (2, 3, 6, 5)
    # the grey sample is replicated to RGB: its three channels are equal, like PIL's convert("RGB")
    assert torch.equal(x[1, 0], x[1, 1]) and torch.equal(x[1, 1], x[1, 2])
    grey_first = make_loader(_Samples([Image.fromarray(grey), Image.fromarray(rgb)]), "torch", batch_size=2,
                             num_workers=0, train=False, device="cpu", augment=Augmentation.none())
    with pytest.raises(ValueError, match="colour sample"):
        list(grey_first)
