"""fastdata.batch_transforms: each transform's semantics on handmade batches, the pipeline's seeding,
checks and refusals, end to end through every backend, fit on soft labels, the example, and CUDA."""
from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from conftest import backend_params, load_example, sync_debug_error
from fastdata import Augmentation, LoaderConfig, make_loader
from fastdata.batch_transforms import (
    BatchPipeline,
    BatchTransform,
    ColorJitter,
    CutMix,
    Cutout,
    MixUp,
    OneOf,
    RandomErasing,
    RandomGrayscale,
    RandomHorizontalFlip,
    RandomVerticalFlip,
    check_batch_transforms,
    host_rng,
)
from fastdata.datasets import ArraySource

MEAN, STD = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
K = 10


def pipe(transforms, *, num_classes=K, mean=MEAN, std=STD, device="cpu"):
    return BatchPipeline(transforms, num_classes=num_classes, device=device, mean=mean, std=std)


def pixels(n=16, c=3, h=12, w=12, seed=0) -> torch.Tensor:
    """Random [0, 1] pixels (N, C, H, W), strictly inside (0, 1) so that no clamp touches them."""
    return torch.rand((n, c, h, w), generator=torch.Generator().manual_seed(seed)) * 0.8 + 0.1


def norm(x, mean=MEAN, std=STD):
    c = x.shape[1]
    m, s = torch.tensor(mean[:c]).view(1, -1, 1, 1), torch.tensor(std[:c]).view(1, -1, 1, 1)
    return (x - m) / s


def unnorm(z, mean=MEAN, std=STD):
    c = z.shape[1]
    m, s = torch.tensor(mean[:c]).view(1, -1, 1, 1), torch.tensor(std[:c]).view(1, -1, 1, 1)
    return z.float() * s + m


def labels_of(n):
    return torch.arange(n) % K


def constant_images(n=8, c=3, h=10, w=10):
    """Image i is the constant i + 1 (in normalized units): where a pixel came from is readable."""
    return (torch.arange(n, dtype=torch.float32) + 1).view(-1, 1, 1, 1).expand(n, c, h, w).contiguous()


# ----------------------------------------------------------------------------------- flips
@pytest.mark.parametrize("cls, dim", [(RandomHorizontalFlip, -1), (RandomVerticalFlip, -2)])
def test_flips_per_sample(cls, dim):
    z = norm(pixels(64))
    y = labels_of(64)
    out, labels = pipe([cls(p=1.0)])(z, y, 1)
    assert torch.equal(out, z.flip(dim)) and torch.equal(labels, y)
    out, _ = pipe([cls(p=0.0)])(z, y, 1)
    assert torch.equal(out, z)
    out, _ = pipe([cls(p=0.5)])(z, y, 1)
    flipped = torch.tensor([torch.equal(out[i], z[i].flip(dim)) for i in range(64)])
    kept = torch.tensor([torch.equal(out[i], z[i]) for i in range(64)])
    assert bool((flipped | kept).all())          # each image whole, flipped or not
    assert 10 < int(flipped.sum()) < 54          # drawn per sample, not once per batch


# ----------------------------------------------------------------------------------- Cutout
def test_cutout_zeroes_one_square_of_the_size_clipped_at_the_border():
    n, size = 256, 5
    z = torch.ones(n, 3, 20, 20) * 2.0        # normalized value 2: a zero is the hole
    out, _ = pipe([Cutout(size)])(z, labels_of(n), 7)
    interior = 0
    for i in range(n):
        hole = (out[i] == 0).all(0)
        assert bool(((out[i] == 0) == hole).all())        # every channel holed alike
        assert bool((out[i][:, ~hole] == 2.0).all())       # the rest untouched
        rows, cols = hole.any(1).nonzero().flatten(), hole.any(0).nonzero().flatten()
        assert len(rows) and len(cols)
        # one rectangle: the hole is exactly its rows x its columns, each a contiguous run
        assert bool((hole == (hole.any(1)[:, None] & hole.any(0)[None, :])).all())
        assert rows[-1] - rows[0] + 1 == len(rows) and cols[-1] - cols[0] + 1 == len(cols)
        assert len(rows) <= size and len(cols) <= size
        touches = rows[0] == 0 or rows[-1] == 19 or cols[0] == 0 or cols[-1] == 19
        if not touches:
            assert (len(rows), len(cols)) == (size, size)   # exactly size x size inside the image
            interior += 1
    assert interior > n // 3
    assert torch.equal(pipe([Cutout(size, p=0.0)])(z, labels_of(n), 7)[0], z)


def test_cutout_holes_and_probability():
    z = torch.ones(200, 1, 32, 32)
    out, _ = pipe([Cutout(4, holes=3, p=0.5)], mean=(0.5,), std=(0.25,))(z, labels_of(200), 3)
    holed = (out == 0).flatten(1).any(1)
    assert 60 < int(holed.sum()) < 140
    # up to 3 overlapping 4x4 squares: at most 48 pixels, more than one square's 16 in most images
    area = (out == 0).flatten(1).sum(1)
    assert int(area.max()) <= 48 and int((area > 16).sum()) > 50


