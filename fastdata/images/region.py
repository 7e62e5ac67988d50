"""Region decoding of JPEGs on the CPU: decode only the window a crop box needs.

A RandomResizedCrop box covers about half of an ImageNet photo on average, and libjpeg-turbo can skip
work outside it: rows below the box are never read (the decoder stops at the box's last row), and
rows above it are entropy-decoded but not transformed (``jpeg_skip_scanlines``); columns outside it
skip the IDCT and colour conversion (``jpeg_crop_scanline``). Pillow exposes neither (its decoder can
be told to stop early by shortening ``img.tile``, but libjpeg then fails the file with the same
"broken data stream" as real corruption), so the window is decoded with nvImageCodec's CPU-only
libjpeg-turbo decoder (``nvidia.nvimgcodec``, installed with DALI), when it is there.

What is skipped is the IDCT of the columns outside the box and everything below it; entropy decoding
of the rows above it is not (JPEG's Huffman stream is sequential). At quality 90 entropy decoding is
about 60% of a full decode, so a box low in the image saves little, and ``Image.draft`` (a full decode
at 1/2, 1/4 or 1/8 scale) is cheaper for large boxes that are shrunk a lot anyway. ``decode_box``
estimates both and returns None where the draft path is cheaper (``policy="auto"``), so the caller
keeps its draft path for those.

The pixels are the full decode's: both decoders are libjpeg-turbo with the integer IDCT and fancy
upsampling, and libjpeg-turbo keeps the context rows and columns the upsampling needs at a window's
edge. The window includes a margin of the resize filter's support around the box, so resizing the
window with the returned box equals resizing the full image with the original box (Pillow's filter
reads source pixels around the box's edges).

Only for files stored upright (EXIF orientation 1): the box is in stored pixels. The caller falls back
to a full decode for other orientations, for CMYK/YCCK JPEGs (Pillow and libjpeg-turbo disagree on
inverted Adobe CMYK) and for anything that is not an 8-bit JPEG.
"""
from __future__ import annotations

import functools
import math
import os
import struct
import threading
from typing import TYPE_CHECKING, NamedTuple

from ..checks import check_choice
from ..errors import DecodeError

if TYPE_CHECKING:   # PIL is imported where a window is decoded
    from PIL import Image

INSTALL_HINT = "pip install nvidia-nvimgcodec-cu12 (it also comes with DALI: pip install -e '.[dali]')"

# Share of a full decode's time (quality-90 JPEGs, libjpeg-turbo, one core here) spent in entropy
# decoding, which every row down to the box's last one pays, against the IDCT, upsampling and colour
# conversion, which only the decoded window's pixels pay. Measured with nvImageCodec windows on
# 1,200-2,000 px photos: the top quarter of the rows took 25% of a full decode, the bottom quarter
# 70%, a 2%-wide window at the bottom 65%, a full-height column of a quarter of the width 85%. With
# 0.6, ``choose`` picked the faster path for 83% of 120 RandomResizedCrop and center boxes (large and
# ImageNet-sized photos), and their total time was within 3% of always picking the faster one.
_ENTROPY_SHARE = 0.6
# Bilinear's filter support is 1 source pixel per output pixel of shrink (PIL's BILINEAR); one more
# pixel covers the rounding of PIL's window bounds (int(center +- support + 0.5)).
_FILTER_SUPPORT = 1.0


class DecodedBox(NamedTuple):
    """A decoded window of a photo and where the requested box lies in it.

    ``image``: RGB ``PIL.Image`` of the window, at full resolution.
    ``box``: (left, top, right, bottom), PIL's ``resize(box=...)`` argument, in ``image``'s pixels.
    ``window``: (y0, x0, y1, x1), the rows and columns of the source that ``image`` holds.
    """

    image: Image.Image
    box: tuple[float, float, float, float]
    window: tuple[int, int, int, int]


def _import():
    from nvidia import nvimgcodec  # optional: comes with DALI

    return nvimgcodec


