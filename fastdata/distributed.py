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


# ------------------------------------------------------------------------------------ one node
# node_group()'s groups, per backend, for the default process group they were made under (a group
# destroyed and started again, as the tests and fit's set-up do, gets new ones).
_NODE_GROUPS: dict = {}
_NODE_WORLD = None


def node_key() -> str:
    """What names this process's node: the host name, and torchrun's ``GROUP_RANK`` where it is set.

    ``GROUP_RANK`` keeps two torchrun agents on one machine (``--nnodes 2`` on 127.0.0.1, the CI test)
    two nodes, as their ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` say they are; without torchrun (srun, Ray)
    the host name alone groups the processes of a machine."""
    import socket

    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


def node_layout() -> list[list[int]]:
    """The global ranks of every node, nodes ordered by their lowest rank; ``[[0]]`` without a process
    group. Collective under a process group (one all-gather of ``node_key()`` over every rank; cached
    with node_group's groups)."""
    if not is_distributed():
        return [[0]]
    _check_node_cache()
    if "layout" not in _NODE_GROUPS:
        keys = [None] * dist.get_world_size()
        dist.all_gather_object(keys, node_key())
        nodes: dict = {}
        for r, key in enumerate(keys):
            nodes.setdefault(key, []).append(r)
        _NODE_GROUPS["layout"] = sorted(nodes.values())
    return _NODE_GROUPS["layout"]


def _check_node_cache() -> None:
    global _NODE_WORLD
    world = dist.group.WORLD
    if _NODE_WORLD is not world:
        _NODE_GROUPS.clear()
        _NODE_WORLD = world


