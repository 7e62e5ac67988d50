"""``dali`` backend: NVIDIA DALI decodes, crops, resizes and normalizes in its C++ thread pool (CPU) or
with nvJPEG and CUDA kernels (``device="mixed"``/``"gpu"``).

Design: every batch enters through ``fn.external_source``, not through DALI's own ``fn.readers.file``.
The reader would shuffle with DALI's RNG, shard with its own padding rules and hide its position
inside the pipeline; the contract asks for the *same* order as every other backend (``EpochPlan``
from ``(seed, epoch)``), a resume that yields exactly the remaining batches, ``set_epoch``, and equal
batch counts on every rank. Feeding the plan's batches ourselves gives all of that exactly.

Reading: DALI calls the input callback on the training thread, so the callback must not read files
there (it did: 37-64 ms per 64-image batch on 2 busy cores, which under nvJPEG would cap a rank at a
few thousand images/s). Batches are assembled ahead, ``prefetch_queue_depth + 1`` of them, by one
assembler thread that spreads each batch's files over ``read_threads`` reader threads; the callback
only picks up a finished batch (measured 1.3-8 ms per 64-image batch, mostly waiting for the GIL).
A file's size and EXIF orientation are learnt once, from the bytes read for its first batch (no
separate header pass: construction stays instant for ImageNet's 1.28M files), and kept in numpy arrays.
Threads, not DALI's parallel (multi-process) external source: reads and PIL decoding release the GIL,
the per-file knowledge must stay in this process, and the parallel source pickles the callback into
workers that cannot follow an epoch/resume position set here.

Integrity (``validate=True``): the first time a file is read it is decoded once with PIL, the decoder
the torch and memory backends use (``transforms.check_pixels``, at 1/8 scale: libjpeg still reads every
byte of the scan; measured 1.4 ms per ImageNet-sized JPEG and core, 0.7x a full decode). Region
decoding alone cannot be trusted with broken files: a file truncated at 90% decodes whenever the crop
misses its last rows (the run then dies at a random later epoch), and garbage that libjpeg only warns
about inside DALI yields a garbled image. With the check, every backend refuses the same files in the
first epoch, whatever the crops.

Random augmentation parameters come from ``transforms.draw_params`` (the one source every backend
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
(``region.decode_box``, the same libjpeg-turbo that DALI's CPU decoder runs) or PIL's reduced-scale
decode, whichever is estimated cheaper, then PIL's resize; DALI gets dense uint8 crops and only flips
and normalizes them. Measured (2 cores, ImageNet-sized JPEGs, per crop and core): DALI's CPU
``fn.resize`` 1.8 ms against PIL-SIMD's 0.4 ms for the same windows, more than the region decode itself
(1.3-1.6 ms; a full decode 2.0-2.2 ms): the in-pipeline path spent 3.4 ms of CPU per image, the host
path 2.5 ms (1.5x the images/s in the same run). ``jpeg_fancy_upsampling`` and ``use_fast_idct`` change
nothing there: DALI passes the first to nvJPEG only (libjpeg-turbo always upsamples "fancy": DALI's CPU
pixels equal PIL's), and the second saved under 10% of the decode. The pixels are the torch backend's
wherever both decode the same rows at the same scale.

Arrays: the batch goes in as one dense array; translation is ``fn.slice`` with a
per-sample anchor whose window leaves the image by up to ``pad`` pixels, filled by the slice's
``out_of_bounds_policy`` (pad + crop in one op, no padded copy): zeros (``"pad"``), the edge pixel
(``"edge"``) or the mirror without the edge pixel (``"reflect_101"``: numpy's and torch's "reflect";
DALI's own "reflect" repeats the edge pixel). A DALI without those border modes (they came with 2.4's
slice) gets the batch padded on the host with ``np.pad`` and a slice inside it instead: the same pixels.

Errors: a file whose header PIL cannot read (empty, not an image, wrong extension, decompression bomb)
or that fails the integrity check raises ``DecodeError`` naming it when its batch is fed
(``on_error="skip"``: skipped and counted in ``self.skipped``, with the crop draws consumed exactly as
the torch backend consumes them); the verdict is kept, so the file is never read again. Decoding on
the host, a file the reader thread's decoder refuses (``validate=False``) is handled the same way, in
its batch's order. A file that still fails inside DALI (``validate=False``, or one PIL accepts and
DALI does not) fails the whole DALI iteration: DALI 2.4 raises a plain ``RuntimeError`` (see
``is_dali_failure``: classified by type and origin; any other error is re-raised untouched). The loader
then decodes the batch's files one by one in one reusable probe pipeline to find the culprit and raises
``DecodeError`` with the path and DALI's message (``"skip"``: it remembers the file, rebuilds the main
pipeline and feeds the batch again without it). After any error or an epoch left unfinished (a closed
generator), the next ``iter()`` builds a fresh pipeline and drops the batches read ahead, never reusing
a broken one.

Outputs: DALI 2.4's default executor (``exec_dynamic``) hands its buffers to torch through DLPack
without a copy. They stay valid as long as torch holds them (DALI's ``TensorGPU.__dlpack__`` docs),
and ``torch.from_dlpack`` passes torch's current stream. The hand-over itself is a host wait:
``DALIGenericIterator`` calls ``Pipeline.share_outputs()`` with no stream, which DALI 2.4 documents as
"the outputs are synchronized with the host" (``nvidia/dali/pipeline.py``). It waits for the batch
being handed over only, which DALI's prefetch queue (``prefetch_queue_depth``) has usually finished by
then, not for torch's work on the GPU.
"""
from __future__ import annotations

