"""The read-ahead (shards/readahead.py) retires what its readers have read, and nothing a pass still reads:
retired, a shard is evicted before any other."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from procs import wait_until


def _idle(ahead) -> bool:
    frame = sys._current_frames().get(ahead._thread.ident)
    return (frame is not None and frame.f_code.co_name == "wait" and frame.f_back.f_code.co_name == "_run"
            and not ahead._wanted)


def _packed(tmp_path):
    from fastdata.datasets import ImageFolder, make_image_folder
    from fastdata.packing import pack

    folder = make_image_folder(tmp_path / "photos", classes=2, per_class=8, size_range=((24, 32), (24, 32)))
    out = tmp_path / "packed"
    pack(ImageFolder(folder), out, shard_size=6000, workers=0, progress=False)   # a photo or two a shard
    return out


def test_a_pass_that_starts_retires_no_shard_its_readers_have_not_read(tmp_path):
    """dali tells read=prefetch_queue_depth: batches in DALI's queue are read already. Not when a pass
    starts on a fresh pipeline (the first pass, a resume, set_epoch, ranks starting together): nothing
    is read then. A shard of the first batches that is cached already (a warm cache_dir, another rank's
    download) was retired at position 0, evicted first by the read-ahead's next download, and read
    from the network again."""
    from fastdata.datasets import Shards
    from fastdata.shards.index import read_index

    out = _packed(tmp_path)
    index = read_index(out)
    largest = max(s.size for s in index.shards)
    order = np.arange(len(index.shard))
    seq = list(dict.fromkeys(index.shards[int(j)].name for j in index.shard[order]))
    first_pos = {}
    for p, j in enumerate(index.shard[order].tolist()):
        first_pos.setdefault(index.shards[j].name, p)
    shards = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=1, cache_limit=3 * largest)
    cache = shards._cache
    try:
        start = seq[0]
        cache.get(start)          # cached before the pass starts: a warm cache_dir, another rank
        cache.release(start)
        read = first_pos[seq[1]]  # "read already": the first shard's samples, which nobody has read
        shards.plan_in_flight(3, read, read=1)
        shards.reading(order, 0)
        assert wait_until(lambda: _idle(shards._prefetcher), timeout=30)
        path = shards.cached_path(start)
        assert os.path.exists(path), "the first shard, unread, was evicted by the read-ahead"
        assert os.stat(path).st_mtime > time.time() - 86400, "the first shard, unread, was retired"
        assert cache.downloads(start) == 1
    finally:
        shards.close()



def test_a_shard_the_last_pass_retired_is_kept_for_the_pass_that_reads_it_next(tmp_path):
    """A shard retired by the last pass stays stamped in the past. When the next pass reaches it while
    it is still cached, the read-ahead's downloads of the shards before it evicted it first (before a
    shard no pass needs), and it was downloaded again: at a cache_limit that holds every shard in
    flight, dali warned "downloaded again within a pass" about 1 run in 4."""
    from fastdata.datasets import Shards
    from fastdata.shards.index import read_index

    out = _packed(tmp_path)
    index = read_index(out)
    size = {s.name: s.size for s in index.shards}
    order = np.arange(len(index.shard))
    seq = list(dict.fromkeys(index.shards[int(j)].name for j in index.shard[order]))
    first_pos = {}
    for p, j in enumerate(index.shard[order].tolist()):
        first_pos.setdefault(index.shards[j].name, p)
    s0, s1, s2, unused = seq[0], seq[1], seq[2], seq[-1]
    # Room for s1 (cached, retired by the last pass), an unused shard and s0 but one byte.
    limit = size[s0] + size[s1] + size[unused] - 1
    assert limit >= 2 * max(size.values())
    shards = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=1, cache_limit=limit)
    cache = shards._cache
    try:
        for name in (unused, s1):
            cache.get(name)
            cache.release(name)
        cache.retire(s1)                          # the last pass finished it
        shards.plan_in_flight(1, first_pos[s2])   # the readers read s0 and s1
        shards.reading(order, 0)
        assert wait_until(lambda: _idle(shards._prefetcher), timeout=30)
        assert os.path.exists(shards.cached_path(s1)), "s1, which this pass reads now, was evicted"
        assert not os.path.exists(shards.cached_path(unused))
        assert cache.downloads(s1) == 1
    finally:
        shards.close()



def _retired(shards, name) -> bool:
    path = shards.cached_path(name)
    return os.path.exists(path) and os.stat(path).st_mtime < time.time() - 86400


def _first_shard(tmp_path):
    """A small pack, its index, the order 0..n-1, its first shard's name and the position of its last sample."""
    from fastdata.shards.index import read_index

    out = _packed(tmp_path)
    index = read_index(out)
    order = np.arange(len(index.shard))
    names = [index.shards[int(j)].name for j in index.shard[order]]
    return out, index, order, names[0], max(p for p, n in enumerate(names) if n == names[0])


