"""torchvision datasets as fastdata sources: ImageFolder/DatasetFolder → files, CIFAR and the MNIST family →
arrays, so memory and dali read them; one with its own transform stays a Dataset, and says why.

Every dataset is built by torchvision's own code over files written here in its on-disk format (no
download). CIFAR's constructor checks fixed md5 sums of the real files; ``_LocalCIFAR10`` differs from
``CIFAR10`` only in those sums (None: torchvision then checks that the files exist), so the pickles are
still read by torchvision's loading code.
"""
from __future__ import annotations

import os
import pickle
import random
import re
import struct

import numpy as np
import pytest
import torch
import torchvision  # a core dependency, as torch: missing, the install is broken (no skip)
from torchvision import transforms as T

from conftest import DEVICES, backend_params
from fastdata import Augmentation, make_loader
from fastdata.datasets import ArraySource, DatasetSource, ImageFolder, as_source, split

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


class _LocalCIFAR10(torchvision.datasets.CIFAR10):
    """CIFAR10 without the md5 sums of the real download (see the module docstring)."""

    train_list = [[f"data_batch_{i}", None] for i in range(1, 6)]
    test_list = [["test_batch", None]]
    meta = {"filename": "batches.meta", "key": "label_names", "md5": None}


def write_cifar10(root, per_batch: int = 8, seed: int = 0) -> np.ndarray:
    """CIFAR-10's python pickles (5 training batches, the test batch, batches.meta) under
    root/cifar-10-batches-py; returns the training images as torchvision reads them (N, 32, 32, 3)."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    train = []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3 * 32 * 32), dtype=np.uint8)   # rows: R plane, G, B
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f)
        if name != "test_batch":
            train.append(data)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": CIFAR_CLASSES, "num_cases_per_batch": per_batch}, f)
    return np.concatenate(train).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def write_idx(path, array):
    path.write_bytes(struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
                     + array.astype(np.uint8).tobytes())


def write_mnist(root, folder: str = "MNIST", n: int = 40, seed: int = 0):
    """The four IDX files torchvision's MNIST-like classes expect under root/<folder>/raw."""
    rng = np.random.default_rng(seed)
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split_name in ("train", "t10k"):
        write_idx(raw / f"{split_name}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(raw / f"{split_name}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))


@pytest.fixture
def cifar(tmp_path):
    write_cifar10(tmp_path)
    return _LocalCIFAR10(str(tmp_path), train=True)


# ---------------------------------------------------------------- arrays
def test_cifar10_becomes_an_array_source_with_its_pixels_labels_and_class_names(tmp_path):
    images = write_cifar10(tmp_path)
    tv = _LocalCIFAR10(str(tmp_path), train=True)
    src = as_source(tv)
    assert isinstance(src, ArraySource) and len(src) == len(tv) == 40
    np.testing.assert_array_equal(src.images, images)
    for i in (0, 17, 39):   # what torchvision's own __getitem__ returns, pixel for pixel
        np.testing.assert_array_equal(src.images[i], np.asarray(tv[i][0]))
        assert src.labels[i] == tv[i][1]
    assert src.classes == CIFAR_CLASSES and src.num_classes == 10 and src.channels == 3
    np.testing.assert_allclose(src.mean, images.reshape(-1, 3).mean(0) / 255, atol=1e-4)   # measured
    assert src.default_augmentation(True) == Augmentation.cifar_train()
    assert src.default_augmentation(False) == Augmentation.none()


def test_cifar100_and_an_exact_cifar10_object_convert_too():
    # Exact classes (no subclass): built with object.__new__ and the attributes torchvision's
    # constructor sets, because its md5 check cannot be bypassed through public parameters.
    for cls, k in ((torchvision.datasets.CIFAR10, 10), (torchvision.datasets.CIFAR100, 100)):
        tv = object.__new__(cls)
        tv.transform = tv.target_transform = tv.transforms = None
        tv.data = np.random.default_rng(k).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
        tv.targets = [i % 10 for i in range(12)]
        tv.classes = [f"c{i}" for i in range(k)]
        src = as_source(tv)
        assert isinstance(src, ArraySource) and src.num_classes == k and src.classes[3] == "c3"
        assert src.name == cls.__name__.lower()


def test_a_cifar_label_past_its_classes_names_the_first_one():
    tv = object.__new__(torchvision.datasets.CIFAR10)
    tv.transform = tv.target_transform = tv.transforms = None
    tv.data = np.zeros((4, 32, 32, 3), np.uint8)
    tv.targets = [0, 9, 10, 11]
    tv.classes = CIFAR_CLASSES
    with pytest.raises(ValueError, match=r"labels must be integers in \[0, 10\).*labels\[2\] is 10"):
        as_source(tv)


