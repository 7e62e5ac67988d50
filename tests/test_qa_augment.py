"""QA of augmentation as a user uses it: batch transforms against torchvision v2 and timm, plain callables
from other libraries, class counts and label smoothing of the mixing transforms, ColorJitter's arguments
as torchvision users write them, and the statistics a colour transform un-normalizes with."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fastdata import make_loader
from fastdata.batch_transforms import (
    BatchPipeline,
    ColorJitter,
    CutMix,
    MixUp,
    OneOf,
    RandomGrayscale,
    RandomHorizontalFlip,
)
from fastdata.datasets import ArraySource
from test_batch_transforms import K, labels_of, norm, pipe, pixels, unnorm  # the transforms' own test helpers


class _Unlabelled(torch.utils.data.Dataset):
    """A torch Dataset with neither .classes nor .targets: its class count is unknown to fastdata."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3, 8, 8), i * 7 % 256, dtype=torch.uint8), i % 7


# ----------------------------------------------------------------------------------- plain callables
def test_a_plain_callable_drawing_from_pythons_random_repeats_per_batch():
    """timm's RandomErasing is made for normalized device batches (timm's PrefetchLoader runs it there),
    so a timm user passes it as it is; it draws its boxes from Python's ``random``. Forking only torch's
    RNG left those draws to whatever the global state was: the same seed gave other batches, a resumed
    run other ones than the uninterrupted run, and the user's own ``random`` stream moved."""
    from timm.data.random_erasing import RandomErasing as TimmErasing

    z, y = norm(pixels(8)), labels_of(8)
    p = pipe([TimmErasing(probability=0.5, mode="pixel", device="cpu")])
    random.seed(1)
    first = p(z.clone(), y, 3)[0]    # (a clone: timm's erases in place)
    after = random.random()
    random.seed(2)
    again = p(z.clone(), y, 3)[0]
    assert not torch.equal(first, z)
    assert torch.equal(first, again)                       # the batch's seed decides, not the global state
    assert not torch.equal(first, p(z.clone(), y, 4)[0])   # and another seed draws other boxes
    random.seed(1)
    expected = random.random()
    assert after == expected                               # the caller's `random` stream did not move


def test_a_plain_callable_drawing_from_numpys_global_rng_repeats_per_batch():
    def jitter(x):   # a user's lambda-style transform on numpy's legacy global RNG
        return x + torch.from_numpy(np.random.standard_normal(x.shape[1:]).astype(np.float32))

    z, y = norm(pixels(4)), labels_of(4)
    np.random.seed(0)
    first = pipe([jitter])(z, y, 5)[0]
    after = np.random.random()
    np.random.seed(9)
    assert torch.equal(first, pipe([jitter])(z, y, 5)[0])
    np.random.seed(0)
    assert np.random.random() == after                     # numpy's global stream left alone


def test_timm_random_erasing_through_a_loader_resumes_with_the_same_batches():
    from timm.data.random_erasing import RandomErasing as TimmErasing

    rng = np.random.default_rng(0)
    src = ArraySource(rng.integers(0, 255, (96, 16, 16, 3)).astype(np.uint8), rng.integers(0, 10, 96))

    def loader():
        return make_loader(src, "torch", batch_size=16, device="cpu", num_workers=0, seed=1,
                           batch_transforms=[TimmErasing(probability=0.5, mode="pixel", device="cpu")])

    with loader() as whole:
        reference = [x.clone() for x, _ in whole]
    with loader() as first:
        it = iter(first)
        for _ in range(2):
            next(it)
        state = first.state_dict()
        it.close()
    random.random()   # the process went on drawing meanwhile
    with loader() as resumed:
        resumed.load_state_dict(state)
        rest = [x.clone() for x, _ in resumed]
    assert len(rest) == len(reference) - 2
    assert all(torch.equal(a, b) for a, b in zip(rest, reference[2:]))


# ----------------------------------------------------------------------------------- class counts
def _first(source, transforms, **kw):
    with make_loader(source, "torch", batch_size=16, device="cpu", num_workers=0, batch_transforms=transforms,
                     **kw) as loader:
        return next(iter(loader))


@pytest.mark.parametrize("make", [lambda: [MixUp(num_classes=7)], lambda: [CutMix(num_classes=7)],
                                  lambda: [OneOf([MixUp(num_classes=7), RandomHorizontalFlip(p=1.0)])],
                                  lambda: [RandomHorizontalFlip(), OneOf([CutMix(), MixUp(num_classes=7)])]])
