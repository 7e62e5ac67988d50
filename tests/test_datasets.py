"""Sources: MNIST's IDX files, synthetic digits, image folders, the photo generator."""
import gzip
import os
import re
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import backend_params, decode_ids, indexed_source
from fastdata import Augmentation, make_loader
from fastdata.datasets import (
    MNIST,
    ArraySource,
    DatasetSource,
    ImageFolder,
    SyntheticDigits,
    as_source,
    make_image_folder,
    split,
)


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


def test_array_source_takes_tensors_wherever_they_are():
    """torch tensors are copied to the host whatever their device or grad (Tensor.numpy() alone refuses
    CUDA tensors and tensors that require grad): a requires-grad float tensor reaches the dtype check."""
    src = ArraySource(torch.zeros((4, 5, 5), dtype=torch.uint8), torch.arange(4))
    assert src.images.shape == (4, 5, 5, 1) and src.labels.tolist() == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="images must be uint8, got float32"):
        ArraySource(torch.zeros((4, 5, 5), requires_grad=True), torch.arange(4))


@pytest.mark.cuda
def test_array_source_takes_cuda_tensors():
    images = torch.arange(4 * 5 * 5, dtype=torch.uint8).reshape(4, 5, 5)
    src = ArraySource(images.cuda(), torch.arange(4, device="cuda"))
    np.testing.assert_array_equal(src.images[..., 0], images.numpy())
    assert src.labels.tolist() == [0, 1, 2, 3]


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


def test_a_float_step_inside_a_composition_is_refused_when_the_folder_is_made(tmp_path):
    """nn.Sequential (torchvision's scripted composition) and RandomApply/RandomChoice/RandomOrder slipped past
    the check: the float images then surfaced at some batch, or (RandomApply with a small p) at a random one."""
    from torchvision.transforms import v2

    _tiny_folder(tmp_path)
    to_float = v2.ToDtype(torch.float32, scale=True)
    for tf, words in ((torch.nn.Sequential(v2.ToImage(), to_float), r"\(ToDtype\): drop"),
                      (v2.Compose([v2.ToImage(), torch.nn.Sequential(v2.RandomApply([to_float], p=0.01))]),
                       r"\(ToDtype\) in some of its random draws"),
                      (v2.Compose([v2.ToImage(), v2.RandomChoice([v2.Identity(), to_float])]), r"\(ToDtype\) in"),
                      (v2.RandomOrder([v2.ToImage(), to_float, v2.ToDtype(torch.uint8)]), r"\(ToDtype\) in")):
        with pytest.raises(TypeError, match=rf"transform of ImageFolder .* ends with float images {words}"):
            ImageFolder(tmp_path, transform=tf)
    # Converted back to uint8 in every draw: accepted.
    back = v2.ToDtype(torch.uint8, scale=True)
    for tf in (torch.nn.Sequential(v2.ToImage(), to_float, back),
               v2.Compose([v2.ToImage(), v2.RandomApply([to_float, back], p=0.5)]),
               v2.Compose([v2.ToImage(), v2.RandomChoice([back, v2.Compose([to_float, back])])])):
        ImageFolder(tmp_path, transform=tf)


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


def test_palette_samples_keep_their_colour_and_count_as_colour():
    """A palette image has one band but RGB entries: pure red stays red, never becomes grey 76."""
    from fastdata.datasets import DatasetSource

    red = Image.new("RGB", (5, 4), (255, 0, 0)).convert("P")
    assert red.mode == "P"
    src = DatasetSource(_Samples([red]))
    assert src.channels == 3
    np.testing.assert_array_equal(src.as_array(red), np.full((4, 5, 3), (255, 0, 0), np.uint8))
    grey_palette = Image.fromarray(_rgb()[..., 0]).convert("P")
    src = DatasetSource(_Samples([grey_palette, red]))   # photos are RGB, whatever the first one's mode
    assert src.channels == 3
    np.testing.assert_array_equal(src.as_array(red), np.full((4, 5, 3), (255, 0, 0), np.uint8))


def test_numpy_samples_are_hwc_as_the_readme_says_and_tensors_chw():
    import torch

    from fastdata.datasets import DatasetSource

    rgb = _rgb()                              # (6, 5, 3)
    src = DatasetSource(_Samples([rgb]))
    assert src.channels == 3
    np.testing.assert_array_equal(src.as_array(rgb), rgb)
    np.testing.assert_array_equal(src.as_array(torch.from_numpy(rgb).permute(2, 0, 1)), rgb)
    assert DatasetSource(_Samples([rgb[..., 0]])).channels == 1
    with pytest.raises(ValueError, match=r"array of shape \(3, 6, 5\); expected uint8 \(H, W, C\)"):
        src.as_array(rgb.transpose(2, 0, 1).copy())   # (C, H, W) is a tensor's layout, not an array's


