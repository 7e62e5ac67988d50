"""fastdata.shards.cache: a bounded folder of whole shards, shared by processes, never half written.

Shards come from a real HTTP server on 127.0.0.1 (so downloads can be counted) or from a ``file://``
URL (a Storage that copies, unlike a plain folder, which is read in place)."""
from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fastdata.shards.cache import CacheFull, ShardCache
from fastdata.shards.storage import Storage, StorageError
from procs import wait_until
from shard_servers import Faults, http_server

pytestmark = pytest.mark.requires("fsspec", "aiohttp")   # each test skips, or fails in CI, naming the extra

FAST = {"retries": 2, "backoff": 0.01}
SIZE = 1_000
NAMES = ["s0.tar", "s1.tar", "s2.tar", "s3.tar", "sub/s4.tar"]


@pytest.fixture
def remote(tmp_path):
    """Five shards of SIZE random bytes; returns (folder, {name: bytes})."""
    root = tmp_path / "remote"
    files = {name: os.urandom(SIZE) for name in NAMES}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root, files


def sizes(files):
    return {name: len(data) for name, data in files.items()}


def cached_bytes(cache_dir) -> int:
    """Bytes of shards (and temporary files) in the cache folder, lock files excluded. A download may
    finish (its temporary file renamed) between the listing and the sizes: then it is counted again."""
    while True:
        total = 0
        try:
            for folder, dirs, names in os.walk(cache_dir):
                dirs[:] = [d for d in dirs if d != ".locks"]
                total += sum(os.path.getsize(os.path.join(folder, n)) for n in names)
        except FileNotFoundError:
            continue
        return total


def leftovers(cache_dir) -> list[str]:
    return sorted(n for _, dirs, names in os.walk(cache_dir) for n in names if ".tmp-" in n)


def test_get_downloads_once_and_publishes_the_bytes(remote, tmp_path):
    root, files = remote
    with http_server(root) as server:
        with ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=10 * SIZE,
                        expected_sizes=sizes(files)) as cache:
            path = cache.get("sub/s4.tar")
            assert open(path, "rb").read() == files["sub/s4.tar"]
            assert path == str(tmp_path / "cache" / "sub" / "s4.tar")
            cache.release("sub/s4.tar")
            assert cache.get("sub/s4.tar") == path
            cache.release("sub/s4.tar")
        assert server.count("/sub/s4.tar", "GET") == 1
    assert leftovers(tmp_path / "cache") == []


def _get_in_another_process(url, cache_dir, expected, name, start, out):
    """A rank of the node: waits for the common start, gets ``name``, reports the bytes it read."""
    cache = ShardCache(Storage(url, **FAST), cache_dir, limit_bytes=10 * SIZE, expected_sizes=expected)
    start.wait(30)
    path = cache.get(name)
    with open(path, "rb") as f:
        out.put(f.read())
    cache.release(name)
    cache.close()


def test_two_processes_sharing_a_cache_download_a_shard_once(remote, tmp_path):
    root, files = remote
    ctx = multiprocessing.get_context("spawn")
    # Each request is slowed down, so the second process asks while the first is still downloading.
    with http_server(root, Faults(delay=0.5)) as server:
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_get_in_another_process,
                             args=(server.url, str(tmp_path / "cache"), sizes(files), "s1.tar", start, out))
                 for _ in range(2)]
        for p in procs:
            p.start()
        start.set()
        got = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert [p.exitcode for p in procs] == [0, 0]
        assert got == [files["s1.tar"]] * 2
        assert server.count("/s1.tar", "GET") == 1


