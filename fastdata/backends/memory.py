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
backend, so for digits the two backends produce identical batches.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from ..config import Augmentation
from ..errors import CacheDoesNotFit, DecodeError
from ..sampling import EpochPlan
from ..transforms import center_params, rrc_params, translate_offsets
from .base import Loader

# Leave room for the model, activations and the batch being augmented.
FIT_FRACTION = 0.8


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
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_ram()


def cache_bytes(source, config) -> int:
    """Bytes of the uint8 cache for ``source`` (new allocation only: an array on the CPU is shared)."""
    if source.kind == "array":
        aug = config.augment if config.augment is not None else source.default_augmentation(config.train)
        if aug.crop == "translate":  # kept pre-padded (see MemoryLoader), on any device
            n, h, w, c = source.images.shape
            return n * (h + 2 * aug.pad) * (w + 2 * aug.pad) * c
        return 0 if config.device.type == "cpu" else source.images.nbytes
    return len(source) * config.cache_size * config.cache_size * 3


def ready_bytes(source, config, aug) -> int:
    """Bytes of an array source cached already normalized (padded for translation) in the output dtype."""
    n, h, w, c = source.images.shape
    p = aug.pad if aug.crop == "translate" else 0
    return n * (h + 2 * p) * (w + 2 * p) * c * config.dtype.itemsize


def check_fits(source, config) -> None:
    need, free = cache_bytes(source, config), free_bytes(config.device)
    if need > FIT_FRACTION * free:
        where = f"GPU {config.device}" if config.device.type == "cuda" else "RAM"
        raise CacheDoesNotFit(
            f"memory backend: caching {source!r} needs {need} bytes ({_fmt(need)}) but the {where} has "
            f"{free} bytes ({_fmt(free)}) free, of which it uses at most {FIT_FRACTION:.0%}; use the "
            f"'torch', 'prefetch' or 'dali' backend, or a smaller cache_size")