@functools.cache
def region_decoder_status() -> str:
    """One line: whether region decoding is available here and why not (``python -m fastdata doctor``)."""
    try:
        nv = _import()
    except ImportError as e:
        return f"unavailable: nvImageCodec is not installed ({e}); {INSTALL_HINT}"
    except Exception as e:  # a broken install (missing shared library) must not break the doctor
        return f"unavailable: nvImageCodec failed to import ({type(e).__name__}: {e})"
    try:
        _self_test()
    except Exception as e:
        return (f"unavailable: nvImageCodec {nv.__version__}'s CPU decoder failed its self-test "
                f"({type(e).__name__}: {e})")
    return (f"available: nvImageCodec {nv.__version__} CPU decoder (libjpeg-turbo), 8-bit RGB and grey "
            f"JPEGs stored upright")


def region_available() -> bool:
    """True when ``decode_box`` can region-decode here (the status above starts with "available")."""
    return region_decoder_status().startswith("available")


def _self_test() -> None:
    """Decode a window of a small JPEG made here and compare it with Pillow's full decode of it."""
    import io

    import numpy as np
    from PIL import Image

    yy, xx = np.mgrid[0:40, 0:56]
    arr = np.stack([xx * 4, yy * 6, (xx + yy) * 2], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    got = decode_window(data, 9, 13, 30, 47, name="self-test JPEG")
    if got is None:
        raise RuntimeError("the decoder returned no image")
    if got.shape != (21, 34, 3) or int(np.abs(got.astype(np.int16) - full[9:30, 13:47]).max()) > 1:
        raise RuntimeError("its window differs from Pillow's full decode")


# ------------------------------------------------------------------------------- the decoder
_local = threading.local()


def _decoder():
    """This process's and this thread's decoder.

    Created lazily, one per process (keyed by pid, so a decoder made before a DataLoader forks its
    workers is never used in a child: nvImageCodec does not document fork safety, and with more than
    one CPU thread it owns a thread pool that a fork does not copy) and per thread (thread safety is
    not documented either). Creating one costs ~0.2 ms.
    """
    pid = os.getpid()
    cached = getattr(_local, "decoder", None)
    if cached is not None and cached[0] == pid:
        return cached[1], cached[2]
    nv = _import()
    # One thread: a loader already runs one worker per core, and one image gains nothing from a pool.
    # fancy_upsampling is libjpeg's (and Pillow's) default; set explicitly because the pixels must
    # equal Pillow's full decode, whatever a later nvImageCodec's default.
    dec = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                     backends=[nv.Backend(nv.BackendKind.CPU_ONLY)],
                     options="libjpeg_turbo_decoder:fancy_upsampling=1")
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB,
                             sample_format=nv.SampleFormat.I_RGB)
    _local.decoder = (pid, dec, params)
    return dec, params


def _code_stream(data: bytes, name):
    """nvImageCodec's parsed header of ``data``; None when it is not an 8-bit RGB or grey JPEG."""
    nv = _import()
    try:
        cs = nv.CodeStream(data)
        # The header is parsed lazily, by the first property read.
        ok = cs.codec_name == "jpeg" and cs.num_channels in (1, 3) and cs.precision == 8
    except RuntimeError as e:  # "Failed to get image info": not an image nvImageCodec can parse
        raise DecodeError(name, f"not a readable image ({e})") from None
    return cs if ok else None


