"""Shards over HTTP with the smallest cache its window allows, read by loaders whose readers run ahead of
the training step (``Shards.plan_in_flight``): no shard is downloaded twice in a pass, and a cache too
small for what is in flight says so once. Downloads are counted by the test's HTTP server on 127.0.0.1."""
from __future__ import annotations

import collections
import warnings

import pytest

from conftest import BACKENDS
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, Shards, make_image_folder
from shard_servers import http_server

pytestmark = pytest.mark.requires("fsspec", "aiohttp")

NONE = Augmentation(crop="center", size=16)
@pytest.fixture(scope="module")
def small_shards(tmp_path_factory):
    """120 small photos in 3 classes, packed about 7 to a shard (17 shards)."""
    from fastdata.packing import pack

    root = tmp_path_factory.mktemp("in_flight")
    folder = make_image_folder(root / "photos", classes=3, per_class=40, seed=1, size_range=((40, 48), (32, 40)))
    sizes = sorted(p.stat().st_size for p in folder.rglob("*.jpg"))
    out = root / "packed"
    pack(ImageFolder(folder), out, shard_size=10 * (sizes[len(sizes) // 2] + 1024), workers=0, progress=False)
    return out


def _passes(server, shards, loader, epochs: int) -> list[dict]:
    """Per pass, the shards downloaded more than once for it: a download is for the pass that next reads
    the shard, from where the training step is when it is made (the samples handed out). One made
    after this pass's last read of the shard (the next epoch's first shards, fetched ahead while this
    pass ends, or read by dali's stream) is the next pass's."""
    import numpy as np

    for_pass: list[collections.Counter] = [collections.Counter() for _ in range(epochs + 1)]
    for epoch in range(epochs):
        order = loader.plan.order(epoch)
        last = {}   # shard name -> the position of its last sample in this pass
        for position, j in enumerate(shards.index.shard[np.asarray(order)]):
            last[shards.index.shards[int(j)].name] = position
        marks, start = [], len(server.requests)
        for _ in loader:
            marks.append(len(server.requests))   # requests made before the training step had this batch
        assert len(marks) == len(loader)
        for r, (method, path, _) in enumerate(server.requests[start:], start):
            name = path.rsplit("/", 1)[-1]
            if method == "GET" and name in last:
                # The samples handed out before it (batches of them: a position is a sample's)
                position = int(np.searchsorted(marks, r, side="right")) * loader.plan.global_batch
                for_pass[epoch if position <= last[name] else epoch + 1][name] += 1
    return [{name: n for name, n in gets.items() if n > 1} for gets in for_pass[:epochs]]


def _read(packed, tmp_path, backend: str, *, window: int, cache_shards: int, batch: int, epochs: int, **options):
    """``epochs`` passes of ``backend`` (2 workers, its ``options``) over ``packed`` served by HTTP, through a
    cache of ``cache_shards`` of its largest shard: (``_passes``' shards downloaded twice, the "downloaded
    again" warnings (``warnings.WarningMessage``), the largest shard's size)."""
    from fastdata.shards.index import read_index

    largest = max(s.size for s in read_index(packed).shards)
    with http_server(packed) as server, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shards = Shards(server.url, cache_dir=tmp_path / "cache", window=window, cache_limit=cache_shards * largest)
        with make_loader(shards, backend, batch_size=batch, device="cpu", augment=NONE, num_workers=2,
                         seed=5, **options) as loader:
            try:
                twice = _passes(server, shards, loader, epochs=epochs)
            finally:
                shards.close()
    return twice, [w for w in caught if "downloaded again" in str(w.message)], largest


@pytest.mark.parametrize("backend, options", [(b, o) for b, o in (("torch", {}), ("dali", {}),
                                                                   ("dali", {"driver": "thread"})) if b in BACKENDS])
def test_no_shard_is_downloaded_twice_in_a_pass_at_the_smallest_cache(small_shards, tmp_path, backend, options):
    """The backend tells the source its batches in flight (torch: 2 workers x prefetch_factor 2 + 1; dali
    on the CPU: 2 x prefetch_queue_depth 2 + 2, 2 of them decoded already; with a driver thread 3 more,
    none surely read: told it as read, the thread's empty queue let 15-17 of 17 shards be retired under
    the readers and downloaded again each pass). window=2 and 2 windows of
    cache: the readers are up to 6 samples past the training step, inside
    the next window, and the read-ahead fetched the shards they had finished (downloaded again once
    evicted) while the cache evicted, least recently used first, shards fetched ahead and not read yet
    before the finished ones: torch downloaded 2-3 shards twice in 3 passes, dali 4-7."""
    twice, said, _ = _read(small_shards, tmp_path, backend, window=2, cache_shards=4, batch=1, epochs=3, **options)
    assert twice == [{}, {}, {}] and not said, (twice, said)   # a cache that holds them says nothing


@pytest.mark.skipif("torch" not in BACKENDS, reason="the torch backend is not available")
def test_a_cache_too_small_for_the_batches_in_flight_says_so_once(small_shards, tmp_path):
    """window=1 and 2 shards of cache, while two workers read 8-photo batches 5 ahead (about 6 shards):
    shards come back evicted and are downloaded again. Said once, naming cache_limit and what it takes."""
    twice, caught, largest = _read(small_shards, tmp_path, "torch", window=1, cache_shards=2, batch=8, epochs=2)
    said = [str(w.message) for w in caught]
    assert any(twice), "the cache held every shard in flight: nothing to say"
    assert len(said) == 1, said
    assert f"cache_limit={2 * largest}" in said[0] and "plan_in_flight" in said[0] and "at least" in said[0]
    # Where the user's loop is (here: _passes' loop over the loader), not a line inside fastdata (a
    # fixed stacklevel named datasets/shards.py, Shards.reading's call of the read-ahead).
    assert caught[0].filename == __file__, (caught[0].filename, caught[0].lineno)


def test_plan_in_flight_refuses_what_is_not_a_count(small_shards):
    shards = Shards(small_shards)
    with pytest.raises(ValueError, match="batches"):
        shards.plan_in_flight(-1, 8)
    with pytest.raises(ValueError, match="read"):
        shards.plan_in_flight(2, 8, read=2)        # every batch in flight read already: none being read
    shards.plan_in_flight(0, 8)                     # a loader that reads nothing ahead
    shards.close()


class _Told(Shards):
    """Shards that records what each loader tells its ``plan_in_flight``."""

    def plan_in_flight(self, batches: int, batch_size: int, read: int = 0, ranks: int = 1) -> None:
        self.told = [*getattr(self, "told", []), (batches, batch_size, read, ranks)]
        super().plan_in_flight(batches, batch_size, read, ranks)


@pytest.mark.parametrize("backend, options, batches", [
    ("torch", {}, 2 * 3 + 1),                      # workers x prefetch_factor + the batch handed out
    ("prefetch", {"depth": 4}, 2 * 3 + 1 + 4 + 1),  # and the stage's queue and the batch its thread holds
])
def test_a_loader_tells_the_source_its_batches_in_flight_once(small_shards, backend, options, batches):
    """prefetch (torch's DataLoader plus a stage) told the span twice: torch's own, then its own, which
    replaced it. Built on the CPU: the stage runs there without streams, and nothing is read here."""
    shards = _Told(small_shards)
    try:
        with make_loader(shards, backend, batch_size=4, device="cpu", augment=NONE, num_workers=2,
                         prefetch_factor=3, **options):
            assert shards.told == [(batches, 4, 0, 1)]
    finally:
        shards.close()


def test_a_pass_over_an_order_at_the_last_ones_address_is_a_new_pass(small_shards, tmp_path):
    """Each pass's order is a new array of the same size, which the allocator often puts where the last
    one was freed: told apart by id() alone, the next pass read as the last one going on, its shards
    counted as fetched already (none fetched ahead) and its positions mapped through the old order.
    Here the next epoch's order is written into the same array (the same object): told from the start
    again, it is a new pass, and its first shards are fetched."""
    import os
    import sys

    from fastdata.shards.index import read_index
    from procs import wait_until

    def idle(thread):
        frame = sys._current_frames().get(thread.ident)
        return frame is not None and frame.f_code.co_name == "wait" and frame.f_back.f_code.co_name == "_run"

    shards = Shards(f"file://{small_shards}", cache_dir=tmp_path / "cache", window=1,
                    cache_limit=10 * max(s.size for s in read_index(small_shards).shards))
    try:
        order = shards.epoch_order(3, 0).copy()
        for position in range(0, len(order) + 1, 7):
            shards.reading(order, min(position, len(order)))
        order[:] = shards.epoch_order(3, 1)        # the next pass, in the same array
        for f in (tmp_path / "cache").glob("*.tar"):
            f.unlink()                              # nothing cached: what the next pass fetches shows
        shards.reading(order, 0)
        ahead = shards._prefetcher
        assert wait_until(lambda: idle(ahead._thread) and not ahead._wanted, timeout=30)
        first = shards.index.shards[int(shards.index.shard[order[0]])].name
        assert os.path.exists(shards.cached_path(first)), (first, ahead.error)
    finally:
        shards.close()



@pytest.mark.skipif("torch" not in BACKENDS, reason="the torch backend is not available")
def test_the_shards_of_even_batches_padding_are_kept_for_the_last_batch(small_shards, tmp_path):
    """Two ranks of a node (one process here, each with its own source over one cache_dir), even_batches
    and 119 samples: the last step (7 samples) is padded with the epoch's first sample, which rank 1's
    last batch reads. The read-ahead retired that sample's shard once the pass was past it (evicted
    first), and the last batch downloaded it again: twice in the pass. Kept now (not retired) in a cache
    of 8 shards, room for the shards in flight (up to 3: 8 samples from the position, shards of about 7),
    those another rank may still read (one global batch more, up to 2), window=2 ahead and the padding's
    one, it is downloaded once. (The next epoch starts with other shards: none of its fetches count.)"""
    import numpy as np

    from fastdata.shards.index import read_index

    largest = max(s.size for s in read_index(small_shards).shards)
    with http_server(small_shards) as server:
        sources = [Shards(server.url, cache_dir=tmp_path / "cache", window=2, cache_limit=8 * largest)
                   for _ in range(2)]
        ranks = [s.subset(range(119)) for s in sources]
        loaders = [make_loader(r, "torch", batch_size=4, device="cpu", augment=NONE, num_workers=0, seed=5,
                               drop_last=False, rank=rank, world_size=2, even_batches=True)
                   for rank, r in enumerate(ranks)]
        try:
            plan = loaders[1].plan
            assert plan.padding() == 1   # 119 = 14 steps of 8 + 7 real, split 4 + 4 with one padding sample
            order = plan.order(0)
            index = sources[0].index   # the subset's sample i is the source's sample i
            padding = index.shards[int(index.shard[order[0]])].name
            start = len(server.requests)
            for _ in zip(*loaders):
                pass
            gets = [path for method, path, _ in server.requests[start:] if method == "GET"]
            assert sum(path.endswith("/" + padding) for path in gets) == 1, (padding, gets)
            assert len(np.unique([p.rsplit("/", 1)[-1] for p in gets])) >= 17   # every shard was read
        finally:
            for thing in loaders + ranks + sources:
                thing.close()


def test_two_ranks_at_the_smallest_cache_download_each_shard_once_in_a_pass(small_shards, tmp_path):
    """Two ranks of a node sharing the smallest cache (2 x window shards), read side by side: a shard is
    retired one global batch after a rank has read it (another rank may still read it), and until then
    it counts among the shards being read when the read-ahead sizes its window. Without that, the
    read-ahead fetched past it, the other rank's shard was evicted under it, and 9-11 of the 17 shards
    were downloaded twice in the pass, with the warning. Only the next epoch's first shards, fetched
    while this pass ends, may be downloaded again (for the next pass)."""
    import numpy as np

    from fastdata.shards.index import read_index

    largest = max(s.size for s in read_index(small_shards).shards)
    with http_server(small_shards) as server, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sources = [Shards(server.url, cache_dir=tmp_path / "cache", window=2, cache_limit=4 * largest)
                   for _ in range(2)]
        loaders = [make_loader(s, "torch", batch_size=4, device="cpu", augment=NONE, num_workers=0, seed=5,
                               rank=rank, world_size=2) for rank, s in enumerate(sources)]
        try:
            start = len(server.requests)
            for _ in zip(*loaders):
                pass
            gets = collections.Counter(p.rsplit("/", 1)[-1] for m, p, _ in server.requests[start:] if m == "GET")
            index = sources[0].index
            nxt = index.shard[loaders[0].plan.order(1)]
            _, first = np.unique(nxt, return_index=True)
            upcoming = {index.shards[int(nxt[i])].name for i in np.sort(first)[:4]}   # window x 2 ahead
        finally:
            for thing in loaders + sources:
                thing.close()
    assert len(gets) == 17, gets
    assert {name for name, n in gets.items() if n > 1} <= upcoming, (gets, upcoming)
    assert not [w for w in caught if "downloaded again" in str(w.message)]
