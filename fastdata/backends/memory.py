"""``memory`` backend: decode once, keep the whole dataset as one uint8 tensor, augment whole batches.

After the one-time cache, an epoch is a permutation, a gather and a few tensor ops per batch — no
processes, no per-sample Python, no host-to-device copy when the cache is on the GPU (airbench's
approach). uint8 keeps the cache at a quarter of float's size: MNIST is 47 MB, 10,000 photos at a
256-px maximum side are 2 GB.

Photos for training are cached whole, as FFCV does with ``max_resolution``: each resized (aspect kept,
never enlarged) so that its longer side is at most ``cache_size``, placed top-left in a fixed
(N, cache_size, cache_size, 3) tensor, the rest zero, with its original and cached (height, width)
recorded on the host. RandomResizedCrop boxes are drawn from the ORIGINAL size by the one
``draw_params`` (the torch backend's boxes and flips, for the same seed), scaled to the cached copy,
and resampled bilinearly on the device from inside the photo's own region (its edge pixels repeat
past a box's edge, never the zero fill). The evaluation recipe (center crop) is deterministic, so it
is cached already applied: exactly the torch backend's pixels, at ``size``², whatever ``cache_size``.

Translation pads by ``Augmentation.padding`` (zeros, reflection or the edge repeated, numpy's
``np.pad`` modes, so the torch backend's pixels exactly) once, when the cache is built: a shifted crop
of a padded image is then a gather, whatever the padding.

The random parameters are drawn on the host with the same numpy code and per-batch seed as the torch
backend, so for arrays the two backends produce identical batches. They are drawn for the whole epoch
when it starts and uploaded once (see MemoryLoader.prepare_epoch): a batch costs no host→device copy
and no host sync.

Building a photo cache (``cache_build``): threads decode with PIL straight into the cache's rows
("threads", the CPU default: PIL's decode and resize release the GIL, and threads need no worker start-up
and no shared-memory transfer of chunks); on a CUDA device nvImageCodec decodes batches of JPEGs on the
GPU into device memory, resized there ("nvimgcodec", the default where it is installed); the DataLoader
worker processes of before remain as "processes". Measured in benchmarks/results/cache-*.md.

Budget: a cache must fit in the device's total memory minus ``memory_reserve`` (default: a quarter of a
GPU, a fifth of the host's available RAM) minus the other live memory caches of this process, and on a
GPU also in its free memory.

One cache per node: under a process group, the k ranks of a node build a photo cache together (see
MemoryLoader._decode_node): local rank j decodes the j-th k-th of the files, so each file is decoded once
per node. On the CPU they share ONE copy in a /dev/shm file every rank maps (the budget counts it once
for the node: the need is one cache, not k); on CUDA an all-gather inside the node gives each GPU its
full copy. Undecodable files are exchanged first, so every rank keeps the same ones, or every rank
raises, naming the file. Arrays are not decoded: each rank's cache is its own array, as before.
"""
from __future__ import annotations

import contextlib
import io
import math
import numbers
import os
import threading
import warnings
import weakref
import zlib
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..config import ON_ERROR, Augmentation, Crop, Padding
from ..datasets import SourceKind
from ..decode import BatchDecoder, collect_before_fork
from ..errors import CacheDoesNotFit, DecodeError
from ..sampling import EpochPlan
from ..transforms import (
    JPEG_FORMATS,
    NUMPY_PAD_MODE,
    decode_upright,
    draw_params,
    exif_orientation,
    open_image,
    require_fixed_size,
)
from .base import Loader

#: What the budget keeps free by default for the model, its activations and the batch being augmented:
#: a quarter of a GPU's *total* memory (free memory would hand the cache whatever the model has not
#: allocated yet, and the training step then runs out), a fifth of the host's available RAM.
DEFAULT_RESERVE = {"cuda": 0.25, "cpu": 0.2}

#: Live MemoryLoader caches of this process. Every new cache is budgeted against what the others already
#: hold on the same device (a train and an eval cache must fit together); weak references, so a cache
#: leaves the budget when its loader is closed or collected.
_LIVE: weakref.WeakSet[MemoryLoader] = weakref.WeakSet()


