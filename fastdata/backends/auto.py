"""``auto``: pick the fastest backend that fits, and say why.

Order, from what the benchmarks measure (benchmarks/results): ``memory`` (no per-epoch decoding at
all; on a 2-core CPU 2,100 JPEG-sized images/s against 1,100-1,250 for the decoding backends) when
its cache fits the memory backend's budget; else ``dali`` on CUDA when DALI imports (nvJPEG decodes
on the GPU); else ``prefetch`` on CUDA (copies overlap compute); else ``torch``. Torch Datasets (arbitrary Python
``__getitem__``) can only be read by the torch-based backends.

Every rank of a distributed job must pick the same backend (different backends read different
batches and would deadlock DDP). With a process group initialized, rank 0 decides and broadcasts its
choice. Without one (ranks from ``RANK``/``WORLD_SIZE`` or explicit ``rank=``/``world_size=``), the
decision uses only quantities equal on every rank: the device's total memory, the reserve and this
process's live caches, not the free memory, which differs with what each rank has allocated so far.
"""
from __future__ import annotations

from . import memory


def choose(source, config, options: dict | None = None) -> tuple[str, str]:
    """(backend name, reason) for ``source`` under ``config``; ``options`` are make_loader's backend
    options (``memory_reserve`` sets the memory backend's budget)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Rank 0 decides; the others take its answer. On NCCL the object travels through the loader's
        # GPU (not torch's current device, which may still be cuda:0 on every rank).
        device = config.device if "nccl" in str(dist.get_backend()) and config.device.type == "cuda" else None
        choice = [choose_locally(source, config, options, stable=False) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(choice, src=0, device=device)
        name, reason = choice[0]
        return name, f"{reason} (rank 0's choice, shared with all {dist.get_world_size()} ranks)"
    from ..sampling import distributed_info

    _, world = distributed_info(config.rank, config.world_size)
    return choose_locally(source, config, options, stable=world > 1)


def choose_locally(source, config, options: dict | None = None, stable: bool = False) -> tuple[str, str]:
    """The choice on this process alone. ``stable``: budget the cache against total memory minus the
    reserve only (equal on every rank), leaving out the free memory (which differs between ranks)."""
    from ..registry import _importable

    cuda = config.device.type == "cuda"
    if source.kind == "dataset":
        return ("prefetch" if cuda else "torch"), "a torch Dataset is read by the DataLoader-based backends"
    dali = _importable("nvidia.dali.plugin.pytorch")
    reserve = (options or {}).get("memory_reserve")
    need, b = memory.cache_bytes(source, config), memory.budget(config.device, reserve)
    limit = b.stable if stable else b.limit
    where = f"GPU {config.device}" if cuda else "RAM"
    if need <= limit:
        return "memory", (f"its uint8 cache ({memory._fmt(need)}) fits in the free {where} "
                          f"({memory._fmt(limit)} after the memory_reserve and other caches)")
    why = (f"the cache ({memory._fmt(need)}) does not fit in the free {where} ({memory._fmt(limit)} after "
           f"the memory_reserve and other caches)")
    if cuda and dali:
        return "dali", why + "; DALI decodes and augments on the GPU"
    if cuda:
        return "prefetch", why + " and DALI is not installed"
    return "torch", why + "; on the CPU the worker processes do the decoding"
