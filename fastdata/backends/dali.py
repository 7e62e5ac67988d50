"""``dali`` backend: NVIDIA DALI decodes, crops, resizes and normalizes in its C++ thread pool (CPU) or
with nvJPEG and CUDA kernels (``device="mixed"``/``"gpu"``).

Design: every batch enters through ``fn.external_source``, not through DALI's own ``fn.readers.file``.
The reader would shuffle with DALI's RNG, shard with its own padding rules and hide its position
inside the pipeline; the contract asks for the *same* order as every other backend (``EpochPlan``
from ``(seed, epoch)``), a resume that yields exactly the remaining batches, ``set_epoch``, and equal
batch counts on every rank. Feeding the plan's batches ourselves gives all of that exactly, and costs
little: the callback reads each file's bytes with ``np.fromfile`` and its header with PIL (measured
0.08-0.17 ms per image on 2 busy cores, next to ~1.5 ms of decoding per image and core that DALI's
threads do meanwhile: the callback runs while the pipeline works on the batches already queued). DALI's parallel (multi-process) external
source would only move that small cost to other processes, and it pickles the callback, which cannot
follow an epoch/resume position set in this process.

Random augmentation parameters are drawn here, in Python, from ``plan.batch_seed(epoch, batch)`` with
the shared helpers (``sample_box``, ``translate_offsets``) in the same order as the torch backend, and
fed to DALI as per-sample inputs (slice anchor, resize ROI, mirror flag). So a batch's augmentation
depends only on the seed, never on DALI's RNG, its threads or where a run was resumed; for array
sources the output equals the torch backend's bit for bit before normalization.

Files: ``fn.decoders.image_slice`` decodes only a window around the crop box (libjpeg-turbo / nvJPEG ROI
decoding: a small RandomResizedCrop box skips most of the IDCT), ``fn.resize`` maps the exact
(fractional) box to ``size`` x ``size`` with an antialiased linear filter (PIL's BILINEAR with ``box`` in
the torch backend), and ``fn.crop_mirror_normalize`` flips, normalizes, converts the layout and the
dtype in one pass. Arrays: the batch goes in as one dense array; translation is ``fn.slice`` with a
per-sample anchor and zero fill outside the image (pad + crop in one op).

Errors: a file whose header PIL cannot read (empty, not an image, wrong extension, decompression bomb)
is found in the callback and raises ``DecodeError`` naming it (``on_error="skip"``: skipped and counted
in ``self.skipped``). A file that fails inside DALI (e.g. a truncated JPEG) fails the whole DALI
iteration and invalidates the pipeline; the loader then decodes that batch's files one by one in a
small probe pipeline to find the culprit and raises ``DecodeError`` with the path and DALI's message
(``"skip"``: it remembers the file, rebuilds the pipeline and feeds the batch again without it). After
any error or an epoch left unfinished, the next ``iter()`` builds a fresh pipeline, never a broken one.
"""
from __future__ import annotations

import collections
import math
import os
import re
import weakref

import numpy as np
import torch

from ..errors import DecodeError
from ..transforms import exif_orientation, open_image, sample_box, translate_offsets
from .base import Loader

# Pipelines inherited by forked children, kept alive there on purpose (see DaliLoader.__del__).
_INHERITED: list = []


def _pil_opinion(path) -> str:
    """What PIL says about a file DALI failed on: DALI's own reason is often just 'Failed to decode
    sample #0' (its decoder logs the detail to stderr), PIL's names it ('image file is truncated')."""
    try:
        with open_image(path) as img:
            img.load()
    except Exception as e:
        return f"; PIL: {e}"
    return "; PIL decodes it"


