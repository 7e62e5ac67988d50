"""The memory backend's budget: how many bytes a cache needs, and how many the device can give it.

A cache must fit in the device's total memory minus ``memory_reserve`` (default: a quarter of a GPU, a
fifth of the host's available RAM) minus the other live memory caches of this process, and on a GPU also
in its free memory. Refused before anything is allocated (``check_fits``), naming every part.
"""
from __future__ import annotations

import numbers
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ...augment import recipe
from ...checks import env_integer
from ...config import Augmentation, Crop, check_integer, resolve_device
from ...datasets import SourceKind
from ...errors import CacheDoesNotFit
from ...host_memory import available_ram, cgroup_room, fmt_bytes, total_ram  # noqa: F401 (cgroup_room: re-exported)

if TYPE_CHECKING:
    from ...config import LoaderConfig
    from ...datasets import Source


class LoaderFields:
    """What the memory loader's mixins (``CacheBuild``, ``NodeCache``) read from ``MemoryLoader`` and its
    other bases, declared once for type checkers (the values are set there, not here)."""

    source: Source
    config: LoaderConfig
    opts: dict
    augment: Augmentation
    device: torch.device
    cache_size: int


#: What the budget keeps free by default for the model, its activations and the batch being augmented:
#: a quarter of a GPU's *total* memory (free memory would hand the cache whatever the model has not
#: allocated yet, and the training step then runs out), a fifth of the host's available RAM.
DEFAULT_RESERVE = {"cuda": 0.25, "cpu": 0.2}

#: Live MemoryLoader caches of this process. Every new cache is budgeted against what the others already
#: hold on the same device (a train and an eval cache must fit together); weak references, so a cache
#: leaves the budget when its loader is closed or collected.
LIVE: weakref.WeakSet = weakref.WeakSet()


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
    return sum(m.footprint for m in list(LIVE) if m is not exclude and m.device == device)


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
            pool = f"GPU {self.device} allows {self.limit} bytes ({fmt_bytes(self.limit)}): {self.total} bytes " \
                   f"({fmt_bytes(self.total)}) in total"
        else:
            pool = (f"host RAM allows {self.limit} bytes ({fmt_bytes(self.limit)}): {self.free} bytes "
                    f"({fmt_bytes(self.free)}) available plus {self.total - self.free} bytes held by this process's "
                    f"memory caches")
        text = (f"the {pool}, minus the memory_reserve of {self.reserve} bytes ({fmt_bytes(self.reserve)}) kept "
                f"for the model and activations, minus {self.live} bytes ({fmt_bytes(self.live)}) held by other "
                f"live memory caches of this process")
        if self.device.type == "cuda" and self.free < self.stable:
            text += f", and only {self.free} bytes ({fmt_bytes(self.free)}) are free now"
        return text


def budget(device: torch.device, reserve=None, exclude=None) -> Budget:
    """What a new cache may use on ``device`` (``exclude``: a loader whose own cache is not counted).

    ``device`` as ``make_loader`` takes it ("cpu", "cuda", None, a torch.device): a loader's device is
    always indexed (cuda:0), so an unindexed "cuda" must be resolved the same way, or the caches living
    there would not count (and a string had no ``.type``)."""
    if not (isinstance(device, torch.device) and (device.type == "cpu" or device.index is not None
                                                  or not torch.cuda.is_available())):
        device = resolve_device(device)
    total, free = total_bytes(device), free_bytes(device)
    return Budget(device, total, reserve_bytes(reserve, device, total), live_cache_bytes(device, exclude), free)


def stable_limit(device, reserve=None) -> tuple[int, str]:
    """(what a cache may use, where the number comes from) from quantities equal on every rank of a job
    on identical machines: ``backend='auto'`` without a process group decides on this, as there is no
    way to compare the ranks' free memory, and a choice on each rank's own differed between ranks.

    A GPU: its total memory minus the reserve and this process's live caches (``Budget.stable``). The
    host: its total RAM (capped by the memory cgroup's limit) minus the reserve (of that total), split
    between the node's ``LOCAL_WORLD_SIZE`` ranks (each caches its own copy without a process group),
    minus this process's live caches: not the available RAM, which differs with what each rank (and
    anything else on the node) has allocated so far. A rank whose available RAM then cannot hold the
    cache fails building it (CacheDoesNotFit, naming its budget), as every backend's choice is the same."""
    b = budget(device, reserve)
    if b.device.type == "cuda":
        return b.stable, "the GPU's total memory, less the memory_reserve and other caches"
    ram, ranks = total_ram(), env_integer("LOCAL_WORLD_SIZE", 1, minimum=1)
    share = (ram - reserve_bytes(reserve, b.device, ram)) // ranks
    shared = f" shared by LOCAL_WORLD_SIZE={ranks} ranks" if ranks > 1 else ""
    return max(0, share - b.live), (f"the host's total RAM{shared}, less the memory_reserve and other caches; "
                                    f"not its available RAM, which differs between ranks")


#: The ``cache_size`` option's default (see MemoryLoader): 192 KiB a photo.
DEFAULT_CACHE_SIZE = 256


def check_cache_size(value) -> int:
    """The ``cache_size`` option as an int >= 1; TypeError/ValueError naming it otherwise."""
    return check_integer("cache_size", value, minimum=1)


def photo_side(aug: Augmentation, cache_size: int) -> int:
    """Side of the square slots photos are cached in: the evaluation crop (``center``) is cached
    already applied, at ``size``; any other recipe caches each photo whole, longer side <= cache_size."""
    return aug.crop_size if aug.crop is Crop.CENTER else cache_size


def cache_bytes(source, config, cache_size: int = DEFAULT_CACHE_SIZE) -> int:
    """Bytes of the uint8 cache for ``source`` (new allocation only: an array on the CPU is shared);
    ``cache_size``: the option of that name (photos' longer side in the training cache)."""
    aug = recipe(source, config)
    if source.kind is SourceKind.ARRAY:
        if aug.crop is Crop.TRANSLATE:  # kept pre-padded (see MemoryLoader), on any device
            n, h, w, c = source.images.shape
            return n * (h + 2 * aug.pad) * (w + 2 * aug.pad) * c
        return 0 if config.device.type == "cpu" else source.images.nbytes
    side = photo_side(aug, check_cache_size(cache_size))
    return len(source) * side * side * 3



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


def check_fits(source, config, reserve=None, copies: int = 1, *, cache_size: int = DEFAULT_CACHE_SIZE) -> Budget:
    """Raise CacheDoesNotFit, naming both sizes and the budget's parts, if the uint8 cache does not fit.

    ``copies``: caches of this size the device's memory must hold at once: 1 for a cache of one
    process, and for the one shared copy of a node's ranks on the host; k for the host copies of k ranks
    of a node that cannot share one (no room in /dev/shm). Each rank then checks its 1/k share."""
    one, b = cache_bytes(source, config, cache_size), budget(config.device, reserve)
    need = one * copies
    if need > b.limit:
        copies_text = f" ({copies} copies, one per rank of this node)" if copies > 1 else ""
        raise CacheDoesNotFit(
            f"memory backend: caching {source!r} needs {need} bytes ({fmt_bytes(need)}){copies_text} but "
            f"{b.explain()}; "
            f"pass memory_reserve=<bytes or fraction of the device> to change the reserve, or use the "
            f"'torch', 'prefetch' or 'dali' backend"
            # cache_size bounds the photos of a whole-photo cache only (arrays and the evaluation
            # recipe's crops are cached at their own size): suggested only where it shrinks the cache.
            f"{', or a smaller cache_size' if cache_bytes(source, config, 1) < one else ''}")
    return b