import collections
import os
import re
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..config import Crop, Padding
from ..datasets import SourceKind
from ..decode.dali_files import BROKEN, DaliFiles
from ..decode.on_error import OnError
from ..errors import DecodeError
from ..transforms import (
    NUMPY_PAD_MODE,
    draw_params,
    require_fixed_size,
)
from .base import Loader

# Pipelines inherited by forked children, kept alive there on purpose (see DaliLoader.__del__).
_INHERITED: list = []


# DALI 2.4 has no exception classes of its own: its C++ executor's errors reach Python as a plain
# RuntimeError (pybind11's translation of std::runtime_error) whose text starts with one of these.
_DALI_PREFIXES = ("Critical error in pipeline", "Critical error when building pipeline",
                  "Unknown critical error")


#: ``Augmentation.padding`` → ``fn.slice``'s out_of_bounds_policy for a translation. Not DALI's "reflect":
#: that one repeats the edge pixel (numpy's "symmetric"); numpy's, torch's and torchvision's "reflect"
#: does not, which is DALI's "reflect_101".
SLICE_POLICY = {Padding.CONSTANT: "pad", Padding.REFLECT: "reflect_101", Padding.EDGE: "edge"}

#: The ``decode`` option's values (see DaliLoader).
DECODE_CHOICES = ("auto", "host", "dali")


def files_decoder(gpu: bool) -> tuple[str, dict]:
    """The photo decoder of the in-pipeline files path (``decode="dali"``): the ``fn.decoders``
    operator's name and its keyword arguments (besides the inputs and ``output_type``).

    ``"image_slice"`` (the CPU) decodes a window around the crop box, given as (anchor, shape) inputs:
    libjpeg-turbo never reads the rows below it. ``"image"`` (a GPU) decodes whole photos, and the crop
    box is then ``fn.resize``'s ROI in the photo's own coordinates. Why not a region decode on the GPU:
    nvImageCodec 0.9's nvJPEG extension (with nvJPEG 12.x) refuses a region decode with
    ``jpeg_fancy_upsampling`` for chroma-subsampled JPEGs, nearly every photo ("ROI decode with fancy
    upsampling may produce wrong results on image edge ... with nvJPEG < 13.2", in libnvjpeg_ext.so),
    and DALI quietly decodes those on its CPU fallback: the pixels were right and every test passed,
    but the GPU's decoding speed was gone. Without fancy upsampling nvJPEG's chroma differs from
    libjpeg-turbo's (PIL, the other backends) by tens of levels along colour edges.
    """
    if gpu:
        return "image", {"device": "mixed", "jpeg_fancy_upsampling": True}
    # jpeg_fancy_upsampling: DALI 2.4 documents it for the mixed backend only; the CPU decoder
    # upsamples so already (measured: same pixels, same speed). Kept for symmetry with the GPU.
    return "image_slice", {"device": "cpu", "axis_names": "HW", "normalized_anchor": False,
                           "normalized_shape": False, "jpeg_fancy_upsampling": True}