def test_a_class_count_given_to_the_mixing_transform_serves_a_source_without_one(make):
    """MixUp's own error for such a source says "give MixUp(..., num_classes=N)", and num_classes is
    documented as the source's count only when None: given, it was refused all the same."""
    images, labels = _first(_Unlabelled(), make())
    assert labels.shape == (16, 7) and labels.dtype == torch.float32
    torch.testing.assert_close(labels.sum(1), torch.ones(16))


def test_different_class_counts_in_one_list_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"num_classes.*\b7\b.*\b8\b"):
        _first(_Unlabelled(), [MixUp(num_classes=7), CutMix(num_classes=8)])


def test_a_label_past_the_given_class_count_is_named_on_the_cpu():
    # the source cannot check its labels against a count it does not know: the soft targets do
    with pytest.raises(ValueError, match=r"label 6.*\[0, 5\).*num_classes=5"):
        _first(_Unlabelled(), [MixUp(num_classes=5)])
    with pytest.raises(ValueError, match=r"label -1.*\[0, 10\)"):
        pipe([MixUp()])(norm(pixels(2)), torch.tensor([3, -1]), 0)


# ----------------------------------------------------------------------------------- label smoothing
def test_label_smoothing_holds_for_the_batches_a_one_of_does_not_mix():
    """timm's Mixup(prob=p, label_smoothing=ε) smooths every batch, mixed or not (and torchvision's
    references smooth in the loss, every batch). OneOf([MixUp(label_smoothing=ε), flip]) made the
    flip's batches plain one-hot targets: ε accepted, and ignored on part of the batches."""
    eps = 0.1
    z, y = norm(pixels(8)), labels_of(8)
    p = pipe([OneOf([MixUp(label_smoothing=eps), RandomHorizontalFlip(p=1.0)])])
    expected = torch.full((8, K), eps / K).scatter_(1, y.view(-1, 1), 1 - eps + eps / K)
    flipped = 0
    for seed in range(20):
        out, soft = p(z, y, seed)
        if torch.equal(out, z.flip(-1)):
            flipped += 1
            torch.testing.assert_close(soft, expected)
    assert 0 < flipped < 20


@pytest.mark.parametrize("make", [lambda: [OneOf([MixUp(label_smoothing=0.1), CutMix()])],
                                  lambda: [MixUp(label_smoothing=0.1), CutMix(label_smoothing=0.2)],
                                  lambda: [CutMix(), OneOf([MixUp(label_smoothing=0.1), RandomHorizontalFlip()])]])
def test_mixing_transforms_that_disagree_on_label_smoothing_are_refused(make):
    # one list's targets get one smoothing: in a OneOf the batches would differ by branch, and in a
    # sequence the later transform's would be ignored (the labels are soft already)
    with pytest.raises(ValueError, match=r"label_smoothing.*0\.1.*0\.[02]|label_smoothing.*0\.[02].*0\.1"):
        pipe(make())


# ----------------------------------------------------------------------------------- ColorJitter's arguments
def test_color_jitter_written_as_torchvisions_takes_the_hue_fourth():
    """torchvision's signature is ColorJitter(brightness, contrast, saturation, hue): ported as it is,
    ColorJitter(0.4, 0.4, 0.4, 0.1) put the hue into mean= and failed with "give both mean and std".
    The fourth argument is the hue, as torchvision's."""
    assert ColorJitter(0.4, 0.4, 0.4, 0.1).hue == (-0.1, 0.1)
    assert ColorJitter(brightness=0.4, hue=(-0.1, 0.2)).hue == (-0.1, 0.2)
    z = norm(pixels())
    plain = pipe([ColorJitter(0.4, 0.4, 0.4)])(z, labels_of(16), 3)[0]
    for no_hue in (0, 0.0, None, (0, 0)):   # torchvision's identity hue is accepted, and changes nothing
        assert torch.equal(pipe([ColorJitter(0.4, 0.4, 0.4, no_hue)])(z, labels_of(16), 3)[0], plain)
    with pytest.raises(TypeError):          # mean/std only by keyword: no fifth positional number
        ColorJitter(0.4, 0.4, 0.4, 0.0, (0.5,), (0.2,))


