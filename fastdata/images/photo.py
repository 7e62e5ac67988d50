"""A photo file's bytes → uint8 (H, W, 3) pixels: opened and checked with Pillow (every failure a
DecodeError naming the file), EXIF orientation, and the crop of the recipe's box decoded the cheapest
exact way (a region decode of the box's window through ``region``, or ``Image.draft``'s reduced scale).

Pixels stay uint8 HWC: float conversion and normalization happen once per batch on the device (a float
sample is 4x the bytes to collate, pin and copy). The box and the flip are the recipe's
(``augment.sample_box``), drawn from a numpy Generator passed in, so the result does not depend on which
worker decoded the photo.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..augment import clamp_box, mirrored, sample_box
from ..config import Augmentation
from ..errors import DecodeError

#: The format Pillow must find behind each image file ending (``datasets.IMAGE_EXTENSIONS``).
_FORMAT_OF_EXT = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".bmp": "BMP", ".tif": "TIFF", ".tiff": "TIFF",
                  ".webp": "WEBP", ".ppm": "PPM", ".pgm": "PPM"}
#: Pillow's names for JPEG files: a multi-picture JPEG (MPO: a phone's or camera's photo with a depth
#: map or gain map appended, as an MPF index in APP2) is a JPEG whose first picture is the photo, and
#: every JPEG decoder (libjpeg, nvImageCodec, DALI, torchvision) decodes that picture.
JPEG_FORMATS = ("JPEG", "MPO")
#: Pillow formats an optional library provides; a build without it cannot identify such files.
_FEATURE_OF_FORMAT = {"WEBP": "webp"}
_EXIF_ORIENTATION = 0x0112


#: How a user with photos that large on purpose (satellite tiles, slides, panoramas) reads them.
_RAISE_LIMIT = ("photos this large are read once PIL.Image.MAX_IMAGE_PIXELS is raised above their pixels (or "
                "set to None), before the loader is made")


#: The most scans a JPEG may hold (``check_scans``). A progressive JPEG has about 10 (libjpeg's default
#: script; optimizers such as mozjpeg's pick a few more). Each scan is a decoding pass over every block of
#: the picture, and a scan of a flat picture takes some 30 bytes: a 300 kB file of 10 000 scans at 8000²
#: kept a worker decoding for minutes, at any draft scale. libjpeg-turbo has this guard (djpeg -maxscans,
#: TurboJPEG's scan limit); Pillow sets none. Read at each call: raise it before the loader is made.
MAX_JPEG_SCANS = 500

#: A marker where a decoder looks for one: 0xFF and a code, but not a stuffed 00 or a restart marker
#: (D0-D7: both live inside a scan's entropy-coded data), nor fill (FF), TEM (01) or SOI (D8), which have
#: no length. Its literal first byte lets ``re`` find it with memchr: faster than ``bytes.count``.
_MARKER = re.compile(rb"\xff[^\x00\x01\xd0-\xd8\xff]")
#: Markers ``jpeg_scans`` walks before it gives up (a photo has some 50; a file of 4-byte empty segments,
#: millions): past it, every FF DA pair in the file is counted, an upper bound of the scans.
_MAX_MARKERS = 10_000


def jpeg_scans(data: bytes) -> int:
    """The scans a decoder reads in the JPEG ``data``: its markers walked as libjpeg reads them, from the
    start to the end of the first picture (EOI), each segment skipped by its stated length, junk between
    markers skipped to the next one. FF DA byte pairs in metadata (an ICC profile, an EXIF thumbnail's own
    scans), in the MPO's other pictures or in data appended after the picture (a motion photo's video)
    are no scans of the decode: counting every pair refused such photos."""
    pos, scans, end = 2, 0, len(data)
    for _ in range(_MAX_MARKERS):
        found = _MARKER.search(data, pos)
        if found is None or found.end() + 2 > end:
            return scans
        pos, code = found.end(), data[found.end() - 1]
        if code == 0xD9:   # EOI: the decode ends here
            return scans
        length = int.from_bytes(data[pos:pos + 2], "big")
        if length < 2:     # libjpeg stops at a bogus length; a lenient decoder might not: count them all
            break
        scans += code == 0xDA
        pos += length      # a scan's data follows its header: the next search skips it
    return data.count(b"\xff\xda")


def check_scans(path, data: bytes) -> None:
    """Refuse a JPEG of more than ``MAX_JPEG_SCANS`` scans (``jpeg_scans``), naming the file, before any
    is decoded; some 30 µs for a 100 kB photo."""
    scans = jpeg_scans(data)
    if scans > MAX_JPEG_SCANS:
        raise DecodeError(str(path), f"a JPEG of {scans} scans, past the limit of {MAX_JPEG_SCANS} "
                                     f"(fastdata.images.photo.MAX_JPEG_SCANS): each scan is a decoding pass over "
                                     f"the whole picture, so it would take minutes to decode; a photo has about 10")


def open_image(path, fp=None, *, scans_counted: bool = False) -> Image.Image:
    """Open (header only) and check an image; any failure becomes a DecodeError naming the file.

    ``fp``: the file's bytes already read (a file object), so a caller that needs them anyway (the
    dali backend feeds them to DALI) reads the file once; ``path`` still names it in errors. A JPEG's
    scans are counted (``check_scans``) in those bytes only; ``scans_counted``: the caller counted them.
    """
    path = str(path)
    try:
        with warnings.catch_warnings():
            # Pillow warns between 1x and 2x its pixel limit and raises above; both are refused here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(path if fp is None else fp)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DecodeError(path, f"decompression-bomb limit: {e} {_RAISE_LIMIT}") from None
    except FileNotFoundError:
        raise DecodeError(path, "file not found") from None
    except Exception as e:  # UnidentifiedImageError, OSError, SyntaxError from broken headers
        size = len(fp.getbuffer()) if isinstance(fp, io.BytesIO) else _size_or_none(path)
        if size == 0:
            why = "empty file (0 bytes)"
        elif isinstance(e, UnidentifiedImageError):
            why = _unidentified(path, fp)
        else:
            why = f"not a readable image ({type(e).__name__}: {e})"
        ext = _extension(path)
        feature = _FEATURE_OF_FORMAT.get(_FORMAT_OF_EXT.get(ext, ""))
        if size and feature:
            from PIL import features

            if not features.check(feature):
                why += (f"; this Pillow was built without {feature.upper()} support "
                        f"(PIL.features.check({feature!r}) is False): convert such files, or install a "
                        f"Pillow built with it")
        raise DecodeError(path, why) from None
    limit = Image.MAX_IMAGE_PIXELS
    if limit and img.width * img.height > limit:
        img.close()
        raise DecodeError(path, f"{img.width}x{img.height} pixels exceeds the decompression-bomb limit "
                                f"of {limit} pixels; {_RAISE_LIMIT}")
    ext = _extension(path)
    expected = _FORMAT_OF_EXT.get(ext)
    if expected and img.format != expected and not (expected == "JPEG" and img.format in JPEG_FORMATS):
        fmt = img.format
        img.close()
        raise DecodeError(path, f"file holds {fmt} data but is named {ext} (expected {expected})")
    if img.format in JPEG_FORMATS and isinstance(fp, io.BytesIO) and not scans_counted:
        try:
            check_scans(path, fp.getvalue())   # no copy: the BytesIO shares the bytes it was made from
        except DecodeError:
            img.close()
            raise
    return img


def _extension(path: str) -> str:
    """The file name's ending, lower case (".jpg"), the key of ``_FORMAT_OF_EXT``; "" for none."""
    return os.path.splitext(path)[1].lower()