def test_float_pil_images_and_non_pairs_are_refused_naming_the_fix():
    from fastdata.datasets import DatasetSource

    ramp = Image.fromarray(np.linspace(0, 1, 20, dtype=np.float32).reshape(4, 5), mode="F")
    with pytest.raises(TypeError, match=r"_Samples\[0\] returned a float32 \(PIL mode 'F'\) image.*ToTensor"):
        DatasetSource(_Samples([ramp]))
    with pytest.raises(TypeError, match=r"returned a float32 \(PIL mode 'F'\) image"):
        DatasetSource(_Samples([Image.fromarray(_rgb())])).as_array(ramp)

    class Shaped(torch_dataset()):
        def __init__(self, sample):
            self.sample = sample

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return self.sample

    image = Image.fromarray(_rgb())
    for sample, words in [({"image": image, "label": 1}, r"a dict with keys \['image', 'label'\]"),
                          ((image, 1, "extra"), "a 3-item tuple"), (image, "an object of type Image")]:
        with pytest.raises(TypeError, match=rf"Shaped\[0\] returned {words}; fastdata reads \(image, label\) pairs"):
            DatasetSource(Shaped(sample))
    src = DatasetSource(Shaped((image, 1)))
    src.dataset.sample = {"image": image}
    with pytest.raises(TypeError, match=r"Shaped\[1\] returned a dict"):
        src.fetch([1])


def test_the_class_count_comes_from_num_classes_and_mixup_says_how_to_give_it():
    from fastdata import make_loader
    from fastdata.batch_transforms import MixUp
    from fastdata.datasets import DatasetSource

    image = Image.fromarray(_rgb())

    class Counted(torch_dataset()):
        num_classes = 4

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return image, i % 4

    class Unknown(Counted):
        num_classes = None

    assert DatasetSource(Counted()).num_classes == 4
    assert DatasetSource(Unknown()).num_classes == 0
    with pytest.raises(ValueError, match=r"MixUp needs the number of classes, and the source does not know it.*"
                                         r"MixUp\(\.\.\., num_classes=N\).*DatasetSource\(dataset, num_classes=N\)"):
        make_loader(Unknown(), "torch", batch_size=4, device="cpu", num_workers=0, batch_transforms=[MixUp(0.2)])
    loader = make_loader(Counted(), "torch", batch_size=4, device="cpu", num_workers=0, batch_transforms=[MixUp(0.2)])
    assert next(iter(loader))[1].shape == (4, 4)


def torch_dataset():
    import torch

    return torch.utils.data.Dataset


class _Drawing(torch.utils.data.Dataset):
    """A Dataset whose __getitem__ draws from every global generator, as a random per-sample transform does."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import random

        torch.rand(1), np.random.rand(), random.random()
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i % 2


@pytest.mark.parametrize("backend", ["torch", "prefetch", "auto"])
def test_building_a_loader_leaves_the_callers_global_rngs_alone(backend):
    """The first sample, read to learn the channels, moved torch's, numpy's and random's global state: a run's
    dropout and initialization then depended on whether (and how many) loaders were built before them."""
    import random

    def states():
        return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()

    before = states()
    loader = make_loader(_Drawing(), backend, batch_size=4, device="cpu", num_workers=0, quiet=True)
    after = states()
    assert loader.source.channels == 3
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]


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
    # Tensors: the first sample decides (a grey first one makes 1 channel, and colour is then an error).
    grey_tensor_first = make_loader(_Samples([torch.from_numpy(grey), torch.from_numpy(rgb).permute(2, 0, 1)]),
                                    "torch", batch_size=2, num_workers=0, train=False, device="cpu")
    with pytest.raises(ValueError, match="colour sample"):
        list(grey_tensor_first)


class _GreyData(_Samples):
    """Grey by construction, as torchvision's MNIST family: a (N, H, W) ``data`` array, "L" samples."""

    def __init__(self, images):
        super().__init__([Image.fromarray(im) for im in images])
        self.data = np.stack(images)