# ----------------------------------------------------------------------------------- RandomErasing
def test_random_erasing_follows_torchvision_box_rules_per_sample():
    n, h, w = 300, 40, 40
    z = torch.full((n, 3, h, w), 3.0)
    t = RandomErasing(p=1.0, scale=(0.05, 0.2), ratio=(0.5, 2.0), value=(1.0, -1.0, 0.5))
    out, _ = pipe([t])(z, labels_of(n), 11)
    boxes = set()
    for i in range(n):
        erased = (out[i] != 3.0).any(0)
        rows, cols = erased.any(1).nonzero().flatten(), erased.any(0).nonzero().flatten()
        bh, bw = len(rows), len(cols)
        assert bool((erased == (erased.any(1)[:, None] & erased.any(0)[None, :])).all())
        assert 0.05 * h * w - h <= bh * bw <= 0.2 * h * w + h      # area from scale (± rounding)
        assert 0.5 / 1.3 <= bh / bw <= 2.0 * 1.3                  # aspect from ratio (± rounding)
        for ch, v in enumerate((1.0, -1.0, 0.5)):
            assert bool((out[i, ch][erased] == v).all())
        boxes.add((int(rows[0]), int(cols[0]), bh, bw))
    assert len(boxes) > n // 2     # a box per image, not one per batch


def test_random_erasing_value_random_and_p_and_no_fitting_box():
    z = torch.full((100, 3, 16, 16), 3.0)
    out, _ = pipe([RandomErasing(p=0.5, value="random")])(z, labels_of(100), 2)
    erased = (out != 3.0).flatten(1).any(1)
    assert 25 < int(erased.sum()) < 75
    noise = out[out != 3.0]
    assert 0.7 < float(noise.std()) < 1.3 and abs(float(noise.mean())) < 0.2   # standard normal
    # scale (1, 1): a box of the whole image never fits (torchvision wants h < H): nothing is erased
    out, _ = pipe([RandomErasing(p=1.0, scale=(1.0, 1.0), ratio=(1.0, 1.0))])(z, labels_of(100), 2)
    assert torch.equal(out, z)
    out, _ = pipe([RandomErasing(p=1.0)])(z, labels_of(100), 2)
    assert bool(((out == 0) | (out == 3.0)).all()) and bool((out == 0).flatten(1).any(1).all())


# ----------------------------------------------------------------------------------- ColorJitter
def test_color_jitter_identity_when_factors_are_one():
    z = norm(pixels())
    for t in (ColorJitter(), ColorJitter(brightness=(1.0, 1.0), contrast=0, saturation=(1, 1))):
        assert torch.equal(pipe([t])(z, labels_of(16), 5)[0], z)
    # enabled, but every factor drawn from (1, 1 + 1e-9): the identity up to float rounding
    t = ColorJitter(brightness=(1.0, 1.0 + 1e-9), contrast=(1.0, 1.0 + 1e-9), saturation=(1.0, 1.0 + 1e-9))
    torch.testing.assert_close(pipe([t])(z, labels_of(16), 5)[0], z, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, factor", [("brightness", 1.3), ("brightness", 0.6), ("contrast", 1.5),
                                          ("contrast", 0.5), ("saturation", 1.7), ("saturation", 0.3)])
