"""A JPEG's EXIF block rewritten for DALI's decoder, so that DALI turns the photo as Pillow reads it.

Why: the crop boxes of every backend are drawn in the photo as Pillow shows it (``exif_orientation``:
its EXIF orientation applied), and the torch, memory and host-decoding dali paths turn the pixels by
that same reading. DALI's decoders (``fn.decoders.image``/``image_slice``, nvJPEG on a GPU,
libjpeg-turbo on the CPU) read the EXIF block themselves and turn the photo as they read it. On a
well-formed block the two readings agree. On a malformed one (an orientation stored as a LONG, an entry
count past the block's end, a byte order that is neither "II" nor "MM": all found in the wild) each
reader stops or goes on differently: DALI turned such a photo to another height and width than the
box was drawn for, and the batch failed (or, where the box still fit, the crop came from a photo
turned the other way).

The fix, where DALI decodes: the file is handed to DALI with its EXIF segments replaced by one minimal,
well-formed block holding Pillow's orientation (none at all for orientation 1). Only the block
changes: the compressed scan is the same bytes, so DALI decodes the same pixels and turns them as
Pillow does. Not turning in DALI instead (``adjust_orientation=False`` and a per-sample turn in the
graph) would add a pass over every photo of every batch on the GPU's hot path for the few photos whose
block is malformed; this costs a rewrite of those few files, once, when each is first read.
Which files: those whose EXIF block is not strictly well-formed (``strict_orientation``: one block,
a TIFF header, IFD0 and every value it points to inside the block, the orientation one SHORT in 1..8)
or holds another orientation than Pillow's reading. The lenient header walk the decoders use
(``images.region.jpeg_orientation``, which reads as Pillow does) is not enough: an IFD whose entry count
runs past the block still gives it (and Pillow) the orientation in its first entry, where DALI's reader
refuses the whole block and turns nothing.
"""
from __future__ import annotations

import struct

from ..images.region import TIFF_UNIT, is_jpeg

_SOI = b"\xff\xd8"
_EXIF = b"Exif\x00\x00"


def dali_bytes(data: bytes, orientation: int) -> bytes | None:
    """``data`` (a file's bytes) as DALI's decoder should be given them to turn the photo by
    ``orientation`` (Pillow's reading, 1..8), or None when the bytes are right as they are (not a JPEG,
    or a well-formed block with ``orientation``, see ``strict_orientation``) or cannot be rewritten
    (markers this walk does not follow: the batch's failure then names the file, ``DaliLoader._probe``)."""
    if not is_jpeg(data) or strict_orientation(data) == orientation:
        return None
    return with_orientation(data, orientation)


def _segments(data: bytes):
    """(marker, start of its payload, end) of each length-prefixed segment before the scan; a final
    ``(None, 0, 0)`` when the walk reached the scan, nothing more where the markers are not a plain
    sequence of segments."""
    n, pos = len(data), 2
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:         # a fill byte before a marker
            pos += 1
            continue
        if marker in (0xDA, 0xD9):  # start of scan, or end of image
            yield None, 0, 0
            return
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:   # standalone markers
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2 or pos + 2 + length > n:
            return
        yield marker, pos + 4, pos + 2 + length
        pos += 2 + length


def strict_orientation(data: bytes) -> int | None:
    """The EXIF orientation of a JPEG whose EXIF is beyond doubt (1 without any), else None: exactly one
    APP1 "Exif" segment before the scan, a TIFF header ("II" or "MM", 42), IFD0 with its entries and
    the next-IFD pointer inside the block, every entry's values inside it, and the orientation (if
    any) one SHORT in 1..8. Any reader, DALI's and Pillow's included, reads such a block the same way."""
    blocks, reached_scan = [], False
    for marker, a, b in _segments(data):
        if marker is None:
            reached_scan = True
        elif marker == 0xE1 and data[a:a + 6] == _EXIF:
            blocks.append(data[a + 6:b])
    if not reached_scan or len(blocks) > 1:
        return None
    if not blocks:
        return 1
    tiff = blocks[0]
    try:
        end = {b"II": "<", b"MM": ">"}[bytes(tiff[:2])]
        magic, ifd = struct.unpack_from(end + "HI", tiff, 2)
        (count,) = struct.unpack_from(end + "H", tiff, ifd)
    except (KeyError, struct.error):
        return None
    if magic != 42 or ifd < 8 or ifd + 2 + 12 * count + 4 > len(tiff):
        return None
    orientation = 1
    for k in range(count):
        tag, kind, num, where = struct.unpack_from(end + "HHII", tiff, ifd + 2 + 12 * k)
        unit = TIFF_UNIT.get(kind)
        if unit is None or (num * unit > 4 and where + num * unit > len(tiff)):
            return None
        if tag == 0x0112:
            if kind != 3 or num != 1:
                return None
            (orientation,) = struct.unpack_from(end + "H", tiff, ifd + 2 + 12 * k + 8)
            if not 1 <= orientation <= 8:
                return None
    return orientation


def exif_segment(orientation: int) -> bytes:
    """A JPEG APP1 segment holding a minimal EXIF block: IFD0 with the orientation tag alone (a SHORT,
    big-endian TIFF), the layout cameras write and every EXIF reader follows."""
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8)                     # header; IFD0 right after it
    tiff += struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0)
    tiff += struct.pack(">I", 0)                                     # no IFD1
    body = _EXIF + tiff
    return b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body


def with_orientation(data: bytes, orientation: int) -> bytes | None:
    """The JPEG ``data`` with every EXIF APP1 segment before its scan removed and, unless
    ``orientation`` is 1, one minimal block with that orientation right after the start marker. None
    when the markers before the scan are not a plain sequence of segments (``_segments``)."""
    if not is_jpeg(data) or not 1 <= orientation <= 8:
        return None
    kept = [_SOI, exif_segment(orientation) if orientation != 1 else b""]
    start = 2   # the first byte not yet copied into ``kept``
    for marker, a, b in _segments(data):
        if marker is None:   # the scan: everything from here is copied as it is
            kept.append(data[start:])
            return b"".join(kept)
        if marker == 0xE1 and data[a:a + 6] == _EXIF:
            kept.append(data[start:a - 4])   # what came before this segment; the segment is dropped
            start = b
    return None
