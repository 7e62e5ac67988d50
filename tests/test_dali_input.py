"""decode.dali_input: which files DALI is given other bytes for (a JPEG's EXIF block rewritten, a PNG of
Pillow's reading for a format DALI reads otherwise) and those bytes; the last test decodes them in the dali
backend (test_real_broken_files.py and test_qa_photos.py have more)."""
from __future__ import annotations

import io
import struct
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.decode.dali_input import dali_bytes, dali_input, exif_segment, strict_orientation, with_orientation
from test_real_broken_files import CORRUPT_EXIF, _with_exif


def _photo(**save) -> bytes:
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(out, "JPEG", quality=90, **save)
    return out.getvalue()


def _camera_exif(orientation: int) -> bytes:
    """An EXIF block as a camera writes it: several IFD0 tags, values stored past the entries
    (strings, rationals) and an Exif sub-IFD, written by Pillow."""
    exif = Image.Exif()
    exif[0x010F] = "Camera maker, long enough to be stored out of line"
    exif[0x0110] = "Model X"
    exif[0x011A] = 72.0
    exif[0x0112] = orientation
    exif.get_ifd(0x8769)[0x9003] = "2026:11:27 12:00:00"
    return exif.tobytes()


def _scan(data: bytes) -> bytes:
    """The bytes from the start-of-scan marker on: the compressed pixels."""
    return data[data.index(b"\xff\xda"):]


def _pillow_orientation(data: bytes) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Image.open(io.BytesIO(data)).getexif().get(0x0112, 1)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_a_well_formed_camera_block_is_given_to_dali_as_it_is(orientation):
    data = _photo(exif=_camera_exif(orientation))
    assert strict_orientation(data) == orientation == _pillow_orientation(data)
    assert dali_bytes(data, orientation) is None


def test_a_photo_without_exif_or_not_a_jpeg_is_given_as_it_is():
    assert strict_orientation(_photo()) == 1 and dali_bytes(_photo(), 1) is None
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    assert dali_bytes(png.getvalue(), 1) is None


@pytest.mark.parametrize("name", sorted(CORRUPT_EXIF))
def test_a_malformed_block_is_rewritten_to_pillows_orientation_with_the_same_scan(name):
    """Every block found broken in the wild fails the strict reading (an IFD count past the block
    included, which the lenient header walk and Pillow read); the rewrite holds Pillow's orientation in
    a block that is beyond doubt, and the compressed pixels are the same bytes."""
    data = _with_exif(_photo(), CORRUPT_EXIF[name])
    assert strict_orientation(data) is None
    pillow = _pillow_orientation(data)
    fixed = dali_bytes(data, pillow)
    assert fixed is not None and _scan(fixed) == _scan(data)
    assert strict_orientation(fixed) == pillow == _pillow_orientation(fixed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Pillow's "Corrupt EXIF data" on the original
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(fixed))), np.asarray(Image.open(io.BytesIO(data))))


def test_another_orientation_than_pillows_or_two_blocks_are_rewritten_to_one():
    data = _photo(exif=_camera_exif(6))
    fixed = dali_bytes(data, 1)   # Pillow's reading says 1: no block left at all
    assert fixed is not None and b"Exif\x00\x00" not in fixed[:fixed.index(b"\xff\xda")]
    twice = _with_exif(data, _camera_exif(3)[6:])   # a second Exif APP1 in front of the first
    assert strict_orientation(twice) is None
    fixed = dali_bytes(twice, 3)
    assert fixed is not None and fixed[:fixed.index(b"\xff\xda")].count(b"Exif\x00\x00") == 1
    assert strict_orientation(fixed) == 3 and _scan(fixed) == _scan(data)


def test_markers_the_walk_does_not_follow_are_left_alone():
    data = _with_exif(_photo(), CORRUPT_EXIF["orientation_as_long"])
    broken = data[:2] + b"\x00\x00" + data[4:]   # not a marker where a segment should start
    assert with_orientation(broken, 6) is None and dali_bytes(broken, 6) is None
    cut = data[:data.index(b"\xff\xda")]          # no scan: nothing to copy the segments in front of
    assert with_orientation(cut, 6) is None


