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


def load(path, map_location="cpu") -> dict:
    """Load a checkpoint written by ``save`` (``weights_only=True``: no arbitrary code runs)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    return torch.load(path, map_location=map_location, weights_only=True)


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