@pytest.mark.parametrize("modes", [("L", "RGB", "RGB"), ("L", "L", "RGB"), ("P", "CMYK", "RGBA"), ("L", "L", "L")])
def test_photos_come_out_rgb_whatever_the_first_ones_mode(modes):
    """A Dataset of PIL photos whose first photo is grey refused the colour ones after it (ImageNet has grey
    JPEGs); photos now come out RGB as torchvision's default loader makes them, whatever comes first."""
    import torch

    rgb = [_rgb(seed) for seed in range(3)]
    photos = [Image.fromarray(im).convert(mode) for im, mode in zip(rgb, modes)]
    loader = make_loader(_Samples(photos), "torch", batch_size=3, num_workers=0, train=False, device="cpu",
                         mean=(0.0,), std=(1.0,))
    (x, _), = list(loader)
    assert loader.source.channels == 3 and x.shape == (3, 3, 6, 5)
    want = np.stack([np.asarray(p.convert("RGB")) for p in photos])   # torchvision's pil_loader
    torch.testing.assert_close(x, torch.from_numpy(want).permute(0, 3, 1, 2).float() / 255)
    # One channel when asked for, or when the dataset's pixels are grey by construction (MNIST-like).
    assert DatasetSource(_Samples(photos), channels=1).channels == 1
    grey = [im[..., 0] for im in rgb]
    mnist_like = make_loader(_GreyData(grey), "torch", batch_size=3, num_workers=0, train=False, device="cpu")
    assert next(iter(mnist_like))[0].shape == (3, 1, 6, 5)


# ---------------------------------------------------------------- classes, num_classes, labels in range
def test_array_source_classes_and_num_classes():
    images = np.zeros((4, 5, 5), np.uint8)
    src = ArraySource(images, [0, 1, 1, 0])
    assert src.classes == [0, 1] and src.num_classes == 2
    named = ArraySource(images, [0, 1, 1, 0], classes=["cat", "dog", "emu"])
    assert named.classes == ["cat", "dog", "emu"] and named.num_classes == 3   # a class may have no sample
    assert ArraySource(images, [0, 1, 1, 0], num_classes=10).classes == list(range(10))
    with pytest.raises(ValueError, match=r"labels must be integers in \[0, 2\) \(num_classes=2\); labels\[2\] is 5"):
        ArraySource(images, [0, 1, 5, 7], num_classes=2)
    with pytest.raises(ValueError, match=r"labels\[1\] is 2"):
        ArraySource(images, [0, 2, 1, 0], classes=["a", "b"])
    with pytest.raises(ValueError, match="num_classes=3 but classes has 2 names"):
        ArraySource(images, [0, 1, 1, 0], classes=["a", "b"], num_classes=3)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 1 or None, got 0"):
        ArraySource(images, [0, 1, 1, 0], num_classes=0)


def test_a_dataset_with_class_names_refuses_a_label_past_them():
    from fastdata.datasets import DatasetSource

    class Named(_Samples):
        classes = ["a", "b"]
        targets = [0, 1, 2]

    with pytest.raises(ValueError, match=r"Named.targets must be integers in \[0, 2\).*Named.targets\[2\] is 2"):
        DatasetSource(Named([np.zeros((4, 4), np.uint8)] * 3))

    class Untargeted(_Samples):
        classes = ["a", "b"]

    src = DatasetSource(Untargeted([np.zeros((4, 4), np.uint8)] * 3))
    assert src.classes == ["a", "b"] and src.num_classes == 2
    with pytest.raises(ValueError, match=r"Untargeted\[5\] returned label 2; labels must be integers in \[0, 2\)"):
        src.as_label(2, 5)


@pytest.mark.parametrize("shape, digits, expected", [
    ((32, 32, 3), False, Augmentation.cifar_train()),
    ((5, 9, 3), False, Augmentation.cifar_train()),
    ((4, 9, 3), False, Augmentation.none()),       # a side of 4: too small to reflect-pad by 4
    ((32, 32, 1), False, Augmentation.none()),     # grey, not digits: no flip or shift by default
    ((28, 28, 1), True, Augmentation.digits_train()),
])
def test_array_default_recipes(shape, digits, expected):
    src = ArraySource(np.zeros((2,) + shape, np.uint8), [0, 1], digits=digits)
    assert src.default_augmentation(True) == expected
    assert src.default_augmentation(False) == Augmentation.none()


