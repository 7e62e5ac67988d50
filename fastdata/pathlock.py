"""One process at a time on a path: a flock on a lock file, taken without waiting, that names the
process holding it. ``checkpoint.claim`` (a run's checkpoint file) and ``runlog.RunLog`` (its log
folder) hold one for a run's length; ``checkpoint``'s save holds one on its temporary while writing it.

Why flock: the kernel drops it when the process dies (killed, its job ended), so a crashed run never
blocks its own resume, and on Linux NFS emulates it with byte-range locks across hosts. Where there are
no locks (Windows, a file system without them) nothing is held and nothing is refused.
"""
from __future__ import annotations

import os
import socket
import time
import weakref
from pathlib import Path


def try_lock(fd: int, *, blocking: bool = False) -> bool | None:
    """An exclusive flock on ``fd``: True when taken, False when another process holds it, None when
    this system or file system has no locks (then nothing can be told apart, and nothing is refused)."""
    try:
        import fcntl
    except ImportError:   # Windows
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:   # ENOLCK, EOPNOTSUPP: a file system without flock
        return None
    return True


class Claim:
    """A process's hold on a lock file, flocked until ``release``. The file a killed process leaves
    behind is unlocked: the next ``hold`` takes it over (and removes it at its own release)."""

    def __init__(self, lock: Path, fd: int):
        self.lock = lock
        self.fd: int | None = fd
        _CLAIMS.add(self)

    def release(self) -> None:
        """Give the path up (idempotent). The file is removed while still locked: a run that opened it
        meanwhile finds, once it holds the lock, that the name no longer points at it, and starts over."""
        if self.fd is None:
            return
        try:
            self.lock.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __del__(self):
        # An object given up without release() (a RunLog left unclosed in a notebook) frees the path.
        try:
            self.release()
        except Exception:
            pass


def hold(lock: Path, refusal) -> Claim | None:
    """Take the flock on the file ``lock`` (created if missing) for this process, or raise
    ``refusal(holder)`` when another process holds it (``holder``: its pid, host and start, as it wrote
    them). None where no lock can be taken: no locks here, or a lock file that cannot be created."""
    for _ in range(8):   # each retry: the holder released (and removed) the file we opened
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None
        held = try_lock(fd)
        if held is not True:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() if held is False else ""
            here = held is False and _held_here(fd)
            if held is None and os.fstat(fd).st_size == 0:
                # Made by this open for nothing (Windows, a file system without flock): nothing will
                # remove it, and a .lock beside every checkpoint and in every log folder stayed for good.
                _remove(lock)
            os.close(fd)
            if held is None:
                return None
            raise refusal(_holder(holder, lock, here))
        try:
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{_me()}, since {time.ctime()}".encode(), 0)
            return Claim(lock, fd)
        os.close(fd)
    return None


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


#: This process's live claims: whether a refused path is held by this very process is told by them,
#: not by the pid and host a lock file names (containers on two nodes may share both).
_CLAIMS: weakref.WeakSet[Claim] = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker): let go of the parent's claims without removing them.
    A flock belongs to the open file, which a child's copy of the descriptor keeps: a run killed while
    its workers lived on stayed "in use" until the last of them ended, and a child's release() would
    remove the lock file the parent still holds."""
    for claim in list(_CLAIMS):
        fd, claim.fd = claim.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _held_here(fd: int) -> bool:
    """Whether a live claim of this process holds the file open at ``fd``."""
    st = os.fstat(fd)
    for claim in list(_CLAIMS):
        try:
            other = os.fstat(claim.fd) if claim.fd is not None else None
        except OSError:
            continue
        if other is not None and (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _me() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _holder(text: str, lock: Path, here: bool = False) -> str:
    """The holder as it wrote itself, and how to let go where "stop the other run" names no run one
    can stop: this very process (a notebook cell run again, ``log = RunLog(d)`` after its loop raised
    before ``close()``, makes the new object while the old one still holds the path), or a process on
    another host, whose lock a network file system can keep after that host went down (NFSv3's lock
    manager until the host comes back: a job preempted with its node)."""
    if here:
        return (f"{text or _me()}: this process itself, an object of an earlier run in it (a notebook cell run again) "
                f"not closed: close() it (RunLog.close(), TrainingState.release()) or del it")
    if not text:
        return "a process that has not said which"
    host = text.split(" on ", 1)[1].split(",", 1)[0] if text.startswith("pid ") and " on " in text else None
    if host is not None and host != socket.gethostname():
        return (f"{text}; if that run is gone (its host went down, and the network file system kept its "
                f"lock), remove '{lock}'")
    return text
