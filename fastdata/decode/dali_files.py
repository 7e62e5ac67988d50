"""The dali backend's file side: reading each batch's files in reader threads, learning each file's size,
EXIF orientation and integrity once, and (``decode="host"``, the CPU default) decoding and resizing the
crops there with the torch backend's decoders. ``DaliFiles`` is that part of ``DaliLoader``; see
``fastdata.backends.dali``'s docstring ("Reading", "Integrity", "CPU decoding", "Errors") for why.
Every per-file failure goes through the loader's ``OnError`` (``self.on_error``): raised, or skipped
and counted in the batch's record.
"""
from __future__ import annotations

import io
import math
import os

import numpy as np

from ..datasets import ImageFolder
from ..errors import DecodeError
from ..transforms import check_pixels, crop_photo, draw_params, exif_orientation, open_image

# What the loader knows about each file, learnt the first time the file is read (see _read_file).
UNSEEN, OK, NO_HEADER, BROKEN = 0, 1, 2, 3


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


def file_stamp(path) -> int:
    """A stamp of the file at ``path`` (its size and modification time) without reading it: what the
    names-only epochs compare to notice a photo replaced in place. OSError when it is gone."""
    st = os.stat(path)
    return (st.st_size * 1_000_003 + st.st_mtime_ns) & 0x7FFF_FFFF_FFFF_FFFF


def _pil_opinion(data: bytes, path) -> str:
    """What PIL says about a file DALI failed on: DALI's own reason is often just 'Failed to decode
    sample #0' (its decoder logs the detail to stderr), PIL's names it ('image file is truncated')."""
    try:
        with open_image(path, io.BytesIO(data)) as img:
            img.load()
    except Exception as e:
        return f"; PIL: {e}"
    return "; PIL decodes it"


