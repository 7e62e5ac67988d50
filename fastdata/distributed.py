"""Process-group set-up under ``torchrun``, DDP wrapping and reducing per-epoch figures.

Without ``torchrun`` (no ``WORLD_SIZE`` > 1 in the environment) every function here is a cheap no-op
for a single process, so the same script runs alone or distributed.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def env_world_size() -> int:
    """The world size torchrun announced (``WORLD_SIZE``), before or without a process group; 1 alone."""
    return int(os.environ.get("WORLD_SIZE", 1))


def is_distributed() -> bool:
    """Whether a process group of more than one rank is running (what DDP and the reductions need)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank: the process group's, else ``RANK`` (torchrun sets it before the
    group starts, so rank 0 alone prints even then), else 0."""
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Ranks in the running process group; 1 without one."""
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK`` set by torchrun; 0 otherwise)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Rank 0 prints, writes checkpoints and JSON."""
    return rank() == 0


def init_distributed(device=None) -> torch.device:
    """Initialize the process group when launched by ``torchrun``; return this process's device.

    nccl for CUDA, gloo for CPU. On CUDA each process takes ``cuda:LOCAL_RANK`` and makes it the
    current device *before* loaders are built, so ``device=None`` resolves to the right GPU and NCCL
    does not pile every rank onto GPU 0.

    Args:
        device: ``None`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``; an explicit index is
            honoured for single-process runs only.
    """
    from .config import resolve_device

    want_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if env_world_size() <= 1:
        return resolve_device(device)
    if want_cuda:
        local = local_rank()
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} but this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s); start at most that many processes per node")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = resolve_device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", **kwargs)
    return dev


def cleanup(barrier: bool = True) -> None:
    """Tear the process group down, on every rank together after a successful run.

    The barrier first: a rank that destroys its group and exits while a peer's gloo threads still
    talk to it can make that peer abort at exit ("terminate called without an active exception",
    seen here in the 2-rank CPU test; pytorch/pytorch#190489). After a failure pass
    ``barrier=False``: the peers may be inside a collective that never completes, and the barrier
    would wait for the process group's timeout (30 minutes) instead of letting torchrun stop them."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            try:
                dist.barrier()
            except Exception:  # a peer already failed: still release this rank's resources
                pass
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank; a no-op in a single process."""
    if is_distributed():
        dist.barrier()


def check_device(device: torch.device) -> None:
    """Under torchrun on CUDA, refuse a device other than ``cuda:LOCAL_RANK``.

    Every rank on the same GPU (``cuda:0``, what ``torch.cuda.current_device()`` says before anything
    sets it) would crash NCCL or silently share one GPU; a loader built on the wrong GPU is the usual
    cause, so the error says how loaders pick theirs."""
    device = torch.device(device)
    if env_world_size() <= 1 or device.type != "cuda":
        return
    local = local_rank()
    if device.index != local:
        raise RuntimeError(
            f"under torchrun, rank {rank()} (LOCAL_RANK={local}) must train on cuda:{local}, but its "
            f"train_loader is on {device}: build the loaders with device=None or 'cuda' (both mean "
            f"cuda:LOCAL_RANK under torchrun), or with fastdata.distributed.init_distributed()'s device")


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """DDP's ``device_ids``: the one GPU this process trains on, or None for CPU modules."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:
        raise ValueError(f"DDP needs an explicit CUDA device index, got {device}")
    return [device.index]


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel when the process group has more than one rank, else ``model`` itself.

    ``device`` is the loader's: DDP replicates, broadcasts and reduces on that GPU."""
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model
    return DistributedDataParallel(model, device_ids=ddp_device_ids(device))


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (in place on a copy); identity in a single process.

    The tensor must live on the loader's device: nccl reduces CUDA tensors only."""
    if is_distributed():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of a tensor over ranks (on a copy); identity in a single process."""
    if is_distributed():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values
