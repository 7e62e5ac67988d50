"""Atomic checkpoints that load with ``torch.load(weights_only=True)``.

A checkpoint is written to a temporary file in the destination's folder, flushed and fsynced, then
moved over the destination with ``os.replace``: a reader (or a run restarted after a crash) sees the
old checkpoint or the new one, never half of one. The temporary lives in the same folder because
``os.replace`` is atomic only within one file system. A crash between the write and the replace
leaves a ``<name>.tmp.*`` file behind; ``clean_stale`` removes those on the next start.

Everything saved is tensors and plain Python types (RNG states included), so loading never needs to
unpickle arbitrary objects.

Where a checkpoint lives is a small hook (``storage_for``): a plain path is the local file system
(the atomic save above); a URL with a scheme (``s3://``, ``gs://``, ``memory://``, ...) goes through
fsspec where it is installed (``file://`` is the local file system); any object with ``exists``,
``read_bytes`` and ``write_bytes`` (``Storage``) can be passed instead. ``load_shared`` reads one
checkpoint for every rank of a job: rank 0 decides whether it exists, and a rank that cannot read the
same bytes (its node has its own disk) gets them from rank 0.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import io
import os
import pickle
import random
import re
import shutil
import stat
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from .pathlock import Claim, hold, try_lock

TMP_MARK = ".tmp."


def save(obj: dict, path, storage=None):
    """Write ``obj`` to ``path`` atomically. On any error the previous file at ``path`` is untouched,
    the temporary is removed and the error propagates.

    What is written is ``loadable(obj)``: numpy values become Python numbers and tensors, and a value
    ``load`` could not read back is refused here, naming its key, instead of written.

    ``path`` may be a URL or ``storage`` given (see ``storage_for``): the checkpoint is then serialized
    in memory and handed to the storage's ``write_bytes`` in one piece. Returns the local ``Path`` it
    wrote, or the URL as given."""
    obj = loadable(obj, f"checkpoint '{path}'")
    store = storage_for(path, storage)
    if store is not LOCAL:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        store.write_bytes(str(path), buffer.getvalue())
        return path
    path = _local_path(path)
    _atomic_write(path, lambda f: torch.save(obj, f))
    return path


#: Values ``torch.load(weights_only=True)`` reads whatever torch version wrote them (their exact types:
#: an IntEnum is an int and is not one of them).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_PLAIN = (torch.Tensor, torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)


def loadable(obj, name: str = "checkpoint"):
    """``obj`` as ``load`` (``torch.load(weights_only=True)``) can read it back: numpy scalars as Python
    numbers (``np.float64`` → float, ``np.int64`` → int), numeric numpy arrays as tensors (others as
    lists), in a copy of the containers (the tensors are not copied).

    A scheduler's state_dict is its ``__dict__``: a user's schedule computed with numpy holds
    ``np.float64`` rates (and puts them in the optimizer's param_groups) and ``np.int64`` counters.
    ``torch.save`` pickles them with numpy's globals, which ``weights_only`` refuses, so the run saved
    fine and could never be resumed ("not a fastdata checkpoint or is corrupt").

    Any other value of a type ``weights_only`` refuses (a Fraction, an Enum, a namedtuple; unless
    allowed with ``torch.serialization.add_safe_globals``) is a TypeError naming its key in ``name``.
    """
    return _loadable(obj, name, "")


def _loadable(v, name: str, keys: str):
    if isinstance(v, np.generic):   # before the plain types: np.float64 subclasses float
        v = v.item()
    elif isinstance(v, np.ndarray):
        if v.dtype.kind in "biufc":   # a copy: from_numpy refuses a read-only array's memory with a warning
            return torch.from_numpy(np.array(v, order="C"))
        v = v.tolist()
    kind = type(v)
    if kind in _PLAIN or isinstance(v, _TORCH_PLAIN):
        return v
    if kind in (dict, collections.OrderedDict):
        return kind((_loadable(k, name, f"{keys} (a key)"), _loadable(x, name, f"{keys}[{k!r}]"))
                    for k, x in v.items())
    if kind in (list, tuple, set):
        return kind(_loadable(x, name, f"{keys}[{i}]") for i, x in enumerate(v))
    # Something else: loadable only when torch allows it (add_safe_globals). Try this value alone.
    buffer = io.BytesIO()
    try:
        torch.save(v, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:
        cls = f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{name}: {keys or 'the object'} is a {cls} ({v!r:.60}), which "
                        f"torch.load(weights_only=True) cannot read back ({type(e).__name__}), so it is not "
                        f"written: keep numbers, strings and tensors in that state_dict, or allow the class "
                        f"with torch.serialization.add_safe_globals([{cls}])") from None
    return v


def _atomic_write(path: Path, write) -> None:
    """``write(file)`` into a temporary beside ``path``, fsync it, then move it over ``path`` (over the
    file a symbolic link at ``path`` points to: see ``_followed``)."""
    path = _followed(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot save checkpoint '{path}': folder '{folder}' does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=folder)
    except OSError as e:
        raise _save_failed(e, path) from e
    # Locked while it is written: another run's clean_stale (the same path, started meanwhile) leaves
    # a temporary in use alone; it removed it, and this save's os.replace failed naming a .tmp file.
    try_lock(fd)
    f = os.fdopen(fd, "wb")
    try:
        # mkstemp makes the file 0600 and os.replace keeps that: give it the mode open() would, so a
        # team's shared run folder can read (and resume from) the checkpoint as from torch.save's.
        os.chmod(fd, 0o666 & ~_umask())
        write(f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # with the lock still held: closing first opened a window for clean_stale
    except BaseException as e:
        f.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        cause = _os_error(e)
        if cause is not None:
            raise _save_failed(cause, path) from e
        raise
    f.close()
    _fsync_folder(folder)  # makes the rename itself durable


def _followed(path: Path) -> Path:
    """The file a symbolic link at ``path`` points to, else ``path``. A checkpoint linked to a scratch
    disk (``run/c.pt -> /scratch/me/c.pt``, beside a home folder's small quota) was replaced by a regular
    file in ``run/``: os.replace renames over the link, not its target, so every save after the first
    went to the quota'd disk and the scratch copy stopped at the link's day."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _save_failed(e: OSError, path: Path) -> OSError:
    """An OSError of a save (a full disk, a folder made read-only, a quota) as one that names the
    checkpoint and says what is kept: torch.save's own said "[Errno 28] No space left on device" and
    nothing of which file, or that the previous checkpoint is intact. Same class and errno."""
    what = {errno.ENOSPC: "Free space on that disk", errno.EDQUOT: "Free space within your quota",
            errno.EACCES: "Make the folder writable", errno.EROFS: "Give a path on a writable file system"}
    todo = what.get(e.errno or 0, "Fix that")
    kept = (f"the previous checkpoint there is intact. {todo}, then resume from it" if path.is_file()
            else f"nothing was written there. {todo} and run again")
    text = f"cannot save checkpoint '{path}': {e.strerror or e}; {kept} (or give another checkpoint path)"
    return type(e)(e.errno, text) if e.errno is not None else type(e)(text)


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: ``e`` itself, or the one torch's writer met while it wrote. On a
    full disk torch.save raises "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos
    704 vs 598", naming neither the file nor the disk; the file's own OSError is its ``__context__``."""
    link: BaseException | None = e
    for _ in range(5):
        if link is None or isinstance(link, OSError):
            return link
        link = link.__cause__ or link.__context__
    return None


def _umask() -> int:
    """The process's umask: Linux's /proc/self/status says it without changing it; elsewhere os.umask
    can only read it by setting it (set back at once; another thread creating a file in between would
    get 022's mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms/file systems cannot open a directory; the data is safe anyway
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read back: empty, truncated, corrupt or not a checkpoint."""


class ResumeError(CheckpointError):
    """A checkpoint that reads but cannot continue this run: another dataset or sample order, or a
    one-cycle schedule the run would step past its end. A CheckpointError, so a caller that turns an
    unusable checkpoint into one line of error catches both."""


def load(path, map_location="cpu", storage=None) -> dict:
    """Load a checkpoint written by ``save`` (``weights_only=True``: no arbitrary code runs).

    Every failure names the path and says what is wrong with it: missing, a folder, empty, truncated
    or corrupt, or a file that is not a checkpoint (``CheckpointError``, a ``ValueError``). A URL or a
    ``storage`` reads through it (see ``storage_for``)."""
    store = storage_for(path, storage)
    if store is not LOCAL:
        return from_bytes(read_bytes(path, store), path, map_location)
    path = _local_path(path)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint '{path}' is a directory, not a checkpoint file")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    size = path.stat().st_size
    _check_readable(path)
    return _torch_load(path, path, size, map_location)


def _check_readable(path: Path) -> None:
    """Refuse, naming why, a checkpoint this user may not read (a teammate's under umask 077, root's after
    a sudo run): torch.load's PermissionError was reported as "truncated or corrupt ... delete it"."""
    try:
        with open(path, "rb"):
            pass
    except PermissionError as e:
        st = path.stat()
        raise CheckpointError(f"checkpoint '{path}' cannot be read by this user ({e.strerror}: owner uid "
                              f"{st.st_uid}, mode {stat.filemode(st.st_mode)}); nothing says it is damaged. "
                              f"Give read access (chmod a+r '{path}') or run as its owner") from e


def read_bytes(path, storage=None) -> bytes:
    """The checkpoint's bytes at ``path``, through ``storage`` (see ``storage_for``); a missing one is
    a FileNotFoundError naming it."""
    store = storage_for(path, storage)
    if store is LOCAL:
        local = _local_path(path)
        if local.is_dir():
            raise IsADirectoryError(f"checkpoint '{local}' is a directory, not a checkpoint file")
    if not store.exists(str(path)):
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    return store.read_bytes(str(path))


def from_bytes(data: bytes, path="checkpoint", map_location="cpu") -> dict:
    """A checkpoint from its bytes (as ``read_bytes`` returns them), with ``load``'s checks and errors
    (``path`` names it in them)."""
    return _torch_load(io.BytesIO(data), path, len(data), map_location)


def _torch_load(source, path, size: int, map_location) -> dict:
    if size == 0:
        raise CheckpointError(f"checkpoint '{path}' is empty (0 bytes): it was never written completely; "
                              f"delete it to start afresh")
    _check_crcs(source, path, size)
    try:
        state = torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses anything but tensors and plain types: not a file save() wrote.
        raise CheckpointError(f"checkpoint '{path}' ({size:,} bytes) is not a fastdata checkpoint or is "
                              f"corrupt: it does not load with weights_only=True ({_refusal(e)})") from e
    except Exception as e:
        # torch raises RuntimeError ("failed finding central directory"), EOFError or OSError [Errno 22]
        # for a cut-off zip archive, and a few bytes that are no zip at all reach its legacy unpickler
        # (KeyError: 97 for b"half"): none of them names the file.
        raise CheckpointError(f"checkpoint '{path}' ({size:,} bytes) is truncated or corrupt and cannot "
                              f"be read ({type(e).__name__}: {_first_line(e)}); delete it to start afresh "
                              f"or point to an intact copy") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint '{path}' holds a {type(state).__name__}, not a checkpoint dict")
    return state


def _check_crcs(source, path, size: int) -> None:
    """Refuse a zip bomb (``_oversized``) and a file changed after it was written (torch.load checks no
    CRC-32: a damaged tensor loads as wrong weights). Reads the file once more (a second per GB)."""
    try:
        with zipfile.ZipFile(source) as archive:
            big = _oversized(archive, size)
            bad = archive.testzip() if big is None else None   # testzip would inflate the bomb too
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        big = bad = None
    finally:
        if hasattr(source, "seek"):
            source.seek(0)
    if big is not None:
        raise CheckpointError(f"checkpoint '{path}' ({size:,} bytes) is not a checkpoint torch.save wrote: its "
                              f"{big}, more than the whole file (a zip bomb, or a damaged file). It was not read: "
                              f"delete it, or point to an intact copy")
    if bad is not None:
        raise CheckpointError(f"checkpoint '{path}' ({size:,} bytes) is corrupt: its entry '{bad}' fails its "
                              f"CRC-32 check, so the file changed after it was written (a damaged disk or "
                              f"copy); delete it to start afresh or point to an intact copy")


def _oversized(archive: zipfile.ZipFile, size: int) -> str | None:
    """The entry, else all, stating more bytes than the file (said so): torch.load allocates each entry's
    stated size (a deflated one of zeros states 1000x its own); torch.save stores them: never more."""
    entries = archive.infolist()
    big = next((entry for entry in entries if entry.file_size > size), None)
    if big is not None:
        return f"entry '{big.filename}' says it expands to {big.file_size:,} bytes"
    total = sum(entry.file_size for entry in entries)
    return f"{len(entries):,} entries say they expand to {total:,} bytes together" if total > size else None


#: What torch's weights-only unpickler names when it refuses a pickled callable or class.
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+?)(?: was not an allowed global| whose module (\S+) is blocked)")
#: Modules of code, commands, imports (Python 2's too: protocol 2 names subprocess "commands"). torch blocks os,
#: posix, nt, sys alone: eval was "not an allowed global", and the error advised add_safe_globals([eval]).
_CODE_MODULES = frozenset({"builtins", "__builtin__", "os", "posix", "nt", "sys", "subprocess", "commands", "popen2",
                           "runpy", "importlib", "pkgutil", "code", "codeop", "pdb", "timeit", "pickle", "marshal",
                           "shelve", "types", "ctypes", "pty", "shutil", "socket", "webbrowser", "operator",
                           "functools", "multiprocessing", "asyncio", "platform", "tempfile", "pathlib", "io"})


def _refusal(e: pickle.UnpicklingError) -> str:
    """What ``weights_only`` refused and what it means: torch's text opens with a paragraph on re-running
    with ``weights_only=False`` (never for a file from elsewhere), and that was all the error showed."""
    found = _REFUSED_GLOBAL.search(str(e))
    if found is None:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((line for line in lines if "error" in line.lower() and "Weights only" not in line),
                      lines[-1] if lines else "no message")
        return f"{detail}; the file was not unpickled any further, and no code in it ran"
    name, blocked = found.group(1), found.group(2)
    module = blocked or (name.split(".")[0] if "." in name else "builtins")   # torch drops "builtins."
    if blocked or module in _CODE_MODULES:
        return (f"it calls {name}, from module {module}, which runs code and which no checkpoint of weights "
                f"needs: a file that names it was made to run that code when loaded (or is damaged). It did "
                f"not run: delete the file, and never load it with weights_only=False")
    return (f"it holds a pickled {name}, which loading would call or create with code the file names; it "
            f"did not run. From someone else, such a file can be crafted to run any code: do not load it "
            f"with weights_only=False. Your own checkpoint holding an object of your class loads once that "
            f"class is allowed: torch.serialization.add_safe_globals([{name}])")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


def prepare(path, storage=None):
    """Check, before any training, that ``path`` can take a checkpoint; remove stale temporaries.

    Refuses a path that is a directory, creates the folder when it is missing, and proves the folder is
    writable by creating (and removing) a temporary file there, the way ``save`` will: an unusable path
    is an error now, not after the first epoch's work. A URL or ``storage`` is checked by the storage's
    own ``prepare`` when it has one."""
    store = storage_for(path, storage)
    if store is not LOCAL:
        check = getattr(store, "prepare", None)
        if check is not None:
            check(str(path))
        return path
    path = _local_path(path)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint path '{path}' is a directory; give a file path such as "
                                f"'{path / 'checkpoint.pt'}'")
    path = _followed(path)   # the folder that saves write into
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent is a file, or no permission to create it
        raise type(e)(f"cannot create the folder '{folder}' for checkpoint '{path}': "
                      f"{e.strerror or e}") from e
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=folder)
    except OSError as e:
        raise type(e)(f"cannot write checkpoint '{path}': folder '{folder}' is not writable "
                      f"({e.strerror or e})") from e
    os.close(fd)
    os.unlink(tmp)
    clean_stale(path)
    return path