def slice_has_policy(policy: str) -> bool:
    """Whether the installed DALI's ``fn.slice`` knows ``out_of_bounds_policy=policy``. "edge" and
    "reflect_101" came with DALI's slice border modes (2.4 has them); older releases know only
    error/pad/trim_to_shape and would refuse the pipeline. Read from the operator's schema, which lists
    the values it parses."""
    from nvidia.dali import backend

    return f'"{policy}"' in backend.GetSchema("Slice").GetArgumentDox("out_of_bounds_policy")


def _dali_dir() -> str:
    import nvidia.dali

    return os.path.dirname(os.path.abspath(nvidia.dali.__file__)) + os.sep


def _free_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames in ``error``'s traceback (and its causes'). A failure
    raised inside DALI's iteration carries DALI's frames (the iterator's ``_schedule_runs`` down to the
    feeder's callback), which hold the iterator and its pipeline in a reference cycle: dropped by
    ``_release``, the pipeline's threads and buffers lived on until the cyclic GC ran (47 threads and
    +55 MB RSS after 20 failed epochs here; on a GPU, its device buffers too). The traceback keeps its
    lines; frames still running (the caller's) cannot be cleared and are left as they are."""
    import traceback

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def is_dali_failure(e: BaseException) -> bool:
    """True for an error that DALI's executor raised while running a pipeline (an operator failed,
    e.g. the decoder on a broken file); False for anything else, which is re-raised untouched.

    Classified by type and origin, not by words in the text: exactly ``RuntimeError`` (not a
    subclass such as ``torch.OutOfMemoryError``), raised inside the ``nvidia.dali`` package (the
    innermost traceback frame is DALI's Python code calling into its C++ executor; an error from our
    own input callback, which DALI calls, has its innermost frame in fastdata), and carrying the
    executor's "Critical error ..." prefix (which DALI's own argument errors, also raised from its
    package, do not).
    """
    if type(e) is not RuntimeError:
        return False
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_dali_dir()):
        return False
    return str(e).lstrip().startswith(_DALI_PREFIXES)


class _Feeder:
    """The external_source callback: turns the plan's batches into DALI inputs, one batch per call.

    ``records`` holds one entry per batch handed to DALI (or found empty), in order, so the consumer
    side knows which batch each DALI output is and which files it held.

    Files are read ahead: ``ahead`` batches are prepared in the loader's reader thread (reading the
    files' bytes and, the first time, their headers and integrity) while DALI works on the batches
    already fed, so the call DALI makes on the training thread only picks up a finished batch.
    Array batches are a vectorized gather: prepared right here.
    """

    def __init__(self, loader: "DaliLoader", ahead: int):
        # A weak reference: the pipeline holds this callback, and a strong one back to the loader would
        # put every DaliLoader in a reference cycle that only the cyclic GC frees — possibly inside a
        # forked DataLoader worker, where destroying a DALI pipeline deadlocks.
        self.loader = weakref.proxy(loader)
        self.ahead = ahead
        self.jobs = iter(())
        self.pending = collections.deque()  # futures of the batches being read ahead, in order
        self.records = collections.deque()
        self.epoch = 0

    def start(self, epoch: int, jobs):
        """``jobs``: iterable of (batch number in the epoch, sample ids)."""
        self.cancel()
        self.epoch = epoch
        self.jobs = iter(jobs)
        self.records.clear()  # reading starts with DALI's first call (the pipeline may be rebuilt first)

    def cancel(self):
        """Drop the batches read ahead (an epoch abandoned or failed): none may reach another epoch."""
        for f in self.pending:
            f.cancel()  # one already running finishes in the background; its result is dropped
        self.pending.clear()

    def _fill(self):
        assembler = self.loader._assembler
        while assembler is not None and len(self.pending) < self.ahead:
            job = next(self.jobs, None)
            if job is None:
                return
            self.pending.append(assembler.submit(self.loader._prepare, self.epoch, *job))

    def _next_batch(self):
        if self.loader._assembler is None:
            k, ids = next(self.jobs)  # StopIteration ends DALI's epoch
            return self.loader._prepare(self.epoch, k, ids)
        self._fill()
        if not self.pending:
            raise StopIteration  # ends DALI's epoch
        done = self.pending.popleft()
        self._fill()
        return done.result()  # re-raises a DecodeError of that batch here, in DALI's call

    def __call__(self):
        while True:
            inputs, record = self._next_batch()
            self.records.append(record)
            if inputs is not None:
                return inputs
            # An empty batch (every sample skipped, or a rank's share of a tiny last step): DALI cannot
            # run a batch of 0 samples, so it is yielded by the consumer side without DALI.


