"""What DALI's decoder is given for a file, so that it decodes the picture Pillow reads (the picture
of every other backend, and the one the crop boxes are drawn in): the file's own bytes, a JPEG with
its EXIF block rewritten, or a PNG of Pillow's reading.

Formats. DALI's decoder (nvImageCodec: nvJPEG on a GPU, libjpeg-turbo and others on the CPU) reads
JPEG (MPO too: its first picture), PNG and BMP as Pillow does, in every mode Pillow writes (checked on
DALI 2.4: the same pixels). The others it reads otherwise or not at all: a GIF fails the batch; a
TIFF's own Orientation tag is not applied, a grey+alpha, palette+alpha or float TIFF comes out a
different picture, a 1-bit or 32-bit integer TIFF is refused; a PGM/PPM's maxval is ignored (12-bit
data comes out black). Such a file is given to DALI as a PNG of Pillow's reading, turned upright
(``decode_upright``, the torch backend's decode): one decode and encode when the file is first read,
and DALI decodes a PNG (on its CPU threads, even on a GPU). A dataset of TIFFs is faster converted to
JPEG or PNG once than re-read through copies: ``python -m fastdata pack``. So is a JPEG or PNG cut
short where the program set Pillow's ``ImageFile.LOAD_TRUNCATED_IMAGES`` (a common recipe): Pillow then
decodes it, grey below the cut, and the other backends keep it; DALI would refuse it.

EXIF. The torch, memory and host-decoding dali paths turn a photo by Pillow's reading of its EXIF
orientation (``exif_orientation``). DALI's decoders read the block themselves. On a well-formed block
the two readings agree. On a malformed one (an orientation stored as a LONG, an entry count past the
block's end, a byte order that is neither "II" nor "MM": all found in the wild) each reader stops or
goes on differently: DALI turned such a photo to another height and width than the box was drawn
for, and the batch failed (or, where the box still fit, the crop came from a photo turned the other
way). Such a JPEG is given to DALI with its EXIF segments replaced by one minimal, well-formed block
holding Pillow's orientation (none at all for orientation 1). Only the block changes: the compressed
scan is the same bytes, so DALI decodes the same pixels and turns them as Pillow does. Not turning
in DALI instead (``adjust_orientation=False`` and a per-sample turn in the graph) would add a pass
over every photo of every batch on the GPU's hot path for the few photos whose block is malformed.
Which JPEGs: those whose EXIF block is not strictly well-formed (``strict_orientation``: one block,
a TIFF header, IFD0 and every value it points to inside the block, the orientation one SHORT in 1..8)
or holds another orientation than Pillow's reading. The lenient header walk the decoders use
(``images.region.jpeg_orientation``, which reads as Pillow does) is not enough: an IFD whose entry
count runs past the block still gives it (and Pillow) the orientation in its first entry, where
DALI's reader refuses the whole block and turns nothing.
"""
from __future__ import annotations

import io
import struct

from PIL import ImageFile

from ..images.photo import decode_upright, open_image
from ..images.region import TIFF_UNIT, ifd0_entries, is_jpeg, jpeg_segments, tiff_header

#: Pillow's names of the formats DALI's decoder reads as Pillow does (see the module docstring).
DALI_READS = frozenset({"JPEG", "MPO", "PNG", "BMP"})

_SOI = b"\xff\xd8"
_EXIF = b"Exif\x00\x00"