def test_over_several_ranks_a_shard_is_retired_one_global_batch_later(tmp_path):
    """A rank tells its position once it has handed out its share of a batch, while another rank's workers
    may still read theirs: a shard whose last sample is in that batch was retired, evicted first, and read
    from the network again by the rank still on it. Over several ranks it is retired a global batch
    later; on one rank at once (at the smallest cache a later retirement evicts shards still to be read)."""
    from fastdata.datasets import Shards

    out, index, order, first, last_of_first = _first_shard(tmp_path)
    for ranks, retired in ((1, True), (2, False)):
        shards = Shards(f"file://{out}", cache_dir=tmp_path / f"cache{ranks}", window=1,   # room: no eviction
                        cache_limit=6 * max(s.size for s in index.shards))
        try:
            shards.plan_in_flight(1, 2, ranks=ranks)   # batches of 2 samples over every rank
            shards.reading(order, 0)
            assert wait_until(lambda s=shards: _idle(s._prefetcher), timeout=30)
            shards.reading(order, last_of_first + 1)   # the batch holding the first shard's last sample told
            assert wait_until(lambda s=shards: _idle(s._prefetcher), timeout=30)
            assert _retired(shards, first) is retired, ranks
            if not retired:
                shards.reading(order, last_of_first + 3)   # one global batch later
                assert wait_until(lambda s=shards: _retired(s, first), timeout=30)
        finally:
            shards.close()


def test_a_shard_held_by_this_process_when_finished_is_retired_once_released(tmp_path):
    """retire() leaves a shard this process holds (dali's reader threads, num_workers=0: its release
    stamps it used): the read-ahead marked it retired anyway and never tried again that pass."""
    from fastdata.datasets import Shards

    out, index, order, first, last_of_first = _first_shard(tmp_path)
    shards = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=1,   # room: no eviction
                    cache_limit=6 * max(s.size for s in index.shards))
    cache = shards._cache
    try:
        shards.plan_in_flight(1, 1)
        shards.reading(order, 0)
        assert wait_until(lambda: _idle(shards._prefetcher), timeout=30)
        cache.get(first)   # a reader of this process still on it
        shards.reading(order, last_of_first + 1)
        assert wait_until(lambda: _idle(shards._prefetcher), timeout=30)
        assert not _retired(shards, first)
        cache.release(first)
        shards.reading(order, last_of_first + 2)
        assert wait_until(lambda: _retired(shards, first), timeout=30), "never retired once released"
    finally:
        shards.close()


def test_the_padding_shards_are_kept_and_fetched_again_for_the_last_step(tmp_path):
    """even_batches pads the pass's last step with the epoch's first samples (``padding``): the first
    shard is not retired when the pass is past it (it was: evicted first, downloaded again at the end),
    and, evicted all the same (a small cache), is fetched again once the last step is in the readers'
    reach. Where the cache cannot hold it with the shards being read, it is retired as before."""
    from fastdata.datasets import Shards

    out, index, order, first, last_of_first = _first_shard(tmp_path)
    n, largest = len(order), max(s.size for s in index.shards)
    names = [index.shards[int(j)].name for j in index.shard[order]]
    assert last_of_first == 0 and len(set(names)) == n   # a photo a shard (all of one size)
    # Two shards being read: with the first, three; a cache of two holds them only (and refuses less).
    for shards_of_cache, kept in ((6, True), (2, False)):
        shards = Shards(f"file://{out}", cache_dir=tmp_path / f"cache{shards_of_cache}", window=1,
                        cache_limit=shards_of_cache * largest)
        try:
            shards.plan_in_flight(1, 2)
            shards.reading(order, 0, padding=1)
            assert wait_until(lambda s=shards: _idle(s._prefetcher), timeout=30)
            shards.reading(order, 2, padding=1)   # past the first two shards: both finished
            assert wait_until(lambda s=shards: _idle(s._prefetcher), timeout=30)
            assert shards._prefetcher._retired[:2].tolist() == [not kept, True], shards_of_cache
            if kept:
                assert os.path.exists(shards.cached_path(first)) and not _retired(shards, first)
        finally:
            shards.close()
    shards = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=1, cache_limit=6 * largest)
    try:
        shards.plan_in_flight(1, 2)
        shards.reading(order, 0, padding=1)
        assert wait_until(lambda: _idle(shards._prefetcher), timeout=30)
        os.unlink(shards.cached_path(first))        # evicted meanwhile
        shards.reading(order, n - 3, padding=1)      # the last step (positions n-1 and the padding) not yet
        assert wait_until(lambda: _idle(shards._prefetcher), timeout=30)
        assert not os.path.exists(shards.cached_path(first))
        shards.reading(order, n - 1, padding=1)      # in reach: fetched again before the readers read it
        assert wait_until(lambda: os.path.exists(shards.cached_path(first)), timeout=30)
    finally:
        shards.close()


def test_a_source_is_told_the_padding_where_its_reading_takes_it():
    """Over two ranks, even_batches and 7 samples a step of 8 leaves the last step short of one sample:
    ``reading_call`` gives it as ``padding`` to a source whose ``reading`` takes it, and calls one
    written before (``order, position[, next_order]``) as before."""
    from fastdata.datasets.base import reading_call
    from fastdata.sampling import EpochPlan

    class Old:
        def reading(self, order, position, next_order=None):
            self.told = (position, next_order is not None)

    class New:
        def reading(self, order, position, next_order=None, padding=0):
            self.told = (position, padding)

    plan = EpochPlan(num_samples=23, batch_size=4, shuffle=False, drop_last=False, seed=0, rank=1,
                     world_size=2, even=True)
    old, new = Old(), New()
    reading_call(old, plan, 0, 0)(plan.order(0), 8)
    reading_call(new, plan, 0, 0)(plan.order(0), 8)
    assert old.told == (8, True) and new.told == (8, 1)
    reading_call(new, plan, 0, 16)(plan.order(0), 16)   # 7 left from a resume at 16: the same padding
    assert new.told == (16, 1)
    uneven = EpochPlan(num_samples=23, batch_size=4, shuffle=False, drop_last=False, seed=0, world_size=2)
    reading_call(new, uneven, 0, 0)(uneven.order(0), 0)
    assert new.told == (0, 0)