def test_the_minimal_block_is_one_short_orientation_in_a_big_endian_tiff():
    seg = exif_segment(6)
    assert seg[:2] == b"\xff\xe1" and struct.unpack(">H", seg[2:4])[0] == len(seg) - 2
    tiff = seg[10:]
    assert tiff[:4] == b"MM\x00\x2a" and struct.unpack(">IHHHIH", tiff[4:20]) == (8, 1, 0x0112, 3, 1, 6)


# ------------------------------------------------------------------------------ formats
def _saved(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def _scene() -> Image.Image:
    yy, xx = np.mgrid[0:24, 0:40]
    return Image.fromarray(np.stack([xx * 6, yy * 10, (xx + yy) * 4], -1).astype(np.uint8))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP"])
def test_the_formats_dali_reads_as_pillow_go_as_they_are(fmt):
    assert dali_input("p", _saved(_scene(), fmt), 1) is None


@pytest.mark.parametrize("fmt, mode", [("GIF", "P"), ("TIFF", "LA"), ("TIFF", "RGB"), ("PPM", "RGB")])
def test_another_format_goes_as_a_png_of_pillows_reading_turned_upright(fmt, mode):
    data = _saved(_scene().convert(mode), fmt)
    png = dali_input("p", data, 6)   # as if its orientation were 6: the PNG holds the turned picture
    expected = _scene().convert(mode).convert("RGB").transpose(Image.Transpose.ROTATE_270)
    got = Image.open(io.BytesIO(png))
    assert got.format == "PNG" and got.mode == "RGB" and not got.getexif()
    assert np.array_equal(np.asarray(got), np.asarray(expected))


def test_a_file_pillow_cannot_decode_is_a_decode_error_naming_it():
    from fastdata import DecodeError

    data = _saved(_scene(), "TIFF")
    with pytest.raises(DecodeError, match="broken.tif"):
        dali_input("broken.tif", data[: len(data) // 2], 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("packed", [False, True], ids=["file names", "shard bytes"])
def test_dalis_own_decoder_reads_a_gif_and_a_turned_tiff_as_the_torch_backend(tmp_path, packed, device):
    """decode='dali': a GIF failed the whole batch inside DALI (every other backend reads its first
    frame), and a TIFF's own Orientation tag was not applied. Both now reach DALI as PNGs of Pillow's
    reading: the torch backend's pixels, in two epochs (the second reads plain files from the copies).
    On a GPU the PNGs go through DALI's mixed decoder."""
    pytest.importorskip("nvidia.dali.plugin.pytorch")
    import fastdata
    from fastdata import Augmentation, make_loader
    from fastdata.datasets import ImageFolder, Shards

    (tmp_path / "photos" / "a").mkdir(parents=True)
    scene = _scene().resize((80, 48))
    scene.save(tmp_path / "photos" / "a" / "anim.gif", save_all=True,
               append_images=[scene.transpose(Image.Transpose.ROTATE_180)])
    scene.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "photos" / "a" / "turned.tif", tiffinfo={0x0112: 6})
    scene.save(tmp_path / "photos" / "a" / "plain.jpg", quality=95)
    source = ImageFolder(tmp_path / "photos")
    if packed:
        fastdata.pack(source, tmp_path / "packed", progress=False, workers=0)
        source = Shards(tmp_path / "packed")
    recipe = Augmentation(crop="center", size=32, resize=32, hflip=0.0)
    kw = {"batch_size": 3, "train": False, "device": "cpu", "augment": recipe}
    ref = torch_cat(make_loader(source, "torch", num_workers=0, **kw))
    loader = make_loader(source, "dali", decode="dali", **{**kw, "device": device})
    try:
        for _ in range(2):
            got = torch_cat(loader).cpu()
            assert got.shape == ref.shape and float((got - ref).abs().mean()) * 255 < 3
    finally:
        loader.close()


def test_a_shard_members_png_is_made_once_not_every_epoch(tmp_path, monkeypatch):
    """A shard member in a format DALI reads otherwise (here a GIF and a TIFF) is given as a PNG of
    Pillow's reading. It was encoded again every epoch (a PNG encode a sample, on a shard of WebP
    photos); it is now written once beside plain files' copies and read back, the same bytes. (A
    WebP here where Pillow reads them.)"""
    pytest.importorskip("nvidia.dali.plugin.pytorch")
    from PIL import features

    import fastdata
    import fastdata.decode.dali_files as dali_files
    from fastdata import Augmentation, make_loader
    from fastdata.datasets import ImageFolder, Shards

    (tmp_path / "photos" / "a").mkdir(parents=True)
    scene = _scene().resize((80, 48))
    others = ["p.tif", "p.webp"] if features.check("webp") else ["p.tif", "q.tif"]
    for name in [*others, "p.jpg"]:
        scene.save(tmp_path / "photos" / "a" / name)
    fastdata.pack(ImageFolder(tmp_path / "photos"), tmp_path / "packed", progress=False, workers=0)
    made = []
    original = dali_files.dali_input

    def counted(path, *args):
        out = original(path, *args)
        made.extend([path] if out is not None else [])
        return out

    monkeypatch.setattr(dali_files, "dali_input", counted)
    loader = make_loader(Shards(tmp_path / "packed"), "dali", decode="dali", batch_size=3, train=False,
                         device="cpu", augment=Augmentation(crop="center", size=32, resize=32, hflip=0.0))
    try:
        epochs = [torch_cat(loader) for _ in range(3)]
    finally:
        loader.close()
    assert len(made) == len(set(made)) == len(others), made   # each, once
    assert all(torch.equal(e, epochs[0]) for e in epochs[1:])


def torch_cat(loader):
    return torch.cat([x for x, _ in loader])


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_cut_file_goes_as_pillows_reading_only_where_the_program_lets_pillow_decode_it(fmt, monkeypatch):
    """ImageFile.LOAD_TRUNCATED_IMAGES=True (a common recipe): Pillow decodes a file cut short, grey below
    the cut, and every other backend keeps it; DALI refuses it, so it gets Pillow's reading as a PNG.
    Without the setting the file goes as it is (every backend refuses it, DALI by its own check)."""
    from PIL import ImageFile

    whole = _saved(_scene().resize((80, 64)), fmt)
    cut = whole[: len(whole) * 2 // 3]
    assert dali_input("p", cut, 1) is None and dali_input("p", whole, 1) is None
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    assert dali_input("p", whole, 1) is None
    png = Image.open(io.BytesIO(dali_input("p", cut, 1)))
    assert png.format == "PNG" and png.size == (80, 64)
    assert np.array_equal(np.asarray(png), np.asarray(Image.open(io.BytesIO(cut)).convert("RGB")))


def test_copies_past_a_gigabyte_warn_once_that_the_dataset_is_better_converted(tmp_path, monkeypatch):
    """A whole dataset in a format DALI reads otherwise (TIFFs, say) would fill TMPDIR with a second copy
    of itself, silently: past COPIES_WARN_BYTES (here lowered to a byte) the loader warns once, naming
    the folder of copies and the conversion."""
    pytest.importorskip("nvidia.dali.plugin.pytorch")
    import warnings

    import fastdata.decode.dali_files as dali_files
    from fastdata import Augmentation, make_loader
    from fastdata.datasets import ImageFolder

    (tmp_path / "a").mkdir()
    for k in range(3):
        _scene().save(tmp_path / "a" / f"p{k}.tif")
    monkeypatch.setattr(dali_files, "COPIES_WARN_BYTES", 1)
    loader = make_loader(ImageFolder(tmp_path), "dali", decode="dali", batch_size=3, train=False, device="cpu",
                         augment=Augmentation(crop="center", size=16, resize=16, hflip=0.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert sum(len(x) for x, _ in loader) == 3
    said = [str(w.message) for w in caught if "copies" in str(w.message)]
    loader.close()
    assert len(said) == 1 and "python -m fastdata pack" in said[0] and "fastdata-dali-" in said[0]
