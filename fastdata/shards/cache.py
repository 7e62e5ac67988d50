"""The per-node cache of whole shards: bounded, shared by the processes of one node, never half written.

``ShardCache(storage, cache_dir, limit_bytes=..., expected_sizes=...)``: ``get(name)`` returns a local
path (downloading the shard if needed) and marks it in use until ``release(name)``; when a download
needs room, shards the reader has retired (``retire``: finished for this pass) are evicted first, then
the other released shards, least recently used first (the file times that say so, and count each
shard's downloads, are ``shards.stamps``'). Fetching ahead is the reader's job
(``shards.readahead``: ``get`` then ``release`` on a thread, ahead of the readers): a shard fetched and
released stays cached as the most recently used until its reader takes it. A local-folder
``Storage`` is read in place: nothing is copied and the budget is not used.

Why file locks (``fcntl.flock``), one per shard under ``cache_dir/.locks/``: the ranks of a node are
separate processes, and the kernel drops a process's locks when it dies, so a ``kill -9`` cannot leave
a count that blocks eviction forever (the lock-file refcounts of other loaders do). A process downloads
a shard holding its lock exclusively (a second process waits on it, then finds the file published),
and holds it shared while the shard is in use; eviction deletes only files whose lock it can take
exclusively without waiting. Lock files are never deleted: unlinking a lock file that another process
has open lets two processes hold "exclusive" locks on two different files; they are empty and there is
one per shard of the manifest. A ``.budget`` lock serializes the decisions "is there room, what to
evict" so that two processes do not both spend the same free bytes.

A download goes to a temporary name and is published by ``os.replace`` only after its size matched
``expected_sizes`` and its sha256 ``digests`` (``Storage.fetch``); a file with the wrong size under the
final name (from an older run, or written by something else) is treated as missing and fetched again.
Temporary files of dead processes are removed when the cache is opened and whenever it scans.

Why the digest is in the file name (``shard-000.<16 hex digits of its sha256>.tar``): a location that is
re-packed keeps its shard names, often their sizes too, so a cache keyed by name alone served the old
shards under the new index. Keyed by identity, a new version of a shard is a new file, never the old
copy; the old versions' files (same stem and extension, another digest, or the bare name a cache of
an earlier fastdata used) count against the budget and are evicted first once no process holds them.
Other files in ``cache_dir`` are left alone.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import shutil
import threading
import time
import uuid
import weakref

from fastdata.checks import check_integer, check_number
from fastdata.shards import stamps
from fastdata.shards.storage import ShardMismatch, StorageError, check_name

__all__ = ["ShardCache", "CacheFull", "unlock_close", "human_bytes"]

_TMP = re.compile(r"^(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-z]+$")
# A cached shard's file name with its identity: STEM.<16 hex digits of its sha256>[.EXT].
_VERSIONED = re.compile(r"^(?P<stem>(?:.*/)?\.?[^/.]+)\.(?P<digest>[0-9a-f]{16})(?P<ext>\.[^/]+)?$")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_LOCKS = ".locks"
_POLL = 0.05


class _Ready(Exception):
    """A wait for a lock ended without it: what the waiter was waiting for came about meanwhile."""


class CacheFull(OSError):
    """The cache cannot make room for a shard: its budget is held by shards in use, or its disk is full
    (or read-only)."""


def human_bytes(n: float) -> str:
    """``n`` bytes as people read them: ``"512 B"``, ``"1.5 MB"`` (powers of 1000, as disks are sold)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # exists, owned by someone else
        return True
    return True


