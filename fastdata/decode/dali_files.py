"""The dali backend's file side: reading each batch's files in reader threads, learning each file's size,
EXIF orientation and integrity once, and (``decode="host"``, the CPU default) decoding and resizing the
crops there with the torch backend's decoders. ``DaliFiles`` is that part of ``DaliLoader``; see
``fastdata.backends.dali``'s docstring ("Reading", "Integrity", "CPU decoding", "Errors") for why.
Every per-file failure goes through the loader's ``OnError`` (``self.on_error``): raised, or skipped
and counted in the batch's record.
"""
from __future__ import annotations

import io
import os
import shutil
import tempfile
import threading
import warnings
from itertools import zip_longest
from typing import TYPE_CHECKING, cast

import numpy as np

from ..augment import draw_params
from ..datasets import ImageFolder, folders
from ..errors import DecodeError
from ..images.photo import check_pixels, crop_photo, displayed_size, exif_orientation, open_image
from ..images.region import is_jpeg
from .dali_feed import batch_record
from .dali_input import dali_input

if TYPE_CHECKING:
    from multiprocessing.util import Finalize

    from ..config import Augmentation
    from ..datasets import Source
    from ..images.on_error import OnError
    from .dali_feed import WorkerPool

# What the loader knows about each file, learnt the first time the file is read (see _read_file).
UNSEEN, OK, NO_HEADER, BROKEN = 0, 1, 2, 3

#: Bytes of copies (``DaliFiles._learn_input``) past which the loader warns, once: a whole dataset in a
#: format DALI reads otherwise (TIFFs, say) would otherwise fill TMPDIR with a second copy of itself.
COPIES_WARN_BYTES = 2**30


def plain_file_paths(source) -> list | None:
    """The source's file paths when sample ``i``'s bytes are exactly file ``paths[i]``'s contents, so
    DALI may read them itself (``fn.io.file.read``); None for any other source (shards, archives, a
    subclass that transforms the bytes it reads), which keeps reading through ``Source.read_stamped``.
    Decided by the method that reads the bytes, not by the source's type: an ImageFolder subclass that
    overrides ``read_stamped`` (decrypting, say) is not plain files."""
    paths = getattr(source, "paths", None)
    if paths is None or len(paths) != len(source):
        return None
    if getattr(type(source), "read_stamped", None) is not ImageFolder.read_stamped:
        return None
    return paths


def _pil_opinion(data: bytes, path) -> str:
    """What PIL says about a file DALI failed on: DALI's own reason is often just 'Failed to decode
    sample #0' (its decoder logs the detail to stderr), PIL's names it ('image file is truncated')."""
    try:
        with open_image(path, io.BytesIO(data)) as img:
            img.load()
    except Exception as e:
        return f"; PIL: {e}"
    return "; PIL decodes it"


def _unreadable(err: OSError) -> str:
    """The reason a batch refuses a known file that a stat of its path fails on now."""
    return f"cannot read it now ({err.strerror or err})"


def dense_names(names: list[bytes]) -> np.ndarray:
    """File names as one (n, longest + 1) uint8 array, each name followed by NULs: what
    ``fn.io.file.read`` is fed. One dense array, not a list of n arrays: DALI's external source checks
    and copies each array of a list on its own (measured here: 17 µs a sample fed as a list against
    11 µs dense, for the read of a 5 KB file included). DALI opens the name as a C string, so it ends
    at the first NUL (a name that still carried the padding would fail to open, loudly, not read
    another file)."""
    width = max(len(n) for n in names) + 1
    return np.frombuffer(b"".join(n.ljust(width, b"\0") for n in names), np.uint8).reshape(len(names), width)


