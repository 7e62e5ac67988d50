"""``memory`` backend: decode once, keep the whole dataset as one uint8 tensor, augment whole batches.

After the one-time cache, an epoch is a permutation, a gather and a few tensor ops per batch — no
processes, no per-sample Python, no host-to-device copy when the cache is on the GPU (airbench's
approach). uint8 keeps the cache at a quarter of float's size: MNIST is 47 MB, 10,000 photos at 256²
are 2 GB.

Photos are cached at a fixed resolution: shorter side resized to ``cache_size`` (256) and
center-cropped to a square. The evaluation recipe (resize 256, center-crop 224) is then exact; the
training RandomResizedCrop samples its box from the cached square instead of the full photo (it loses
the borders of non-square photos; the box statistics are otherwise the same).

The random parameters are drawn on the host with the same numpy code and per-batch seed as the torch
backend, so for digits the two backends produce identical batches. They are drawn for the whole epoch
when it starts and uploaded once (see MemoryLoader.prepare_epoch): a batch costs no host→device copy
and no host sync.

Budget: a cache must fit in the device's total memory minus ``memory_reserve`` (default: a quarter of a
GPU, a fifth of the host's available RAM) minus the other live memory caches of this process, and on a
GPU also in its free memory. Not yet handled: under torchrun every rank decodes and holds the whole
dataset; ranks on one node do not share one host copy, and on the CPU their caches do not see each
other's budget (each process only sees the RAM the others have already taken).
"""
from __future__ import annotations

import os
import weakref
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..config import Augmentation, Crop
from ..datasets import SourceKind
from ..decode import BatchDecoder, collect_before_fork
from ..errors import CacheDoesNotFit
from ..sampling import EpochPlan
from ..transforms import draw_params
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
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or reserve < 0 \
            or (isinstance(reserve, float) and reserve >= 1):
        raise ValueError(f"memory_reserve must be a fraction of the device's memory in [0, 1) or a number "
                         f"of bytes >= 0, got {reserve!r}")
    return int(total * reserve) if isinstance(reserve, float) else int(reserve)


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


def cache_bytes(source, config) -> int:
    """Bytes of the uint8 cache for ``source`` (new allocation only: an array on the CPU is shared)."""
    if source.kind is SourceKind.ARRAY:
        aug = config.augment if config.augment is not None else source.default_augmentation(config.train)
        if aug.crop is Crop.TRANSLATE:  # kept pre-padded (see MemoryLoader), on any device
            n, h, w, c = source.images.shape
            return n * (h + 2 * aug.pad) * (w + 2 * aug.pad) * c
        return 0 if config.device.type == "cpu" else source.images.nbytes
    return len(source) * config.cache_size * config.cache_size * 3


def ready_bytes(source, config, aug) -> int:
    """Bytes of an array source cached already normalized (padded for translation) in the output dtype."""
    n, h, w, c = source.images.shape
    p = aug.pad if aug.crop is Crop.TRANSLATE else 0
    return n * (h + 2 * p) * (w + 2 * p) * c * config.dtype.itemsize


def check_fits(source, config, reserve=None) -> Budget:
    """Raise CacheDoesNotFit, naming both sizes and the budget's parts, if the uint8 cache does not fit."""
    need, b = cache_bytes(source, config), budget(config.device, reserve)
    if need > b.limit:
        raise CacheDoesNotFit(
            f"memory backend: caching {source!r} needs {need} bytes ({_fmt(need)}) but {b.explain()}; "
            f"pass memory_reserve=<bytes or fraction of the device> to change the reserve, or use the "
            f"'torch', 'prefetch' or 'dali' backend, or a smaller cache_size")
    return b


class _Epoch(NamedTuple):
    """One epoch's sample ids and augmentation parameters, on the device, for slicing per batch."""

    bounds: list            # (start, end) of each batch in the flat tensors below
    ids: torch.Tensor       # int64 (samples,)
    off: torch.Tensor | None    # int64 (samples, 2) translation offsets
    flip: torch.Tensor | None   # bool (samples,)
    theta: torch.Tensor | None  # float32 (samples, 2, 3) crop boxes as affine_grid matrices
    exact: list             # per batch: (top, left) when its crop is an exact slice (eval), else None
    pinned: tuple           # the pinned host buffers, alive until the epoch ends (see prepare_epoch)


