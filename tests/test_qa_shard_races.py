"""Shards read at once by many threads and processes through one small cache (the ranks of a node, a
DataLoader's workers, dali's reader threads, the read-ahead thread): every sample's own bytes, no
shard downloaded more often than the order asks, no error that only the race made. Each test forces
its interleaving (a lock held by the test, a hook on the cache's own wait) instead of hoping for it."""
from __future__ import annotations

import fcntl
import json
import os
import threading

import numpy as np
import pytest

from fastdata.datasets import ImageFolder, Shards, make_image_folder
from fastdata.shards.cache import ShardCache
from fastdata.shards.storage import Storage
from shard_servers import http_server

pytestmark = pytest.mark.requires("fsspec", "aiohttp")

FAST = {"retries": 1, "backoff": 0.01}


@pytest.fixture
def remote(tmp_path):
    """Four shards of 1000 random bytes in a folder; returns (folder, {name: bytes})."""
    root = tmp_path / "remote"
    root.mkdir()
    files = {f"s{k}.tar": os.urandom(1000) for k in range(4)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, files


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    """48 small photos in 2 classes packed into 8 shards of ~6."""
    from fastdata.packing import pack

    root = tmp_path_factory.mktemp("qa-races")
    folder = make_image_folder(root / "photos", classes=2, per_class=24, seed=3, size_range=((32, 48), (32, 48)))
    pack(ImageFolder(folder), root / "packed", shard_size=20_000, progress=False)
    return root / "packed"


def _largest(pack_dir) -> int:
    return max(s["size"] for s in json.loads((pack_dir / "index.json").read_text())["shards"])


def _lock_of(shards: Shards, name: str) -> int:
    """An open descriptor of the cache's lock file of shard ``name`` (what other processes lock)."""
    cached = shards.cached_path(name)
    path = os.path.join(os.path.dirname(cached), ".locks", os.path.basename(cached)) + ".lock"
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _hook_waits(shards: Shards, name: str) -> threading.Event:
    """An event set when the cache of ``shards`` waits for (or takes) the lock of shard ``name``."""
    cache = shards._cache
    own_flock, waiting = cache._flock, threading.Event()

    def flock(fd, mode, deadline, what, *args, **kwargs):
        if f"'{name}'" in what:
            waiting.set()
        return own_flock(fd, mode, deadline, what, *args, **kwargs)

    cache._flock = flock
    return waiting


def _sequence(shards: Shards, order) -> list[str]:
    """The shards ``order`` reads, in the order it first reaches them."""
    return [shards.index.shards[int(k)].name for k in dict.fromkeys(shards.index.shard[order].tolist())]


def _first(shards: Shards, order, name: str) -> int:
    """The position in ``order`` of the first sample of shard ``name``."""
    return next(p for p, i in enumerate(order) if shards.index.shards[int(shards.index.shard[i])].name == name)


def _sizes(files):
    return {name: len(data) for name, data in files.items()}


def test_a_reader_waiting_to_download_takes_the_copy_a_peer_published_while_the_peer_reads_it(remote, tmp_path):
    """Two ranks want a shard that is not cached: both find it missing, one downloads it (holding its
    lock exclusively), the other waits for that exclusive lock to download it itself. Once published,
    the first rank reads it holding the lock shared, for as long as its readers take (dali's threads
    and the other ranks keep it held without a gap): the second waited for exclusivity until then, or
    until wait_timeout (a TimeoutError), and then downloaded the shard again if it had been evicted
    meanwhile (the read-ahead thread did: a third download of a shard read once)."""
    root, files = remote
    with http_server(root) as server:
        cache = ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=4000,
                           expected_sizes=_sizes(files), wait_timeout=5)
        name, path = "s1.tar", cache.path("s1.tar")
        # The peer: it has found the shard missing too (it holds the lock shared), and will publish it.
        peer = os.open(os.path.join(cache.cache_dir, ".locks", "s1.tar.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(peer, fcntl.LOCK_SH)
        waiting = threading.Event()
        own_flock = cache._flock

        def flock(fd, mode, *args, **kwargs):
            if mode == fcntl.LOCK_EX:
                waiting.set()                    # past its shared look: it waits to download
            return own_flock(fd, mode, *args, **kwargs)

        cache._flock = flock
        got = []
        reader = threading.Thread(target=lambda: got.append(_outcome(cache.get, name)))
        reader.start()
        try:
            assert waiting.wait(30)
            tmp = f"{path}.tmp-{os.getpid()}-peer"
            with open(tmp, "wb") as f:
                f.write(files[name])
            os.replace(tmp, path)                # published; the peer goes on reading it (lock shared)
            reader.join(15)
        finally:
            fcntl.flock(peer, fcntl.LOCK_UN)
            os.close(peer)
            reader.join(30)
        assert got == [path], got
        assert server.count(".tar", "GET") == 0   # the peer's copy, not a download of its own
        with open(path, "rb") as f:
            assert f.read() == files[name]
        cache.release(name)
        cache.close()


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - compared by the test
        return repr(e)


def test_the_read_ahead_gives_up_a_shard_the_pass_went_past_while_it_waited_for_it(pack_dir, tmp_path):
    """The read-ahead thread asks for the next shard while another process downloads it (holding its
    lock exclusively); the readers get it from that process, read it and move on. When the lock came
    free, the thread found the shard evicted and downloaded it again, evicting in its place a shard the
    readers were about to read (with DataLoader workers ahead of the consumer, most of a pass's
    downloads were such repeats). Here the other process dies without publishing it: the pass is past
    that shard by then, so nobody downloads it."""
    from procs import wait_until

    with http_server(pack_dir) as server:
        shards = Shards(server.url, window=1, cache_dir=tmp_path / "cache", cache_limit=2 * _largest(pack_dir))
        try:
            order = np.arange(len(shards))
            second, fourth = _sequence(shards, order)[1], _sequence(shards, order)[3]
            lock = _lock_of(shards, second)
            fcntl.flock(lock, fcntl.LOCK_EX)          # the other process, downloading the second shard
            waiting = _hook_waits(shards, second)
            shards.reading(order, 0)                  # wants the first shard and the second
            assert waiting.wait(30)                   # the thread waits for the second one
            shards.reading(order, _first(shards, order, fourth))   # two shards on
            # Given up while the lock is still held, not at close() (stop() gives up a wait too): the
            # thread goes on to the shards the pass reads now.
            assert wait_until(lambda: server.count(f"/{fourth}", "GET") > 0, 30)
            fcntl.flock(lock, fcntl.LOCK_UN)          # the other process died: nothing published
            os.close(lock)
        finally:
            shards.close()                            # the thread ends once done with what it holds
        assert server.count(f"/{second}", "GET") == 0


def test_a_shard_given_up_in_a_pass_cut_short_is_still_fetched_ahead_in_the_next(pack_dir, tmp_path):
    """set_epoch or load_state_dict mid-pass starts a new pass while the read-ahead thread waits for a
    shard of the old one. That shard, given up (the new pass does not read it yet), was recorded as
    done in the new pass's set, so the new pass never fetched it ahead: its readers waited for it."""
    from procs import wait_until

    with http_server(pack_dir) as server:
        shards = Shards(server.url, window=1, cache_dir=tmp_path / "cache", cache_limit=2 * _largest(pack_dir))
        try:
            old, new = np.arange(len(shards)), np.arange(len(shards))[::-1].copy()
            second = _sequence(shards, old)[1]
            lock = _lock_of(shards, second)
            fcntl.flock(lock, fcntl.LOCK_EX)          # another process downloads the old pass's second shard
            waiting = _hook_waits(shards, second)
            shards.reading(old, 0)
            assert waiting.wait(30)
            shards.reading(new, 0)                    # a new pass, which reads that shard near its end
            fcntl.flock(lock, fcntl.LOCK_UN)          # the other process died: nothing published
            os.close(lock)
            # The thread is done with that shard once it has fetched the new pass's first two.
            assert wait_until(lambda: server.count(f"/{_sequence(shards, new)[1]}", "GET") > 0, 30)
            shards.reading(new, _first(shards, new, second))   # the new pass reaches it: fetched ahead now
            assert wait_until(lambda: server.count(f"/{second}", "GET") > 0, 30)
        finally:
            shards.close()
        assert server.count(f"/{second}", "GET") == 1


def _deleted_but_open(folder) -> list[str]:
    """Files under ``folder`` this process holds open after they were deleted (their bytes stay on disk)."""
    prefix, found = str(folder) + os.sep, []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix) and target.endswith(" (deleted)"):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="open files are listed from /proc (Linux)")
