"""A user's own data through every backend: what a training script that already has a dataset meets
when it switches to fastdata (evaluation loaders made ``like=`` the training one, torch's
``ConcatDataset``/``TensorDataset``, torchvision datasets in their on-disk layouts).

Every dataset is made here, small; torchvision's own classes read it where they exist.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision  # a core dependency, as torch (tests/test_sources_torchvision.py)
from torchvision.transforms import v2

from conftest import backend_params
from fastdata import Augmentation, make_loader
from fastdata.datasets import make_image_folder

CPU = dict(device="cpu", num_workers=0, quiet=True)


@pytest.fixture(scope="module")
def small_photos(tmp_path_factory):
    """2 classes x 3 JPEGs of 60-80 x 50-70 px: photos of mixed sizes, quick to decode."""
    return make_image_folder(tmp_path_factory.mktemp("small"), classes=2, per_class=3, seed=4,
                             size_range=((60, 80), (50, 70)))


def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


# ---------------------------------------------------------------- like=: the evaluation loader
@pytest.mark.parametrize("backend", ["torch", "memory", "dali"])
def test_an_evaluation_loader_like_a_training_loader_crops_at_its_size(small_photos, backend):
    """A model trained on imagenet_train(size=32) was evaluated by a like= loader at 224 (the source's
    default evaluation crop): another resolution than the one it learnt. The evaluation crop now
    follows the training crop's size, the shorter side resized in the default recipe's proportion."""
    from fastdata.datasets import ImageFolder

    train = make_loader(ImageFolder(small_photos), backend, batch_size=2, augment=Augmentation.imagenet_train(size=32),
                        **CPU)
    val = make_loader(ImageFolder(small_photos), backend, like=train)
    assert val.augment == Augmentation.imagenet_eval(size=32, resize=37)
    expected = make_loader(ImageFolder(small_photos), backend, batch_size=2, train=False, mean=train.mean,
                           std=train.std, augment=Augmentation.imagenet_eval(size=32, resize=37), **CPU)
    got, want = _batches(val), _batches(expected)
    assert [tuple(x.shape) for x, _ in got] == [(2, 3, 32, 32)] * 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))


def test_like_keeps_the_callers_recipe_and_a_training_crop_of_the_default_size(small_photos):
    from fastdata.datasets import ImageFolder

    src = ImageFolder(small_photos)
    train = make_loader(src, "torch", batch_size=2, augment=Augmentation.imagenet_train(size=32), **CPU)
    mine = Augmentation.imagenet_eval(size=48, resize=64)
    assert make_loader(src, "torch", like=train, augment=mine).augment == mine
    # A center-cropping training loader hands over its own resize.
    center = make_loader(src, "torch", batch_size=2, augment=Augmentation.imagenet_eval(size=40, resize=60), **CPU)
    assert make_loader(src, "torch", like=center).augment == Augmentation.imagenet_eval(size=40, resize=60)
    # The default training crop (224) leaves the default evaluation recipe.
    default = make_loader(src, "torch", batch_size=2, **CPU)
    assert make_loader(src, "torch", like=default).augment == Augmentation.imagenet_eval()
    # like=..., train=True asks for a training loader: its own training recipe.
    assert make_loader(src, "torch", like=train, train=True).augment == Augmentation.imagenet_train()


def test_like_leaves_a_per_sample_transform_alone(small_photos):
    """An evaluation source with its own transform (Resize + CenterCrop) is its own recipe: like= must
    not add one (a recipe on top of a transform is refused)."""
    train = make_loader(torchvision.datasets.ImageFolder(str(small_photos)), "torch", batch_size=2,
                        augment=Augmentation.imagenet_train(size=32), **CPU)
    val_ds = torchvision.datasets.ImageFolder(str(small_photos), transform=v2.Compose([
        v2.Resize(40), v2.CenterCrop(32), v2.PILToTensor()]))
    val = make_loader(val_ds, "torch", like=train)
    assert val.augment == Augmentation.none()
    assert next(iter(val))[0].shape == (2, 3, 32, 32)


@pytest.mark.parametrize("backend", ["torch", "memory", "dali"])
def test_like_follows_a_size_set_in_the_training_sources_transform(small_photos, backend):
    """Trained through a torchvision transform (RandomResizedCrop(48) in a Compose, the torch backend),
    a like= evaluation loader of a plain folder evaluated at 224: the size lives in the transform, not
    in the loader's recipe. It now evaluates at 48, the shorter side resized to round(48 * 256 / 224)."""
    from fastdata.datasets import ImageFolder

    train_ds = torchvision.datasets.ImageFolder(str(small_photos), transform=v2.Compose([
        v2.RandomResizedCrop(48), v2.RandomHorizontalFlip(), v2.PILToTensor()]))
    train = make_loader(train_ds, "torch", batch_size=2, **CPU)
    val = make_loader(ImageFolder(small_photos), backend, like=train)
    assert val.augment == Augmentation.imagenet_eval(size=48, resize=55)
    assert next(iter(val))[0].shape == (2, 3, 48, 48)