def dali_input(path, data: bytes, orientation: int, image_format: str | None = None) -> bytes | None:
    """The bytes DALI's decoder is given for the file ``path`` whose bytes are ``data`` and whose
    EXIF orientation Pillow reads as ``orientation``: None for its own bytes, else a JPEG with its EXIF
    block rewritten (``dali_bytes``) or a PNG of Pillow's reading (a format DALI reads otherwise).
    ``image_format``: Pillow's name of the format, where the caller has opened the file already.
    Raises the DecodeError naming ``path`` for a file Pillow cannot decode."""
    if image_format is None:
        with open_image(path, io.BytesIO(data)) as img:
            image_format = img.format
    if image_format in DALI_READS and (_whole(data, image_format) or not ImageFile.LOAD_TRUNCATED_IMAGES):
        return dali_bytes(data, orientation)
    # A format DALI reads otherwise, or a file cut short that Pillow decodes because the program set
    # ImageFile.LOAD_TRUNCATED_IMAGES (grey below the cut; DALI would refuse it where every other
    # backend keeps it): Pillow's reading, as a PNG.
    with open_image(path, io.BytesIO(data)) as img:
        picture = decode_upright(img, path, orientation)
    out = io.BytesIO()
    # The fastest zlib level: the copy is read by DALI, not kept (3-4x faster to write than the default).
    picture.save(out, "PNG", compress_level=1)
    return out.getvalue()


def _whole(data: bytes, image_format: str) -> bool:
    """Whether a JPEG ends with its end-of-image marker, a PNG with its IEND chunk (trailing padding
    aside; other formats: True). A file cut short lacks them."""
    tail = data[-64:].rstrip(b"\x00\r\n\t ")
    if image_format in ("JPEG", "MPO"):
        return tail.endswith(b"\xff\xd9")
    if image_format == "PNG":
        return b"IEND" in tail[-12:]
    return True


def dali_bytes(data: bytes, orientation: int) -> bytes | None:
    """``data`` (a file's bytes) as DALI's decoder should be given them to turn the photo by
    ``orientation`` (Pillow's reading, 1..8), or None when the bytes are right as they are (not a JPEG,
    or a well-formed block with ``orientation``, see ``strict_orientation``) or cannot be rewritten
    (markers ``jpeg_segments`` does not follow: the batch's failure then names the file, ``DaliLoader._probe``)."""
    if not is_jpeg(data) or strict_orientation(data) == orientation:
        return None
    return with_orientation(data, orientation)


def strict_orientation(data: bytes) -> int | None:
    """The EXIF orientation of a JPEG whose EXIF is beyond doubt (1 without any), else None: exactly one
    APP1 "Exif" segment before the scan, a TIFF header ("II" or "MM", 42), IFD0 with its entries and
    the next-IFD pointer inside the block, every entry's values inside it, and the orientation (if
    any) one SHORT in 1..8, tagged once. Any reader, DALI's and Pillow's included, reads such a block the same way."""
    blocks, reached_scan = [], False
    for marker, a, b in jpeg_segments(data):
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
        end, magic, ifd, count = tiff_header(tiff)
    except (KeyError, struct.error):
        return None
    if magic != 42 or ifd < 8 or ifd + 2 + 12 * count + 4 > len(tiff):
        return None
    orientation, seen = 1, False
    for tag, kind, num, where, short in ifd0_entries(tiff, end, ifd, count):   # all inside: checked above
        unit = TIFF_UNIT.get(kind)
        if unit is None or (num * unit > 4 and where + num * unit > len(tiff)):
            return None
        if tag == 0x0112:   # a second one is doubt: Pillow keeps the last, a reader may keep the first
            if kind != 3 or num != 1 or not 1 <= short <= 8 or seen:
                return None
            orientation, seen = short, True
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
    when the markers before the scan are not a plain sequence of segments (``jpeg_segments``)."""
    if not is_jpeg(data) or not 1 <= orientation <= 8:
        return None
    kept = [_SOI, exif_segment(orientation) if orientation != 1 else b""]
    start = 2   # the first byte not yet copied into ``kept``
    for marker, a, b in jpeg_segments(data):
        if marker is None:   # the scan: everything from here is copied as it is
            kept.append(data[start:])
            return b"".join(kept)
        if marker == 0xE1 and data[a:a + 6] == _EXIF:
            kept.append(data[start:a - 4])   # what came before this segment; the segment is dropped
            start = b
    return None