def test_a_shard_the_read_ahead_releases_last_is_not_left_open_by_its_reader_once_evicted(pack_dir, tmp_path):
    """A reader closes its descriptor of a shard when this process's last hold of it ends, before the
    shard may be evicted: an evicted file still open keeps its bytes on the disk while the cache counts
    them free. The read-ahead thread holds shards too (get, then release): when its release came last
    (it held the shard the reader was reading, as at a pass's start), nobody closed the reader's
    descriptor, and the shard stayed on the disk, deleted, past cache_limit."""
    with http_server(pack_dir) as server:
        cache_dir = tmp_path / "cache"
        shards = Shards(server.url, window=1, cache_dir=cache_dir, cache_limit=2 * _largest(pack_dir))
        try:
            order = np.arange(len(shards))
            first, *rest = _sequence(shards, order)
            cache = shards._cache
            own_release, holding, go = cache.release, threading.Event(), threading.Event()

            def release(name, **kwargs):
                if name == first and threading.current_thread().name == "fastdata-shards":
                    holding.set()              # the thread holds the first shard: the reader reads it now
                    assert go.wait(30)
                return own_release(name, **kwargs)

            cache.release = release
            shards.reading(order, 0)
            assert holding.wait(30)
            start, size = int(shards.index.offset[0]), int(shards.index.size[0])
            assert shards.read(0) == (pack_dir / first).read_bytes()[start: start + size]
            go.set()                           # the thread's release is this process's last hold
            for name in rest[:3]:              # the pass goes on: the first shard is evicted
                cache.get(name)
                cache.release(name)
            assert not os.path.exists(shards.cached_path(first))
            assert _deleted_but_open(cache_dir) == []
        finally:
            go.set()
            shards.close()


def test_close_does_not_wait_for_another_processs_download_the_read_ahead_was_waiting_for(pack_dir, tmp_path):
    """close() stops the read-ahead thread and joins it. Waiting for a shard another rank was
    downloading (a big shard over a slow link: minutes), the thread went on waiting, and close() (or
    the collection of the source, or the interpreter's exit at the end of a run) blocked for a minute,
    the join's limit. Stopped, the thread gives up a wait that is not its own download."""
    with http_server(pack_dir) as server:
        shards = Shards(server.url, window=1, cache_dir=tmp_path / "cache", cache_limit=2 * _largest(pack_dir))
        first = _sequence(shards, np.arange(len(shards)))[0]
        lock = _lock_of(shards, first)
        fcntl.flock(lock, fcntl.LOCK_EX)              # another rank, downloading the first shard
        try:
            waiting = _hook_waits(shards, first)
            shards.reading(np.arange(len(shards)), 0)
            assert waiting.wait(30)
            closing = threading.Thread(target=shards.close)
            closing.start()
            closing.join(30)                          # the join's own limit is 60 s
            assert not closing.is_alive()             # returned while the other rank still downloads
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
            shards.close()
        assert server.count(".tar", "GET") == 0