@pytest.mark.parametrize("cls, digits", [("MNIST", True), ("FashionMNIST", False), ("KMNIST", False)])
def test_the_mnist_family_becomes_grey_arrays_and_only_mnist_gets_the_digit_recipe(tmp_path, cls, digits):
    write_mnist(tmp_path, cls)
    tv = getattr(torchvision.datasets, cls)(str(tmp_path), train=True, download=False)
    src = as_source(tv)
    assert isinstance(src, ArraySource) and src.image_shape == (28, 28, 1) and len(src) == 40
    np.testing.assert_array_equal(src.images[..., 0], tv.data.numpy())
    np.testing.assert_array_equal(src.labels, tv.targets.numpy())
    assert src.classes == list(tv.classes) and src.num_classes == 10
    assert src.digits is digits
    assert src.default_augmentation(True) == (Augmentation.digits_train() if digits else Augmentation.none())


def test_a_fake_torchvision_shaped_object_is_recognized_by_its_class_not_by_importing_torchvision():
    """Detection reads the class's module and name (in its MRO): no torchvision import is needed."""
    Fake = type("CIFAR10", (), {"__module__": "torchvision.datasets.cifar", "transform": None,
                                "target_transform": None, "transforms": None,
                                "__len__": lambda self: len(self.data)})
    fake = Fake()
    fake.data = np.full((3, 32, 32, 3), 7, np.uint8)
    fake.targets = [2, 0, 1]
    fake.classes = ["a", "b", "c"]
    src = as_source(fake)
    assert isinstance(src, ArraySource) and src.classes == ["a", "b", "c"] and src.labels.tolist() == [2, 0, 1]


# ---------------------------------------------------------------- files
def test_torchvision_imagefolder_becomes_fastdatas_file_list(photo_folder):
    tv = torchvision.datasets.ImageFolder(str(photo_folder))
    src = as_source(tv)
    assert isinstance(src, ImageFolder) and src.kind == "files"
    assert src.paths == [p for p, _ in tv.samples] and src.labels.tolist() == tv.targets
    assert src.classes == tv.classes and src.class_to_idx == tv.class_to_idx
    assert src.mean == ImageFolder(photo_folder).mean
    # The same files give the same fingerprint: a checkpoint resumes across the two.
    assert src.fingerprint() == ImageFolder(photo_folder).fingerprint()
    assert src.default_augmentation(True) == Augmentation.imagenet_train()


def test_a_nested_class_folder_lists_its_files_in_torchvisions_order(tmp_path):
    """torchvision lists a folder's files before its sub-folder's (sorted os.walk, then names): cat/z.jpg
    before cat/more/b.jpg. fastdata sorted whole paths, so sample i was another file and a checkpoint
    would not resume across the two."""
    from PIL import Image

    for rel in ("cat/a.jpg", "cat/z.jpg", "cat/more/b.jpg", "cat/more/deeper/c.jpg", "cat/n/d.jpg", "dog/c.jpg"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (len(rel), 0, 0)).save(tmp_path / rel)
    tv = torchvision.datasets.ImageFolder(str(tmp_path))
    ours = ImageFolder(tmp_path)
    assert ours.paths == [p for p, _ in tv.samples]
    assert [os.path.relpath(p, tmp_path) for p in ours.paths][:3] == ["cat/a.jpg", "cat/z.jpg", "cat/more/b.jpg"]
    assert ours.fingerprint() == as_source(tv).fingerprint()


def test_a_subclass_with_its_own_getitem_is_called_not_bypassed(photo_folder):
    """Converting it to a file list would drop what its __getitem__ does (here: 3 classes become 2,
    images become 16x16): it stays a Dataset, the torch backend calls it, the others say why not."""
    from PIL import Image

    class TwoClasses(torchvision.datasets.ImageFolder):
        def __getitem__(self, i):
            image, label = super().__getitem__(i)
            return image.resize((16, 16), Image.BILINEAR), min(label, 1)

    tv = TwoClasses(str(photo_folder))
    src = as_source(tv)
    assert isinstance(src, DatasetSource)
    loader = make_loader(tv, "torch", batch_size=len(tv), train=False, device="cpu", num_workers=0,
                         augment=Augmentation())
    (x, y), = list(loader)
    assert x.shape[-2:] == (16, 16) and sorted(set(y.tolist())) == [0, 1]
    with pytest.raises(TypeError, match=r"TwoClasses has its own __getitem__ .*only the torch and prefetch"):
        make_loader(tv, "memory", batch_size=4, device="cpu")

    class SameItems(torchvision.datasets.ImageFolder):   # a subclass that only adds things still converts
        extra = 1

    assert isinstance(as_source(SameItems(str(photo_folder))), ImageFolder)