# ---------------------------------------------------------------- subsets
def test_an_array_subset_keeps_the_parents_statistics_and_classes():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (50, 6, 6, 3), dtype=np.uint8)
    images[:10] = 255                                   # the first ten are white: statistics differ
    src = ArraySource(images, np.arange(50) % 5, classes=list("abcde"))
    sub = src.subset([12, 3, 40])
    assert type(sub) is ArraySource and len(sub) == 3 and sub.indices.tolist() == [12, 3, 40]
    np.testing.assert_array_equal(sub.images, images[[12, 3, 40]])
    assert sub.labels.tolist() == [2, 3, 0]
    white = src.subset(range(10))
    assert white.mean == src.mean and white.std == src.std       # the parent's, not its own (1.0)
    assert white.classes == list("abcde") and white.num_classes == 5 and white.channels == 3
    assert np.shares_memory(white.images, src.images)           # a run of ids is a view, not a copy
    nested = sub.subset([2, 0])
    assert nested.indices.tolist() == [40, 12]                  # into the full source
    np.testing.assert_array_equal(nested.images, images[[40, 12]])
    src[49], sub[0]                                             # every source is indexable
    with pytest.raises(IndexError, match="index 3 is out of range for ArraySource with 3 samples"):
        sub[3]


@pytest.mark.parametrize("indices", [
    [1, 4, 2], np.array([1, 4, 2]), np.array([1, 4, 2], np.uint8), torch.tensor([1, 4, 2]),
    np.isin(np.arange(6), [1, 2, 4]), torch.tensor([False, True, True, False, True, False]),
])
def test_subset_takes_lists_arrays_tensors_and_masks(indices):
    src = ArraySource(np.arange(6, dtype=np.uint8).reshape(6, 1, 1), np.arange(6))
    sub = src.subset(indices)
    assert sorted(sub.labels.tolist()) == [1, 2, 4] and sub.labels.tolist() == sub.indices.tolist()


@pytest.mark.parametrize("indices, error, match", [
    ([1, 6, 7], IndexError, r"indices\[1\] is 6, outside \[0, 6\)"),
    ([0, -1], IndexError, r"indices\[1\] is -1, outside \[0, 6\)"),
    ([3, 1, 3, 1], ValueError, r"index 3 appears more than once \(indices\[0\] and indices\[2\]\)"),
    ([], ValueError, "select no samples"),
    ([0.0, 1.0], TypeError, "must be integers"),
    ([[0, 1]], ValueError, "must be 1-D"),
    (np.ones(5, bool), ValueError, r"boolean mask must have one entry per sample \(6\)"),
    ({0, 1}, TypeError, "must be ordered"),
])
def test_subset_refuses_bad_indices_naming_the_first(indices, error, match):
    src = ArraySource(np.zeros((6, 2, 2), np.uint8), np.arange(6))
    with pytest.raises(error, match=match):
        src.subset(indices)


def test_a_subset_fingerprint_names_its_indices():
    src = ArraySource(np.arange(40, dtype=np.uint8).reshape(10, 2, 2), np.arange(10) % 2)
    a, b = src.subset([0, 1, 2, 3]), src.subset([0, 1, 2, 5])
    assert a.fingerprint() != b.fingerprint() and a.fingerprint() != src.fingerprint()
    assert a.fingerprint() == src.subset([0, 1, 2, 3]).fingerprint()


def _relpath_fingerprint(src):
    """ImageFolder.fingerprint as it was written first: os.path.relpath and a stat per file, in order
    (a checkpoint saved then must resume now)."""
    import zlib

    crc = zlib.crc32("\n".join(src.classes).encode())
    for path, label in zip(src.paths, src.labels):
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1
        crc = zlib.crc32(f"{os.path.relpath(path, src.root)}\0{label}\0{size}\n".encode(), crc)
    return f"ImageFolder n={len(src)} classes={src.num_classes} files={crc:08x}{src._subset_tag()}"