def may_hold_jpeg(path) -> bool:
    """Whether ``open_image`` lets the file ``path`` hold JPEG data: a JPEG ending, or one that promises
    no format (a shard member's key, a name without an ending). A decoder that reads JPEG bytes without
    Pillow (the region decode, nvImageCodec's cache build) asks this first, so a JPEG named .png is
    refused by every backend, not decoded by the ones that never open it with Pillow."""
    return _FORMAT_OF_EXT.get(_extension(str(path)), "JPEG") == "JPEG"


def _unidentified(path: str, fp) -> str:
    """Why Pillow identified no format: the failure of the format whose signature the file carries (a
    JPEG whose EXIF block breaks Pillow's header reading is a JPEG, not an unknown format), else what
    the file starts with. Pillow's own text names neither (its file object, "<_io.BytesIO ...>")."""
    head = _head(path, fp)
    Image.init()
    for fmt in Image.ID:
        factory, accept = Image.OPEN[fmt]
        try:
            if accept is None or not accept(head):
                continue
        except Exception:   # a signature test reading past a short file (BMP's on 3 bytes: struct.error),
            continue        # which Image.open catches around it too
        try:
            with (open(path, "rb") if fp is None else contextlib.nullcontext(fp)) as stream, \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")   # Image.open warned already
                stream.seek(0)
                factory(stream, path).close()
        except Exception as e:   # what Image.open swallows: SyntaxError, IndexError, struct.error, ...
            return f"a {fmt} file whose header Pillow cannot read ({type(e).__name__}: {e})"
    why = f"not an image format Pillow recognizes (the file starts with {head!r})"
    if head.startswith(b"\x00\x05\x16\x07"):   # AppleDouble's magic number
        why += ("; it is a macOS AppleDouble file (a ._ file: another file's metadata, not a photo), which "
                "fastdata's ImageFolder leaves out and torchvision's lists: delete them (dot_clean)")
    elif head[4:8] == b"ftyp" and head[8:12] in _HEIF_BRANDS:
        why += (f"; it is a HEIF/AVIF photo (brand {head[8:12].decode()}: a phone's), which Pillow reads "
                f"only with a plugin such as pillow-heif: convert such files to JPEG")
    return why