def test_eviction_keeps_the_cache_under_its_limit_and_spares_shards_in_use(remote, tmp_path):
    root, files = remote
    limit = 2 * SIZE + SIZE // 2                  # room for two shards
    storage = Storage(f"file://{root}", **FAST)
    cache = ShardCache(storage, tmp_path / "cache", limit_bytes=limit, expected_sizes=sizes(files))
    # A second cache on the same folder holds its own locks, as another rank's process would.
    other = ShardCache(storage, tmp_path / "cache", limit_bytes=limit, expected_sizes=sizes(files))
    held = other.get("s0.tar")
    for name in NAMES[1:]:
        path = cache.get(name)
        assert open(path, "rb").read() == files[name]
        assert cached_bytes(tmp_path / "cache") <= limit
        assert open(held, "rb").read() == files["s0.tar"]      # in use elsewhere: never evicted
        cache.release(name)
    other.release("s0.tar")
    cache.get("sub/s4.tar")                       # used after s0's release: s0 is the least recently used
    cache.release("sub/s4.tar")
    cache.get("s1.tar")                           # now s0 (least recently used, released) may go
    assert not os.path.exists(held)
    assert cached_bytes(tmp_path / "cache") <= limit
    cache.close()
    other.close()


def test_least_recently_used_released_shards_go_first(remote, tmp_path):
    root, files = remote
    cache = ShardCache(Storage(f"file://{root}", **FAST), tmp_path / "cache", limit_bytes=3 * SIZE,
                       expected_sizes=sizes(files))
    for name in ["s0.tar", "s1.tar", "s2.tar"]:
        cache.get(name)
        cache.release(name)
        time.sleep(0.02)                          # distinct modification times
    cache.get("s0.tar")                           # used again: s1 is now the least recently used
    cache.release("s0.tar")
    cache.get("s3.tar")
    left = sorted(os.listdir(tmp_path / "cache"))
    assert left == [".locks", "s0.tar", "s2.tar", "s3.tar"]
    cache.close()


def test_a_retired_shard_goes_before_any_other_and_a_later_use_takes_that_back(remote, tmp_path):
    """The read-ahead retires the shards a pass has finished: the next download evicts them first, not
    the least recently used (a shard fetched ahead and not read yet was that, and was downloaded twice)."""
    root, files = remote
    with http_server(root) as server:
        cache = ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=3 * SIZE,
                           expected_sizes=sizes(files))
        for name in ["s0.tar", "s1.tar", "s2.tar"]:   # s0 fetched ahead long ago; s1, s2 read since
            cache.get(name)
            cache.release(name)
        cache.retire("s2.tar")
        cache.retire("s1.tar")                        # retired last: evicted after s2
        cache.get("s3.tar")
        assert sorted(os.listdir(tmp_path / "cache")) == [".locks", "s0.tar", "s1.tar", "s3.tar"]
        cache.get("s1.tar")                           # used again: no longer retired
        cache.release("s1.tar")
        cache.get("sub/s4.tar")                       # s0 is now the least recently used
        assert sorted(os.listdir(tmp_path / "cache")) == [".locks", "s1.tar", "s3.tar", "sub"]
        cache.retire("s0.tar")                        # evicted already: nothing to do
        cache.get("s0.tar")                           # downloaded again: counted, by name
        assert [cache.downloads(n) for n in NAMES] == [2, 1, 1, 1, 1]
        assert [server.count(n, "GET") for n in NAMES] == [2, 1, 1, 1, 1]
        # Counted in a lock file's mtime: a file system that keeps whole seconds (ext3) or 2 s (FAT) kept
        # a count in nanoseconds as 0. Such a file system's truncation, applied by hand:
        lock = tmp_path / "cache" / ".locks" / "s0.tar.lock"
        for tick in (10**9, 2 * 10**9):
            stamp = os.stat(lock).st_mtime_ns // tick * tick
            os.utime(lock, ns=(stamp, stamp))
            assert cache.downloads("s0.tar") == 2, tick
        cache.close()


