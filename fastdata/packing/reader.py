"""How ``pack`` reads a source: per sample its image bytes (re-encoded when ``max_side`` asks), its
extension and label, and an identity of its input that tells a finished shard from a stale one."""
from __future__ import annotations

import hashlib
import io
import os
import re
import zlib

import numpy as np

from ..errors import DecodeError

#: Bumped when the bytes a plan produces change, so a re-run does not keep shards packed the old way.
PACK_VERSION = 1
JPEG_QUALITY = 90
_EXT = re.compile(r"[a-z0-9]+\Z")
#: Samples per planning task (see SampleReader.plan_inputs).
_PLAN_RUN = 1024


#: A control character (a newline, a tab, ...) as the escape that shows it: see ``one_line``.
_ESCAPES = {**{c: f"\\x{c:02x}" for c in (*range(32), 127)}, ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def one_line(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\t``, ``\\x1b``): a file name
    may hold a newline or a tab (Linux allows any byte but ``/``), and the command prints the last line
    of an error (one named file's newline cut the count and the other names off), ``pack-refused.txt``
    has one ``name<TAB>why`` line per file."""
    return text.translate(_ESCAPES)


class RefusedFile(ValueError):
    """A file of the source that ``pack`` will not copy into a shard: ``name`` (the source's name for it,
    as it is) and ``why``, a short reason; the message is the whole sentence, on one line. Pack goes on
    with the other files to name every such file in one run (``RefusedFiles``), where a folder with ten
    of them took ten."""

    def __init__(self, message: str, name: str, why: str):
        super().__init__(one_line(message))
        self.name, self.why = name, why

    def __reduce__(self):   # raised in pack's worker processes: rebuilt whole in the parent
        return type(self), (str(self), self.name, self.why)


def _image_ext(path: str) -> str:
    ext = os.path.splitext(path)[1][1:].lower()
    ext = {"jpeg": "jpg", "tif": "tiff"}.get(ext, ext)
    if not _EXT.match(ext):
        raise RefusedFile(f"'{path}' has no image extension (letters and digits after its last dot): the tar "
                          f"member's extension says what the image is", path, "no image extension")
    return ext


def check_image(name: str, data: bytes) -> None:
    """Refuse ``data`` unless its header is an image's that the loaders open (``images.photo.open_image``:
    a format Pillow identifies, matching the name's ending, within the pixel limit).

    Why before copying: pack copies a file's bytes as they are, and a downloaded folder may hold a link
    named ``x.jpg`` to a private file outside it (``~/.ssh/id_rsa``): unchecked, it went into a shard
    ready to be published. Header only, no decode, and no count of a JPEG's scans (``scans_counted``):
    that walk over the whole file costs several times the header parse on a typical photo and guards
    decoding, which pack does not do; every loader still refuses (or skips) such a photo by name."""
    from ..images.photo import open_image

    try:
        if not data:
            raise DecodeError(name, "empty file (0 bytes)")
        open_image(name, io.BytesIO(data), scans_counted=True).close()
    except Exception as e:   # DecodeError; any other failure on hostile bytes is a refusal too, named
        why = e.why if isinstance(e, DecodeError) else f"{type(e).__name__}: {e}"
        raise RefusedFile(f"pack: '{name}' is not an image the loaders read ({why}); pack copies only "
                          f"images: remove the file or fix it, then pack again", name,
                          f"not an image the loaders read: {why}") from None


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
    out = io.BytesIO()
    # Level 6, not 9: a third faster to write for a few percent in size; decoding costs the same.
    image.save(out, format="PNG", compress_level=6)
    return out.getvalue()


def shrink(data: bytes, max_side: int, name: str) -> bytes | None:
    """``data`` re-encoded as a JPEG (quality 90) whose longer side is ``max_side``, upright (EXIF
    orientation applied: the copy carries no orientation tag), or None when its longer side is already
    at most ``max_side`` (the original is kept).

    The pixels are the ones the loaders decode (``images.photo.to_rgb``, which every backend's decode
    goes through): 16-bit and 32-bit grey scaled to 8 bits as they scale them, palettes through RGBA,
    alpha dropped, CMYK converted. Pillow's own ``convert`` clips 16-bit data at 255 (a white image)
    and refuses to resample some modes; converting first and resizing the 8-bit result avoids both.
    A grey image stays a grey JPEG (the loaders' RGB of it has three equal channels).

    Upright as the loaders turn it: their reading of the orientation (``exif_orientation``: EXIF's tag
    alone, a TIFF's own tag as Pillow applies it) and their turn (``decode_upright``: the pixels alone).
    ``ImageOps.exif_transpose`` also rewrote the copy's EXIF block and raised on a tag Pillow reads but
    cannot write back (a Make stored as a RATIONAL: an error naming no file), and turned a PNG by the
    orientation in an ImageMagick text chunk, which no loader does."""
    from PIL import Image, UnidentifiedImageError

    from ..errors import DecodeError
    from ..images.photo import JPEG_FORMATS, decode_upright, exif_orientation

    what = f"'{name}'"   # how the errors name the file
    try:
        with Image.open(io.BytesIO(data)) as opened:
            img: Image.Image = opened   # replaced below by the turned, converted images
            if max(img.size) <= max_side:
                return None
            grey = img.mode in _GREY_MODES
            orientation = exif_orientation(img, what)
            if img.format in JPEG_FORMATS and img.mode in ("RGB", "L"):
                # A square bound: downscaling before the rotation gives the same pixels as after it, and
                # thumbnail() lets a JPEG decode at a reduced DCT scale (draft) instead of full size.
                img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
                img = decode_upright(img, what, orientation)
            else:
                img = decode_upright(img, what, orientation)   # what the loaders see, 8-bit RGB
                img.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
            img = img.convert("L") if grey else img
            out = io.BytesIO()
            img.save(out, format="JPEG", quality=JPEG_QUALITY)
            return out.getvalue()
    except DecodeError as e:
        why = e.why
    except UnidentifiedImageError:
        # Pillow's own text names its file object ("<_io.BytesIO object at 0x7f...>"), not the file.
        why = f"not an image format Pillow recognizes (the file starts with {data[:16]!r})"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        # DecompressionBombError is no OSError: it left pack as Pillow's own error, naming no file.
        why = str(e)
    raise RefusedFile(f"cannot re-encode {what} for --max-side {max_side}: {why}", name,
                      f"cannot be re-encoded for --max-side {max_side}: {why}")


#: Modes whose pixels are one grey value (the loaders' RGB of them has three equal channels).
_GREY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def _below_common_folder(names: list[str]) -> list[str]:
    """``names`` without the folder they all lie in (a path's or a URL's directories): a finished
    shard's identity is what it holds, so a source moved, mounted or served elsewhere keeps its shards
    (sizes and modification times still tell a changed file). The common prefix of all names is that of
    the lowest and highest, cut back to its last separator: two string comparisons per name."""
    if not names:
        return names
    prefix = os.path.commonprefix([min(names), max(names)])
    cut = max(prefix.rfind("/"), prefix.rfind(os.sep)) + 1
    return [name[cut:] for name in names] if cut else names


class SampleReader:
    """What ``pack`` needs from a source: per sample its image bytes, extension and label, a size
    estimate to plan shards with, and an identity of each sample's input to recognise a finished shard.

    It reads a source by its kind, through the interface every backend uses: encoded files
    (``SourceKind.FILES``: an image folder, ``Shards``, a source of your own such as the docs'
    ``ZipImages``) through ``read_stamped(i)`` and ``sample_name(i)``, planned with ``stamp(i)`` when the
    source knows sizes without reading; decoded pixels
    (``SourceKind.ARRAY``) through ``images``; a wrapped torch Dataset (``SourceKind.DATASET``) through
    ``fetch``. A file's extension in the tar is the one ``sample_name(i)`` ends with.

    Args:
        source: a fastdata source.
        max_side: re-encode images whose longer side exceeds it (None: keep the bytes).
        threads: threads that stat (or, without ``stamp``, read) the files while the shards are planned.
    """

    def __init__(self, source, max_side: int | None, threads: int = 8):
        from ..config import SourceKind

        self.source, self.max_side, self.threads = source, max_side, max(1, int(threads))
        self.labels = np.asarray(source.labels, dtype=np.int64)
        self.kind = getattr(source, "kind", None)
        self._fingerprint: str | None = None
        if self.kind not in (SourceKind.FILES, SourceKind.ARRAY, SourceKind.DATASET):
            raise TypeError(f"pack cannot read {type(source).__name__} (kind {self.kind!r}): pass a source of "
                            f"encoded files (read_stamped), arrays, or a torchvision/map-style dataset")

    def plan_inputs(self) -> tuple[np.ndarray, list]:
        """(estimated image bytes per sample, per-sample identity of the input). Files: their size and
        stamp from the source's ``stamp(i)`` (a ``stat``, an archive's directory, an index: nothing
        read), else from reading them once through ``read_stamped``; arrays: raw pixel bytes (the PNG
        is smaller); datasets: the first sample's PNG size."""
        from ..config import SourceKind

        n = len(self.labels)
        if self.kind == SourceKind.FILES:
            from concurrent.futures import ThreadPoolExecutor

            # Threads: a stat or a read is I/O (a disk, an archive, a remote shard) and releases the GIL.
            # A task is a run of samples, not one: a thread pool ignores map's chunksize, and a task per
            # sample cost ~15 us of pool overhead each (~20 s for ImageNet), more than a cached stat.
            runs = (range(a, min(a + _PLAN_RUN, n)) for a in range(0, n, _PLAN_RUN))
            with ThreadPoolExecutor(self.threads) as pool:
                try:
                    found = [f for run in pool.map(self._sizes_and_stamps, runs) for f in run]
                except DecodeError as e:
                    # DecodeError's own hint (on_error='skip') is the loaders'; pack has no such option.
                    raise ValueError(f"pack: cannot read '{e.path}' ({e.why}); pack copies every file of the "
                                     f"source: remove the file or fix it, then pack again") from None
            empty = [i for i, (size, _) in enumerate(found) if size == 0]
            if empty:
                # Before any shard is written: Shards refuses an index with an empty image member, so the
                # pack would be written whole and then not open at all.
                shown = ", ".join(repr(self.source.sample_name(i)) for i in empty[:3])
                shown += ", ..." if len(empty) > 3 else ""
                raise ValueError(f"pack: {len(empty)} empty file(s) (0 bytes: {shown})"
                                 f"; every loader refuses such a file, and a shard holds none: remove them, "
                                 f"then pack again")
            names = _below_common_folder([self.source.sample_name(i) for i in range(n)])
            return (np.array([f[0] for f in found], dtype=np.int64).reshape(n),
                    [f"{name}\0{size}\0{stamp}" for name, (size, stamp) in zip(names, found, strict=True)])
        if self.kind == SourceKind.ARRAY:
            per = int(np.prod(self.source.images.shape[1:]))
            return np.full(n, per, dtype=np.int64), [None] * n
        first = len(self.read(0)[1]) if n else 0
        return np.full(n, first, dtype=np.int64), [None] * n

    def _sizes_and_stamps(self, run: range) -> list[tuple[int, int]]:
        # Why the hook: reading to plan made pack read every file twice (plan, then write), and made a
        # re-run after an interruption read the whole source again just to find its finished shards.
        stamp = getattr(self.source, "stamp", None)
        out = []
        for i in run:
            known = stamp(i) if stamp is not None else None
            if known is not None:
                out.append((int(known[0]), int(known[1])))
            else:
                data, read_stamp = self.source.read_stamped(i)
                out.append((len(data), read_stamp))
        return out

    def shard_identity(self, start: int, stop: int, ident: list) -> str:
        """A digest of what shard [start, stop) is made from: a finished shard is kept only when it matches."""
        from ..config import SourceKind

        h = hashlib.sha256(f"v{PACK_VERSION} max_side={self.max_side} {start}:{stop}\n".encode())
        h.update(self.labels[start:stop].tobytes())
        if self.kind == SourceKind.FILES:
            h.update(os.fsencode("\n".join(ident[start:stop])))   # file names: not UTF-8 ones too
        elif self.kind == SourceKind.ARRAY:
            h.update(f"{zlib.crc32(np.ascontiguousarray(self.source.images[start:stop]).data):08x}".encode())
        else:   # a Dataset's bytes are only known by reading it: its fingerprint is what there is
            h.update(self._dataset_fingerprint().encode())
        return h.hexdigest()

    def _dataset_fingerprint(self) -> str:
        # Once per pack, not once per shard: a wrapped Dataset's fingerprint digests all its targets
        # (~10 ms for ImageNet's 1.28M), which a thousand shards would pay a thousand times.
        if self._fingerprint is None:
            self._fingerprint = self.source.fingerprint()
        return self._fingerprint

    def describe(self, i: int) -> str:
        """How errors name sample ``i``: the source's own name for it (its file, its shard and member)."""
        return f"'{self.source.sample_name(i)}'"

    def read(self, i: int) -> tuple[str, bytes, int, tuple | None]:
        """(extension, image bytes, label, (H, W, C) of an array's image or None for a file) of sample ``i``."""
        from ..config import SourceKind

        label = int(self.labels[i])
        if self.kind == SourceKind.FILES:
            name = self.source.sample_name(i)
            try:
                data = self.source.read_stamped(i)[0]
            except DecodeError as e:
                # As while planning: DecodeError's own hint (on_error='skip') is the loaders'; pack has none.
                raise RefusedFile(f"pack: cannot read '{e.path}' ({e.why}); pack copies every file of the "
                                  f"source: remove the file or fix it, then pack again", name,
                                  f"cannot be read: {e.why}") from None
            check_image(name, data)
            if self.max_side is not None:
                small = shrink(data, self.max_side, name)
                if small is not None:
                    return "jpg", small, label, None
            return _image_ext(name), data, label, None
        if self.kind == SourceKind.ARRAY:
            image = np.asarray(self.source.images[i])
        else:
            (pair,), (ds_index,) = self.source.fetch([i])
            image = self.source.as_array(pair[0])
            label = self.source.as_label(pair[1], ds_index)
        if self.max_side is not None and max(image.shape[:2]) > self.max_side:
            from PIL import Image

            img = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
            img.thumbnail((self.max_side, self.max_side), Image.Resampling.LANCZOS)
            image = np.asarray(img).reshape(img.height, img.width, -1)
        image = image.reshape(*image.shape[:2], -1)
        return "png", _png(image), label, tuple(int(v) for v in image.shape)