def _fmt(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else total."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_bytes(device: torch.device) -> int:
    """Bytes allocatable now: a GPU's free memory; the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_ram()


def total_bytes(device: torch.device) -> int:
    """The pool a cache is budgeted against. On a GPU its total memory: the same on every rank of a job
    on identical GPUs, whatever each has allocated so far. On the host, the available RAM plus what this
    process's live memory caches hold (MemAvailable has already lost them; the budget subtracts them
    explicitly, like on a GPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return free_bytes(device) + live_cache_bytes(device)


def reserve_bytes(reserve, device: torch.device, total: int) -> int:
    """``memory_reserve`` in bytes: None (the default for the device type), a fraction of ``total``
    in [0, 1), or a number of bytes."""
    if reserve is None:
        reserve = DEFAULT_RESERVE[device.type]
    # numpy's scalars count (np.int64(10**9) is a number of bytes); an integer is bytes, a float a
    # fraction, so 1 is one byte and 1.0 is refused (all of the device).
    integral = isinstance(reserve, numbers.Integral) and not isinstance(reserve, (bool, np.bool_))
    fraction = isinstance(reserve, numbers.Real) and not integral and not isinstance(reserve, (bool, np.bool_))
    if not (integral and reserve >= 0) and not (fraction and 0 <= reserve < 1):
        raise ValueError(f"memory_reserve must be a fraction of the device's memory in [0, 1) (a float) or a "
                         f"number of bytes >= 0 (an integer), got {reserve!r}")
    return int(total * float(reserve)) if fraction else int(reserve)


def live_cache_bytes(device: torch.device, exclude=None) -> int:
    """Bytes held on ``device`` by this process's live memory-backend caches."""
    return sum(m.footprint for m in list(_LIVE) if m is not exclude and m.device == device)


class Budget(NamedTuple):
    """What a new cache may use on a device, and where the number comes from (for the error)."""

    device: torch.device
    total: int
    reserve: int
    live: int      # held by other live memory caches of this process
    free: int      # allocatable right now (GPU: other processes, the model already loaded; host: MemAvailable)

    @property
    def stable(self) -> int:
        """total - reserve - live caches: equal on every rank of a job on identical GPUs."""
        return max(0, self.total - self.reserve - self.live)

    @property
    def limit(self) -> int:
        """What the cache may use now."""
        # On a GPU the cache must also be allocatable now: free memory caps the stable budget (other
        # processes, the model already loaded). On the host "total" is derived from the free RAM already.
        return min(self.stable, self.free) if self.device.type == "cuda" else self.stable

    def explain(self) -> str:
        """Where ``limit`` comes from, for the CacheDoesNotFit message."""
        if self.device.type == "cuda":
            pool = f"GPU {self.device} allows {self.limit} bytes ({_fmt(self.limit)}): {self.total} bytes " \
                   f"({_fmt(self.total)}) in total"
        else:
            pool = (f"host RAM allows {self.limit} bytes ({_fmt(self.limit)}): {self.free} bytes "
                    f"({_fmt(self.free)}) available plus {self.total - self.free} bytes held by this process's "
                    f"memory caches")
        text = (f"the {pool}, minus the memory_reserve of {self.reserve} bytes ({_fmt(self.reserve)}) kept "
                f"for the model and activations, minus {self.live} bytes ({_fmt(self.live)}) held by other "
                f"live memory caches of this process")
        if self.device.type == "cuda" and self.free < self.stable:
            text += f", and only {self.free} bytes ({_fmt(self.free)}) are free now"
        return text


def budget(device: torch.device, reserve=None, exclude=None) -> Budget:
    """What a new cache may use on ``device`` (``exclude``: a loader whose own cache is not counted)."""
    total, free = total_bytes(device), free_bytes(device)
    return Budget(device, total, reserve_bytes(reserve, device, total), live_cache_bytes(device, exclude), free)


def recipe(source, config) -> Augmentation:
    """The augmentation a loader made with ``config`` applies to ``source``."""
    return config.augment if config.augment is not None else source.default_augmentation(config.train)


def photo_side(aug: Augmentation, cache_size: int) -> int:
    """Side of the square slots photos are cached in: the evaluation crop (``center``) is cached
    already applied, at ``size``; any other recipe caches each photo whole, longer side <= cache_size."""
    return aug.size if aug.crop is Crop.CENTER else cache_size


def cache_bytes(source, config) -> int:
    """Bytes of the uint8 cache for ``source`` (new allocation only: an array on the CPU is shared)."""
    aug = recipe(source, config)
    if source.kind is SourceKind.ARRAY:
        if aug.crop is Crop.TRANSLATE:  # kept pre-padded (see MemoryLoader), on any device
            n, h, w, c = source.images.shape
            return n * (h + 2 * aug.pad) * (w + 2 * aug.pad) * c
        return 0 if config.device.type == "cpu" else source.images.nbytes
    side = photo_side(aug, config.cache_size)
    return len(source) * side * side * 3


def pad_images(x: torch.Tensor, pad: int, padding: Padding) -> torch.Tensor:
    """uint8 or float (N, H, W, C) → (N, H + 2 pad, W + 2 pad, C) padded as ``np.pad`` pads with
    ``mode=padding`` ("constant" zeros, "reflect", "edge"), on x's device.

    Reflection and edge padding are a gather by the index map ``np.pad(arange(H), pad, mode)``: the
    same map numpy applies to the pixels, so the torch backend's crops come out identical, and it is
    defined for any pad (torch's reflection pad refuses a pad as wide as the image; numpy reflects
    again) and any dtype.
    """
    if padding is Padding.CONSTANT:
        return F.pad(x, (0, 0, pad, pad, pad, pad))   # zero = black border
    _, h, w, _ = x.shape
    mode = NUMPY_PAD_MODE[padding]
    rows = torch.from_numpy(np.pad(np.arange(h), pad, mode=mode)).to(x.device)
    cols = torch.from_numpy(np.pad(np.arange(w), pad, mode=mode)).to(x.device)
    return x.index_select(1, rows).index_select(2, cols)


def _chunks(n: int, per_item: int, limit: int = 64 * 2**20):
    """Ranges of at most ``limit`` bytes' worth of items: bounded temporaries while converting."""
    step = max(1, limit // max(per_item, 1))
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def load_whole(data: bytes, path, side: int) -> tuple[np.ndarray, int, int]:
    """One photo, whole, as uint8 (h, w, 3) with its longer side at most ``side`` (aspect kept; a
    smaller photo is kept as it is), and its original (H, W) after EXIF orientation, the size the
    recipe's boxes are drawn from. ``data``: the file's bytes (``Source.read``); ``path`` names it.
    Errors are the DecodeErrors ``transforms.load_photo`` raises.

    JPEGs decode at a reduced scale (``Image.draft``) when the target allows; the drafted image is
    resized from the exact region that covers the original (drafted sizes round up to whole blocks).
    """
    from PIL import Image

    img = open_image(path, io.BytesIO(data))
    try:
        orientation = exif_orientation(img, path)
        swap = orientation in (5, 6, 7, 8)
        stored_w = img.width
        W, H = (img.height, img.width) if swap else img.size
        h, w = whole_size(H, W, side)
        if (h, w) != (H, W) and img.format in JPEG_FORMATS:
            img.draft("RGB", (h, w) if swap else (w, h))   # draft works in stored orientation
        reduction = 2 ** round(math.log2(stored_w / img.width)) if img.width < stored_w else 1
        img = decode_upright(img, path, orientation)
        if img.size != (w, h):
            img = img.resize((w, h), Image.BILINEAR, box=(0, 0, W / reduction, H / reduction))
        return np.asarray(img), H, W
    finally:
        img.close()


class WholePhotos(Dataset):
    """A DataLoader "dataset" of cache chunks: job ``ids`` → ``(uint8 (k, side, side, 3), each photo
    top-left and zero around it; int64 (k, 4) (H, W, h, w): original and cached sizes; kept ids)``.
    Files that fail are skipped with ``on_error="skip"`` (the ids kept say which)."""

    def __init__(self, source, side: int, on_error: str = "raise"):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
        self.source, self.side, self.on_error = source, side, on_error

    def __len__(self):  # jobs come from the sampler; a length keeps DataLoader's bookkeeping happy
        return len(self.source)

    def __getitem__(self, ids):
        s = self.side
        out = torch.empty((len(ids), s, s, 3), dtype=torch.uint8)
        sizes = np.zeros((len(ids), 4), dtype=np.int64)
        ok = self.decode_rows(ids, out, sizes)
        kept = [int(i) for i in np.asarray(ids)[ok]]
        # The kept photos first, in order (a no-op without skips): the chunk's rows are contiguous.
        good = torch.from_numpy(np.flatnonzero(ok))
        return out[good] if len(kept) < len(ids) else out, torch.from_numpy(sizes[ok]), kept

    def decode_rows(self, ids, rows: torch.Tensor, sizes: np.ndarray) -> np.ndarray:
        """Decode files ``ids`` straight into ``rows`` (uint8 (k, side, side, 3) on the CPU, e.g. the
        cache's own rows): each photo top-left, zeros around it, and its (H, W, h, w) into ``sizes``
        (int64 (k, 4)). Returns a bool (k,): which decoded; a skipped file's row is left as it was
        (on_error="skip"), a DecodeError propagates with on_error="raise"."""
        ok = np.zeros(len(ids), dtype=bool)
        rows = rows.numpy()   # numpy's copies into a slot's sub-rectangle: far cheaper than torch's
        for j, i in enumerate(ids):
            try:
                arr, H, W = load_whole(self.source.read(i), self.source.sample_name(i), self.side)
            except DecodeError:
                if self.on_error == "raise":
                    raise
                continue
            h, w = arr.shape[:2]
            place(rows[j], arr)
            sizes[j] = (H, W, h, w)
            ok[j] = True
        return ok


def place(row: np.ndarray, arr: np.ndarray) -> None:
    """Write a (h, w, 3) photo top-left into a cache slot (s, s, 3) and zero the rest of it: the slot
    is written once, with no zeroed temporary (rows of a fresh cache are whatever memory held)."""
    h, w = arr.shape[:2]
    row[:h, :w] = arr
    row[:h, w:] = 0
    row[h:] = 0


def _compact(out: torch.Tensor, ok: np.ndarray, sizes: np.ndarray, lo: int, *, applied: bool):
    """Close the gaps skipped files left in ``out``'s rows (each kept row moves to the front, in order;
    a no-op without skips); return (kept ids, their sizes, or an empty (0, 4) for the applied recipe)."""
    good = np.flatnonzero(ok)
    moved = np.flatnonzero(good != np.arange(len(good)))
    for j in moved:   # good[j] >= j: a row is read before anything is written over it
        out[j] = out[int(good[j])]
    kept = (lo + good).astype(np.int64)
    return kept, (np.empty((0, 4), dtype=np.int64) if applied else sizes[good])


#: The ``cache_build`` choices (see MemoryLoader).
CACHE_BUILDS = ("auto", "threads", "processes", "nvimgcodec")


def _nvimgcodec():
    """nvImageCodec's module, or None where it is not installed (it comes with DALI)."""
    try:
        from nvidia import nvimgcodec  # optional
    except Exception:   # ImportError, or a broken install's missing shared library
        return None
    return nvimgcodec


def whole_size(H: int, W: int, side: int) -> tuple[int, int]:
    """(h, w) of a photo (H, W) cached whole: aspect kept, longer side at most ``side``, never enlarged."""
    r = min(1.0, side / max(H, W))
    return max(1, round(H * r)), max(1, round(W * r))


#: The largest shrink per axis one antialiased ``F.interpolate`` does on CUDA (``resize_whole``): its
#: kernel keeps each output pixel's filter weights in shared memory, and past ~94x per axis it fails
#: with "Too much shared memory required" (a 30,000-px panorama cached at 256). 16x leaves a wide margin.
MAX_CUDA_SHRINK = 16


def shrink_steps(src: tuple[int, int], dst: tuple[int, int], max_shrink: int | None) -> list[tuple[int, int]]:
    """The sizes an antialiased resize from ``src`` (h, w) to ``dst`` passes through, ``dst`` last: each
    step shrinks an axis by at most ``max_shrink`` (None: one step). Intermediate sizes are the
    largest such shrinks (ceil(size / max_shrink)), so the last step does what is left."""
    if max_shrink is None or max_shrink < 2:
        return [tuple(dst)]
    steps, cur = [], tuple(src)
    while True:
        nxt = tuple(max(d, -(-c // max_shrink)) for c, d in zip(cur, dst))
        if nxt == tuple(dst) or nxt == cur:
            steps.append(tuple(dst))
            return steps
        steps.append(nxt)
        cur = nxt


def resize_whole(t: torch.Tensor, side: int, *, via_float: bool | None = None,
                 max_shrink: int | None = None) -> torch.Tensor:
    """uint8 (H, W, 3) → uint8 (h, w, 3) at ``whole_size``, on t's device, bilinear with antialiasing:
    PIL's BILINEAR filter (a triangle widened by the reduction). On the CPU torch resizes uint8 directly,
    with PIL's integer arithmetic: PIL's pixels exactly (tested). On CUDA it resizes in float and rounds
    (``via_float``, its default there: the uint8 path measured here is the CPU kernel's), within 1 of
    PIL's pixels (tested on the CPU with via_float=True).

    ``max_shrink`` (default on CUDA: ``MAX_CUDA_SHRINK``; the CPU has no such limit) splits a larger
    shrink into steps (``shrink_steps``), in float without rounding between them: close to one step's
    pixels (a slightly wider filter), where one step would abort the whole cache build."""
    H, W = t.shape[:2]
    h, w = whole_size(H, W, side)
    if (h, w) == (H, W):
        return t
    via_float = t.is_cuda if via_float is None else via_float
    steps = shrink_steps((H, W), (h, w), MAX_CUDA_SHRINK if max_shrink is None and t.is_cuda else max_shrink)
    x = t.permute(2, 0, 1)[None]
    if not via_float and len(steps) == 1:
        return F.interpolate(x, size=(h, w), mode="bilinear", antialias=True, align_corners=False)[0].permute(1, 2, 0)
    y = x.float()
    for size in steps:
        y = F.interpolate(y, size=size, mode="bilinear", antialias=True, align_corners=False)
    return y[0].round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0)


def read_ahead(items, read, *, ahead: int = 1, name: str = "fastdata-read"):
    """``(item, read(item))`` for each of ``items`` in order, with ``read`` of the next ``ahead`` items
    running on one host thread while the caller works on the current one: the GPU cache build reads
    the next group's files while this group decodes. An error of ``read`` is raised at its item.
    Leaving early (an error in the caller's work, ``close()``) cancels the reads not started and
    waits for the one running (one group's files: bounded)."""
    import collections
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
        raise ValueError(f"ahead must be an integer >= 1, got {ahead!r}")
    items = iter(items)
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    pending = collections.deque((item, pool.submit(read, item)) for item in itertools.islice(items, ahead))
    try:
        while pending:
            item, future = pending.popleft()
            # The next read is queued before this one is waited for: it runs while the caller works.
            pending.extend((nxt, pool.submit(read, nxt)) for nxt in itertools.islice(items, 1))
            yield item, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class NvWholeDecoder:
    """Whole photos decoded by nvImageCodec in batches, written into cache rows (``WholePhotos``'s
    ``decode_rows``, for ``cache_build="nvimgcodec"``).

    On CUDA: one batch call decodes the JPEGs on the loader's GPU (hardware decoder or nvJPEG,
    whichever nvImageCodec picks) into device memory, where each photo is resized (``resize_whole``) and
    written into its row: no decoded pixel crosses PCIe. On the CPU: nvImageCodec's CPU (libjpeg-turbo)
    backend decodes the photos smaller than twice the cached side (the larger ones PIL decodes at a
    reduced scale, see ``load_whole``), PIL resizes: the "threads" build's pixels exactly (tested).
    EXIF orientation is applied by the decoder. Anything it does not take (not a JPEG, CMYK, 16-bit,
    beyond the decompression-bomb limit, unreadable, or failing to decode) goes through ``load_whole``
    instead: the "threads" build's pixels for those files, and the same DecodeError naming a broken one.

    Args:
        photos: the ``WholePhotos`` (source, side, on_error).
        device: where the rows are (the loader's device).
    """

    #: Files per job: enough to fill the GPU decoder's batch.
    batch = 64
    #: Decoded bytes per decode call at most: 64 ImageNet photos take ~35 MB, 64 12-megapixel photos
    #: would take 2.3 GB of the GPU the cache lives on, so calls are split by the headers' sizes.
    max_call_bytes = 256 * 2**20

    def _groups(self, streams) -> list[list[int]]:
        """Indices into ``streams`` in consecutive groups of at most ``max_call_bytes`` decoded (a photo
        larger than that alone)."""
        groups, size = [], 0
        for k, cs in enumerate(streams):
            nbytes = cs.width * cs.height * 3
            if groups and size + nbytes <= self.max_call_bytes:
                groups[-1].append(k)
                size += nbytes
            else:
                groups.append([k])
                size = nbytes
        return groups

    def __init__(self, photos: WholePhotos, device: torch.device):
        nv = _nvimgcodec()
        if nv is None:
            from ..region import INSTALL_HINT

            raise ImportError(f"memory backend: cache_build='nvimgcodec' needs nvImageCodec; {INSTALL_HINT}")
        self.nv, self.photos, self.device = nv, photos, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            # Every backend allowed: the hardware JPEG decoder (A100/H100), nvJPEG on CUDA, and the CPU
            # for what they refuse; output on this GPU.
            self.decoder = nv.Decoder(device_id=index)
        else:
            # fancy_upsampling: libjpeg's (and Pillow's) default chroma upsampling, set explicitly.
            self.decoder = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                      backends=[nv.Backend(nv.BackendKind.CPU_ONLY)],
                                      options="libjpeg_turbo_decoder:fancy_upsampling=1")
        self.params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.ColorSpec.SRGB,
                                      sample_format=nv.SampleFormat.I_RGB)
        #: CUDA: the last group's decoded photos and the event after the GPU work that reads them (see
        #: _release), kept while the next group is decoded.
        self._held = None

    def read(self, ids) -> list:
        """The files' bytes (None for one that cannot be read: ``load_whole`` then names the problem):
        the host's part of ``decode_rows``, which a caller may do ahead on another thread."""
        source, out = self.photos.source, []
        for i in ids:
            try:
                out.append(source.read(i))
            except DecodeError:
                out.append(None)
        return out

    def _stream(self, data):
        """nvImageCodec's parsed header of a file's bytes, or None when it is not one it should decode."""
        from PIL import Image

        if data is None:
            return None
        try:
            cs = self.nv.CodeStream(data)
            limit = Image.MAX_IMAGE_PIXELS
            ok = (cs.codec_name == "jpeg" and cs.num_channels in (1, 3) and cs.precision == 8
                  and not (limit and cs.width * cs.height > limit))
            # On the CPU a photo at least twice the cached side goes to PIL: Image.draft decodes it at
            # 1/2, 1/4 or 1/8 scale, which nvImageCodec 0.9 cannot (no DCT scaling), for less work.
            ok = ok and (self.cuda or max(cs.width, cs.height) < 2 * self.photos.side)
        except (OSError, RuntimeError):   # unreadable, or not an image it parses: load_whole names why
            return None
        return cs if ok else None

    def _pixels(self, img):
        """(H, W, 3) uint8 of a decoded image: on the GPU a tensor viewing its device memory, else a
        numpy array; None where nvImageCodec gave up on the file."""
        if img is None:
            return None
        if self.cuda and img.buffer_kind == self.nv.ImageBufferKind.STRIDED_DEVICE:
            return torch.as_tensor(img, device=self.device)   # __cuda_array_interface__: no copy
        return np.asarray(img.cpu())

    def _release(self) -> None:
        """Drop the decoded photos held since the last group, once the GPU work reading them is done.

        Which stream nvImageCodec 0.9 frees an Image's buffer on is not documented (Image.cuda_stream
        is the decode's, torch's current one, but the Python binding does not say it frees there), so
        the photos go only after the event recorded behind their resizes and row copies. Waited for
        after the NEXT group's decode is queued: the host reads, parses and queues group k+1 while the
        GPU still works on group k (a stream synchronize per group serialized them), for at most two
        groups' photos (2 x ``max_call_bytes``) on the GPU at once."""
        if self._held is not None:
            images, done = self._held
            self._held = None
            done.synchronize()
            del images

    def flush(self) -> None:
        """Release what ``decode_rows(..., hold=True)`` kept (see ``_release``); call it at the end."""
        self._release()

    def decode_rows(self, ids, rows: torch.Tensor, sizes: np.ndarray, data: list | None = None, *,
                    hold: bool = False) -> np.ndarray:
        """As ``WholePhotos.decode_rows``, into torch rows on the decoder's device. ``data``: the files'
        bytes already read (``read``), else read here. ``hold`` (CUDA): keep the last group's decoded
        photos until the next call or ``flush()`` instead of waiting for its GPU work here."""
        from PIL import Image

        source, side = self.photos.source, self.photos.side
        data = self.read(ids) if data is None else data
        streams, where, fallback = [], [], []
        for j, cs in enumerate(map(self._stream, data)):
            if cs is None:
                fallback.append(j)
            else:
                streams.append(cs)
                where.append(j)
        # The decode is ordered before the resizes on the current stream (the one torch's kernels use).
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.cuda else 0
        ok = np.zeros(len(ids), dtype=bool)
        # On the CPU the rows are written through numpy: torch's strided uint8 copies into a slot's
        # sub-rectangle measured ~20 ms a photo here, numpy's well under 1 ms.
        host = rows if rows.is_cuda else rows.numpy()
        try:
            for group in self._groups(streams):
                images = self.decoder.decode([streams[k] for k in group], params=self.params, cuda_stream=stream)
                self._release()   # the previous group's photos: this decode is queued behind its work
                for k, img in zip(group, images, strict=True):
                    j, t = where[k], self._pixels(img)
                    if t is None or t.ndim != 3 or t.shape[2] != 3:
                        fallback.append(j)   # nvImageCodec gave up on it: PIL decodes it or names the problem
                        continue
                    H, W = t.shape[:2]
                    if isinstance(t, torch.Tensor):
                        small = resize_whole(t, side)
                    else:   # PIL's resize: measured as fast as torch's uint8 one here, the same pixels
                        h, w = whole_size(H, W, side)
                        small = t if (h, w) == (H, W) else \
                            np.asarray(Image.fromarray(t).resize((w, h), Image.BILINEAR))
                    place(host[j], small)
                    sizes[j] = (H, W, *small.shape[:2])
                    ok[j] = True
                # No view of a decoded photo may outlive its group (a tensor keeps its Image alive): the
                # photos go in _release, after their event, and nowhere else.
                img = t = small = None
                if self.cuda:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(self.device))
                    self._held = (images, done)
                del images
        finally:
            if not hold:
                self._release()
        for j in sorted(fallback):
            try:
                i = ids[j]
                raw = source.read(i) if data[j] is None else data[j]   # None: unreadable, read again to name why
                arr, H, W = load_whole(raw, source.sample_name(i), side)
            except DecodeError:
                if self.photos.on_error == "raise":
                    raise
                continue
            place(host[j], torch.from_numpy(arr.copy()).to(rows.device) if rows.is_cuda else arr)
            sizes[j] = (H, W, *arr.shape[:2])
            ok[j] = True
        return ok


def ready_bytes(source, config, aug) -> int:
    """Bytes of an array source cached already normalized (padded for translation) in the output dtype."""
    n, h, w, c = source.images.shape
    p = aug.pad if aug.crop is Crop.TRANSLATE else 0
    return n * (h + 2 * p) * (w + 2 * p) * c * config.dtype.itemsize


def uses_ready(source, config, aug, limit: int) -> bool:
    """Whether an array source is cached already normalized (``ready``: a batch is one gather, measured
    1.3-3.6x the uint8 path's rate on 32² and 64² RGB arrays here) rather than as uint8. It costs the
    output dtype's bytes (4x uint8's in float32), so it is taken only when it needs at most half the
    budget: the other half stays free for the model and the training. ``fits`` reports this choice's
    bytes, the ones allocated."""
    return (source.kind is SourceKind.ARRAY and not aug.crop.resamples
            and ready_bytes(source, config, aug) <= limit // 2)


def check_fits(source, config, reserve=None, copies: int = 1) -> Budget:
    """Raise CacheDoesNotFit, naming both sizes and the budget's parts, if the uint8 cache does not fit.

    ``copies``: caches of this size the device's memory must hold at once: 1 for a cache of one
    process, and for the one shared copy of a node's ranks on the host; k for the host copies of k ranks
    of a node that cannot share one (no room in /dev/shm). Each rank then checks its 1/k share."""
    one, b = cache_bytes(source, config), budget(config.device, reserve)
    need = one * copies
    if need > b.limit:
        copies_text = f" ({copies} copies, one per rank of this node)" if copies > 1 else ""
        raise CacheDoesNotFit(
            f"memory backend: caching {source!r} needs {need} bytes ({_fmt(need)}){copies_text} but {b.explain()}; "
            f"pass memory_reserve=<bytes or fraction of the device> to change the reserve, or use the "
            f"'torch', 'prefetch' or 'dali' backend, or a smaller cache_size")
    return b


class _Epoch(NamedTuple):
    """One epoch's sample ids and augmentation parameters, on the device, for slicing per batch."""

    bounds: list            # (start, end) of each batch in the flat tensors below
    ids: torch.Tensor       # int64 (samples,)
    off: torch.Tensor | None    # int64 (samples, 2) translation offsets
    flip: torch.Tensor | None   # bool (samples,)
    lin: torch.Tensor | None    # float32 (samples, 6) resized crops: see MemoryLoader._sampling
    exact: list             # per batch: (top, left) when its crop is an exact slice, else None
    pinned: tuple           # the pinned host buffers, alive until the epoch ends (see prepare_epoch)


class MemoryLoader(Loader):
    """The whole source cached as one uint8 (N, H, W, C) tensor on the device.

    Options:
        cache_build: how photos are decoded into the cache: "threads" (threads writing straight into
            the cache's rows; PIL's decode and resize release the GIL), "processes" (DataLoader worker
            processes sending chunks through shared memory: the build before issue 13), "nvimgcodec"
            (nvImageCodec in batches: nvJPEG on the loader's GPU into device memory, resized there;
            its CPU backend on the CPU, PIL for photos Image.draft can shrink), or "auto" (default):
            "nvimgcodec" on a CUDA device where nvImageCodec is installed, else "threads". The
            evaluation recipe (cached through the torch backend's decoding) is built by "threads"
            under either.
        cache_workers: threads (or processes) that decode photos into the cache (default: the usable
            cores for threads, num_workers for processes; 0: the calling thread).
        memory_reserve: memory the cache must leave for the model, its activations and the batch being
            augmented: a fraction in [0, 1) (of a GPU's total memory; of the host's available RAM) or a
            number of bytes. Default: 0.25 on a GPU, 0.2 on the CPU. Other live memory caches of the
            process (e.g. the training cache, for the evaluation one) count against the same budget.
        node_cache: under a process group, the ranks of a node decode a photo cache together, each file
            once per node, and share it (one /dev/shm copy per node on the CPU, an all-gather between the
            GPUs on CUDA). Building the loader is then a call every rank makes, as for DDP (also
            ``node_group``'s first call, collective over the job). False: every rank decodes and caches
            everything itself (no collective; a loader only some ranks build).
    """

    name = "memory"
    reads = frozenset({SourceKind.ARRAY, SourceKind.FILES})   # a torch Dataset is not cached (yet)
    options = {"cache_build": "auto", "cache_workers": None, "memory_reserve": None, "node_cache": True}

    @classmethod
    def fits(cls, source, config, options=None, *, stable=False):
        """Fits when the source's uint8 cache fits the budget (see the module docstring).

        The need is one cache: under a process group the ranks of a node share one host copy (see
        ``node_cache``), and each GPU holds its own. ``stable``: budget against the device's total
        memory minus the reserve and this process's live caches only — equal on every rank of a job
        without a process group, where free memory (which differs with what each rank has allocated so
        far) would let ranks pick different backends.
        """
        ok, why = super().fits(source, config, options, stable=stable)
        if not ok:
            return ok, why
        reserve = (options or {}).get("memory_reserve")
        need, b = cache_bytes(source, config), budget(config.device, reserve)
        limit = b.stable if stable else b.limit
        where = f"GPU {config.device}" if config.device.type == "cuda" else "RAM"
        aug = recipe(source, config)
        if uses_ready(source, config, aug, limit):
            ready = ready_bytes(source, config, aug)
            dtype = str(config.dtype).replace("torch.", "")
            return True, (f"its cache, normalized ahead in {dtype} ({_fmt(ready)}, a batch is one "
                          f"gather), fits in half the free {where} ({_fmt(limit // 2)} of {_fmt(limit)} after "
                          f"the memory_reserve and other caches)")
        if need == 0:  # an array on the CPU, read where it is: nothing to allocate
            return True, f"it reads the source's array in {where} as it is (no copy to make)"
        if need <= limit:
            return True, (f"its uint8 cache ({_fmt(need)}) fits in the free {where} "
                          f"({_fmt(limit)} after the memory_reserve and other caches)")
        return False, (f"the cache ({_fmt(need)}) does not fit in the free {where} ({_fmt(limit)} after "
                       f"the memory_reserve and other caches)")

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        self.footprint = 0          # bytes this loader holds on its device (for the shared budget)
        self.cache = self.ready = self._shifted = None
        self._scratch = None        # CPU: resized crops' float input, reused batch to batch (_float_slots)
        #: The /dev/shm file a node's shared host cache was made in (already unlinked: the ranks'
        #: mappings hold the memory until the last one closes); None for a cache of this process only.
        self.shared_path = None
        aug = self.augment
        if source.kind is SourceKind.FILES:
            require_fixed_size(source, aug)   # the torch backend's error, before any decoding
        # (group, local rank, ranks on this node) while the node builds one cache together, else None.
        self._node = self._node_ranks()
        reserve = self.opts["memory_reserve"]
        if self._node is None:
            check_fits(source, config, reserve)  # before any allocation
        else:   # every rank of the node raises, or none does (its peers would wait in the next collective)
            self._agree(lambda: check_fits(source, config, reserve))
        _LIVE.add(self)
        p = aug.pad if aug.crop is Crop.TRANSLATE else 0
        # Per cache slot, on the host: the (H, W) boxes are drawn from and the (h, w) of the pixels
        # cached for it (photos: a whole photo, top-left in its slot); None: every slot is the
        # cache's (H, W).
        self._sizes = None
        # Photos under the evaluation recipe: the slots hold the recipe's output, only flips remain.
        self._applied = source.kind is SourceKind.FILES and aug.crop is Crop.CENTER
        if source.kind is SourceKind.ARRAY:
            with warnings.catch_warnings():
                # A read-only array (np.load(mmap_mode="r"), MNIST's IDX bytes) is shared too: the
                # cache is only read (gathers, and the padded or normalized copies made from it).
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                cache = torch.from_numpy(source.images)      # shares the array's memory on the CPU
            labels = torch.from_numpy(source.labels)
            self.kept = None
        else:
            cache, labels = self._decode_files()             # already on the device
        self.labels = labels.to(self.device)
        if aug.crop.resamples and not self._applied:
            # The output's pixel steps (see _resized_crops), made once: a batch then creates no tensor
            # from host data.
            self._steps = torch.arange(aug.size, dtype=torch.float32, device=self.device)
        if uses_ready(source, config, aug, budget(self.device, reserve, self).limit):
            # Arrays (digits, CIFAR): cache them already normalized, padded for the translation, in the
            # output dtype. A batch is then one gather from a strided view of every shifted copy, with
            # no per-batch conversion — the same work as gathering ready float batches. It costs 4x
            # the bytes of uint8 (245 MB for 60,000 MNIST digits in float32); when that needs more
            # than half the budget, the uint8 path below runs instead.
            self.ready = self._build_ready(cache)
            self.footprint = self._owned_bytes()
            return
        if p:
            # Pad the cache once (zeros, reflection or edge, as the recipe says): then gathering a
            # batch, padding it and cropping each sample at its offset is a single `take` of
            # precomputed flat indices (measured on the CPU: ~3x faster than a gather, a pad and an
            # advanced-indexing crop per batch). The padded tensor is allocated on the device and
            # filled chunk by chunk: no second full copy.
            n, h, w, c = cache.shape
            hp, wp = h + 2 * p, w + 2 * p
            dev = self.device
            padded = torch.empty((n, hp, wp, c), dtype=torch.uint8, device=dev)
            for a, b in _chunks(n, hp * wp * c):
                padded[a:b] = pad_images(cache[a:b].to(dev), p, aug.padding)
            self.cache = padded
            self._pixel = ((torch.arange(h, device=dev) * wp * c)[:, None, None]
                           + (torch.arange(w, device=dev) * c)[None, :, None]
                           + torch.arange(c, device=dev)[None, None, :])[None]      # (1, h, w, c)
            self._strides = (hp * wp * c, wp * c, c)
        else:
            self.cache = cache.to(self.device)
        self.footprint = self._owned_bytes()
        if self.kept is not None and len(self.kept) != len(source):
            # on_error="skip" dropped files at cache time: the epoch covers the decodable ones.
            self.plan = EpochPlan(len(self.kept), config.batch_size, config.shuffle, config.drop_last,
                                  config.seed, self.plan.rank, self.plan.world_size)
            if len(self.plan) == 0:
                raise ValueError(f"only {len(self.kept)} decodable files remain, fewer than one batch")

    def _owned_bytes(self) -> int:
        """Bytes of the tensors this loader allocated (an array source shared on the CPU is not one)."""
        shared = self.source.images.ctypes.data if self.source.kind is SourceKind.ARRAY else None
        seen, total = set(), 0
        for t in (self.cache, self.ready, self.labels, getattr(self, "_pixel", None)):
            if t is None:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen or (t.device.type == "cpu" and st.data_ptr() == shared):
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    def _build_ready(self, cache: torch.Tensor) -> torch.Tensor:
        aug = self.augment
        p = aug.pad if aug.crop is Crop.TRANSLATE else 0
        n, h, w, c = cache.shape
        fmt = torch.channels_last if self.config.channels_last else torch.contiguous_format
        ready = torch.empty((n, c, h + 2 * p, w + 2 * p), dtype=self.config.dtype, device=self.device,
                            memory_format=fmt)
        for a, b in _chunks(n, (h + 2 * p) * (w + 2 * p) * c * 4):  # bounded temporaries
            part = cache[a:b].to(self.device)
            ready[a:b] = self.normalize(pad_images(part, p, aug.padding) if p else part)
        if p:
            sn, sc, sh, sw = ready.stride()
            # view[i, dy, dx] is sample i shifted by (dy - p, dx - p): no copy until the gather.
            self._shifted = ready.as_strided((n, 2 * p + 1, 2 * p + 1, c, h, w), (sn, sh, sw, sc, sh, sw))
        return ready

    # Files per decoding job; the host holds at most a few of these at a time (see _decode_into).
    _CHUNK = 64

    def _decode_files(self):
        """Decode every file once, in parallel, chunk by chunk straight into the cache on the device
        (DataLoader workers do the decoding). Training recipes: each photo whole at a longer side of at
        most cache_size (``WholePhotos``); the evaluation recipe: its output (``BatchDecoder``, the torch
        backend's decoding). Files skipped with on_error='skip' leave no gap: the good ones are written
        contiguously. Under a process group the node's ranks share the work (see ``_decode_node``)."""
        aug = self.augment
        s = photo_side(aug, self.config.cache_size)
        if self._applied:
            # Flips are drawn per epoch and applied on the device; the crop itself draws nothing.
            decoder = BatchDecoder(self.source, Augmentation(crop="center", size=aug.size, resize=aug.resize),
                                   self.config.on_error)
        else:
            decoder = WholePhotos(self.source, s, self.config.on_error)
        n = len(self.source)
        if self._node is not None:
            cache, kept, sizes = self._decode_node(decoder, n, s)
        else:
            cache = torch.empty((n, s, s, 3), dtype=torch.uint8, device=self.device)
            kept, sizes = self._decode_into(decoder, cache, 0, n)
        self.kept = kept
        if not self._applied:
            self._sizes = (sizes[:, :2], sizes[:, 2:])
        # Left out of every epoch: loader.skipped reports them each epoch (the one counter and warning).
        self.skipped_at_cache = self._dropped = self.skipped = n - len(self.kept)
        if self.skipped_at_cache:
            cache = cache[:len(kept)]   # a view: the unused tail is only the skipped files' bytes
        return cache, torch.from_numpy(self.source.labels[self.kept])

    def _cache_build(self) -> str:
        """The ``cache_build`` option resolved: "threads", "processes" or "nvimgcodec"."""
        build = self.opts["cache_build"]
        if build not in CACHE_BUILDS:
            raise ValueError(f"memory backend: unknown cache_build {build!r}; choose from {list(CACHE_BUILDS)}")
        if self._applied and build in ("auto", "nvimgcodec"):
            return "threads"    # the evaluation recipe is the torch backend's decoding, exactly
        if build == "auto":
            # On a GPU nvImageCodec takes the decoding off the CPU. On the CPU its libjpeg-turbo build
            # used ~16% fewer CPU seconds than "threads" (same pixels), but paired round by round its
            # wall clock was within noise of it on the shared 2-core machine (0.92-1.41x,
            # benchmarks/results/cache-cpu-2c.md): PIL stays the CPU default, so an optional package
            # does not decide how a CPU cache is built.
            gpu = self.device.type == "cuda" and _nvimgcodec() is not None
            return "nvimgcodec" if gpu else "threads"
        return build

    def _decode_into(self, decoder, out: torch.Tensor, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Decode samples ``lo .. hi-1`` into ``out``'s first rows, the kept ones contiguously; return
        (kept ids, int64 (kept, 4) photo sizes (empty for the applied evaluation recipe))."""
        build = self._cache_build()
        if build in ("threads", "nvimgcodec"):
            return self._decode_threads(decoder, out, lo, hi)
        return self._decode_processes(decoder, out, lo, hi)

    #: Files per thread job: small enough that 2 threads stay busy to the end, large enough that the
    #: job's Python overhead is noise.
    _THREAD_CHUNK = 16

    def _decode_threads(self, decoder, out: torch.Tensor, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``_decode_into`` by threads. On the CPU each thread decodes straight into the cache's rows (no
        chunk tensor, no shared-memory segment, no copy); on a GPU into a per-job host buffer copied to
        the device rows. Why threads: a photo's cost is PIL's decode and resize, which release the GIL,
        and threads need no start-up (forking workers) and no transfer of chunks between processes.
        Files skipped leave gaps that are closed at the end (rows move towards the front, in order)."""
        from concurrent.futures import ThreadPoolExecutor

        n, s = hi - lo, out.shape[1]
        ok = np.zeros(n, dtype=bool)
        sizes = np.zeros((n, 4), dtype=np.int64)
        host = out.device.type == "cpu"

        nv = self._cache_build() == "nvimgcodec"
        local = threading.local()

        def rows_decoder():
            """WholePhotos (stateless), or this thread's NvWholeDecoder (one decoder per thread: its
            thread safety is not documented)."""
            if not nv:
                return decoder
            if getattr(local, "nv", None) is None:
                local.nv = NvWholeDecoder(decoder, out.device)
            return local.nv

        direct = host or nv   # NvWholeDecoder writes rows on the GPU itself

        def job(a: int, b: int) -> None:
            ids = np.arange(lo + a, lo + b)
            rows = out[a:b] if direct else torch.empty((b - a, s, s, 3), dtype=torch.uint8)
            if self._applied:
                images, _, good = decoder[(ids, 0)]
                pos = torch.as_tensor(np.asarray(good, dtype=np.int64) - (lo + a))
                rows[pos] = images
                ok[a + pos.numpy()] = True
            else:
                ok[a:b] = rows_decoder().decode_rows(ids, rows, sizes[a:b])
            if not direct:
                out[a:b].copy_(rows)

        workers = self.opts["cache_workers"]
        workers = len(os.sched_getaffinity(0)) if workers is None else workers
        chunk = self._THREAD_CHUNK
        if nv and out.is_cuda:
            # The GPU decodes a whole batch per call, on this thread; the next batch's files are read on
            # a host thread meanwhile (read_ahead), and the GPU work is ordered by events, not waited
            # for per group (NvWholeDecoder._release).
            chunk = NvWholeDecoder.batch
            gpu = rows_decoder()
            spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
            # closing: a DecodeError's traceback would keep the generator, and its read thread, alive.
            groups = contextlib.closing(read_ahead(spans, lambda span: gpu.read(range(lo + span[0], lo + span[1]))))
            try:
                with groups as files:
                    for (a, b), data in files:
                        ok[a:b] = gpu.decode_rows(np.arange(lo + a, lo + b), out[a:b], sizes[a:b], data, hold=True)
            finally:
                gpu.flush()
            return _compact(out, ok, sizes, lo, applied=self._applied)
        spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
        if workers == 0 or len(spans) <= 1:
            for a, b in spans:
                job(a, b)
        else:
            pool = ThreadPoolExecutor(min(workers, len(spans)), thread_name_prefix="fastdata-cache")
            try:
                futures = [pool.submit(job, a, b) for a, b in spans]
                for f in futures:    # in file order: the first broken file (by position) is the one named
                    f.result()
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        return _compact(out, ok, sizes, lo, applied=self._applied)

    def _decode_processes(self, decoder, out: torch.Tensor, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``_decode_into`` by DataLoader worker processes, chunk by chunk through shared memory."""
        from torch.utils.data import DataLoader

        s, chunk = out.shape[1], self._CHUNK
        jobs = [np.arange(i, min(i + chunk, hi)) for i in range(lo, hi, chunk)]
        if self._applied:
            jobs = [(ids, 0) for ids in jobs]
        workers = self.opts["cache_workers"]
        workers = min(self.config.num_workers if workers is None else workers, len(jobs))
        # Host memory in flight: DataLoader's 2 chunks ahead per worker, plus the chunk being copied.
        host = (2 * max(workers, 1) + 1) * chunk * s * s * 3
        if self.device.type == "cuda" and host > available_ram():
            raise CacheDoesNotFit(f"memory backend: decoding {self.source!r} needs {host} bytes "
                                  f"({_fmt(host)}) of host RAM for its chunks in flight but {_fmt(available_ram())} "
                                  f"is available; pass fewer cache_workers")
        kept, sizes = [], []
        pos = 0
        if jobs:
            # generator=: building the cache must not move the caller's global torch RNG (decoding draws
            # nothing random, so its seed does not matter)
            loader = DataLoader(decoder, batch_size=None, sampler=jobs, num_workers=workers,
                                generator=torch.Generator().manual_seed(0))
            if loader.num_workers:
                collect_before_fork()
            it = iter(loader)
            try:
                for images, extra, good in it:   # good: the chunk's ids that decoded, in the images' order
                    out[pos:pos + len(good)] = images    # a pageable copy; synchronous, at cache time only
                    pos += len(good)
                    kept.append(np.asarray(good, dtype=np.int64))
                    if not self._applied:
                        sizes.append(extra.numpy())
            finally:
                # Shut the decoding workers down now, also after a DecodeError: left to the cyclic GC
                # (the exception's traceback holds the iterator), they stall a later loader for seconds.
                if hasattr(it, "_shutdown_workers"):
                    it._shutdown_workers()
        kept = np.concatenate(kept) if kept else np.empty(0, dtype=np.int64)
        sizes = np.concatenate(sizes) if sizes else np.empty((0, 4), dtype=np.int64)
        return kept, sizes

    # ------------------------------------------------------------------ one cache per node
    def _node_ranks(self):
        """(gloo group, local rank, local world size, data group) when this node's ranks build the cache
        together: files, ``node_cache=True``, a process group with more than one rank on this node.
        Else None.

        The exchanges (budget, skips, errors) and the waits for the slowest rank's decoding run on a
        gloo group of the node, on the host: under nccl such a wait would sit in a GPU collective under
        NCCL's watchdog, and small objects would travel through a GPU. The data group moves the cache:
        the gloo group for a host cache, the job's default backend for a CUDA cache (nccl: the
        all-gather runs GPU to GPU, entered only once every rank is known to be ready)."""
        node_cache = self.opts["node_cache"]
        if not isinstance(node_cache, bool):
            raise TypeError(f"memory backend: node_cache must be True or False, got {node_cache!r}")
        if not node_cache or self.source.kind is not SourceKind.FILES:
            return None
        from .. import distributed as fdist

        if not fdist.is_distributed():
            return None
        with self._collective_device():   # node_group's first call gathers over the default group
            group, local, k = fdist.node_group("gloo")
            data = fdist.node_group()[0] if self.device.type == "cuda" else group
        return (group, local, k, data) if k > 1 else None

    def _collective_device(self):
        """Object collectives on an nccl group travel through the current GPU: make it the loader's."""
        import contextlib

        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _agree(self, step):
        """Run ``step`` on every rank of the node, then raise on every rank if it failed on any: a rank
        that raised alone would leave its peers waiting in the next collective until the process group's
        timeout (30 minutes). Returns ``step``'s result."""
        from .. import distributed as fdist

        result, mine, failure = None, None, None
        try:
            result = step()
        except Exception as e:   # noqa: BLE001 (sent to the peers, then raised again below)
            mine = e
            failure = (type(e).__name__, getattr(e, "path", None), getattr(e, "reason", None), str(e))
        failures = fdist.gather_objects(failure, self._node[0])
        if mine is not None:
            raise mine
        for j, f in enumerate(failures):
            if f is None:
                continue
            kind, path, reason, text = f
            if kind == "DecodeError" and path is not None:
                raise DecodeError(path, f"{reason} (found by local rank {j} while the node's ranks built "
                                        f"the memory cache together)")
            if kind == "CacheDoesNotFit":
                raise CacheDoesNotFit(f"on local rank {j} of this node: {text}")
            raise RuntimeError(f"local rank {j} of this node failed while the node's ranks built the "
                               f"memory cache together: {kind}: {text}")
        return result

    def _decode_node(self, decoder, n: int, s: int):
        """The node's ranks decode the cache together: local rank j of k decodes samples
        ``[j*m, (j+1)*m)`` (m = ceil(n / k)), each sample once per node, then they share the result.

        CPU: into ONE shared-memory file (``fdist.node_shared_tensor``), each rank writing its block;
        every rank maps the whole. CUDA (or no room in /dev/shm): each rank decodes its block into its
        own full-size cache, then an all-gather inside the node fills in the others' blocks (one decode
        per sample per node, one copy per GPU). Skips and errors are exchanged before anything is
        shared: every rank keeps the same files, or every rank raises, naming the file.
        """
        from .. import distributed as fdist

        group, local, k, data = self._node
        m = -(-n // k)
        lo, hi = min(local * m, n), min((local + 1) * m, n)
        slot = s * s * 3
        cache = None
        if self.device.type == "cpu":
            tag = f"memory-{zlib.crc32(self._cache_key().encode()):08x}"
            flat, path, why = fdist.node_shared_tensor(n * slot, group, tag=tag)
            if flat is not None:
                cache, self.shared_path = flat.view(n, s, s, 3), path
            else:
                warnings.warn(f"memory backend: no shared-memory cache for this node ({why}); every rank "
                              f"keeps its own copy of the cache (still decoded once per node). Give "
                              f"/dev/shm room for {_fmt(n * slot)} (docker: --shm-size) to share one",
                              RuntimeWarning, stacklevel=4)
                self._agree(lambda: check_fits(self.source, self.config, self.opts["memory_reserve"], copies=k))
        shared = cache is not None
        if not shared:
            # k blocks of m rows: all_gather's equal blocks; the last one's unused rows go with the tail.
            cache = torch.empty((k * m, s, s, 3), dtype=torch.uint8, device=self.device)
        kept, sizes = self._agree(lambda: self._decode_into(decoder, cache[local * m:local * m + hi - lo], lo, hi))
        parts = fdist.gather_objects((kept, sizes), group)
        counts = [len(p[0]) for p in parts]
        if shared:
            # Local rank 0 closes the gaps skipped files left (a no-op without skips); the others wait,
            # so that no rank reads the cache while it moves.
            if local == 0:
                fdist.compact_blocks(cache, [j * m for j in range(k)], counts)
            fdist.gather_objects(None, group)   # a barrier
        else:
            fdist.gather_blocks(cache, m, data)
            fdist.compact_blocks(cache, [j * m for j in range(k)], counts)
        kept = np.concatenate([p[0] for p in parts])
        sizes = np.concatenate([p[1] for p in parts])
        total = len(kept)
        return cache[:total] if total < cache.shape[0] else cache, kept, sizes

    def _cache_key(self) -> str:
        """The job, the source and the recipe: part of the shared file's name (tells whose it is)."""
        job = os.environ.get("TORCHELASTIC_RUN_ID") or \
            f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        return f"{job}|{self.source.fingerprint()}|{self.augment!r}|{self.config.cache_size}|{self.config.on_error}"

    @property
    def photo_sizes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Photos cached whole: per cache slot, the original (H, W) the recipe's boxes are drawn from,
        and the (h, w) of its cached copy (top-left in the slot); None for other caches."""
        return self._sizes

    # ------------------------------------------------------------------ epochs
    def _epoch(self, epoch, batches, start):
        ep = self.prepare_epoch(epoch, batches, start)
        for k in range(len(ep.bounds)):
            yield self.batch(ep, k)

    def prepare_epoch(self, epoch: int, batches: list, start: int) -> _Epoch:
        """Every batch's ids and augmentation parameters for the epoch, uploaded once.

        Why: they depend only on (seed, epoch, batch), and a per-batch ``torch.from_numpy(...).to(cuda)``
        copies pageable memory, which blocks the host until the training stream reaches the copy: Python
        and the kernel launches of the next step would stop overlapping the GPU every batch. Here the
        epoch's parameters go up in one pinned, non_blocking copy per kind, and a batch is slices and
        device ops only. The draws are the torch backend's (same per-batch rng, same order), so the
        batches stay bit-identical to it for digits.
        """
        aug = self.augment
        bounds, ids, offs, flips, lins, exact = [], [], [], [], [], []
        pos = 0
        # Shifted copies or the evaluation recipe already applied: offsets and flips only.
        simple = self.ready is not None or not aug.crop.resamples or self._applied
        size = self.cache.shape[1:3] if self.cache is not None else self.ready.shape[2:]
        for k, b in enumerate(batches):
            n = len(b)
            # Photos cached whole: boxes from each photo's original size, as the torch backend draws them.
            sizes = self._sizes[0][b] if self._sizes is not None else size
            params = draw_params(aug, self.batch_rng(epoch, start + k), n, sizes)
            if simple:
                if params.offsets is not None:
                    offs.append(params.offsets)
                if aug.hflip > 0:
                    flips.append(params.flips)
                exact.append(None)
            else:
                lin, ex = self._sampling(params, b)
                lins.append(lin)
                exact.append(ex)
            bounds.append((pos, pos + n))
            ids.append(b)
            pos += n
        pinned = []

        def upload(parts, dtype, shape):
            arr = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(shape, dtype)
            t = torch.from_numpy(np.ascontiguousarray(arr))
            if self.device.type != "cuda":
                return t
            # Pinned, so the copy is a DMA that runs on the current stream without blocking the host.
            # The caching host allocator would keep the buffer until the copy's event completes even if
            # it were freed; holding it for the epoch makes that independent of allocator details.
            with torch.cuda.device(self.device):   # the pinning context is the loader's GPU, not cuda:0
                t = t.pin_memory()
            pinned.append(t)
            return t.to(self.device, non_blocking=True)

        return _Epoch(
            bounds=bounds,
            ids=upload(ids, np.int64, (0,)),
            off=upload(offs, np.int64, (0, 2)) if simple and aug.crop is Crop.TRANSLATE else None,
            flip=upload(flips, np.bool_, (0,)) if simple and aug.hflip > 0 else None,
            lin=None if simple else upload(lins, np.float32, (0, 6)),
            exact=exact, pinned=tuple(pinned))

    def batch(self, ep: _Epoch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``k`` of a prepared epoch: slices of its tensors and device ops, no host→device copy."""
        a, b = ep.bounds[k]
        idx = ep.ids[a:b]
        off = ep.off[a:b] if ep.off is not None else None
        flip = ep.flip[a:b] if ep.flip is not None else None
        if self.ready is not None:
            images = self._from_ready(idx, off, flip)
        elif not self.augment.crop.resamples or self._applied:
            images = self._from_uint8(idx, off, flip)
        else:
            images = self._resized_crops(idx, ep.lin[a:b], ep.exact[k])
        return images, self.labels[idx]

    def _from_uint8(self, idx, off, flip) -> torch.Tensor:
        """uint8 cache → normalized float (N, C, h, w): translate and/or flip."""
        if off is not None:
            s_img, s_row, s_col = self._strides
            start = idx * s_img + off[:, 0] * s_row + off[:, 1] * s_col
            x = self.cache.view(-1).take(start[:, None, None, None] + self._pixel)
        else:
            x = self.cache[idx]
        if flip is not None:
            x = torch.where(flip[:, None, None, None], x.flip(2), x)
        return self.normalize(x)

    def _from_ready(self, idx, off, flip) -> torch.Tensor:
        x = self._shifted[idx, off[:, 0], off[:, 1]] if off is not None else self.ready[idx]
        if flip is not None:
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
        if self.config.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _sampling(self, params, ids) -> tuple[np.ndarray, tuple[int, int] | None]:
        """One batch's resized crops as sampling lines in cache pixels, and the exact crop, if any.

        Returns float32 (n, 6) rows ``(ay, by, ax, bx, ymax, xmax)``: output row i samples cache row
        ``ay + by * i`` and output column j column ``ax + bx * j`` (pixel centres; PIL's mapping of a
        resize box), clamped to ``[0, ymax] x [0, xmax]``, the sample's own pixels. The boxes are in
        the source's original pixels (what ``draw_params`` draws from); a photo cached smaller is
        scaled per axis by its cached/original size. A flip runs the columns backwards. ``exact``:
        (top, left) when every box is the same whole-pixel ``size``² window without a flip (an array
        source's center crop without resizing): a slice, no resampling.
        """
        aug, size = self.augment, self.augment.size
        boxes, flips = params.boxes, params.flips
        n = len(flips)
        if self._sizes is not None:
            orig, cached = self._sizes[0][ids], self._sizes[1][ids]
        else:
            orig = cached = np.broadcast_to(np.asarray(self.cache.shape[1:3]), (n, 2))
        sy, sx = cached[:, 0] / orig[:, 0], cached[:, 1] / orig[:, 1]
        top, left, bh, bw = boxes[:, 0] * sy, boxes[:, 1] * sx, boxes[:, 2] * sy, boxes[:, 3] * sx
        exact = None
        if n and self._sizes is None and aug.crop is Crop.CENTER and not flips.any() \
                and np.allclose(boxes[:, 2:], size) and float(top[0]).is_integer() \
                and float(left[0]).is_integer():
            exact = (int(top[0]), int(left[0]))
        step_y, step_x = bh / size, bw / size
        lin = np.empty((n, 6), dtype=np.float64)
        lin[:, 0] = top + 0.5 * step_y - 0.5
        lin[:, 1] = step_y
        lin[:, 2] = np.where(flips, left + bw - 0.5 * step_x, left + 0.5 * step_x) - 0.5
        lin[:, 3] = np.where(flips, -step_x, step_x)
        lin[:, 4] = cached[:, 0] - 1
        lin[:, 5] = cached[:, 1] - 1
        return lin.astype(np.float32), exact

    def _resized_crops(self, idx, lin, exact) -> torch.Tensor:
        """Per-sample boxes cropped and resized in one bilinear grid_sample (or the exact slice).

        The sampling points are clamped to each sample's own pixels before they are normalized over
        the whole slot: a photo's slot is zero beyond its (h, w), and grid_sample's border clamp would
        reach it. (Four uint8 gathers per output pixel instead of a float copy of every slot measured
        2-4x slower on the CPU: torch's CPU gathers are not vectorized; grid_sample is.)
        """
        size = self.augment.size
        if exact is not None:
            t, l = exact
            return self.normalize(self.cache[idx, t:t + size, l:l + size])
        if idx.shape[0] == 0:  # an empty share (drop_last=False, more ranks than samples left)
            return self.normalize(self.cache.new_empty((0, size, size, self.cache.shape[3])))
        n, (hs, ws) = idx.shape[0], self.cache.shape[1:3]
        u = self._steps
        ys = torch.minimum((lin[:, 0:1] + lin[:, 1:2] * u).clamp_(min=0), lin[:, 4:5])   # (n, size)
        xs = torch.minimum((lin[:, 2:3] + lin[:, 3:4] * u).clamp_(min=0), lin[:, 5:6])
        # Pixel centres → grid_sample's coordinates (align_corners=False: the slot's edges at ±1).
        gy, gx = (ys + 0.5) * (2 / hs) - 1, (xs + 0.5) * (2 / ws) - 1
        grid = torch.stack((gx[:, None, :].expand(n, size, size), gy[:, :, None].expand(n, size, size)), -1)
        out = F.grid_sample(self._float_slots(idx), grid, mode="bilinear", padding_mode="border", align_corners=False)
        return self.normalizer.floats(out, inplace=True)   # grid_sample's output is ours alone

    def _float_slots(self, idx) -> torch.Tensor:
        """The batch's cache slots as float (n, C, hs, ws), grid_sample's input.

        On the CPU they are converted into one buffer kept for the loader's life (n x 0.75 MB: 48 MB at
        batch 64), in the cache's NHWC layout, and handed over as a channels-last view: a fresh float
        batch of that size is a new mmap whose page faults cost more than the conversion, and the
        layout change would cost a strided pass (measured per image: 0.54 ms before, 0.32 now, with
        grid_sample 0.05 ms slower on the view). On CUDA the caching allocator reuses memory anyway.
        """
        slots = self.cache[idx]
        if self.device.type != "cpu":
            return slots.permute(0, 3, 1, 2).float()
        buf = self._scratch
        if buf is None or buf.shape[0] < slots.shape[0] or buf.shape[1:] != slots.shape[1:]:
            buf = self._scratch = torch.empty((max(slots.shape[0], 1), *slots.shape[1:]), dtype=torch.float32)
        x = buf[: slots.shape[0]]
        x.copy_(slots)
        return x.permute(0, 3, 1, 2)

    def close(self):
        self.cache = self.ready = self._shifted = self._pixel = self._sizes = self._scratch = None
        self.footprint = 0
        _LIVE.discard(self)