def test_shards_used_a_moment_apart_are_evicted_in_the_order_they_were_used(remote, tmp_path):
    """No sleep between the uses: the kernel's "now" (a bare os.utime) is one coarse tick, so a shard
    used after another within the tick tied with it, and the tie went to the name: s0, used last here,
    was evicted before s1 and s2 (a fetch-ahead evicted the shard the next pass was about to read)."""
    root, files = remote
    for attempt in range(20):
        folder = tmp_path / f"cache{attempt}"
        cache = ShardCache(Storage(f"file://{root}", **FAST), folder, limit_bytes=3 * SIZE,
                           expected_sizes=sizes(files))
        for name in ["s2.tar", "s1.tar", "s0.tar"]:   # fetched, then used in the reverse order of names
            cache.get(name)
            cache.release(name)
        for name in ["s2.tar", "s1.tar", "s0.tar"]:
            cache.get(name)
            cache.release(name)
        cache.get("s3.tar")
        assert sorted(os.listdir(folder)) == [".locks", "s0.tar", "s1.tar", "s3.tar"], attempt
        cache.close()


def test_no_room_while_every_shard_is_in_use_is_an_error_that_says_so(remote, tmp_path):
    root, files = remote
    cache = ShardCache(Storage(f"file://{root}", **FAST), tmp_path / "cache", limit_bytes=2 * SIZE,
                       expected_sizes=sizes(files), wait_timeout=0.3)
    cache.get("s0.tar")
    cache.get("s1.tar")
    with pytest.raises(CacheFull, match=r"cannot make room for shard 's2.tar'.*in use"):
        cache.get("s2.tar")
    assert leftovers(tmp_path / "cache") == [] and not (tmp_path / "cache" / "s2.tar").exists()
    cache.release("s1.tar")
    assert open(cache.get("s2.tar"), "rb").read() == files["s2.tar"]
    cache.close()


@pytest.mark.parametrize("window, need", [(1, 1_500), (2, 2_500)])
def test_a_budget_that_cannot_hold_the_window_is_refused_up_front(tmp_path, window, need):
    root = tmp_path / "remote"
    root.mkdir()
    expected = {"big.tar": 1_500, "mid.tar": 1_000, "small.tar": 10}
    for name, size in expected.items():
        (root / name).write_bytes(b"x" * size)
    with pytest.raises(ValueError, match=f"needs at least {need} bytes .*{tmp_path / 'cache'}"):
        ShardCache(Storage(f"file://{root}"), tmp_path / "cache", limit_bytes=need - 1,
                   expected_sizes=expected, window=window)
    ShardCache(Storage(f"file://{root}"), tmp_path / "cache", limit_bytes=need, expected_sizes=expected,
               window=window).close()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window=0), ValueError, r"^ShardCache: window must be an integer >= 1, got 0"),
    (dict(window=1.5), TypeError, r"^ShardCache: window must be an integer >= 1, got 1.5"),
    (dict(expected_sizes={"a.tar": -1}), ValueError,
     r"^ShardCache: the expected size \(bytes\) of shard 'a.tar' must be an integer >= 0, got -1"),
    (dict(expected_sizes={"a.tar": 10.0}), TypeError,
     r"^ShardCache: the expected size \(bytes\) of shard 'a.tar' must be an integer >= 0, got 10.0"),
    (dict(limit_bytes="1GB"), TypeError, r"^ShardCache: limit_bytes must be an integer >= 0, got '1GB'"),
    (dict(wait_timeout=0), ValueError, r"^ShardCache: wait_timeout \(seconds\) must be a number > 0, got 0"),
])
def test_bad_cache_arguments_are_refused_by_name(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        ShardCache(Storage(f"file://{tmp_path}"), tmp_path / "cache",
                   **{"limit_bytes": 1 << 20, "expected_sizes": {"a.tar": 10}, **kwargs})


def test_a_bad_cache_limit_is_refused_by_name_before_anything_is_read(tmp_path):
    """Shards(cache_limit=...) was never checked: "1GB" failed later, inside int(), naming nothing."""
    from fastdata.datasets import Shards

    for bad, error in (("1GB", TypeError), (0, ValueError)):
        with pytest.raises(error, match=r"^cache_limit \(bytes\) must be an integer >= 1 or None, got"):
            Shards(f"file://{tmp_path}", cache_limit=bad)


def test_a_cached_file_of_the_wrong_size_is_fetched_again(remote, tmp_path):
    root, files = remote
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "s2.tar").write_bytes(b"truncated")     # an older run, cut short
    with http_server(root) as server:
        cache = ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=10 * SIZE,
                           expected_sizes=sizes(files))
        assert open(cache.get("s2.tar"), "rb").read() == files["s2.tar"]
        assert server.count("/s2.tar", "GET") == 1
        cache.close()


