"""``auto``: pick the first backend in the registry's preference order that fits, and say why.

For each row of the table (``fastdata.registry``), in preference order: the backend must be allowed on
the device type (``BackendSpec.devices``), its package must import, and its class must say it fits
(``Loader.fits``: it reads the source's kind, and for the memory backend its cache fits the budget). The first
that passes is picked; the reason names it and what the preferred ones lacked. This module knows no
backend by name: the table's ``order`` and each class's ``fits`` hold the knowledge (benchmarks/results
holds the measurements behind the order). Two rules live in ``fits``: memory fits when its cache fits
the budget; prefetch fits on CUDA only when a uint8 batch is at least ``fastdata.prefetch.MIN_BATCH_BYTES``
(1 MiB), since a smaller batch has no copy worth hiding and the torch backend, next in the order, is as
fast (``PrefetchStage.helps``; digits and CIFAR-sized batches go to torch, photo batches to prefetch).

Every rank of a distributed job must pick the same backend (different backends read different
batches and would deadlock DDP). With a process group initialized, rank 0 decides and broadcasts its
choice. Without one (ranks from ``RANK``/``WORLD_SIZE`` or explicit ``rank=``/``world_size=``), the
decision uses only quantities equal on every rank (``stable=True``): for the memory backend the device's
total memory, the reserve and this process's live caches, not the free memory, which differs with what
each rank has allocated so far.
"""
from __future__ import annotations

from collections.abc import Sequence


def choose(source, config, options: dict | None, specs: Sequence) -> tuple[str, str]:
    """(backend name, reason) for ``source`` under ``config``.

    Args:
        source: a fastdata source (``as_source`` already applied).
        config: the LoaderConfig.
        options: make_loader's backend options (``memory_reserve`` moves the memory backend's budget).
        specs: the registry's rows in preference order (``registry.by_preference()``).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Rank 0 decides; the others take its answer. On NCCL the object travels through the loader's
        # GPU (not torch's current device, which may still be cuda:0 on every rank).
        device = config.device if "nccl" in str(dist.get_backend()) and config.device.type == "cuda" else None
        choice: list[tuple[str, str] | None] = [
            choose_locally(source, config, options, specs, stable=False) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(choice, src=0, device=device)
        if choice[0] is None:   # the broadcast fills it with rank 0's pair: a None would be a torch bug
            raise RuntimeError("backend='auto': rank 0's choice did not arrive through broadcast_object_list")
        name, reason = choice[0]
        return name, f"{reason} (rank 0's choice, shared with all {dist.get_world_size()} ranks)"
    from ..sampling import distributed_info

    _, world = distributed_info(config.rank, config.world_size)
    return choose_locally(source, config, options, specs, stable=world > 1)


def choose_locally(source, config, options: dict | None, specs: Sequence, stable: bool = False) -> tuple[str, str]:
    """The choice on this process alone. ``stable``: decide on quantities equal on every rank only (the
    memory backend budgets against total memory minus the reserve, leaving out the free memory)."""
    device_type = config.device.type
    passed_over = []
    for spec in specs:
        if device_type not in spec.devices:
            continue  # e.g. prefetch and dali only pay off on CUDA; not worth a word in the reason
        if not spec.available:
            passed_over.append(f"not {spec.name}: {spec.unavailable_reason}")
            continue
        # fits() checks the kinds the backend reads (a torch Dataset's arbitrary __getitem__ only suits
        # the DataLoader-based backends) and any resource limit (the memory backend's cache budget).
        fits, why = spec.load().fits(source, config, options or {}, stable=stable)
        if fits:
            tail = f" ({'; '.join(passed_over)})" if passed_over else ""
            return spec.name, why + tail
        passed_over.append(f"not {spec.name}: {why}")
    raise ValueError(f"no backend fits {source!r} on {config.device}: " + "; ".join(passed_over)
                     + f"; backends allowed on {device_type}: {[s.name for s in specs if device_type in s.devices]}")