class DaliLoader(DaliFiles, Loader):
    """NVIDIA DALI backend (CPU threads here, nvJPEG + CUDA kernels on a GPU).

    Options:
        num_threads: DALI's CPU worker threads (default: ``config.num_workers``, the usable cores).
        prefetch_queue_depth: batches DALI prepares ahead of the consumer (default 2).
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
    """

    name = "dali"
    reads = frozenset({SourceKind.ARRAY, SourceKind.FILES})   # DALI cannot call a Python __getitem__
    options = {"num_threads": None, "prefetch_queue_depth": 2, "read_threads": None, "validate": True,
               "decode": "auto"}

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
        readers = self.opts["read_threads"]
        readers = threads if readers is None else readers
        if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
            raise ValueError(f"read_threads must be an integer >= 1, got {readers!r}")
        if not isinstance(self.opts["validate"], bool):
            raise ValueError(f"validate must be True or False, got {self.opts['validate']!r}")
        self.read_threads, self.validate = readers, self.opts["validate"]
        self.gpu = self.device.type == "cuda"
        self.on_error = OnError(config.on_error)   # raise or skip: decided there, never here
        decode = self.opts["decode"]
        if decode not in DECODE_CHOICES:
            raise ValueError(f"decode must be one of {list(DECODE_CHOICES)}, got {decode!r}")
        if decode == "host" and self.gpu:
            raise ValueError(f"decode='host' is for device='cpu'; on {self.device} nvJPEG decodes inside the "
                             f"pipeline (decode='dali' or 'auto')")
        #: True: photos are decoded and resized in the reader threads and DALI only flips and normalizes.
        self.host_decode = source.kind is SourceKind.FILES and decode != "dali" and not self.gpu
        #: The in-pipeline decoder (files_decoder): a window around each box, or whole photos.
        self._decoder = files_decoder(self.gpu)
        aug = self.augment
        require_fixed_size(source, aug)   # (base.py has refused a reflect pad the images cannot mirror)
        # Reflect/edge translation where this DALI's slice lacks the border mode: pad on the host.
        self._host_pad = (aug.crop is Crop.TRANSLATE and aug.padding is not Padding.CONSTANT
                          and not slice_has_policy(SLICE_POLICY[aug.padding]))
        if source.kind is SourceKind.FILES:
            self.out_shape = (3, aug.size, aug.size)
        else:
            h, w, c = source.image_shape
            self.out_shape = (c,) + aug.output_size(h, w)
        # Per file: what is known (UNSEEN/OK/NO_HEADER/BROKEN), (height, width, EXIF orientation)
        # as the augmentation sees them, and a stamp of the file they were read from. numpy, not dicts
        # of tuples: 21 bytes a file, 27 MB for ImageNet's 1.28M files. Reasons are kept only for the
        # few broken ones.
        n = len(source) if source.kind is SourceKind.FILES else 0
        self._state = np.zeros(n, np.uint8)
        self._dims = np.zeros((n, 3), np.int32)
        self._stamps = np.zeros(n, np.int64)   # each file's (size, mtime) when its size was read
        self._why: dict[int, str] = {}
        # Reading: one assembler thread prepares whole batches in plan order (the augmentation draws
        # need each file's size); it spreads a batch's files over the reader threads. Threads, not
        # processes or DALI's parallel external source: file reads and PIL's decode release the GIL,
        # the per-file verdicts must be shared with this loader, and DALI's parallel source would
        # pickle the callback into worker processes, which cannot follow the epoch/resume position
        # set here. Created on first use (the executors start their threads lazily).
        self._assembler = self._readers = None
        if source.kind is SourceKind.FILES:
            self._assembler = ThreadPoolExecutor(1, thread_name_prefix="fastdata-dali-batch")
            self._readers = ThreadPoolExecutor(readers, thread_name_prefix="fastdata-dali-read")
        self._feeder = _Feeder(self, ahead=depth + 1)
        self._probe_pipe = None
        self._pipe = None
        self._iter = None
        self._clean = False  # the current pipeline finished its last epoch and can be reset for another
        self._owner_pid = os.getpid()

    # ------------------------------------------------------------------ the pipeline
    def _build(self):
        """A fresh pipeline and DALIGenericIterator; the feeder must hold the epoch's jobs already.

        Over 60 lines on purpose: the pipeline graph is one DALI function and reads top to bottom as
        the data flows (inputs, decode, crop, normalize); split, its branches would be harder to follow.
        """
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self._release()
        aug, gpu = self.augment, self.gpu
        files = self.source.kind is SourceKind.FILES
        half = self.config.dtype == torch.float16
        channels_last = self.config.channels_last

        @pipeline_def(batch_size=self.config.batch_size, num_threads=self.num_threads,
                      device_id=self.device.index if gpu else None,
                      prefetch_queue_depth=self.prefetch_queue_depth, seed=self.plan.seed & 0x7FFFFFFF)
        def graph():
            if files and self.host_decode:
                # Decoded and resized in the reader threads (see _host_crop): flip and normalize only.
                img, labels, mirror = fn.external_source(source=self._feeder, num_outputs=3, batch=True,
                                                         layout=["HWC", None, None],
                                                         dtype=[types.UINT8, types.INT64, types.INT32])
            elif files:
                # The CPU decodes only a window around the crop box (anchor, shape); a GPU decodes whole
                # photos, as nvJPEG refuses a region decode with libjpeg-turbo's chroma upsampling
                # (files_decoder). Either way the ROI below is the box in what was decoded.
                op, kwargs = self._decoder
                windowed = op == "image_slice"
                enc, labels, *windows, roi_start, roi_end, mirror = fn.external_source(
                    source=self._feeder, num_outputs=7 if windowed else 5, batch=True,
                    dtype=[types.UINT8, types.INT64] + [types.INT32, types.INT32] * windowed
                    + [types.FLOAT, types.FLOAT, types.INT32])
                img = getattr(fn.decoders, op)(enc, *windows, output_type=types.RGB, **kwargs)
                img = fn.resize(img, size=[aug.size, aug.size], roi_start=roi_start, roi_end=roi_end,
                                roi_relative=False, interp_type=types.INTERP_LINEAR, antialias=True)
            else:
                # With crop "none" there is no window to feed: 3 inputs instead of 5.
                n_in = 3 if aug.crop is Crop.NONE else 5
                ins = fn.external_source(source=self._feeder, num_outputs=n_in, batch=True,
                                         layout=["HWC"] + [None] * (n_in - 1),
                                         dtype=[types.UINT8, types.INT64, types.FLOAT, types.FLOAT,
                                                types.INT32][:n_in - 1] + [types.INT32])
                img, labels, mirror = ins[0], ins[1], ins[-1]
                p0, p1 = (ins[2], ins[3]) if n_in == 5 else (None, None)
                img = img.gpu() if gpu else img
                if aug.crop is Crop.TRANSLATE:
                    # pad + random crop as one slice whose window may leave the image by up to pad px,
                    # filled by the recipe's padding (host-padded batches: the window stays inside).
                    policy = "pad" if self._host_pad else SLICE_POLICY[aug.padding]
                    img = fn.slice(img, p0, p1, axis_names="HW", normalized_anchor=False,
                                   normalized_shape=False, out_of_bounds_policy=policy, fill_values=0)
                elif aug.crop.resamples:
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
        self._feeder.cancel()
        self._iter = None
        self._pipe = None  # DALI frees its threads and buffers with the pipeline object
        self._clean = False

    # ------------------------------------------------------------------ inputs for one batch
    def _prepare(self, epoch: int, k: int, ids: np.ndarray):
        """DALI inputs of batch ``k`` (or None when it is empty) and its record."""
        rng = self.batch_rng(epoch, k)
        if self.source.kind is SourceKind.FILES:
            return self._prepare_files(rng, k, ids)
        src, aug = self.source, self.augment
        n = len(ids)
        record = {"k": k, "ids": ids, "n": n, "skipped": 0}
        if n == 0:
            return None, record
        h, w, _ = src.image_shape
        images = src.images[ids]
        params = draw_params(aug, rng, n, (h, w))   # the recipe's one source of random numbers
        flips = params.flips.astype(np.int32)
        if params.offsets is not None:
            if self._host_pad:   # the window inside the padded images: anchor = offset
                p = aug.pad
                images = np.pad(images, ((0, 0), (p, p), (p, p), (0, 0)), mode=NUMPY_PAD_MODE[aug.padding])
                p0 = params.offsets.astype(np.float32)
            else:                # the window shifted by offset - pad: out of bounds by up to pad px
                p0 = (params.offsets - aug.pad).astype(np.float32)             # slice anchor
            p1 = np.tile(np.array([h, w], np.float32), (n, 1))                 # slice shape
        elif params.boxes is not None:
            boxes = params.boxes.astype(np.float32)                            # (top, left, h, w)
            p0, p1 = boxes[:, :2].copy(), boxes[:, :2] + boxes[:, 2:]
        else:
            return (images, src.labels[ids], flips), record
        return (images, src.labels[ids], p0, p1, flips), record

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
            except DecodeError as e:
                self._release()
                _free_frames(e)
                raise
            except GeneratorExit:
                self._release()  # the pipeline still holds prefetched batches of this epoch
                raise
            except Exception as e:
                self._release()
                if not is_dali_failure(e):
                    raise
                _free_frames(e)
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
    def _dali_reason(e: BaseException) -> str:
        """The useful line(s) of a DALI error: what follows 'encountered:' (not DALI's traceback)."""
        text = str(e)
        m = re.search(r"encountered:\s*(.*?)\s*(Current pipeline object is no longer valid|$)", text, re.S)
        reason = (m.group(1) if m else text).strip()
        reason = " ".join(line.strip() for line in reason.splitlines() if line.strip())
        return reason.rstrip(" :")[:300] or type(e).__name__

    def _handle_decode_failure(self, e: BaseException) -> None:
        candidates = [int(i) for rec in self._feeder.records for i in rec["ids"]]
        bad = self._probe(candidates)
        if not bad:
            raise RuntimeError(f"DALI failed on a batch of {len(candidates)} file(s) "
                               f"({', '.join(repr(self.source.sample_name(i)) for i in candidates[:3])}"
                               f"{', ...' if len(candidates) > 3 else ''}) although each decodes alone: "
                               f"{self._dali_reason(e)}") from e
        for i, why in bad:
            self._why[i] = f"DALI cannot decode it ({why}){self._pil_opinion(i)}"
            self._state[i] = BROKEN  # refused from now on without asking DALI again
        i = bad[0][0]
        self.on_error.refuse(self.source.sample_name(i), self._why[i])   # "skip": the batch is fed again

    def _probe(self, ids) -> list[tuple[int, str]]:
        """Decode files one at a time with DALI's decoder; return (id, reason) for those that fail.

        One probe pipeline serves every file and every failure: DALI 2.4 appends "Current pipeline
        object is no longer valid" to a failed run's error, but a ``run()`` pipeline without prefetch
        (batch 1, queue depth 1) decodes the next file correctly anyway (checked: bad and good files
        interleaved give the pixels of a fresh pipeline), so rebuilding it per bad file (a new decoder
        and, on a GPU, new nvJPEG state and memory) would only cost time. It is rebuilt when a run
        fails in a way that is not a decoder failure.
        """
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=1, num_threads=1, device_id=self.device.index if self.gpu else None,
                      prefetch_queue_depth=1)
        def probe():
            enc = fn.external_source(name="enc", dtype=types.UINT8)
            return fn.decoders.image(enc, device="mixed" if self.gpu else "cpu", output_type=types.RGB,
                                     jpeg_fancy_upsampling=True)

        bad = []
        for i in ids:
            data = np.frombuffer(self.source.read(i), dtype=np.uint8)
            for attempt in (0, 1):
                if self._probe_pipe is None:
                    self._probe_pipe = probe()
                    self._probe_pipe.build()
                try:
                    self._probe_pipe.run(enc=[data])
                except Exception as e:
                    if is_dali_failure(e):
                        bad.append((i, self._dali_reason(e)))
                        break
                    self._probe_pipe = None
                    if attempt:
                        raise
                    continue
                break
        return bad

    # ------------------------------------------------------------------ lifetime
    def close(self):
        self._release()
        self._probe_pipe = None
        for pool in (self._assembler, self._readers):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self):
        try:
            if os.getpid() != self._owner_pid:
                # A forked child (a DataLoader worker of another loader) inherited this object. DALI's
                # pipeline threads exist only in the parent: destroying the pipeline here waits for
                # them forever. Keep the child's copy alive instead; the child's exit frees it.
                _INHERITED.append((self._pipe, self._iter, self._probe_pipe))
                return
            self.close()
        except Exception:
            pass