#: ISO-BMFF brands of HEIF/HEIC and AVIF photos (what iPhones and recent Android phones save).
_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis")


def _head(path, fp, n: int = 16) -> bytes:
    """The first ``n`` bytes of the file (of ``fp`` when given): what an unknown format starts with."""
    try:
        if fp is not None:
            fp.seek(0)
            return fp.read(n)
        with open(path, "rb") as f:
            return f.read(n)
    except (OSError, ValueError):
        return b""


def _size_or_none(path):
    import os

    try:
        return os.path.getsize(path)
    except OSError:
        return None


#: Formats whose 32-bit ("I") images Pillow makes from 16-bit data, spanning 0..65535 (a PGM of any maxval
#: above 255 scaled to 65535, an older Pillow's 16-bit PNG).
_SIXTEEN_BIT_AS_I = ("PNG", "PPM")


def to_rgb(img: Image.Image, image_format: str | None = None) -> Image.Image:
    """Any mode → RGB: greyscale and CMYK converted, alpha dropped, 16-bit scaled (not clipped) to 8.

    ``image_format``: the file's format (``img.format``, which a turned copy no longer has). A 32-bit
    image of a 16-bit format is scaled from 0..65535 whatever its values: read from its values, a dark
    16-bit PGM (nothing above 255) was taken for 8-bit and came out up to 257 times as bright."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(img)
        # 16-bit data spans 0..65535; Pillow's own convert clips at 255, which whitens the image. An
        # "I" image of another format (a 32-bit TIFF) says nothing of its range but its values.
        sixteen = img.mode.startswith("I;16") or (image_format or img.format) in _SIXTEEN_BIT_AS_I
        top = 65535 if sixteen or arr.max() > 255 else 255
        img = Image.fromarray((arr.astype(np.float32) * (255.0 / top) + 0.5).clip(0, 255).astype(np.uint8))
    elif img.mode == "P":
        img = img.convert("RGBA")  # via RGBA: a palette with transparency converts without a warning
    return img.convert("RGB")


def exif_orientation(img: Image.Image, path) -> int:
    """The EXIF orientation tag (1..8; 1 = as stored), 1 when absent or unreadable.

    EXIF's alone: an orientation given only in XMP (``tiff:Orientation``), which Pillow's ``getexif``
    also reports, is ignored, as nvImageCodec, DALI, torchvision.io and web browsers ignore it. Every
    backend must put a photo the same way up, and the GPU decoders apply EXIF's tag only. So is a PNG's
    EXIF block kept by ImageMagick as a "Raw profile type exif" text chunk (in hex), which Pillow
    also reads and DALI's and nvImageCodec's PNG decoders do not (a PNG's own eXIf chunk counts).

    A PNG's EXIF chunk may follow its pixel data, so Pillow loads the whole image to look for it: a
    failure there is the file's (a broken data stream), raised as the DecodeError naming ``path``, not
    an unreadable EXIF block (a failed load leaves the image half-decoded, and loading it again does
    nothing, so it must not pass unseen).

    A TIFF is loaded first too: Pillow's TIFF reader reports the displayed size as soon as it opens one
    turned by a quarter, and turns the pixels by the tag itself as it loads them (then drops the tag).
    Read after the load, such a TIFF is upright (1) at the size it decodes to; read before, its sides
    were swapped twice and the crops drawn in the wrong shape.
    """
    if (img.format == "PNG" and "exif" not in img.info) or img.format == "TIFF":
        load_pixels(img, path)
    hidden = {k: img.info.pop(k) for k in _NOT_EXIF_KEYS if k in img.info}
    try:
        if hidden:
            # Pillow may have read the EXIF, XMP's (or a raw profile's) orientation merged in, while
            # opening the file (a JPEG's DPI): forget that reading. The one made now, with them out of
            # sight, is cached for any later reading of this image.
            img._exif = None
        return int(img.getexif().get(_EXIF_ORIENTATION, 1) or 1)
    except Exception:  # a broken EXIF block does not make the pixels unreadable
        return 1
    finally:
        img.info.update(hidden)


def displayed_size(height: int, width: int, orientation: int) -> tuple[int, int]:
    """(height, width) of a photo stored ``height`` x ``width`` as EXIF ``orientation`` shows it: the
    sides swap for the turns by a quarter (5 to 8)."""
    return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


#: Where Pillow keeps an image's XMP packet (JPEG, WebP, TIFF: "xmp"; PNG's iTXt: "XML:com.adobe.xmp").
_XMP_KEYS = ("xmp", "XML:com.adobe.xmp")
#: Where Pillow's ``getexif`` finds an orientation that no GPU decoder reads: XMP, and ImageMagick's PNG
#: text chunk holding an EXIF block in hex.
_NOT_EXIF_KEYS = _XMP_KEYS + ("Raw profile type exif",)


def load_pixels(img: Image.Image, path) -> None:
    """Decode an opened image's pixels; a failure is the DecodeError naming ``path``."""
    try:
        img.load()
    except Exception as e:
        raise DecodeError(path, f"{type(e).__name__}: {e}") from None


def check_pixels(img: Image.Image, path) -> None:
    """Decode all of an opened image's data with the decoder ``load_photo`` uses; a failure (truncated
    file, broken data stream) becomes the DecodeError ``load_photo`` raises for it.

    A backend that does not decode with PIL (dali) calls this once per file so that every backend
    agrees on which files are broken, whatever the crop (a region decoder never reads the rows a crop
    misses). JPEGs are decoded at 1/8 scale (``Image.draft``): libjpeg still reads and entropy-decodes
    every byte of the scan, which is where truncation and corrupt data are found, but skips most of
    the IDCT and colour conversion. ``img`` is consumed (loaded at reduced size).
    """
    if img.format in JPEG_FORMATS:
        img.draft("RGB", (max(1, img.width // 8), max(1, img.height // 8)))
    load_pixels(img, path)


def region_decode_enabled() -> bool:
    """Whether ``load_photo`` may decode only a crop's window (``fastdata.images.region``): nvImageCodec is
    there and ``FASTDATA_REGION_DECODE`` is not ``0`` (the switch the benchmarks compare both paths with;
    read per call, so DataLoader workers follow their parent's environment)."""
    if os.environ.get("FASTDATA_REGION_DECODE", "1").strip() == "0":
        return False
    from .region import region_available

    return region_available()


def _ends_whole(data: bytes) -> bool:
    """The JPEG ends with its end-of-image marker (trailing padding aside).

    A region decode never reads the rows below its window, so it would not notice a file cut short
    there, which today's full decode refuses: every backend must refuse the same files (dali checks
    each file once). A truncated file, by far the most common damage, lacks the marker, and takes the
    full decode below, which names it. Damage inside the scan below the window, with the file's end
    intact, is not seen by the region path (the README says so).
    """
    return data[-64:].rstrip(b"\x00\r\n\t ").endswith(b"\xff\xd9")


def load_photo(data: bytes, path, aug: Augmentation, rng: np.random.Generator, *,
               checked: bool = True) -> np.ndarray:
    """Decode one file's bytes (``Source.read``) and apply the recipe; returns uint8 (H, W, 3). ``path``
    names the file in errors (``Source.sample_name``), and its extension is checked against the bytes.

    The box is drawn from the header's size before any pixel is decoded (``sample_box``), then
    ``crop_photo`` gets its pixels the cheapest exact way. ``checked``: see ``crop_photo``.

    An 8-bit JPEG that region decoding will take has its header read without Pillow (``_jpeg_header``);
    every other file is opened with Pillow, which checks it and names what is wrong with it.
    """
    import io

    head = _jpeg_header(path, data)
    img = None
    try:
        if head is None:
            img = open_image(path, fp=io.BytesIO(data))
            orientation = exif_orientation(img, path)
            stored = (img.height, img.width)
        else:
            *stored, orientation = head
        height, width = displayed_size(*stored, orientation)
        box, flip = sample_box(aug, rng, height, width)
        return crop_photo(path, data, box, aug, orientation, (height, width), img=img, checked=checked,
                          flip=flip, scans_counted=head is not None)
    finally:
        if img is not None:
            img.close()


def _jpeg_header(path, data: bytes):
    """(stored height, width, orientation) of a JPEG the region decoder takes, read without Pillow
    (``region.jpeg_header``: 0.1 ms less a photo), or None: Pillow's ``open_image`` is needed (region
    decoding off, not an 8-bit RGB/grey JPEG, a name that promises another format, over the
    decompression-bomb limit: each refused there with its message)."""
    if not may_hold_jpeg(path) or not region_decode_enabled():
        return None
    from .region import jpeg_header

    head = jpeg_header(data)
    limit = Image.MAX_IMAGE_PIXELS
    if head is None or (limit and head[0] * head[1] > limit):
        return None
    check_scans(path, data)   # the region decoder reads every scan too; Pillow's open_image is skipped here
    return head


#: The turn of each EXIF orientation (none for 1), as ``ImageOps.exif_transpose`` makes it.
_TURN_OF_ORIENTATION = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                        4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                        6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}


def decode_upright(img: Image.Image, path, orientation: int) -> Image.Image:
    """Decode an opened image (at the scale a ``draft`` chose) as displayed: EXIF orientation applied,
    RGB. A decoding failure is the DecodeError naming ``path`` that every backend raises for it, and so
    is pixels that cannot be converted to RGB (CIELAB without littleCMS).

    The pixels alone are turned (``transpose``), not through ``ImageOps.exif_transpose``: that one also
    rewrites the turned copy's EXIF block, and raised on a block Pillow reads but cannot write back (a
    tag stored with another type than the standard's, as old cameras and editors write): a valid
    photo, turned by an orientation read without fault, failed with an error naming no file."""
    load_pixels(img, path)
    try:
        turn = _TURN_OF_ORIENTATION.get(orientation)
        return to_rgb(img if turn is None else img.transpose(turn), img.format)
    except MemoryError:   # the machine's condition, not the file's: never skipped as a broken file
        raise
    except Exception as e:
        raise DecodeError(path, _not_convertible(img, e)) from None


def _not_convertible(img: Image.Image, e: Exception) -> str:
    """Why ``img``'s decoded pixels did not become RGB, with the way out where there is one."""
    why = f"its {img.mode} pixels cannot be converted to RGB ({type(e).__name__}: {e})"
    if img.mode == "LAB":
        from PIL import features

        if not features.check("littlecms2"):
            why += ("; converting CIELAB needs a Pillow built with littleCMS (PIL.features.check('littlecms2') "
                    "is False): convert such files to RGB, or install a Pillow built with it")
    return why


def crop_photo(path, data: bytes, box, aug: Augmentation, orientation: int, dims, *, img=None,
               checked: bool = True, flip: bool = False, scans_counted: bool = False) -> np.ndarray:
    """The photo's ``box`` (top, left, h, w in displayed pixels; None: the whole photo) resized to
    ``aug.size``, uint8 (H, W, 3), mirrored when ``flip``. ``data``: the file's bytes; ``dims``: its
    displayed (height, width); ``img``: the header already opened from ``data`` (opened here when None).

    The mirror is PIL's ``transpose`` of the resized image, before it becomes an array: 0.09 ms for a
    224² crop, where numpy's copy of a reversed (H, W, 3) view takes 0.57 ms (an element-wise loop over
    3-byte pixels), a sixth of a region decode.

    For an upright 8-bit JPEG with nvImageCodec installed (``fastdata.images.region``), only the window the
    box needs is decoded, with the full decode's pixels (1.17-1.27x faster per 224 crop on
    ImageNet-sized photos: benchmarks/results/decode-cpu-2c.md). Otherwise, or where it is estimated
    cheaper, ``Image.draft`` lets libjpeg decode at 1/2, 1/4 or 1/8 scale when the crop will be shrunk
    anyway (the IDCT skips the detail the resize would throw away). Pillow-SIMD resizes either way.
    Which path runs depends on the file and the box only, so the pixels do not depend on the process.

    ``checked``: the file's whole scan was already decoded once (by this process, or a validation
    pass). A region decode never reads the rows below its window, so damage there would go unseen and
    this backend would accept a file the others refuse; an unchecked file is checked first
    (``check_pixels``). Callers remember the files they decoded (``fastdata.decode`` does, per
    process), so only a file's first decode pays for it. ``scans_counted``: the caller counted the
    JPEG's scans in ``data`` (``load_photo`` does when it reads the header without Pillow).
    """
    import io

    from .region import is_jpeg

    height, width = dims
    own = img is None   # opened here, only when needed: the region path reads no header with Pillow
    try:
        if box is not None and orientation == 1 and _ends_whole(data) and region_decode_enabled() \
                and (is_jpeg(data) if img is None else img.format in JPEG_FORMATS and img.mode in ("RGB", "L")):
            from .region import decode_box

            got = decode_box(data, box, aug.crop_size, name=str(path))  # None: the draft path is cheaper
            if got is not None:
                if not checked:
                    if img is None:
                        img = open_image(path, fp=io.BytesIO(data), scans_counted=scans_counted)
                    check_pixels(img, path)
                side = aug.crop_size
                return mirrored(got.image.resize((side, side), Image.Resampling.BILINEAR, box=got.box), flip)
        if img is None:
            img = open_image(path, fp=io.BytesIO(data), scans_counted=scans_counted)
        if box is not None and orientation == 1 and img.format in JPEG_FORMATS:
            top, left, bh, bw = box
            out = aug.size
            # Ask for the smallest scale that keeps the crop at least `out` pixels on each side.
            want = (max(1, math.ceil(width * out / bw)), max(1, math.ceil(height * out / bh)))
            if want[0] < width and want[1] < height:
                img.draft("RGB", want)
        img = decode_upright(img, path, orientation)
        if box is not None:
            # draft shrinks by an exact power of two (1/2, 1/4, 1/8); the reduced size is rounded up
            # to whole blocks, so img.width / width is not the scale (off by up to 3 source pixels).
            reduction = 2 ** round(math.log2(width / img.width)) if img.width < width else 1
            fx = fy = 1.0 / reduction
            top, left, bh, bw = box
            img = img.resize((aug.size, aug.size), Image.Resampling.BILINEAR,
                             box=clamp_box(left * fx, top * fy, bw * fx, bh * fy, img.width, img.height))
        return mirrored(img, flip)
    finally:
        if own and img is not None:
            img.close()
