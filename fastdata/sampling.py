"""The order of an epoch: which sample ids each rank reads, in which batches.

All backends draw their batches from here, so order, sharding, drop_last and resume behave the same
whichever backend runs. The order of epoch ``e`` is a pure function of ``(seed, e)``: a resumed run,
another rank, or a rerun computes the same permutation without any saved RNG state.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .checks import check_integer, env_integer


def distributed_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit values, else torch.distributed, else the launcher's variables, else (0, 1).

    Launchers differ in what they export before the process group exists: torchrun and SLURM-style
    launchers set ``RANK``; Lightning's DDP launcher sets only ``LOCAL_RANK``, ``NODE_RANK`` and
    ``WORLD_SIZE``. So the rank is ``RANK``, else ``NODE_RANK`` x ``LOCAL_WORLD_SIZE`` + ``LOCAL_RANK``
    (``LOCAL_RANK`` alone on node 0), and with ``WORLD_SIZE`` > 1 and neither, an error naming what is
    missing: a silent rank 0 of N would read rank 0's shard on every process.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
    else:
        w = env_integer("WORLD_SIZE", 1, minimum=1)
        r = _env_rank(w if world_size is None else world_size, world_size is not None) if rank is None else rank
    return (r if rank is None else rank), (w if world_size is None else world_size)


def _env_rank(world: int, given: bool = False) -> int:
    """The global rank from the launcher's variables (see distributed_info), inside ``world`` ranks
    (``given``: passed as make_loader's ``world_size=``, not read from ``WORLD_SIZE``).

    A rank the variables give that is outside the world is an error naming both: ``RANK=1`` left in a
    shell (or a launcher that exports ``RANK`` and not ``WORLD_SIZE``) read as rank 1 of 1 failed deep
    inside the plan ("rank 1 is outside [0, world_size=1)"), naming no variable."""
    rank, how, unset = _launcher_rank(world)
    if rank < world:
        return rank
    if given or os.environ.get("WORLD_SIZE", "").strip():
        size = f"world_size={world} was passed" if given else f"WORLD_SIZE={world}"
        fix = "the launcher's variables disagree: correct them"
    else:
        size = "WORLD_SIZE is not set (one process)"
        fix = f"launch with torchrun (it sets both), set WORLD_SIZE too, unset {unset} to run one process"
    raise RuntimeError(f"{how} but {size}: rank {rank} is outside [0, {world}); {fix}, or pass rank= and "
                       f"world_size= to make_loader")


def _launcher_rank(world: int) -> tuple[int, str, str]:
    """(rank, the variables it came from, which to unset for one process): see distributed_info."""
    rank = env_integer("RANK", None, minimum=0)
    if rank is not None:
        return rank, f"RANK={rank}", "RANK"
    local, detail = env_integer("LOCAL_RANK", None, minimum=0), ""
    if local is None:
        missing = "RANK (or LOCAL_RANK with NODE_RANK)"
    else:
        node = env_integer("NODE_RANK", 0, minimum=0)
        if node == 0:
            return local, f"LOCAL_RANK={local}", "LOCAL_RANK"
        per_node = env_integer("LOCAL_WORLD_SIZE", None, minimum=1)
        if per_node is not None:
            return (node * per_node + local, f"NODE_RANK={node} x LOCAL_WORLD_SIZE={per_node} + LOCAL_RANK={local}",
                    "NODE_RANK and LOCAL_RANK")
        missing, detail = "LOCAL_WORLD_SIZE", f" (NODE_RANK={node}, LOCAL_RANK={local})"
    if world > 1:
        raise RuntimeError(
            f"WORLD_SIZE={world} but this process's rank is unknown: {missing} is not set{detail}. Build "
            f"the loader after the process group exists (Lightning: in the DataModule's setup() or "
            f"*_dataloader(); accelerate: after Accelerator()), or pass rank= and world_size= to make_loader")
    return 0, "", ""


def seed_for(*parts: int) -> int:
    """A 63-bit seed mixed from integers (seed, epoch, batch, ...); stable across runs and platforms."""
    # int() before the shift: under numpy 1.x, np.uint64 >> (a Python int) promotes to float64 and raises.
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0]) >> 1


# ------------------------------------------------------------------ many generators at once
# Why: a backend that draws a whole epoch's augmentation at once (memory) made one generator per batch,
# ``default_rng(seed_for(...))``: two SeedSequences and a PCG64, 30 us a batch, 8.5 ms of every epoch
# on the H200 machine's host, where the epoch's batches themselves took 10 ms (issue 30). SeedSequence
# is a fixed sequence of 32-bit multiply/xor/shift steps (numpy/random/bit_generator.pyx, after
# M. O'Neill's seed_seq_fe), so it runs for every batch at once as array operations, bit for bit;
# only the PCG64 objects are made one by one. tests/test_sampling.py compares both with numpy's own.
_M32 = 0xFFFFFFFF
_POOL, _XSHIFT = 4, np.uint32(16)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)


def _hash_consts(init: int, mult: int, n: int) -> list:
    """init, init*mult, init*mult^2, ... (n + 1 values, mod 2^32): the hash constant before each step."""
    out = [init]
    for _ in range(n):
        out.append((out[-1] * mult) & _M32)
    return [np.uint32(c) for c in out]


def seed_sequence_words(entropy: np.ndarray, n_words: int) -> np.ndarray:
    """The state numpy's SeedSequence makes from each row of ``entropy``, a (B, L) array of 32-bit words
    (what SeedSequence makes of its entropy first: a list of ints below 2^32 - 1 is one word each, an
    int of 2^32 - 1 or more its little-endian words), as ``generate_state(n_words, np.uint32)``."""
    e = np.asarray(entropy, dtype=np.uint64)
    if e.ndim != 2 or (e.size and int(e.max()) > _M32):
        raise ValueError(f"entropy must be a (B, L) array of 32-bit words, got shape {e.shape}"
                         f"{f' with {int(e.max())}' if e.size else ''}")
    e = e.astype(np.uint32)
    rows, length = e.shape
    steps = _POOL + _POOL * (_POOL - 1) + max(length - _POOL, 0) * _POOL
    hc, k = _hash_consts(_INIT_A, _MULT_A, steps), 0

    def hashmix(v):   # v ^= hash; hash *= MULT_A; v *= hash; v ^= v >> 16
        nonlocal k
        v = (v ^ hc[k]) * hc[k + 1]
        k += 1
        return v ^ (v >> _XSHIFT)

    def mix(x, y):
        r = x * _MIX_L - y * _MIX_R
        return r ^ (r >> _XSHIFT)

    zero = np.zeros(rows, dtype=np.uint32)
    pool = [hashmix(e[:, i] if i < length else zero) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, length):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(e[:, src]))
    hb = _hash_consts(_INIT_B, _MULT_B, n_words)
    out = np.empty((rows, n_words), dtype=np.uint32)
    for i in range(n_words):
        v = (pool[i % _POOL] ^ hb[i]) * hb[i + 1]
        out[:, i] = v ^ (v >> _XSHIFT)
    return out


def _as_uint64(words: np.ndarray) -> np.ndarray:
    """(B, 2k) uint32 words → (B, k) uint64, little-endian pairs, as SeedSequence returns uint64."""
    return np.ascontiguousarray(words).astype("<u4").view("<u8").astype(np.uint64)


def seeds_for(fixed: tuple, varying: np.ndarray, at: int) -> np.ndarray:
    """``[seed_for(*fixed[:at], v, *fixed[at:]) for v in varying]`` as one uint64 array."""
    varying = np.asarray(varying, dtype=np.int64)
    cols = [np.full(len(varying), int(p) & _M32, dtype=np.uint64) for p in fixed]
    cols.insert(at, (varying & _M32).astype(np.uint64))
    e = np.stack(cols, 1) if cols else np.empty((0, 0), dtype=np.uint64)
    whole = (e < _M32).all(1)   # a part equal to 2^32 - 1 is two words: numpy's own path
    out = np.empty(len(varying), dtype=np.uint64)
    out[whole] = _as_uint64(seed_sequence_words(e[whole], 4))[:, 0] >> np.uint64(1)
    for i in np.flatnonzero(~whole).tolist():
        out[i] = seed_for(*fixed[:at], int(varying[i]), *fixed[at:])
    return out


class _Words(np.random.bit_generator.ISeedSequence):
    """A seed sequence whose state is already computed: what PCG64 asks of ``SeedSequence(seed)``."""

    def __init__(self, words: np.ndarray):
        self.words = words

    def generate_state(self, n_words, dtype=np.uint32):
        if n_words != len(self.words) or np.dtype(dtype) != np.uint64:
            raise ValueError(f"_Words holds {len(self.words)} uint64 words, asked for {n_words} {dtype}")
        return self.words


def generators_for(seeds: np.ndarray) -> list:
    """``[np.random.default_rng(int(s)) for s in seeds]`` (the same streams), the seeding done at once."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    two = seeds >= np.uint64(_M32)   # numpy's entropy of such a seed: its low and high 32-bit words
    out: list = [None] * len(seeds)
    idx = np.flatnonzero(two)
    if len(idx):
        pairs = np.stack([seeds[idx] & np.uint64(_M32), seeds[idx] >> np.uint64(32)], 1)
        words = _as_uint64(seed_sequence_words(pairs, 8))   # PCG64 takes 4 uint64 words
        for j, i in enumerate(idx.tolist()):
            # numpy takes any ISeedSequence (BitGenerator.__init__); its stubs name SeedSequence only
            out[i] = np.random.Generator(np.random.PCG64(_Words(words[j])))  # type: ignore[arg-type]
    for i in np.flatnonzero(~two).tolist():   # seeds below 2^32 - 1: one word (1 in 2^31 of them)
        out[i] = np.random.default_rng(int(seeds[i]))
    return out


@dataclass(frozen=True)
class EpochPlan:
    """Batches of sample ids for one rank.

    With ``drop_last=True`` every rank gets ``N // (world * batch)`` full batches; the rest of the
    permutation is not read this epoch (a new permutation next epoch reaches it).
    With ``drop_last=False`` every sample is read exactly once across ranks: the final global step's
    remainder is split as evenly as possible, so every rank has the same number of batches and at most
    the last one is smaller (it is empty on a rank only when fewer samples than ranks remain).
    ``even`` (``drop_last=False``): the last step is split in equal contiguous parts instead, padded at
    its end with samples from the start of the epoch's order, as DistributedSampler pads: every rank's
    last batch has the same size (collectives that need equal shapes work), the ranks' batches laid end
    to end in rank order are the epoch's order, and the first ``remainder()`` samples of the gathered
    last step are the real ones.
    """

    num_samples: int
    batch_size: int
    shuffle: bool
    drop_last: bool
    seed: int
    rank: int = 0
    world_size: int = 1
    even: bool = False
    #: The source's own shuffled order, ``(seed, epoch) -> ids`` or None (``Source.epoch_order``: shards
    #: are shuffled by windows of shards); None → a permutation of every sample.
    order_fn: Callable[[int, int], np.ndarray | None] | None = field(default=None, compare=False, repr=False)
    #: ``batches_from``'s latest results, ``(epoch, offset) -> batches`` (read-only arrays). Why: a
    #: loader computes the next epoch's batches ahead (memory's draws thread, dali's feeder) and the
    #: next ``iter()`` asks for them again on the training thread, where a permutation of 60,000 ids
    #: cost 1-1.6 ms of counted data wait each epoch (issue 30). Not pickled (see __getstate__).
    _made: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        check_integer("num_samples", self.num_samples, minimum=0)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, world_size={self.world_size})")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_made"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _made={})

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks."""
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return -(-self.num_samples // self.global_batch)

    def order(self, epoch: int) -> np.ndarray:
        """Every sample id in epoch ``epoch``'s order (shuffled from ``(seed, epoch)`` when shuffle is on)."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        own = self.order_fn(self.seed, epoch) if self.order_fn is not None else None
        if own is not None:
            return np.asarray(own, dtype=np.int64)
        return np.random.default_rng(seed_for(self.seed, epoch)).permutation(self.num_samples).astype(np.int64)

    def samples_read(self) -> int:
        """Samples one epoch reads over all ranks: all of them, or with ``drop_last`` the full steps."""
        return len(self) * self.global_batch if self.drop_last else self.num_samples

    def offset_of(self, batch: int) -> int:
        """The global sample offset (into the epoch's order) at which this plan's batch ``batch`` starts."""
        return min(batch * self.global_batch, self.samples_read())

    def batches(self, epoch: int, start: int = 0) -> list[np.ndarray]:
        """This rank's batches of epoch ``epoch``, from batch ``start`` on (resume skips, never decodes)."""
        n_batches = len(self)
        if not 0 <= start <= n_batches:
            raise ValueError(f"start batch {start} is outside [0, {n_batches}]")
        return self.batches_from(epoch, self.offset_of(start))

    def batches_from(self, epoch: int, offset: int) -> list[np.ndarray]:
        """This rank's batches of the rest of epoch ``epoch`` after its first ``offset`` samples (over all
        ranks, in the epoch's order).

        This is how a position saved under another world size or batch size resumes (elastic resume):
        the order is one global permutation per (seed, epoch), so the samples not yet read are
        ``order[offset:]`` whatever the layout that read the first ``offset``; they are re-split into
        this plan's steps. With ``drop_last=False`` every one of them is read exactly once and every rank
        gets the same number of batches (the last step split evenly); with ``drop_last=True`` only full
        steps are read, as in any epoch.
        """
        if not 0 <= offset <= self.num_samples:
            raise ValueError(f"sample offset {offset} is outside [0, {self.num_samples}]")
        key = (epoch, offset)
        made = self._made.get(key)   # a dict's get and set are atomic: the threads that ask share it
        if made is not None:
            return list(made)
        out = self._split(epoch, offset)
        for ids in out:   # shared by every caller from now on: a write raises instead of changing them
            ids.flags.writeable = False
        if len(self._made) >= 4:   # this epoch's and the next, under a resume or set_epoch a few more
            self._made.clear()
        self._made[key] = tuple(out)
        return out

    def _split(self, epoch: int, offset: int) -> list[np.ndarray]:
        rest = self.order(epoch)[offset:]
        gb = self.global_batch
        steps = len(rest) // gb if self.drop_last else -(-len(rest) // gb)
        out = []
        for b in range(steps):
            step = rest[b * gb:(b + 1) * gb]
            if len(step) == gb:
                out.append(step[self.rank * self.batch_size:(self.rank + 1) * self.batch_size])
            elif self.even and self.world_size > 1:  # equal parts, the padding at the end of the step
                part = -(-len(step) // self.world_size)
                pad = part * self.world_size - len(step)
                step = np.concatenate([step, np.resize(self.order(epoch), pad)])
                out.append(step[self.rank * part:(self.rank + 1) * part])
            else:  # the partial last step (drop_last=False): split evenly over the ranks
                out.append(np.array_split(step, self.world_size)[self.rank])
        return out

    def remainder(self, offset: int = 0) -> int:
        """Real samples in the last step of a pass from ``offset`` when it is partial, else 0 (what
        accelerate calls the remainder: the gathered last step's first ``remainder`` are real)."""
        return 0 if self.drop_last else (self.num_samples - offset) % self.global_batch

    def padding(self, offset: int = 0) -> int:
        """Samples of padding at the end of this rank's last batch in a pass from ``offset``: with ``even``
        the last step is split in equal parts and padded at its end, so the last ranks' parts end in
        samples other ranks read; 0 without padding. A metric that sums over ranks leaves them out."""
        total = self.padded(offset)
        if not total:
            return 0
        rest = self.remainder(offset)
        part = (rest + total) // self.world_size
        return part - min(part, max(0, rest - self.rank * part))

    def padded(self, offset: int = 0) -> int:
        """Samples of padding in the last step of a pass from ``offset``, over every rank: with ``even``
        the step is filled up to equal parts with the epoch's first ``padded`` samples (``batches_from``),
        which the pass so reads again at its end; 0 without padding."""
        rest = self.remainder(offset)
        if not (self.even and self.world_size > 1 and rest):
            return 0
        return -(-rest // self.world_size) * self.world_size - rest

    def rank_samples(self) -> int:
        """Samples this rank reads in a whole epoch (padding included), as ``len(DistributedSampler)``."""
        full, rest = divmod(self.num_samples, self.global_batch)
        if self.drop_last or rest == 0:
            return full * self.batch_size
        if self.even:
            return full * self.batch_size + -(-rest // self.world_size)
        return full * self.batch_size + rest // self.world_size + (self.rank < rest % self.world_size)

    def consumed(self, offset: int, batches: int) -> int:
        """The global sample offset after ``batches`` more steps of this plan from ``offset``."""
        return min(offset + batches * self.global_batch, self.num_samples)

    def batch_seed(self, epoch: int, batch: int) -> int:
        """Seed of the random augmentation of one batch: independent of workers, threads and resume."""
        return seed_for(self.seed, epoch, batch, self.rank, 0x5EED)

    def batch_seeds(self, epoch: int, first: int, count: int) -> np.ndarray:
        """``batch_seed`` of batches ``first .. first + count - 1`` (uint64), computed at once
        (``seeds_for``: 60x less host time than one by one, before a pass's first batch)."""
        return seeds_for((self.seed, epoch, self.rank, 0x5EED), np.arange(first, first + count), at=2)

    def batch_rngs(self, epoch: int, first: int, count: int) -> list:
        """The generators of batches ``first .. first + count - 1``: ``default_rng(batch_seed(...))``
        each, the same streams, seeded at once (``generators_for``)."""
        return generators_for(self.batch_seeds(epoch, first, count))


def check_shard(loader, name: str = "train_loader", gather: Callable[[Any], list] | None = None) -> None:
    """Under a running process group, refuse a fastdata loader whose shard was planned for another rank
    or world size than its process has in the group, or whose epoch differs between ranks. A collective
    when it checks (every rank calls it with its own loader); nothing without a group, and nothing for a
    loader that is not fastdata's (no ``plan``).

    A loader takes its rank and world size when it is built. One built before ``init_process_group`` by
    a script that starts the group itself (``torch.multiprocessing.spawn``: no launcher variables) is
    rank 0 of 1 on every process: every rank reads the whole epoch in the same order, DDP averages N
    copies of one gradient, and the run is a single process's at N times the cost, without a word. A
    rank and world size passed to ``make_loader`` are the caller's choice and are not checked.

    Ranks whose loaders count different batches (each node's own copy of the data, one of them stale;
    another batch_size) fall out of step: the rank that ends its epoch first waits in a collective its
    peers never join, until the process group's timeout (30 minutes), saying nothing.

    ``gather(obj)``: every rank's ``obj`` in rank order (``fastdata.distributed.check_shard`` passes
    its gloo path, so nothing goes through a GPU); default ``all_gather_object`` on the default group."""
    import torch.distributed as dist

    plan, config = getattr(loader, "plan", None), getattr(loader, "config", None)
    if not isinstance(plan, EpochPlan) or not (dist.is_available() and dist.is_initialized()):
        return
    chosen = getattr(config, "rank", None) is not None or getattr(config, "world_size", None) is not None
    world = dist.get_world_size()
    if chosen and plan.world_size != world:
        return   # the caller shards over a group of its own
    mine = (plan.rank, plan.world_size, len(loader), plan.num_samples, plan.batch_size)
    if gather is None:
        every: list = [None] * world   # filled by the collective
        dist.all_gather_object(every, mine)
    else:
        every = gather(mine)
    stale = [r for r, (a, b, *_) in enumerate(every) if (a, b) != (r, world)]
    if stale and not chosen:
        r = stale[0]
        a, b = every[r][:2]
        what = ("every rank would read every sample of each epoch, in the same order" if b == 1
                else "the ranks' shards would overlap and leave samples out")
        raise RuntimeError(
            f"{name} was built as rank {a} of {b}, but the process that holds it is rank {r} of {world} in "
            f"the process group: {what}. Build the loaders after the process group exists (after "
            f"init_process_group, or fastdata.distributed.init_distributed()), or pass rank= and world_size= "
            f"to make_loader")
    if len({e[2:] for e in every}) > 1:
        ranks = "; ".join(f"rank {r}: {n} batches of {b} from {s} samples" for r, (_, _, n, s, b) in enumerate(every))
        raise RuntimeError(
            f"{name} differs between ranks ({ranks}): the ranks would fall out of step (in training, the rank "
            f"that ended its epoch first would wait for the others in a collective they never join, until the "
            f"process group's timeout). Every rank must read the same data with the same batch_size (a node "
            f"with its own copy of the data: check that the copies are the same)")