def test_an_image_folder_fingerprint_is_the_relpath_one_on_threads(tmp_path, monkeypatch):
    """The fingerprint slices each path below the root instead of os.path.relpath (2.8x faster for
    50k files) and stats on threads: the same digest, paths that are not plain (``./``, ``..``, outside
    the root) and a file gone since the walk included."""
    from fastdata.datasets import folders

    monkeypatch.setattr(folders, "_STAT_RUN", 3)        # several runs, so the threads are used
    root = _tiny_folder(tmp_path / "data")
    walked = ImageFolder(root)
    assert walked.fingerprint() == _relpath_fingerprint(walked)
    monkeypatch.chdir(tmp_path)
    assert ImageFolder("data").fingerprint() == _relpath_fingerprint(walked)      # relative root, same digest
    odd = [os.path.join(root, "a", ".", os.path.basename(walked.paths[0])),
           os.path.join(root, "b", "..", "a", os.path.basename(walked.paths[1])),
           str(tmp_path / "elsewhere.jpg"), os.path.join("data", "b", os.path.basename(walked.paths[-1]))]
    Image.new("RGB", (4, 4)).save(odd[2])
    given = ImageFolder.from_samples([(q, 0) for q in odd] + [(walked.paths[0], 1)] * 5, ["a", "b"], root=root)
    os.remove(odd[2])                                                            # gone since: size -1
    assert given.fingerprint() == _relpath_fingerprint(given)
    assert given.fingerprint() != walked.fingerprint()


def test_an_image_folder_subset_lists_its_files_and_decodes_them(tmp_path):
    root = _tiny_folder(tmp_path / "data")
    src = ImageFolder(root)
    sub = src.subset([4, 0])
    assert type(sub) is ImageFolder and sub.paths == [src.paths[4], src.paths[0]]
    assert sub.labels.tolist() == [1, 0] and sub.classes == ["a", "b"] and sub.mean == src.mean
    assert sub.fingerprint() != src.subset([0, 4]).fingerprint()
    image, label = sub[1]                               # the file at full size, RGB, no recipe
    assert image.dtype == torch.uint8 and tuple(image.shape) == (8, 8, 3) and label == 0
    assert image[0, 0].tolist() == [0, 0, 0]


def test_image_folder_from_samples(tmp_path):
    root = _tiny_folder(tmp_path / "data")
    walked = ImageFolder(root)
    given = ImageFolder.from_samples(list(zip(walked.paths, walked.labels.tolist())), ["a", "b"], root=root)
    assert given.paths == walked.paths and given.fingerprint() == walked.fingerprint()
    assert ImageFolder.from_samples([(walked.paths[0], 0)], ["a", "b", "c"]).num_classes == 3
    assert ImageFolder.from_samples([(walked.paths[0], 0)], ["a"]).root == root / "a"   # the common folder
    with pytest.raises(ValueError, match=r"samples' labels must be integers in \[0, 2\).*labels\[1\] is 2"):
        ImageFolder.from_samples([(walked.paths[0], 0), (walked.paths[1], 2)], ["a", "b"])
    with pytest.raises(TypeError, match=r"samples\[0\] must be a \(path, label\) pair"):
        ImageFolder.from_samples([walked.paths[0]], ["a"])
    with pytest.raises(ValueError, match="samples is empty"):
        ImageFolder.from_samples([], ["a"])


def test_a_dataset_subset_reads_the_datasets_samples_through_its_indices():
    from fastdata.datasets import DatasetSource
    from fastdata.decode import decode

    chw = torch.arange(10, dtype=torch.uint8).reshape(10, 1, 1, 1).expand(10, 1, 2, 2)
    ds = torch.utils.data.TensorDataset(chw, torch.arange(10) % 3)
    sub = DatasetSource(ds).subset([7, 2, 9])
    assert len(sub) == 3 and sub[0][1] == 7 % 3
    d = decode(sub, np.array([2, 0]), Augmentation(), np.random.default_rng(0))
    assert d.images[:, 0, 0, 0].tolist() == [9, 7] and d.labels.tolist() == [0, 1]
    assert d.kept.tolist() == [2, 0]                    # ids of the subset, as the loader asked


def test_torch_subset_and_random_split_become_subsets():
    src = indexed_source(100)
    sub = as_source(torch.utils.data.Subset(src, [9, 3]))
    assert isinstance(sub, ArraySource) and sub.indices.tolist() == [9, 3]
    parts = torch.utils.data.random_split(src, [0.7, 0.3], generator=torch.Generator().manual_seed(1))
    a, b = as_source(parts[0]), as_source(parts[1])
    assert (len(a), len(b)) == (70, 30)
    assert sorted(a.indices.tolist() + b.indices.tolist()) == list(range(100))
    assert torch.equal(parts[0][0][0], a[0][0])           # Subset's own __getitem__ reads the source