def test_an_interrupted_download_leaves_no_file_under_the_final_name(remote, tmp_path):
    root, files = remote
    with http_server(root, Faults(drop_first=-1)) as server:
        cache = ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=10 * SIZE,
                           expected_sizes=sizes(files))
        with pytest.raises(StorageError, match="s3.tar"):
            cache.get("s3.tar")
        cache.close()
    assert not (tmp_path / "cache" / "s3.tar").exists() and leftovers(tmp_path / "cache") == []


def test_temporary_files_of_dead_processes_are_removed(remote, tmp_path):
    root, files = remote
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "cache").mkdir()
    stale = tmp_path / "cache" / f"s0.tar.tmp-{dead}-0a1b2c3d"
    stale.write_bytes(b"half")
    mine = tmp_path / "cache" / f"s1.tar.tmp-{os.getpid()}-0a1b2c3d"     # a live download's: kept
    mine.write_bytes(b"half")
    reused = tmp_path / "cache" / f"s2.tar.tmp-{os.getpid()}-0a1b2c3d"   # a dead one's whose pid runs again
    reused.write_bytes(b"half")
    (tmp_path / "cache" / ".locks").mkdir()
    lock = os.open(tmp_path / "cache" / ".locks" / "s1.tar.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)          # as a download holds its shard's lock until it publishes
    try:
        ShardCache(Storage(f"file://{root}"), tmp_path / "cache", limit_bytes=10 * SIZE,
                   expected_sizes=sizes(files)).close()
    finally:
        os.close(lock)
    assert not stale.exists() and mine.exists() and not reused.exists()


def _idle(thread: threading.Thread) -> bool:
    """Whether ``thread`` (the shards' prefetcher) waits for work: in its loop's Condition.wait."""
    frame = sys._current_frames().get(thread.ident)
    caller = frame.f_back if frame is not None else None
    return frame.f_code.co_name == "wait" and caller is not None and caller.f_code.co_name == "_run"


def test_the_readers_prefetcher_fetches_a_window_ahead_in_order_within_the_budget(tmp_path):
    """The one prefetcher is the reader's (``Shards.reading``: ``get`` then ``release`` on a thread):
    told where the pass is, it fetches the shard being read and the next ``window``, in the pass's
    order, no further (the cache holds two windows), and the reader then finds each one cached."""
    from fastdata.datasets import ImageFolder, Shards, make_image_folder
    from fastdata.packing import pack
    from fastdata.shards.index import read_index

    folder = make_image_folder(tmp_path / "photos", classes=2, per_class=8, size_range=((24, 32), (24, 32)))
    out = tmp_path / "packed"
    pack(ImageFolder(folder), out, shard_size=6000, workers=0, progress=False)   # a photo or two a shard
    index = read_index(out)
    largest = max(s.size for s in index.shards)
    assert len(index.shards) >= 6
    shards = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=2, cache_limit=4 * largest)
    order = np.arange(len(shards))[::-1].copy()           # the pass reads the last shard first
    names = [index.shards[int(j)].name for j in dict.fromkeys(index.shard[order].tolist())]
    try:
        shards.reading(order, 0)
        # The window fetched and the prefetcher back to waiting for work: had it run on, it would be
        # fetching names[3] instead, or names[3] would be there. Its own thread, not any of that name:
        # threads of other sources in this process are not this one's.
        prefetcher = shards._prefetcher._thread
        assert wait_until(lambda: all(os.path.exists(shards.cached_path(n)) for n in names[:3]) and _idle(prefetcher),
                          timeout=30), "the prefetcher never fetched its window"
        cached = sorted(p.name.split(".")[0] for p in (tmp_path / "cache").glob("*.tar"))
        assert cached == sorted(n[:-4] for n in names[:3]), (cached, shards._prefetcher.error)
        local = Shards(out)
        for position, i in enumerate(order):                # the reader moves on, sample by sample
            shards.reading(order, position)
            assert shards.read(int(i)) == local.read(int(i))
            assert cached_bytes(tmp_path / "cache") <= 4 * largest
        local.close()
        assert shards._prefetcher._thread is prefetcher   # the one prefetcher, all pass long
    finally:
        shards.close()
    assert not prefetcher.is_alive()


