"""The host's memory as a process may use it: the available RAM, capped by the memory cgroup's room.

Shared by the memory backend's budget (a cache must fit) and the dali backend (its prefetched output
batches must fit), so it sits below both."""
from __future__ import annotations

import os


def fmt_bytes(n: float) -> str:
    """Bytes as messages show them: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else total; capped by
    what this process's memory cgroup still allows (``cgroup_room``)."""
    ram = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    ram = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if ram is None:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = cgroup_room()
    return ram if room is None else min(ram, room)


def total_ram() -> int:
    """The host's RAM (MemTotal), capped by this process's memory cgroup limit (``cgroup_limit``):
    unlike ``available_ram``, the same in every process of a node, and on every node of identical ones,
    whatever each has allocated so far."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_limit()
    return ram if limit is None else min(ram, limit)


def cgroup_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The smallest memory limit of this process's cgroup and its parents (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None where none is set."""
    found = [room_and_limit[1] for d, files in _cgroup_dirs_of(root, proc_cgroup)
             if (room_and_limit := _room_in(d, *files)) is not None]
    return min(found) if found else None


#: (limit file, usage file, the memory.stat key of reclaimable file pages) of cgroup v2, then v1.
_CGROUP_FILES = (("memory.max", "memory.current", "inactive_file"),
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def cgroup_room(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes this process's memory cgroup still allows (limit - usage + inactive file pages, the
    smallest over the cgroup and its parents), or None where no limit is set.

    Why: /proc/meminfo shows the host's memory, not a container's. Under Docker's ``--memory``, a
    Kubernetes limit or a SLURM job's cgroup, a cache sized by MemAvailable alone passed the budget
    and the kernel killed the process (SIGKILL, no message) while it was being built."""
    found = [room_and_limit[0] for d, files in _cgroup_dirs_of(root, proc_cgroup)
             if (room_and_limit := _room_in(d, *files)) is not None]
    return min(found) if found else None


def _cgroup_dirs_of(root: str, proc_cgroup: str) -> list[tuple[str, tuple[str, str, str]]]:
    """(directory, its files in ``_CGROUP_FILES``) of this process's memory cgroup and its parents, v2
    then v1."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    paths = {}   # "v2" / "v1": the process's cgroup path in that hierarchy
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return [(d, files) for files, (version, mount) in zip(_CGROUP_FILES, (("v2", root), ("v1", f"{root}/memory")),
                                                          strict=True)
            for d in _cgroup_dirs(mount, paths.get(version, "/"))]


def _cgroup_dirs(mount: str, path: str) -> list[str]:
    """The cgroup's directory and its parents' under ``mount`` (inside a container's cgroup namespace the
    path is "/" and the mount is the container's own cgroup)."""
    parts = [p for p in path.split("/") if p]
    return [os.path.join(mount, *parts[:k]) for k in range(len(parts), -1, -1)]


def _room_in(d: str, limit_f: str, usage_f: str, key: str) -> tuple[int, int] | None:
    """(room left, limit) in cgroup directory ``d``, None where it sets no limit."""
    try:
        with open(os.path.join(d, limit_f)) as f:
            limit = f.read().strip()
        with open(os.path.join(d, usage_f)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    # "max" (v2) or a page-rounded 2**63 (v1): no limit here.
    if limit == "max" or not limit.isdigit() or int(limit) >= 2**62:
        return None
    inactive = 0
    try:
        with open(os.path.join(d, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    inactive = int(value)
                    break
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - usage + inactive), int(limit)