def test_output_size_reads_the_size_a_transform_ends_at():
    from fastdata.datasets.sample_transforms import output_size

    T = torchvision.transforms
    assert output_size(T.Compose([T.RandomResizedCrop(96), T.RandomHorizontalFlip(), T.PILToTensor()])) == (96, 96)
    assert output_size(T.Compose([T.Resize(256), T.CenterCrop(224)])) == (224, 224)
    assert output_size(T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])) == (32, 32)
    assert output_size(v2.Compose([v2.Resize((64, 48))])) == (64, 48)
    # The photos keep sizes of their own: a shorter side alone, a max_size alone, no resizing step.
    assert output_size(T.Compose([T.Resize(256)])) is None
    assert output_size(v2.Compose([v2.RandomResizedCrop(160), v2.Resize(None, max_size=200)])) is None
    assert output_size(T.RandomHorizontalFlip()) is None
    # A crop that runs only sometimes: the size is not fixed; one that runs always, under a jitter that may not.
    assert output_size(T.RandomApply([T.CenterCrop(20)], p=0.5)) is None
    assert output_size(T.Compose([T.CenterCrop(20), T.RandomApply([T.ColorJitter(0.1)], p=0.5)])) == (20, 20)


@pytest.mark.requires("timm")
def test_output_size_reads_timms_transforms():
    """timm's training transform crops with its own class (RandomResizedCropAndInterpolation), known by
    its name and its torchvision-like ``size``."""
    from timm.data import create_transform

    from fastdata.datasets.sample_transforms import output_size

    assert output_size(create_transform(128, is_training=True)) == (128, 128)
    assert output_size(create_transform(128)) == (128, 128)


# ---------------------------------------------------------------- torch's ConcatDataset
def _photo(path, value, size=(12, 10)):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 255 - value, value // 2)).save(path)


@pytest.fixture
def two_folders(tmp_path):
    """A training folder (cat, dog) and an extra one holding only cat photos: torchvision labels both
    cat folders 0, so concatenated they agree."""
    for i in range(3):
        _photo(tmp_path / "main" / "cat" / f"{i}.png", 10 + i)
        _photo(tmp_path / "main" / "dog" / f"{i}.png", 100 + i)
    for i in range(2):
        _photo(tmp_path / "extra" / "cat" / f"x{i}.png", 200 + i)
    return tmp_path / "main", tmp_path / "extra"


@pytest.mark.parametrize("backend", backend_params(auto=True) + ["dali:decode=dali"])
def test_a_concat_of_two_image_folders_is_read_by_every_backend_with_its_classes(two_folders, backend):
    """ConcatDataset([ImageFolder(a), ImageFolder(b)]) was a Dataset memory and dali refused, whose
    classes and class count were unknown (0). It is now one file list: every backend reads it, the
    classes are the folders', and the batches are those of the same list given as samples."""
    from fastdata.datasets import ImageFolder

    main, extra = (torchvision.datasets.ImageFolder(str(f)) for f in two_folders)
    both = torch.utils.data.ConcatDataset([main, extra])
    backend, _, decode = backend.partition(":decode=")   # dali with its own decoder too (on the CPU here)
    opts = {"decode": decode} if decode else {}
    kw = dict(batch_size=4, train=False, augment=Augmentation.imagenet_eval(size=8, resize=8), **CPU, **opts)
    loader = make_loader(both, backend, **kw)
    assert loader.classes == ["cat", "dog"] and loader.num_classes == 2 and len(loader.dataset) == 8
    same = make_loader(ImageFolder.from_samples(main.samples + extra.samples, ["cat", "dog"]), backend, **kw)
    got, want = _batches(loader), _batches(same)
    assert len(got) == len(loader) == 2
    assert torch.cat([y for _, y in got]).tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want))


def test_a_concat_whose_parts_name_their_classes_differently_is_refused(two_folders, tmp_path):
    """A folder of (bird, cat) after one of (cat, dog): label 0 is cat in one and bird in the other. The
    DataLoader mixes them without a word; fastdata names the clash."""
    for name in ("bird", "cat"):
        _photo(tmp_path / "other" / name / "a.png", 50)
    parts = [torchvision.datasets.ImageFolder(str(two_folders[0])),
             torchvision.datasets.ImageFolder(str(tmp_path / "other"))]
    with pytest.raises(ValueError, match=r"class 0 is 'bird' in the one and 'cat' in the other.*label 0"):
        make_loader(torch.utils.data.ConcatDataset(parts), "torch", **CPU)