# ---------------------------------------------------------------- split
def test_split_is_disjoint_covering_deterministic_and_keeps_statistics():
    src = indexed_source(103)
    train, val, test = split(src, [0.8, 0.1, 0.1], seed=3)
    assert (len(train), len(val), len(test)) == (83, 10, 10)   # floor, then the rest to the first parts
    ids = np.concatenate([p.indices for p in (train, val, test)])
    assert sorted(ids.tolist()) == list(range(103))
    assert all(np.all(np.diff(p.indices) > 0) for p in (train, val, test))   # folder order kept
    assert val.mean == src.mean and val.std == src.std
    again = split(src, [0.8, 0.1, 0.1], seed=3)
    assert all(np.array_equal(p.indices, q.indices) for p, q in zip((train, val, test), again))
    assert not np.array_equal(split(src, [0.8, 0.1, 0.1], seed=4)[1].indices, val.indices)
    assert [len(p) for p in split(src, [100, 3])] == [100, 3]


@pytest.mark.parametrize("fractions, match", [
    ([0.8, 0.3], r"sum to 1\.1, not 1"),
    ([0.5, -0.5, 1.0], r"fractions\[1\] \(a fraction or a count\) must be a number >= 0, got -0\.5"),
    ([0.5, float("nan"), 0.5], r"fractions\[1\] \(a fraction or a count\) must be a finite number >= 0, got nan"),
    ([0.5, "0.5"], r"fractions\[1\] \(a fraction or a count\) must be a number >= 0, got '0.5'"),
    ([90, 5], r"counts \[90, 5\] sum to 95, but .* has 100 samples"),
    ([0.999, 0.001], "part 1 of split .* gets no sample"),
    ([], "non-empty list"),
])
def test_split_errors_name_the_bad_fractions(fractions, match):
    with pytest.raises((ValueError, TypeError), match=match):
        split(indexed_source(100), fractions)


# ---------------------------------------------------------------- loaders over a subset: shards and resume
def _subset_ids(loader):
    return np.concatenate([decode_ids(x) for x, _ in loader])


def test_two_ranks_over_a_subset_are_disjoint_and_cover_it():
    src = indexed_source(300)
    idx = np.random.default_rng(0).permutation(300)[:101]
    seen = [_subset_ids(make_loader(src, "memory", indices=idx, batch_size=16, rank=r, world_size=2,
                                    drop_last=False, device="cpu", augment=Augmentation.none()))
            for r in (0, 1)]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(np.concatenate(seen).tolist()) == sorted(idx.tolist())


@pytest.mark.parametrize("backend", ["memory", "torch"])
def test_a_subset_loader_resumes_mid_epoch_and_refuses_another_subset(backend):
    src = indexed_source(300)
    sub = src.subset(np.arange(0, 300, 3))
    kw = dict(batch_size=10, device="cpu", num_workers=0, seed=7, augment=Augmentation.none())
    whole = [decode_ids(x) for x, _ in make_loader(sub, backend, **kw)]
    a = make_loader(sub, backend, **kw)
    it = iter(a)
    first = [decode_ids(next(it)[0]) for _ in range(4)]
    state = a.state_dict()
    b = make_loader(src, backend, indices=np.arange(0, 300, 3), **kw)
    b.load_state_dict(state)
    rest = [decode_ids(x) for x, _ in b]
    assert all(np.array_equal(p, q) for p, q in zip(first + rest, whole, strict=True))
    other = make_loader(src.subset(np.arange(1, 300, 3)), backend, **kw)
    with pytest.raises(ValueError, match=r"source was '.* subset=[0-9a-f]{8}' and is now '.* subset="):
        other.load_state_dict(state)


def test_a_plain_dataset_says_what_memory_and_dali_read_instead():
    src = as_source(_Samples([np.zeros((4, 4), np.uint8)] * 4))
    assert ArraySource.refusal_hint is None and ImageFolder.refusal_hint is None
    assert "pass ArraySource(images, labels) or an image folder" in src.refusal_hint
    assert src.sample_transform is None
    with pytest.raises(TypeError, match=r"cannot read .*: memory and dali read arrays or files.*use the torch "
                                        r"backend"):
        make_loader(src, "memory", batch_size=2, device="cpu")


