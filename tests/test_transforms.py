"""transforms: the one source of random augmentation parameters, and the recipe's enums."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from conftest import file_bytes, pairs, skip_missing
from fastdata import Augmentation
from fastdata.config import Crop
from fastdata.datasets import SourceKind, SyntheticDigits
from fastdata.transforms import (
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
            params = super().make_params(flat_inputs)
            return {**params, "top": self.top, "left": self.left, "needs_crop": True}

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


# ---------------------------------------------------------------- region decoding inside load_photo
def _region_or_skip():
    from fastdata.region import region_available, region_decoder_status

    if not region_available():
        skip_missing(region_decoder_status())


def test_load_photo_decodes_only_the_window_with_the_full_decodes_pixels(photo_folder, monkeypatch):
    import fastdata.region as region
    from fastdata.datasets import ImageFolder
    from fastdata.transforms import load_photo

    _region_or_skip()
    calls = []
    real = region.decode_box
    monkeypatch.setattr(region, "decode_box", lambda *a, **k: calls.append(1) or real(*a, **k))
    # boxes under twice the output on a side: the full-decode path does not draft either
    aug = Augmentation(crop="random_resized", size=224, scale=(0.08, 0.5), hflip=0.5)
    paths = ImageFolder(photo_folder).paths[:12]
    for i, path in enumerate(paths):
        monkeypatch.setenv("FASTDATA_REGION_DECODE", "1")
        got = load_photo(*file_bytes(path), aug, np.random.default_rng(i))
        monkeypatch.setenv("FASTDATA_REGION_DECODE", "0")
        want = load_photo(*file_bytes(path), aug, np.random.default_rng(i))
        diff = np.abs(got.astype(int) - want.astype(int))
        assert diff.max() <= 1 and diff.mean() < 0.01, path  # the same box, flip and pixels
    assert len(calls) == len(paths)  # the region path ran (and only with the switch on)


def test_a_truncated_jpeg_is_still_refused_when_regions_are_decoded(photo_folder, tmp_path):
    from fastdata.datasets import ImageFolder
    from fastdata.errors import DecodeError
    from fastdata.transforms import load_photo

    _region_or_skip()
    data = open(ImageFolder(photo_folder).paths[0], "rb").read()
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(data[: int(len(data) * 0.9)])  # damage below any box near the top
    aug = Augmentation(crop="random_resized", size=32, scale=(0.01, 0.02))
    with pytest.raises(DecodeError, match="cut.jpg"):
        load_photo(*file_bytes(cut), aug, np.random.default_rng(0))
    # bytes after the end-of-image marker (cameras append data): decoded by the full path, not refused
    tail = tmp_path / "tail.jpg"
    tail.write_bytes(data + b"appended by a camera")
    assert load_photo(*file_bytes(tail), aug, np.random.default_rng(0)).shape == (32, 32, 3)


# ---------------------------------------------------------------- the JPEG header read without Pillow
def _jpeg_bytes(exif: bytes | None = None, app: bytes | None = None, size=(40, 24)) -> bytes:
    import io

    from PIL import Image

    yy, xx = np.mgrid[0:size[1], 0:size[0]]
    img = Image.fromarray(np.stack([xx * 5, yy * 9, xx + yy], -1).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **({"exif": exif} if exif is not None else {}))
    data = buf.getvalue()
    if app is not None:   # an extra segment right after SOI (XMP, ICC, a comment...)
        data = data[:2] + app + data[2:]
    return data


def _exif_block(orientation, endian="<", kind=3, count=1, extra_tags=()) -> bytes:
    """An APP1 EXIF payload: a TIFF block with IFD0 entries (tag, type, count, 4-byte value), by hand."""
    import struct

    tags = sorted([*extra_tags, (0x0112, kind, count, orientation)]) if orientation is not None else list(extra_tags)
    head = (b"II" if endian == "<" else b"MM") + struct.pack(endian + "HI", 42, 8)
    ifd = struct.pack(endian + "H", len(tags))
    for tag, k, n, value in tags:
        ifd += struct.pack(endian + "HHI", tag, k, n) + (struct.pack(endian + "HH", value, 0) if k == 3
                                                          else struct.pack(endian + "I", value))
    return b"Exif\x00\x00" + head + ifd + struct.pack(endian + "I", 0)


def _pillow_orientation(data: bytes) -> int:
    import io

    from PIL import Image

    from fastdata.transforms import exif_orientation

    return exif_orientation(Image.open(io.BytesIO(data)), "<bytes>")


@pytest.mark.parametrize("endian", ["<", ">"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_orientation_walk_reads_what_pillow_reads(orientation, endian):
    from fastdata.region import jpeg_orientation

    data = _jpeg_bytes(exif=_exif_block(orientation, endian, extra_tags=[(0x010F, 2, 4, 0x4D_41_43_00)]))
    assert jpeg_orientation(data) == _pillow_orientation(data) == orientation


def test_the_orientation_walk_without_exif_or_with_other_segments():
    import struct

    from fastdata.region import jpeg_orientation

    xmp = b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta/>"
    cases = {
        "no EXIF": _jpeg_bytes(),
        "XMP in APP1, not EXIF": _jpeg_bytes(app=b"\xff\xe1" + struct.pack(">H", len(xmp) + 2) + xmp),
        "a comment first": _jpeg_bytes(exif=_exif_block(6), app=b"\xff\xfe\x00\x05hi!"),
        "EXIF without the tag": _jpeg_bytes(exif=_exif_block(None, extra_tags=[(0x010F, 2, 4, 0)])),
    }
    for name, data in cases.items():
        assert jpeg_orientation(data) == _pillow_orientation(data), name


def test_an_orientation_in_xmp_alone_is_ignored_on_every_path():
    """Pillow's getexif reports XMP's tiff:Orientation when EXIF has none; nvImageCodec, DALI and
    torchvision.io apply EXIF's tag only. fastdata reads EXIF's alone on its Pillow path too, so whether
    a photo is turned does not depend on the backend, or on whether nvImageCodec is installed."""
    import io
    import struct

    from PIL import Image

    from fastdata.region import jpeg_orientation
    from fastdata.transforms import exif_orientation

    xmp = (b'http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF><rdf:Description '
           b'xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    app = b"\xff\xe1" + struct.pack(">H", len(xmp) + 2) + xmp
    for name, data, want in [
        ("XMP alone", _jpeg_bytes(app=app), 1),
        ("EXIF without the tag, then XMP", _jpeg_bytes(exif=_exif_block(None, extra_tags=[(0x010F, 2, 4, 0)]),
                                                       app=app), 1),
        ("EXIF's 3 and XMP's 6", _jpeg_bytes(exif=_exif_block(3), app=app), 3),
    ]:
        assert Image.open(io.BytesIO(data)).getexif().get(0x0112) == (6 if want == 1 else want), name
        assert jpeg_orientation(data) == _pillow_orientation(data) == want, name
        img = Image.open(io.BytesIO(data))
        exif_orientation(img, "<bytes>")
        assert img.info.get("xmp"), "the XMP packet is left in place for the caller"


def test_a_png_whose_pixels_fail_to_load_is_not_taken_for_a_bad_exif_block():
    """Pillow loads a whole PNG to look for an EXIF chunk after the pixels: a broken data stream there
    is the file's DecodeError, not orientation 1 and a half-decoded image."""
    import io

    from PIL import Image

    from fastdata.errors import DecodeError
    from fastdata.transforms import exif_orientation

    arr = (np.random.default_rng(2).random((60, 80, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(16)
    with pytest.raises(DecodeError, match="broken.png") as info:
        exif_orientation(Image.open(io.BytesIO(bytes(data))), "broken.png")
    assert info.value.path == "broken.png"
    buf.seek(0)
    assert exif_orientation(Image.open(buf), "fine.png") == 1


def test_anything_the_walk_does_not_read_is_left_to_pillow():
    from fastdata.region import jpeg_header, jpeg_orientation

    assert jpeg_orientation(b"\x89PNG\r\n\x1a\n") is None
    assert jpeg_orientation(_jpeg_bytes(exif=_exif_block(6, kind=4))) is None        # a LONG, not a SHORT
    assert jpeg_orientation(_jpeg_bytes(exif=b"Exif\x00\x00XX" + b"\x00" * 8)) is None  # no byte order
    assert jpeg_orientation(_jpeg_bytes(exif=_exif_block(9))) is None                  # out of range
    broken = _jpeg_bytes(exif=_exif_block(6))
    assert jpeg_orientation(broken[:30]) is None                                       # cut in the EXIF
    _region_or_skip()
    assert jpeg_header(b"\xff\xd8\xff\xe0garbage") is None
    assert jpeg_header(_jpeg_bytes(exif=_exif_block(6), size=(40, 24))) == (24, 40, 6)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_load_photo_gives_the_same_pixels_with_either_header_reader(tmp_path, monkeypatch, orientation):
    import fastdata.transforms as T

    _region_or_skip()
    path = tmp_path / f"o{orientation}.jpg"
    path.write_bytes(_jpeg_bytes(exif=_exif_block(orientation), size=(96, 64)))
    aug = Augmentation(crop="random_resized", size=32, hflip=0.5)
    seen = []
    real = T._jpeg_header
    monkeypatch.setattr(T, "_jpeg_header", lambda *a: seen.append(real(*a)) or seen[-1])
    fast = [T.load_photo(*file_bytes(path), aug, np.random.default_rng(s)) for s in range(6)]
    assert seen and all(h == (64, 96, orientation) for h in seen)   # read without Pillow
    monkeypatch.setattr(T, "_jpeg_header", lambda *a: None)
    slow = [T.load_photo(*file_bytes(path), aug, np.random.default_rng(s)) for s in range(6)]
    for a, b in zip(fast, slow):
        assert np.array_equal(a, b)


def test_files_pillow_must_refuse_still_go_through_pillow(tmp_path, monkeypatch):
    from PIL import Image

    import fastdata.transforms as T
    from fastdata.errors import DecodeError

    _region_or_skip()
    data = _jpeg_bytes(size=(96, 64))
    named_png = tmp_path / "photo.png"
    named_png.write_bytes(data)
    assert T._jpeg_header(named_png, data) is None
    with pytest.raises(DecodeError, match="named .png"):
        T.load_photo(*file_bytes(named_png), Augmentation(crop="random_resized", size=32), np.random.default_rng(0))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 96 * 64 - 1)
    bomb = tmp_path / "bomb.jpg"
    bomb.write_bytes(data)
    assert T._jpeg_header(bomb, data) is None
    with pytest.raises(DecodeError, match="decompression-bomb"):
        T.load_photo(*file_bytes(bomb), Augmentation(crop="random_resized", size=32), np.random.default_rng(0))
    monkeypatch.setenv("FASTDATA_REGION_DECODE", "0")
    assert T._jpeg_header(tmp_path / "x.jpg", data) is None


def test_training_on_region_decoded_photos_matches_full_decoding(photo_folder, monkeypatch):
    """Accuracy is unchanged: for one seed, region decoding draws the same augmentation boxes and
    flips as the full decode, its batches differ by at most 1 grey level, and a few SGD steps of the
    same model on each end at the same losses."""
    import torch

    import fastdata.transforms as T
    from fastdata import make_loader
    from fastdata.datasets import ImageFolder
    from fastdata.models import SmallCNN

    _region_or_skip()
    real = T.sample_box
    # boxes under twice the output on a side, so neither path shrinks with Image.draft (which would
    # make both paths' pixels differ from a full decode by design)
    aug = Augmentation(crop="random_resized", size=224, scale=(0.08, 0.5), hflip=0.5)

    def run(region: str):
        monkeypatch.setenv("FASTDATA_REGION_DECODE", region)
        drawn = []
        monkeypatch.setattr(T, "sample_box", lambda *a: drawn.append(real(*a)) or drawn[-1])
        loader = make_loader(ImageFolder(photo_folder), "torch", batch_size=6, num_workers=0, device="cpu",
                             augment=aug, seed=3,
                             quiet=True)
        torch.manual_seed(0)
        model = SmallCNN(num_classes=loader.num_classes, in_channels=3, width=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        batches, losses = [], []
        for _ in range(2):
            for images, labels in loader:
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                batches.append(images)
                losses.append(loss.item())
        grey = float(loader.normalizer.scale.max())   # one grey level, in normalized units
        return drawn, batches, losses, grey

    boxes_region, batches_region, losses_region, grey = run("1")
    boxes_full, batches_full, losses_full, _ = run("0")
    assert boxes_region == boxes_full and len(boxes_full) >= 12
    for a, b in zip(batches_region, batches_full, strict=True):
        diff = (a - b).abs()
        assert float(diff.max()) <= 1.001 * grey and float(diff.mean()) < 0.01 * grey
    assert losses_region == pytest.approx(losses_full, rel=1e-3)


def test_a_webp_file_this_pillow_cannot_read_says_why(tmp_path):
    """ImageFolder lists .webp (torchvision does); a Pillow built without libwebp cannot open them."""
    import warnings

    from PIL import features

    from fastdata.errors import DecodeError
    from fastdata.transforms import open_image

    if features.check("webp"):
        pytest.skip("this Pillow reads WebP")
    path = tmp_path / "photo.webp"
    path.write_bytes(b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # Pillow's own "WEBP support not installed"
        with pytest.raises(DecodeError, match=r"built without WEBP support \(PIL.features.check\('webp'\) is False\)"):
            open_image(path)


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

    from fastdata.datasets import ArraySource, DatasetSource, ImageFolder, make_image_folder
    from fastdata.transforms import output_size

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