class ShardCache:
    """A bounded folder of whole shards, shared by the processes of one node.

    Args:
        storage: the ``Storage`` the shards come from.
        cache_dir: the local folder (created if missing). Give the ranks of a node the same one.
        limit_bytes: the most bytes of shards kept on disk, in-progress downloads included.
        expected_sizes: ``{shard name: size in bytes}`` from the index; a download of another size is an
            error (retried), a cached file of another size is fetched again.
        digests: ``{shard name: sha256 hex}`` from the index, or None. Given, a shard is cached under a
            name that carries its digest, and a download with another digest is a ``ShardMismatch``
            (never published; later ``get`` calls of this cache raise it again without downloading).
        window: how many shards the reader holds at once; the budget must hold the ``window`` largest
            shards, which is checked here, before any download.
        wait_timeout: seconds ``get`` waits for another process's download of the same shard, or for
            room held by shards in use, before it raises.
        failure_hold: seconds a reader's ``get`` that failed after the storage's retries (a 5xx that
            did not end, a 404) is raised again at once by this process's ``get`` of that shard, instead
            of every sample of the shard going through the retries again: under ``on_error="skip"`` a
            shard that stays unreachable cost its retries per sample (hours for a shard of thousands).
    """

    def __init__(self, storage, cache_dir, *, limit_bytes: int, expected_sizes: dict, window: int = 1,
                 wait_timeout: float = 600.0, digests: dict | None = None, failure_hold: float = 60.0):
        if not expected_sizes:
            raise ValueError("ShardCache: expected_sizes is empty; it maps each shard name to its size")
        sizes = {}
        for name, size in expected_sizes.items():
            check_name(name)
            sizes[name] = check_integer(f"ShardCache: the expected size (bytes) of shard {name!r}", size, minimum=0)
        # window: the number of shards read at once.
        window = check_integer("ShardCache: window", window, minimum=1)
        self.storage, self.expected_sizes, self.window = storage, sizes, window
        self.digests = self._check_digests(digests or {}, sizes)
        self._files = {name: _versioned(name, self.digests.get(name)) for name in sizes}   # name -> file
        self._names = {file: name for name, file in self._files.items()}                 # file -> name
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        self.limit_bytes = check_integer("ShardCache: limit_bytes", limit_bytes, minimum=0)
        self.wait_timeout = check_number("ShardCache: wait_timeout (seconds)", wait_timeout, above=0)
        self.failure_hold = check_number("ShardCache: failure_hold (seconds)", failure_hold, minimum=0)
        self.in_place = getattr(storage, "local_path", lambda n: None)(next(iter(sizes))) is not None
        largest = sorted(sizes.values(), reverse=True)[:self.window]
        need = sum(largest)
        if not self.in_place and self.limit_bytes < need:
            # Said in Shards' words (its one caller): the user gave cache_limit= and window=, and holds
            # 2 x window shards at once; "limit_bytes" and this class's window would name neither.
            what = "the largest shard" if self.window == 1 else f"the {self.window} largest shards"
            raise ValueError(f"the shard cache's limit (Shards' cache_limit=) of {self.limit_bytes} bytes "
                             f"({human_bytes(self.limit_bytes)}) cannot hold {what}, the most read at once (Shards "
                             f"holds 2 x window= shards: the window being read and the next, fetched ahead): "
                             f"it needs at least {need} bytes ({human_bytes(need)}) in {self.cache_dir}; raise "
                             f"cache_limit, lower window, or pack smaller shards (pack --shard-size)")
        self._lock = threading.RLock()
        self._reset()
        # In a forked child, drop the inherited lock copies at once, not at its first use of the cache.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (c := ref()) is not None and c._after_fork())
        if not self.in_place:
            os.makedirs(os.path.join(self.cache_dir, _LOCKS), exist_ok=True)
            self._check_locks()
            self._scan()   # removes what dead processes left half written

    def _check_locks(self) -> None:
        """Refuse a ``cache_dir`` whose file system has no ``flock`` (some FUSE mounts, Lustre without
        ``-o flock``): every ``get`` failed there, and each failure was one sample's (``on_error="skip"``
        skipped them all)."""
        fd = os.open(os.path.join(self.cache_dir, _LOCKS, ".budget"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass                         # another process holds it: locks work
        except OSError as e:
            raise ValueError(f"ShardCache: the file system of cache_dir {self.cache_dir} does not support file "
                             f"locks (flock: {e.strerror or e}), which the processes sharing the cache need; "
                             f"give cache_dir= a folder on a local disk") from None
        finally:
            unlock_close(fd)

    @staticmethod
    def _check_digests(digests: dict, sizes: dict) -> dict:
        for name, digest in digests.items():
            if name not in sizes:
                raise ValueError(f"ShardCache: digests names shard {name!r}, which expected_sizes does not")
            if not isinstance(digest, str) or not _SHA256.match(digest):
                raise ValueError(f"ShardCache: digest of shard {name!r} is {digest!r}; expected 64 lowercase "
                                 f"hex digits (a sha256)")
        return dict(digests)

    def _reset(self):
        self._held: dict[str, list] = {}          # name -> [lock fd (shared), count, {release's last: None}]
        self._mismatched: dict[str, BaseException] = {}   # shards whose download is another shard
        self._failed: dict[str, tuple[BaseException, float]] = {}   # name -> (error, raised again until)
        self._pid = os.getpid()

    def __getstate__(self):
        # Locks and held shards belong to the process that took them: a copy starts empty (``_reset``).
        # The file names of the shards' versions (``_files``, ``_names``) are the cache's layout: kept.
        per_process = ("_lock", "_held", "_mismatched", "_failed", "_pid")
        return {k: v for k, v in self.__dict__.items() if k not in per_process}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._reset()

    def _after_fork(self):
        """In a forked child, at once: no descriptor it inherited keeps a cache file (or lock) alive."""
        _detach_inherited(self.cache_dir)
        self._check_process()

    def _check_process(self):
        if self._pid != os.getpid():
            # A forked child: the lock descriptors it inherited are copies of the parent's, sharing their
            # flock. Our copies are closed (close, never LOCK_UN: that would release the parent's lock
            # too): kept open, they would hold the parent's shards locked after the parent released them,
            # and a DataLoader worker forked while the parent read a shard kept that shard unevictable for
            # the worker's whole life.
            for fd, *_ in self._held.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._lock = threading.RLock()
            self._reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- paths -----------------------------------------------------------------------------------

    def path(self, name: str) -> str:
        """Where ``name`` lives once cached (or, read in place, in the storage's folder)."""
        self._known(name)
        if self.in_place:
            return self.storage.local_path(name)
        return os.path.join(self.cache_dir, *self._files[name].split("/"))

    def _known(self, name: str) -> int:
        check_name(name)
        try:
            return self.expected_sizes[name]
        except KeyError:
            raise KeyError(f"shard {name!r} is not in this cache's expected_sizes ({len(self.expected_sizes)} "
                           f"shards, e.g. {next(iter(self.expected_sizes))!r})") from None

    def _good(self, name: str) -> bool:
        try:
            return os.stat(self.path(name)).st_size == self.expected_sizes[name]
        except FileNotFoundError:
            return False

    def _lock_path(self, file: str) -> str:
        """The lock file of cached ``file`` (a shard's is ``self._files[name]``), under ``.locks/``."""
        return os.path.join(self.cache_dir, _LOCKS, *file.split("/")) + ".lock"

    def _open_lock(self, file: str) -> int:
        """The open lock file of cached ``file`` (``_lock_path``)."""
        path = self._lock_path(file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def _flock(self, fd: int, mode: int, deadline: float, what: str, progress=None, ready=None) -> float:
        """flock(fd, mode), waiting at most until ``deadline``: polled, so a stuck peer is an error, not a
        hang; returns the deadline, moved by ``progress``: a value that changes while the holder gets on
        (a download's bytes so far), each change giving the wait another ``wait_timeout``. A big shard over
        a slow link takes as long as it takes while its bytes keep coming, for the process downloading it
        (``timeout`` bounds each wait for bytes) and so for the ones waiting for it too. ``ready``: the
        wait ends without the lock (``_Ready`` raised) once it says True."""
        seen = progress() if progress is not None else None
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return deadline
            except BlockingIOError:
                if ready is not None and ready():
                    raise _Ready from None
                now = time.monotonic()
                if progress is not None and (moved := progress()) != seen:
                    seen, deadline = moved, max(deadline, now + self.wait_timeout)
                if now >= deadline:
                    raise TimeoutError(f"waited {self.wait_timeout:.0f} s for {what} in {self.cache_dir} "
                                       f"(another process holds it; wait_timeout= sets the limit)") from None
                time.sleep(_POLL)

    def _downloaded(self, name: str) -> int:
        """Bytes written so far by the downloads of ``name`` in progress (their temporary files)."""
        final = self.path(name)
        total = 0
        for tmp in glob.glob(glob.escape(final) + ".tmp-*"):
            try:
                total += os.path.getsize(tmp)
            except FileNotFoundError:   # published or removed meanwhile
                pass
        return total

    # -- public API ------------------------------------------------------------------------------

    def get(self, name: str, *, remember_failure: bool = True, wanted=None) -> str | None:
        """The local path of shard ``name``, downloaded if needed and held (not evicted) until ``release``.
        ``remember_failure=False`` (the read-ahead thread): a failed download is not kept for the readers,
        who try once themselves. ``wanted`` (the read-ahead thread): a callable asked while ``get`` waits
        for another process and before it downloads; once it says False, ``get`` returns None, holding
        nothing: the readers went past the shard while it waited, and a download now would only evict
        the shards they read next."""
        self._check_process()
        self._known(name)
        if self.in_place:
            return self.path(name)
        with self._lock:
            if name in self._held:
                self._held[name][1] += 1
                stamps.touch(self.path(name))
                return self.path(name)
            mismatched = self._mismatched.get(name)
            failed = self._failed.get(name)
        if mismatched is not None:
            raise mismatched
        if failed is not None and time.monotonic() < failed[1]:
            raise failed[0].with_traceback(None)
        try:
            fd = self._acquire(name, wanted)
            if fd is None:
                return None
        except ShardMismatch as e:
            with self._lock:
                self._mismatched[name] = e
            raise
        except StorageError as e:   # after the storage's retries, or final at once (a 404, a 403)
            if remember_failure:
                with self._lock:
                    self._failed[name] = (e, time.monotonic() + self.failure_hold)
            raise
        with self._lock:
            if name in self._held:         # another thread of this process got it meanwhile
                unlock_close(fd)
                self._held[name][1] += 1
            else:
                self._held[name] = [fd, 1, {}]
        return self.path(name)

    def release(self, name: str, *, last=None) -> None:
        """Done with ``name`` (once per ``get``): when no reader of this process holds it, it may be evicted.

        ``last``: called when this process's last hold ends, before the file may be evicted: the reader
        closes its descriptors of the file there. An evicted file that is still open keeps its bytes on
        the disk while the budget counts them as free. Kept until then, whoever releases last: the
        read-ahead thread (which gives none) or another reader may hold the shard after this one, and
        the reader's descriptor stayed open once they released it. Equal callables are kept once."""
        self._check_process()
        self._known(name)
        if self.in_place:
            return
        with self._lock:
            entry = self._held.get(name)
            if entry is None:
                raise ValueError(f"release({name!r}): this cache does not hold that shard (one release per get)")
            entry[1] -= 1
            if last is not None:
                entry[2][last] = None
            if entry[1] == 0:
                try:
                    for close in entry[2]:
                        close()
                finally:
                    self._drop(name)

    def downloads(self, name: str) -> int:
        """How many times shard ``name`` was downloaded into this cache folder, by any process (counted in
        its lock file: ``shards.stamps``): ``shards.readahead`` sees a shard evicted and fetched again.
        0 read in place."""
        self._known(name)
        return stamps.downloads(self._lock_path(self._files[name]))

    def retire(self, name: str) -> bool:
        """The pass is done with ``name``: any process's download evicts it before other released shards
        (``shards.stamps.retire``; a later use stamps it again). False where it was not stamped: in place,
        or held by this process (its release stamps it used)."""
        self._check_process()
        self._known(name)
        if self.in_place or name in self._held:
            return False
        stamps.retire(self.path(name))
        return True

    def claim(self, name: str) -> bool:
        """A pass wants ``name``: a cached copy that an earlier pass retired is stamped used now
        (``shards.stamps.claim``), so that it is not evicted first. Whether it was. Never in place: the
        storage's own files are not stamped."""
        return not self.in_place and stamps.claim(self.path(name))

    def _drop(self, name: str):
        fd, *_ = self._held.pop(name)
        try:
            stamps.touch(self.path(name))        # least recently used = released longest ago
        except FileNotFoundError:
            pass
        unlock_close(fd)                  # evictable from now on

    def close(self) -> None:
        """Release every shard this process still holds."""
        if self._pid != os.getpid():
            return
        with self._lock:
            for name in list(self._held):
                self._drop(name)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass

    # -- acquiring, downloading, evicting --------------------------------------------------------

    def _acquire(self, name: str, wanted=None) -> int | None:
        """A lock descriptor holding ``name`` shared, with the file published under its final name; None
        once ``wanted()`` says False before the shard is there."""
        deadline = time.monotonic() + self.wait_timeout
        fd = self._open_lock(self._files[name])

        def progress():   # another process's download of it: waited for while its bytes keep coming
            return self._downloaded(name)

        def unwanted():
            return wanted is not None and not wanted()

        try:
            while True:
                # Not waited for once unwanted: another process's download may take minutes.
                deadline = self._flock(fd, fcntl.LOCK_SH, deadline, f"shard {name!r}'s lock", progress,
                                       ready=unwanted)
                # Checked under the shared lock: from here on no one can evict it.
                if self._good(name):
                    stamps.touch(self.path(name))
                    return fd
                fcntl.flock(fd, fcntl.LOCK_UN)
                # Exclusive: we download it, or wait here while another process does, until it is
                # published: its downloader then reads it holding it shared, and so may the other ranks
                # and threads without a gap, for as long as they read it; waiting for exclusivity till
                # then timed out, or downloaded the shard again once it was evicted.
                try:
                    deadline = self._flock(fd, fcntl.LOCK_EX, deadline, f"shard {name!r}'s lock", progress,
                                           ready=lambda: self._good(name) or unwanted())
                except _Ready:
                    if unwanted():
                        raise
                    continue                         # published meanwhile: take it shared
                if not self._good(name):
                    if unwanted():
                        raise _Ready
                    try:
                        os.unlink(self.path(name))   # wrong size: nobody holds it (we hold it exclusively)
                    except FileNotFoundError:
                        pass
                    stamps.count_download(fd)   # before it is published: a reader that sees it sees it counted
                    try:
                        self._download(name, deadline=deadline)
                    except BaseException:
                        stamps.count_download(fd, -1)
                        raise
                # Loop: take it shared and check again (flock's conversion is not atomic).
        except _Ready:   # unwanted before the shard was there: nothing held
            unlock_close(fd)
            return None
        except BaseException:
            unlock_close(fd)
            raise

    def _download(self, name: str, *, deadline: float):
        size, final = self.expected_sizes[name], self.path(name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        freed_for_disk = None
        for attempt in range(2):
            reservation = self._reserve(name, size, deadline=deadline)
            try:
                # Only with a digest: a Storage written before digests existed takes size alone.
                digest = {"sha256": self.digests[name]} if name in self.digests else {}
                self.storage.fetch(name, final, size=size, **digest)
                return
            except OSError as e:
                if e.errno == errno.EROFS:
                    # The node's disk, not the shard's: raised as it is, never each sample's DecodeError
                    # (on_error="skip" would skip the whole pass), and no eviction makes it writable.
                    raise CacheFull(errno.EROFS, f"the shard cache {self.cache_dir} is on a read-only file "
                                    f"system (shard {name!r} could not be written there): give a cache_dir "
                                    f"on a writable disk") from None
                if e.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", 122)):
                    raise
                if attempt == 1:
                    free = shutil.disk_usage(self.cache_dir).free
                    raise CacheFull(errno.ENOSPC, f"the disk holding the shard cache {self.cache_dir} is full: "
                                    f"shard {name!r} needs {size} bytes ({human_bytes(size)}), {free} bytes "
                                    f"({human_bytes(free)}) are free after evicting {freed_for_disk} released "
                                    f"shard(s); free space there, lower limit_bytes={self.limit_bytes} or give "
                                    f"another cache_dir") from None
            finally:
                _unlink(reservation)
            # The disk filled before the budget did (other files on it): evict what is released, retry once.
            freed_for_disk = self._evict_for_disk(size, deadline)

    def _reserve(self, name: str, size: int, *, deadline: float) -> str:
        """Make room for ``size`` bytes and leave a marker that other processes count as ``size`` until
        the download is published, so that two processes do not both spend the same free bytes."""
        budget = os.open(os.path.join(self.cache_dir, _LOCKS, ".budget"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                self._flock(budget, fcntl.LOCK_EX, deadline, "the cache's budget lock")
                try:
                    if self._make_room(size, exclude=name):
                        marker = f"{self.path(name)}.tmp-{os.getpid()}-reserved{uuid.uuid4().hex[:8]}"
                        open(marker, "wb").close()
                        return marker
                finally:
                    fcntl.flock(budget, fcntl.LOCK_UN)
                if time.monotonic() >= deadline:
                    usage, _ = self._scan()
                    raise CacheFull(errno.ENOSPC, f"shard cache {self.cache_dir} cannot make room for shard "
                                    f"{name!r} ({human_bytes(size)}): {human_bytes(usage)} of limit_bytes="
                                    f"{self.limit_bytes} ({human_bytes(self.limit_bytes)}) are held by shards in "
                                    f"use for {self.wait_timeout:.0f} s; release shards after reading them, or "
                                    f"raise the limit to hold every shard read at once")
                time.sleep(_POLL * 4)
        finally:
            os.close(budget)

    def _scan(self):
        """(bytes counted against the budget, [(mtime, file, bytes) of published shards, older versions of
        the manifest's shards first]). ``file`` is relative to the cache folder. Removes the temporary
        files of dead processes."""
        usage, published, stale, pending = 0, [], [], set()
        root = self.cache_dir
        for folder, dirs, files in os.walk(root):
            if folder == root and _LOCKS in dirs:
                dirs.remove(_LOCKS)
            rel = os.path.relpath(folder, root)
            for f in files:
                name = f if rel == "." else "/".join([*rel.split(os.sep), f])
                match = _TMP.match(name)
                if match is not None:
                    if not _alive(int(match["pid"])):
                        _unlink(os.path.join(folder, f))
                    elif not self._remove_abandoned(match["base"], os.path.join(folder, f)) \
                            and match["base"] in self._names:   # a live download: pending
                        pending.add(self._names[match["base"]])
                    continue
                ours = name in self._names
                if not ours and not self._old_version(name):
                    continue
                try:
                    st = os.stat(os.path.join(folder, f))
                except FileNotFoundError:
                    continue
                usage += st.st_size
                (published if ours else stale).append((st.st_mtime_ns, name, st.st_size))
        usage += sum(self.expected_sizes[n] for n in pending)
        return usage, sorted(stale) + sorted(published)

    def _remove_abandoned(self, file: str, tmp: str) -> bool:
        """Remove temporary file ``tmp`` of cached ``file`` if no process holds ``file``'s lock (taken
        here exclusively, without waiting) and ``tmp`` is still there: a download holds its shard's lock
        from its reservation to its publication, so it was left by a process that died. The pid in the
        name is not enough: a container restarted on a kept cache_dir runs its trainer under the pid the
        killed one had (PID 1, say), and its half files looked alive. A ``tmp`` gone by the time the lock
        is free was published meanwhile (False: counted as pending, as the listing may miss the shard)."""
        fd = self._open_lock(file)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False                # a live download, or readers of the published shard
            if not os.path.exists(tmp):
                return False
            _unlink(tmp)
            return True
        finally:
            unlock_close(fd)             # not a bare close: a process forked meanwhile keeps no lock

    def _old_version(self, file: str) -> bool:
        """Whether ``file`` is another version (another digest) of one of the manifest's shards, or a
        copy under its bare name (a cache written before shards were keyed by digest)."""
        if file in self._files and self._files[file] != file:
            return True
        match = _VERSIONED.match(file)
        return match is not None and f"{match['stem']}{match['ext'] or ''}" in self._files

    def _evict(self, file: str) -> int:
        """Delete cached ``file`` if no process holds it (its lock taken exclusively without waiting);
        its bytes."""
        with self._lock:
            if self._names.get(file) in self._held:
                return 0
        fd = self._open_lock(file)
        path = os.path.join(self.cache_dir, *file.split("/"))
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0                   # in use, or being downloaded, by some process
            try:
                size = os.stat(path).st_size
                os.unlink(path)
                return size
            except FileNotFoundError:
                return 0
        finally:
            unlock_close(fd)

    def _make_room(self, size: int, *, exclude: str) -> bool:
        usage, published = self._scan()
        for _, file, _ in published:       # old versions, then least recently used first
            if usage + size <= self.limit_bytes:
                break
            if file != self._files[exclude]:
                usage -= self._evict(file)
        return usage + size <= self.limit_bytes

    def _evict_for_disk(self, size: int, deadline: float) -> int:
        budget = os.open(os.path.join(self.cache_dir, _LOCKS, ".budget"), os.O_RDWR | os.O_CREAT, 0o644)
        evicted = 0
        try:
            self._flock(budget, fcntl.LOCK_EX, deadline, "the cache's budget lock")
            for _, file, _ in self._scan()[1]:
                if shutil.disk_usage(self.cache_dir).free >= size:
                    break
                evicted += bool(self._evict(file))
        finally:
            unlock_close(budget)
        return evicted


def _versioned(name: str, digest: str | None) -> str:
    """The cache's file name of shard ``name``: ``dir/stem.<16 hex digits>.ext`` (``name`` without a digest)."""
    if digest is None:
        return name
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not stem:                     # ".hidden": no extension to keep apart
        stem, dot, ext = base, "", ""
    versioned = f"{stem}.{digest[:16]}{dot}{ext}"
    return f"{folder}/{versioned}" if folder else versioned


def _detach_inherited(folder: str) -> None:
    """Point every descriptor of this (just forked) process that is open on a file under ``folder`` at
    ``/dev/null``. A DataLoader worker forks while the read-ahead thread downloads (a pass starts both at
    once): it inherited the download's open file, and once that shard was published and evicted, its
    bytes stayed on the disk, past the budget, for the worker's whole life. ``dup2``, not ``close``: the
    parent's objects copied into the child (the download's file object) may close their descriptor
    later, and a closed number could by then be another file's. Linux (``/proc``); elsewhere nothing."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    prefix, null = folder.rstrip(os.sep) + os.sep, None
    try:
        for name in fds:
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith(prefix):
                    continue
                if null is None:
                    null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, int(name))
            except OSError:   # closed meanwhile (listdir's own descriptor)
                pass
    finally:
        if null is not None:
            os.close(null)


def unlock_close(fd: int) -> None:
    """Unlock, then close. Closing alone is not enough: a process forked while ``fd`` was open (a
    DataLoader worker started while the prefetcher was downloading, or while a shard was being
    evicted) holds a copy of it, and a flock lives until the last copy closes. A shard downloaded
    during such a fork stayed locked for the worker's whole life, so it was never evicted, and a lock
    taken to evict would have blocked that shard for every process. LOCK_UN releases the lock for
    every copy at once. (The child itself only closes its copies: see ``_check_process``.)"""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