class DaliFiles:
    """Files for ``DaliLoader``: its batches' inputs read, checked and (on the host) decoded."""

    # What the mixin reads from DaliLoader and its bases, declared for type checkers (set in
    # DaliLoader.__init__, which says what each holds; the per-file arrays are indexed by sample id).
    source: Source
    augment: Augmentation
    opts: dict
    on_error: OnError
    read_threads: int
    validate: bool
    host_decode: bool
    _decoder: tuple[str, dict]
    _paths: list | None          # plain files that DALI reads itself (plain_file_paths), else None
    _readers: WorkerPool | None  # None for an array source (no files to read)
    _state: np.ndarray           # uint8: UNSEEN/OK/NO_HEADER/BROKEN
    _dims: np.ndarray            # int32 (n, 3): height, width, EXIF orientation
    _stamps: np.ndarray          # int64: file_stamp when the size was read
    _why: dict[int, str]
    #: Files DALI is given other bytes for (``_learn_input``): the copy's path for plain files (in
    #: ``_rewrite_dir``, removed by ``_drop_rewritten``), None for bytes fed.
    _rewritten: dict[int, str | None]
    _rewrite_dir: str | None
    _rewrite_owner: int           # the process that made _rewrite_dir, the one that removes it
    _rewrite_finalizer: Finalize  # removes _rewrite_dir at that process's exit (see _write_copy)
    _rewrite_lock: threading.Lock
    _copied_bytes: int            # bytes of the copies written (COPIES_WARN_BYTES)
    _copies_warned: bool

    def _prepare_files(self, rng, k, ids):
        """Runs in the assembler thread: reads the batch's files (in the reader threads), then draws
        the crops in the plan's order, exactly as the torch backend does for the same seed."""
        data, clean = self._batch_data(ids)
        # Parameters for every file whose header opened, in order: the torch backend draws for a file
        # once open_image succeeds, before its decode can fail (a file without a header draws nothing).
        states = self._state[ids]
        opened = ids[states != NO_HEADER]
        params = draw_params(self.augment, rng, len(opened), self._dims[opened, :2].reshape(-1, 2))
        # A clean batch (every file known and unchanged, every epoch after the first) has nothing to
        # refuse: no per-file Python at all.
        usable, skipped = (np.ones(len(ids), bool), 0) if clean else self._refuse_unusable(ids, data, states)
        kept = usable[states != NO_HEADER]   # of the drawn parameters, those of the files kept
        keep, boxes, flips = ids[usable], params.boxes[kept].astype(np.float64), params.flips[kept]
        if self.host_decode:
            crops = [(int(i), buf, tuple(box)) for i, buf, box in
                     zip(keep.tolist(), (b for b, ok in zip(data, usable) if ok), boxes.tolist())]
            return self._host_batch(k, crops, flips.tolist(), skipped)
        record = batch_record(k, keep, self.source.labels, skipped)
        if not len(keep):
            return None, record
        windowed = self._decoder[0] == "image_slice"
        anchor, shape, roi0, roi1 = self._windows(self._dims[keep], boxes, windowed)
        enc = data if clean else [buf for buf, ok in zip(data, usable) if ok]
        if self._paths is not None:
            enc = dense_names(enc)
        # Per sample, the window as int32 (anchor y, x, shape h, w) and the box as float32 (roi start y, x,
        # end y, x), split in the graph: each input is a feed through DALI's Python in schedule_run, on the
        # training thread (~90 us a feed behind a training step here). The flips stay an int32 input.
        box = np.concatenate([roi0, roi1], axis=1)
        return (enc, *((np.concatenate([anchor, shape], axis=1),) if windowed else ()), box,
                flips.astype(np.int32)), record

    def _batch_data(self, ids) -> tuple[list, bool]:
        """(``_read_file`` of each id in order, clean: whether each is the name of a file known OK and
        unchanged). Plain files already known (every epoch after a file's first, decoded in DALI) need
        only a stat and their name: done right here, as a thread hop per batch cost more than the
        stats."""
        if self._paths is not None and (self._state[ids] == OK).all():
            names, stamps = self._unchanged_names(ids)
            if names is not None:
                return names, True
            # A file changed or cannot be stat'ed (rare): file by file, each handed the stamp just taken
            # (None past a stat that failed: not taken), so no file of the batch is stat'ed twice.
            return [self._read_file(i, s) for i, s in zip_longest(ids.tolist(), stamps)], False
        chunks = np.array_split(ids, min(len(ids), self.read_threads)) if len(ids) else []
        return [d for chunk in self._pool().map(self._read_files, chunks) for d in chunk], False

    def _pool(self) -> WorkerPool:
        """The reader threads; only a files source has them, and only a files source reads files."""
        if self._readers is None:
            raise RuntimeError(f"{type(self).__name__} reads no files (an array source has no reader threads)")
        return self._readers

    def _refuse_unusable(self, ids, data: list, states: np.ndarray) -> tuple[np.ndarray, int]:
        """(usable mask, how many refused) of a batch's files: those unknown to be OK or not read now
        (a reason, str) are refused in the batch's order (raised, or skipped and counted)."""
        usable = np.fromiter((not isinstance(buf, str) for buf in data), bool, len(ids)) & (states == OK)
        for j in np.flatnonzero(~usable).tolist():
            i, buf = int(ids[j]), data[j]
            self.on_error.refuse(self.source.sample_name(i), buf if isinstance(buf, str) else self._why[i])
        return usable, int((~usable).sum())

    def _windows(self, dims: np.ndarray, boxes: np.ndarray, windowed: bool):
        """(anchor, shape) of what the decoder decodes and the box (roi start, end) inside it, for boxes
        (top, left, h, w) in photos of ``dims`` (height, width, EXIF orientation), vectorized.

        ``windowed``: a window around the box; the margin covers the antialiasing filter's reach (about
        one source pixel per output pixel of shrink), so the edge pixels match a full decode, and the
        ROI inside keeps the box's fractional position. A rotated photo, or a GPU (whole photos): the
        window is all of it (rotated)."""
        # (y, x) pairs as (n, 2) arrays, both axes in each operation: half the numpy calls of one array
        # per coordinate (each call costs about a microsecond whatever its 64 elements; the same
        # float64 arithmetic, so the same windows and pixels).
        corner, extent = boxes[:, :2], boxes[:, 2:]
        photo = dims[:, :2].astype(np.float64)
        lo, hi = np.zeros_like(corner), photo
        if windowed:
            m = np.ceil(extent.max(1, keepdims=True) / self.augment.size) + 2
            upright = (dims[:, 2] == 1)[:, None]
            lo = np.where(upright, np.maximum(0, np.floor(corner) - m), 0)
            hi = np.where(upright, np.minimum(photo, np.ceil(corner + extent) + m), photo)
        roi0 = corner - lo
        return lo.astype(np.int32), (hi - lo).astype(np.int32), roi0.astype(np.float32), \
            (roi0 + extent).astype(np.float32)

    #: Photos per reader-thread task when decoding on the host. Small: a batch split into one piece per
    #: thread left a core idle whenever one piece finished first (the threads were busy 76-84% of a
    #: pass here); with pieces of 4 the threads take the next piece as they come free.
    _HOST_CHUNK = 4

    def _host_batch(self, k, crops, mirror, skipped):
        """Host decoding: the batch's crops decoded and resized in the reader threads, as one dense
        uint8 (N, size, size, C) array; DALI then only flips and normalizes it."""
        size = self.augment.size
        chunks = np.array_split(np.arange(len(crops)), -(-len(crops) // self._HOST_CHUNK)) if crops else []
        done = [c for part in self._pool().map(lambda js: [self._host_crop(*crops[j]) for j in js], chunks)
                for c in part]
        keep, flips = [], []
        images = np.empty((len(crops), size, size, 3), np.uint8)
        for (i, _, _), flip, got in zip(crops, mirror, done):
            if isinstance(got, str):   # not decodable (validate=False, or damage PIL's check missed)
                self._why[i] = got
                self._state[i] = BROKEN   # refused from now on, as the torch backend refuses it each epoch
                self.on_error.refuse(self.source.sample_name(i), got)
                skipped += 1
                continue
            images[len(keep)] = got
            keep.append(i)
            flips.append(flip)
        keep = np.asarray(keep, dtype=np.int64)
        record = batch_record(k, keep, self.source.labels, skipped)
        if not len(keep):
            return None, record
        return (images[:len(keep)], np.asarray(flips, np.int32)), record

    def _host_crop(self, i: int, buf: np.ndarray, box):
        """Runs in a reader thread: file ``i``'s crop ``box`` (top, left, h, w) resized to ``size`` x
        ``size``, uint8 (size, size, 3), not flipped; or the reason (str) it cannot be decoded.

        The torch backend's decoders, through the same function (``images.photo.crop_photo``: a region
        decode of the box's window where nvImageCodec is there, else ``Image.draft``, then PIL's
        BILINEAR), so the pixels are the torch backend's. ``checked``: with ``validate`` every file's
        whole scan was decoded once by ``_read_file`` before it gets here.
        """
        height, width, orientation = (int(v) for v in self._dims[i])
        try:
            return crop_photo(self.source.sample_name(i), buf.tobytes(), box, self.augment, orientation,
                              (height, width), checked=self.opts["validate"])
        except DecodeError as e:
            return e.why

    def _unchanged_names(self, ids) -> tuple[list[bytes] | None, list]:
        """(the encoded names of plain files known OK, when a stat of each finds its stamp unchanged, the
        stamps). Every epoch after a file's first, but for a photo replaced: whole-batch list operations,
        one stat per file and no per-file call into ``_read_file``, whose Python cost per file was as
        large as the stat's. Names None when any file changed or cannot be stat'ed: then ``_read_file``
        learns what changed, and words what cannot be read, file by file, from the stamps taken here:
        one per file in order, up to and including the reason (str) of the first stat that failed."""
        paths = cast(list, self._paths)   # the caller's condition: plain files
        chosen = [paths[i] for i in ids.tolist()]
        stamps: list = []
        try:
            # One Python call a file. extend, not list(): the stamps before a stat that raises are kept
            # (extend appends item by item), so the files before it are not stat'ed again.
            stamps.extend(map(folders.file_stamp, map(os.stat, chosen)))
        except OSError as err:
            stamps.append(_unreadable(err))
        if stamps != self._stamps[ids].tolist():   # a reason, or a shorter list, never equals
            return None, stamps
        if self._rewritten:   # the few files DALI reads from a copy (_learn_input)
            chosen = [self._rewritten.get(i) or p for i, p in zip(ids.tolist(), chosen)]
        return list(map(os.fsencode, chosen)), stamps

    def _read_files(self, ids):
        return [self._read_file(int(i)) for i in ids]

    def _read_file(self, i: int, stat: int | str | None = None):
        """Runs in a reader thread: file ``i``'s bytes (uint8 array; plain files decoded in DALI: its
        encoded path, ``bytes``), None for a file known to be unusable, or a reason (str) when it cannot
        be read now. ``stat``: for a plain file known OK, the stamp a stat of its path just gave, or the
        reason it failed (``_unchanged_names``); None: stat it here.

        The first time, it also learns the file's size and EXIF orientation from the bytes just read
        (no second open) and, with ``validate``, decodes them once with PIL (``check_pixels``): a file
        that PIL refuses is marked broken for good, so DALI never sees it and the verdict does not
        depend on which rows a crop decodes. Later epochs only read the bytes (plain files decoded in
        DALI: only a stat, DALI reads them), unless the file changed since (its size or modification
        time, from the open file: no extra path lookup): then it is learnt again, as the torch backend,
        which reads every header every epoch, would see it (a photo
        replaced in place by one of another size got boxes drawn for the old size: a wrong crop, or a
        box outside the image).
        """
        state = self._state[i]
        if state in (NO_HEADER, BROKEN):
            return None
        if self._paths is not None and state == OK:
            # Names only: DALI reads the file. A stat (no read) tells whether it changed since.
            now = self._path_stamp(i) if stat is None else stat
            if isinstance(now, str):
                return now
            if now == self._stamps[i]:
                return os.fsencode(self._dali_path(i))
            state = UNSEEN
        path = self.source.sample_name(i)
        try:
            # The source owns the bytes (a file, a shard member). For plain files (self._paths) the stamp
            # is read_file's, from the open file: the formula file_stamp uses, so the names-only epochs
            # compare like with like, and it describes the bytes read (a path stat after the read could
            # see a replacement and record its stamp beside the old file's size).
            raw, stamp = self.source.read_stamped(i)
            if state == OK and self._stamps[i] != stamp:
                state = UNSEEN
        except DecodeError as err:
            if state == UNSEEN:  # never read: unusable for good (file not found, ...)
                self._why[i] = err.why
                self._state[i] = NO_HEADER
                return None
            return f"cannot read it now ({err.why})"
        fed = None   # the bytes DALI is given, where learning the file made them (_learn_input)
        if state == UNSEEN:
            try:
                img = open_image(path, io.BytesIO(raw))
            except DecodeError as err:
                self._why[i] = err.why
                self._state[i] = NO_HEADER
                return None
            verdict = OK
            # A broken file still has its batch's box drawn (from its size) before it is refused.
            self._dims[i] = (img.height, img.width, 1)
            try:
                orientation = exif_orientation(img, path)
                self._dims[i] = (*displayed_size(img.height, img.width, orientation), orientation)
                if self.validate:
                    check_pixels(img, path)
            except DecodeError as err:
                self._why[i] = err.why
                verdict = BROKEN
            finally:
                img.close()
            if verdict == OK and not self.host_decode:
                fed = self._learn_input(i, raw, img.format)
                if isinstance(fed, str):
                    self._why[i], verdict = fed, BROKEN
            self._stamps[i] = stamp
            self._state[i] = verdict  # last: a thread that sees OK/BROKEN also sees the size
            if verdict == BROKEN:
                return None
        if self._paths is not None:   # learnt; from now on DALI reads it (the page cache has it now)
            return os.fsencode(self._dali_path(i))
        # A read-only view of the bytes, which never change: DALI holds the array until its iteration is
        # done (no_copy, on the CPU) or copies it into its own buffer (files on a GPU).
        fed = fed if fed is not None else self._as_fed(i, raw)
        return fed if isinstance(fed, str) else np.frombuffer(fed, dtype=np.uint8)

    # ------------------------------------------------------------------ files DALI would read otherwise
    def _learn_input(self, i: int, raw: bytes, image_format: str | None) -> bytes | str:
        """Decoding in DALI: what DALI is given for file ``i`` (just learnt, its orientation in
        ``_dims``): ``raw``, or other bytes (``dali_input.dali_input``: a JPEG's malformed EXIF block
        rewritten, a PNG of a format DALI reads otherwise); the reason (str) when Pillow cannot decode
        it. A plain file's other bytes are written once, to a folder of the loader's own, and DALI is
        given that copy's name (it reads files by name). So is a shard member's PNG, which later epochs
        read back (``_as_fed``): encoding it again every epoch cost a PNG encode a sample (a shard of
        WebP photos, say), where a JPEG's rewritten EXIF block costs microseconds and is redone."""
        path = self.source.sample_name(i)
        try:
            fixed = dali_input(path, raw, int(self._dims[i, 2]), image_format)
        except DecodeError as err:
            return err.why
        if fixed is None:
            self._rewritten.pop(i, None)   # a replaced file may not need it any more
            return raw
        copy = self._paths is not None or not is_jpeg(fixed)
        self._rewritten[i] = self._write_copy(i, path, fixed) if copy else None
        return fixed

    def _write_copy(self, i: int, path: str, data: bytes) -> str:
        """Write plain file ``i``'s bytes for DALI (``data``) to the loader's folder of copies; its path.
        Past ``COPIES_WARN_BYTES`` of copies it warns, once: a whole dataset of a format DALI reads
        otherwise is read faster converted once than through copies that fill TMPDIR."""
        with self._rewrite_lock:
            if self._rewrite_dir is None:
                self._rewrite_dir = tempfile.mkdtemp(prefix="fastdata-dali-")
                self._rewrite_owner = os.getpid()
                # Also removed at a forked child's exit (the loader adopted there, see DaliLoader):
                # multiprocessing ends its children with os._exit, which skips atexit (and so
                # close()), but runs this registry first; an entry runs only in the process that made it.
                from multiprocessing.util import Finalize

                self._rewrite_finalizer = Finalize(None, shutil.rmtree, args=(self._rewrite_dir,),
                                                   kwargs={"ignore_errors": True}, exitpriority=0)
        ending = os.path.splitext(cast(list, self._paths)[i])[1] if is_jpeg(data) else ".png"
        copy = os.path.join(self._rewrite_dir, f"{i}{ending}")
        try:
            with open(copy, "wb") as f:
                f.write(data)
        except OSError as err:
            raise OSError(err.errno, f"dali backend: {path!r} is given to DALI's decoder as a copy (its format "
                                     f"or EXIF block DALI reads otherwise than Pillow), and writing it to "
                                     f"{copy!r} failed ({err.strerror or err}); set TMPDIR to a folder with "
                                     f"room, or decode='host' on the CPU") from err
        with self._rewrite_lock:   # reader threads write copies at once
            self._copied_bytes += len(data)
            warn = self._copied_bytes >= COPIES_WARN_BYTES and not self._copies_warned
            self._copies_warned |= warn
        if warn:
            warnings.warn(f"dali backend: {len(self._rewritten) + 1} files so far are given to DALI's decoder "
                          f"as copies in {self._rewrite_dir} ({self._copied_bytes / 2**30:.1f} GiB), their "
                          f"format or EXIF block being one DALI reads otherwise than Pillow (e.g. {path!r}); such "
                          f"a dataset is read faster and without the copies once converted (python -m fastdata "
                          f"pack SOURCE OUT writes JPEG shards), or with the torch or memory backend",
                          RuntimeWarning, stacklevel=2)
        return copy

    def _dali_path(self, i: int) -> str:
        """The name DALI reads plain file ``i`` by: its path, or its copy's (``_learn_input``)."""
        return self._rewritten.get(i) or cast(list, self._paths)[i]

    def _as_fed(self, i: int, raw: bytes) -> bytes | str:
        """File ``i``'s bytes as DALI is given them (``_learn_input``), or the reason (str) they cannot
        be made now."""
        if i not in self._rewritten:
            return raw
        copy = self._rewritten[i]
        if copy is not None:   # a shard member's PNG, written when it was learnt
            try:
                with open(copy, "rb") as f:
                    return f.read()
            except OSError:
                pass   # removed under the loader (a TMPDIR cleaner): made again from the bytes
        try:
            return dali_input(self.source.sample_name(i), raw, int(self._dims[i, 2])) or raw
        except DecodeError as err:
            return f"cannot decode it now ({err.why})"

    def _drop_rewritten(self) -> None:
        """Remove the rewritten copies (the loader is closed). Their files are learnt again if the
        loader is iterated after all, which writes the copies again."""
        folder = self._rewrite_dir
        for i in list(self._rewritten):
            self._state[i] = UNSEEN
        self._rewritten.clear()
        if folder is not None and self._rewrite_owner == os.getpid():   # not a forked child's parent's
            # The folder is forgotten only once removed: a Ctrl-C inside rmtree leaves it named, for the
            # next close() (or __del__) to remove, and its finalizer for the process's exit.
            shutil.rmtree(folder, ignore_errors=True)
            self._rewrite_finalizer.cancel()   # removed: the exit must not remove a later folder of that name
        self._rewrite_dir = None

    def _path_stamp(self, i: int) -> int | str:
        """Plain file ``i``'s stamp from a stat of its path, or the reason (str) it cannot be stat'ed."""
        try:
            return folders.file_stamp(os.stat(cast(list, self._paths)[i]))
        except OSError as err:
            return _unreadable(err)

    def _pil_opinion(self, i: int) -> str:
        try:
            return _pil_opinion(self.source.read(i), self.source.sample_name(i))
        except DecodeError as e:
            return f"; cannot read it again ({e.why})"
