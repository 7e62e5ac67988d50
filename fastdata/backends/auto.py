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
batches and would deadlock DDP), and one that every rank can build. With a process group initialized,
each rank judges every row on its own (its own free memory), the verdicts are gathered, and every rank
takes the first row that fits on all of them (``combine``): rank 0 deciding alone picked the memory
backend for a job whose other GPU had no room for the cache, and that rank failed building it.
Without one (ranks from ``RANK``/``WORLD_SIZE`` or explicit ``rank=``/``world_size=``), the decision uses
only quantities equal on every rank (``stable=True``): for the memory backend a GPU's total memory or the
host's total RAM split between the node's ranks, the reserve and this process's live caches, not the free
memory, which differs with what each rank has allocated so far (``budgeting.stable_limit``).
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
        from ..distributed import gather_on_cpu

        # Every row judged here, not only up to the first that fits: another rank may need a later one.
        try:
            mine: list | str = list(verdicts(source, config, options, specs, stable=False))
        except Exception as e:   # gathered, so that no rank waits for this one in the collective
            mine = f"{type(e).__name__}: {e}"
        # Through a gloo group: a few bytes of Python objects need no trip through an NCCL GPU.
        name, why = combine(gather_on_cpu(mine), config.device.type, source, config.device)
    else:
        from ..sampling import distributed_info

        _, world = distributed_info(config.rank, config.world_size)
        name, why = choose_locally(source, config, options, specs, stable=world > 1)
    return name, why + unused_options(name, options, specs)


def verdicts(source, config, options: dict | None, specs: Sequence, stable: bool = False):
    """``(name, fits, why)`` for each row allowed on the device, in preference order (a generator: a
    caller may stop at the first that fits)."""
    device_type, found = config.device.type, False
    for spec in specs:
        if device_type not in spec.devices:
            continue  # e.g. prefetch and dali only pay off on CUDA; not worth a word in the reason
        if not spec.available:
            yield spec.name, False, spec.unavailable_reason
            continue
        # fits() checks the kinds the backend reads (a torch Dataset's arbitrary __getitem__ only suits
        # the DataLoader-based backends) and any resource limit (the memory backend's cache budget).
        try:
            fits, why = spec.load().fits(source, config, options or {}, stable=stable)
        except Exception as e:
            if not found:
                raise
            # A row after one that fits, which one process alone never reaches (a broken DALI install):
            # its failure is its refusal, not the failure of a choice made across ranks.
            fits, why = False, f"{type(e).__name__}: {e}"
        found = found or fits
        yield spec.name, fits, why


def choose_locally(source, config, options: dict | None, specs: Sequence, stable: bool = False) -> tuple[str, str]:
    """The choice on this process alone. ``stable``: decide on quantities equal on every rank only (the
    memory backend budgets against total memory minus the reserve, leaving out the free memory)."""
    passed_over: list[str] = []
    for name, fits, why in verdicts(source, config, options, specs, stable=stable):
        if fits:
            tail = f" ({'; '.join(passed_over)})" if passed_over else ""
            return name, why + tail
        passed_over.append(f"not {name}: {why}")
    device_type = config.device.type
    raise ValueError(f"no backend fits {source!r} on {config.device}: " + "; ".join(passed_over)
                     + f"; backends allowed on {device_type}: {[s.name for s in specs if device_type in s.devices]}")


def combine(per_rank: list, device_type: str, source=None, device=None) -> tuple[str, str]:
    """The first row that fits on every rank, from each rank's ``verdicts`` (in rank order; a string
    in place of a rank's list: the error that rank met while judging, raised on every rank)."""
    failed = [(r, v) for r, v in enumerate(per_rank) if isinstance(v, str)]
    if failed:
        raise RuntimeError("backend='auto': " + "; ".join(f"rank {r} could not decide: {v}" for r, v in failed))
    names = [[n for n, _, _ in rows] for rows in per_rank]
    if any(n != names[0] for n in names):
        raise RuntimeError(f"backend='auto': the ranks' backend tables differ ({names}): install the same "
                           f"fastdata and backends on every node")
    passed_over: list[str] = []
    for i, name in enumerate(names[0]):
        refusals = [(r, rows[i][2]) for r, rows in enumerate(per_rank) if not rows[i][1]]
        if not refusals:
            tail = f"; {'; '.join(passed_over)}" if passed_over else ""
            return name, f"{per_rank[0][i][2]} (the first that fits on all {len(per_rank)} ranks{tail})"
        rank, why = refusals[0]
        passed_over.append(f"not {name} on rank {rank}: {why}")
    what = f"{source!r} on {device}" if source is not None else device_type
    raise ValueError(f"no backend fits on every rank ({what}): " + "; ".join(passed_over)
                     + f"; backends allowed on {device_type}: {names[0]}")


def unused_options(name: str, options: dict | None, specs: Sequence) -> str:
    """The part of the reason that names the options ``name`` does not take (make_loader passes a
    backend only its own): what the user set for another backend (``depth=4`` for prefetch) is not in
    effect, and must not vanish without a word. Empty when every option is the picked backend's."""
    by_name = {s.name: s for s in specs}
    taken = by_name[name].option_names() if name in by_name else None
    if not options or taken is None:
        return ""
    left = sorted(set(options) - taken)
    if not left:
        return ""
    owners = {k: sorted(f"{s.name}'s" for s in specs if k in (s.option_names() or ())) for k in left}
    listed = ", ".join(f"{k}={options[k]!r} ({', '.join(owners[k])})" for k in left)
    return f"; not passed to {name}, which does not take them: {listed}"
