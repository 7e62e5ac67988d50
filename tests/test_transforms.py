"""transforms: the one source of random augmentation parameters, and the recipe's enums."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from fastdata import Augmentation
from fastdata.config import Crop
from fastdata.datasets import SourceKind, SyntheticDigits
from fastdata.transforms import apply_params, augment_batch, draw_params, require_fixed_size, rrc_params, sample_box

RRC = Augmentation(crop="random_resized", size=8, hflip=0.5)
SHIFT = Augmentation(crop="translate", pad=2, hflip=0.5)


@pytest.mark.parametrize("aug", [RRC, SHIFT, Augmentation(crop="center", size=8, resize=10, hflip=0.5),
                                 Augmentation(hflip=0.5), Augmentation()])
def test_the_same_seed_gives_the_same_parameters(aug):
    a = draw_params(aug, np.random.default_rng(7), 16, (20, 30))
    b = draw_params(aug, np.random.default_rng(7), 16, (20, 30))
    for x, y in zip(a, b):
        assert (x is None and y is None) or np.array_equal(x, y)
    assert len(a.flips) == 16 and a.flips.dtype == bool


def test_translate_draws_all_offsets_then_all_flips():
    rng = np.random.default_rng(3)
    offsets = rng.integers(0, 5, size=(10, 2))
    flips = rng.random(10) < 0.5
    p = draw_params(SHIFT, np.random.default_rng(3), 10, (28, 28))
    assert np.array_equal(p.offsets, offsets) and np.array_equal(p.flips, flips) and p.boxes is None


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

    for path in sorted(Path(fastdata.backends.__file__).parent.glob("*.py")):
        text = path.read_text()
        draws = re.findall(r".*(?:\brng\.|random\(|\.integers\(|\.uniform\().*", text)
        assert not draws, f"{path.name} draws random numbers itself: {draws}"