def test_the_prefetcher_counts_the_batches_in_flight_and_fetches_ahead_only_within_the_budget(tmp_path):
    """Told that the readers run ``plan_in_flight`` samples ahead, the prefetcher fetches the shards they
    may be reading, then ahead only as far as the cache holds them all (here one shard, not the window
    of 2): further, it evicts a shard the readers have not finished. Where their shards alone are more
    than the cache holds, it fetches nothing: the readers fetch what they read."""
    from fastdata.datasets import ImageFolder, Shards, make_image_folder
    from fastdata.packing import pack
    from fastdata.shards.index import read_index

    folder = make_image_folder(tmp_path / "photos", classes=2, per_class=8, size_range=((24, 32), (24, 32)))
    out = tmp_path / "packed"
    pack(ImageFolder(folder), out, shard_size=6000, workers=0, progress=False)   # a photo or two a shard
    index = read_index(out)
    largest = max(s.size for s in index.shards)
    order = np.arange(len(index.shard))[::-1].copy()
    first: dict[str, int] = {}   # each shard's first position in the order, in the order it is first read
    for position, j in enumerate(index.shard[order].tolist()):
        first.setdefault(index.shards[j].name, position)
    names = list(first)
    sizes_ = {s.name: s.size for s in index.shards}
    for case, in_flight in (("fits", first[names[3]]), ("too many", None)):
        cache_dir = tmp_path / f"cache-{case}"
        shards = Shards(f"file://{out}", cache_dir=cache_dir, window=2, cache_limit=4 * largest)
        if in_flight is None:   # the fewest first shards whose bytes are more than the cache holds
            total, k = 0, 0
            while total <= 4 * largest:
                total, k = total + sizes_[names[k]], k + 1
            in_flight = first[names[k]]
        shards.plan_in_flight(in_flight, 1)            # samples 0 .. in_flight - 1: shards names[:k]
        try:
            shards.reading(order, 0)
            ahead = shards._prefetcher
            assert wait_until(lambda a=ahead: _idle(a._thread) and not a._wanted, timeout=30)
            cached = sorted(p.name.split(".")[0] for p in cache_dir.glob("*.tar"))
            want = names[:4] if case == "fits" else []
            assert cached == sorted(n[:-4] for n in want), (case, cached, shards._prefetcher.error)
        finally:
            shards.close()


class FullDisk(Storage):
    """A Storage whose downloads fail with ENOSPC the first ``full`` times."""

    def __init__(self, *args, full: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.full, self.fetches = full, 0

    def fetch(self, name, dest, *, size=None):
        self.fetches += 1
        if self.fetches <= self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().fetch(name, dest, size=size)


def test_a_full_disk_evicts_released_shards_and_retries_once(remote, tmp_path, monkeypatch):
    root, files = remote
    storage = FullDisk(f"file://{root}", full=0, **FAST)
    cache = ShardCache(storage, tmp_path / "cache", limit_bytes=10 * SIZE, expected_sizes=sizes(files))
    cache.get("s0.tar")
    cache.release("s0.tar")
    storage.full = storage.fetches + 1            # the next download finds the disk full
    import shutil
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0))   # "still full"
    assert open(cache.get("s1.tar"), "rb").read() == files["s1.tar"]
    assert not (tmp_path / "cache" / "s0.tar").exists()          # evicted to make room on the disk
    cache.close()