def check_room(path, nbytes: int, storage=None) -> None:
    """Refuse, before any training, a local checkpoint folder with less free space than ``nbytes`` (what
    a checkpoint of the run holds at least: its weights): the first save would fail on the full disk
    after an epoch of work. A save needs room for the new file beside the old one (it replaces it only
    once written). URLs and storage objects are not checked."""
    if storage_for(path, storage) is not LOCAL:
        return
    folder = _followed(_local_path(path)).parent
    try:
        free = shutil.disk_usage(folder if str(folder) else ".").free
    except OSError:
        return
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"cannot save checkpoint '{path}': its folder has {free / 2**20:,.1f} MiB free "
                                    f"and a checkpoint of this run takes at least {nbytes / 2**20:,.1f} MiB (its "
                                    f"weights; the optimizer's state comes on top). Free space there or give a "
                                    f"checkpoint path on another disk")


def clean_stale(path) -> list[Path]:
    """Remove temporaries that a crashed ``save`` of ``path`` left behind; returns what was removed."""
    path = _followed(_local_path(path))
    folder = path.parent if str(path.parent) else Path(".")
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in folder.glob(path.name + TMP_MARK + "*"):
        try:
            fd = _open_to_lock(p)
        except OSError:   # gone meanwhile, or unreadable: not ours to judge
            continue
        try:
            if try_lock(fd) is False:   # a save in progress (another run of the same path) holds it
                continue
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed


