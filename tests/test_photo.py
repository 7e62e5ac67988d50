"""images.photo: a photo's bytes → pixels: region decoding inside load_photo, the JPEG header read
without Pillow, and the errors that name what is wrong with a file."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import file_bytes, skip_missing
from fastdata import Augmentation


# ---------------------------------------------------------------- region decoding inside load_photo
def _region_or_skip():
    from fastdata.images.region import region_available, region_decoder_status

    if not region_available():
        skip_missing(region_decoder_status())


def test_load_photo_decodes_only_the_window_with_the_full_decodes_pixels(photo_folder, monkeypatch):
    import fastdata.images.region as region
    from fastdata.datasets import ImageFolder
    from fastdata.images.photo import load_photo

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
    from fastdata.images.photo import load_photo

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

    from fastdata.images.photo import exif_orientation

    return exif_orientation(Image.open(io.BytesIO(data)), "<bytes>")


@pytest.mark.parametrize("endian", ["<", ">"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_orientation_walk_reads_what_pillow_reads(orientation, endian):
    from fastdata.images.region import jpeg_orientation

    data = _jpeg_bytes(exif=_exif_block(orientation, endian, extra_tags=[(0x010F, 2, 4, 0x4D_41_43_00)]))
    assert jpeg_orientation(data) == _pillow_orientation(data) == orientation


def test_the_orientation_walk_without_exif_or_with_other_segments():
    import struct

    from fastdata.images.region import jpeg_orientation

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

    from fastdata.images.photo import exif_orientation
    from fastdata.images.region import jpeg_orientation

    xmp = (b'http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF><rdf:Description '
           b'xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    app = b"\xff\xe1" + struct.pack(">H", len(xmp) + 2) + xmp
    for name, data, want in [
        ("XMP alone", _jpeg_bytes(app=app), 1),
        ("EXIF without the tag, then XMP", _jpeg_bytes(exif=_exif_block(None, extra_tags=[(0x010F, 2, 4, 0)]),
                                                       app=app), 1),
        ("EXIF's 3 and XMP's 6", _jpeg_bytes(exif=_exif_block(3), app=app), 3),
    ]:
        # Pillow 9.1 (the floor) reads no XMP in getexif: there the XMP-only cases report nothing.
        assert Image.open(io.BytesIO(data)).getexif().get(0x0112) in ((6, None) if want == 1 else (want,)), name
        assert jpeg_orientation(data) == _pillow_orientation(data) == want, name
        img = Image.open(io.BytesIO(data))
        exif_orientation(img, "<bytes>")
        # as Pillow read it (Pillow 9.1 keeps no XMP in a JPEG's info: None both sides there)
        assert img.info.get("xmp") == Image.open(io.BytesIO(data)).info.get("xmp"), \
            "the XMP packet is left in place for the caller"


def test_a_png_whose_pixels_fail_to_load_is_not_taken_for_a_bad_exif_block():
    """Pillow loads a whole PNG to look for an EXIF chunk after the pixels: a broken data stream there
    is the file's DecodeError, not orientation 1 and a half-decoded image."""
    import io

    from PIL import Image

    from fastdata.errors import DecodeError
    from fastdata.images.photo import exif_orientation

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
    from fastdata.images.region import jpeg_header, jpeg_orientation

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
    import fastdata.images.photo as P

    _region_or_skip()
    path = tmp_path / f"o{orientation}.jpg"
    path.write_bytes(_jpeg_bytes(exif=_exif_block(orientation), size=(96, 64)))
    aug = Augmentation(crop="random_resized", size=32, hflip=0.5)
    seen = []
    real = P._jpeg_header
    monkeypatch.setattr(P, "_jpeg_header", lambda *a: seen.append(real(*a)) or seen[-1])
    fast = [P.load_photo(*file_bytes(path), aug, np.random.default_rng(s)) for s in range(6)]
    assert seen and all(h == (64, 96, orientation) for h in seen)   # read without Pillow
    monkeypatch.setattr(P, "_jpeg_header", lambda *a: None)
    slow = [P.load_photo(*file_bytes(path), aug, np.random.default_rng(s)) for s in range(6)]
    for a, b in zip(fast, slow):
        assert np.array_equal(a, b)