def test_a_disk_that_stays_full_is_an_error_saying_how_much_and_where(remote, tmp_path):
    root, files = remote
    cache = ShardCache(FullDisk(f"file://{root}", full=99, **FAST), tmp_path / "cache", limit_bytes=10 * SIZE,
                       expected_sizes=sizes(files))
    with pytest.raises(CacheFull, match=f"{tmp_path / 'cache'} is full: shard 's2.tar' needs {SIZE} bytes"):
        cache.get("s2.tar")
    assert cache.storage.fetches == 2 and leftovers(tmp_path / "cache") == []
    cache.close()


@pytest.mark.parametrize("name", ["../evil.tar", "/etc/passwd", "a/../../b.tar"])
def test_names_that_would_escape_the_cache_are_refused(remote, tmp_path, name):
    root, files = remote
    with pytest.raises(ValueError, match="refused"):
        ShardCache(Storage(f"file://{root}"), tmp_path / "cache", limit_bytes=10 * SIZE,
                   expected_sizes={**sizes(files), name: 10})
    cache = ShardCache(Storage(f"file://{root}"), tmp_path / "cache", limit_bytes=10 * SIZE,
                       expected_sizes=sizes(files))
    with pytest.raises(ValueError, match="refused"):
        cache.get(name)
    with pytest.raises(KeyError, match="not in this cache"):
        cache.get("other.tar")
    cache.close()


def test_a_local_folder_is_read_in_place(remote, tmp_path):
    root, files = remote
    cache = ShardCache(Storage(root), tmp_path / "cache", limit_bytes=1, expected_sizes=sizes(files))
    assert cache.get("s0.tar") == str(root / "s0.tar")
    cache.release("s0.tar")
    assert not (tmp_path / "cache").exists()
    # The storage's own files are never stamped: not retired, not claimed back (one that looks retired).
    stamp = 10**15
    os.utime(root / "s1.tar", ns=(stamp, stamp))
    assert not cache.retire("s0.tar") and not cache.claim("s1.tar") and cache.downloads("s0.tar") == 0
    assert os.stat(root / "s1.tar").st_mtime_ns == stamp and os.stat(root / "s0.tar").st_mtime_ns > stamp


def test_release_without_get_is_an_error(remote, tmp_path):
    root, files = remote
    cache = ShardCache(Storage(f"file://{root}"), tmp_path / "cache", limit_bytes=10 * SIZE,
                       expected_sizes=sizes(files))
    with pytest.raises(ValueError, match="does not hold"):
        cache.release("s0.tar")
    cache.close()


def test_a_forked_child_does_not_keep_the_parents_shard_locked(remote, tmp_path):
    """A DataLoader worker forked while the parent held a shard inherited its flock; kept open, that copy
    held the shard unevictable for the worker's whole life, after the parent had released it."""
    root, files = remote
    limit = 2 * SIZE + SIZE // 2                  # room for two shards
    storage = Storage(f"file://{root}", **FAST)
    cache = ShardCache(storage, tmp_path / "cache", limit_bytes=limit, expected_sizes=sizes(files))
    held = cache.get("s0.tar")
    ctx = multiprocessing.get_context("fork")
    go, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=lambda: (go.wait(30), done.set(), time.sleep(30)), daemon=True)
    child.start()                                 # alive, and never touches the cache itself
    try:
        go.set()
        assert done.wait(30)
        cache.release("s0.tar")
        cache.get("s1.tar")
        cache.release("s1.tar")
        cache.get("s2.tar")                       # needs room: s0, released, must be evictable
        assert not os.path.exists(held)
        cache.release("s2.tar")
    finally:
        child.kill()
        child.join()
        cache.close()


