"""Process-group set-up under ``torchrun``, DDP wrapping and reducing per-epoch figures.

Without ``torchrun`` (no ``WORLD_SIZE`` > 1 in the environment) every function here is a cheap no-op
for a single process, so the same script runs alone or distributed.

One node: ``node_group`` gives the ranks of this machine their own process group, and the helpers
after it let them build one thing together (``memory``'s cache per node): exchange small objects
(``gather_objects``), all-gather equal blocks of a tensor in place (``gather_blocks``), close the gaps
of blocks that kept fewer rows (``compact_blocks``), and map one shared-memory file on every rank
(``node_shared_tensor``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .checks import env_integer


def env_world_size() -> int:
    """The world size torchrun announced (``WORLD_SIZE``), before or without a process group; 1 alone."""
    return env_integer("WORLD_SIZE", 1, minimum=1)


def is_distributed() -> bool:
    """Whether a process group of more than one rank is running (what DDP and the reductions need)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank: the process group's, else the launcher's variables as the loaders
    read them (``RANK``; Lightning's ``NODE_RANK``/``LOCAL_RANK``: see ``sampling.distributed_info``),
    so rank 0 alone prints even before the group starts; 0 where they do not say."""
    if is_distributed():
        return dist.get_rank()
    from .sampling import distributed_info

    try:
        return distributed_info()[0]
    except RuntimeError:   # several ranks, no rank variable: a loader refuses this; printing need not
        return 0


def world_size() -> int:
    """Ranks in the running process group; 1 without one."""
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK`` set by torchrun; 0 otherwise)."""
    return env_integer("LOCAL_RANK", 0, minimum=0)


def is_main() -> bool:
    """Rank 0 prints, writes checkpoints and JSON."""
    return rank() == 0


def init_distributed(device=None) -> torch.device:
    """Initialize the process group when launched by ``torchrun``; return this process's device.

    nccl for CUDA, gloo for CPU. On CUDA each process takes its GPU (``config.rank_gpu``:
    ``cuda:LOCAL_RANK``, or ``cuda:0`` where it sees only its own) and makes it the current device
    *before* loaders are built, so ``device=None`` resolves to the right GPU and NCCL does not pile
    every rank onto GPU 0.

    Args:
        device: ``None`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``; an explicit index is
            honoured for single-process runs only.
    """
    from .config import rank_gpu, resolve_device

    want_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if env_world_size() <= 1:
        return resolve_device(device)
    if want_cuda:
        if not torch.cuda.is_available():   # rank_gpu would say "run at most 0 processes per node"
            resolve_device(device)          # raises, naming CUDA's absence and device='cpu'
        index = rank_gpu(local_rank(), torch.cuda.device_count(), device if device is not None else "cuda")
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        dev = resolve_device("cpu")
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", **kwargs)
        if dev.type == "cuda":
            import socket

            # rank_gpu takes cuda:0 where each process sees one GPU, trusting a per-rank
            # CUDA_VISIBLE_DEVICES; a job-wide one (the same GPU for every rank) is caught here.
            me = (socket.gethostname(), str(torch.cuda.get_device_properties(dev).uuid), local_rank(),
                  os.environ.get("CUDA_VISIBLE_DEVICES", ""))
            problem = duplicate_gpus(gather_objects(me))
            if problem:
                raise RuntimeError(problem)
    return dev


def duplicate_gpus(ranks: list) -> str | None:
    """Why two ranks would train on one GPU, or None: ``ranks[r]`` is rank r's (host, GPU uuid,
    LOCAL_RANK, CUDA_VISIBLE_DEVICES)."""
    first: dict[tuple, int] = {}
    for rank, (host, uuid, local, visible) in enumerate(ranks):
        if (host, uuid) in first:
            other = first[(host, uuid)]
            return (f"ranks {other} and {rank} (LOCAL_RANK {ranks[other][2]} and {local}) on {host} would both "
                    f"train on GPU {uuid} (CUDA_VISIBLE_DEVICES={ranks[other][3]!r} and {visible!r}): each "
                    f"process sees one GPU, but not its own; set CUDA_VISIBLE_DEVICES per rank (or not at "
                    f"all, so that rank r takes cuda:LOCAL_RANK), or start as many processes per node as GPUs")
        first[(host, uuid)] = rank
    return None


def cleanup(barrier: bool = True) -> None:
    """Tear the process group down, on every rank together after a successful run, and give gloo's
    worker threads the moment they need to let go of the last collectives' tensors before the
    interpreter shuts down (a quarter of a second, once). Call it last, where a script ends.

    The barrier first: a rank that destroys its group and exits while a peer's gloo threads still
    talk to it can make that peer abort at exit. After a failure pass ``barrier=False``: the peers may
    be inside a collective that never completes, and the barrier would wait for the process group's
    timeout (30 minutes) instead of letting torchrun stop them."""
    _NODE_GROUPS.forget()   # fastdata's own groups go with the default group, not at interpreter exit
    _CPU_GROUPS.forget()
    if dist.is_available() and dist.is_initialized():
        if barrier:
            try:
                dist.barrier()
            except Exception:  # a peer already failed: still release this rank's resources
                pass
        dist.destroy_process_group()
        # Under nccl too: fastdata's preparation and decisions travel over gloo groups of their own.
        _let_gloo_threads_finish()


# How long cleanup() leaves the GIL to gloo's worker threads (see _let_gloo_threads_finish).
GLOO_EXIT_GRACE_S = 0.25


def _let_gloo_threads_finish() -> None:
    """Sleep (the GIL released) for GLOO_EXIT_GRACE_S, so gloo's worker threads drop what they hold.

    A gloo worker thread frees a finished collective after the caller has already been told it is
    done, and a barrier's work also holds the collectives queued before it. Freeing a tensor that
    Python code passed in takes the GIL. When the main thread has meanwhile reached interpreter
    shutdown, CPython 3.11 ends the worker thread inside that C++ destructor (pthread_exit), and
    the process aborts: "terminate called without an active exception", exit -6, after every rank
    had finished its work. Seen about once in 20 3-rank CPU runs on a loaded 2-core machine; the
    core dump shows ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> ~AsyncAllreduceWork ->
    TensorImpl::decref_pyobject -> take_gil -> pthread_exit. destroy_process_group does not stop
    gloo's threads (its shutdown is a no-op), and DDP keeps the group alive until shutdown, so
    there is nothing to join: the drop takes microseconds once the thread runs, and a quarter of a
    second with the GIL free is ample even when 2 cores run several ranks."""
    import time

    time.sleep(GLOO_EXIT_GRACE_S)


def barrier() -> None:
    """Wait for every rank; a no-op in a single process."""
    if is_distributed():
        dist.barrier()


def check_device(device: torch.device) -> None:
    """Under torchrun on CUDA, refuse a device other than this rank's GPU (``config.rank_gpu``).

    Every rank on the same GPU (``cuda:0``, what ``torch.cuda.current_device()`` says before anything
    sets it) would crash NCCL or silently share one GPU; a loader built on the wrong GPU is the usual
    cause, so the error says how loaders pick theirs."""
    from .config import rank_gpu

    device = torch.device(device)
    if env_world_size() <= 1 or device.type != "cuda":
        return
    local = local_rank()
    own = rank_gpu(local, torch.cuda.device_count())
    if device.index != own:
        raise RuntimeError(
            f"under torchrun, rank {rank()} (LOCAL_RANK={local}) must train on cuda:{own}, but its "
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
class _PerWorld:
    """Values made under one default process group (groups fastdata made, the node layout), forgotten
    when that group goes: a group destroyed and started again, as the tests and fit's set-up do, gets
    new ones.

    It holds the default group only by a weak reference, and lets go of its own groups as soon as the
    default group is freed (or ``cleanup`` runs). Holding them past ``destroy_process_group`` kept gloo's
    groups, and their worker threads, alive until the interpreter shut down, where a thread still
    freeing work aborts the process (see ``_let_gloo_threads_finish``; pytorch/pytorch#179291). The
    abort seen in CI came from the default group's threads, which DDP keeps alive anyway: this is not
    its fix, only one thing fewer to free at shutdown."""

    def __init__(self):
        self.values: dict = {}
        self._world = None

    def current(self) -> dict:
        """The values for the default process group now in place (emptied if it changed)."""
        world = dist.group.WORLD
        if self._world is None or self._world() is not world:
            self.values.clear()
            self._world = weakref.ref(world, self._gone)
        return self.values

    def _gone(self, ref) -> None:
        if self._world is ref:   # an older group freed late must not empty a newer group's values
            self.forget()

    def forget(self) -> None:
        """Drop every value and the reference to the default group."""
        self.values.clear()
        self._world = None


# node_group()'s groups, per backend, and node_layout()'s layout.
_NODE_GROUPS = _PerWorld()


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
    cache = _NODE_GROUPS.current()
    if "layout" not in cache:
        keys: list[Any] = [None] * dist.get_world_size()   # filled by the collective
        dist.all_gather_object(keys, node_key())
        nodes: dict = {}
        for r, key in enumerate(keys):
            nodes.setdefault(key, []).append(r)
        cache["layout"] = sorted(nodes.values())
    return cache["layout"]


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
    cache = _NODE_GROUPS.current()
    if name not in cache:
        me, mine = dist.get_rank(), None
        for i, ranks in enumerate(layout):
            g = dist.new_group(ranks, backend=name, group_desc=f"fastdata_node{i}_{name}")
            if me in ranks:
                mine = (g, ranks.index(me), len(ranks))
        cache[name] = mine
    return cache[name]


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` in ``group`` (default: all ranks), in group rank order; ``[obj]`` without a
    process group. Picklable objects only; on an nccl group they travel through the current GPU."""
    if group is None and not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_on_cpu(obj) -> list:
    """Every rank's ``obj`` in rank order, through a gloo group (CPU objects such as RNG states need no
    trip through a GPU under nccl); ``[obj]`` in a single process. Collective: every rank calls it."""
    return gather_objects(obj, group=_cpu_group(None)) if is_distributed() else [obj]


def check_shard(loader, name: str = "train_loader") -> None:
    """``sampling.check_shard`` (a loader sharded for another rank, ranks whose epochs differ), its
    figures gathered over the host: under nccl, ``all_gather_object`` would use the current GPU."""
    from .sampling import check_shard as check

    check(loader, name, gather=gather_on_cpu)


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


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _close(fd) -> None:
    """Close ``fd`` when it is one (None: nothing to close)."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


#: A shared-memory file of a process that is gone, this much older than now, is stale (see below).
STALE_SHARED_SECONDS = 600


def remove_stale_shared_files(directory: str = "/dev/shm") -> list[str]:
    """Remove the ``fastdata-*`` files in ``directory`` that a killed job left: ``node_shared_tensor``
    unlinks its file once every rank has mapped it, and holds an flock on it until then, so one whose
    creating process (the pid in its name) no longer runs here, that is older than
    ``STALE_SHARED_SECONDS`` and whose lock is free can only be a leftover of a SIGKILL or an OOM kill
    during that window (a lock dies with its process; a pid in another container's namespace looks
    dead here, but its lock is still held). Returns the paths removed."""
    import fcntl
    import time

    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if not name.startswith("fastdata-") or len(parts) < 4 or not parts[-2].isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            os.kill(int(parts[-2]), 0)
            continue                     # its process still runs (or is another user's)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue
        try:
            if time.time() - os.stat(path).st_mtime < STALE_SHARED_SECONDS:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # held: its job is setting it up right now
            continue
        else:
            _unlink(path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def _sigterm_raises():
    """While the block runs, SIGTERM raises ``SystemExit(143)`` (the exit status of a SIGTERM'd process)
    instead of killing at once, so that ``finally`` blocks run: SIGTERM is how torchrun, SLURM and
    Docker stop a job, and Python's default action for it exits without unwinding anything.

    Only where SIGTERM's action is the default one, and only in the main thread (the only one that can
    install a handler; elsewhere this does nothing). A handler of the user's is left in place, as it
    already runs Python code here: raising from it unwinds the block, returning lets it go on. An
    ignored SIGTERM stays ignored. The previous action is restored on the way out."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# SIGTERM (a job stopped by torchrun, SLURM, Docker) while the file exists unwinds through the cleanup
# below, like Ctrl-C: the default action would leave it in /dev/shm (RAM) until the next stale sweep.
@_sigterm_raises()
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
    An error, Ctrl-C or SIGTERM (see ``_sigterm_raises``) before it removes the file on the way out; a
    SIGKILL in that window leaves it, and ``remove_stale_shared_files`` clears such leftovers when the
    next cache is shared. A SIGTERM while this rank waits inside a gather takes effect only when the
    gather returns (gloo's wait does not run Python's signal handlers); torchrun's SIGKILL after its
    grace period then leaves the file to that sweep.
    """
    import fcntl
    import secrets

    local = dist.get_rank(group)
    path, fd = None, None
    try:
        why = None
        if local == 0:
            remove_stale_shared_files(directory)
            path = os.path.join(directory, f"fastdata-{tag}-{os.getpid()}-{secrets.token_hex(6)}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                # Held until the file is unlinked: the stale-file sweep of another job (another container
                # sharing /dev/shm, where this pid means nothing) sees the lock and leaves the file alone.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if nbytes:
                    if not hasattr(os, "posix_fallocate"):   # macOS: no way to reserve the pages up front
                        raise OSError(f"os.posix_fallocate is not available on {sys.platform}")
                    os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                why = f"cannot create {nbytes} bytes in {path}: {e.strerror or e}"
        path, why = gather_objects((path, why), group)[0]
        if why is not None:
            return None, path, why
        tensor, mine = None, None
        try:
            tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) if nbytes else \
                torch.empty(0, dtype=torch.uint8)
        except Exception as e:   # another /dev/shm (a container of its own), a permission: private copies
            mine = f"local rank {local} cannot map {path}: {type(e).__name__}: {e}"
        problems = [p for p in gather_objects(mine, group) if p is not None]
    finally:
        # After the second gather every rank has mapped it (or said it cannot). On the way out of a
        # failed creation, an error or an interrupt (Ctrl-C while fallocate zeroes a large file's pages,
        # a peer dying in a gather) the file goes too: /dev/shm is RAM, and nothing else would remove it.
        if local == 0 and path is not None:
            _unlink(path)
            _close(fd)
    if problems:
        return None, path, problems[0]
    return tensor, path, None


# --------------------------------------------------------------- preparation and decisions made once

# Work that one rank does for others (a download, an extraction, a decision such as "is there a
# checkpoint") and whose outcome every rank needs. The outcome travels over a gloo group with its own
# timeout: a download can outlast the default group's (30 minutes for gloo, 10 for nccl), and gloo keeps
# the pickled objects on the host where an nccl group would route them through a GPU.
PREPARE_TIMEOUT = timedelta(hours=24)
# gloo groups by timeout, for the default process group they were made under (see _cpu_group).
_CPU_GROUPS = _PerWorld()


class PreparationError(RuntimeError):
    """Raised on every rank that waited when the rank doing the work for it failed; names that rank,
    its node and the error. The failing rank itself raises its own exception."""


def prepare_per_node(fn, *args, what: str | None = None, timeout: timedelta | None = PREPARE_TIMEOUT, **kwargs):
    """Run ``fn(*args, **kwargs)`` on local rank 0 of every node while the other ranks wait: a download,
    an extraction, a cache written to a node's own disk (Lightning's ``prepare_data_per_node``).

    Every rank of the job must call it (it is a collective). Each node's local rank 0 runs ``fn``; then
    every rank learns every node's outcome. When ``fn`` raised on some node, its rank re-raises its own
    exception and every other rank raises ``PreparationError`` naming the failed rank, its node and the
    error: no rank is left waiting for a preparation that will never come. Without a process group (a
    single process) it just calls ``fn``.

    Nodes are told apart by ``LOCAL_RANK`` (torchrun, Lightning and Ray Train set it): the rank that
    prepares for rank r is r - LOCAL_RANK, which is how those launchers number ranks, node by node.

    Args:
        fn: the preparation; its return value is shared with the node's other ranks, so keep it small
            (a path, a flag, a name): build datasets afterwards, on every rank, from what it prepared.
        what: what is being prepared, for the error messages (default: ``fn``'s name).
        timeout: how long the waiting ranks wait (default 24 hours: a download can take that long).

    Returns:
        ``fn``'s return value on this node's local rank 0, on every rank of the node.
    """
    return _run_and_share(fn, args, kwargs, per_node=True, what=what, timeout=timeout)


def prepare_once(fn, *args, what: str | None = None, timeout: timedelta | None = PREPARE_TIMEOUT, **kwargs):
    """Run ``fn(*args, **kwargs)`` on global rank 0 only while every other rank waits: preparation for a
    filesystem every node shares (one download for the whole job). Failures and the return value are
    shared as in ``prepare_per_node``; without a process group it just calls ``fn``."""
    return _run_and_share(fn, args, kwargs, per_node=False, what=what, timeout=timeout)


def decide_on_main(fn, *args, what: str | None = None, **kwargs):
    """A decision made once: global rank 0 computes ``fn(*args, **kwargs)`` and every rank returns that
    value (or raises, naming rank 0's error, when it failed). For choices the ranks must agree on and
    could answer differently on their own (does the checkpoint exist: each node sees its own disk).
    Every rank must call it; it waits no longer than the process group's own timeout."""
    return _run_and_share(fn, args, kwargs, per_node=False, what=what, timeout=None)


def share_from_main(value, need: bool):
    """Rank 0's ``value`` on every rank that says it ``need``s it; the others get their own ``value``
    back. A collective (every rank calls it); the object is sent only when some rank needs it, over the
    host (gloo), so a checkpoint's bytes never pass through a GPU. A no-op in a single process."""
    if not is_distributed():
        return value
    with_timeout = _cpu_group(None)
    needs = [False] * dist.get_world_size()
    dist.all_gather_object(needs, bool(need), group=with_timeout)
    if not any(needs):
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=with_timeout)
    return box[0] if need else value


def _run_and_share(fn, args, kwargs, *, per_node: bool, what, timeout):
    what = what or getattr(fn, "__name__", "the preparation")
    if not is_distributed():
        if env_world_size() > 1:
            raise RuntimeError(f"{what}: WORLD_SIZE={env_world_size()} but no process group is running, so the "
                               f"ranks that wait cannot be told when it is done: call "
                               f"fastdata.distributed.init_distributed() first")
        return fn(*args, **kwargs)
    import pickle
    import socket

    me = dist.get_rank()
    local = local_rank() if per_node else me
    leader = me - local
    here = {"rank": me, "local_rank": local_rank(), "host": socket.gethostname(),
            "node": os.environ.get("GROUP_RANK")}
    outcome, error = None, None
    if local == 0:
        try:
            result = fn(*args, **kwargs)
            pickle.dumps(result)   # unpicklable here, not in the collective below (the others would hang)
            outcome = ("ok", result)
        except Exception as e:   # reported to every rank; re-raised here below
            outcome, error = ("failed", f"{type(e).__name__}: {e}"), e
    everyone: list[Any] = [None] * dist.get_world_size()   # every rank's (here, outcome), by the collective
    dist.all_gather_object(everyone, (here, outcome), group=_cpu_group(timeout))
    failed = [(who, o[1]) for who, o in everyone if o is not None and o[0] == "failed"]
    if error is not None:
        raise error
    if failed:
        where = "; ".join(f"rank {who['rank']} ({_node_name(who)}): {msg}" for who, msg in failed)
        raise PreparationError(f"{what} failed on {len(failed)} rank(s), which this rank ({me}) waited for: "
                               f"{where}")
    if not 0 <= leader < len(everyone) or everyone[leader][1] is None:
        raise RuntimeError(f"{what}: rank {me} (LOCAL_RANK={local}) expected rank {leader} to prepare for its "
                           f"node, and it did not: the launcher does not number ranks node by node "
                           f"(rank - LOCAL_RANK = the node's first rank); use prepare_once on a shared "
                           f"filesystem instead")
    return everyone[leader][1][1]


def _node_name(who: dict) -> str:
    node = f"node {who['node']}, " if who.get("node") not in (None, "") else ""
    return f"{node}host {who['host']}, LOCAL_RANK {who['local_rank']}"


def _cpu_group(timeout: timedelta | None):
    """A gloo group over every rank with ``timeout`` (None: the default group's timeout), made once per
    timeout and kept until the default group is destroyed: a group destroyed right after a collective
    can close its sockets while a peer still reads from them. Collective the first time (every rank
    calls ``new_group`` in the same order, as the callers above guarantee). The default group itself
    when it is gloo and no timeout is asked for."""
    cache = _CPU_GROUPS.current()
    if timeout is None and "gloo" in str(dist.get_backend()).lower():
        return None
    if timeout not in cache:
        seconds = int(timeout.total_seconds()) if timeout else 0
        cache[timeout] = dist.new_group(backend="gloo", timeout=timeout, group_desc=f"fastdata_cpu_{seconds}")
    return cache[timeout]
