"""A user's own data through every backend: what a training script that already has a dataset meets
when it switches to fastdata (evaluation loaders made ``like=`` the training one, torch's
``ConcatDataset``/``TensorDataset``, torchvision datasets in their on-disk layouts).

Every dataset is made here, small; torchvision's own classes read it where they exist.
"""
from __future__ import annotations

import pytest
import torch
import torchvision  # a core dependency, as torch (tests/test_sources_torchvision.py)
from torchvision.transforms import v2

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
