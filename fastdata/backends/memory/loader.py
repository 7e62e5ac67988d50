"""``MemoryLoader``: the memory backend's loader, its epochs and the device recipe (see the package's
docstring for the design). Its budget is ``budgeting.py``'s, its cache is built by ``cache.py`` and shared
within a node by ``node.py``."""
from __future__ import annotations

import warnings
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from ...augment import (
    draw_params,
    require_fixed_size,
)
from ...checks import check_integer
from ...config import Crop
from ...datasets import SourceKind
from ...datasets.base import ArrayPixels
from ...errors import user_stacklevel
from ...sampling import EpochPlan
from ..base import Loader, pinned
from .budgeting import (
    DEFAULT_CACHE_SIZE,
    LIVE,
    budget,
    cache_bytes,
    check_cache_size,
    check_fits,
    fmt_bytes,
    ready_bytes,
    recipe,
    stable_limit,
    uses_ready,
)
from .cache import CacheBuild, check_cache_build, chunks, pad_images
from .epochs import DrawAhead, Draws, Epoch, grid_lines, group_bounds, starts, window
from .node import NodeCache


class MemoryLoader(CacheBuild, NodeCache, Loader):
    """The whole source cached as one uint8 (N, H, W, C) tensor on the device.

    Options:
        cache_size: the longest side at which each training photo is cached, whole (aspect kept; a
            smaller photo is kept as it is), in an (N, cache_size, cache_size, 3) uint8 tensor (default
            256). Crops are drawn from the original photo's size, as every backend draws them, then
            resampled from the cached copy: 256 keeps the cache small (192 KiB a photo) at the cost of
            resolution for small boxes; 512 keeps ImageNet-sized photos whole. The evaluation recipe
            (``center``) is cached already applied, at ``size``², whatever ``cache_size``. A memory
            option, not a shared one: ``make_loader(src, "memory", cache_size=512)``, and ``auto``
            passes it on when it picks memory. It stays 256 under a crop over 256 (a default following
            the crop would change what fits, and so ``auto``'s pick, for recipes that work today): the
            build then warns, naming the cache_size to pass and whether that cache fits.
        cache_build: how photos are decoded into the cache: "threads" (threads writing straight into
            the cache's rows; PIL's decode and resize release the GIL), "processes" (DataLoader worker
            processes sending chunks through shared memory: the build before issue 13), "nvimgcodec"
            (nvImageCodec in batches: nvJPEG on the loader's GPU into device memory, resized there;
            its CPU backend on the CPU, PIL for photos Image.draft can shrink), or "auto" (default):
            "nvimgcodec" on a CUDA device where nvImageCodec is installed, else "threads". The
            evaluation recipe (cached through the torch backend's decoding) is built by "threads"
            under either.
        cache_workers: threads (or processes) that decode photos into the cache (default: this rank's
            share of the usable cores for threads, as num_workers's default, num_workers for
            processes; 0: the calling thread).
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
    options = {"cache_size": DEFAULT_CACHE_SIZE, "cache_build": "auto", "cache_workers": None,
               "memory_reserve": None, "node_cache": True}

    @classmethod
    def fits(cls, source, config, options=None, *, stable=False):
        """Fits when the source's uint8 cache fits the budget (see the module docstring).

        The need is one cache: under a process group the ranks of a node share one host copy (see
        ``node_cache``), and each GPU holds its own. ``stable``: budget on quantities equal on every
        rank of a job without a process group (``budgeting.stable_limit``: a GPU's total memory, the
        host's total RAM), where free memory (which differs with what each rank has allocated so far)
        let ranks pick different backends.
        """
        ok, why = super().fits(source, config, options, stable=stable)
        if not ok:
            return ok, why
        reserve = (options or {}).get("memory_reserve")
        size = check_cache_size((options or {}).get("cache_size", DEFAULT_CACHE_SIZE))
        need = cache_bytes(source, config, size)
        where = f"GPU {config.device}" if config.device.type == "cuda" else "RAM"
        if stable:   # the same on every rank (no process group to compare free memory)
            limit, how = stable_limit(config.device, reserve)
            room, how = f"the {where} every rank may use", f"from {how}"
        else:
            limit, room, how = budget(config.device, reserve).limit, f"the free {where}", "after the memory_reserve " \
                "and other caches"
        aug = recipe(source, config)
        if uses_ready(source, config, aug, limit):
            ready = ready_bytes(source, config, aug)
            dtype = str(config.dtype).replace("torch.", "")
            return True, (f"its cache, normalized ahead in {dtype} ({fmt_bytes(ready)}, a batch is one "
                          f"gather), fits in half {room} ({fmt_bytes(limit // 2)} of "
                          f"{fmt_bytes(limit)} {how})")
        if need == 0:  # an array on the CPU, read where it is: nothing to allocate
            return True, f"it reads the source's array in {where} as it is (no copy to make)"
        if need <= limit:
            return True, f"its uint8 cache ({fmt_bytes(need)}) fits in {room} ({fmt_bytes(limit)} {how})"
        return False, f"the cache ({fmt_bytes(need)}) does not fit in {room} ({fmt_bytes(limit)} {how})"

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        try:
            self._build(source, config)
        except BaseException:
            # A loader that failed half-built (too few decodable files, Ctrl-C in the build) is still
            # referenced by the traceback (a notebook keeps the last one): it must neither hold its
            # cache nor count against the budget of the loader the user builds next.
            self.close()
            raise

    def _build(self, source, config):
        self.cache_size = check_cache_size(self.opts["cache_size"])   # before anything is decoded
        # Checked here, for every source: an array source never builds a photo cache, where they were read.
        check_cache_build(self.opts["cache_build"])
        check_integer("memory backend: cache_workers", self.opts["cache_workers"], minimum=0, optional=True)
        self.footprint = 0          # bytes this loader holds on its device (for the shared budget)
        self.cache = self.ready = None
        # The cache (or the ready copy) viewed so that a batch is one gather of its samples' first
        # elements (epochs.window), and the element strides of a sample, a row and a column in it.
        self._window = self._strides = None
        self._ahead = DrawAhead()   # the next epoch's augmentation draws, made while this one runs
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
            check_fits(source, config, reserve, cache_size=self.cache_size)  # before any allocation
        else:   # every rank of the node raises, or none does (its peers would wait in the next collective)
            self._agree(lambda: check_fits(source, config, reserve, cache_size=self.cache_size))
        LIVE.add(self)
        p = aug.pad if aug.crop is Crop.TRANSLATE else 0
        # Per cache slot, on the host: the (H, W) boxes are drawn from and the (h, w) of the pixels
        # cached for it (photos: a whole photo, top-left in its slot); None: every slot is the
        # cache's (H, W).
        self._sizes = None
        # Photos under the evaluation recipe: the slots hold the recipe's output, only flips remain.
        self._applied = source.kind is SourceKind.FILES and aug.crop is Crop.CENTER
        if source.kind is SourceKind.ARRAY:
            pixels = cast(ArrayPixels, source)
            with warnings.catch_warnings():
                # A read-only array (np.load(mmap_mode="r"), MNIST's IDX bytes) is shared too: the
                # cache is only read (gathers, and the padded or normalized copies made from it).
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                cache = torch.from_numpy(pixels.images)      # shares the array's memory on the CPU
            labels = torch.from_numpy(pixels.labels)
            self.kept = None
        else:
            cache, labels = self._decode_files()             # already on the device
            self._check_slots(cache)
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
        n, h, w, c = cache.shape
        if p:
            # Pad the cache once (zeros, reflection or edge, as the recipe says): then gathering a
            # batch, padding it and cropping each sample at its offset is one gather from the window
            # below, each sample's shift folded into its start (measured on the CPU: ~3x faster than
            # a gather, a pad and an advanced-indexing crop per batch). The padded tensor is
            # allocated on the device and filled chunk by chunk: no second full copy.
            padded = torch.empty((n, h + 2 * p, w + 2 * p, c), dtype=torch.uint8, device=self.device)
            for a, b in chunks(n, (h + 2 * p) * (w + 2 * p) * c):
                padded[a:b] = pad_images(cache[a:b].to(self.device), p, aug.padding)
            self.cache = padded
        else:
            self.cache = cache.to(self.device)
        if not aug.crop.resamples or self._applied:
            # Shifts, flips or nothing: every batch is (n, h, w, c) blocks of the cache.
            s_n, s_row, s_col, s_ch = self.cache.stride()
            self._window = window(self.cache, (h, w, c), (s_row, s_col, s_ch))
            self._strides = (s_n, s_row, s_col)
        self.footprint = self._owned_bytes()
        if self.kept is not None and len(self.kept) != len(source):
            self._plan_kept(source, config)

    def _check_slots(self, cache: torch.Tensor) -> None:
        """Warn where cache_size does not suit the photos (training recipes, once they are decoded).

        Under the crop's size while photos were shrunk to it (the default 256 under a 384 recipe):
        their crops are enlarged from the smaller copy, blurrier than every other backend's. At least
        twice the largest photo (32 px PNGs under the default 256): every slot is mostly zeros, 64x the
        memory of cache_size=32, and each batch converts whole slots."""
        if self._sizes is None or not len(self._sizes[1]):
            return
        shrunk, longest, crop = int(self._sizes[0].max()) > self.cache_size, int(self._sizes[1].max()), \
            self.augment.crop_size
        if shrunk and self.cache_size < crop:
            warnings.warn(self._small_slots_text(cache, crop), UserWarning, stacklevel=user_stacklevel())
        elif 2 * longest <= self.cache_size:
            warnings.warn(f"memory backend: the largest photo of {self.source!r} is {longest} px on its longer "
                          f"side, but cache_size={self.cache_size} gives each photo a {self.cache_size}² slot: "
                          f"the cache takes {fmt_bytes(cache.nbytes)} where cache_size={longest} would take "
                          f"{fmt_bytes(len(cache) * longest * longest * 3)} (the same pixels); pass "
                          f"cache_size={longest}", UserWarning, stacklevel=user_stacklevel())

    def _small_slots_text(self, cache: torch.Tensor, crop: int) -> str:
        """The warning for a cache_size under the crop: what it costs the pixels, what to pass instead,
        and whether that cache fits the budget here (this cache's bytes counted back in)."""
        need = len(cache) * crop * crop * 3
        # The cache built has left the free memory (counted back), not a GPU's other bound, its total less
        # the reserve and other caches (on the host both bounds are the free RAM).
        b = budget(self.device, self.opts["memory_reserve"], self)
        room = min(b.stable, b.free + cache.nbytes) if b.device.type == "cuda" else b.limit + cache.nbytes
        fits = (f"which the budget allows ({fmt_bytes(room)})" if need <= room else
                f"more than the {fmt_bytes(room)} the budget allows: lower memory_reserve, or use the 'torch' or "
                f"'dali' backend, which crop from the full photo")
        return (f"memory backend: cache_size={self.cache_size} is smaller than the crop size {crop}: photos of "
                f"{self.source!r} are cached at most {self.cache_size} px on their longer side, so a crop of a "
                f"larger photo is enlarged from that copy, blurrier than the torch and dali backends' crops of "
                f"the full photo. Pass cache_size>={crop} (make_loader(source, 'memory', cache_size={crop}); "
                f"'auto' passes it on): the cache then takes {fmt_bytes(need)}, {fits}")

    def _plan_kept(self, source, config):
        """on_error="skip" dropped files at cache time: the epoch covers the decodable ones."""
        # Every option of the plan kept (even_batches too): only the number of samples changes.
        self.plan = EpochPlan(len(self.kept), config.batch_size, config.shuffle, config.drop_last,
                              config.seed, self.plan.rank, self.plan.world_size, even=self.plan.even)
        if len(self.plan) == 0:
            skipped = len(source) - len(self.kept)
            raise ValueError(
                f"memory backend: only {len(self.kept)} of the {len(source)} files of {source!r} decode "
                f"({skipped} skipped with on_error='skip'), fewer than one batch of {config.batch_size} "
                f"with drop_last={config.drop_last}; lower batch_size, pass drop_last=False or fix the files")

    def _owned_bytes(self) -> int:
        """Bytes of the tensors this loader allocated (an array source shared on the CPU is not one)."""
        # An array source's pixels, which the cache shares on the CPU (see __init__).
        array = self.source.kind is SourceKind.ARRAY
        shared = cast(ArrayPixels, self.source).images.ctypes.data if array else None
        seen, total = set(), 0
        for t in (self.cache, self.ready, self.labels):
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
        ready = torch.empty((n, c, h + 2 * p, w + 2 * p), dtype=self.normalizer.dtype, device=self.device,
                            memory_format=fmt)
        for a, b in chunks(n, (h + 2 * p) * (w + 2 * p) * c * 4):  # bounded temporaries
            part = cache[a:b].to(self.device)
            ready[a:b] = self.normalize(pad_images(part, p, aug.padding) if p else part)
        # Row id * sn + dy * sh + dx * sw of the window is sample id shifted by (dy - p, dx - p), in
        # the ready tensor's own layout (contiguous or channels-last): no copy until the gather.
        sn, sc, sh, sw = ready.stride()
        self._window = window(ready, (c, h, w), (sc, sh, sw))
        self._strides = (sn, sh, sw)
        return ready

    # Files per decoding job; the host holds at most a few of these at a time (see _decode_into).

    @property
    def photo_sizes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Photos cached whole: per cache slot, the original (H, W) the recipe's boxes are drawn from,
        and the (h, w) of its cached copy (top-left in the slot); None for other caches."""
        return self._sizes

    # ------------------------------------------------------------------ epochs
    def _epoch(self, epoch, batches, start):
        if self.cache is None and self.ready is None:
            # close() freed the cache (the base contract: unusable afterwards); say so rather than fail
            # on a None deep in the gather.
            raise RuntimeError(f"this memory loader was closed: its cache of {self.source!r} is freed; "
                               f"make a new loader to read it again")
        ep = self.prepare_epoch(epoch, batches, start)
        # The next epoch's draws, on a thread while this one runs (see epochs.py). A set_epoch or a
        # resume in between makes them unused, not wrong (Draws.matches).
        nxt = epoch + 1
        self._ahead.start((nxt, 0), lambda: self.draw_epoch(nxt, self.plan.batches_from(nxt, 0), 0))
        if ep.starts is None:
            for k, (a, b) in enumerate(ep.bounds):
                yield self._resized_crops(ep.ids[a:b], ep.grid, a, b, ep.exact[k]), ep.labels[a:b]
            return
        # Per group of batches (see group_bounds): one gather (two more kernels with flips, plus the
        # normalization of a uint8 cache); per batch two slices; everything else was done for the whole
        # epoch in prepare_epoch.
        rows, labels, flip, view = ep.starts, ep.labels, ep.flip, self._window
        ready = self.ready is not None
        width = 3 if ready else 2           # (n, c, h, w) ready floats, (n, h, w, c) uint8
        layout = torch.channels_last if ready and self.config.channels_last else None
        sample = view.shape[1:].numel() * self.normalizer.dtype.itemsize   # a batch's bytes are its output's
        for group in group_bounds(ep.bounds, sample, self.device):
            a, b = group[0][0], group[-1][1]
            x = view[rows[a:b]]
            if flip is not None:
                x = torch.where(flip[a:b, None, None, None], x.flip(width), x)
            if not ready:
                x = self.normalize(x)
            elif layout is not None:
                x = x.contiguous(memory_format=layout)   # a no-op: the gather keeps the cache's layout
            # The group's batches, images and labels, made in one split each: a slice per batch is a
            # trip through torch's indexing code, cold after each training step (on the CPU 25 us of
            # a batch's 37, the loader's whole next() now 12). Views along dim 0 keep the group's
            # layout (contiguous or channels-last) and own no storage: the group's memory is freed
            # once its last batch is.
            if len(group) == 1:   # the CPU's groups (and a batch as large as a group): the gather is it
                yield x, labels[a:b]
                continue
            sizes = [e - s for s, e in group]
            yield from zip(x.split(sizes), labels[a:b].split(sizes))

    def prepare_epoch(self, epoch: int, batches: list, start: int) -> Epoch:
        """Every batch's ids and augmentation parameters for the epoch, on the device (see epochs.py).

        Why once per epoch: they depend only on (seed, epoch, batch), and a per-batch
        ``torch.from_numpy(...).to(cuda)`` copies pageable memory, which blocks the host until the
        training stream reaches the copy: Python and the kernel launches of the next step would stop
        overlapping the GPU every batch. The draws are the torch backend's (same per-batch rng, same
        order), so the batches stay bit-identical to it for digits.
        """
        draws = self._ahead.take((epoch, start), batches) or self.draw_epoch(epoch, batches, start)
        return self.upload(draws)

    def draw_epoch(self, epoch: int, batches: list, start: int) -> Draws:
        """The epoch's host side: each batch's draws (``draw_params``, the torch backend's), flat,
        pinned on CUDA. Pure: it reads the loader's recipe and sizes only, so a thread may run it."""
        aug = self.augment
        bounds, ids, offs, flips, lins = [], [], [], [], []
        exact: list[tuple[int, int] | None] = []
        pos = 0
        simple = self._window is not None   # shifts and flips only (see __init__)
        size = self.cache.shape[1:3] if self.cache is not None else self.ready.shape[2:]
        # The batches' generators seeded at once: one by one they were most of an epoch's host time.
        for b, rng in zip(batches, self.batch_rngs(epoch, start, len(batches)), strict=True):
            n = len(b)
            # Photos cached whole: boxes from each photo's original size, as the torch backend draws them.
            sizes = self._sizes[0][b] if self._sizes is not None else size
            params = draw_params(aug, rng, n, sizes)
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

        def host(parts, dtype, shape):
            arr = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(shape, dtype)
            # Pinned on CUDA, so the upload is a DMA that runs on the current stream without blocking the host.
            return pinned(torch.from_numpy(np.ascontiguousarray(arr)), self.device)

        return Draws(
            key=(epoch, start), bounds=bounds, ids=host(ids, np.int64, (0,)),
            off=host(offs, np.int64, (0, 2)) if simple and aug.crop is Crop.TRANSLATE else None,
            flip=host(flips, np.bool_, (0,)) if simple and aug.hflip > 0 else None,
            lin=None if simple else host(lins, np.float32, (0, 6)), exact=exact, batches=list(batches))

    def upload(self, draws: Draws) -> Epoch:
        """The draws on the device, and what the batches slice: each sample's start in the cache's
        window, the epoch's labels in order, the crops' sampling lines. One pinned non_blocking copy
        per kind and a few kernels, once per epoch.

        The pinned buffers are kept with the epoch: the caching host allocator would keep a buffer
        until its copy's event completes even if it were freed; holding it for the epoch makes that
        independent of allocator details."""
        def up(t):
            return None if t is None else t.to(self.device, non_blocking=True)

        ids, lin = up(draws.ids), up(draws.lin)
        rows = starts(ids, up(draws.off), self._strides) if self._window is not None else None
        grid = grid_lines(lin, self._steps, *self.cache.shape[1:3]) if lin is not None else None
        pinned = tuple(t for t in (draws.ids, draws.off, draws.flip, draws.lin)
                       if t is not None and self.device.type == "cuda")
        return Epoch(bounds=draws.bounds, ids=ids, starts=rows, labels=self.labels[ids], flip=up(draws.flip),
                     lin=lin, grid=grid, exact=draws.exact, pinned=pinned)

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
        aug, size = self.augment, self.augment.crop_size   # boxes: a resizing crop, whose size is set
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

    def _resized_crops(self, idx, grid, a: int, b: int, exact) -> torch.Tensor:
        """Per-sample boxes cropped and resized in one bilinear grid_sample (or the exact slice).

        ``grid``: the epoch's sampling lines (epochs.grid_lines), clamped to each sample's own pixels;
        samples ``a:b`` are this batch's. (Four uint8 gathers per output pixel instead of a float copy
        of every slot measured 2-4x slower on the CPU: torch's CPU gathers are not vectorized;
        grid_sample is.)
        """
        size = self.augment.size
        if exact is not None:
            t, l = exact
            return self.normalize(self.cache[idx, t:t + size, l:l + size])
        if idx.shape[0] == 0:  # an empty share (drop_last=False, more ranks than samples left)
            return self.normalize(self.cache.new_empty((0, size, size, self.cache.shape[3])))
        n = idx.shape[0]
        gy, gx = grid[0][a:b], grid[1][a:b]
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
        # End a pass still running first: its generator holds views of the cache (and the epoch's
        # tensors), which would stay allocated after the budget had been told they were freed.
        # Its next() says so, as torch's, prefetch's and dali's passes do.
        self._end_running_pass("the memory loader was closed while this pass ran (close() frees its cache); "
                               "make a new loader to read it again")
        self.cache = self.ready = self._window = self._sizes = self._scratch = None
        ahead = getattr(self, "_ahead", None)   # absent when __init__ failed before making it
        if ahead is not None:
            ahead.close()
        self.footprint = 0
        LIVE.discard(self)