def test_a_dataset_folder_with_its_own_loader_stays_a_dataset_and_says_why(tmp_path):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i in range(2):
            np.save(tmp_path / cls / f"{i}.npy", np.full((4, 4), i, np.uint8))
    tv = torchvision.datasets.DatasetFolder(str(tmp_path), loader=lambda p: torch.from_numpy(np.load(p)),
                                            extensions=(".npy",))
    src = as_source(tv)
    assert isinstance(src, DatasetSource) and "has its own loader=" in src.refusal_hint
    with pytest.raises(TypeError, match="has its own loader="):
        make_loader(tv, "memory", batch_size=2, device="cpu")


# ---------------------------------------------------------------- own transforms
def test_a_dataset_with_its_own_transform_is_not_converted_and_memory_says_why(cifar):
    cifar.transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])
    cifar.transforms = torchvision.datasets.vision.StandardTransform(cifar.transform, None)
    src = as_source(cifar)
    assert isinstance(src, DatasetSource) and src.sample_transform is cifar.transform
    assert src.refusal_hint.startswith("_LocalCIFAR10 has its own transform=Compose(RandomCrop(")
    assert "for memory/dali pass _LocalCIFAR10(..., transform=None)" in src.refusal_hint
    for backend in ("memory", "dali"):
        with pytest.raises(TypeError, match=r"has its own transform=.*transform=None\), which fastdata reads as "
                                            r"arrays, .*augment=Augmentation\(\.\.\.\) \(presets .*batch_transforms="):
            make_loader(cifar, backend, batch_size=8, device="cpu")


def test_a_target_transform_alone_also_keeps_the_dataset(cifar):
    cifar.target_transform = lambda y: y
    assert isinstance(as_source(cifar), DatasetSource)
    assert "target_transform=" in as_source(cifar).refusal_hint


def test_the_torch_backend_runs_the_datasets_transform_and_repeats_by_seed(cifar):
    cifar.transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])

    def run(workers):
        loader = make_loader(cifar, "torch", batch_size=8, device="cpu", num_workers=workers, seed=5,
                             mean=(0.5,), std=(0.25,))
        return torch.cat([x for x, _ in loader])

    a = run(0)
    random.seed(123)
    torch.manual_seed(123)   # the caller's generators do not matter: each sample's draws are seeded
    assert torch.equal(a, run(0)) and torch.equal(a, run(2))   # the same with 2 workers
    plain = torch.cat([x for x, _ in make_loader(_plain(cifar), "torch", batch_size=8, device="cpu",
                                                  num_workers=0, seed=5, mean=(0.5,), std=(0.25,),
                                                  augment=Augmentation.none())])
    assert not torch.equal(a, plain)    # the transform ran


def _plain(tv):
    tv = pickle.loads(pickle.dumps(tv))
    tv.transform = tv.transforms = None
    return tv


def test_a_transform_ending_in_float_is_refused_naming_the_fix(cifar):
    cifar.transform = T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.2,) * 3)])
    with pytest.raises(TypeError, match=r"drop ToDtype/Normalize/ToTensor from the transform and pass "
                                        r"mean=/std= to make_loader"):
        make_loader(cifar, "torch", batch_size=8, device="cpu", num_workers=0)


def test_a_float_step_a_random_container_rarely_runs_is_refused_before_any_batch(cifar):
    """RandomApply([ToTensor()], p=0.01): the first sample (read for its channels) was a PIL image, so the float
    images came out at some later batch, or not in a short test."""
    cifar.transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomApply([T.ToTensor()], p=0.01)])
    with pytest.raises(TypeError, match=r"_LocalCIFAR10 ends with float images \(ToTensor\) in some of its random "
                                        r"draws: drop ToDtype/Normalize/ToTensor"):
        make_loader(cifar, "torch", batch_size=8, device="cpu", num_workers=0)


