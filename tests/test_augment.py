"""augment: the one source of random augmentation parameters, and the recipe's enums."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from conftest import pairs
from fastdata import Augmentation
from fastdata.augment import (
    RRC_DRAWS,
    RRC_TRIES,
    Params,
    apply_params,
    augment_batch,
    draw_params,
    require_fixed_size,
    require_padding_fits,
    rrc_boxes,
    rrc_params,
    sample_box,
)
from fastdata.config import Crop
from fastdata.datasets import SourceKind, SyntheticDigits

RRC = Augmentation(crop="random_resized", size=8, hflip=0.5)
SHIFT = Augmentation(crop="translate", pad=2, hflip=0.5)


@pytest.mark.parametrize("aug", [RRC, SHIFT, Augmentation(crop="center", size=8, resize=10, hflip=0.5),
                                 Augmentation(hflip=0.5), Augmentation()])
def test_the_same_seed_gives_the_same_parameters(aug):
    a = draw_params(aug, np.random.default_rng(7), 16, (20, 30))
    b = draw_params(aug, np.random.default_rng(7), 16, (20, 30))
    for x, y in pairs(a, b):
        assert (x is None and y is None) or np.array_equal(x, y)
    assert len(a.flips) == 16 and a.flips.dtype == bool


def test_translate_draws_all_offsets_then_all_flips():
    rng = np.random.default_rng(3)
    offsets = rng.integers(0, 5, size=(10, 2))
    flips = rng.random(10) < 0.5
    p = draw_params(SHIFT, np.random.default_rng(3), 10, (28, 28))
    assert np.array_equal(p.offsets, offsets) and np.array_equal(p.flips, flips) and p.boxes is None


@pytest.mark.parametrize("aug", [Augmentation(hflip=0.3), Augmentation(crop="center", size=8, hflip=0.3)])
def test_crops_that_draw_no_box_draw_n_flips_and_nothing_else(aug):
    rng, ref = np.random.default_rng(4), np.random.default_rng(4)
    p = draw_params(aug, rng, 9, (20, 30))
    assert np.array_equal(p.flips, ref.random(9) < 0.3) and p.offsets is None
    assert rng.random() == ref.random()    # the next batch's draws start where they did


def test_resizing_crops_draw_box_then_flip_per_sample_so_one_by_one_equals_the_batch():
    sizes = np.array([[20, 30], [40, 25], [33, 33], [64, 48]])
    batch = draw_params(RRC, np.random.default_rng(5), 4, sizes)
    rng = np.random.default_rng(5)
    for i, (h, w) in enumerate(sizes):     # torchvision's box, then the flip, sample after sample
        box = rrc_params(rng, int(h), int(w), RRC.scale, RRC.ratio)
        assert np.array_equal(batch.boxes[i], box) and batch.flips[i] == (rng.random() < RRC.hflip)
    rng = np.random.default_rng(5)
    for i, (h, w) in enumerate(sizes):     # how files are decoded: opened and drawn one at a time
        box, flip = sample_box(RRC, rng, int(h), int(w))
        assert np.array_equal(batch.boxes[i], box) and batch.flips[i] == flip
    # Per-sample sizes matter: the same seed with one size for all gives other boxes.
    same = draw_params(RRC, np.random.default_rng(5), 4, (20, 30))
    assert not np.allclose(same.boxes, batch.boxes)


def _rrc_reference(u, height, width, scale, ratio):
    """torchvision's RandomResizedCrop box written sample by sample, as draw_params once drew it, on one
    row of uniforms: try a's area fraction is u[2a], its log aspect u[2a+1]; top and left u[-2], u[-1]."""
    import math

    area, log_ratio = height * width, (math.log(ratio[0]), math.log(ratio[1]))
    for a in range(RRC_TRIES):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[2 * a])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[2 * a + 1])
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(u[-2] * (height - h + 1)), int(u[-1] * (width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _center_reference(height, width, size, resize):
    """torchvision's Resize(resize) + CenterCrop(size) as a source box, written for one image."""
    resize = resize or size
    if width <= height:
        rw, rh = resize, int(resize * height / width)
    else:
        rw, rh = int(resize * width / height), resize
    top, left = int(round((rh - size) / 2.0)), int(round((rw - size) / 2.0))
    sy, sx = height / rh, width / rw
    return top * sy, left * sx, size * sy, size * sx


# tiny, square, extreme aspect ratios both ways, and ordinary photo sizes
EDGE_SIZES = [(1, 1), (1, 2), (2, 1), (1, 500), (500, 1), (3, 200), (200, 3), (7, 7), (8, 9), (13, 40),
              (375, 500), (500, 333), (1080, 1920), (4000, 30)]


@pytest.mark.parametrize("aug", [RRC, Augmentation(crop="random_resized", size=8, scale=(0.5, 1.0), ratio=(0.2, 5.0)),
                                 Augmentation(crop="random_resized", size=8, scale=(0.9, 1.0), ratio=(1.0, 1.0))])
def test_batched_boxes_equal_the_per_sample_reference(aug):
    """draw_params computes all of a batch's boxes with array operations; each equals torchvision's loop
    run on that sample's row of RRC_DRAWS uniforms (one rng.random((n, RRC_DRAWS + 1)) per batch, the last
    column the flip's; without flips, no such column)."""
    gen = np.random.default_rng(0)
    sizes = np.concatenate([np.array(EDGE_SIZES), gen.integers(1, 700, size=(400, 2))])
    n = len(sizes)
    p = draw_params(aug, np.random.default_rng(42), n, sizes)
    u = np.random.default_rng(42).random((n, RRC_DRAWS + (aug.hflip > 0)))   # no flip's column when hflip is 0
    for i, (h, w) in enumerate(sizes.tolist()):
        box = _rrc_reference(u[i].tolist()[:RRC_DRAWS], h, w, aug.scale, aug.ratio)
        assert p.boxes[i].tolist() == list(box), (h, w)
        top, left, bh, bw = box
        assert 0 <= top <= h - bh and 0 <= left <= w - bw and bh >= 1 and bw >= 1
    assert np.array_equal(p.flips, u[:, RRC_DRAWS] < aug.hflip if aug.hflip else np.zeros(n, dtype=bool))
    assert np.array_equal(rrc_boxes(u[:, :RRC_DRAWS], sizes, aug.scale, aug.ratio), p.boxes)


def test_the_center_fallback_when_no_try_fits():
    """All 10 tries fail (the largest area at the narrowest aspect never fits a square, and nothing of
    area near 1 fits a 1-pixel strip): the central crop of the nearest allowed aspect, as torchvision."""
    u = np.zeros((3, RRC_DRAWS))
    u[:, 0:2 * RRC_TRIES:2] = 0.999999      # area fraction ~1 ...
    u[:, 1:2 * RRC_TRIES:2] = 0.0           # ... at aspect 3/4: taller than the image
    sizes = np.array([[30, 30], [10, 100], [100, 10]])
    boxes = rrc_boxes(u, sizes, (0.08, 1.0), (3 / 4, 4 / 3))
    assert boxes.tolist() == [[0, 0, 30, 30], [0, 43, 10, 13], [(100 - 13) // 2, 0, 13, 10]]
    for row, (h, w) in zip(boxes.tolist(), sizes.tolist()):
        assert row == list(_rrc_reference(list(u[0]), h, w, (0.08, 1.0), (3 / 4, 4 / 3)))


@pytest.mark.parametrize("resize", [None, 10, 37])
def test_batched_center_boxes_equal_the_per_sample_reference(resize):
    aug = Augmentation(crop="center", size=8, resize=resize, hflip=0.5)
    sizes = np.concatenate([np.array(EDGE_SIZES) + 8, np.random.default_rng(1).integers(8, 900, size=(300, 2))])
    p = draw_params(aug, np.random.default_rng(3), len(sizes), sizes)
    for i, (h, w) in enumerate(sizes.tolist()):
        assert p.boxes[i].tolist() == list(_center_reference(h, w, 8, resize)), (h, w)
    assert np.array_equal(p.flips, np.random.default_rng(3).random(len(sizes)) < 0.5)


@pytest.mark.parametrize("aug", [RRC, Augmentation(crop="center", size=8, hflip=0.5), SHIFT])
def test_an_empty_batch_draws_nothing_and_has_empty_parameters(aug):
    rng = np.random.default_rng(9)
    state = rng.bit_generator.state
    for sizes in ((20, 30), np.zeros((0, 2), dtype=np.int64)):
        p = draw_params(aug, rng, 0, sizes)
        assert p.flips.shape == (0,) and p.flips.dtype == bool
        assert p.boxes is None or (p.boxes.shape == (0, 4) and p.boxes.dtype == np.float64)
    assert rng.bit_generator.state == state


def test_no_random_recipe_draws_nothing():
    rng = np.random.default_rng(1)
    state = rng.bit_generator.state
    p = draw_params(Augmentation(crop="center", size=8), rng, 5, (10, 12))
    draw_params(Augmentation(), rng, 5, (10, 12))
    assert rng.bit_generator.state == state and not p.flips.any()


def test_apply_params_is_the_drawn_recipe_on_arrays():
    images = SyntheticDigits(8, seed=0).images
    p = draw_params(SHIFT, np.random.default_rng(2), 8, (28, 28))
    out = apply_params(images, SHIFT, p)
    assert np.array_equal(out, augment_batch(images, SHIFT, np.random.default_rng(2)))
    i = int(np.argmax(p.flips))          # a flipped sample equals its shifted crop mirrored
    (dy, dx), pad = p.offsets[i], SHIFT.pad
    padded = np.pad(images[i], ((pad, pad), (pad, pad), (0, 0)))
    crop = padded[dy:dy + 28, dx:dx + 28]
    assert np.array_equal(out[i], crop[:, ::-1] if p.flips[i] else crop)


def test_crop_is_an_enum_that_still_accepts_and_equals_strings():
    aug = Augmentation(crop="translate", pad=2)
    assert aug.crop is Crop.TRANSLATE and aug.crop == "translate" and f"{aug.crop}" == "translate"
    assert {"translate": 1}[aug.crop] == 1 and Augmentation(crop=Crop.TRANSLATE, pad=2) == aug
    assert "crop='translate'" in repr(aug)
    assert pickle.loads(pickle.dumps(aug)) == aug     # DataLoader workers receive the recipe pickled
    assert Crop.RANDOM_RESIZED.fixes_size and Crop.CENTER.fixes_size and not Crop.TRANSLATE.fixes_size
    assert Crop.TRANSLATE.is_random and Crop.RANDOM_RESIZED.is_random and not Crop.CENTER.is_random
    with pytest.raises(ValueError, match=r"unknown crop 'zoom'; choose from \['none', 'translate'"):
        Augmentation(crop="zoom")


def test_source_kind_is_an_enum_equal_to_its_string():
    src = SyntheticDigits(4)
    assert src.kind is SourceKind.ARRAY and src.kind == "array" and repr(src.kind) == "'array'"


def test_photos_need_a_size_fixing_crop_in_one_check(tmp_path):
    from fastdata.datasets import ImageFolder, make_image_folder

    folder = ImageFolder(make_image_folder(tmp_path / "f", classes=1, per_class=1,
                                                 size_range=((20, 30), (20, 30))))
    require_fixed_size(folder, RRC)
    require_fixed_size(SyntheticDigits(4), SHIFT)    # arrays have one size: any crop
    with pytest.raises(ValueError, match="crop that fixes the output size.*got crop='translate'"):
        require_fixed_size(folder, SHIFT)


def test_the_backends_draw_no_random_numbers_themselves():
    """Every draw goes through draw_params: a backend that drew its own would drift from the others."""
    import re
    from pathlib import Path

    import fastdata.backends

    root = Path(fastdata.backends.__file__).parent
    paths = sorted(root.rglob("*.py"))                 # backends/memory/*.py too: a backend may be a package
    assert root / "memory" / "loader.py" in paths
    for path in paths:
        text = path.read_text()
        draws = re.findall(r".*(?:\brng\.|random\(|\.integers\(|\.uniform\().*", text)
        assert not draws, f"{path.relative_to(root)} draws random numbers itself: {draws}"


# ------------------------------------------------------------------------ padding: reflect and edge
TORCH_MODE = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}


def _random_batch(n=16, h=7, w=9, c=3, seed=0):
    return np.random.default_rng(seed).integers(1, 256, (n, h, w, c), dtype=np.uint8)   # no black pixel


@pytest.mark.parametrize("padding", ["constant", "reflect", "edge"])
def test_translate_pads_like_torch_pad_then_crops_at_the_drawn_offsets(padding):
    """The reference is torch's own pad (mode reflect/replicate/constant) and a crop at each drawn
    (dy, dx): an implementation that padded with zeros, repeated the edge pixel in a reflection or
    shifted the window the other way fails on the border pixels."""
    import torch
    import torch.nn.functional as F

    pad = 4
    aug = Augmentation(crop="translate", pad=pad, padding=padding, hflip=0.5)
    images = _random_batch(n=64, h=7, w=9)          # pad < 7: reflection fits, and not square
    p = draw_params(aug, np.random.default_rng(11), len(images), (7, 9))
    out = apply_params(images, aug, p)
    nchw = torch.from_numpy(images).permute(0, 3, 1, 2).float()
    padded = F.pad(nchw, (pad, pad, pad, pad), mode=TORCH_MODE[padding])
    for i, ((dy, dx), flip) in enumerate(zip(p.offsets, p.flips)):
        ref = padded[i, :, dy:dy + 7, dx:dx + 9]
        ref = ref.flip(-1) if flip else ref
        assert np.array_equal(out[i], ref.permute(1, 2, 0).byte().numpy()), (padding, i, dy, dx, flip)
    # Both extreme shifts on both axes were drawn: every border of the padding was compared.
    assert (p.offsets.min(0) == 0).all() and (p.offsets.max(0) == 2 * pad).all()
    # The images hold no 0: only constant padding shifts black in.
    assert (out == 0).any() == (padding == "constant")


@pytest.mark.parametrize("padding", ["constant", "reflect", "edge"])
def test_translate_matches_torchvision_random_crop_with_padding_mode(padding):
    """torchvision v2 ``RandomCrop(size, padding=p, padding_mode=...)`` at every offset (its top/left
    pinned): the convention (which pixel a reflection starts from, which way a shift goes) is theirs."""
    import torch
    from torchvision.transforms import v2

    pad, h, w = 3, 6, 8
    image = _random_batch(n=1, h=h, w=w, seed=4)
    aug = Augmentation(crop="translate", pad=pad, padding=padding)

    class PinnedCrop(v2.RandomCrop):
        def __init__(self, top, left, **kw):
            super().__init__(**kw)
            self.top, self.left = top, left

        def make_params(self, flat_inputs):
            base = getattr(super(), "make_params", None) or super()._get_params
            return {**base(flat_inputs), "top": self.top, "left": self.left, "needs_crop": True}

        _get_params = make_params   # torchvision 0.19's name for it (the floor; make_params is newer)

    chw = torch.from_numpy(image[0]).permute(2, 0, 1).contiguous()
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            tv = PinnedCrop(dy, dx, size=(h, w), padding=pad, padding_mode=padding)(chw)
            ours = apply_params(image, aug, Params(np.array([[dy, dx]]), None, np.zeros(1, bool)))[0]
            assert np.array_equal(ours, tv.permute(1, 2, 0).numpy()), (padding, dy, dx)


def test_padding_draws_nothing_more_and_changes_no_parameter():
    shapes = (20, 30)
    plain = draw_params(SHIFT, np.random.default_rng(9), 12, shapes)
    for padding in ("reflect", "edge"):
        rng = np.random.default_rng(9)
        p = draw_params(Augmentation(crop="translate", pad=2, hflip=0.5, padding=padding), rng, 12, shapes)
        assert np.array_equal(p.offsets, plain.offsets) and np.array_equal(p.flips, plain.flips)
        again = np.random.default_rng(9)
        draw_params(SHIFT, again, 12, shapes)
        assert rng.bit_generator.state == again.bit_generator.state


def test_reflect_pad_must_be_smaller_than_the_image():
    from fastdata.datasets import ArraySource

    aug = Augmentation.cifar_train(pad=4)
    assert aug.padding == "reflect" and aug.crop == "translate" and aug.pad == 4 and aug.hflip == 0.5
    require_padding_fits((5, 5), aug)                      # pad 4 < 5: fits
    require_padding_fits((4, 4), Augmentation.cifar_train(pad=4, padding="edge"))    # edge fits any size
    require_padding_fits((4, 4), Augmentation.cifar_train(pad=4, padding="constant"))
    with pytest.raises(ValueError, match=r"images of 4x9 px cannot be padded by pad=4 with "
                                         r"padding='reflect'.*at most 3 here.*'edge' or 'constant'"):
        require_padding_fits((4, 9), aug)
    src = ArraySource(np.zeros((3, 9, 4), np.uint8), np.zeros(3, np.int64), mean=(0.5,), std=(0.5,))
    with pytest.raises(ValueError, match=r"ArraySource.*of 9x4 px cannot be padded by pad=4"):
        require_padding_fits(src, aug)
    # Where the size is first seen per batch (a torch Dataset's samples), apply_params checks it.
    with pytest.raises(ValueError, match="cannot be padded by pad=4"):
        augment_batch(np.zeros((2, 4, 4, 1), np.uint8), aug, np.random.default_rng(0))
    empty = augment_batch(np.zeros((0, 4, 4, 1), np.uint8), aug, np.random.default_rng(0))
    assert empty.shape == (0, 4, 4, 1)


def test_torch_reflect_pad_refuses_what_require_padding_fits_refuses():
    """The limit is torch's (the memory backend pads with it on the device), not an invention."""
    import torch
    import torch.nn.functional as F

    F.pad(torch.zeros(1, 1, 5, 5), (4, 4, 4, 4), mode="reflect")
    with pytest.raises(RuntimeError):
        F.pad(torch.zeros(1, 1, 4, 4), (4, 4, 4, 4), mode="reflect")


def test_a_flip_never_writes_into_the_callers_array():
    """apply_params flipped a writable input in place: a Dataset whose samples are views of its data
    (np arrays returned by __getitem__) had its data mirrored for good by the first epoch's flips."""
    images = np.arange(2 * 3 * 4 * 1, dtype=np.uint8).reshape(2, 3, 4, 1)
    before = images.copy()
    out = augment_batch(images, Augmentation(crop="none", hflip=1.0), np.random.default_rng(0))
    assert np.array_equal(images, before)
    assert np.array_equal(out, before[:, :, ::-1])


def test_output_size_is_the_batches_size_where_known_before_any_batch(tmp_path):
    """What an empty batch's (H, W) is before any batch showed it (Normalizer.size)."""
    import torch

    from fastdata.augment import output_size
    from fastdata.datasets import ArraySource, DatasetSource, ImageFolder, make_image_folder

    arrays = ArraySource(np.zeros((4, 7, 5, 3), np.uint8), np.arange(4) % 2)
    assert output_size(arrays, Augmentation.none()) == (7, 5)
    assert output_size(arrays, Augmentation(crop="translate", pad=2)) == (7, 5)
    assert output_size(arrays, Augmentation(crop="random_resized", size=3)) == (3, 3)

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros((3, 9, 4), dtype=torch.uint8), 0

    assert output_size(DatasetSource(Samples()), Augmentation.none()) == (9, 4)
    assert output_size(DatasetSource(Samples(), channels=3), Augmentation.none()) is None   # sample 0 unread
    folder = make_image_folder(tmp_path, classes=2, per_class=1, size_range=((20, 24), (20, 24)))
    assert output_size(ImageFolder(folder), Augmentation.imagenet_eval(size=8, resize=10)) == (8, 8)
    assert output_size(ImageFolder(folder, transform=lambda im: im), Augmentation.none()) is None


def test_the_old_import_path_still_gives_every_name_it_had():
    """fastdata.transforms held the recipe and photo decoding until issue 32 split it into augment and
    images.photo (docs/contract.md named fastdata.transforms.draw_params): code importing from the old
    path gets the same objects."""
    import fastdata.augment as augment
    import fastdata.images.photo as photo
    import fastdata.transforms as old

    names = {"JPEG_FORMATS", "NUMPY_PAD_MODE", "open_image", "to_rgb", "exif_orientation", "load_pixels",
             "check_pixels", "RRC_TRIES", "RRC_DRAWS", "rrc_boxes", "rrc_params", "center_boxes", "center_params",
             "Params", "draw_params", "sample_box", "require_fixed_size", "recipe", "output_size",
             "require_padding_fits", "region_decode_enabled", "load_photo", "decode_upright", "crop_photo",
             "resize_box", "apply_params", "augment_array", "translate_offsets", "augment_batch"}
    assert set(old.__all__) == names
    for name in names:
        assert getattr(old, name) is getattr(augment, name, None) or getattr(old, name) is getattr(photo, name)
