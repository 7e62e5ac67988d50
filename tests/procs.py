"""Process inspection for the tests, read from /proc, tolerant of what vanishes mid-walk.

Every test that looks at processes or threads goes through here, and so do the scripts the tests run
in subprocesses (they put this folder on ``sys.path``). Threads and processes end while they are being
listed: a task directory listed by ``iterdir()`` can be gone by the time its ``children`` file is read
(a FileNotFoundError failed a clean clone's CI once in three runs), and a child can exit between being
listed and its ``stat`` being read. Each read is guarded; whatever vanished is simply not counted.
"""
from __future__ import annotations

import os
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # ENOENT (gone), ESRCH, EACCES: the task or process ended or is not ours to read
        return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def state(pid: int) -> str | None:
    """The one-letter state from /proc/<pid>/stat ('R', 'S', 'Z', ...), None when it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:
        return stat.rsplit(")", 1)[1].split()[0]
    except IndexError:
        return None


def children(pid: int | None = None) -> set[int]:
    """Live (not zombie, not dead) child processes of ``pid`` (default: this process)."""
    pid = pid or os.getpid()
    found: set[int] = set()
    for task in _listdir(f"/proc/{pid}/task"):
        text = _read(f"/proc/{pid}/task/{task}/children")
        if text:
            found |= {int(c) for c in text.split()}
    return {c for c in found if state(c) not in (None, "Z", "X")}


def family(pid: int | None = None) -> list[int]:
    """``pid`` (default: this process) and its live children."""
    pid = pid or os.getpid()
    return [pid, *sorted(children(pid))]


def usage(pids=None) -> dict:
    """Summed over ``pids`` (default: this process's family): resident bytes, open fds, threads, processes.

    A process that ends during the walk is left out of every sum, not counted half."""
    rss = fds = threads = procs = 0
    for pid in (family() if pids is None else pids):
        statm = _read(f"/proc/{pid}/statm")
        if statm is None:
            continue
        try:
            p_rss = int(statm.split()[1]) * PAGE
            p_fds = len(os.listdir(f"/proc/{pid}/fd"))
            p_threads = len(os.listdir(f"/proc/{pid}/task"))
        except (OSError, IndexError, ValueError):
            continue
        rss, fds, threads, procs = rss + p_rss, fds + p_fds, threads + p_threads, procs + 1
    return {"rss": rss, "fds": fds, "threads": threads, "procs": procs}


def wait_until(cond, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; the final answer is ``cond()``'s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())
