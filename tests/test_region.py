"""region: decoding only a crop box's window of a JPEG agrees with Pillow's full decode + crop.

Tolerance: max abs difference <= 1 and mean <= 0.01 per channel value. Both decoders are libjpeg-turbo
with the integer IDCT and fancy upsampling, and libjpeg-turbo keeps the upsampling's context at a
window's edge, so the pixels are the same (measured: max 0 on every file and box here). The one level
allows for two builds of libjpeg-turbo (Pillow's and nvImageCodec's own) whose SIMD and C paths round
differently. A window off by one pixel is far outside it (checked below), so the tolerance catches a
misplaced window.
"""
from __future__ import annotations

import io
import multiprocessing as mp

import numpy as np
import pytest
from PIL import Image

from conftest import skip_missing
from fastdata.augment import rrc_params
from fastdata.datasets import make_image_folder
from fastdata.errors import DecodeError
from fastdata.images import region

if not region.region_available():
    skip_missing(region.region_decoder_status(), allow_module_level=True)

MAX_DIFF, MEAN_DIFF = 1, 0.01


def encode(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def full_decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def diff(a, b):
    d = np.abs(np.asarray(a).astype(np.int16) - np.asarray(b).astype(np.int16))
    return int(d.max()), float(d.mean())


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    """One ImageNet-like photo (~450x350, 1/f² texture, so a misplaced pixel shows)."""
    root = make_image_folder(tmp_path_factory.mktemp("region"), classes=1, per_class=1, seed=3)
    return Image.open(next(root.rglob("*.jpg"))).convert("RGB")


@pytest.fixture(scope="module")
def variants(photo):
    """Encodings libjpeg-turbo decodes differently: chroma subsampling, progressive scans, restart
    markers, grey, sizes that are not whole blocks."""
    return {
        "baseline 4:2:0": encode(photo, quality=90),
        "progressive": encode(photo, quality=90, progressive=True),
        "4:4:4": encode(photo, quality=90, subsampling=0),
        "4:2:2": encode(photo, quality=90, subsampling=1),
        "optimized huffman q75": encode(photo, quality=75, optimize=True),
        "grey": encode(photo.convert("L"), quality=90),
        "odd size 333x217": encode(photo.resize((333, 217)), quality=90),
        "tiny 5x3": encode(photo.resize((5, 3)), quality=90),
    }


def boxes_for(h, w):
    """Integer boxes (top, left, h, w): whole image, edges, corners, odd offsets and sizes, 1 pixel."""
    out = [(0, 0, h, w), (h - 1, w - 1, 1, 1), (0, 0, 1, 1), (h // 3, w // 3, h // 2, w // 2),
           # 1-pixel strips along the edges (nvImageCodec 0.9 alone gets column 0 of a 4:2:0 JPEG wrong)
           (0, 0, h, 1), (0, 0, 1, w), (0, w - 1, h, 1), (h - 1, 0, 1, w)]
    if h > 8 and w > 8:
        out += [(1, 1, h - 2, w - 2), (3, 5, h - 3, w - 5), (h - 7, 0, 7, w), (0, w - 9, h, 9),
                (5, 7, 13, 17)]
    return out


@pytest.mark.parametrize("kind", ["baseline 4:2:0", "progressive", "4:4:4", "4:2:2", "optimized huffman q75",
                                  "grey", "odd size 333x217", "tiny 5x3"])
def test_window_equals_full_decode_crop(variants, kind):
    data = variants[kind]
    ref = full_decode(data)
    h, w = ref.shape[:2]
    for top, left, bh, bw in boxes_for(h, w):
        got = region.decode_box(data, (top, left, bh, bw), None, policy="region")
        assert got is not None, (kind, (top, left, bh, bw))
        assert got.window == (top, left, top + bh, left + bw)
        assert got.box == (0.0, 0.0, float(bw), float(bh))
        arr = np.asarray(got.image)
        assert arr.shape == (bh, bw, 3) and arr.dtype == np.uint8
        mx, mean = diff(arr, ref[top:top + bh, left:left + bw])
        assert mx <= MAX_DIFF and mean <= MEAN_DIFF, (kind, (top, left, bh, bw), mx, mean)


def test_the_tolerance_catches_a_window_one_pixel_off(variants):
    ref = full_decode(variants["baseline 4:2:0"])
    got = np.asarray(region.decode_box(variants["baseline 4:2:0"], (40, 50, 100, 120), None, policy="region").image)
    for dy, dx in ((1, 0), (0, 1)):
        mx, mean = diff(got, ref[40 + dy:140 + dy, 50 + dx:170 + dx])
        assert mx > MAX_DIFF and mean > 100 * MEAN_DIFF


@pytest.mark.parametrize("out", [224, 64, 17])
def test_resizing_the_window_equals_resizing_the_full_image(variants, out):
    """The window carries the bilinear filter's margin, so the recipe's resize of the returned box
    equals the resize of the fully decoded image with the original (fractional) box."""
    data = variants["baseline 4:2:0"]
    full = Image.open(io.BytesIO(data)).convert("RGB")
    rng = np.random.default_rng(0)
    for _ in range(12):
        top, left, bh, bw = rrc_params(rng, full.height, full.width, (0.08, 1.0), (3 / 4, 4 / 3))
        # the recipe's boxes are fractional where they come from center_params: shift by a fraction too
        box = (top + 0.37 * (top + bh < full.height), left + 0.61 * (left + bw < full.width), bh - 0.5, bw - 0.25)
        got = region.decode_box(data, box, out, policy="region")
        y0, x0, y1, x1 = got.window
        assert y0 <= box[0] and x0 <= box[1] and y1 >= box[0] + box[2] and x1 >= box[1] + box[3]
        mine = got.image.resize((out, out), Image.BILINEAR, box=got.box)
        ref = full.resize((out, out), Image.BILINEAR, box=(box[1], box[0], box[1] + box[3], box[0] + box[2]))
        mx, mean = diff(mine, ref)
        assert mx <= MAX_DIFF and mean <= MEAN_DIFF, (box, mx, mean)


def test_the_window_is_the_box_plus_the_filter_margin_clamped_to_the_image():
    # 2x shrink: bilinear support 2 source pixels + 1 for PIL's rounding of its window bounds.
    assert region.plan_window(400, 300, (100.5, 50.2, 180, 180), 90) == (97, 47, 284, 234)
    assert region.plan_window(400, 300, (100.5, 50.2, 180, 180), None) == (100, 50, 281, 231)
    # enlarging: support 1 pixel + 1; at the image's edges the window stops there
    assert region.plan_window(400, 300, (0, 0, 50, 400), 224) == (0, 0, 52, 400)
    assert region.plan_window(400, 300, (290, 390, 10, 10), 224) == (288, 388, 300, 400)


def test_path_and_bytes_give_the_same_pixels(tmp_path, variants):
    path = tmp_path / "a.jpg"
    path.write_bytes(variants["progressive"])
    a = region.decode_box(path, (10, 20, 100, 150), 64, policy="region")
    b = region.decode_box(variants["progressive"], (10, 20, 100, 150), 64, policy="region")
    assert a.window == b.window and np.array_equal(np.asarray(a.image), np.asarray(b.image))


def test_exif_orientation_is_not_applied(photo):
    """The box is in stored pixels: the caller region-decodes only upright files (orientation 1)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(photo, quality=90, exif=exif.tobytes())
    got = region.decode_box(data, (0, 0, photo.height, photo.width), None, policy="region")
    assert got.image.size == photo.size  # not rotated to (h, w)
    assert diff(got.image, full_decode(data))[0] <= MAX_DIFF


def test_cmyk_and_other_formats_fall_back_to_the_caller(photo):
    assert region.decode_box(encode(photo.convert("CMYK"), quality=90), (0, 0, 10, 10), None) is None
    png = io.BytesIO()
    photo.save(png, "PNG")
    assert region.decode_box(png.getvalue(), (0, 0, 10, 10), None) is None


def test_broken_data_raises_decode_error_naming_the_file(tmp_path, variants):
    data = variants["baseline 4:2:0"]
    h = full_decode(data).shape[0]
    path = tmp_path / "truncated.jpg"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DecodeError, match="truncated.jpg") as err:
        region.decode_box(path, (h - 20, 0, 20, 20), None)
    assert err.value.path == str(path) and "truncated or corrupt" in err.value.reason
    # The decoder stops at the window's last row: damage below it is not seen (a caller that must
    # refuse every broken file checks the whole file once, as transforms.check_pixels does).
    top = region.decode_box(path, (0, 0, 16, 16), None, policy="region")
    assert diff(top.image, full_decode(data)[:16, :16])[0] <= MAX_DIFF
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with pytest.raises(DecodeError, match="junk.jpg"):
        region.decode_box(junk, (0, 0, 10, 10), None)
    with pytest.raises(DecodeError, match="missing.jpg"):
        region.decode_box(tmp_path / "missing.jpg", (0, 0, 10, 10), None)
    with pytest.raises(DecodeError, match="<bytes>"):
        region.decode_box(b"", (0, 0, 10, 10), None)


def test_decode_box_is_not_a_validator(variants):
    """Corrupt entropy data that Pillow refuses ("broken data stream") is decoded into wrong pixels
    by nvImageCodec without an error: a caller that must refuse the files Pillow refuses checks each
    file once with Pillow (transforms.check_pixels), as the dali backend does."""
    from fastdata.images.photo import check_pixels

    data = bytearray(variants["baseline 4:2:0"])
    data[len(data) // 2:len(data) // 2 + 100] = b"\xff" * 100
    data = bytes(data)
    h, w = full_decode(variants["baseline 4:2:0"]).shape[:2]
    got = region.decode_box(data, (h - 10, 0, 10, w), None)
    assert got is not None and got.image.size == (w, 10)
    with pytest.raises(DecodeError, match="corrupt.jpg"):
        check_pixels(Image.open(io.BytesIO(data)), "corrupt.jpg")


def test_bad_arguments_are_errors_naming_them(variants):
    data = variants["baseline 4:2:0"]
    h, w = full_decode(data).shape[:2]
    with pytest.raises(ValueError, match=r"^unknown policy 'fast'; choose from \['auto', 'region'\]$"):
        region.decode_box(data, (0, 0, 10, 10), None, policy="fast")
    for box in ((0, 0, h + 1, 10), (-2, 0, 10, 10), (0, w - 5, 10, 6), (0, 0, 0, 10)):
        with pytest.raises(ValueError, match=f"not inside the {w}x{h} image"):
            region.decode_box(data, box, 224)


def test_auto_leaves_large_shrunk_boxes_to_the_draft_path(tmp_path):
    """Entropy decoding of every row above the box's bottom is not skipped, so a large box shrunk 4x
    is cheaper as a full decode at 1/4 scale; a small box in the top rows is cheaper as a window."""
    big = make_image_folder(tmp_path, classes=1, per_class=1, seed=5, size_range=((1600, 1600), (1200, 1200)))
    data = next(big.rglob("*.jpg")).read_bytes()
    h, w = full_decode(data).shape[:2]
    assert region.choose(w, h, (0, 0, h, w), 224) == "draft"
    assert region.decode_box(data, (0, 0, h, w), 224) is None
    assert region.choose(w, h, (0, 0, 300, 300), 224) == "region"
    assert region.decode_box(data, (0, 0, 300, 300), 224) is not None
    # nothing to shrink: the window always wins
    assert region.choose(w, h, (h - 224, w - 224, 224, 224), 224) == "region"
    assert region.draft_cost(1) == 1.0 and region.region_cost(w, h, (0, 0, h, w)) == pytest.approx(1.0)


def test_draft_scale_is_the_reduction_pillow_applies(variants):
    """The cost model compares against the scale ``Image.draft`` really picks for load_photo's request."""
    import math

    data = variants["baseline 4:2:0"]
    rng = np.random.default_rng(1)
    for _ in range(40):
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            bh, bw = rng.uniform(8, h), rng.uniform(8, w)
            out = int(rng.integers(16, 200))
            want = (max(1, math.ceil(w * out / bw)), max(1, math.ceil(h * out / bh)))
            if want[0] < w and want[1] < h:
                im.draft("RGB", want)
            got = round(w / im.size[0])
        assert region.draft_scale(w, h, bh, bw, out, out) == got, (bh, bw, out)


def _decode_in_child(data, queue):
    queue.put(np.asarray(region.decode_box(data, (5, 6, 70, 80), None, policy="region").image))


def test_a_forked_worker_makes_its_own_decoder(variants):
    data = variants["baseline 4:2:0"]
    parent = np.asarray(region.decode_box(data, (5, 6, 70, 80), None, policy="region").image)
    made_here = region._local.decoder[0]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_decode_in_child, args=(data, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and np.array_equal(got, parent)
    assert region._local.decoder[0] == made_here  # the child's decoder did not replace the parent's


def test_without_nvimgcodec_the_status_says_why_and_decode_box_declines(monkeypatch, variants):
    def missing():
        raise ImportError("No module named 'nvidia.nvimgcodec'")

    monkeypatch.setattr(region, "_import", missing)
    region.region_decoder_status.cache_clear()
    try:
        status = region.region_decoder_status()
        assert status.startswith("unavailable: nvImageCodec is not installed") and "nvidia-nvimgcodec" in status
        assert not region.region_available()
        assert region.decode_box(variants["baseline 4:2:0"], (0, 0, 10, 10), None) is None
    finally:
        region.region_decoder_status.cache_clear()


def test_status_names_the_version_when_available():
    from nvidia import nvimgcodec

    assert region.region_decoder_status().startswith(f"available: nvImageCodec {nvimgcodec.__version__}")


def test_the_old_import_path_still_gives_every_name_it_had():
    """fastdata.region moved to fastdata.images.region in issue 32 (docs/benchmarks.md named it): code
    importing from the old path gets the same objects."""
    import fastdata.region as old

    names = {"INSTALL_HINT", "DecodedBox", "region_decoder_status", "region_available", "decode_window",
             "JPEG_START", "is_jpeg", "jpeg_orientation", "jpeg_header", "draft_scale", "region_cost", "draft_cost",
             "plan_window", "choose", "decode_box"}
    assert set(old.__all__) == names
    for name in names:
        assert getattr(old, name) is getattr(region, name)