def test_a_concat_of_cifar_train_and_test_is_one_array(tmp_path):
    from fastdata.datasets import ArraySource, as_source
    from test_sources_torchvision import _LocalCIFAR10, write_cifar10

    write_cifar10(tmp_path)
    train, test = _LocalCIFAR10(str(tmp_path), train=True), _LocalCIFAR10(str(tmp_path), train=False)
    src = as_source(torch.utils.data.ConcatDataset([train, test]))
    assert isinstance(src, ArraySource) and len(src) == len(train) + len(test) and src.classes == train.classes
    assert src.labels.tolist() == list(train.targets) + list(test.targets)
    loader = make_loader(torch.utils.data.ConcatDataset([train, test]), "memory", batch_size=len(src), train=False,
                         mean=(0.0,) * 3, std=(1.0,) * 3, **CPU)
    images, labels = next(iter(loader))
    last = np.array(test[len(test) - 1][0])  # torchvision's own PIL image of the last sample
    assert torch.equal((images[-1].permute(1, 2, 0) * 255).round().byte(), torch.from_numpy(last))
    assert labels[-1].item() == test[len(test) - 1][1]


def test_a_concat_that_stays_a_dataset_keeps_its_parts_classes_and_labels(two_folders):
    """A part with a transform of its own keeps the ConcatDataset a Dataset (torch and prefetch): its
    classes and label count come from the parts instead of being unknown."""
    main = torchvision.datasets.ImageFolder(str(two_folders[0]), transform=v2.Compose([v2.Resize((8, 8)),
                                                                                     v2.PILToTensor()]))
    extra = torchvision.datasets.ImageFolder(str(two_folders[1]), transform=main.transform)
    loader = make_loader(torch.utils.data.ConcatDataset([main, extra]), "torch", batch_size=4, train=False, **CPU)
    assert loader.classes == ["cat", "dog"] and loader.num_classes == 2
    assert loader.dataset.labels.tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert [y.tolist() for _, y in loader] == [[0, 0, 0, 1], [1, 1, 0, 0]]


