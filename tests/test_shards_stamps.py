"""fastdata.shards.stamps: what the shard cache writes in file times (a shard used now, retired, claimed
back; the downloads counted in its lock file), read back as any process of the node reads them."""
from __future__ import annotations

import os
import time

from fastdata.shards.stamps import RETIRED_NS, claim, count_download, downloads, retire, touch

DAY_NS = 86400 * 10**9


def _mtime(path) -> int:
    return os.stat(path).st_mtime_ns


def test_a_retired_shard_is_stamped_far_back_and_a_claim_takes_that_back(tmp_path):
    shard = tmp_path / "s0.tar"
    shard.write_bytes(b"x")
    before = time.time_ns()
    retire(str(shard))
    assert _mtime(shard) <= time.time_ns() - RETIRED_NS < before - DAY_NS   # evicted before any released one
    assert claim(str(shard)) and _mtime(shard) >= before - DAY_NS           # used now
    assert not claim(str(shard))                                             # not retired: left as it is


def test_a_claim_leaves_a_shard_used_since_its_stamp_alone(tmp_path):
    """Only a retired copy is stamped: one read an hour ago keeps its place among the released shards."""
    shard = tmp_path / "s0.tar"
    shard.write_bytes(b"x")
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(shard, ns=(hour_ago, hour_ago))
    assert not claim(str(shard)) and _mtime(shard) == hour_ago


def test_a_shard_that_is_not_cached_is_neither_retired_nor_claimed(tmp_path):
    retire(str(tmp_path / "gone.tar"))                  # evicted meanwhile: nothing to do, nothing raised
    assert not claim(str(tmp_path / "gone.tar"))
    assert not (tmp_path / "gone.tar").exists()


def test_touch_stamps_to_the_nanosecond(tmp_path):
    """Eviction orders by these stamps: two shards touched a moment apart are told apart (the kernel's
    coarse "now" tied them, and the tie went to the name)."""
    a, b = tmp_path / "b.tar", tmp_path / "a.tar"   # by name, the other way round
    for f in (a, b):
        f.write_bytes(b"x")
    touch(str(a))
    touch(str(b))
    assert _mtime(a) < _mtime(b)


def test_downloads_are_counted_in_the_lock_files_mtime(tmp_path):
    lock = tmp_path / "s0.tar.lock"
    assert downloads(str(lock)) == 0                     # no lock file: never downloaded
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert downloads(str(lock)) == 0                 # created now: its mtime is the clock's, no count
        count_download(fd)
        count_download(fd)
        count_download(fd)
        count_download(fd, -1)                           # a download that failed is taken back
        assert downloads(str(lock)) == 2
        # A file system that keeps whole seconds (ext3) or 2 s (FAT) keeps the count.
        for tick in (10**9, 2 * 10**9):
            stamp = _mtime(lock) // tick * tick
            os.utime(lock, ns=(stamp, stamp))
            assert downloads(str(lock)) == 2, tick
        for _ in range(3):
            count_download(fd, -1)
        assert downloads(str(lock)) == 0                 # never below none
        assert os.path.getsize(lock) == 0                # a lock file stays empty
    finally:
        os.close(fd)