class HeldDownload(Storage):
    """A Storage whose fetch waits for ``go`` after saying it started: a download in progress on demand."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started, self.go = threading.Event(), threading.Event()

    def fetch(self, name, dest, *, size=None):
        self.started.set()
        assert self.go.wait(30)
        return super().fetch(name, dest, size=size)


def test_a_child_forked_during_a_download_does_not_keep_that_shard_locked(remote, tmp_path):
    """A DataLoader worker forked while the read-ahead thread downloaded a shard inherited the download's lock
    descriptor, which the cache does not know as held; closing the parent's copy left the shard locked
    for the worker's whole life, never evicted, and the cache full."""
    root, files = remote
    storage = HeldDownload(f"file://{root}", **FAST)
    cache = ShardCache(storage, tmp_path / "cache", limit_bytes=2 * SIZE + SIZE // 2, expected_sizes=sizes(files),
                       wait_timeout=3)
    # What the reader's prefetcher does (Shards' read-ahead thread): get, then release, on a thread.
    def read_ahead():
        cache.get("s0.tar")
        cache.release("s0.tar")

    ahead = threading.Thread(target=read_ahead, daemon=True)
    ahead.start()
    assert storage.started.wait(30)               # the read-ahead thread holds s0's lock, downloading
    ctx = multiprocessing.get_context("fork")
    alive = ctx.Event()
    child = ctx.Process(target=lambda: (alive.set(), time.sleep(60)), daemon=True)
    child.start()
    try:
        assert alive.wait(30)
        storage.go.set()
        ahead.join(30)
        first = cache.get("s0.tar")
        cache.release("s0.tar")
        for name in ("s1.tar", "s2.tar"):         # s2 needs room: s0, released, must be evictable
            cache.get(name)
            cache.release(name)
        assert not os.path.exists(first)
    finally:
        child.kill()
        child.join()
        cache.close()


def test_with_digests_each_version_of_a_shard_is_its_own_file_and_a_wrong_download_is_never_published(
        remote, tmp_path):
    import hashlib

    from fastdata.shards.storage import ShardMismatch

    root, files = remote
    digest = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "s3.tar").write_bytes(files["s3.tar"])   # cached before shards were keyed by digest
    with http_server(root) as server:
        old = ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=3 * SIZE,
                         expected_sizes=sizes(files), digests=digest)
        path = old.get("s0.tar")
        assert os.path.basename(path) == f"s0.{digest['s0.tar'][:16]}.tar"
        old.release("s0.tar")
        old.close()
        # The location is re-packed: s0.tar has new bytes of the same size, and the new index says so.
        new_bytes = os.urandom(SIZE)
        (root / "s0.tar").write_bytes(new_bytes)
        repacked = {**digest, "s0.tar": hashlib.sha256(new_bytes).hexdigest()}
        new = ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=3 * SIZE,
                         expected_sizes=sizes(files), digests=repacked)
        assert open(new.get("s0.tar"), "rb").read() == new_bytes          # never the old copy
        new.release("s0.tar")
        assert server.count("/s0.tar", "GET") == 2
        for name in ("s1.tar", "s2.tar"):                                   # room for them: the old version goes first
            new.get(name)
            new.release(name)
        # Old versions went first: the bare-named copy and s0's earlier version.
        assert not os.path.exists(path) and not (tmp_path / "cache" / "s3.tar").exists()
        assert os.path.exists(new.path("s0.tar"))
        # A reader still holding the old index asks for the old version: the download is refused, once.
        stale = ShardCache(Storage(server.url, **FAST), tmp_path / "cache", limit_bytes=3 * SIZE,
                           expected_sizes=sizes(files), digests=digest)
        for _ in range(2):
            with pytest.raises(ShardMismatch, match=r"shard 's0.tar' at http.*is not the shard its index describes"):
                stale.get("s0.tar")
        assert server.count("/s0.tar", "GET") == 3 and leftovers(tmp_path / "cache") == []
        assert not os.path.exists(stale.path("s0.tar"))
        new.close()
        stale.close()
