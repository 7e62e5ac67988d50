"""``dali`` backend: NVIDIA DALI decodes, crops, resizes and normalizes in its C++ thread pool (CPU) or
with nvJPEG and CUDA kernels (``device="mixed"``/``"gpu"``).

This docstring says why the backend is built as it is. The measurements those reasons rest on
(milliseconds per image and per batch, and the machine) are in docs/backends.md, "The measurements behind
the dali backend's design", where they can be re-measured.

Design: every batch enters through ``fn.external_source``, not through DALI's own ``fn.readers.file``.
The reader would shuffle with DALI's RNG, shard with its own padding rules and hide its position
inside the pipeline; the contract asks for the *same* order as every other backend (``EpochPlan``
from ``(seed, epoch)``), a resume that yields exactly the remaining batches, ``set_epoch``, and equal
batch counts on every rank. Feeding the plan's batches ourselves gives all of that exactly.

Reading: DALI calls the input callback on the training thread, so the callback must not read files
there (under nvJPEG that read would be what caps a rank's images/s). Batches are assembled ahead,
``prefetch_queue_depth + 1`` of them, by one assembler thread that spreads each batch's files over
``read_threads`` reader threads; the callback only picks up a finished batch.
Image folders decoded inside DALI (``decode="dali"``, a GPU) are not read in Python at all after a
file's first epoch: the batch carries file names and ``fn.io.file.read`` reads them in DALI's C++
threads (``decode.dali_files``). One pipeline serves every epoch: DALI is fed one endless stream of
batches and the loader counts a pass's batches (``decode.dali_feed``); the threads are daemon threads
of our own, and every loader still open is closed before the interpreter exits.
A file's size and EXIF orientation are learnt once, from the bytes read for its first batch (no
separate header pass: construction stays instant for ImageNet's 1.28M files), and kept in numpy arrays.
Threads, not DALI's parallel (multi-process) external source: reads and PIL decoding release the GIL,
the per-file knowledge must stay in this process, and the parallel source pickles the callback into
workers that cannot follow an epoch/resume position set here.

Integrity (``validate=True``): the first time a file is read it is decoded once with PIL, the decoder
the torch and memory backends use (``images.photo.check_pixels``, at 1/8 scale: cheaper than a full
decode, and libjpeg still reads every byte of the scan). Region decoding alone cannot be trusted with
broken files: a file truncated at 90% decodes whenever the crop misses its last rows (the run then dies
at a random later epoch), and garbage that libjpeg only warns about inside DALI yields a garbled image.
With the check, every backend refuses the same files in the first epoch, whatever the crops.

Random augmentation parameters come from ``augment.draw_params`` (the one source every backend
uses), drawn in Python from ``plan.batch_seed(epoch, batch)``, and fed to DALI as per-sample inputs
(slice anchor, resize ROI, mirror flag). So a batch's augmentation
depends only on the seed, never on DALI's RNG, its threads or where a run was resumed; for array
sources the output equals the torch backend's bit for bit before normalization.

Files on a GPU (and ``decode="dali"``): nvJPEG decodes whole photos (``fn.decoders.image``: it refuses a
region decode with libjpeg-turbo's chroma upsampling, see ``files_decoder``); with ``decode="dali"`` on
the CPU, ``fn.decoders.image_slice`` decodes only a window around the crop box (nvImageCodec's
libjpeg-turbo honours the window: rows below it are never read and rows above it only
entropy-decoded). ``fn.resize`` maps the exact (fractional) box to ``size`` x
``size`` with an antialiased linear filter (PIL's BILINEAR with ``box`` in the torch backend), and
``fn.crop_mirror_normalize`` flips, normalizes, converts the layout and the dtype in one pass.

CPU decoding: on the CPU the photos are decoded and resized in the reader threads instead
(``decode="auto"`` → ``"host"``), with the torch backend's decoders: nvImageCodec's region decode
(``images.region.decode_box``, the same libjpeg-turbo that DALI's CPU decoder runs) or PIL's reduced-scale
decode, whichever is estimated cheaper, then PIL's resize; DALI gets dense uint8 crops and only flips
and normalizes them, because DALI's CPU ``fn.resize`` costs several times PIL-SIMD's resize of the same
window, more than the region decode itself. ``jpeg_fancy_upsampling`` and ``use_fast_idct`` do not
change that: DALI passes the first to nvJPEG only (libjpeg-turbo always upsamples "fancy": DALI's CPU
pixels equal PIL's), and the second saves little of the decode. The pixels are the torch backend's
wherever both decode the same rows at the same scale.

Arrays: the batch goes in as one dense array; translation is ``fn.slice`` with a
per-sample anchor whose window leaves the image by up to ``pad`` pixels, filled by the slice's
``out_of_bounds_policy`` (pad + crop in one op, no padded copy): zeros (``"pad"``), the edge pixel
(``"edge"``) or the mirror without the edge pixel (``"reflect_101"``: numpy's and torch's "reflect";
DALI's own "reflect" repeats the edge pixel). A DALI without those border modes (they came with 2.4's
slice) gets the batch padded on the host with ``np.pad`` and a slice inside it instead: the same pixels.

Errors: a file whose header PIL cannot read (empty, not an image, wrong extension, decompression bomb)
or that fails the integrity check raises ``DecodeError`` naming it when the consumer reaches its batch
(not when DALI asks for it, batches or an epoch ahead; ``on_error="skip"``: skipped and counted in
``self.skipped``, with the crop draws consumed exactly as the torch backend consumes them); the verdict
is kept, so the file is never read again. Decoding on the host, a file the reader thread's decoder
refuses (``validate=False``) is handled the same way, in its batch's order. A file that still fails
inside DALI (``validate=False``, or one PIL accepts and DALI does not) fails the whole DALI iteration:
DALI 2.4 raises a plain ``RuntimeError`` (see ``is_dali_failure``: classified by type and origin; any
other error is re-raised untouched). The loader then decodes the batch's files one by one in one
reusable probe pipeline to find the culprit and raises ``DecodeError`` with the path and DALI's message
(``"skip"``: it remembers the file, rebuilds the main pipeline and feeds the batch again without it).
When each file decodes alone, a file changed after its batch was prepared (its name read ahead): the
batch's files are learnt again and it is fed once more. After any error or an epoch left unfinished (a
closed generator), the next ``iter()`` builds a fresh pipeline and drops the batches read ahead, never
reusing a broken one.

Outputs: DALI 2.4's default executor (``exec_dynamic``) hands its buffers to torch through DLPack
without a copy; they stay valid as long as torch holds them (DALI's ``TensorGPU.__dlpack__`` docs). The
pipeline is driven by ``decode.dali_outputs.Outputs``, not ``DALIGenericIterator``: the iterator asks
for each batch with no stream, which DALI documents as "the outputs are synchronized with the host", so
the training thread waited for the GPU to finish every batch before it could queue the step using it.
The consumer's current CUDA stream waits for each batch instead (``handover="stream"``): its work is
ordered before the step's on that stream, and the host goes on at once.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import weakref
from typing import cast

import numpy as np
import torch

from ..augment import require_fixed_size
from ..config import Crop, Padding
from ..datasets import SourceKind
from ..datasets.base import ArrayPixels, tell_in_flight
from ..decode.dali_arrays import DaliArrays
from ..decode.dali_errors import dali_reason, free_frames, is_dali_failure
from ..decode.dali_feed import Feeder, WorkerPool, record_labels, stream
from ..decode.dali_files import BROKEN, OK, UNSEEN, DaliFiles, plain_file_paths
from ..decode.dali_options import (  # noqa: F401 (DECODE_CHOICES: re-exported, the option's values)
    DECODE_CHOICES,
    SLICE_POLICY,
    DaliOptions,
    decoder_tuning,
    files_decoder,
    slice_has_policy,
)
from ..decode.dali_outputs import DRIVEN_AHEAD, DrivenOutputs, Outputs, PassLabels, output_itemsize
from ..errors import DecodeError
from ..host_memory import available_ram
from ..images.on_error import OnError
from ..images.photo import displayed_size, exif_orientation, open_image
from .base import Loader, labels_on


class _StreamEnded(Exception):
    """DALI's stream ended (the feeder gave up on a run of empty batches) where an output was needed."""