def _open_to_lock(p: Path) -> int:
    """``p`` opened for writing where this user may (else for reading): NFSv4 emulates flock with POSIX
    locks, and an exclusive one on a read-only descriptor fails (EBADF), which read as "no locks here",
    so another run's clean_stale removed a save in progress there after all."""
    try:
        return os.open(p, os.O_RDWR)
    except PermissionError:
        return os.open(p, os.O_RDONLY)


# ------------------------------------------------------------------------------------ one run a path
class CheckpointInUse(CheckpointError):
    """Another live run saves to the same checkpoint path (``claim``)."""


def claim(path, storage=None) -> Claim | None:
    """Hold ``path`` for this run, or refuse when another live run holds it (``CheckpointInUse``, naming
    its process and host). Two runs saving to one file each overwrite the other's saves, and a resume
    continues whichever saved last (another model's is refused, the same model's taken silently). None
    where nothing can be held: a URL or a storage object, a file system without locks, a lock file that
    cannot be created. ``fit`` holds its checkpoint's path from its start to its end (rank 0)."""
    if storage_for(path, storage) is not LOCAL:
        return None
    path = _followed(_local_path(path))   # one lock for a file however it is reached (a link to it)
    lock = path.with_name(path.name + ".lock")
    return hold(lock, lambda holder: CheckpointInUse(
        f"checkpoint '{path}' is in use by another run ({holder}), which saves there: two runs on one "
        f"checkpoint overwrite each other's saves. Give this run its own checkpoint path, or stop the other "
        f"run first (it holds '{lock}')"))