class DaliFiles:
    """Files for ``DaliLoader``: its batches' inputs read, checked and (on the host) decoded."""

    def _prepare_files(self, rng, k, ids):
        """Runs in the assembler thread: reads the batch's files (in the reader threads), then draws
        the crops in the plan's order, exactly as the torch backend does for the same seed."""
        size = self.augment.size
        chunks = np.array_split(ids, min(len(ids), self.read_threads)) if len(ids) else []
        data = [d for chunk in self._readers.map(self._read_files, chunks) for d in chunk]
        enc, keep, anchor, shape, roi0, roi1, mirror = [], [], [], [], [], [], []
        crops = []  # host decoding: (id, bytes, box) of each file to decode, in order
        skipped = 0
        # Parameters for every file whose header opened, in order: the torch backend draws for a file
        # once open_image succeeds, before its decode can fail (a file without a header draws nothing).
        opened = [int(i) for i in ids if self._state[int(i)] != NO_HEADER]
        params = draw_params(self.augment, rng, len(opened), self._dims[opened, :2].reshape(-1, 2))
        j = 0
        for i, buf in zip(ids, data):
            i = int(i)
            state = self._state[i]
            if state == NO_HEADER:
                self.on_error.refuse(self.source.sample_name(i), self._why[i])
                skipped += 1
                continue
            height, width, orientation = (int(v) for v in self._dims[i])
            (top, left, bh, bw), flip = (float(v) for v in params.boxes[j]), bool(params.flips[j])
            j += 1
            if state == BROKEN or isinstance(buf, str):
                self.on_error.refuse(self.source.sample_name(i), buf if isinstance(buf, str) else self._why[i])
                skipped += 1
                continue
            if self.host_decode:
                crops.append((i, buf, (top, left, bh, bw)))
                mirror.append(flip)
                continue
            if orientation == 1 and self._decoder[0] == "image_slice":
                # Decode a window around the box: the margin covers the antialiasing filter's reach
                # (about one source pixel per output pixel of shrink), so the edge pixels match a full
                # decode; the ROI inside the window keeps the box's fractional position.
                m = math.ceil(max(bh, bw) / size) + 2
                y0, x0 = max(0, math.floor(top) - m), max(0, math.floor(left) - m)
                y1, x1 = min(height, math.ceil(top + bh) + m), min(width, math.ceil(left + bw) + m)
            else:  # a rotated image, or a GPU (whole photos): the ROI applies to all of it (rotated)
                y0, x0, y1, x1 = 0, 0, height, width
            enc.append(buf)
            keep.append(i)
            anchor.append((y0, x0))
            shape.append((y1 - y0, x1 - x0))
            roi0.append((top - y0, left - x0))
            roi1.append((top - y0 + bh, left - x0 + bw))
            mirror.append(flip)
        if self.host_decode:
            return self._host_batch(k, crops, mirror, skipped)
        keep = np.asarray(keep, dtype=np.int64)
        record = {"k": k, "ids": keep, "n": len(keep), "skipped": skipped}
        if not len(keep):
            return None, record
        windows = (np.asarray(anchor, np.int32), np.asarray(shape, np.int32)) \
            if self._decoder[0] == "image_slice" else ()
        return (enc, self.source.labels[keep], *windows, np.asarray(roi0, np.float32),
                np.asarray(roi1, np.float32), np.asarray(mirror, np.int32)), record

    #: Photos per reader-thread task when decoding on the host. Small: a batch split into one piece per
    #: thread left a core idle whenever one piece finished first (the threads were busy 76-84% of a
    #: pass here); with pieces of 4 the threads take the next piece as they come free.
    _HOST_CHUNK = 4

    def _host_batch(self, k, crops, mirror, skipped):
        """Host decoding: the batch's crops decoded and resized in the reader threads, as one dense
        uint8 (N, size, size, C) array; DALI then only flips and normalizes it."""
        size = self.augment.size
        chunks = np.array_split(np.arange(len(crops)), -(-len(crops) // self._HOST_CHUNK)) if crops else []
        done = [c for part in self._readers.map(lambda js: [self._host_crop(*crops[j]) for j in js], chunks)
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
        record = {"k": k, "ids": keep, "n": len(keep), "skipped": skipped}
        if not len(keep):
            return None, record
        return (images[:len(keep)], self.source.labels[keep], np.asarray(flips, np.int32)), record

    def _host_crop(self, i: int, buf: np.ndarray, box):
        """Runs in a reader thread: file ``i``'s crop ``box`` (top, left, h, w) resized to ``size`` x
        ``size``, uint8 (size, size, 3), not flipped; or the reason (str) it cannot be decoded.

        The torch backend's decoders, through the same function (``transforms.crop_photo``: a region
        decode of the box's window where nvImageCodec is there, else ``Image.draft``, then PIL's
        BILINEAR), so the pixels are the torch backend's. ``checked``: with ``validate`` every file's
        whole scan was decoded once by ``_read_file`` before it gets here.
        """
        height, width, orientation = (int(v) for v in self._dims[i])
        try:
            return crop_photo(self.source.sample_name(i), buf.tobytes(), box, self.augment, orientation,
                              (height, width), checked=self.opts["validate"])
        except DecodeError as e:
            return e.reason

    def _read_files(self, ids):
        return [self._read_file(int(i)) for i in ids]

    def _read_file(self, i: int):
        """Runs in a reader thread: file ``i``'s bytes (uint8 array), None for a file known to be
        unusable, or a reason (str) when it cannot be read now.

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
        path = self.source.sample_name(i)
        if self._paths is not None and state == OK:
            # Names only: DALI reads the file. A stat (no read) tells whether it changed since.
            try:
                if file_stamp(self._paths[i]) == self._stamps[i]:
                    return np.frombuffer(os.fsencode(self._paths[i]), np.uint8)
            except OSError as err:
                return f"cannot read it now ({err.strerror or err})"
            state = UNSEEN
        try:
            raw, stamp = self.source.read_stamped(i)   # the source owns the bytes (a file, a shard member)
            if self._paths is not None:
                stamp = self._stat(i, path)   # the names-only epochs' stamp (file_stamp)
            if state == OK and self._stamps[i] != stamp:
                state = UNSEEN
        except DecodeError as err:
            if state == UNSEEN:  # never read: unusable for good (file not found, ...)
                self._why[i] = err.reason
                self._state[i] = NO_HEADER
                return None
            return f"cannot read it now ({err.reason})"
        if state == UNSEEN:
            try:
                img = open_image(path, io.BytesIO(raw))
            except DecodeError as err:
                self._why[i] = err.reason
                self._state[i] = NO_HEADER
                return None
            verdict = OK
            # A broken file still has its batch's box drawn (from its size) before it is refused.
            self._dims[i] = (img.height, img.width, 1)
            try:
                orientation = exif_orientation(img, path)
                width, height = (img.height, img.width) if orientation in (5, 6, 7, 8) else img.size
                self._dims[i] = (height, width, orientation)
                if self.validate:
                    check_pixels(img, path)
            except DecodeError as err:
                self._why[i] = err.reason
                verdict = BROKEN
            finally:
                img.close()
            self._stamps[i] = stamp
            self._state[i] = verdict  # last: a thread that sees OK/BROKEN also sees the size
            if verdict == BROKEN:
                return None
        if self._paths is not None:   # learnt; from now on DALI reads it (the page cache has it now)
            return np.frombuffer(os.fsencode(self._paths[i]), np.uint8)
        # A read-only view of the bytes: external_source copies them into DALI's own buffer.
        return np.frombuffer(raw, dtype=np.uint8)

    def _stat(self, i: int, path: str) -> int:
        try:
            return file_stamp(self._paths[i])
        except OSError as e:   # gone between the read and the stat: as a failed read
            raise DecodeError(path, f"cannot read the file ({e.strerror or e})") from None

    def _pil_opinion(self, i: int) -> str:
        try:
            return _pil_opinion(self.source.read(i), self.source.sample_name(i))
        except DecodeError as e:
            return f"; cannot read it again ({e.reason})"