@pytest.mark.parametrize("backend", ["memory", "dali", "auto"])
def test_a_float_transform_refusal_names_the_way_out_for_the_backend_asked(photo_folder, backend):
    """torchvision's ImageFolder(transform=Compose([..., ToTensor(), Normalize()])) given to memory or dali: the
    refusal said only "drop ToTensor/Normalize, pass mean=/std=", after which the transform itself was refused.
    The first refusal names both ways; each is followed here, literally, to a batch."""
    crop = [T.Resize(40), T.CenterCrop(32)]
    stats = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    tv = torchvision.datasets.ImageFolder(str(photo_folder), transform=T.Compose([*crop, T.ToTensor(),
                                                                                   T.Normalize(**stats)]))
    kw = {"batch_size": 6, "device": "cpu", "num_workers": 0, "train": False, "quiet": True, **stats}
    with pytest.raises(TypeError) as err:
        make_loader(tv, backend, **kw)
    message = str(err.value)
    assert "drop ToDtype/Normalize/ToTensor from the transform and pass mean=/std= to make_loader for backend " \
           "'torch' or 'prefetch'" in message
    assert re.search(r"Backends 'memory' and 'dali' run no per-sample transform .*: for them pass "
                     r"ImageFolder\(\.\.\., transform=None\), .* and pass augment=Augmentation\(\.\.\.\) with "
                     r"mean=/std=", message), message
    assert "Augmentation.imagenet_eval()" in message
    if backend == "auto":   # the first way: the transform without its float steps
        tv.transform = tv.transforms.transform = T.Compose(crop)
        loader = make_loader(tv, backend, **kw)
    else:                   # memory/dali's way: no transform, the recipe as augment=
        loader = make_loader(torchvision.datasets.ImageFolder(str(photo_folder), transform=None), backend,
                             augment=Augmentation.imagenet_eval(size=32, resize=40), **kw)
    with loader:
        images, labels = next(iter(loader))
    assert images.shape == (6, 3, 32, 32) and labels.tolist() == tv.targets[:6]


def test_a_dataset_memory_cannot_read_even_without_its_transform_is_not_told_to_drop_it():
    """FakeData (neither files nor arrays) with a transform: the hint said "pass FakeData(..., transform=None)"
    for memory/dali, which then refused FakeData itself. Both refusals now say it is the Dataset they cannot
    read, and how to hand them its pixels."""
    tv = torchvision.datasets.FakeData(8, image_size=(3, 6, 5), num_classes=2, transform=T.RandomHorizontalFlip())
    assert "transform=None" not in as_source(tv).refusal_hint
    with pytest.raises(TypeError, match=r"backend 'memory' cannot read .*FakeData has its own transform=.*ArraySource"):
        make_loader(tv, "memory", batch_size=4, device="cpu")
    tv.transform = T.Compose([T.RandomHorizontalFlip(), T.ToTensor()])
    with pytest.raises(TypeError, match=r"run no per-sample transform .*: for them FakeData cannot serve at all, "
                                        r"transform or not .*ArraySource\(images, labels\)"):
        make_loader(tv, "memory", batch_size=4, device="cpu")


# ---------------------------------------------------------------- every backend reads them
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", backend_params())
def test_every_backend_reads_a_cifar_dataset_with_the_same_batches(cifar, backend, device):
    ref = [(x, y) for x, y in make_loader(as_source(cifar), "torch", batch_size=16, train=False,
                                          device="cpu", num_workers=0)]
    got = list(make_loader(cifar, backend, batch_size=16, train=False, device=device, num_workers=0))
    assert len(got) == len(ref) == 3
    for (x, y), (rx, ry) in zip(got, ref):
        assert x.device.type == device
        torch.testing.assert_close(x.cpu(), rx, rtol=0, atol=1e-5)
        assert torch.equal(y.cpu(), ry)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", backend_params())
def test_every_backend_reads_a_torchvision_imagefolder(photo_folder, backend, device):
    tv = torchvision.datasets.ImageFolder(str(photo_folder))
    aug = Augmentation.imagenet_eval(size=32, resize=40)
    ys = torch.cat([y.cpu() for _, y in make_loader(tv, backend, batch_size=6, train=False, device=device,
                                                     num_workers=0, augment=aug,
                                                     **({"cache_size": 40} if backend == "memory" else {}))])
    assert ys.tolist() == tv.targets


# ---------------------------------------------------------------- subsets of them
def test_subset_and_random_split_of_a_torchvision_dataset_become_subsets(cifar):
    src = as_source(cifar)
    sub = as_source(torch.utils.data.Subset(cifar, [5, 1, 30]))
    assert isinstance(sub, ArraySource) and sub.indices.tolist() == [5, 1, 30]
    np.testing.assert_array_equal(sub.images, src.images[[5, 1, 30]])
    assert sub.mean == src.mean and sub.classes == CIFAR_CLASSES
    nested = as_source(torch.utils.data.Subset(torch.utils.data.Subset(cifar, [5, 1, 30]), [2, 0]))
    assert nested.indices.tolist() == [30, 5]
    parts = torch.utils.data.random_split(cifar, [0.75, 0.25], generator=torch.Generator().manual_seed(0))
    a, b = (as_source(p) for p in parts)
    assert sorted(a.indices.tolist() + b.indices.tolist()) == list(range(40))
    tr, va = split(cifar, [0.75, 0.25], seed=1)
    assert (len(tr), len(va)) == (30, 10) and va.std == src.std