# ---------------------------------------------------------------- torch's TensorDataset
@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_a_tensor_dataset_of_uint8_images_is_read_by_every_backend_as_its_arrays(backend):
    """TensorDataset(images (N, C, H, W) uint8, labels) was a Dataset memory and dali refused, with an
    unknown class count. It is the arrays it holds: every backend reads it, as the same ArraySource."""
    from fastdata.datasets import ArraySource

    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (10, 3, 6, 5), dtype=torch.uint8, generator=gen)
    labels = torch.arange(10) % 4
    kw = dict(batch_size=4, train=True, seed=2, drop_last=False, **CPU)
    loader = make_loader(torch.utils.data.TensorDataset(images, labels), backend, **kw)
    assert loader.num_classes == 4 and len(loader) == 3
    same = make_loader(ArraySource(images.permute(0, 2, 3, 1).numpy(), labels.numpy()), backend, **kw)
    got, want = _batches(loader), _batches(same)
    assert [tuple(x.shape) for x, _ in got] == [(4, 3, 6, 5), (4, 3, 6, 5), (2, 3, 6, 5)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    # The pixels of sample i are the tensor's (C, H, W), as the Dataset hands them out.
    plain = make_loader(torch.utils.data.TensorDataset(images, labels), backend, batch_size=10, train=False,
                        mean=(0.0,) * 3, std=(1.0,) * 3, **CPU)
    x, y = next(iter(plain))
    assert torch.equal((x * 255).round().byte(), images) and torch.equal(y, labels)


def test_a_tensor_dataset_of_float_images_is_refused_saying_how_to_hand_them_over():
    """A TensorDataset of float images got the per-sample transform advice ("drop ToTensor from the
    transform") and was told memory and dali cannot read a TensorDataset at all. The refusal now says
    how to hand the pixels over as uint8, and that normalized ones would be normalized twice."""
    grey = torch.utils.data.TensorDataset(torch.zeros(4, 7, 7, dtype=torch.uint8), torch.tensor([0, 1, 2, 1]))
    assert next(iter(make_loader(grey, "memory", batch_size=4, train=False, **CPU)))[0].shape == (4, 1, 7, 7)
    labels = torch.tensor([0, 1, 2, 1])
    unit = torch.linspace(0, 1, 4 * 3 * 7 * 7).reshape(4, 3, 7, 7)
    with pytest.raises(TypeError, match=r"TensorDataset holds torch.float32 images \(values from 0 to 1\);"
                                        r".*TensorDataset\(\(images \* 255\).round\(\).clamp\(0, 255\)"):
        make_loader(torch.utils.data.TensorDataset(unit, labels), "memory", **CPU)
    with pytest.raises(TypeError, match=r"normalized already, which the loader's normalization would repeat.*"
                                        r"un-normalize them \(images \* std \+ mean\)"):
        make_loader(torch.utils.data.TensorDataset((unit - 0.5) / 0.25, labels), "torch", **CPU)


# ---------------------------------------------------------------- a Dataset of the user's own
class _Tabled(torch.utils.data.Dataset):
    """A Dataset as a table-driven one is written: class names from ``np.unique`` of a column."""

    def __init__(self, labels):
        self.names = ["dog", "cat", "bird", "cat", "dog", "bird"]
        self.classes = np.unique(self.names)          # a numpy array: ['bird', 'cat', 'dog']
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return np.full((5, 5, 3), i, np.uint8), self.labels[i]


def test_class_names_in_a_numpy_array_are_the_datasets_classes():
    """classes = np.unique(...) was dropped (only a list or tuple counted): num_classes 0, MixUp refused
    and a label past the classes went unchecked."""
    loader = make_loader(_Tabled([2, 1, 0, 1, 2, 0]), "torch", batch_size=3, **CPU)
    assert loader.classes == ["bird", "cat", "dog"] and loader.num_classes == 3
    assert all(type(c) is str for c in loader.classes)
    with pytest.raises(ValueError, match=r"_Tabled\[1\] returned label 3; labels must be integers in \[0, 3\)"):
        list(make_loader(_Tabled([2, 3, 0, 1, 2, 0]), "torch", batch_size=3, shuffle=False, **CPU))


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i % 2


class _Short(_Pairs):
    """A batched fetch that loses the last index (a bug of the user's)."""

    def __getitems__(self, indices):
        return [self[i] for i in indices][:-1]


class _Collated(_Pairs):
    """A batched fetch that collates, for a DataLoader with a collate_fn of the user's."""

    def __getitems__(self, indices):
        return torch.stack([self[i][0] for i in indices]), torch.tensor([self[i][1] for i in indices])


def test_a_batched_fetch_that_returns_fewer_samples_is_an_error_not_a_shorter_epoch():
    """__getitems__'s result was zipped with the ids: one sample short made every batch 3 of 4 and the
    epoch 6 of 8 samples, silently (drop_last=False promises each sample once)."""
    with pytest.raises(TypeError, match=r"_Short.__getitems__\(4 indices\) returned a 3-item list; fastdata "
                                        r"reads a list of 4 \(image, label\) pairs"):
        list(make_loader(_Short(), "torch", batch_size=4, train=False, **CPU))


def test_a_batched_fetch_that_collates_is_named_as_such():
    with pytest.raises(TypeError, match=r"_Collated.__getitems__\(2 indices\)\[0\] returned an object of type "
                                        r"Tensor"):
        list(make_loader(_Collated(), "torch", batch_size=2, train=False, **CPU))
    with pytest.raises(TypeError, match=r"_Collated.__getitems__\(4 indices\) returned a 2-item tuple"):
        list(make_loader(_Collated(), "torch", batch_size=4, train=False, **CPU))


def test_a_dataloader_or_an_iterable_dataset_is_refused_with_what_to_pass():
    """A script switching to fastdata hands over the DataLoader it had: the error named only the kinds
    of source, not that the loader's dataset is one."""
    data = torch.utils.data.TensorDataset(torch.zeros(4, 3, 4, 4, dtype=torch.uint8), torch.arange(4))
    with pytest.raises(TypeError, match=r"this is a DataLoader: pass its dataset \(make_loader\(loader.dataset, "
                                        r"batch_size=2"):
        make_loader(torch.utils.data.DataLoader(data, batch_size=2), "torch", **CPU)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from data

        def __len__(self):   # for progress bars; it was then read as a map-style Dataset, whose
            return len(data)  # __getitem__ (Dataset's) raised NotImplementedError

    with pytest.raises(TypeError, match=r"an IterableDataset has no __getitem__.*map-style Dataset"):
        make_loader(Stream(), "torch", **CPU)


# ---------------------------------------------------------------- QMNIST: targets of 8 fields a sample
def write_qmnist(root, n: int = 12) -> np.ndarray:
    """QMNIST's training files under root/QMNIST/raw (images idx3 ubyte, labels idx2 int32 rows of 8:
    digit, NIST class, writer, ...); returns the label rows."""
    import struct

    rng = np.random.default_rng(0)
    raw = root / "QMNIST" / "raw"
    raw.mkdir(parents=True)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    rows = np.zeros((n, 8), np.int32)
    rows[:, 0] = (np.arange(n) * 7) % 10          # the digit
    rows[:, 2] = 300 + np.arange(n)               # the writer
    rows[:, 5] = np.arange(n) * 1000              # the index in NIST
    (raw / "qmnist-train-images-idx3-ubyte").write_bytes(struct.pack(">HBB", 0, 8, 3) + struct.pack(">III", n, 28, 28)
                                                         + images.tobytes())
    (raw / "qmnist-train-labels-idx2-int").write_bytes(struct.pack(">HBB", 0, 0x0C, 2) + struct.pack(">II", n, 8)
                                                       + rows.astype(">i4").tobytes())
    return rows


@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_qmnist_is_read_by_every_backend_labelled_by_its_digit(tmp_path, backend):
    """QMNIST crashed every backend with "can only convert an array of size 1 to a Python scalar": its
    targets, rows of 8 fields, were checked as one label each. With compat=True (its default) its label
    is the digit, and it is now the digits' arrays."""
    rows = write_qmnist(tmp_path)
    ds = torchvision.datasets.QMNIST(str(tmp_path), what="train", download=False)
    loader = make_loader(ds, backend, batch_size=6, train=False, mean=(0.0,), std=(1.0,), **CPU)
    assert loader.num_classes == 10 and loader.classes == ds.classes
    got = list(loader)
    assert torch.cat([y for _, y in got]).tolist() == rows[:, 0].tolist() == [ds[i][1] for i in range(len(ds))]
    first = torch.from_numpy(np.array(ds[0][0]))
    assert torch.equal((got[0][0][0, 0] * 255).round().byte(), first)


def test_qmnist_without_compat_stays_a_dataset_whose_row_labels_are_refused_by_name(tmp_path):
    write_qmnist(tmp_path)
    ds = torchvision.datasets.QMNIST(str(tmp_path), what="train", download=False, compat=False)
    loader = make_loader(ds, "torch", batch_size=6, train=False, **CPU)     # made: its targets are not read
    with pytest.raises(ValueError, match=r"QMNIST\[0\] returned label tensor\(\[ *0, +0, 300,"):
        next(iter(loader))
    from fastdata.datasets import check_labels

    with pytest.raises(ValueError, match=r"rows must hold one integer per sample, got shape \(3, 2\)"):
        check_labels(np.zeros((3, 2), np.int64), "rows")


# ---------------------------------------------------------------- a broken file inside a Dataset
@pytest.fixture
def folder_with_broken_files(tmp_path):
    """Two classes of 2 PNGs, plus two files that are not images in class a (sorted after the good ones)."""
    for c in ("a", "b"):
        for i in range(2):
            _photo(tmp_path / c / f"{i}.png", 40 * i + (0 if c == "a" else 100))
    for i in range(2):
        (tmp_path / "a" / f"bad{i}.png").write_bytes(b"not a png")
    return tmp_path


@pytest.mark.parametrize("backend", ["torch", "prefetch"])
def test_on_error_skip_skips_a_broken_file_of_a_dataset_with_a_transform(folder_with_broken_files, backend):
    """A torchvision ImageFolder with a transform stays a Dataset: its broken file raised Pillow's
    UnidentifiedImageError from __getitem__, and on_error="skip" did not skip it (the same folder without
    the transform skipped it). It is now the DecodeError naming the file, skipped and counted."""
    ds = torchvision.datasets.ImageFolder(str(folder_with_broken_files), transform=v2.Compose([
        v2.Resize((8, 8)), v2.PILToTensor()]))
    kw = dict(batch_size=2, train=False, **CPU)
    loader = make_loader(ds, backend, on_error="skip", **kw)
    with pytest.warns(RuntimeWarning, match="skipped 2"):
        got = list(loader)
    assert [tuple(x.shape) for x, _ in got] == [(2, 3, 8, 8), (0, 3, 8, 8), (2, 3, 8, 8)] and loader.skipped == 2
    assert [y.tolist() for _, y in got] == [[0, 0], [], [1, 1]]
    from fastdata import DecodeError

    with pytest.raises(DecodeError, match=r"bad0.png.*UnidentifiedImageError") as caught:
        list(make_loader(ds, backend, **kw))
    assert caught.value.path == str(folder_with_broken_files / "a" / "bad0.png")


class _Unreadable(_Pairs):
    """A user's Dataset reading files in a batch (``__getitems__``): sample 5's file is gone."""

    def __getitem__(self, i):
        if i == 5:
            raise FileNotFoundError(2, "No such file or directory", f"/data/{i}.png")
        if i == 6:
            raise KeyError("a bug of the user's, not a broken file")
        return super().__getitem__(i)

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def test_a_batched_fetch_that_fails_on_one_file_skips_only_that_one_and_a_bug_still_raises():
    loader = make_loader(torch.utils.data.Subset(_Unreadable(), [4, 5, 7]), "torch", batch_size=3, train=False,
                         on_error="skip", mean=(0.0,) * 3, std=(1.0,) * 3, **CPU)
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        (x, y), = list(loader)
    assert (x[:, 0, 0, 0] * 255).round().tolist() == [4, 7] and y.tolist() == [0, 1]
    from fastdata import DecodeError

    with pytest.raises(DecodeError, match=r"'_Unreadable\[5\]': FileNotFoundError"):
        list(make_loader(_Unreadable(), "torch", batch_size=8, train=False, **CPU))
    with pytest.raises(KeyError, match="a bug of the user's"):      # not a file that cannot be read
        list(make_loader(torch.utils.data.Subset(_Unreadable(), [6]), "torch", batch_size=1, train=False,
                         on_error="skip", **CPU))


def test_a_broken_first_file_does_not_refuse_a_dataset_that_skip_reads(folder_with_broken_files):
    """The first sample is read to learn the channels: a broken first photo raised Pillow's error when
    the loader was made, so on_error="skip" never got to skip it."""
    (folder_with_broken_files / "a" / "0.png").write_bytes(b"broken first")
    ds = torchvision.datasets.ImageFolder(str(folder_with_broken_files), transform=v2.Compose([
        v2.Resize((8, 8)), v2.PILToTensor()]))
    loader = make_loader(ds, "torch", batch_size=6, train=False, on_error="skip", **CPU)
    with pytest.warns(RuntimeWarning, match="skipped 3"):
        (x, y), = list(loader)
    assert x.shape == (3, 3, 8, 8) and y.tolist() == [0, 1, 1]
    from fastdata import DecodeError

    class Gone(_Pairs):   # no sample can be read: the error is the first one's, naming it
        def __getitem__(self, i):
            raise FileNotFoundError(2, "No such file or directory", f"/data/{i}.png")

    with pytest.raises(DecodeError, match=r"'Gone\[0\]': FileNotFoundError.*/data/0.png"):
        make_loader(Gone(), "torch", batch_size=2, train=False, on_error="skip", **CPU)


class _NamedTargets(_Pairs):
    """targets hold class names; __getitem__ turns them into indices."""

    classes = ["cat", "dog"]
    targets = ["cat", "dog", "dog", "cat", "cat", "dog", "cat", "dog"]

    def __getitem__(self, i):
        return super().__getitem__(i)[0], self.classes.index(self.targets[i])


def test_targets_that_are_names_are_left_to_getitem_not_refused():
    """A Dataset keeping class names in .targets was refused ("targets must be integers") for an
    attribute fastdata only peeks at; its labels are those __getitem__ returns."""
    loader = make_loader(_NamedTargets(), "torch", batch_size=8, train=False, **CPU)
    assert loader.classes == ["cat", "dog"]
    assert next(iter(loader))[1].tolist() == [0, 1, 1, 0, 0, 1, 0, 1]


# ---------------------------------------------------------------- SVHN, STL10, USPS: arrays too
def _stl10(root, monkeypatch, n: int = 6):
    """STL10's binary files (images stored column by column, labels 1..10) under root/stl10_binary."""
    folder = root / "stl10_binary"
    folder.mkdir()
    images = np.random.default_rng(1).integers(0, 256, (n, 3, 96, 96), dtype=np.uint8)
    (folder / "train_X.bin").write_bytes(images.tobytes())
    (folder / "train_y.bin").write_bytes((np.arange(n) % 10 + 1).astype(np.uint8).tobytes())
    (folder / "unlabeled_X.bin").write_bytes(images.tobytes())
    (folder / "class_names.txt").write_text("\n".join(f"class{i}" for i in range(10)))
    monkeypatch.setattr(torchvision.datasets.STL10, "_check_integrity", lambda self: True)   # no md5 of real files


def _svhn(n: int = 6):
    """An SVHN as torchvision's constructor leaves it (data (N, 3, 32, 32), labels 0..9), made without
    its .mat file (scipy reads those)."""
    ds = torchvision.datasets.SVHN.__new__(torchvision.datasets.SVHN)
    torch.utils.data.Dataset.__init__(ds)
    ds.root, ds.split, ds.transform, ds.target_transform, ds.transforms = "svhn", "train", None, None, None
    ds.data = np.random.default_rng(2).integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    ds.labels = (np.arange(n) * 3) % 10
    return ds


def _usps(root, n: int = 6):
    """USPS's bz2 libsvm file: a label 1..10, then 256 values in [-1, 1] per line."""
    import bz2

    values = np.random.default_rng(3).uniform(-1, 1, (n, 256))
    lines = [f"{i % 10 + 1} " + " ".join(f"{j + 1}:{v:.4f}" for j, v in enumerate(row)) for i, row in enumerate(values)]
    (root / "usps.bz2").write_bytes(bz2.compress("\n".join(lines).encode()))   # read without a checksum


@pytest.mark.parametrize("kind", ["stl10", "svhn", "usps"])
@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_svhn_stl10_and_usps_are_read_by_every_backend_as_their_arrays(tmp_path, monkeypatch, kind, backend):
    """They were Datasets memory and dali refused ("pass ArraySource(images, labels)"), though their
    pixels and labels are arrays like CIFAR's. Every backend now gives the pixels their __getitem__ gives."""
    if kind == "stl10":
        _stl10(tmp_path, monkeypatch)
        ds = torchvision.datasets.STL10(str(tmp_path), split="train", download=False)
    elif kind == "svhn":
        ds = _svhn()
    else:
        _usps(tmp_path)
        ds = torchvision.datasets.USPS(str(tmp_path), train=True, download=False)
    channels = 1 if kind == "usps" else 3
    loader = make_loader(ds, backend, batch_size=len(ds), train=False, mean=(0.0,) * channels,
                         std=(1.0,) * channels, **CPU)
    (x, y), = list(loader)
    want = np.stack([np.asarray(ds[i][0]).reshape(*np.asarray(ds[i][0]).shape[:2], -1) for i in range(len(ds))])
    assert torch.equal((x.permute(0, 2, 3, 1) * 255).round().byte(), torch.from_numpy(want))
    assert y.tolist() == [ds[i][1] for i in range(len(ds))]
    if kind == "stl10":
        assert loader.classes == ds.classes


def test_stl10s_unlabeled_split_stays_a_dataset_refused_by_name(tmp_path, monkeypatch):
    _stl10(tmp_path, monkeypatch)
    ds = torchvision.datasets.STL10(str(tmp_path), split="unlabeled", download=False)
    with pytest.raises(ValueError, match=r"STL10\[0\] returned label -1; labels must be integers >= 0"):
        next(iter(make_loader(ds, "torch", batch_size=2, train=False, **CPU)))


# ---------------------------------------------------------------- torchvision's ImageNet: tuple class names
@pytest.fixture
def imagenet(tmp_path):
    """torchvision's ImageNet over its prepared layout: root/meta.bin and root/train/<wnid>/*.JPEG."""
    wnids = {"n01440764": ("tench", "Tinca tinca"), "n01443537": ("goldfish", "Carassius auratus")}
    torch.save((wnids, []), tmp_path / "meta.bin")
    for k, wnid in enumerate(wnids):
        for i in range(3):
            _photo(tmp_path / "train" / wnid / f"{wnid}_{i}.JPEG", 30 * i + 100 * k)
    return torchvision.datasets.ImageNet(str(tmp_path), split="train")


@pytest.mark.parametrize("backend", ["torch", "memory", "dali"])
def test_imagenet_with_tuple_class_names_checkpoints_and_resumes(imagenet, backend):
    """ImageNet names each class by a tuple of synonyms: the first state_dict() (a checkpoint, mid-run)
    failed on "sequence item 0: expected str instance, tuple found", naming nothing."""
    assert imagenet.classes[0] == ("tench", "Tinca tinca")
    kw = dict(batch_size=2, augment=Augmentation.imagenet_train(size=8), seed=3, **CPU)
    loader = make_loader(imagenet, backend, **kw)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = make_loader(imagenet, backend, **kw)
    again.load_state_dict(state)
    rest = _batches(again)
    full = _batches(make_loader(imagenet, backend, **kw))
    assert len(rest) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(rest, full[1:]))
    assert loader.classes == imagenet.classes