def _rgb_source(mean=(0.3, 0.4, 0.5), std=(0.2, 0.25, 0.3)):
    rng = np.random.default_rng(0)
    return ArraySource(rng.integers(0, 255, (64, 12, 12, 3)).astype(np.uint8), rng.integers(0, 10, 64),
                       mean=mean, std=std)


@pytest.mark.parametrize("cls", [ColorJitter, RandomGrayscale])
def test_statistics_other_than_the_loaders_are_refused_when_the_loader_is_made(cls):
    """The batches are normalized with the loader's mean/std; a colour transform given others
    un-normalized them wrongly (shifted, rescaled pixels, then clamped) without a word."""
    src = _rgb_source()
    make = (lambda **kw: ColorJitter(0.4, **kw)) if cls is ColorJitter else (lambda **kw: RandomGrayscale(0.5, **kw))
    with pytest.raises(ValueError, match=rf"{cls.__name__}.*mean=\(0\.485.*loader.*\(0\.3, 0\.4, 0\.5\)"):
        _first(src, [make(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))])
    # the loader's own statistics (also as one number per channel) are accepted
    _first(src, [make(mean=(0.3, 0.4, 0.5), std=(0.2, 0.25, 0.3))])
    _first(_rgb_source((0.5,) * 3, (0.25,) * 3), [make(mean=0.5, std=0.25)])


def test_color_jitter_contrast_and_saturation_refuse_batches_neither_rgb_nor_grey():
    # torchvision refuses them ("permitted channel values are 1 or 3"): a grey level of 4 channels
    # (RGBA, multispectral) is not defined; the channels' plain mean stood in for it silently
    z = torch.randn(4, 4, 8, 8)
    for t in (ColorJitter(contrast=0.4), ColorJitter(saturation=0.4), ColorJitter(hue=0.1)):
        with pytest.raises(ValueError, match=r"ColorJitter.*contrast, saturation and hue.*4 channels"):
            pipe([t], mean=(0.5,) * 4, std=(0.25,) * 4)(z, labels_of(4), 0)
    out, _ = pipe([ColorJitter(brightness=(2.0, 2.0))], mean=(0.5,) * 4, std=(0.25,) * 4)(z, labels_of(4), 0)
    torch.testing.assert_close(unnorm(out, (0.5,) * 4, (0.25,) * 4),
                               (unnorm(z, (0.5,) * 4, (0.25,) * 4) * 2).clamp(0, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, factor", [("brightness", 1.4), ("contrast", 0.5), ("contrast", 1.6),
                                          ("saturation", 0.2)])
def test_color_jitter_on_a_grey_batch_equals_torchvision(name, factor):
    from torchvision.transforms.v2 import functional as F

    x = pixels(c=1)
    out, _ = pipe([ColorJitter(**{name: (factor, factor)})], mean=(0.45,), std=(0.22,))(
        norm(x, (0.45,), (0.22,)), labels_of(16), 2)
    torch.testing.assert_close(unnorm(out, (0.45,), (0.22,)), getattr(F, f"adjust_{name}")(x, factor), atol=1e-5,
                               rtol=0)


def test_timms_mixup_is_refused_with_fastdatas_equivalent():
    """timm's Mixup takes (images, targets) and mixes them in place: refused by its signature only, the
    message said to subclass BatchTransform, not that fastdata has it, nor how its arguments map."""
    from timm.data import Mixup

    with pytest.raises(TypeError, match=r"timm's Mixup.*OneOf\(\[MixUp\(.*CutMix\(.*label_smoothing"):
        pipe([Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=K)])


def test_the_mapping_of_timms_mixup_smooths_the_unmixed_batches_as_timm_does():
    from timm.data.mixup import mixup_target

    eps, y = 0.1, labels_of(8)
    p = pipe([OneOf([MixUp(0.8, label_smoothing=eps), CutMix(1.0, label_smoothing=eps), lambda x: x],
                    weights=(0.25, 0.25, 0.5))])      # timm's Mixup(prob=0.5, switch_prob=0.5)
    z = norm(pixels(8))
    unmixed = [soft for out, soft in (p(z, y, s) for s in range(16)) if torch.equal(out, z)]
    assert unmixed
    for soft in unmixed:   # timm's target for a batch it does not mix: lam = 1, smoothed
        torch.testing.assert_close(soft, mixup_target(y, K, lam=1.0, smoothing=eps))