# ----------------------------------------------------------------------------------- the storage hook
class Storage:
    """Where checkpoints are kept: the hook ``save``, ``load`` and ``fit(checkpoint_storage=...)`` go
    through. Any object with these methods works (no need to subclass); paths are passed as strings.

    ``write_bytes`` must be atomic for readers: a reader (or a run restarted after a crash) sees the
    previous checkpoint or the new one, never part of one. ``prepare`` is optional: it checks, before
    training, that ``path`` can take a checkpoint."""

    def exists(self, path: str) -> bool:
        """Whether a checkpoint is stored at ``path``."""
        raise NotImplementedError

    def read_bytes(self, path: str) -> bytes:
        """The bytes stored at ``path``."""
        raise NotImplementedError

    def write_bytes(self, path: str, data: bytes) -> None:
        """Store ``data`` at ``path``, replacing what was there atomically."""
        raise NotImplementedError

    def prepare(self, path: str) -> None:
        """Check that ``path`` can take a checkpoint (default: nothing to check)."""


class LocalStorage(Storage):
    """The local file system, with the atomic save of this module (a temporary in the same folder,
    fsynced, then ``os.replace``). ``save``/``load`` stream through files instead of these methods."""

    def exists(self, path: str) -> bool:
        """Whether ``path`` is a file."""
        return _local_path(path).is_file()

    def read_bytes(self, path: str) -> bytes:
        """The file's bytes."""
        return _local_path(path).read_bytes()

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` atomically (as ``save`` writes a checkpoint)."""
        _atomic_write(_local_path(path), lambda f: f.write(data))

    def prepare(self, path: str) -> None:
        """``prepare``'s checks of a local path."""
        prepare(path)


class FsspecStorage(Storage):
    """A URL read and written through fsspec (``s3://``, ``gs://``, ``memory://``, ...; the file system
    for the scheme may need its own package, e.g. s3fs or gcsfs). A checkpoint is written with one
    ``pipe_file``: an object store makes the object visible only once the whole upload is done.

    Args:
        protocol: the URL scheme (``"s3"``).
        storage_options: passed to ``fsspec.filesystem`` (credentials, endpoint, ...).
    """

    def __init__(self, protocol: str, **storage_options):
        import fsspec

        self.protocol = protocol
        self.fs = fsspec.filesystem(protocol, **storage_options)

    def exists(self, path: str) -> bool:
        """Whether an object (not a folder) is stored at ``path``."""
        return self.fs.isfile(path)

    def read_bytes(self, path: str) -> bytes:
        """The object's bytes."""
        return self.fs.cat_file(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Upload ``data`` to ``path`` in one piece, creating its folder where the file system has them."""
        parent = self.fs._parent(path)
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        self.fs.pipe_file(path, data)

    def prepare(self, path: str) -> None:
        """Refuse a folder at ``path``; create its parent folder where the file system has folders."""
        if self.fs.isdir(path):
            raise IsADirectoryError(f"checkpoint path '{path}' is a directory; give a file path such as "
                                    f"'{path.rstrip('/')}/checkpoint.pt'")
        parent = self.fs._parent(path)
        if parent:
            self.fs.makedirs(parent, exist_ok=True)


LOCAL = LocalStorage()
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


def url_scheme(path) -> str | None:
    """The scheme of a URL (``"s3"`` for ``s3://bucket/run.pt``); None for a plain path (and for a
    Windows drive letter: a scheme has two characters at least)."""
    if isinstance(path, os.PathLike):
        return None
    match = _SCHEME.match(str(path))
    return match.group(1).lower() if match else None


def storage_for(path, storage=None):
    """The hook that reads and writes ``path``: ``storage`` when given; the local file system for a plain
    path and a ``file://`` URL; fsspec for any other URL (an ImportError naming ``pip install fsspec``
    where it is missing)."""
    if storage is not None:
        missing = [m for m in ("exists", "read_bytes", "write_bytes") if not callable(getattr(storage, m, None))]
        if missing:
            raise TypeError(f"checkpoint storage {storage!r} has no {missing} method(s): a storage needs "
                            f"exists(path), read_bytes(path) and write_bytes(path, data) (see "
                            f"fastdata.checkpoint.Storage)")
        return storage
    scheme = url_scheme(path)
    if scheme is None or scheme == "file":
        return LOCAL
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"checkpoint '{path}' is a {scheme}:// URL, which is read and written through "
                          f"fsspec, and fsspec is not installed: pip install fsspec (plus the {scheme} file "
                          f"system's own package, e.g. s3fs for s3://, gcsfs for gs://)") from None
    try:
        return FsspecStorage(scheme)
    except (ImportError, ValueError) as e:   # fsspec knows no such protocol, or its package is missing
        known = ", ".join(sorted(fsspec.available_protocols())[:12])
        raise ImportError(f"checkpoint '{path}': fsspec cannot open {scheme}:// URLs ({_first_line(e)}); "
                          f"install the package that provides it (s3fs for s3://: pip install fastdata[shards]; "
                          f"gcsfs for gs://); fsspec "
                          f"knows {known}, ...") from e


def _local_path(path) -> Path:
    """A plain path, or a ``file://`` URL's path."""
    if url_scheme(path) == "file":
        from urllib.parse import unquote, urlparse

        url = urlparse(str(path))
        if url.netloc not in ("", "localhost"):
            raise ValueError(f"checkpoint '{path}': a file:// URL names a local path (file:///dir/run.pt), "
                             f"not host {url.netloc!r}")
        return Path(unquote(url.path))
    return Path(path)


# ------------------------------------------------------------------------------- one file, every rank
def exists(path, storage=None) -> bool:
    """Whether a checkpoint is stored at ``path`` as this process sees it."""
    return storage_for(path, storage).exists(str(path))


def digest(data: bytes) -> str:
    """A short hash of a checkpoint's bytes: ranks compare it to know they read the same file."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def load_shared(path, map_location="cpu", storage=None) -> dict | None:
    """The checkpoint at ``path`` for every rank of a job, or None on every rank when there is none.

    Rank 0 decides: whether a checkpoint exists, and which bytes it holds (a damaged one fails on every
    rank, naming it). Every other rank reads its own copy when it sees one with the same bytes (a
    shared file system), and gets rank 0's bytes over the process group otherwise: a checkpoint on rank
    0's local disk, or an older one left on another node's disk at the same path, still resumes every
    rank from rank 0's. Collective: every rank calls it. In a single process: ``load`` when it exists.
    """
    from . import distributed as fdist

    if not fdist.is_distributed():
        return load(path, map_location, storage) if exists(path, storage) else None
    mine: dict = {}

    def decide():
        if not exists(path, storage):
            return None
        data = read_bytes(path, storage)
        from_bytes(data, path, map_location)   # a damaged checkpoint fails here, for every rank
        mine["data"] = data
        return digest(data)

    wanted = fdist.decide_on_main(decide, what=f"reading checkpoint '{path}' on rank 0")
    if wanted is None:
        return None
    data = mine.get("data")   # rank 0's, read by decide()
    if not fdist.is_main():
        try:
            data = read_bytes(path, storage) if exists(path, storage) else None
        except OSError:   # unreadable here: rank 0's copy is sent instead
            data = None
        if data is not None and digest(data) != wanted:
            data = None   # another file at the same path (another node's disk): rank 0's decides
    received = fdist.share_from_main(mine.get("data"), need=data is None)
    return from_bytes(data if data is not None else received, path, map_location)


# ------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict:
    """Python, numpy, torch (CPU and every CUDA device) RNG states as tensors and plain types."""
    legacy = np.random.get_state(legacy=True)
    if isinstance(legacy, dict):   # only a RandomState over another bit generator; np.random's is MT19937
        raise RuntimeError(f"numpy's global RNG is not MT19937 ({legacy.get('bit_generator')}): cannot save it")
    kind, keys, pos, has_gauss, cached = legacy
    version, internal, gauss = random.getstate()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the generators ``rng_state`` saved (the CUDA ones that this machine has)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        # A run resumed on fewer GPUs restores the ones it has.
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