def test_files_pillow_must_refuse_still_go_through_pillow(tmp_path, monkeypatch):
    from PIL import Image

    import fastdata.images.photo as P
    from fastdata.errors import DecodeError

    _region_or_skip()
    data = _jpeg_bytes(size=(96, 64))
    named_png = tmp_path / "photo.png"
    named_png.write_bytes(data)
    assert P._jpeg_header(named_png, data) is None
    with pytest.raises(DecodeError, match="named .png"):
        P.load_photo(*file_bytes(named_png), Augmentation(crop="random_resized", size=32), np.random.default_rng(0))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 96 * 64 - 1)
    bomb = tmp_path / "bomb.jpg"
    bomb.write_bytes(data)
    assert P._jpeg_header(bomb, data) is None
    with pytest.raises(DecodeError, match="decompression-bomb"):
        P.load_photo(*file_bytes(bomb), Augmentation(crop="random_resized", size=32), np.random.default_rng(0))
    monkeypatch.setenv("FASTDATA_REGION_DECODE", "0")
    assert P._jpeg_header(tmp_path / "x.jpg", data) is None


def test_training_on_region_decoded_photos_matches_full_decoding(photo_folder, monkeypatch):
    """Accuracy is unchanged: for one seed, region decoding draws the same augmentation boxes and
    flips as the full decode, its batches differ by at most 1 grey level, and a few SGD steps of the
    same model on each end at the same losses."""
    import torch

    import fastdata.images.photo as P
    from fastdata import make_loader
    from fastdata.datasets import ImageFolder
    from fastdata.models import SmallCNN

    _region_or_skip()
    real = P.sample_box
    # boxes under twice the output on a side, so neither path shrinks with Image.draft (which would
    # make both paths' pixels differ from a full decode by design)
    aug = Augmentation(crop="random_resized", size=224, scale=(0.08, 0.5), hflip=0.5)

    def run(region: str):
        monkeypatch.setenv("FASTDATA_REGION_DECODE", region)
        drawn = []
        monkeypatch.setattr(P, "sample_box", lambda *a: drawn.append(real(*a)) or drawn[-1])
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
    from fastdata.images.photo import open_image

    if features.check("webp"):
        pytest.skip("this Pillow reads WebP")
    path = tmp_path / "photo.webp"
    path.write_bytes(b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # Pillow's own "WEBP support not installed"
        with pytest.raises(DecodeError, match=r"built without WEBP support \(PIL.features.check\('webp'\) is False\)"):
            open_image(path)


@pytest.mark.parametrize("orientation", [1, 6])
def test_a_dark_16_bit_pgm_is_scaled_from_its_16_bits_not_read_as_8_bit(tmp_path, orientation):
    """Pillow reads a PGM of maxval 1023 as a 32-bit image scaled to 0..65535. Its range was read off its
    values: a dark one (nothing above 255 after the scaling) was taken for 8-bit and came out 257 times as
    bright as the same picture with one bright pixel. Turned by EXIF (a copy without the format) too."""
    from PIL import Image

    from fastdata.images.photo import decode_upright

    dark = (np.arange(32 * 32).reshape(32, 32) % 4).astype(">u2")     # 0..3 of 1023
    bright = dark.copy()
    bright[0, 0] = 1023
    out = []
    for k, data in enumerate((dark, bright)):
        path = tmp_path / f"p{k}.pgm"
        path.write_bytes(b"P5\n32 32\n1023\n" + data.tobytes())
        img = Image.open(path)
        assert img.mode == "I"
        out.append(np.asarray(decode_upright(img, path, orientation)))
    assert out[0].max() <= 1   # 3/1023 of white
    np.testing.assert_array_equal(out[0][1:, 1:], out[1][1:, 1:])


def test_a_photo_over_the_pixel_limit_says_how_to_read_it(tmp_path, monkeypatch):
    """Satellite tiles, slides and panoramas are over Pillow's decompression-bomb limit on purpose: the
    refusal named the limit but not how to lift it. It now says: raise PIL.Image.MAX_IMAGE_PIXELS (or
    set it to None); once raised, the photo is read."""
    from PIL import Image

    import fastdata.images.photo as P
    from fastdata.errors import DecodeError

    path = tmp_path / "wide.jpg"
    path.write_bytes(_jpeg_bytes(size=(96, 64)))
    for limit in (96 * 64 - 1, 96 * 64 // 3):   # Pillow warns (1x-2x its limit), and raises (over 2x)
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with pytest.raises(DecodeError, match=r"decompression-bomb.* photos this large are read once "
                                              r"PIL\.Image\.MAX_IMAGE_PIXELS is raised above their pixels"):
            P.open_image(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert P.open_image(path).size == (96, 64)