def decode_window(data: bytes, y0: int, x0: int, y1: int, x1: int, *, name="<bytes>", cs=None):
    """uint8 RGB (y1-y0, x1-x0, 3) of a JPEG's rows y0:y1 and columns x0:x1 (stored pixels, whole ones);
    None if it is not an 8-bit RGB or grey JPEG. Needs ``region_available()``.

    ``name`` names the file in errors; ``cs``: its ``CodeStream`` when the caller parsed it already.
    """
    import numpy as np

    nv = _import()
    dec, params = _decoder()
    cs = cs if cs is not None else _code_stream(data, name)
    if cs is None:
        return None
    if not (0 <= y0 < y1 <= cs.height and 0 <= x0 < x1 <= cs.width):
        raise ValueError(f"window rows {y0}:{y1}, columns {x0}:{x1} lies outside the {cs.width}x{cs.height} "
                         f"image {name}")
    # A window narrower than _MIN_SIDE is widened, then cut back: nvImageCodec 0.9 returns wrong pixels
    # for a 1-column window at column 0 of a 4:2:0 JPEG (up to 58 levels off; every wider window tested
    # equals the full decode), and a few more columns cost nothing measurable.
    (wy0, wy1), (wx0, wx1) = _widened(y0, y1, cs.height), _widened(x0, x1, cs.width)
    window = cs.get_sub_code_stream(region=nv.Region(wy0, wx0, wy1, wx1))
    img = dec.decode(window, params=params)
    if img is None:
        # nvImageCodec returns None for a stream that ends or breaks before the window's last row;
        # its own reason goes to stderr (libjpeg's message), not to Python.
        raise DecodeError(name, f"JPEG data is truncated or corrupt before row {y1} of {cs.height} "
                                f"(nvImageCodec could not decode rows {y0}:{y1})")
    pixels = np.asarray(img.cpu())
    if (wy0, wx0, wy1, wx1) != (y0, x0, y1, x1):
        pixels = pixels[y0 - wy0:y1 - wy0, x0 - wx0:x1 - wx0]
    return pixels


#: The fewest rows and columns ``decode_window`` asks nvImageCodec for (see there).
_MIN_SIDE = 16


def _widened(lo: int, hi: int, size: int) -> tuple[int, int]:
    """``lo:hi`` grown to at least ``_MIN_SIDE`` (or ``size``) long, within ``0:size``."""
    if hi - lo >= _MIN_SIDE or hi - lo >= size:
        return lo, hi
    lo = max(0, min(lo, size - _MIN_SIDE))
    return lo, min(size, lo + _MIN_SIDE)


#: How every JPEG file starts: the start-of-image marker, then the first segment's marker.
JPEG_START = b"\xff\xd8\xff"


def is_jpeg(data: bytes) -> bool:
    """``data`` starts like a JPEG file (what Pillow and nvImageCodec identify JPEGs by)."""
    return data[:3] == JPEG_START


#: Bytes per value of each TIFF type Pillow reads (``TiffImagePlugin``'s ``_load_dispatch``); another
#: type's entry is skipped by Pillow, and here.
TIFF_UNIT = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8}


def jpeg_segments(data: bytes):
    """``(marker, payload start, payload end)`` of each length-prefixed segment of a JPEG before its scan,
    then a final ``(None, 0, 0)`` when the walk reached the scan (or the end-of-image marker). Nothing
    more where the bytes stop being a plain sequence of segments (a byte that is not a marker, a length
    below 2 or past the end): the caller then asks Pillow. Fill bytes and standalone markers are stepped
    over. The one walk of a JPEG's headers (the EXIF orientation here, DALI's EXIF rewrite in
    ``decode.dali_input``)."""
    n, pos = len(data), 2
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:          # a fill byte before a marker
            pos += 1
            continue
        if marker == 0xDA or marker == 0xD9:   # start of scan (or end of image)
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


def jpeg_orientation(data: bytes) -> int | None:
    """The EXIF orientation (1..8) of a JPEG from its bytes, as Pillow reads it (IFD0's tag 0x0112 in
    the first APP1 "Exif" segment; 1 when there is none); None when the markers or the EXIF block are
    not what this walk expects (the caller then asks Pillow).

    Why not Pillow: opening a JPEG with it parses every marker into Python objects, 0.1 ms a photo
    here, a fifteenth of a region decode; this walks the segment headers before the scan
    (``jpeg_segments``) and reads one TIFF tag.
    """
    if not is_jpeg(data):
        return None
    for marker, a, b in jpeg_segments(data):
        if marker is None:          # the scan: no EXIF before it
            return 1
        if marker == 0xE1 and data[a:a + 6] == b"Exif\x00\x00":
            tiff = data[a + 6:b]
            try:
                end, magic, ifd, count = tiff_header(tiff)
                if magic != 42:   # Pillow reads no EXIF from a block it finds no TIFF (magic 0), and a
                    return None   # BigTIFF's (43) IFD differently: Pillow decides
                found = None
                for tag, kind, num, where, short in ifd0_entries(tiff, end, ifd, count):
                    if tag == 0x0112:
                        # not one SHORT, or a second orientation tag (Pillow keeps the last one read; the
                        # first was returned here, a photo turned by one backend only): Pillow decides
                        if kind != 3 or num != 1 or found is not None:
                            return None
                        found = short
                    size = num * TIFF_UNIT.get(kind, 0)
                    if size > 4 and where + size > len(tiff):
                        # Pillow stops reading the block at an entry whose values lie past its end, and
                        # never sees an orientation after it (a photo turned by one backend only).
                        return None
            except (KeyError, struct.error):
                return None
            if found is None:
                return 1
            return found if 1 <= found <= 8 else None
    return None


