"""Whether a shard read in place is the shard its index describes: its sha256, hashed once per version
of the file and kept for the other processes that open it (``Verdicts``)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid

from fastdata.shards.cache import unlock_close
from fastdata.shards.storage import ShardMismatch

__all__ = ["Verdicts"]


class Verdicts:
    """Whether local shard files are the shards their index describes, hashed once per file version.

    A shard read in place (a local folder) is checked when a reader opens it: its size against the
    index at every open (an ``fstat``), its sha256 once per version of the file, the version being
    ``(path, size, mtime_ns, inode)``. Hashing a 256 MB shard costs a fraction of a second, far less
    than decoding it, but every DataLoader worker and rank opens every shard: so the verdict is kept in
    ``folder`` (one small file per shard path, written under a lock by the first process that hashes it)
    and in this process's memory, and a file rewritten in place gets a new mtime and is hashed again.

    Args:
        folder: where the verdicts are kept (created); None, or a folder that cannot be written: this
            process's memory only.
    """

    def __init__(self, folder):
        self.folder = None if folder is None else os.fspath(folder)
        self._lock = threading.Lock()
        self._seen: dict[tuple, str] = {}   # file version -> its sha256

    def __getstate__(self):
        # A spawn or forkserver DataLoader worker pickles the source: the lock stays here (it cannot be
        # pickled), the digests seen travel (they are facts about file versions, true in any process).
        with self._lock:
            return {"folder": self.folder, "_seen": dict(self._seen)}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def check(self, path: str, fd: int, *, size: int, sha256: str, name: str, where: str) -> None:
        """Raise ``ShardMismatch`` naming shard ``name`` (at ``where``) unless the open file ``fd`` has
        ``size`` bytes and the digest ``sha256``."""
        st = os.fstat(fd)
        if st.st_size != size:
            raise ShardMismatch(f"shard '{name}' at {where} is {st.st_size} bytes, but its index says {size}: it "
                                f"is not the shard the index describes (re-packed or changed since)", name, where)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            digest = self._seen.get(key)
        if digest is None:
            digest = self._stored(key, fd)
            with self._lock:
                self._seen[key] = digest
        if digest != sha256:
            raise ShardMismatch(f"shard '{name}' at {where} is not the shard its index describes: its sha256 is "
                                f"{digest[:16]}..., the index says {sha256[:16]}... (re-packed or changed "
                                f"since the index was written)", name, where)

    def _stored(self, key: tuple, fd: int) -> str:
        """The digest of file version ``key``: from its verdict file, else hashed (and written there)."""
        from .storage import file_sha256

        if self.folder is None:
            return file_sha256(None, fd)
        import hashlib
        import json

        stem = os.path.join(self.folder, hashlib.sha1(key[0].encode()).hexdigest())
        version = list(key[1:])
        try:
            os.makedirs(self.folder, exist_ok=True)
            lock = os.open(stem + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return file_sha256(None, fd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)   # one process hashes, the others wait and read its verdict
            try:
                with open(stem + ".json") as f:
                    record = json.load(f)
                if record.get("path") == key[0] and record.get("version") == version:
                    return str(record["sha256"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
            digest = file_sha256(None, fd)
            tmp = f"{stem}.json.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "w") as f:
                    json.dump({"path": key[0], "version": version, "sha256": digest}, f)
                os.replace(tmp, stem + ".json")
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return digest
        finally:
            unlock_close(lock)