class MemoryLoader(Loader):
    """The whole source cached as one uint8 (N, H, W, C) tensor on the device.

    Options:
        cache_workers: processes that decode photos into the cache (default: num_workers).
    """

    name = "memory"
    options = {"cache_workers": None}

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        check_fits(source, config)  # before any allocation
        if source.kind == "array":
            cache = torch.from_numpy(source.images)          # shares the array's memory on the CPU
            labels = torch.from_numpy(source.labels)
            self.kept = None
        else:
            cache, labels = self._decode_files()
        self.labels = labels.to(self.device)
        self.ready = None
        if source.kind == "array" and self.augment.crop in ("none", "translate") \
                and ready_bytes(source, config, self.augment) <= FIT_FRACTION * free_bytes(self.device):
            # Small images (digits): cache them already normalized, padded for the translation, in the
            # output dtype. A batch is then one gather from a strided view of every shifted copy, with
            # no per-batch conversion — the same work as gathering ready float batches. It costs 4x
            # the bytes of uint8 (245 MB for 60,000 MNIST digits in float32); when that does not fit,
            # the uint8 path below runs instead.
            self.ready = self._build_ready(cache)
            self.cache = None
            return
        self.cache = cache.to(self.device)
        if self.augment.crop == "translate":
            # Pad the cache once: then gathering a batch, padding it and cropping each sample at its
            # offset is a single `take` of precomputed flat indices (measured on the CPU: ~3x faster
            # than a gather, a pad and an advanced-indexing crop per batch).
            p = self.augment.pad
            self.cache = F.pad(self.cache, (0, 0, p, p, p, p))
            n, hp, wp, c = self.cache.shape
            h, w = hp - 2 * p, wp - 2 * p
            dev = self.device
            self._pixel = ((torch.arange(h, device=dev) * wp * c)[:, None, None]
                           + (torch.arange(w, device=dev) * c)[None, :, None]
                           + torch.arange(c, device=dev)[None, None, :])[None]      # (1, h, w, c)
            self._strides = (hp * wp * c, wp * c, c)
        if self.kept is not None and len(self.kept) != len(source):
            # on_error="skip" dropped files at cache time: the epoch covers the decodable ones.
            self.plan = EpochPlan(len(self.kept), config.batch_size, config.shuffle, config.drop_last,
                                  config.seed, self.plan.rank, self.plan.world_size)
            if len(self.plan) == 0:
                raise ValueError(f"only {len(self.kept)} decodable files remain, fewer than one batch")

    def _build_ready(self, cache: torch.Tensor) -> torch.Tensor:
        p = self.augment.pad if self.augment.crop == "translate" else 0
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

    def _decode_files(self):
        """Decode every file once, in parallel, at cache_size² (the torch backend's workers do it)."""
        from torch.utils.data import DataLoader

        from .torch_loader import BatchFetcher, collect_before_fork

        s = self.config.cache_size
        fetcher = BatchFetcher(self.source, Augmentation(crop="center", size=s, resize=s), "raise")
        n = len(self.source)
        chunk = 64
        jobs = [(np.arange(i, min(i + chunk, n)), 0) for i in range(0, n, chunk)]
        workers = self.opts["cache_workers"]
        workers = self.config.num_workers if workers is None else workers
        cache = torch.empty((n, s, s, 3), dtype=torch.uint8)
        ok = np.ones(n, dtype=bool)
        loader = DataLoader(_Tolerant(fetcher, self.config.on_error), batch_size=None, sampler=jobs,
                            num_workers=min(workers, len(jobs)))
        if loader.num_workers:
            collect_before_fork()
        it = iter(loader)
        try:
            for (ids, _), (images, bad) in zip(jobs, it):
                good = np.setdiff1d(ids, bad, assume_unique=True)
                cache[good] = images
                ok[bad] = False
        finally:
            # Shut the decoding workers down now, also after a DecodeError: left to the cyclic GC
            # (the exception's traceback holds the iterator), they stall a later loader for seconds.
            if hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
        self.skipped_at_cache = int((~ok).sum())
        self.kept = np.flatnonzero(ok)
        if self.skipped_at_cache:
            import warnings

            warnings.warn(f"memory: skipped {self.skipped_at_cache} undecodable file(s) while caching "
                          f"(on_error='skip')", RuntimeWarning, stacklevel=3)
            cache = cache[torch.from_numpy(self.kept)]
        return cache, torch.from_numpy(self.source.labels[self.kept])

    def _epoch(self, epoch, batches, start):
        for k, ids in enumerate(batches):
            rng = self.batch_rng(epoch, start + k)
            idx = torch.from_numpy(ids).to(self.device, non_blocking=True)
            if self.ready is not None:
                yield self._from_ready(idx, rng), self.labels[idx]
                continue
            images = None if self.augment.crop == "translate" else self.cache[idx]
            yield self._augment(images, rng, idx), self.labels[idx]

    def _augment(self, x, rng: np.random.Generator, idx: torch.Tensor) -> torch.Tensor:
        """uint8 (N, H, W, C) batch on the device → normalized float (N, C, h, w)."""
        aug = self.augment
        if aug.crop == "translate":
            # Same draws, same order as transforms.augment_batch: offsets, then flips.
            off = torch.from_numpy(translate_offsets(rng, len(idx), aug.pad)).to(self.device)
            s_img, s_row, s_col = self._strides
            start = idx * s_img + off[:, 0] * s_row + off[:, 1] * s_col
            x = self.cache.view(-1).take(start[:, None, None, None] + self._pixel)
            return self.normalize(self._flip_nhwc(x, rng))
        if aug.crop == "none":
            return self.normalize(self._flip_nhwc(x, rng))
        return self._resized_crops(x, rng)

    def _from_ready(self, idx: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        aug = self.augment
        if aug.crop == "translate":
            # Same draws, same order as transforms.augment_batch: offsets, then flips.
            off = torch.from_numpy(translate_offsets(rng, len(idx), aug.pad)).to(self.device)
            x = self._shifted[idx, off[:, 0], off[:, 1]]
        else:
            x = self.ready[idx]
        if aug.hflip > 0:
            flip = torch.from_numpy(rng.random(len(idx)) < aug.hflip).to(self.device)
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
        if self.config.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _flip_nhwc(self, x, rng):
        if self.augment.hflip <= 0:
            return x
        flip = torch.from_numpy(rng.random(x.shape[0]) < self.augment.hflip).to(self.device)
        return torch.where(flip[:, None, None, None], x.flip(2), x)

    def _resized_crops(self, x, rng):
        """Per-sample boxes (drawn like the torch backend's) cropped and resized in one grid_sample."""
        aug, n = self.augment, x.shape[0]
        h, w = x.shape[1:3]
        boxes = np.empty((n, 4), dtype=np.float64)
        flips = np.zeros(n, dtype=bool)
        for i in range(n):  # the same draw order as transforms.sample_box: box, then flip
            if aug.crop == "random_resized":
                boxes[i] = rrc_params(rng, h, w, aug.scale, aug.ratio)
            else:
                boxes[i] = center_params(h, w, aug.size, aug.resize)
            flips[i] = aug.hflip > 0 and rng.random() < aug.hflip
        xf = x.permute(0, 3, 1, 2).float()
        top, left, bh, bw = (boxes[:, j] for j in range(4))
        if aug.crop == "center" and np.allclose(bh, aug.size) and float(top[0]).is_integer() \
                and float(left[0]).is_integer():
            t, l = int(top[0]), int(left[0])  # the exact eval crop: a slice, no resampling
            return self.normalize_float(xf[:, :, t:t + aug.size, l:l + aug.size].contiguous())
        # affine_grid maps output [-1, 1] to the box in normalized input coordinates
        # (align_corners=False: pixel edges at ±1); a negative x scale mirrors the crop.
        cx = (left + bw / 2) / w * 2 - 1
        cy = (top + bh / 2) / h * 2 - 1
        sx = np.where(flips, -1.0, 1.0) * bw / w
        sy = bh / h
        theta = np.zeros((n, 2, 3), dtype=np.float32)
        theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = sx, cx, sy, cy
        theta = torch.from_numpy(theta).to(self.device)
        grid = F.affine_grid(theta, (n, xf.shape[1], aug.size, aug.size), align_corners=False)
        out = F.grid_sample(xf, grid, mode="bilinear", padding_mode="border", align_corners=False)
        return self.normalize_float(out)

    def close(self):
        self.cache = self.ready = self._shifted = None


class _Tolerant(torch.utils.data.Dataset):
    """Decode a chunk; with on_error='skip' report the ids that failed instead of raising."""

    def __init__(self, fetcher, on_error):
        self.fetcher, self.on_error = fetcher, on_error

    def __len__(self):
        return len(self.fetcher)

    def __getitem__(self, job):
        ids, seed = job
        if self.on_error == "raise":
            images, _, _ = self.fetcher[job]
            return images, np.empty(0, dtype=np.int64)
        from ..transforms import load_photo

        s = self.fetcher.augment.size
        out, bad = [], []
        rng = np.random.default_rng(seed)
        for i in ids:
            try:
                out.append(load_photo(self.fetcher.source.paths[i], self.fetcher.augment, rng))
            except DecodeError:
                bad.append(i)
        images = np.stack(out) if out else np.empty((0, s, s, 3), np.uint8)
        return torch.from_numpy(images), np.asarray(bad, dtype=np.int64)