def tiff_header(tiff: bytes) -> tuple[str, int, int, int]:
    """``(byte order, magic, IFD0 offset, IFD0 entry count)`` of an EXIF block (a TIFF header: "II" or
    "MM", then 42 and IFD0's offset). ``KeyError`` for another byte order, ``struct.error`` for offsets
    past the block's end. The one reading of it: Pillow-like (``jpeg_orientation``, lenient) and strict
    (``decode.dali_input.strict_orientation``) readers differ only in what they accept."""
    end = {b"II": "<", b"MM": ">"}[bytes(tiff[:2])]
    magic, ifd = struct.unpack_from(end + "HI", tiff, 2)
    (count,) = struct.unpack_from(end + "H", tiff, ifd)
    return end, magic, ifd, count


def ifd0_entries(tiff: bytes, end: str, ifd: int, count: int):
    """IFD0's entries, one at a time: ``(tag, type, value count, value offset, the value field's first
    SHORT)`` (the orientation is one SHORT, stored in the field). Lazy, so that a lenient reader stops
    where Pillow would; ``struct.error`` at an entry past the block's end."""
    for k in range(count):
        at = ifd + 2 + 12 * k
        tag, kind, num, where = struct.unpack_from(end + "HHII", tiff, at)
        (short,) = struct.unpack_from(end + "H", tiff, at + 8)
        yield tag, kind, num, where, short


def jpeg_header(data: bytes):
    """(height, width, EXIF orientation) of an 8-bit RGB or grey JPEG, stored dimensions, read by
    nvImageCodec's header parser and ``jpeg_orientation``; None for anything else or anything unusual
    (not a JPEG, CMYK, 12-bit, an EXIF block this does not read, a header nvImageCodec cannot parse),
    for which the caller opens the file with Pillow. Needs ``region_available()``."""
    orientation = jpeg_orientation(data)   # None for anything that is not a JPEG
    if orientation is None:
        return None
    try:
        cs = _code_stream(data, "<bytes>")
    except DecodeError:
        return None
    if cs is None:
        return None
    return cs.height, cs.width, orientation


# ------------------------------------------------------------------------------- planning
def draft_scale(width: int, height: int, bh: float, bw: float, out_h: int, out_w: int) -> int:
    """The reduction ``Image.draft`` (and ``photo.load_photo``) would use: the largest of 1, 2, 4,
    8 that keeps the box at least the output size on each side."""
    want_w, want_h = max(1, math.ceil(width * out_w / bw)), max(1, math.ceil(height * out_h / bh))
    for s in (8, 4, 2):
        if width // s >= want_w and height // s >= want_h:
            return s
    return 1


def region_cost(width: int, height: int, window) -> float:
    """Estimated cost of decoding ``window`` (y0, x0, y1, x1), as a fraction of a full decode."""
    y0, x0, y1, x1 = window
    return _ENTROPY_SHARE * y1 / height + (1 - _ENTROPY_SHARE) * (y1 - y0) * (x1 - x0) / (width * height)


def draft_cost(scale: int) -> float:
    """Estimated cost of a full decode at 1/``scale`` (``Image.draft``), as a fraction of a full decode."""
    return _ENTROPY_SHARE + (1 - _ENTROPY_SHARE) / (scale * scale)