class MemoryLoader(Loader):
    """The whole source cached as one uint8 (N, H, W, C) tensor on the device.

    Options:
        cache_workers: processes that decode photos into the cache (default: num_workers).
        memory_reserve: memory the cache must leave for the model, its activations and the batch being
            augmented: a fraction in [0, 1) (of a GPU's total memory; of the host's available RAM) or a
            number of bytes. Default: 0.25 on a GPU, 0.2 on the CPU. Other live memory caches of the
            process (e.g. the training cache, for the evaluation one) count against the same budget.
    """

    name = "memory"
    reads = frozenset({SourceKind.ARRAY, SourceKind.FILES})   # a torch Dataset is not cached (yet)
    options = {"cache_workers": None, "memory_reserve": None}

    @classmethod
    def fits(cls, source, config, options=None, *, stable=False):
        """Fits when the source's uint8 cache fits the budget (see the module docstring).

        ``stable``: budget against the device's total memory minus the reserve and this process's
        live caches only — equal on every rank of a job without a process group, where free memory
        (which differs with what each rank has allocated so far) would let ranks pick different backends.
        """
        ok, why = super().fits(source, config, options, stable=stable)
        if not ok:
            return ok, why
        reserve = (options or {}).get("memory_reserve")
        need, b = cache_bytes(source, config), budget(config.device, reserve)
        limit = b.stable if stable else b.limit
        where = f"GPU {config.device}" if config.device.type == "cuda" else "RAM"
        if need <= limit:
            return True, (f"its uint8 cache ({_fmt(need)}) fits in the free {where} "
                          f"({_fmt(limit)} after the memory_reserve and other caches)")
        return False, (f"the cache ({_fmt(need)}) does not fit in the free {where} ({_fmt(limit)} after "
                       f"the memory_reserve and other caches)")

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        self.footprint = 0          # bytes this loader holds on its device (for the shared budget)
        self.cache = self.ready = self._shifted = None
        reserve = self.opts["memory_reserve"]
        check_fits(source, config, reserve)  # before any allocation
        _LIVE.add(self)
        p = self.augment.pad if self.augment.crop is Crop.TRANSLATE else 0
        if source.kind is SourceKind.ARRAY:
            cache = torch.from_numpy(source.images)          # shares the array's memory on the CPU
            labels = torch.from_numpy(source.labels)
            self.kept = None
        else:
            cache, labels = self._decode_files()             # already on the device
        self.labels = labels.to(self.device)
        if source.kind is SourceKind.ARRAY and not self.augment.crop.resamples \
                and ready_bytes(source, config, self.augment) <= budget(self.device, reserve, self).limit:
            # Small images (digits): cache them already normalized, padded for the translation, in the
            # output dtype. A batch is then one gather from a strided view of every shifted copy, with
            # no per-batch conversion — the same work as gathering ready float batches. It costs 4x
            # the bytes of uint8 (245 MB for 60,000 MNIST digits in float32); when that does not fit,
            # the uint8 path below runs instead.
            self.ready = self._build_ready(cache)
            self.footprint = self._owned_bytes()
            return
        if p:
            # Pad the cache once: then gathering a batch, padding it and cropping each sample at its
            # offset is a single `take` of precomputed flat indices (measured on the CPU: ~3x faster
            # than a gather, a pad and an advanced-indexing crop per batch). The padded tensor is
            # allocated on the device and the source copied into its interior: no second full copy.
            n, h, w, c = cache.shape
            padded = torch.zeros((n, h + 2 * p, w + 2 * p, c), dtype=torch.uint8, device=self.device)
            padded[:, p:p + h, p:p + w] = cache
            self.cache = padded
            hp, wp = h + 2 * p, w + 2 * p
            dev = self.device
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
        p = self.augment.pad if self.augment.crop is Crop.TRANSLATE else 0
        n, h, w, c = cache.shape
        fmt = torch.channels_last if self.config.channels_last else torch.contiguous_format
        ready = torch.empty((n, c, h + 2 * p, w + 2 * p), dtype=self.config.dtype, device=self.device,
                            memory_format=fmt)
        for i in range(0, n, 4096):  # bounded temporaries while converting
            part = F.pad(cache[i:i + 4096].to(self.device), (0, 0, p, p, p, p))   # zero = black border
            ready[i:i + 4096] = self.normalize(part)
        if p:
            sn, sc, sh, sw = ready.stride()
            # view[i, dy, dx] is sample i shifted by (dy - p, dx - p): no copy until the gather.
            self._shifted = ready.as_strided((n, 2 * p + 1, 2 * p + 1, c, h, w), (sn, sh, sw, sc, sh, sw))
        return ready

    # Files per decoding job; the host holds at most a few of these at a time (see _decode_files).
    _CHUNK = 64

    def _decode_files(self):
        """Decode every file once, in parallel, at cache_size², chunk by chunk straight into the cache on
        the device (the torch backend's workers do the decoding). Files skipped with on_error='skip'
        leave no gap: the good ones are written contiguously."""
        from torch.utils.data import DataLoader

        s = self.config.cache_size
        decoder = BatchDecoder(self.source, Augmentation(crop="center", size=s, resize=s),
                               self.config.on_error)
        n = len(self.source)
        chunk = self._CHUNK
        jobs = [(np.arange(i, min(i + chunk, n)), 0) for i in range(0, n, chunk)]
        workers = self.opts["cache_workers"]
        workers = min(self.config.num_workers if workers is None else workers, len(jobs))
        # Host memory in flight: DataLoader's 2 chunks ahead per worker, plus the chunk being copied.
        host = (2 * max(workers, 1) + 1) * chunk * s * s * 3
        if self.device.type == "cuda" and host > available_ram():
            raise CacheDoesNotFit(f"memory backend: decoding {self.source!r} needs {host} bytes "
                                  f"({_fmt(host)}) of host RAM for its chunks in flight but {_fmt(available_ram())} "
                                  f"is available; pass fewer cache_workers")
        cache = torch.empty((n, s, s, 3), dtype=torch.uint8, device=self.device)
        kept = []
        loader = DataLoader(decoder, batch_size=None, sampler=jobs,
                            num_workers=workers)
        if loader.num_workers:
            collect_before_fork()
        it = iter(loader)
        pos = 0
        try:
            for images, _, good in it:   # good: the chunk's ids that decoded, in the images' order
                cache[pos:pos + len(good)] = images    # a pageable copy; synchronous, at cache time only
                pos += len(good)
                kept.append(np.asarray(good, dtype=np.int64))
        finally:
            # Shut the decoding workers down now, also after a DecodeError: left to the cyclic GC
            # (the exception's traceback holds the iterator), they stall a later loader for seconds.
            if hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
        self.kept = np.concatenate(kept) if kept else np.empty(0, dtype=np.int64)
        # Left out of every epoch: loader.skipped reports them each epoch (the one counter and warning).
        self.skipped_at_cache = self._dropped = self.skipped = n - len(self.kept)
        if self.skipped_at_cache:
            cache = cache[:pos]   # a view: the unused tail is only the skipped files' bytes
        return cache, torch.from_numpy(self.source.labels[self.kept])

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
        bounds, ids, offs, flips, thetas, exact = [], [], [], [], [], []
        pos = 0
        simple = self.ready is not None or not aug.crop.resamples  # shifted copies, no resized crops
        size = self.cache.shape[1:3] if self.cache is not None else self.ready.shape[2:]
        for k, b in enumerate(batches):
            n = len(b)
            params = draw_params(aug, self.batch_rng(epoch, start + k), n, size)
            if simple:
                if params.offsets is not None:
                    offs.append(params.offsets)
                if aug.hflip > 0:
                    flips.append(params.flips)
                exact.append(None)
            else:
                theta, ex = self._crop_params(params)
                thetas.append(theta)
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
            theta=None if simple else upload(thetas, np.float32, (0, 2, 3)),
            exact=exact, pinned=tuple(pinned))

    def batch(self, ep: _Epoch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``k`` of a prepared epoch: slices of its tensors and device ops, no host→device copy."""
        a, b = ep.bounds[k]
        idx = ep.ids[a:b]
        off = ep.off[a:b] if ep.off is not None else None
        flip = ep.flip[a:b] if ep.flip is not None else None
        if self.ready is not None:
            images = self._from_ready(idx, off, flip)
        elif not self.augment.crop.resamples:
            images = self._from_uint8(idx, off, flip)
        else:
            images = self._resized_crops(self.cache[idx], ep.theta[a:b], ep.exact[k])
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

    def _crop_params(self, params):
        """(theta (n, 2, 3), exact crop (top, left) or None) for one batch of photos from the cache.

        affine_grid maps output [-1, 1] to the box in normalized input coordinates (align_corners=False:
        pixel edges at ±1); a negative x scale mirrors the crop.
        """
        aug = self.augment
        h, w = self.cache.shape[1:3]
        boxes, flips = params.boxes, params.flips
        n = len(flips)
        top, left, bh, bw = (boxes[:, j] for j in range(4))
        exact = None
        if n and aug.crop is Crop.CENTER and not flips.any() and np.allclose(bh, aug.size) \
                and float(top[0]).is_integer() and float(left[0]).is_integer():
            exact = (int(top[0]), int(left[0]))  # the exact eval crop: a slice, no resampling
        theta = np.zeros((n, 2, 3), dtype=np.float32)
        theta[:, 0, 0] = np.where(flips, -1.0, 1.0) * bw / w
        theta[:, 0, 2] = (left + bw / 2) / w * 2 - 1
        theta[:, 1, 1] = bh / h
        theta[:, 1, 2] = (top + bh / 2) / h * 2 - 1
        return theta, exact

    def _resized_crops(self, x, theta, exact) -> torch.Tensor:
        """Per-sample boxes cropped and resized in one grid_sample (or the exact eval slice)."""
        size = self.augment.size
        xf = x.permute(0, 3, 1, 2).float()
        if exact is not None:
            t, l = exact
            return self.normalizer.floats(xf[:, :, t:t + size, l:l + size].contiguous())
        if x.shape[0] == 0:  # an empty share (drop_last=False, more ranks than samples left)
            return self.normalizer.floats(xf.new_empty((0, xf.shape[1], size, size)))
        grid = F.affine_grid(theta, (x.shape[0], xf.shape[1], size, size), align_corners=False)
        out = F.grid_sample(xf, grid, mode="bilinear", padding_mode="border", align_corners=False)
        return self.normalizer.floats(out)

    def close(self):
        self.cache = self.ready = self._shifted = self._pixel = None
        self.footprint = 0
        _LIVE.discard(self)
