import numpy as np
import pytest

from fastdata.sampling import EpochPlan
from fastdata.shards.order import epoch_order, epoch_windows, shard_starts

SIZES = [5, 3, 0, 7, 4, 6, 2, 5]   # an empty shard too: a rank's last shard may hold nothing


def _shard_of(ids, sizes):
    return np.searchsorted(np.cumsum(sizes), ids, side="right")


@pytest.mark.parametrize("window", [1, 2, 3, len(SIZES), 100])
def test_every_sample_exactly_once(window):
    order = epoch_order(SIZES, seed=3, epoch=1, window=window)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(sum(SIZES)))


def test_same_seed_and_epoch_same_order_new_epoch_or_seed_new_order():
    a = epoch_order(SIZES, seed=7, epoch=2, window=2)
    assert np.array_equal(a, epoch_order(SIZES, seed=7, epoch=2, window=2))
    assert not np.array_equal(a, epoch_order(SIZES, seed=7, epoch=3, window=2))
    assert not np.array_equal(a, epoch_order(SIZES, seed=8, epoch=2, window=2))


@pytest.mark.parametrize("window", [1, 2, 3])
def test_samples_of_a_window_come_only_from_its_shards(window):
    order = epoch_order(SIZES, seed=1, epoch=4, window=window)
    windows = epoch_windows(SIZES, seed=1, epoch=4, window=window)
    assert sorted(np.concatenate(windows).tolist()) == list(range(len(SIZES)))
    pos = 0
    for shards in windows:
        n = int(np.asarray(SIZES)[shards].sum())
        assert set(_shard_of(order[pos:pos + n], SIZES).tolist()) <= set(shards.tolist())
        assert len(set(_shard_of(order[pos:pos + n], SIZES).tolist())) == sum(SIZES[j] > 0 for j in shards)
        pos += n
    assert pos == sum(SIZES)


def test_window_one_reads_each_shard_contiguously_but_shuffled_inside():
    sizes = [50] * 6
    order = epoch_order(sizes, seed=0, epoch=0, window=1)
    shards = _shard_of(order, sizes)
    assert (np.diff(shards) != 0).sum() == len(sizes) - 1              # one run per shard
    assert shards.tolist() != sorted(shards.tolist())                   # shards permuted
    assert not np.array_equal(order[:50], np.sort(order[:50]))          # samples shuffled within


def test_window_of_all_shards_is_a_full_shuffle():
    sizes = [100] * 10
    order = epoch_order(sizes, seed=0, epoch=0, window=len(sizes))
    # A full shuffle mixes shards from the first sample on: the first 100 come from almost every shard.
    assert len(set(_shard_of(order[:100], sizes).tolist())) >= 8
    narrow = epoch_order(sizes, seed=0, epoch=0, window=1)
    assert len(set(_shard_of(narrow[:100], sizes).tolist())) == 1


def test_shuffle_false_is_the_packed_order():
    assert epoch_order(SIZES, seed=5, epoch=9, window=2, shuffle=False).tolist() == list(range(sum(SIZES)))
    assert [w.tolist() for w in epoch_windows(SIZES, 5, 9, window=3, shuffle=False)] == \
        [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_shard_starts():
    assert shard_starts(SIZES).tolist() == [0, 5, 8, 8, 15, 19, 25, 27]
    assert shard_starts([]).tolist() == []


@pytest.mark.parametrize("world", [1, 2, 3])
def test_epoch_plan_slices_the_global_order_into_disjoint_rank_shares(world):
    # The order does not depend on the world size; EpochPlan's rank slices of it cover every sample once.
    order = epoch_order(SIZES, seed=2, epoch=0, window=2)
    n = sum(SIZES)
    seen = []
    for rank in range(world):
        # shuffle=False: EpochPlan's batches are positions in the order, which epoch_order fills.
        plan = EpochPlan(num_samples=n, batch_size=2, shuffle=False, drop_last=False, seed=0, rank=rank,
                         world_size=world)
        for batch in plan.batches(0):
            seen += order[batch].tolist()
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("kwargs, match", [
    (dict(shard_sizes=[[1, 2]]), "1-D"),
    (dict(shard_sizes=[1.5, 2]), "integers"),
    (dict(shard_sizes=[3, -1]), r"shard_sizes\[1\] is -1"),
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(epoch=1.0), "epoch must be an integer >= 0"),
    (dict(window=0), "window must be an integer >= 1"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(shard_sizes=SIZES, seed=0, epoch=0, window=1) | kwargs
    with pytest.raises(ValueError, match=match):
        epoch_order(**args)


def test_a_subsets_order_is_windows_over_the_shards_it_touches():
    from fastdata.shards.order import subset_epoch_order

    rng = np.random.default_rng(0)
    shard_of_id = np.repeat(np.arange(len(SIZES)), SIZES)
    picked = rng.permutation(sum(SIZES))[:20]            # a subset, in an arbitrary order
    shards = shard_of_id[picked]
    for window in (1, 2, 3):
        order = subset_epoch_order(shards, seed=4, epoch=1, window=window)
        assert sorted(order.tolist()) == list(range(20))
        seq = shards[order]
        # Reading in order, once a shard is left it is never come back to, and at most `window` shards
        # are open at once: a shard's samples lie within one window's stretch.
        runs = [int(s) for k, s in enumerate(seq) if k == 0 or s != seq[k - 1]]
        if window == 1:
            assert len(runs) == len(set(shards.tolist()))
        for s in set(runs):
            first, last = np.flatnonzero(seq == s)[[0, -1]]
            assert len(set(seq[first:last + 1].tolist())) <= window
        assert np.array_equal(order, subset_epoch_order(shards, seed=4, epoch=1, window=window))
    assert not np.array_equal(subset_epoch_order(shards, 4, 1, 2), subset_epoch_order(shards, 4, 2, 2))
    # Over every sample in packed order (and no empty shard) it is the full set's own order.
    full = [5, 3, 7, 4]
    assert np.array_equal(subset_epoch_order(np.repeat(np.arange(4), full), 9, 3, 2),
                          epoch_order(full, seed=9, epoch=3, window=2))