def node_group(backend: str | None = None):
    """``(group, local rank, local world size)``: a process group of this node's ranks, and this rank's
    place in it. ``(None, 0, 1)`` without a process group of more than one rank.

    Collective the first time for each backend: ``torch.distributed.new_group`` must be entered by every
    rank of the job for every group, in the same order, so every rank creates every node's group (nodes
    ordered by their lowest rank) and keeps its own. Later calls return the cached group. Local ranks
    follow global rank order within the node (torchrun's ``LOCAL_RANK`` order).

    Args:
        backend: the group's backend; None: the default group's. ``"gloo"`` gives host tensors a group
            under an nccl job.
    """
    if not is_distributed():
        return None, 0, 1
    layout = node_layout()
    name = str(backend or dist.get_backend()).lower()
    if name not in _NODE_GROUPS:
        me, mine = dist.get_rank(), None
        for i, ranks in enumerate(layout):
            g = dist.new_group(ranks, backend=name, group_desc=f"fastdata_node{i}_{name}")
            if me in ranks:
                mine = (g, ranks.index(me), len(ranks))
        _NODE_GROUPS[name] = mine
    return _NODE_GROUPS[name]


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` in ``group`` (default: all ranks), in group rank order; ``[obj]`` without a
    process group. Picklable objects only; on an nccl group they travel through the current GPU."""
    if group is None and not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _supports(group, device: torch.device) -> bool:
    """Whether ``group``'s backend runs collectives on tensors of ``device`` without staging."""
    backend = str(dist.get_backend(group)).lower()
    return ("nccl" in backend) if device.type == "cuda" else ("gloo" in backend)


def gather_blocks(t: torch.Tensor, rows: int, group, *, in_place: bool | None = None,
                  chunk_bytes: int = 64 * 2**20) -> None:
    """All-gather equal blocks of rows in place: ``t`` holds ``k * rows`` rows (k: the group's size),
    this rank's block at ``[local * rows, (local + 1) * rows)``; afterwards every block holds its rank's
    rows, on every rank.

    ``in_place`` (default: when the group's backend runs on ``t``'s device, e.g. nccl with CUDA
    tensors): one ``all_gather_single`` whose input is this rank's block of the output, the layout
    NCCL's in-place all-gather defines (torch's concatenation form, FSDP's all-gather): no extra copy of
    anything. Otherwise the rows go in chunks of about ``chunk_bytes`` through a buffer on a device the
    group runs on (a gloo group with CUDA tensors stages through the host), the memory in flight
    bounded by k chunks.
    """
    k, local = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[0] != k * rows:
        raise ValueError(f"gather_blocks: t has {t.shape[0]} rows, not {k} ranks x {rows}")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # renamed in torch 2.13
    if in_place is None:   # gloo on host tensors: chunks (an input inside the output would alias it)
        in_place = t.device.type == "cuda" and _supports(group, t.device) and t.is_contiguous()
    if in_place:
        gather(t, t[local * rows:(local + 1) * rows], group=group)
        return
    stage = t.device if _supports(group, t.device) else (
        torch.device("cpu") if t.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device()))
    per_row = max(1, t[0].numel() * t.element_size()) if rows else 1
    step = max(1, chunk_bytes // per_row)
    for a in range(0, rows, step):
        b = min(a + step, rows)
        mine = t[local * rows + a:local * rows + b].to(stage).contiguous()
        out = torch.empty((k * (b - a), *t.shape[1:]), dtype=t.dtype, device=stage)
        gather(out, mine, group=group)
        for j in range(k):
            if j != local:
                t[j * rows + a:j * rows + b] = out[j * (b - a):(j + 1) * (b - a)]


def compact_blocks(t: torch.Tensor, starts, counts) -> int:
    """Move ``t[starts[j] : starts[j] + counts[j]]`` to follow each other from row 0, in order; return
    the rows kept. Blocks start in increasing order at or after their destination, so each is moved
    forward in pieces no longer than that distance: a piece never overlaps the rows it is copied to."""
    pos = 0
    for start, count in zip(starts, counts):
        if start < pos:
            raise ValueError(f"compact_blocks: block at row {start} starts before row {pos}")
        gap = start - pos
        if gap:
            for a in range(0, count, gap):
                b = min(a + gap, count)
                t[pos + a:pos + b] = t[start + a:start + b]
        pos += count
    return pos


def node_shared_tensor(nbytes: int, group, *, tag: str = "", directory: str = "/dev/shm"):
    """``(uint8 tensor of nbytes, path, None)`` backed by ONE shared-memory file for the ranks of
    ``group`` (this node's, see ``node_group``), or ``(None, path, why)`` where one cannot be made
    (no room in ``directory``, a rank that cannot open it): the caller then keeps a copy per rank.
    Collective over ``group``; rank 0 of the group creates the file.

    The file is created exclusively under a name no other job or loader uses (``tag``, this rank's pid
    and a random token), its pages reserved up front (``posix_fallocate``: a full tmpfs is an error
    here, not a SIGBUS at the first write), mapped by every rank, and unlinked as soon as every rank has
    mapped it. The mappings keep the memory alive; it is freed when the last rank drops the tensor
    (its loader closed or collected), and a crash after that point leaves nothing behind in ``directory``.
    """
    import secrets

    local = dist.get_rank(group)
    path, why = None, None
    if local == 0:
        path = os.path.join(directory, f"fastdata-{tag}-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            why = f"cannot create {nbytes} bytes in {path}: {e.strerror or e}"
            try:
                os.unlink(path)
            except OSError:
                pass
    path, why = gather_objects((path, why), group)[0]
    if why is not None:
        return None, path, why
    tensor, mine = None, None
    try:
        tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) if nbytes else \
            torch.empty(0, dtype=torch.uint8)
    except Exception as e:   # another /dev/shm (a container of its own), a permission: keep private copies
        mine = f"local rank {local} cannot map {path}: {type(e).__name__}: {e}"
    problems = [p for p in gather_objects(mine, group) if p is not None]
    if local == 0:
        try:
            os.unlink(path)
        except OSError:
            pass
    if problems:
        return None, path, problems[0]
    return tensor, path, None