def test_imagenet_tuple_class_names_are_compared_by_like_and_concat(imagenet, tmp_path):
    other = torchvision.datasets.ImageFolder(str(tmp_path / "train"))
    other.classes = [("goldfish", "Carassius auratus"), ("tench", "Tinca tinca")]   # another order
    train = make_loader(imagenet, "torch", batch_size=2, **CPU)
    with pytest.raises(ValueError, match=r"class 0 is \('goldfish', 'Carassius auratus'\) here and "
                                         r"\('tench', 'Tinca tinca'\) there"):
        make_loader(other, "torch", like=train)
    with pytest.raises(ValueError, match="label 0 would mean two classes"):
        make_loader(torch.utils.data.ConcatDataset([imagenet, other]), "torch", **CPU)


def test_float_arrays_are_refused_saying_how_to_make_them_uint8():
    """make_loader((x_train / 255., y_train)) said only "images must be uint8, got float64"."""
    from fastdata.datasets import ArraySource

    unit = np.linspace(0, 1, 4 * 8 * 8 * 3).reshape(4, 8, 8, 3)
    with pytest.raises(TypeError, match=r"images must be uint8, got float64 \(values from 0 to 1\); .* pass "
                                        r"\(images \* 255\).round\(\).clip\(0, 255\).astype\(np.uint8\)"):
        make_loader((unit, np.arange(4)), "memory", **CPU)
    with pytest.raises(TypeError, match=r"got float32 \(values from -2 to 2: normalized already.*un-normalize"):
        ArraySource(((unit - 0.5) / 0.25).astype(np.float32), np.arange(4))
    halves = torch.utils.data.TensorDataset(torch.ones(2, 3, 4, 4, dtype=torch.bfloat16) * 200, torch.arange(2))
    with pytest.raises(TypeError, match=r"holds torch.bfloat16 images \(values from 200 to 200\).*\(images\)"):
        make_loader(halves, "torch", **CPU)