def test_channel_stats_are_exact_and_bounded_in_memory():
    """They were numpy's float32 mean/std of a float32 copy of up to 10,000 images: 2.4 GB of RAM
    for a 215 MB array of photos, and std off in the 4th digit. Now a per-channel histogram, in chunks."""
    import tracemalloc

    from fastdata.datasets import channel_stats

    images = np.random.default_rng(0).integers(0, 256, (200, 64, 64, 3), dtype=np.uint8)   # 2.4 MB
    mean, std = channel_stats(images, chunk_bytes=10_000)   # many chunks
    exact = images.astype(np.float64) / 255
    np.testing.assert_allclose(mean, exact.mean(axis=(0, 1, 2)), rtol=1e-12)
    np.testing.assert_allclose(std, exact.std(axis=(0, 1, 2)), rtol=1e-12)
    tracemalloc.start()
    assert channel_stats(images, chunk_bytes=2**16) == (mean, std)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * 2**16 < images.nbytes / 2, peak   # a few chunks' worth, whatever the array's size
    assert channel_stats(np.zeros((2, 3, 3, 1), np.uint8)) == ((0.0,), (1e-3,))


@pytest.mark.parametrize("backend", ["torch", "memory"])
def test_a_read_only_memmap_is_not_copied_into_ram(tmp_path, backend):
    """np.load(mmap_mode="r") is numpy's usual way to open an array larger than RAM: ArraySource copied
    every read-only array whole. It is now kept as it is, and read without torch's not-writable warning."""
    import warnings

    images = np.random.default_rng(0).integers(0, 256, (64, 8, 8, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", np.arange(64) % 4)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        src = ArraySource(mapped, np.load(tmp_path / "y.npy", mmap_mode="r"), mean=(0.5,) * 3, std=(0.25,) * 3)
        assert np.shares_memory(src.images, mapped)
        image, label = src[3]
        image += 1                                     # a writable copy: the file's map is untouched
        assert np.array_equal(np.asarray(mapped[3]), images[3]) and label == 3
        loader = make_loader(src, backend, batch_size=16, device="cpu", num_workers=0, train=False)
        x = torch.cat([x for x, _ in loader])
    expected = (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(x, expected)


def test_fastdatas_own_sources_wrapped_in_concat_or_subset_keep_their_layout():
    """source[i] is an (H, W, C) tensor: wrapped in ConcatDataset it was read as (C, H, W), refused for
    28x28 digits ("expected uint8 (C, H, W)") and silently transposed for images 3 px high."""
    from torch.utils.data import ConcatDataset, Subset

    digits = ConcatDataset([SyntheticDigits(6, seed=1), SyntheticDigits(4, train=False, seed=2)])
    x, y = next(iter(make_loader(Subset(digits, range(10)), "torch", batch_size=10, device="cpu", num_workers=0,
                                 train=False, mean=(0.5,), std=(0.25,))))
    assert x.shape == (10, 1, 28, 28)
    first = digits[0][0]
    torch.testing.assert_close(x[0, 0], (first[..., 0].float() / 255 - 0.5) / 0.25)
    flat = np.arange(4 * 3 * 8 * 3, dtype=np.uint8).reshape(4, 3, 8, 3)   # 3 px high, 8 wide
    both = ConcatDataset([ArraySource(flat, np.arange(4) % 2), ArraySource(flat, np.arange(4) % 2)])
    x, _ = next(iter(make_loader(both, "torch", batch_size=8, device="cpu", num_workers=0, train=False,
                                 mean=(0.0,) * 3, std=(1.0,) * 3)))
    assert x.shape == (8, 3, 3, 8)
    torch.testing.assert_close(x[1].permute(1, 2, 0) * 255, torch.from_numpy(flat[1]).float())
    # Training flips: the batches mirror copies, never the sources' (and the caller's) arrays.
    before = flat.copy()
    for _ in make_loader(both, "torch", batch_size=8, device="cpu", num_workers=0, train=True,
                         augment=Augmentation(crop="none", hflip=1.0), mean=(0.0,) * 3, std=(1.0,) * 3):
        pass
    assert np.array_equal(flat, before)
    # A DatasetSource hands out its dataset's own (C, H, W) tensors: wrapped again, they stay (C, H, W).
    from fastdata.datasets import DatasetSource

    class CHW(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.full((3, 10, 12), i, dtype=torch.uint8), i % 2

    twice = ConcatDataset([DatasetSource(CHW()), DatasetSource(CHW())])
    x, _ = next(iter(make_loader(twice, "torch", batch_size=4, device="cpu", num_workers=0, train=False,
                                 mean=(0.0,) * 3, std=(1.0,) * 3)))
    assert x.shape == (4, 3, 10, 12)


# ---------------------------------------------------------------- a float transform, per backend
#: What the refusal of a float transform must say for the backends that run no per-sample transform.
BATCH_ONLY = r"Backends 'memory' and 'dali' run no per-sample transform"


def named_recipes(message: str) -> list[str]:
    """The Augmentation presets a message names, each checked to exist (a hint must not name a made-up one)."""
    presets = re.findall(r"Augmentation\.(\w+)\(\)", message)
    assert {"imagenet_train", "imagenet_eval", "cifar_train", "digits_train"} <= set(presets), message
    assert all(callable(getattr(Augmentation, p, None)) for p in presets), presets
    return presets


@pytest.mark.parametrize("backend", [p for p in backend_params(auto=True) if p.values[0] in ("memory", "dali", "auto")])
def test_a_float_transform_refusal_names_the_way_out_for_the_backend_asked(photo_folder, backend):
    """ImageFolder(transform=Compose([..., ToTensor(), Normalize()])) said only "drop ToTensor/Normalize, pass
    mean=/std=": for memory and dali, which run no per-sample transform, doing so met a second refusal. The
    first one now says so and names their way out (no transform, augment=Augmentation(...)), and torch's."""
    from torchvision import transforms as T

    crop = [T.Resize(40), T.CenterCrop(32)]
    stats = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    with pytest.raises(TypeError) as err:
        ImageFolder(photo_folder, transform=T.Compose([*crop, T.ToTensor(), T.Normalize(**stats)]))
    message = str(err.value)
    assert "drop ToDtype/Normalize/ToTensor from the transform and pass mean=/std= to make_loader for " \
           "backend 'torch' or 'prefetch', which run per-sample transforms ('auto' picks one of them" in message
    assert re.search(rf"{BATCH_ONLY} .*: for them drop the transform from ImageFolder '.*', and pass "
                     r"augment=Augmentation\(\.\.\.\) with mean=/std= to make_loader", message), message
    assert "fields crop (one of ['none', 'translate', 'random_resized', 'center']), size, pad" in message
    named_recipes(message)
    kw = {"batch_size": 6, "device": "cpu", "num_workers": 0, "train": False, "quiet": True, **stats}
    if backend == "auto":   # the first way: the transform without its float steps
        loader = make_loader(ImageFolder(photo_folder, transform=T.Compose(crop)), backend, **kw)
    else:                   # memory/dali's way: no transform, the recipe as augment=
        loader = make_loader(ImageFolder(photo_folder), backend, augment=Augmentation.imagenet_eval(size=32, resize=40),
                             **kw)
    with loader:
        images, _ = next(iter(loader))
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.float32


def test_the_backends_a_float_transform_refusal_names_are_the_registrys():
    """The refusal is written when the source is made, before any backend is named: the backends it names as
    running per-sample transforms, and as not, are the ones whose classes say so."""
    from fastdata import registry
    from fastdata.datasets.sample_transforms import BATCH_BACKENDS, PER_SAMPLE_BACKENDS

    runs = {s.name: s.load().runs_sample_transforms for s in registry.specs() if s.available}
    assert {n for n, r in runs.items() if r} == set(PER_SAMPLE_BACKENDS) & set(runs)
    assert {n for n, r in runs.items() if not r} == set(BATCH_BACKENDS) & set(runs)
    assert set(PER_SAMPLE_BACKENDS) | set(BATCH_BACKENDS) == set(registry.BACKENDS)


@pytest.mark.parametrize("backend", [p for p in backend_params() if p.values[0] in ("memory", "dali")])
def test_a_datasets_float_sample_refusal_says_memory_and_dali_read_no_dataset(backend):
    """A Dataset of one's own returning float tensors: 'drop ToTensor, pass mean=/std=' alone left memory and
    dali refusing the Dataset itself. The first refusal names their way: the pixels as an ArraySource."""
    images = np.random.default_rng(0).integers(0, 256, (8, 6, 5, 3), dtype=np.uint8)
    floats = [torch.from_numpy(im).permute(2, 0, 1).float() / 255 for im in images]
    with pytest.raises(TypeError) as err:
        make_loader(_Samples(floats), backend, batch_size=4, device="cpu")
    message = str(err.value)
    assert re.search(rf"{BATCH_ONLY} .*: for them _Samples cannot serve at all, transform or not .* pass "
                     r"ArraySource\(images, labels\)", message), message
    named_recipes(message)
    with make_loader(ArraySource(images, np.zeros(8, np.int64)), backend, batch_size=4, device="cpu",
                     augment=Augmentation.none(), mean=(0.5,), std=(0.25,), num_workers=0) as loader:
        assert next(iter(loader))[0].shape == (4, 3, 6, 5)