def test_color_jitter_equals_torchvision_on_the_pixels(name, factor):
    from torchvision.transforms.v2 import functional as F

    x = pixels()
    out, _ = pipe([ColorJitter(**{name: (factor, factor)})])(norm(x), labels_of(16), 9)
    expected = getattr(F, f"adjust_{name}")(x, factor)     # torchvision on un-normalized pixels
    torch.testing.assert_close(unnorm(out), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shift", [0.1, -0.3, 0.5, -0.5])
def test_color_jitter_hue_equals_torchvision_on_the_pixels(shift):
    """ColorJitter(hue=): torchvision's adjust_hue (an HSV round trip), per sample; a grey batch is left
    as it is, as torchvision leaves it."""
    from torchvision.transforms.v2 import functional as F

    x = pixels()
    out, _ = pipe([ColorJitter(hue=(shift, shift))])(norm(x), labels_of(16), 9)
    torch.testing.assert_close(unnorm(out), F.adjust_hue(x, shift), atol=1e-5, rtol=0)
    grey = torch.rand(4, 1, 8, 8)
    same, _ = pipe([ColorJitter(hue=0.5)], mean=(0.5,), std=(0.2,))(grey, labels_of(4), 1)
    assert torch.equal(same, grey)


@pytest.mark.parametrize("hue, match", [(0.6, r"hue must be in \[0, 0.5\]"), (-0.1, r"hue must be in \[0, 0.5\]"),
                                        ((-0.6, 0.1), r"hue\[0\] must be a number in \[-0.5, 0.5\]"),
                                        ((0.2, 0.1), "hue")])
def test_color_jitter_refuses_a_hue_outside_torchvisions_bounds(hue, match):
    with pytest.raises(ValueError, match=match):
        ColorJitter(hue=hue)


@pytest.mark.parametrize("factors", [{"brightness": 1.4, "contrast": 0.5, "saturation": 0.3},
                                     {"brightness": 1.4, "contrast": 0.5, "saturation": 0.3, "hue": 0.2}],
                         ids=["three", "with hue"])
def test_color_jitter_random_order_per_sample(factors):
    """Each image: torchvision's operations in an order of its own (the hue's draws come after the other
    three's, so turning it on leaves their factors as they were)."""
    import itertools

    from torchvision.transforms.v2 import functional as F

    x = pixels(96)
    t = ColorJitter(**{k: (v, v) for k, v in factors.items()})
    got = unnorm(pipe([t])(norm(x), labels_of(96), 4)[0])
    orders = []
    for order in itertools.permutations(factors):
        y = x
        for name in order:
            y = getattr(F, f"adjust_{name}")(y, factors[name])
        orders.append(y)
    match = torch.tensor([[torch.allclose(got[i], o[i], atol=1e-4) for o in orders] for i in range(96)])
    assert bool(match.any(1).all())                    # each image: torchvision's ops in some order
    assert int(match.any(0).sum()) >= 5                # the order drawn per image


def test_color_jitter_factors_within_the_range():
    x = torch.full((200, 1, 4, 4), 0.4)
    out, _ = pipe([ColorJitter(brightness=0.5)], mean=(0.5,), std=(0.2,))(norm(x, (0.5,), (0.2,)), labels_of(200), 1)
    factor = unnorm(out, (0.5,), (0.2,))[:, 0, 0, 0] / 0.4
    assert float(factor.min()) >= 0.5 - 1e-5 and float(factor.max()) <= 1.5 + 1e-5
    assert float(factor.std()) > 0.2          # a factor per image


def test_color_jitter_needs_the_statistics():
    with pytest.raises(ValueError, match="mean/std"):
        BatchPipeline([ColorJitter(0.4)], num_classes=K, device="cpu")
    # given to the transform itself, it runs without a loader's
    x = pixels()
    t = ColorJitter(brightness=(2.0, 2.0), mean=MEAN, std=STD)
    out, _ = BatchPipeline([t], num_classes=K, device="cpu")(norm(x), labels_of(16), 0)
    torch.testing.assert_close(unnorm(out), (x * 2).clamp(0, 1), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------- RandomGrayscale
def test_random_grayscale():
    from torchvision.transforms.v2 import functional as F

    x = pixels(64)
    out, _ = pipe([RandomGrayscale(p=1.0)])(norm(x), labels_of(64), 0)
    raw = unnorm(out)
    torch.testing.assert_close(raw[:, 0], raw[:, 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(raw[:, 1], raw[:, 2], atol=1e-5, rtol=0)
    torch.testing.assert_close(raw, F.rgb_to_grayscale(x, num_output_channels=3), atol=1e-5, rtol=0)
    out, _ = pipe([RandomGrayscale(p=0.5)])(norm(x), labels_of(64), 0)
    grey = torch.tensor([torch.allclose(unnorm(out)[i, 0], unnorm(out)[i, 2], atol=1e-5) for i in range(64)])
    assert 10 < int(grey.sum()) < 54
    assert torch.equal(out[~grey], norm(x)[~grey])
    one = norm(x[:, :1])     # grey batches pass as they are
    assert torch.equal(pipe([RandomGrayscale(p=1.0)], mean=MEAN[:1], std=STD[:1])(one, labels_of(64), 0)[0], one)


# ----------------------------------------------------------------------------------- MixUp / CutMix
def test_mixup_mixes_images_and_labels_by_the_same_lambda():
    n = 8
    z, y = constant_images(n), torch.arange(n)          # distinct classes: each weight readable
    lams = set()
    for seed in range(5):
        out, soft = pipe([MixUp(alpha=0.4)])(z, y, seed)
        assert soft.dtype == torch.float32 and soft.shape == (n, K)
        torch.testing.assert_close(soft.sum(1), torch.ones(n))
        v, prev = torch.arange(n) + 1.0, torch.arange(n).roll(1) + 1.0
        lam = (out[:, 0, 0, 0] - prev) / (v - prev)          # image i = lam * v_i + (1 - lam) * v_{i-1}
        torch.testing.assert_close(lam, lam[:1].expand(n), atol=1e-5, rtol=0)   # one lambda per batch
        torch.testing.assert_close(out, lam.view(-1, 1, 1, 1) * z + (1 - lam.view(-1, 1, 1, 1)) * z.roll(1, 0))
        torch.testing.assert_close(soft[torch.arange(n), y], lam, atol=1e-5, rtol=0)
        torch.testing.assert_close(soft[torch.arange(n), y.roll(1)], 1 - lam, atol=1e-5, rtol=0)
        lams.add(round(float(lam[0]), 6))
    assert len(lams) == 5


def test_mixup_label_smoothing_and_soft_input():
    n, eps = 8, 0.1
    z, y = constant_images(n), torch.arange(n)
    out, soft = pipe([MixUp(alpha=1.0, label_smoothing=eps)])(z, y, 3)
    torch.testing.assert_close(soft.sum(1), torch.ones(n))
    assert float(soft.min()) == pytest.approx(eps / K)      # the classes in neither image
    # soft labels from an earlier transform are mixed as they are (no second smoothing)
    out, twice = pipe([MixUp(1.0, label_smoothing=eps), MixUp(1.0, label_smoothing=eps)])(z, y, 3)
    torch.testing.assert_close(twice.sum(1), torch.ones(n))
    assert float(twice.min()) == pytest.approx(eps / K)
    # so a later transform's own smoothing would be ignored: refused (tests/test_qa_augment.py)
    with pytest.raises(ValueError, match="label_smoothing"):
        pipe([MixUp(1.0), MixUp(1.0, label_smoothing=eps)])


def test_cutmix_lambda_is_the_pasted_area():
    n, h, w = 8, 16, 20
    z, y = constant_images(n, h=h, w=w), torch.arange(n)
    areas = set()
    for seed in range(20):
        out, soft = pipe([CutMix(alpha=1.0)])(z, y, seed)
        pasted = out != z
        assert torch.equal(out[pasted], z.roll(1, 0)[pasted])    # pasted pixels come from the neighbour
        box = pasted[0, 0]
        assert all(torch.equal(pasted[i, c], box) for i in range(n) for c in range(3))   # one box per batch
        if box.any():
            assert bool((box == (box.any(1)[:, None] & box.any(0)[None, :])).all())     # a rectangle
        frac = float(box.sum()) / (h * w)
        torch.testing.assert_close(soft[torch.arange(n), y], torch.full((n,), 1 - frac), atol=1e-6, rtol=0)
        torch.testing.assert_close(soft[torch.arange(n), y.roll(1)], torch.full((n,), frac), atol=1e-6, rtol=0)
        areas.add(frac)
    assert len(areas) > 5


def test_one_of_chooses_per_batch_and_labels_stay_soft():
    z, y = constant_images(8), torch.arange(8)
    chosen = set()
    for seed in range(30):
        out, soft = pipe([OneOf([MixUp(1.0), RandomVerticalFlip(p=1.0)])])(z, y, seed)
        assert soft.shape == (8, K)                   # the flip branch's labels are made soft too
        if torch.equal(out, z.flip(-2)):
            chosen.add("flip")
            torch.testing.assert_close(soft, torch.eye(K)[y])
        else:
            chosen.add("mixup")
    assert chosen == {"flip", "mixup"}
    for seed in range(5):
        out, _ = pipe([OneOf([RandomVerticalFlip(p=1.0), MixUp(1.0)], weights=(1, 0))])(z, y, seed)
        assert torch.equal(out, z.flip(-2))


def test_one_of_takes_plain_callables_too():
    _, v2 = _tv()
    z, y = norm(pixels(8)), labels_of(8)
    p = pipe([OneOf([v2.RandomVerticalFlip(p=1.0), lambda x: -x])])
    outs = [p(z, y, s)[0] for s in range(20)]
    assert all(torch.equal(o, z.flip(-2)) or torch.equal(o, -z) for o in outs)
    assert any(torch.equal(o, -z) for o in outs) and any(torch.equal(o, z.flip(-2)) for o in outs)
    assert all(torch.equal(p(z, y, s)[0], outs[s]) for s in range(20))


# ----------------------------------------------------------------------------------- the pipeline
ALL = [RandomHorizontalFlip(), RandomVerticalFlip(), Cutout(4, holes=2), RandomErasing(p=1.0),
       RandomErasing(p=1.0, value="random"), RandomErasing(p=1.0, value=(0.1, 0.2, 0.3)),
       ColorJitter(0.4, 0.4, 0.4), ColorJitter(0.4, 0.4, 0.4, 0.1), RandomGrayscale(0.5), MixUp(0.2), CutMix(1.0),
       OneOf([MixUp(0.8), CutMix(1.0)])]


def test_same_seed_same_output_other_seed_other_output():
    z, y = norm(pixels(32, h=16, w=16)), labels_of(32)
    p = pipe(ALL)
    a, b, c = p(z, y, 123), p(z, y, 123), p(z, y, 2 ** 62 + 123)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert torch.equal(pipe(ALL)(z, y, 123)[0], a[0])          # a new pipeline: the same draws


def test_a_transform_draws_by_its_position_only():
    z, y = norm(pixels(32, h=16, w=16)), labels_of(32)
    alone = pipe([Cutout(5), RandomErasing(p=1.0)])(z, y, 77)
    more = pipe([Cutout(5), RandomErasing(p=1.0), RandomHorizontalFlip(p=0.0)])(z, y, 77)
    assert torch.equal(alone[0], more[0])


def test_transforms_do_not_touch_the_global_rng_or_their_input():
    z, y = norm(pixels(16)), labels_of(16)
    before = z.clone()
    state = torch.get_rng_state()
    pipe(ALL)(z, y, 5)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(z, before)


@pytest.mark.parametrize("t", ALL, ids=lambda t: type(t).__name__)
def test_transforms_are_stateless_and_picklable(t):
    copy = pickle.loads(pickle.dumps(t))
    assert copy == t
    pipe([t])(norm(pixels()), labels_of(16), 3)
    assert copy == t                     # using it changed nothing
    with pytest.raises(AttributeError):
        t.p = 0.3                        # frozen: one object serves every batch and every worker


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("t", ALL, ids=lambda t: type(t).__name__)
def test_dtype_and_memory_format_kept(t, dtype, channels_last):
    z = norm(pixels(8, h=10, w=10)).to(dtype)
    if channels_last:
        z = z.contiguous(memory_format=torch.channels_last)
    out, labels = pipe([t])(z, labels_of(8), 1)
    assert out.dtype == dtype and out.shape == z.shape
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert bool(torch.isfinite(out.float()).all())
    assert labels.shape == ((8, K) if t.soft_labels else (8,))


@pytest.mark.parametrize("t", ALL, ids=lambda t: type(t).__name__)
@pytest.mark.parametrize("h, w", [(12, 12), (0, 0)])
def test_an_empty_batch_passes(t, h, w):
    """(0, C, 0, 0) too: an empty batch that lost its height and width (a decode of no samples) crashed
    Cutout and CutMix drawing a position in an image of no pixels."""
    out, labels = pipe([t])(norm(pixels(0, h=h, w=w)), labels_of(0), 1)
    assert out.shape == (0, 3, h, w) and labels.shape == ((0, K) if t.soft_labels else (0,))


def test_pipeline_checks_its_inputs():
    p = pipe([Cutout(2)])
    with pytest.raises(ValueError, match="seed must be an integer"):
        p(norm(pixels(2)), labels_of(2), -1)
    with pytest.raises(ValueError, match=r"take images \(N, C, H, W\)"):
        p(torch.zeros(2, 4, 4), labels_of(2), 0)
    with pytest.raises(ValueError, match="num_classes"):
        BatchPipeline([MixUp()], num_classes=0, device="cpu")


@pytest.mark.parametrize("t", [MixUp(num_classes=4), CutMix(num_classes=12), OneOf([MixUp()], num_classes=4),
                               OneOf([CutMix(num_classes=4)])], ids=["MixUp", "CutMix", "OneOf", "OneOf-child"])
def test_a_class_count_other_than_the_sources_is_refused_when_the_loader_is_built(t):
    """Accepted, it failed at the first batch (a label past num_classes; a device-side assert on CUDA)."""
    src = ArraySource(np.zeros((8, 4, 4, 3), np.uint8), np.arange(8) % 10, mean=MEAN, std=STD, classes=list(range(10)))
    with pytest.raises(ValueError, match=rf"num_classes={t.num_classes or 4}\) does not match the source, "
                                         r"which has 10 classes"):
        make_loader(src, "torch", batch_size=4, device="cpu", num_workers=0, batch_transforms=[t])
    ok = make_loader(src, "torch", batch_size=4, device="cpu", num_workers=0, batch_transforms=[MixUp(num_classes=10)])
    assert next(iter(ok))[1].shape == (4, 10)


def test_pipeline_labels_soft_when_any_transform_mixes():
    p = pipe([RandomHorizontalFlip(), MixUp(0.2)])
    assert p.soft_labels and not pipe([Cutout(3)]).soft_labels
    _, labels = p(norm(pixels(4)), labels_of(4), 0)
    assert labels.dtype == torch.float32


# ----------------------------------------------------------------------------------- plain callables
def test_torchvision_v2_transforms_as_is_are_repeatable_per_batch():
    from torchvision.transforms import v2

    z, y = norm(pixels(8)), labels_of(8)
    p = pipe([v2.RandomErasing(p=1.0, value=0), v2.RandomVerticalFlip(p=0.5)])
    outs = [p(z, y, s)[0] for s in range(8)]
    assert all(torch.equal(p(z, y, s)[0], outs[s]) for s in range(8))         # same seed, same batch
    assert len({o.flatten().numpy().tobytes() for o in outs}) == 8            # each seed its own draws
    state = torch.get_rng_state()
    expected = torch.rand(3)
    torch.set_rng_state(state)
    p(z, y, 0)
    assert torch.equal(torch.rand(3), expected)                                # global RNG left alone


def test_a_plain_lambda_gets_the_images_only():
    z, y = norm(pixels(4)), labels_of(4)
    out, labels = pipe([lambda x: x + torch.randn_like(x) * 0.1])(z, y, 1)
    assert torch.equal(labels, y) and not torch.equal(out, z)
    assert torch.equal(out, pipe([lambda x: x + torch.randn_like(x) * 0.1])(z, y, 1)[0])


def test_a_failing_plain_callable_says_what_batch_transforms_get():
    def pil_only(img):
        return img.convert("L")

    with pytest.raises(RuntimeError, match=r"batch_transforms\[0\].*pil_only.*per-sample PIL transforms belong "
                                           r"on the source") as info:
        pipe([pil_only])(norm(pixels(2)), labels_of(2), 0)
    assert isinstance(info.value.__cause__, AttributeError)


# ----------------------------------------------------------------------------------- wrong outputs
class _Bad(BatchTransform):
    def __init__(self, how):
        self.how = how

    def __call__(self, images, labels, generator):
        if self.how == "dtype":
            return images.double(), labels
        if self.how == "drop":
            return images[1:], labels[1:]
        if self.how == "device":
            return images.to("meta"), labels
        if self.how == "labels":
            return images, labels.float()
        return images


@pytest.mark.parametrize("how, error, words", [
    ("dtype", TypeError, "returned torch.float64 images from torch.float32"),
    ("drop", ValueError, "keeps the batch size"),
    ("device", ValueError, "on meta"),
    ("labels", ValueError, "expected int64"),
    ("single", TypeError, "returns \\(images, labels\\)"),
])
def test_a_transform_returning_the_wrong_thing_is_named(how, error, words):
    with pytest.raises(error, match=rf"batch_transforms\[1\] \(<.*_Bad.*{words}"):
        pipe([Cutout(2), _Bad(how)])(norm(pixels(4)), labels_of(4), 0)


# ----------------------------------------------------------------------------------- refusals
def _tv():
    import torchvision.transforms as v1
    from torchvision.transforms import v2

    return v1, v2


class _Wrapper(torch.nn.Module):
    """A user's module around a torchvision transform."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("make, error, words", [
    (lambda: 3, TypeError, "must be a list of callables"),
    (lambda: [3], TypeError, r"batch_transforms\[0\] is not callable"),
    (lambda: "cutout", TypeError, "must be a list of callables"),
    (lambda: [Cutout], TypeError, r"is the class Cutout, not a transform: pass an instance"),
    (lambda: [lambda images, labels: images], TypeError,
     r"cannot be called with one argument.*subclasses fastdata.batch_transforms.BatchTransform"),
    (lambda: [_tv()[1].Normalize((0.5,), (0.2,))], TypeError,
     r"Normalize: fastdata already hands over normalized float batches; drop it and pass mean=/std="),
    (lambda: [_tv()[0].Normalize((0.5,), (0.2,))], TypeError, r"Normalize.*pass mean=/std="),
    (lambda: [_tv()[1].ToDtype(torch.float32, scale=True)], TypeError, "ToDtype.*pass mean=/std="),
    (lambda: [_tv()[1].Compose([_tv()[1].RandomHorizontalFlip(), _tv()[1].PILToTensor()])], TypeError,
     r"transforms\[1\] is torchvision's PILToTensor.*ImageFolder\(root, transform=\.\.\.\)"),
    (lambda: [_tv()[0].Compose([_tv()[0].RandomResizedCrop(8), _tv()[0].ToTensor()])], TypeError,
     r"ToTensor, a conversion of PIL images.*torch/prefetch backends"),
    (lambda: [_tv()[1].MixUp(num_classes=10)], TypeError, r"use fastdata.batch_transforms.MixUp"),
    # [0, 1]-pixel transforms: on a normalized batch they clamp, threshold or mix channels wrongly
    (lambda: [_tv()[1].ColorJitter(brightness=0.01)], TypeError,
     r"ColorJitter, which takes images in \[0, 1\].*use fastdata.batch_transforms.ColorJitter"),
    (lambda: [_tv()[0].RandomGrayscale()], TypeError, r"use fastdata.batch_transforms.RandomGrayscale"),
    (lambda: [_tv()[1].RandomAutocontrast()], TypeError, r"RandomAutocontrast.*run it per sample on the source"),
    (lambda: [_tv()[1].Compose([_tv()[1].RandomVerticalFlip(), _tv()[1].RandomInvert()])], TypeError,
     r"transforms\[1\] is torchvision's RandomInvert"),
    (lambda: [_tv()[1].TrivialAugmentWide()], TypeError, r"TrivialAugmentWide, which takes images in \[0, 1\]"),
    (lambda: [_tv()[1].GaussianNoise(sigma=0.01)], TypeError, r"GaussianNoise, which takes images in \[0, 1\]"),
    (lambda: [_tv()[1].ColorJitter(hue=0.1)], TypeError, r"ColorJitter, which .*use fastdata.batch_transforms"),
    # inside compositions, at any depth: nn.Sequential (torchvision's scripted composition), a module's children
    (lambda: [torch.nn.Sequential(_tv()[1].RandomVerticalFlip(), _tv()[1].Normalize((0.5,), (0.2,)))], TypeError,
     r"batch_transforms\[0\] \(Sequential.*\)\[1\] is torchvision's Normalize: .*pass mean=/std="),
    (lambda: [_tv()[1].Compose([torch.nn.Sequential(_tv()[1].ToDtype(torch.float32, scale=True))])], TypeError,
     r"\.transforms\[0\]\[0\] is torchvision's ToDtype"),
    (lambda: [_tv()[1].RandomApply(torch.nn.ModuleList([_tv()[1].ColorJitter(0.1)]), p=0.01)], TypeError,
     r"\.transforms\[0\] is torchvision's ColorJitter, which takes images in \[0, 1\]"),
    (lambda: [_Wrapper(_tv()[1].RandomChoice([_tv()[1].Grayscale(3)]))], TypeError,
     r"\.inner\.transforms\[0\] is torchvision's Grayscale"),
    (lambda: [_tv()[1].RandomOrder([_tv()[1].RandomApply([_tv()[1].MixUp(num_classes=10)])])], TypeError,
     r"transforms\[0\]\.transforms\[0\] is torchvision's MixUp"),
    (lambda: [_tv()[1].RandomChoice([Cutout(3)])], TypeError, "go directly in the batch_transforms list"),
    (lambda: [OneOf([Cutout(3), 5])], TypeError, r"OneOf transforms\[1\] is not callable"),
])
def test_what_cannot_work_is_refused_with_what_to_do(make, error, words):
    with pytest.raises(error, match=words):
        check_batch_transforms(make())


def test_torchvision_batch_transforms_are_accepted():
    v1, v2 = _tv()
    ok = [v2.RandomErasing(), v2.Compose([v2.RandomVerticalFlip(), v2.RandomErasing()]), v1.RandomHorizontalFlip(),
          torch.nn.Sequential(v2.RandomVerticalFlip(), v2.RandomApply([v2.RandomErasing()])),
          _Wrapper(v2.GaussianBlur(3)),
          v2.GaussianBlur(3),   # a blur commutes with the per-channel normalization: exact on normalized pixels
          v2.GaussianNoise(sigma=0.1, clip=False)]
    assert check_batch_transforms(ok) == tuple(ok)


def test_loader_config_refuses_them_by_field():
    _, v2 = _tv()
    with pytest.raises(TypeError, match="Normalize"):
        LoaderConfig(batch_transforms=[v2.Normalize((0.5,), (0.2,))], device="cpu")
    cfg = LoaderConfig(batch_transforms=[Cutout(4), v2.RandomVerticalFlip()], device="cpu")
    assert isinstance(cfg.batch_transforms, tuple) and len(cfg.batch_transforms) == 2
    assert LoaderConfig(batch_transforms=Cutout(4), device="cpu").batch_transforms == (Cutout(4),)
    assert cfg.replace(batch_size=8).batch_transforms == cfg.batch_transforms


@pytest.mark.parametrize("make, words", [
    (lambda: Cutout(0), "size must be an integer >= 1"),
    (lambda: Cutout(4, p=1.5), r"Cutout: p \(a probability\) must be a number in \[0, 1\], got 1.5"),
    (lambda: RandomErasing(value="noise"), "'random'"),
    (lambda: RandomErasing(scale=(0.5, 0.1)), "min <= max"),
    (lambda: RandomErasing(scale=(0.1, 1.5)), r"RandomErasing: scale\[1\] must be a number in \[0.0, 1.0\], got 1.5"),
    (lambda: ColorJitter(brightness=-1), "brightness must be >= 0"),
    (lambda: MixUp(alpha=0), "MixUp: alpha must be a number > 0, got 0.0"),
    (lambda: MixUp(num_classes=True), "MixUp: num_classes must be an integer >= 1 or None, got True"),
    (lambda: CutMix(label_smoothing=1.0), r"label_smoothing must be in \[0, 1\)"),
    (lambda: OneOf([]), "non-empty"),
    (lambda: OneOf([Cutout(2)], weights=(1, 2)), "weights must be 1 numbers"),
    (lambda: RandomGrayscale(mean=(0.5,)), "both mean and std"),
])
def test_arguments_are_checked_with_the_transform_named(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_host_rng_is_seeded_by_the_generator_seed():
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    torch.rand(10, generator=g2)                       # the state moved, the seed did not
    assert host_rng(g1).random() == host_rng(g2).random()
    assert host_rng(g1).random() != host_rng(torch.Generator().manual_seed(6)).random()


# ----------------------------------------------------------------------------------- end to end
CIFAR_TRANSFORMS = [Cutout(8), MixUp(0.2)]
RECIPE = Augmentation(crop="translate", pad=4, hflip=0.5)


@pytest.fixture(scope="module")
def cifar():
    """CIFAR-shaped: 512 RGB 32x32 uint8 images, 10 classes, with a class-dependent tint to learn."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 512)
    images = rng.integers(0, 120, (512, 32, 32, 3)).astype(np.uint8)
    images[..., 0] += (labels * 12).astype(np.uint8)[:, None, None]
    return ArraySource(images, labels, mean=(0.3, 0.23, 0.23), std=(0.2, 0.14, 0.14), name="cifar-like")


def _loader(src, backend, seed=0, **kw):
    return make_loader(src, backend, batch_size=64, seed=seed, device="cpu", num_workers=1, augment=RECIPE,
                       batch_transforms=CIFAR_TRANSFORMS, **kw)


def _epoch(loader, start=0):
    out = []
    for i, (x, y) in enumerate(loader):
        if i >= start:
            out.append((x.clone(), y.clone()))
    return out


@pytest.fixture(scope="module")
def reference(cifar):
    with _loader(cifar, "torch") as loader:
        return _epoch(loader)


def _same(a, b, backend):
    # DALI's CPU operators may round a pixel differently; every other backend is exact.
    tol = dict(atol=1e-4, rtol=0) if backend == "dali" else dict(atol=0, rtol=0)
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        torch.testing.assert_close(xa, xb, **tol)
        torch.testing.assert_close(ya, yb, **tol)


@pytest.mark.parametrize("backend", backend_params())
def test_every_backend_gives_the_same_transformed_batches(cifar, reference, backend):
    with _loader(cifar, backend) as loader:
        batches = _epoch(loader)
    assert all(y.shape == (64, 10) and y.dtype == torch.float32 for _, y in batches)
    torch.testing.assert_close(batches[0][1].sum(1), torch.ones(64))
    _same(batches, reference, backend)
    with _loader(cifar, backend, seed=1) as other:
        first = next(iter(other))
    assert not torch.equal(first[1], reference[0][1])


@pytest.mark.parametrize("backend", backend_params())
def test_resume_gives_the_remaining_transformed_batches(cifar, reference, backend):
    with _loader(cifar, backend) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        it.close()
    with _loader(cifar, backend) as resumed:
        resumed.load_state_dict(state)
        rest = _epoch(resumed)
    _same(rest, reference[3:], backend)


def _engine_takes_soft_labels() -> bool:
    """Whether fastdata.engine scores (N, classes) soft targets: N=2 against 3 classes cannot broadcast,
    so an engine that compares argmax(logits) with the labels as they are raises."""
    from fastdata import evaluate

    class OneBatch:
        device = torch.device("cpu")

        def __iter__(self):
            yield torch.zeros(2, 1, 2, 2), torch.full((2, 3), 1 / 3)

    try:
        evaluate(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)), OneBatch(), amp="off")
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("backend", backend_params())
def test_fit_trains_on_soft_labels_on_every_backend(cifar, backend):
    from fastdata import SmallCNN, fit

    if not _engine_takes_soft_labels():
        pytest.skip("fastdata.engine does not take soft (N, classes) labels yet: its accuracy compares "
                    "argmax(logits) with the labels as they are (issue 12, soft labels in fit)")
    torch.manual_seed(0)
    with _loader(cifar, backend) as train:
        history = fit(SmallCNN(num_classes=10, in_channels=3, width=8), train, epochs=1, progress=False)
    assert len(history) == 1 and math.isfinite(history[0]["train_loss"])
    assert 0 <= history[0]["train_accuracy"] <= 1


# ----------------------------------------------------------------------------------- the example
def _example():
    return load_example("custom_augmentation")


def test_example_parser_takes_backends_from_the_registry():
    from fastdata import available_backends

    parser = _example().get_args_parser()
    for backend in available_backends():
        assert parser.parse_args(["--backend", backend]).backend == backend
    assert all(a.type is not bool for a in parser._actions)


@pytest.mark.parametrize("backend", ["memory", "torch"])
def test_example_trains_with_its_own_transform(backend, capsys):
    module = _example()
    # its transform is a BatchTransform: seeded per batch, stateless, shape and dtype kept
    t = module.RandomGainAndNoise()
    z = norm(pixels(8), (0.5,) * 3, (0.25,) * 3)
    p = BatchPipeline([t], num_classes=10, device="cpu")
    assert torch.equal(p(z, labels_of(8), 1)[0], p(z, labels_of(8), 1)[0])
    assert not torch.equal(p(z, labels_of(8), 1)[0], z)
    args = module.get_args_parser().parse_args(["--backend", backend, "--epochs", "1", "--batch-size", "64",
                                                "--limit", "512", "--device", "cpu", "--no-progress"])
    result = module.main(args)
    assert len(result["history"]) == 1 and math.isfinite(result["history"][0]["train_loss"])
    assert 0 <= result["test_accuracy"] <= 1
    assert "test accuracy" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- CUDA
# Transforms whose draws are forced, or drawn on the host: the same output on CPU and CUDA.
FORCED = [RandomHorizontalFlip(p=1.0), RandomVerticalFlip(p=0.0), Cutout(4, p=0.0), RandomErasing(p=0.0),
          ColorJitter(brightness=(1.3, 1.3)), ColorJitter(saturation=(0.4, 0.4)), ColorJitter(hue=(0.2, 0.2)),
          RandomGrayscale(p=1.0),
          MixUp(0.4), CutMix(1.0), OneOf([MixUp(0.4), CutMix(1.0)])]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", ALL + FORCED, ids=lambda t: repr(t)[:40])
def test_every_transform_runs_on_cuda_without_a_host_sync(t, dtype):
    z = norm(pixels(32, h=16, w=16)).to(dtype).contiguous(memory_format=torch.channels_last)
    y = labels_of(32)
    cpu = pipe([t])
    gpu = pipe([t], device="cuda")
    zc, yc = z.cuda(), y.cuda()
    torch.cuda.synchronize()
    with sync_debug_error():
        out, labels = gpu(zc, yc, 2 ** 40 + 7)
        again, _ = gpu(zc, yc, 2 ** 40 + 7)
    assert out.is_cuda and out.dtype == dtype and out.shape == z.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, again)
    expected, expected_labels = cpu(z, y, 2 ** 40 + 7)
    assert labels.shape == expected_labels.shape and labels.dtype == expected_labels.dtype
    if t in FORCED:
        tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=0)
        torch.testing.assert_close(out.cpu(), expected, **tol)
        torch.testing.assert_close(labels.cpu(), expected_labels, atol=1e-6, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", backend_params())
def test_a_cuda_epoch_with_batch_transforms_makes_no_synchronizing_call(cifar, backend):
    loader = make_loader(cifar, backend, batch_size=64, device="cuda", num_workers=2, augment=RECIPE,
                         batch_transforms=[Cutout(8), ColorJitter(0.4, 0.4, 0.4), RandomGrayscale(0.2),
                                           RandomErasing(), OneOf([MixUp(0.8), CutMix(1.0)])])
    torch.cuda.synchronize()
    try:
        with sync_debug_error():
            for x, y in loader:
                torch.cuda._sleep(1_000_000)
                assert x.is_cuda and y.shape == (x.shape[0], 10)
    finally:
        loader.close()
