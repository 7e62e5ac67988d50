"""Building the memory backend's cache: every file decoded once, straight into the cache's rows.

``CacheBuild`` is the part of ``MemoryLoader`` that fills a photo cache: threads (PIL's decode and resize
release the GIL), DataLoader worker processes, or nvImageCodec in batches (on a GPU, into device
memory); the decoders themselves are the decode layer's (``fastdata.images.whole``). Files skipped with
``on_error="skip"`` leave gaps that are closed at the end (``_compact``). Also here: what the cache is
made of besides decoding (``pad_images`` for translation, ``chunks`` for bounded temporaries).
"""
from __future__ import annotations

import contextlib
import threading
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from ...augment import (
    NUMPY_PAD_MODE,
)
from ...checks import check_integer
from ...config import Augmentation, Padding, default_workers
from ...decode import BatchDecoder, collect_before_fork
from ...errors import CacheDoesNotFit
from ...images.whole import NvWholeDecoder, WholePhotos, nvimgcodec
from .budgeting import LoaderFields, available_ram, fmt_bytes, photo_side


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


def chunks(n: int, per_item: int, limit: int = 64 * 2**20):
    """Ranges of at most ``limit`` bytes' worth of items: bounded temporaries while converting."""
    step = max(1, limit // max(per_item, 1))
    return [(i, min(i + step, n)) for i in range(0, n, step)]



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


def check_cache_build(build):
    """``build`` when it is one of ``CACHE_BUILDS``, else the ValueError naming the option and the choices."""
    if not (isinstance(build, str) and build in CACHE_BUILDS):
        raise ValueError(f"memory backend: unknown cache_build {build!r}; choose from {list(CACHE_BUILDS)}")
    return build



def read_ahead(items, read, *, ahead: int = 1, name: str = "fastdata-read"):
    """``(item, read(item))`` for each of ``items`` in order, with ``read`` of the next ``ahead`` items
    running on one host thread while the caller works on the current one: the GPU cache build reads
    the next group's files while this group decodes. An error of ``read`` is raised at its item.
    Leaving early (an error in the caller's work, ``close()``) cancels the reads not started and
    waits for the one running (one group's files: bounded)."""
    import collections
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    check_integer("ahead", ahead, minimum=1)
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



class CacheBuild(LoaderFields):
    """The memory loader's cache building (a mixin of ``MemoryLoader``): decoding every sample once into
    the device cache, in chunks, through the decode layer's whole-photo decoders."""

    _CHUNK = 64
    _applied: bool   # set by MemoryLoader, like the fields LoaderFields declares

    def _decode_files(self):
        """Decode every file once, in parallel, chunk by chunk straight into the cache on the device
        (DataLoader workers do the decoding). Training recipes: each photo whole at a longer side of at
        most cache_size (``WholePhotos``); the evaluation recipe: its output (``BatchDecoder``, the torch
        backend's decoding). Files skipped with on_error='skip' leave no gap: the good ones are written
        contiguously. Under a process group the node's ranks share the work (see ``_decode_node``)."""
        aug = self.augment
        s = photo_side(aug, self.cache_size)
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
        build = check_cache_build(self.opts["cache_build"])
        if self._applied and build in ("auto", "nvimgcodec"):
            return "threads"    # the evaluation recipe is the torch backend's decoding, exactly
        if build == "auto":
            # On a GPU nvImageCodec takes the decoding off the CPU. On the CPU its libjpeg-turbo build
            # used ~16% fewer CPU seconds than "threads" (same pixels), but paired round by round its
            # wall clock was within noise of it on the shared 2-core machine (0.92-1.41x,
            # benchmarks/results/cache-cpu-2c.md): PIL stays the CPU default, so an optional package
            # does not decide how a CPU cache is built.
            gpu = self.device.type == "cuda" and nvimgcodec() is not None
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
        workers = default_workers() if workers is None else workers   # this rank's share under torchrun
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
        ranges = [np.arange(i, min(i + chunk, hi)) for i in range(lo, hi, chunk)]
        jobs: list = [(ids, 0) for ids in ranges] if self._applied else ranges
        given = self.opts["cache_workers"]
        workers: int = min(cast(int, self.config.num_workers) if given is None else given, len(jobs))
        # Host memory in flight: DataLoader's 2 chunks ahead per worker, plus the chunk being copied.
        host = (2 * max(workers, 1) + 1) * chunk * s * s * 3
        if self.device.type == "cuda" and host > available_ram():
            raise CacheDoesNotFit(f"memory backend: decoding {self.source!r} needs {host} bytes "
                                  f"({fmt_bytes(host)}) of host RAM for its chunks in flight but "
                                  f"{fmt_bytes(available_ram())} "
                                  f"is available; pass fewer cache_workers")
        kept: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
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
        return (np.concatenate(kept) if kept else np.empty(0, dtype=np.int64),
                np.concatenate(sizes) if sizes else np.empty((0, 4), dtype=np.int64))