class _Feeder:
    """The external_source callback: turns the plan's batches into DALI inputs, one batch per call.

    ``records`` holds one entry per batch handed to DALI (or found empty), in order, so the consumer
    side knows which batch each DALI output is and which files it held.
    """

    def __init__(self, loader: "DaliLoader"):
        # A weak reference: the pipeline holds this callback, and a strong one back to the loader would
        # put every DaliLoader in a reference cycle that only the cyclic GC frees — possibly inside a
        # forked DataLoader worker, where destroying a DALI pipeline deadlocks.
        self.loader = weakref.proxy(loader)
        self.jobs = iter(())
        self.records = collections.deque()
        self.epoch = 0

    def start(self, epoch: int, jobs):
        """``jobs``: iterable of (batch number in the epoch, sample ids)."""
        self.epoch = epoch
        self.jobs = iter(jobs)
        self.records.clear()

    def __call__(self):
        while True:
            k, ids = next(self.jobs)  # StopIteration ends DALI's epoch
            inputs, record = self.loader._prepare(self.epoch, k, ids)
            self.records.append(record)
            if inputs is not None:
                return inputs
            # An empty batch (every sample skipped, or a rank's share of a tiny last step): DALI cannot
            # run a batch of 0 samples, so it is yielded by the consumer side without DALI.


