"""The order of an epoch over tar shards: pure numpy, no I/O, no world size.

Reading shards in a random order of *samples* would touch every shard for every batch; reading them in
packed order would not shuffle at all. So, as MosaicML streaming's ``py1e`` does, the shards are
permuted from ``(seed, epoch)``, cut into windows of ``window`` consecutive (permuted) shards, and the
samples of each window are shuffled among themselves: a reader holds one window of shards at a time,
and a larger window mixes more.

The result is a *global* order of sample ids that does not depend on the number of ranks, so the
existing ``EpochPlan`` (``fastdata.sampling``) slices it into global steps and rank shares: disjoint
ranks and elastic resume (another world or batch size) come for free, as for folders.

Sample ids are the packed order: shard ``j`` holds ids ``[start[j], start[j] + shard_sizes[j])`` with
``start = shard_starts(shard_sizes)``.
"""
from __future__ import annotations

import numpy as np

from ..checks import check_integer
from ..sampling import seed_for

#: Mixed into the seeds so a shard order never equals the plain permutation EpochPlan draws from the same seed.
_SHARD_STREAM, _WINDOW_STREAM = 0x5A4D01, 0x5A4D02


def check_shard_sizes(shard_sizes) -> np.ndarray:
    """``shard_sizes`` as a 1-D int64 array of sample counts >= 0 (an error names the first bad one)."""
    sizes = np.asarray(shard_sizes)
    if sizes.ndim != 1:
        raise ValueError(f"shard_sizes must be 1-D (one sample count per shard), got shape {sizes.shape}")
    if sizes.size and sizes.dtype.kind not in "iu":
        raise ValueError(f"shard_sizes must be integers, got dtype {sizes.dtype}")
    sizes = sizes.astype(np.int64)
    if (sizes < 0).any():
        j = int(np.argmax(sizes < 0))
        raise ValueError(f"shard_sizes[{j}] is {sizes[j]}; a shard holds 0 or more samples")
    return sizes


def shard_starts(shard_sizes) -> np.ndarray:
    """The first global sample id of each shard (packed order), int64."""
    sizes = check_shard_sizes(shard_sizes)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes.size else sizes


def epoch_windows(shard_sizes, seed: int, epoch: int, window: int = 1, shuffle: bool = True) -> list[np.ndarray]:
    """The shards of each window of epoch ``epoch``, in reading order: a list of int64 arrays of shard ids,
    ``window`` shards each (the last may hold fewer). What a reader prefetches and caches together.

    Args:
        shard_sizes: the sample count of each shard, in packed order.
        seed, epoch: integers >= 0; the shard permutation is a pure function of them.
        window: shards per window, >= 1.
        shuffle: False: the packed order, one window after another.
    """
    sizes = check_shard_sizes(shard_sizes)
    seed, epoch = check_integer("seed", seed, minimum=0), check_integer("epoch", epoch, minimum=0)
    window = check_integer("window", window, minimum=1)
    shards = np.arange(len(sizes), dtype=np.int64)
    if shuffle:
        shards = np.random.default_rng(seed_for(seed, epoch, _SHARD_STREAM)).permutation(shards)
    return [shards[i:i + window] for i in range(0, len(shards), window)]


def epoch_order(shard_sizes, seed: int, epoch: int, window: int = 1, shuffle: bool = True) -> np.ndarray:
    """Every global sample id exactly once, in the order epoch ``epoch`` reads them (int64).

    The shards are permuted from ``(seed, epoch)``; the samples of each window of ``window`` consecutive
    permuted shards are shuffled among themselves (each window from its own generator, so a reader can
    compute one window without the others). ``window >= len(shard_sizes)`` is a full shuffle.
    Independent of the world size: slice it with ``EpochPlan`` for ranks and resume.

    Args:
        shard_sizes: the sample count of each shard, in packed order.
        seed, epoch: integers >= 0.
        window: shards per window, >= 1.
        shuffle: False: the packed order ``0 .. N-1``.
    """
    sizes = check_shard_sizes(shard_sizes)
    windows = epoch_windows(sizes, seed, epoch, window, shuffle)
    if not shuffle:
        return np.arange(int(sizes.sum()), dtype=np.int64)
    starts = shard_starts(sizes)
    parts = []
    for w, shards in enumerate(windows):
        ids = np.concatenate([np.arange(starts[j], starts[j] + sizes[j], dtype=np.int64) for j in shards])
        parts.append(np.random.default_rng(seed_for(seed, epoch, _WINDOW_STREAM, w)).permutation(ids))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def subset_epoch_order(sample_shards, seed: int, epoch: int, window: int = 1) -> np.ndarray:
    """``epoch_order`` for a subset of the samples (a ``split()`` part, a ``subset()``): every position
    ``0 .. len(sample_shards) - 1`` once, the shards the subset touches permuted from ``(seed, epoch)``,
    then the positions of each window of ``window`` of those shards shuffled among themselves.

    A plain permutation of a subset's samples would visit its shards in random order sample by sample:
    with a cache smaller than the set, nearly one shard download per sample. Windows over the shards it
    touches keep what ``epoch_order`` keeps: each touched shard read once per epoch, a window at a time.

    Args:
        sample_shards: per position of the subset, the shard its sample is in (int, any order).
        seed, epoch: integers >= 0.
        window: shards per window, >= 1.
    """
    shards = np.asarray(sample_shards, dtype=np.int64)
    if shards.ndim != 1:
        raise ValueError(f"sample_shards must be 1-D (one shard id per sample), got shape {shards.shape}")
    if not len(shards):
        return np.zeros(0, dtype=np.int64)
    _, compact = np.unique(shards, return_inverse=True)   # touched shards renumbered 0 .. k-1, in id order
    by_shard = np.argsort(compact, kind="stable")          # positions grouped by shard, ascending within
    # by_shard is the subset laid out as a pack of its touched shards: that pack's epoch_order, mapped
    # back through it (a permutation draws the same shuffle whatever the values it permutes).
    return by_shard[epoch_order(np.bincount(compact), seed, epoch, window)].astype(np.int64)