def test_channels_first_or_rgba_arrays_are_refused_saying_what_to_pass():
    from fastdata.datasets import ArraySource

    with pytest.raises(ValueError, match=r"got \(4, 3, 8, 8\); this looks like \(N, C, H, W\).*"
                                         r"transpose\(0, 2, 3, 1\)"):
        ArraySource(np.zeros((4, 3, 8, 8), np.uint8), np.arange(4))
    with pytest.raises(ValueError, match=r"got \(4, 8, 8, 4\); RGBA: drop the alpha channel \(images\[\.\.\., :3\]\)"):
        make_loader((np.zeros((4, 8, 8, 4), np.uint8), np.arange(4)), "memory", **CPU)


# ---------------------------------------------------------------- a Dataset that changes between epochs
class _Curriculum(torch.utils.data.Dataset):
    """A Dataset whose samples depend on state the training loop sets in the main process each epoch."""

    stage = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((1, 2, 2), self.stage, dtype=torch.uint8), 0


@pytest.mark.parametrize("backend", ["torch", "prefetch"])
def test_workers_see_what_the_main_process_changed_in_a_dataset_between_epochs(backend):
    """Persistent workers kept their fork's copy of the Dataset: with num_workers=2, every epoch read the
    first epoch's stage (0, 0, 0), where a DataLoader (workers forked each epoch) reads 0, 10, 20."""
    data = _Curriculum()
    loader = make_loader(data, backend, batch_size=4, train=False, mean=(0.0,), std=(1.0,),
                         **{**CPU, "num_workers": 2})
    seen = []
    for epoch in range(3):
        data.stage = 10 * epoch
        (x, _), = list(loader)
        seen.append(int((x[0, 0, 0, 0] * 255).round()))
    assert seen == [0, 10, 20]
    assert not loader.opts["persistent_workers"]
    kept = make_loader(data, backend, batch_size=4, train=False, persistent_workers=True, **{**CPU, "num_workers": 2})
    assert kept.opts["persistent_workers"]             # asked for: the caller's choice stands