# Pipelines inherited by forked children, kept alive there on purpose (see DaliLoader.close).
_INHERITED: list = []

#: Every DaliLoader not yet closed: closed by ``_close_live`` before the interpreter exits.
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Close the loaders still open at exit (most programs never close theirs): their pipelines are then
    freed while the interpreter and CUDA still work, not in module teardown or after CUDA's own atexit
    handlers (torch registered those earlier, so they run after this one), and their threads stop."""
    for loader in list(_LIVE):
        try:
            # A thread stuck in a read (a hung network file system) is given a moment, not the 10 s a
            # close() waits: a daemon thread does not hold the exit up once the pipelines are gone.
            loader._close(join_timeout=1.0)
        except Exception:   # exiting anyway: one loader's failure must not keep the others open
            pass


class DaliLoader(DaliArrays, DaliFiles, Loader):
    """NVIDIA DALI backend (CPU threads here, nvJPEG + CUDA kernels on a GPU).

    Options:
        num_threads: DALI's CPU worker threads (default: ``config.num_workers``, this process's share of
            the usable cores).
        prefetch_queue_depth: batches DALI prepares ahead of the consumer (default 4 on a GPU where
            their outputs fit in an eighth of the free memory, else 2).
        read_threads: threads that read files (and check each once) ahead of DALI (default:
            ``num_threads``). Files only.
        validate: check each file's integrity the first time it is read, with the PIL decode the
            torch and memory backends use (default True), so every backend refuses the same files
            whatever the crop. Costs one reduced-scale decode per file, once per run (measured
            1.4 ms per ImageNet-sized JPEG and core); False trusts the files and leaves broken ones
            to DALI's decoder, which fails only when a crop reaches the damage.
        decode: where photos are decoded and resized (files only). ``"dali"``: inside the pipeline
            (``decoders.image_slice`` + ``fn.resize``; nvJPEG's whole-photo ``decoders.image`` on a
            GPU). ``"host"``: in the reader
            threads, with the torch backend's decoders (nvImageCodec's region decode or PIL's reduced
            scale, then PIL's resize), DALI then flips and normalizes; CPU only. ``"auto"`` (default):
            ``"host"`` on the CPU, ``"dali"`` on a GPU. Why: on the CPU, DALI's ``fn.resize`` costs
            more than the decode itself (module docstring, "CPU decoding").
        hw_decoder_load: the share (0..1) of JPEG work given to the GPU's hardware JPEG decoder
            (``fn.decoders.image``'s argument; default 1.0, measured fastest on an H200; DALI's own is
            0.65). GPU only.
        preallocate: size nvJPEG's buffers for the largest photo known when the pipeline is built (the
            first batch's, on the first build) instead of growing them mid-epoch (default True).
        fancy_upsampling: libjpeg-turbo's chroma upsampling in nvJPEG (default True: the pixels of PIL
            and the other backends; False: nvJPEG's own, tens of levels off along colour edges).
        affine: pin DALI's threads to cores (default False: several ranks or jobs on one host would
            pin theirs to the same cores).
        handover: how a batch is handed to the consumer on a GPU: ``"stream"`` (default) has
            the consumer's current CUDA stream wait for it, not the host; ``"host"`` waits on the host until DALI
            finished it (what ``DALIGenericIterator`` does; kept to measure the difference).
        driver: where DALI's iteration runs: ``"caller"`` (default) in the consumer's ``next()``;
            ``"thread"`` in a thread of the loader's own, ``DRIVEN_AHEAD`` batches ahead, the consumer taking
            ready batches (decode.dali_outputs.DrivenOutputs; to be measured on a GPU before a default).
    """

    name = "dali"
    reads = frozenset({SourceKind.ARRAY, SourceKind.FILES})   # DALI cannot call a Python __getitem__
    options = {f.name: f.default for f in dataclasses.fields(DaliOptions)}

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        self.gpu = self.device.type == "cuda"
        aug = self.augment
        require_fixed_size(source, aug)   # (base.py has refused a reflect pad the images cannot mirror)
        files = source.kind is SourceKind.FILES
        if files:
            self.out_shape = (3, aug.size, aug.size)
        else:
            h, w, c = cast(ArrayPixels, source).image_shape
            self.out_shape = (c,) + aug.output_size(h, w)
        opts = DaliOptions(**self.opts)
        # What one prefetched batch takes in DALI's queue: DALI's own output dtype (output_itemsize), not
        # the loader's: bfloat16 batches are float32 there, converted by torch when handed out.
        batch_bytes = config.batch_size * int(np.prod(self.out_shape)) * output_itemsize(config.dtype)
        # The free memory the prefetched outputs go to: the default depth is chosen from it on a GPU, and a
        # depth the user set is refused where its outputs cannot fit (dali_options.check_depth).
        free = None
        if self.gpu:
            free = torch.cuda.mem_get_info(self.device)[0]
        elif opts.prefetch_queue_depth is not None:
            free = available_ram()
        #: The options with the derived values filled in (DaliOptions.resolve).
        self.dali_options = opts = opts.resolve(config.num_workers, self.gpu, batch_bytes, free)
        self.num_threads, self.prefetch_queue_depth = opts.num_threads, opts.prefetch_queue_depth
        self.read_threads, self.validate = opts.read_threads, opts.validate
        self.on_error = OnError(config.on_error)   # raise or skip: decided there, never here
        if opts.decode == "host" and self.gpu:
            raise ValueError(f"decode='host' is for device='cpu'; on {self.device} nvJPEG decodes inside the "
                             f"pipeline (decode='dali' or 'auto')")
        #: True: photos are decoded and resized in the reader threads and DALI only flips and normalizes.
        self.host_decode = files and opts.decode != "dali" and not self.gpu
        #: The in-pipeline decoder (files_decoder): a window around each box, or whole photos.
        self._decoder = files_decoder(self.gpu)
        # Decoding in DALI from plain files: DALI reads them (fn.io.file.read), fed their names.
        self._paths = plain_file_paths(source) if files and not self.host_decode else None
        # Reflect/edge translation where this DALI's slice lacks the border mode: pad on the host.
        self._host_pad = (aug.crop is Crop.TRANSLATE and aug.padding is not Padding.CONSTANT
                          and not slice_has_policy(SLICE_POLICY[aug.padding]))
        # Per file: what is known (UNSEEN/OK/NO_HEADER/BROKEN), (height, width, EXIF orientation)
        # as the augmentation sees them, and a stamp of the file they were read from. numpy, not dicts
        # of tuples: 21 bytes a file, 27 MB for ImageNet's 1.28M files. Reasons are kept only for the
        # few broken ones.
        n = len(source) if files else 0
        self._state = np.zeros(n, np.uint8)
        self._dims = np.zeros((n, 3), np.int32)
        self._stamps = np.zeros(n, np.int64)   # each file's (size, mtime) when its size was read
        self._why: dict[int, str] = {}
        self._rewritten: dict[int, str | None] = {}   # see DaliFiles._learn_input
        self._rngs, self._drawn = {}, {}   # generators seeded and draws made ahead (decode.dali_arrays)
        self._rewrite_dir, self._rewrite_lock, self._rewrite_owner = None, threading.Lock(), 0
        self._copied_bytes, self._copies_warned = 0, False
        # Reading: one assembler thread prepares whole batches in stream order (the augmentation draws
        # need each file's size); it spreads a batch's files over the reader threads. Threads, not
        # processes or DALI's parallel external source: file reads and PIL's decode release the GIL,
        # the per-file verdicts must be shared with this loader, and DALI's parallel source would
        # pickle the callback into worker processes, which cannot follow the epoch/resume position
        # set here. Daemon threads, started on first use (decode.dali_feed says why).
        #: The pool that assembles whole batches ahead (files only; arrays are gathered in DALI's call).
        self.assembler = self._readers = None
        if files:
            self.assembler = WorkerPool(1, "fastdata-dali-batch")
            self._readers = WorkerPool(opts.read_threads, "fastdata-dali-read")
        self._feeder = Feeder(self, ahead=opts.prefetch_queue_depth + 1, give_up=len(self.plan) + 1)
        # The feeder assembles depth + 1 batches ahead of DALI's queue of depth decoded ones (read already)
        # and one more is being handed over: a streaming source keeps the shards of 2 x depth + 2 batches.
        # A driver thread (driver="thread") holds DRIVEN_AHEAD decoded batches more in its queue and one
        # waiting for room; none of them surely read (a fast consumer leaves the queue empty).
        depth = opts.prefetch_queue_depth
        ahead = DRIVEN_AHEAD + 1 if opts.driver == "thread" else 0
        tell_in_flight(source, self.plan, 2 * depth + 2 + ahead, read=depth)
        self._probe_pipe = self._pipe = self._iter = None
        self._ready = None    # a DALI output fetched for a record not yet handed out
        self._expect = None   # the epoch the running stream goes on with, after a pass ran to its end
        self._owner_pid = os.getpid()
        self._closed = False
        _LIVE.add(self)

    @classmethod
    def fits(cls, source, config, options=None, *, stable=False):
        """The kinds it reads; on a GPU the reason says what it does there (``auto``'s line said only
        "dali reads files sources", not why it was preferred to the torch path)."""
        ok, why = super().fits(source, config, options, stable=stable)
        if ok and config.device.type == "cuda":
            why = ("nvJPEG decodes the photos and DALI crops and normalizes them on the GPU"
                   if source.kind is SourceKind.FILES else "DALI crops and normalizes the batches on the GPU")
        return ok, why

    # ------------------------------------------------------------------ the pipeline
    def _build(self):
        """A fresh pipeline and its outputs (decode.dali_outputs); the feeder must hold its stream already.

        Over 60 lines on purpose: the pipeline graph is one DALI function and reads top to bottom as
        the data flows (inputs, decode, crop, normalize); split, its branches would be harder to follow.
        """
        from nvidia.dali import fn, pipeline_def, types

        aug, gpu, opts = self.augment, self.gpu, self.dali_options
        files = self.source.kind is SourceKind.FILES
        half = self.config.dtype == torch.float16
        channels_last = self.config.channels_last
        known = self._dims[self._state == OK] if files else None   # (height, width, EXIF orientation)

        # no_copy: DALI holds the callback's arrays (all new each batch) until the iteration is done instead
        # of copying them on the training thread in schedule_run (420 -> 243 us a batch of 256 digits here;
        # NVIDIA/DALI#2586). Not for files on a GPU, not measured there: megabytes of bytes or crops would
        # reach the GPU from pageable memory, not DALI's pinned buffers.
        feed = dict(source=self._feeder, batch=True, no_copy=not (gpu and files))

        @pipeline_def(batch_size=self.config.batch_size, num_threads=self.num_threads,
                      device_id=self.device.index if gpu else None, set_affinity=opts.affine,
                      prefetch_queue_depth=self.prefetch_queue_depth, seed=self.plan.seed & 0x7FFFFFFF)
        def graph():
            if files and self.host_decode:
                # Decoded and resized in the reader threads (see _host_crop): flip and normalize only.
                img, mirror = fn.external_source(**feed, num_outputs=2, layout=["HWC", None],
                                                 dtype=[types.UINT8, types.INT32])
            elif files:
                # The CPU decodes only a window around the crop box (anchor, shape); a GPU decodes whole
                # photos, as nvJPEG refuses a region decode with libjpeg-turbo's chroma upsampling
                # (files_decoder). Either way the ROI below is the box in what was decoded.
                op, kwargs = self._decoder
                windowed = op == "image_slice"
                enc, *window, box, mirror = fn.external_source(
                    **feed, num_outputs=4 if windowed else 3,
                    dtype=[types.UINT8] + [types.INT32] * windowed + [types.FLOAT, types.INT32])
                windows = (window[0][0:2], window[0][2:4]) if windowed else ()   # (anchor, shape)
                if self._paths is not None:   # file names: DALI reads the bytes in its C++ threads
                    # Read, not mmap: a file truncated while mapped (rewritten in place) is a SIGBUS
                    # that kills the process; a read of it is an error the loader handles.
                    enc = fn.io.file.read(enc, dont_use_mmap=True)
                img = getattr(fn.decoders, op)(enc, *windows, output_type=types.RGB,
                                               **{**kwargs, **decoder_tuning(opts, known)})
            else:   # the images and their parameters (see prepare)
                n_in = 3 if aug.crop.resamples else 2
                img, *par = fn.external_source(**feed, num_outputs=n_in, layout=["HWC"] + [None] * (n_in - 1),
                                               dtype=[types.UINT8] + [types.FLOAT] * (n_in - 2) + [types.INT32])
                img, box, mirror = img.gpu() if gpu else img, par[0], par[-1]   # crop "none": the flips alone
                if aug.crop is Crop.TRANSLATE:
                    # pad + random crop as one slice whose window may leave the image by up to pad px,
                    # filled by the recipe's padding (host-padded batches: the window stays inside).
                    policy, mirror = "pad" if self._host_pad else SLICE_POLICY[aug.padding], box[2]
                    img = fn.slice(img, start=box[0:2], shape=list(cast(ArrayPixels, self.source).image_shape[:2]),
                                   axis_names="HW", out_of_bounds_policy=policy, fill_values=0)
            if files and not self.host_decode or not files and aug.crop.resamples:
                # The box (roi start y, x, end y, x) in what was decoded (see prepare).
                img = fn.resize(img, size=[aug.size, aug.size], roi_start=box[0:2], roi_end=box[2:4],
                                roi_relative=False, interp_type=types.INTERP_LINEAR, antialias=True)
            # One fused pass: flip, (x - 255 mean) / (255 std), HWC → CHW (or kept for channels_last),
            # and the output dtype (bf16 does not exist in DALI: float32, converted by torch below).
            img = fn.crop_mirror_normalize(
                img, mirror=mirror, mean=[255.0 * m for m in self.mean], std=[255.0 * s for s in self.std],
                dtype=types.FLOAT16 if half else types.FLOAT, output_layout="HWC" if channels_last else "CHW")
            return img

        self._pipe = graph()
        self._pipe.build()
        # Driven through DALI's scheduling API (decode.dali_outputs): its epoch would end only when the
        # feeder raised StopIteration, which the endless stream never does; the passes are counted in
        # _epoch. A smaller last batch of a pass is returned as it is (never padded or filled from the
        # next epoch).
        self._iter = Outputs(self._pipe, self.device, opts.handover, self.config.dtype)
        if opts.driver == "thread":
            self._iter = DrivenOutputs(self._iter)

    def _restart(self, epoch: int, batches: list, start: int) -> None:
        """A fresh pipeline fed the stream from batch ``start`` of ``epoch`` (``batches`` on)."""
        self._release()
        self._feeder.start(stream(self.plan, epoch, batches, start))
        if self._paths is not None and self.dali_options.preallocate:
            self._feeder.prime()   # the first batch's sizes for nvJPEG's buffers (decoder_tuning)
        self._build()

    def _release(self, timeout: float = 60.0):
        # The outputs first: a driver thread (driver="thread") calls the feeder until it is stopped, within
        # ``timeout`` seconds (a batch's read that hangs: close()'s join timeout, not a minute at exit).
        if self._iter is not None and os.getpid() == self._owner_pid:   # a forked child has no CUDA
            # Copies still reading DALI's buffers finish before the pipeline goes.
            self._iter.close(timeout)
        self._feeder.cancel()
        self._feeder.records.clear()
        self._iter = None
        self._pipe = None  # DALI frees its threads and buffers with the pipeline object
        self._ready = self._expect = None

    # ------------------------------------------------------------------ inputs for one batch
    # ------------------------------------------------------------------ one epoch
    def _epoch(self, epoch, batches, start):
        if self._closed:
            # A pass after close() built a pipeline again for arrays (files met the stopped reading
            # threads), out of _LIVE: not freed before the interpreter's exit (see _close_live).
            raise RuntimeError(f"this dali loader was closed: close() freed its pipeline and stopped its "
                               f"threads; make a new loader to read {self.source!r} again")
        if os.getpid() != self._owner_pid:
            self._adopt_in_fork()
        total = len(batches)
        pos = 0  # batches handed out
        retried = -1   # the position last fed again after a failure no single file explains
        if total and not self._continues(epoch, batches, start):
            self._restart(epoch, batches, start)
        planned = PassLabels(batches, lambda flat: labels_on(self.device, self.source.labels[flat]))
        while pos < total:
            try:
                for out in self._outputs(total - pos, planned, pos):
                    pos += 1
                    if pos == total:   # set before the last yield: the consumer may never come back
                        self._expect = epoch + 1
                    yield out
            except _StreamEnded:
                self._restart(epoch, batches[pos:], start + pos)
            except GeneratorExit:
                if pos < total:
                    self._release()  # the stream holds this pass's batches read ahead, not the next one's
                raise
            except DecodeError as e:
                self._release()
                free_frames(e)
                raise
            except Exception as e:
                # DALI's batches; a copy first: a driver thread (driver="thread") may still be appending
                fed = [int(i) for rec in list(self._feeder.records) for i in rec["ids"]]
                self._release()
                if not is_dali_failure(e):
                    raise
                free_frames(e)
                # Raises, or marks the files bad (or to be learnt again) and feeds the batch again.
                self._handle_decode_failure(e, fed, again=retried != pos)
                retried = pos
                self._restart(epoch, batches[pos:], start + pos)
            except BaseException:
                # KeyboardInterrupt (Ctrl-C while this thread waits for DALI, which runs the input
                # callback here) or SystemExit, raised from inside the stream: a record may stand for a
                # batch DALI never got, and _expect may still name this epoch, so the next pass would go
                # on with this stream, its batches and labels out of step. Freed: the next iter() builds
                # a fresh one.
                self._release()
                raise

    def _continues(self, epoch: int, batches: list, start: int) -> bool:
        """Whether the running stream's next batch is this pass's first: the pass is the epoch after a
        pass that ran to its end, read from its start (not a resumed or re-chosen position)."""
        if self._iter is None or self._expect != epoch or start != 0:
            return False
        planned = self.plan.batches_from(epoch, 0)
        return len(planned) == len(batches) and np.array_equal(planned[0], batches[0])

    def _outputs(self, remaining: int, planned: PassLabels, pos: int):
        """(images, labels) for the next ``remaining`` batches of the stream, empty ones included: the
        pass's batches from position ``pos`` (``planned``: their labels as planned, uploaded at once)."""
        records, keep_ids = self._feeder.records, self.ids_keeper()
        for k in range(pos, pos + remaining):
            while not records and self._ready is None:  # nothing fed yet: ask DALI, which calls the feeder
                self._ready = self._fetch()
            rec = records[0]
            if "error" in rec:   # its preparation failed (Feeder): raised now, after the batches before it
                raise rec["error"]
            if rec["n"] and self._ready is None:
                self._ready = self._fetch()
            records.popleft()
            self.skipped += rec["skipped"]
            labels = planned.of(k, rec["ids"], rec["skipped"]) if rec["n"] else None
            keep_ids(None if labels is not None else rec["ids"])   # the files it holds: as planned, or these
            if not rec["n"]:
                yield self._empty()
                continue
            out, self._ready = self._ready, None
            yield self._convert(out, labels_on(self.device, record_labels(rec)) if labels is None else labels)

    def _fetch(self):
        """DALI's next output; None when its stream ended on a run of empty batches that the records
        hold (they are yielded without DALI). Ended with nothing left to yield: _StreamEnded."""
        if self._iter is None:   # every pass builds its pipeline first: only close() took it away since
            raise RuntimeError("the dali loader was closed while this pass ran (close() frees its pipeline "
                               "and threads); a closed loader yields no more batches")
        try:
            return next(self._iter)
        except StopIteration:
            if self._feeder.records:
                return None
            raise _StreamEnded from None

    def _convert(self, images: torch.Tensor, labels: torch.Tensor):
        """The batch DALI made, and its labels (the pass's, or the record's where files were skipped):
        labels never go through DALI (they are known here; as a pipeline input and output they cost an
        external_source feed, an output and a DLPack hand-over per batch for 64 integers)."""
        if self.config.channels_last:
            # NHWC memory viewed as NCHW is exactly the channels_last layout: no copy.
            images = images.permute(0, 3, 1, 2)
        if self.config.dtype == torch.bfloat16:   # on a GPU Outputs' copy made it bfloat16: returned as is
            images = images.to(torch.bfloat16, memory_format=torch.preserve_format)
        return images, labels

    def _empty(self):
        memory = torch.channels_last if self.config.channels_last else torch.contiguous_format
        images = torch.empty((0,) + self.out_shape, dtype=self.config.dtype, device=self.device)
        return images.contiguous(memory_format=memory), torch.empty(0, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ decode errors
    def _handle_decode_failure(self, e: BaseException, candidates: list[int], again: bool) -> None:
        """Find the file(s) DALI failed on: refused (raised, or skipped and the batch fed again). When
        each decodes alone, a file changed since its batch was prepared (a photo replaced in place while
        its name was read ahead: DALI found another size, or a file being rewritten): the batch's files
        are learnt again and it is fed again once (``again``); a second failure is raised."""
        bad = self._probe(candidates)
        if not bad and again:
            for i in candidates:
                if self._state[i] == OK:
                    self._state[i] = UNSEEN
            return
        if not bad:
            raise RuntimeError(f"DALI failed on a batch of {len(candidates)} file(s) "
                               f"({', '.join(repr(self.source.sample_name(i)) for i in candidates[:3])}"
                               f"{', ...' if len(candidates) > 3 else ''}) although each decodes alone: "
                               f"{dali_reason(e)}") from e
        for i, why in bad:
            self._why[i] = f"DALI cannot decode it ({why}){self._pil_opinion(i)}"
            self._state[i] = BROKEN  # refused from now on without asking DALI again
        i = bad[0][0]
        self.on_error.refuse(self.source.sample_name(i), self._why[i])   # "skip": the batch is fed again

    def _probe(self, ids) -> list[tuple[int, str]]:
        """Decode files one at a time with DALI's decoder; return (id, reason) for those that fail
        (a file that cannot be read any more, e.g. deleted since DALI was given its name, too).

        One probe pipeline serves every file and every failure: DALI 2.4 appends "Current pipeline
        object is no longer valid" to a failed run's error, but a ``run()`` pipeline without prefetch
        (batch 1, queue depth 1) decodes the next file correctly anyway (checked: bad and good files
        interleaved give the pixels of a fresh pipeline), so rebuilding it per bad file (a new decoder
        and, on a GPU, new nvJPEG state and memory) would only cost time. It is rebuilt when a run
        fails in a way that is not a decoder failure.
        """
        from nvidia.dali import fn, pipeline_def, types

        # None on the CPU: no device (Pipeline's own default). DALI's pipeline_def overload stub types
        # device_id as int although Pipeline documents and takes None.
        device_id = self.device.index if self.gpu else None

        @pipeline_def(batch_size=1, num_threads=1, prefetch_queue_depth=1,
                      device_id=device_id)  # type: ignore[arg-type]
        def probe():
            enc = fn.external_source(name="enc", dtype=types.UINT8)
            return fn.decoders.image(enc, device="mixed" if self.gpu else "cpu", output_type=types.RGB,
                                     jpeg_fancy_upsampling=True)

        bad: list[tuple[int, str]] = []
        for i in ids:
            try:   # the bytes DALI is given (see DaliFiles._learn_input)
                fed = self._as_fed(i, self.source.read(i))
            except DecodeError as err:
                bad.append((i, err.why))
                continue
            if isinstance(fed, str):
                bad.append((i, fed))
                continue
            data = np.frombuffer(fed, dtype=np.uint8)
            for attempt in (0, 1):
                if self._probe_pipe is None:
                    self._probe_pipe = probe()
                    self._probe_pipe.build()
                try:
                    (out,) = self._probe_pipe.run(enc=[data])
                except Exception as e:
                    if is_dali_failure(e):
                        bad.append((i, dali_reason(e)))
                        break
                    self._probe_pipe = None
                    if attempt:
                        raise
                    continue
                turned = self._turned_otherwise(i, data, out.shape()[0])
                if turned:
                    bad.append((i, turned))
                break
        return bad

    def _turned_otherwise(self, i: int, data: np.ndarray, shape) -> str | None:
        """Why file ``i``, which DALI's decoder decodes, still fails its batch: DALI turns it by its EXIF
        orientation to another height and width than Pillow's reading of the same bytes, which the
        crop windows are drawn in (a malformed block: an orientation stored as LONG, an entry count
        past the block's end, an unknown byte order; each reader stops or goes on differently). The
        window then lies outside DALI's picture. Pillow reads the bytes just probed, not the sizes
        learnt earlier: a photo replaced in place since is another size for both, and is learnt again
        (``_handle_decode_failure``). None when the two agree."""
        import io

        path = self.source.sample_name(i)
        try:
            img = open_image(path, io.BytesIO(data.tobytes()))
        except DecodeError:
            return None   # DALI decodes what Pillow cannot even open: not an orientation question
        orientation = exif_orientation(img, path)
        height, width = displayed_size(img.height, img.width, orientation)
        got = (int(shape[0]), int(shape[1]))
        if got == (height, width):
            return None
        return (f"DALI's decoder turns it to {got[0]}x{got[1]} (height x width) by its EXIF orientation, "
                f"where Pillow's reading of the same EXIF block (orientation {orientation}) gives "
                f"{height}x{width}: a malformed EXIF block, read otherwise by each. decode='host' "
                f"decodes it as the other backends do")

    # ------------------------------------------------------------------ lifetime
    def _adopt_in_fork(self) -> None:
        """Make a loader inherited by a forked child (``multiprocessing``'s fork) the child's own. The
        parent's DALI pipeline and reading threads do not exist here: its stream, fed by them, hung the
        child's first pass forever, and its pools would queue reads no thread runs. Its pipeline objects
        are kept, never destroyed (destroying one waits for the parent's threads, see ``_close``); the
        child gets fresh pools, lock and stream. The folder of copies is shared: the parent's copies stay
        valid while it lives, and the parent, which made the folder, removes it (``_drop_rewritten``)."""
        _INHERITED.append((self._pipe, self._iter, self._probe_pipe))
        self._probe_pipe = None
        self._release()   # the references dropped here are kept in _INHERITED: nothing is destroyed
        self._rngs, self._drawn = {}, {}
        self._rewrite_lock = threading.Lock()   # a parent's thread may have held the old one at the fork
        if self.assembler is not None:
            self.assembler = WorkerPool(1, "fastdata-dali-batch")
            self._readers = WorkerPool(self.read_threads, "fastdata-dali-read")
        self._owner_pid = os.getpid()
        _LIVE.add(self)

    def close(self):
        """Free the pipelines and stop the reading threads (joined: none is left running)."""
        self._close(join_timeout=10.0)

    def _close(self, join_timeout: float):
        if os.getpid() != self._owner_pid:
            # A forked child (a DataLoader worker of another loader) inherited this object. DALI's
            # pipeline threads exist only in the parent: destroying the pipeline here waits for
            # them forever. Keep the child's copy alive instead; the child's exit frees it.
            _INHERITED.append((self._pipe, self._iter, self._probe_pipe))
            return
        _LIVE.discard(self)
        self._closed = True
        try:
            self._release(join_timeout)
            self._probe_pipe = None
            # Readers first: their queued reads are cancelled, so an assembler waiting on them ends at once.
            for pool in (self._readers, self.assembler):
                if pool is not None:
                    pool.shutdown(join_timeout)
        finally:
            # After the readers, which write the copies; and also when a Ctrl-C ends the waits above (a
            # join, DALI freeing its pipeline): the folder stayed until the process's exit, a notebook
            # kernel's whole life. The KeyboardInterrupt goes on after this.
            self._drop_rewritten()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