# ----------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_this_rounds_paths_run_on_cuda_without_a_host_sync_and_as_on_the_cpu():
    """The smoothed targets of a OneOf's unmixed batches, a class count given to MixUp, and a plain
    callable under the seeded Python/numpy RNGs: on CUDA without a host sync (the label range check is
    the CPU's only), and with the CPU's labels (all drawn on the host)."""
    from conftest import sync_debug_error

    def host_drawn_gain(x):
        return x * (1.0 + random.random() + float(np.random.random()))

    ts = [host_drawn_gain, OneOf([MixUp(0.8, label_smoothing=0.1, num_classes=K), lambda x: x])]
    z = norm(pixels(32, h=16, w=16)).contiguous(memory_format=torch.channels_last)
    y = labels_of(32)
    cpu = BatchPipeline(ts, num_classes=0, device="cpu")
    gpu = BatchPipeline(ts, num_classes=0, device="cuda")
    zc, yc = z.cuda(), y.cuda()
    torch.cuda.synchronize()
    for seed in range(6):
        with sync_debug_error():
            out, labels = gpu(zc, yc, seed)
        expected, expected_labels = cpu(z, y, seed)
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(labels.cpu(), expected_labels, atol=1e-6, rtol=0)
        assert labels.shape == (32, K) and float(labels.min()) >= 0.1 / K - 1e-7


def test_label_smoothings_equal_to_float32_rounding_agree():
    # a value read from a config as float32 (np.float32(0.1) is 0.10000000149) is the same smoothing
    p = pipe([OneOf([MixUp(label_smoothing=0.1), CutMix(label_smoothing=np.float32(0.1))])])
    assert p.label_smoothing == pytest.approx(0.1)


@pytest.mark.parametrize("make", [lambda: ColorJitter(0.4, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)),
                                  lambda: RandomGrayscale(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)),
                                  lambda: pipe([ColorJitter(0.4)], mean=(123.675, 116.28, 103.53),
                                               std=(58.395, 57.12, 57.375))])
def test_statistics_in_0_255_units_are_refused_outside_a_loader_too(make):
    # un-normalizing with them gives "pixels" in the hundreds, all clamped to 1: a white batch
    with pytest.raises(ValueError, match=r"mean=\(123\.675.*above 1.*\[0, 1\] units"):
        make()


# ----------------------------------------------------------------------------------- layout
@pytest.mark.parametrize("t", [RandomGrayscale(1.0), ColorJitter(0.4, 0.4, 0.4), MixUp(), RandomHorizontalFlip()])
@pytest.mark.parametrize("shape", [(0, 3, 7, 5), (4, 3, 1, 1)])
def test_an_empty_or_one_pixel_channels_last_batch_keeps_its_strides(t, shape):
    """The pipeline promises the memory format back. An empty (or 1x1) tensor counts as contiguous in
    either format, so a channels_last one came back with NCHW strides from a transform that made a
    new tensor (a rank's empty share of a last step, in a channels_last run)."""
    z = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    out, _ = pipe([t])(z, torch.arange(shape[0]) % K, 0)
    assert out.stride() == z.stride()


# ----------------------------------------------------------------------------------- the recipe
def test_a_resized_box_equals_torchvisions_resized_crop_inside_and_differs_only_at_its_edge():
    """What docs/augmentation.md says of resizing crops against torchvision's (PIL bilinear)."""
    from PIL import Image
    from torchvision.transforms.v2 import functional as F

    from fastdata import Augmentation
    from fastdata.augment import resize_box

    image = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    top, left, h, w = 37, 51, 120, 90
    ours = resize_box(image, Augmentation(crop="random_resized", size=48), (top, left, h, w), False).astype(int)
    theirs = np.asarray(F.resized_crop(Image.fromarray(image), top, left, h, w, [48, 48],
                                       interpolation=F.InterpolationMode.BILINEAR)).astype(int)
    assert np.array_equal(ours[1:-1, 1:-1], theirs[1:-1, 1:-1])
    assert not np.array_equal(ours, theirs)


@pytest.mark.parametrize("cls", [MixUp, CutMix])
def test_alpha_0_says_how_to_turn_mixing_off(cls):
    # timm's Mixup(mixup_alpha=0) means "no MixUp"; torchvision's refuses it (Beta(0, 0) is no distribution)
    with pytest.raises(ValueError, match=rf"{cls.__name__}: alpha must be a number > 0.*to turn .* off, leave "
                                         rf"{cls.__name__} out"):
        cls(alpha=0)