class _Jitter(torch.utils.data.Dataset):
    """A Dataset that augments in its own __getitem__ (no attribute named transform), from every global
    generator."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        import random

        v = i * 10 + random.randrange(5) + int(np.random.randint(3)) + int(torch.randint(0, 2, ()))
        return torch.full((1, 2, 2), v, dtype=torch.uint8), i % 2


def _values(loader):
    return [(x[:, 0, 0, 0] * 255).round().int().tolist() for x, _ in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_drawing_in_its_own_getitem_repeats_by_seed_and_resumes_exactly(workers):
    """Only a Dataset's `transform` was seeded: one drawing in __getitem__ itself read the caller's
    generators (another run, another epoch), and a resumed run read other samples than the
    uninterrupted one. Its draws now come from (seed, epoch, batch), as every recipe's."""
    import random

    kw = dict(batch_size=3, seed=5, mean=(0.0,), std=(1.0,), **{**CPU, "num_workers": workers})
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    first = _values(make_loader(_Jitter(), "torch", **kw))
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    state = torch.get_rng_state()
    second = _values(make_loader(_Jitter(), "torch", **kw))
    assert first == second and torch.equal(torch.get_rng_state(), state)   # the caller's generator untouched
    loader = make_loader(_Jitter(), "torch", **kw)
    it = iter(loader)
    next(it), next(it)
    resumed = make_loader(_Jitter(), "torch", **kw)
    resumed.load_state_dict(loader.state_dict())
    assert _values(resumed) == first[2:]
    assert _values(make_loader(_Jitter(), "torch", **{**kw, "num_workers": 2 - workers})) == first


