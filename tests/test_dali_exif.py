"""decode.dali_exif: which JPEGs DALI is given with their EXIF block rewritten, and the rewrite itself
(no DALI needed: the loader's tests in test_real_broken_files.py decode the results in DALI)."""
from __future__ import annotations

import io
import struct
import warnings

import numpy as np
import pytest
from PIL import Image

from fastdata.decode.dali_exif import dali_bytes, exif_segment, strict_orientation, with_orientation
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