class DaliLoader(Loader):
    """NVIDIA DALI backend (CPU threads here, nvJPEG + CUDA kernels on a GPU).

    Options:
        num_threads: DALI's CPU worker threads (default: ``config.num_workers``, the usable cores).
        prefetch_queue_depth: batches DALI prepares ahead of the consumer (default 2).
    """

    name = "dali"
    kinds = ("array", "files")
    options = {"num_threads": None, "prefetch_queue_depth": 2}

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        threads = self.opts["num_threads"]
        threads = max(1, config.num_workers) if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"num_threads must be an integer >= 1, got {threads!r}")
        depth = self.opts["prefetch_queue_depth"]
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"prefetch_queue_depth must be an integer >= 1, got {depth!r}")
        self.num_threads, self.prefetch_queue_depth = threads, depth
        aug = self.augment
        if source.kind == "files" and aug.crop not in ("random_resized", "center"):
            raise ValueError(f"{source!r} holds photos of different sizes: its augmentation needs a crop "
                             f"that fixes the output size ('random_resized' or 'center'), got "
                             f"crop={aug.crop!r}")
        self.gpu = self.device.type == "cuda"
        if source.kind == "files":
            self.out_shape = (3, aug.size, aug.size)
        else:
            h, w, c = source.image_shape
            self.out_shape = (c,) + aug.output_size(h, w)
        self._bad: dict[int, str] = {}  # sample id → why DALI failed on it (on_error="skip")
        self._feeder = _Feeder(self)
        self._pipe = None
        self._iter = None
        self._clean = False  # the current pipeline finished its last epoch and can be reset for another
        self._owner_pid = os.getpid()

    # ------------------------------------------------------------------ the pipeline
    def _build(self):
        """A fresh pipeline and DALIGenericIterator; the feeder must hold the epoch's jobs already."""
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self._release()
        aug, gpu = self.augment, self.gpu
        files = self.source.kind == "files"
        half = self.config.dtype == torch.float16
        channels_last = self.config.channels_last

        @pipeline_def(batch_size=self.config.batch_size, num_threads=self.num_threads,
                      device_id=self.device.index if gpu else None,
                      prefetch_queue_depth=self.prefetch_queue_depth, seed=self.plan.seed & 0x7FFFFFFF)
        def graph():
            if files:
                enc, labels, anchor, shape, roi_start, roi_end, mirror = fn.external_source(
                    source=self._feeder, num_outputs=7, batch=True,
                    dtype=[types.UINT8, types.INT64, types.INT32, types.INT32, types.FLOAT, types.FLOAT,
                           types.INT32])
                # ROI decode: only the window around the crop box is decoded (and on "mixed", by nvJPEG).
                img = fn.decoders.image_slice(enc, anchor, shape, device="mixed" if gpu else "cpu",
                                              output_type=types.RGB, axis_names="HW",
                                              normalized_anchor=False, normalized_shape=False)
                img = fn.resize(img, size=[aug.size, aug.size], roi_start=roi_start, roi_end=roi_end,
                                roi_relative=False, interp_type=types.INTERP_LINEAR, antialias=True)
            else:
                # With crop "none" there is no window to feed: 3 inputs instead of 5.
                n_in = 3 if aug.crop == "none" else 5
                ins = fn.external_source(source=self._feeder, num_outputs=n_in, batch=True,
                                         layout=["HWC"] + [None] * (n_in - 1),
                                         dtype=[types.UINT8, types.INT64, types.FLOAT, types.FLOAT,
                                                types.INT32][:n_in - 1] + [types.INT32])
                img, labels, mirror = ins[0], ins[1], ins[-1]
                p0, p1 = (ins[2], ins[3]) if n_in == 5 else (None, None)
                img = img.gpu() if gpu else img
                if aug.crop == "translate":
                    # pad + random crop as one slice whose window may leave the image: zeros there.
                    img = fn.slice(img, p0, p1, axis_names="HW", normalized_anchor=False,
                                   normalized_shape=False, out_of_bounds_policy="pad", fill_values=0)
                elif aug.crop in ("random_resized", "center"):
                    img = fn.resize(img, size=[aug.size, aug.size], roi_start=p0, roi_end=p1,
                                    roi_relative=False, interp_type=types.INTERP_LINEAR, antialias=True)
            # One fused pass: flip, (x - 255 mean) / (255 std), HWC → CHW (or kept for channels_last),
            # and the output dtype (bf16 does not exist in DALI: float32, converted by torch below).
            img = fn.crop_mirror_normalize(
                img, mirror=mirror, mean=[255.0 * m for m in self.mean], std=[255.0 * s for s in self.std],
                dtype=types.FLOAT16 if half else types.FLOAT, output_layout="HWC" if channels_last else "CHW")
            return img, (labels.gpu() if gpu else labels)

        self._pipe = graph()
        self._pipe.build()
        # size=-1: the epoch ends when the feeder raises StopIteration; PARTIAL: a smaller last batch
        # is returned as it is (never padded or filled from the next epoch).
        self._iter = DALIGenericIterator(self._pipe, ["images", "labels"], size=-1, auto_reset=False,
                                         last_batch_policy=LastBatchPolicy.PARTIAL,
                                         prepare_first_batch=False)

    def _release(self):
        self._iter = None
        self._pipe = None  # DALI frees its threads and buffers with the pipeline object
        self._clean = False

    # ------------------------------------------------------------------ inputs for one batch
    def _prepare(self, epoch: int, k: int, ids: np.ndarray):
        """DALI inputs of batch ``k`` (or None when it is empty) and its record."""
        rng = self.batch_rng(epoch, k)
        if self.source.kind == "files":
            return self._prepare_files(rng, k, ids)
        src, aug = self.source, self.augment
        n = len(ids)
        record = {"k": k, "ids": ids, "n": n, "skipped": 0}
        if n == 0:
            return None, record
        h, w, _ = src.image_shape
        images = src.images[ids]
        # The draws below follow transforms.augment_batch / augment_array exactly (same order, same
        # helpers), so both backends see the same shifts, boxes and flips for a seed.
        if aug.crop == "translate":
            p0 = (translate_offsets(rng, n, aug.pad) - aug.pad).astype(np.float32)   # slice anchor
            p1 = np.tile(np.array([h, w], np.float32), (n, 1))                       # slice shape
            flips = rng.random(n) < aug.hflip if aug.hflip > 0 else np.zeros(n, bool)
        elif aug.crop in ("random_resized", "center"):
            boxes, flips = zip(*(sample_box(aug, rng, h, w) for _ in range(n)))
            boxes = np.asarray(boxes, np.float32)                                    # (top, left, h, w)
            p0, p1 = boxes[:, :2].copy(), boxes[:, :2] + boxes[:, 2:]
            flips = np.asarray(flips)
        else:
            flips = rng.random(n) < aug.hflip if aug.hflip > 0 else np.zeros(n, bool)
            return (images, src.labels[ids], flips.astype(np.int32)), record
        return (images, src.labels[ids], p0, p1, flips.astype(np.int32)), record

    def _prepare_files(self, rng, k, ids):
        size = self.augment.size
        enc, keep, anchor, shape, roi0, roi1, mirror = [], [], [], [], [], [], []
        skipped = 0
        for i in ids:
            path = self.source.paths[i]
            try:
                img = open_image(path)  # header only: size, format, EXIF orientation
            except DecodeError:
                if self.config.on_error == "raise":
                    raise
                skipped += 1
                continue
            try:
                orientation = exif_orientation(img)
                width, height = (img.height, img.width) if orientation in (5, 6, 7, 8) else img.size
            finally:
                img.close()
            # Drawn before the skip check below, as the torch backend draws before its decode fails.
            (top, left, bh, bw), flip = sample_box(self.augment, rng, height, width)
            if int(i) in self._bad:
                skipped += 1
                continue
            if orientation == 1:
                # Decode a window around the box: the margin covers the antialiasing filter's reach
                # (about one source pixel per output pixel of shrink), so the edge pixels match a full
                # decode; the ROI inside the window keeps the box's fractional position.
                m = math.ceil(max(bh, bw) / size) + 2
                y0, x0 = max(0, math.floor(top) - m), max(0, math.floor(left) - m)
                y1, x1 = min(height, math.ceil(top + bh) + m), min(width, math.ceil(left + bw) + m)
            else:  # a rotated image: decode all of it (the ROI then applies to the rotated pixels)
                y0, x0, y1, x1 = 0, 0, height, width
            enc.append(np.fromfile(path, dtype=np.uint8))
            keep.append(i)
            anchor.append((y0, x0))
            shape.append((y1 - y0, x1 - x0))
            roi0.append((top - y0, left - x0))
            roi1.append((top - y0 + bh, left - x0 + bw))
            mirror.append(flip)
        keep = np.asarray(keep, dtype=np.int64)
        record = {"k": k, "ids": keep, "n": len(keep), "skipped": skipped}
        if not len(keep):
            return None, record
        return (enc, self.source.labels[keep], np.asarray(anchor, np.int32), np.asarray(shape, np.int32),
                np.asarray(roi0, np.float32), np.asarray(roi1, np.float32),
                np.asarray(mirror, np.int32)), record

    # ------------------------------------------------------------------ one epoch
    def _epoch(self, epoch, batches, start):
        total = len(batches)
        pos = 0  # batches handed out
        while pos < total:
            jobs = [(start + j, batches[j]) for j in range(pos, total)]
            self._feeder.start(epoch, jobs)
            if self._clean and self._iter is not None:
                self._iter.reset()  # after a finished epoch: reuse threads and buffers
            else:
                self._build()
            self._clean = False
            try:
                for out in self._outputs(total - pos):
                    pos += 1
                    yield out
                self._clean = True
            except DecodeError:
                self._release()
                raise
            except GeneratorExit:
                self._release()  # the pipeline still holds prefetched batches of this epoch
                raise
            except Exception as e:
                self._release()
                if not self._dali_failure(e):
                    raise
                self._handle_decode_failure(e)  # raises, or marks the files bad and feeds again

    def _outputs(self, remaining: int):
        """(images, labels) for the next ``remaining`` batches, empty ones included, in order."""
        records = self._feeder.records
        ready = None
        for _ in range(remaining):
            while not records and ready is None:  # nothing fed yet: ask DALI, which calls the feeder
                try:
                    ready = next(self._iter)[0]
                except StopIteration:
                    if not records:
                        raise RuntimeError("DALI's iterator ended before the epoch's batches did "
                                           "(internal error)") from None
            rec = records[0]
            if rec["n"] == 0:
                records.popleft()
                self.skipped += rec["skipped"]
                yield self._empty()
                continue
            if ready is None:
                ready = next(self._iter)[0]
            out, ready = ready, None
            records.popleft()
            self.skipped += rec["skipped"]
            yield self._convert(out)
        # Drain DALI's end of epoch so the pipeline can be reset and reused for the next one.
        try:
            next(self._iter)
        except StopIteration:
            return
        raise RuntimeError("DALI returned more batches than the epoch holds (internal error)")

    def _convert(self, out):
        images, labels = out["images"], out["labels"]
        if self.config.channels_last:
            # NHWC memory viewed as NCHW is exactly the channels_last layout: no copy.
            images = images.permute(0, 3, 1, 2)
        if self.config.dtype == torch.bfloat16:
            images = images.to(torch.bfloat16, memory_format=torch.preserve_format)
        return images, labels.to(self.device).view(-1)

    def _empty(self):
        memory = torch.channels_last if self.config.channels_last else torch.contiguous_format
        images = torch.empty((0,) + self.out_shape, dtype=self.config.dtype, device=self.device)
        return images.contiguous(memory_format=memory), torch.empty(0, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ decode errors
    @staticmethod
    def _dali_failure(e: BaseException) -> bool:
        return isinstance(e, RuntimeError) and "pipeline" in str(e).lower()

    @staticmethod
    def _dali_reason(e: BaseException) -> str:
        """The useful line(s) of a DALI error: what follows 'encountered:' (not DALI's traceback)."""
        text = str(e)
        m = re.search(r"encountered:\s*(.*?)\s*(Current pipeline object is no longer valid|$)", text, re.S)
        reason = (m.group(1) if m else text).strip()
        reason = " ".join(line.strip() for line in reason.splitlines() if line.strip())
        return reason.rstrip(" :")[:300] or type(e).__name__

    def _handle_decode_failure(self, e: BaseException) -> None:
        candidates = [i for rec in self._feeder.records for i in rec["ids"]]
        bad = self._probe(candidates)
        if not bad:
            raise RuntimeError(f"DALI failed on a batch of {len(candidates)} file(s) "
                               f"({', '.join(repr(self.source.paths[i]) for i in candidates[:3])}"
                               f"{', ...' if len(candidates) > 3 else ''}) although each decodes alone: "
                               f"{self._dali_reason(e)}") from e
        if self.config.on_error == "raise":
            i, why = bad[0]
            path = self.source.paths[i]
            raise DecodeError(path, f"DALI cannot decode it ({why}){_pil_opinion(path)}") from None
        for i, why in bad:
            self._bad[int(i)] = why

    def _probe(self, ids) -> list[tuple[int, str]]:
        """Decode files one at a time with DALI's decoder; return (id, reason) for those that fail."""
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=1, num_threads=1, device_id=self.device.index if self.gpu else None,
                      prefetch_queue_depth=1)
        def probe():
            enc = fn.external_source(name="enc", dtype=types.UINT8)
            return fn.decoders.image(enc, device="mixed" if self.gpu else "cpu", output_type=types.RGB)

        bad, pipe = [], None
        for i in ids:
            if pipe is None:
                pipe = probe()
                pipe.build()
            try:
                pipe.run(enc=[np.fromfile(self.source.paths[i], dtype=np.uint8)])
            except Exception as e:
                bad.append((int(i), self._dali_reason(e)))
                pipe = None  # a failed pipeline is no longer valid
        return bad

    # ------------------------------------------------------------------ lifetime
    def close(self):
        self._release()

    def __del__(self):
        try:
            if os.getpid() != self._owner_pid:
                # A forked child (a DataLoader worker of another loader) inherited this object. DALI's
                # pipeline threads exist only in the parent: destroying the pipeline here waits for
                # them forever. Keep the child's copy alive instead; the child's exit frees it.
                _INHERITED.append((self._pipe, self._iter))
                return
            self._release()
        except Exception:
            pass