def plan_window(width: int, height: int, box, out_size=None):
    """The window (y0, x0, y1, x1) that region decoding of ``box`` (top, left, h, w) reads: the box's
    whole pixels plus the resize filter's support on each side (when ``out_size`` is given), clamped to
    the image."""
    top, left, bh, bw = (float(v) for v in box)
    if out_size is None:
        my = mx = 0
    else:
        out_h, out_w = (out_size, out_size) if isinstance(out_size, int) else out_size
        my = math.ceil(_FILTER_SUPPORT * max(bh / out_h, 1.0)) + 1
        mx = math.ceil(_FILTER_SUPPORT * max(bw / out_w, 1.0)) + 1
    y0, x0 = max(0, math.floor(top) - my), max(0, math.floor(left) - mx)
    y1, x1 = min(height, math.ceil(top + bh) + my), min(width, math.ceil(left + bw) + mx)
    return y0, x0, max(y1, y0 + 1), max(x1, x0 + 1)


def choose(width: int, height: int, box, out_size) -> str:
    """"region" or "draft": the cheaper way to get ``box`` at ``out_size``, by the estimates above."""
    top, left, bh, bw = box
    out_h, out_w = (out_size, out_size) if isinstance(out_size, int) else out_size
    scale = draft_scale(width, height, bh, bw, out_h, out_w)
    window = plan_window(width, height, box, out_size)
    return "region" if region_cost(width, height, window) < draft_cost(scale) else "draft"


# ------------------------------------------------------------------------------- the entry point
def decode_box(source, box, out_size=None, *, policy: str = "auto", name=None) -> DecodedBox | None:
    """Decode the window of a JPEG that ``box`` needs; None where the caller should decode otherwise.

    Args:
        source: the file's path, or its bytes (a caller that already read them passes them: one read).
        box: (top, left, h, w) in stored source pixels, floats allowed (the recipe's boxes).
        out_size: the size the box will be resized to (int: square, or (h, w)); sets the margin for
            the resize filter and, with ``policy="auto"``, the comparison with a reduced-scale decode.
            None: no resize follows; the window is the box's whole pixels.
        policy: "auto": None when ``Image.draft``'s reduced-scale full decode is estimated cheaper;
            "region": region-decode whenever possible.
        name: what errors call the file (default: ``source`` when it is a path).

    Returns ``DecodedBox(image, box, window)``: resize ``image`` with ``box`` to get the crop. None when
    nvImageCodec is not available, the file is not an 8-bit RGB or grey JPEG (CMYK, 12-bit,
    lossless...), or (auto) the draft path is cheaper.

    Raises ``DecodeError`` (naming the file) for data that nvImageCodec cannot parse, or that ends or
    breaks before the window's last row. Damage below the window is not seen: the decoder stops there.
    Call only for photos stored upright (EXIF orientation 1): the window is in stored pixels.
    """
    check_choice("policy", policy, ("auto", "region"))
    if not region_available():
        return None
    from PIL import Image

    if isinstance(source, (bytes, bytearray, memoryview)):
        data, name = bytes(source), name or "<bytes>"
    else:
        name = name or str(source)
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as e:
            raise DecodeError(name, f"cannot read the file ({type(e).__name__}: {e})") from None
    cs = _code_stream(data, name)
    if cs is None:
        return None
    width, height = cs.width, cs.height
    top, left, bh, bw = (float(v) for v in box)
    if not (bh > 0 and bw > 0 and top > -1e-6 and left > -1e-6 and top + bh <= height + 1e-6
            and left + bw <= width + 1e-6):
        raise ValueError(f"box (top, left, h, w) = {tuple(box)} is not inside the {width}x{height} image {name}")
    if policy == "auto" and out_size is not None and choose(width, height, (top, left, bh, bw), out_size) == "draft":
        return None
    y0, x0, y1, x1 = plan_window(width, height, (top, left, bh, bw), out_size)
    arr = decode_window(data, y0, x0, y1, x1, name=name, cs=cs)
    img = Image.fromarray(arr)
    # PIL's box inside the window; float rounding must not push an edge a hair outside it.
    inner = (max(0.0, left - x0), max(0.0, top - y0), min(float(x1 - x0), left + bw - x0),
             min(float(y1 - y0), top + bh - y0))
    return DecodedBox(img, inner, (y0, x0, y1, x1))
