"""What the shard cache (``shards.cache``) writes in file times, the one record every process of a node
shares without a server or a file to parse: when a cached shard was used, whether a pass is done with it,
and how many times it was downloaded.

Why file times: eviction orders the released shards by their mtime (least recently used first), and any
process (a rank, a DataLoader worker, the read-ahead's thread) may download, so whatever should change
what is evicted, or say what was downloaded, has to be seen by all of them in the cache folder itself.

- ``touch``: used now, to the nanosecond (a shard got or released).
- ``retire``: the pass is done with it; stamped ``RETIRED_NS`` in the past, it is evicted before any
  other released shard. By use alone, a shard fetched ahead and not read yet (stamped when fetched) went
  before a finished one read since, and was downloaded again in the same pass.
- ``claim``: a pass wants a shard that an earlier pass retired and that is cached still: it is stamped
  used now. Else it went first at the next download, before the shards no pass needs, and was downloaded
  again as the pass reached it.
- ``count_download``/``downloads``: each shard's downloads, by any process, in its lock file's mtime (lock
  files are empty and never deleted): the read-ahead sees a shard evicted and fetched again within a pass
  (its warning that the cache is too small for what the readers have in flight).
"""
from __future__ import annotations

import contextlib
import os
import time

__all__ = ["RETIRED_NS", "claim", "count_download", "downloads", "retire", "touch"]

RETIRED_NS = 10 * 365 * 86400 * 10**9   #: how far in the past ``retire`` stamps a finished shard
#: A cached shard stamped before this long ago was retired: half of RETIRED_NS, whatever the clock did since.
_RETIRED_BEFORE_NS = RETIRED_NS // 2
# A lock mtime below 11 days after 1970 is a count: downloads x 2 s (FAT's tick; ext3 keeps whole seconds).
_COUNTED, _COUNT_NS = 10**15, 2 * 10**9


def touch(path: str) -> None:
    """Mark ``path`` used now, to the nanosecond of the clock: what eviction orders by. Not a bare
    ``os.utime(path)``: the kernel stamps "now" from its coarse clock (one tick, 1-10 ms), so a shard
    released by the reader and the next epoch's first shard fetched a moment later read as used at the
    same instant, the tie went to the name, and a fetch-ahead could evict the shard the next pass was
    about to read (it was downloaded twice). Setting a time needs the file's owner: in a cache dir
    shared by several users, another user's shard is stamped the coarse way."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except PermissionError:
        os.utime(path)


def retire(path: str) -> None:
    """Stamp the cached shard at ``path`` ``RETIRED_NS`` in the past: any process's download evicts it
    before the other released shards; a later use (``touch``, ``claim``) stamps it again. Nothing where it
    is gone (evicted) or is another user's file."""
    stamp = time.time_ns() - RETIRED_NS
    with contextlib.suppress(FileNotFoundError, PermissionError):
        os.utime(path, ns=(stamp, stamp))


def claim(path: str) -> bool:
    """Take back ``retire``: stamp the cached shard at ``path`` used now (``touch``) if it was retired.
    Whether it was. A shard used since it was retired is left as it is (its stamp orders it among the
    others); one not cached (or evicted meanwhile), or another user's that cannot be stamped, is only an
    eviction hint missed: False."""
    try:
        if os.stat(path).st_mtime_ns >= time.time_ns() - _RETIRED_BEFORE_NS:
            return False
        touch(path)
    except OSError:
        return False
    return True


def count_download(fd: int, step: int = 1) -> None:
    """``step`` more downloads of the shard whose lock ``fd`` is held exclusively: the lock file's mtime in
    2 s units, kept by a file system of whole seconds (ext3) or 2 s (FAT) too; not bytes (files stay empty)."""
    stamp = os.fstat(fd).st_mtime_ns
    count = max((stamp // _COUNT_NS if stamp < _COUNTED else 0) + step, 0)
    with contextlib.suppress(PermissionError):   # another user's lock file: not counted
        os.utime(fd, ns=(count * _COUNT_NS, count * _COUNT_NS))


def downloads(lock: str) -> int:
    """How many times the shard whose lock file is ``lock`` was downloaded, by any process
    (``count_download``): 0 for a lock file that counts none (created now: its mtime is the clock's) or
    that does not exist (never downloaded)."""
    try:
        stamp = os.stat(lock).st_mtime_ns
    except FileNotFoundError:
        return 0
    return stamp // _COUNT_NS if stamp < _COUNTED else 0
