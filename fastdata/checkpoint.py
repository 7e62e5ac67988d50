"""Atomic checkpoints that load with ``torch.load(weights_only=True)``.

A checkpoint is written to a temporary file in the destination's folder, flushed and fsynced, then
moved over the destination with ``os.replace``: a reader (or a run restarted after a crash) sees the
old checkpoint or the new one, never half of one. The temporary lives in the same folder because
``os.replace`` is atomic only within one file system. A crash between the write and the replace
leaves a ``<name>.tmp.*`` file behind; ``clean_stale`` removes those on the next start.

Everything saved is tensors and plain Python types (RNG states included), so loading never needs to
unpickle arbitrary objects.
"""
from __future__ import annotations

import os
import pickle
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

TMP_MARK = ".tmp."


def save(obj: dict, path) -> Path:
    """Write ``obj`` to ``path`` atomically. On any error the previous file at ``path`` is untouched,
    the temporary is removed and the error propagates."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot save checkpoint '{path}': folder '{folder}' does not exist")
    fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=folder)  # raises if not writable
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)  # makes the rename itself durable
    return path


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


def load(path, map_location="cpu") -> dict:
    """Load a checkpoint written by ``save`` (``weights_only=True``: no arbitrary code runs).

    Every failure names the path and says what is wrong with it: missing, a folder, empty, truncated
    or corrupt, or a file that is not a checkpoint (``CheckpointError``, a ``ValueError``)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint '{path}' is a directory, not a checkpoint file")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint '{path}' is empty (0 bytes): it was never written completely; "
                              f"delete it to start afresh")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses anything but tensors and plain types: not a file save() wrote.
        raise CheckpointError(f"checkpoint '{path}' ({size:,} bytes) is not a fastdata checkpoint or is "
                              f"corrupt: it does not load with weights_only=True ({_first_line(e)})") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        # torch raises RuntimeError ("failed finding central directory"), EOFError or OSError [Errno 22]
        # for a cut-off zip archive, none of them naming the file.
        raise CheckpointError(f"checkpoint '{path}' ({size:,} bytes) is truncated or corrupt and cannot "
                              f"be read ({type(e).__name__}: {_first_line(e)}); delete it to start afresh "
                              f"or point to an intact copy") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint '{path}' holds a {type(state).__name__}, not a checkpoint dict")
    return state


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


def prepare(path) -> Path:
    """Check, before any training, that ``path`` can take a checkpoint; remove stale temporaries.

    Refuses a path that is a directory, creates the folder when it is missing, and proves the folder is
    writable by creating (and removing) a temporary file there, the way ``save`` will: an unusable path
    is an error now, not after the first epoch's work."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"checkpoint path '{path}' is a directory; give a file path such as "
                                f"'{path / 'checkpoint.pt'}'")
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


def clean_stale(path) -> list[Path]:
    """Remove temporaries that a crashed ``save`` of ``path`` left behind; returns what was removed."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.glob(path.name + TMP_MARK + "*"):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


# ------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict:
    """Python, numpy, torch (CPU and every CUDA device) RNG states as tensors and plain types."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
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