@pytest.mark.parametrize("backend", ["torch", "memory", "dali"])
def test_arrays_trained_upscaled_are_evaluated_at_the_training_size(backend):
    """CIFAR trained with imagenet_train(size=64) (upscaled, for a pretrained model) was evaluated by a
    like= loader at its own 32 px."""
    from fastdata.datasets import ArraySource

    src = ArraySource(np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8), np.arange(8) % 2)
    train = make_loader(src, backend, batch_size=4, augment=Augmentation.imagenet_train(size=64), **CPU)
    val = make_loader(src, backend, like=train)
    assert val.augment == Augmentation.imagenet_eval(size=64, resize=73)
    want = make_loader(src, backend, batch_size=4, train=False, mean=train.mean, std=train.std,
                       augment=Augmentation.imagenet_eval(size=64, resize=73), **CPU)
    got = _batches(val)
    assert [tuple(x.shape) for x, _ in got] == [(4, 3, 64, 64)] * 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, _batches(want)))


def test_a_datasets_photos_of_mixed_sizes_are_evaluated_at_the_training_size():
    """A Dataset of photos of mixed sizes trained with imagenet_train(size=16): its like= loader had no
    recipe and refused the batch ("images of different sizes")."""
    from PIL import Image

    class Photos(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return Image.new("RGB", (20 + 3 * i, 18), (40 * i, 0, 0)), i % 2

    train = make_loader(Photos(), "torch", batch_size=2, augment=Augmentation.imagenet_train(size=16), **CPU)
    val = make_loader(Photos(), "torch", like=train)
    assert [tuple(x.shape) for x, _ in val] == [(2, 3, 16, 16)] * 2


def test_statistics_measured_with_numpy_or_torch_are_taken():
    """mean=x.mean(axis=(0, 1, 2)) / 255 (a numpy array) or a tensor was refused as "mean must be a
    number, got array([...])", where the same numbers in a list passed."""
    data = torch.utils.data.TensorDataset(torch.zeros(8, 3, 4, 4, dtype=torch.uint8), torch.arange(8) % 2)
    pixels = np.array([[0.25, 0.5, 0.75]])
    for mean, std in [(pixels.mean(axis=0), np.full(3, 0.5, np.float32)),
                      (torch.tensor([0.25, 0.5, 0.75]), torch.full((3,), 0.5))]:
        loader = make_loader(data, "memory", batch_size=4, mean=mean, std=std, **CPU)
        assert loader.config.mean == (0.25, 0.5, 0.75) and loader.config.std == (0.5,) * 3
        assert torch.allclose(next(iter(loader))[0][0, :, 0, 0], torch.tensor([-0.5, -1.0, -1.5]))
