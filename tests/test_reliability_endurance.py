"""Reliability, endurance: epochs with persistent workers leak nothing.

Memory (RSS), open file descriptors, threads and processes of the main process and of the workers this
loader started, read from /proc, must stay flat once warm-up is over (the first epochs pay for worker
start, allocator pools, DALI's pipeline, pages a forked worker copies as it first touches them). A leak
of one batch, one pipe, one thread or one process per epoch shows up here.

Only this loader's processes are counted: a child of pytest that an earlier test started (Inductor's
compile workers, after a ``torch.compile`` test) is in neither the count before nor the count after.

Each measurement runs in a fresh Python process (``measure_isolated``). In the full suite's pytest
process, the heap and the loaders that earlier tests left behind moved RSS by more than a batch over the
measured epochs: the check that a one-batch-per-epoch leak is caught passed alone and failed in CI's full
run. A fresh process holds only this loader, as a user's training script does.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import DEVICES, backend_params, indexed_source
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, make_image_folder
from procs import children, usage

#: Epochs left out as warm-up, then epochs measured: a per-epoch leak adds MEASURED times its size,
#: which the slope below sees against the noise of single readings.
WARMUP, MEASURED = 3, 10


def steady_allocator() -> None:
    """RSS that follows what is alive. glibc raises its mmap threshold the first time a large block is
    freed, and from then on serves batch-sized blocks from its heap, which grows for several epochs before
    it reuses them: about a batch an epoch for the first 5 to 8 epochs, the size of the leak looked for
    here, and longer after other tests left the heap fragmented. A fixed threshold keeps batch-sized blocks
    mapped on their own and unmapped when freed. Set in the measuring process only (workers forked from
    it inherit it). Without glibc's ``mallopt`` nothing is set: the warm-up epochs have to absorb it."""
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    m_mmap_threshold = -3            # malloc.h
    if mallopt is not None:
        mallopt(m_mmap_threshold, 64 * 1024)


TESTS = Path(__file__).resolve().parent


def measure(kind: str, backend: str, device: str, leak: str | None = None, photos: str | None = None) -> dict:
    """Runs in the measuring process: builds the loader (``kind`` "arrays" or "photos"), runs
    WARMUP + MEASURED epochs and returns the readings (``history``) and the largest batch's bytes."""
    steady_allocator()
    epochs = Epochs(children())
    loader = _photo_loader(backend, photos) if kind == "photos" else _array_loader(backend, device)
    if leak is not None:
        loader = _Leaky(loader, leak)
    try:
        history = epochs.run(loader, WARMUP + MEASURED, device)
    finally:
        loader.close()
    return {"history": history, "batch_bytes": epochs.batch_bytes}


def measure_isolated(kind: str, backend: str, device: str = "cpu", leak: str | None = None,
                     photos=None) -> tuple[list[dict], int]:
    """``measure`` in a fresh Python process (see the module's docstring): its readings and batch bytes."""
    args = [kind, backend, device, leak, None if photos is None else str(photos)]
    script = (f"import json, sys; sys.path.insert(0, {str(TESTS)!r}); "
              f"import test_reliability_endurance as t; "
              f"print('RESULT ' + json.dumps(t.measure(*json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True, text=True,
                          timeout=600, cwd=TESTS.parent)
    assert done.returncode == 0, f"the measuring process failed ({done.returncode}):\n{done.stderr[-4000:]}"
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    return result["history"], result["batch_bytes"]


@pytest.fixture(scope="module")
def endurance_photos(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("endure"), classes=2, per_class=24, seed=5,
                             size_range=((90, 120), (70, 100)))


class Epochs:
    """Runs a loader's epochs and reads, after each, what this process and the loader's own processes
    use. ``before``: this process's children before the loader was built (not the loader's)."""

    def __init__(self, before: set[int]):
        self.before = before
        self.batch_bytes = 0

    def run(self, loader, epochs: int, device: str) -> list[dict]:
        out = []
        for _ in range(epochs):
            total, x = 0.0, None
            for x, _ in loader:
                total += float(x[:, :, 0, 0].sum())  # touch the batch like a consumer would
                self.batch_bytes = max(self.batch_bytes, x.element_size() * x.numel())
            del x                                    # the last batch is not held while /proc is read
            gc.collect()
            u = usage([os.getpid(), *sorted(children() - self.before)])
            u["device"] = torch.cuda.memory_allocated(device) if device == "cuda" else 0
            out.append(u)
        return out


def slope(values) -> float:
    """Growth per epoch: the median of the slopes between every two readings (Theil-Sen). A leak adds the
    same each epoch and is its slope; a one-off step (an allocator pool growing once) moves few of the
    pairs and not the median, as a least-squares line would be moved."""
    v = np.asarray(values, dtype=np.float64)
    i, j = np.triu_indices(len(v), k=1)
    return float(np.median((v[j] - v[i]) / (j - i)))


def assert_flat(history, what: str, batch_bytes: int):
    """After WARMUP epochs: processes exactly as many; fds and threads at most one more, the fewest of the
    last three readings against the fewest of the first three (a file a reading thread has open at
    that instant comes and goes: dali's read-ahead of the next epoch made one reading 6 against 4 in a
    fresh-clone CI; a leak of one an epoch grows by seven there); memory growing by less than half a
    batch per epoch (a leak of one batch grows by one)."""
    steady = history[WARMUP:]
    assert len(steady) >= 8 and batch_bytes > 0, (len(steady), batch_bytes)
    first, last = steady[0], steady[-1]
    assert last["procs"] == first["procs"], f"{what}: processes went from {first['procs']} to {last['procs']}"
    for key in ("fds", "threads"):
        early, late = (min(h[key] for h in part) for part in (steady[:3], steady[-3:]))
        assert late <= early + 1, f"{what}: {key} grew from {early} to {late} ({steady})"
    for key in ("rss", "device"):
        growth = slope([h[key] for h in steady])
        assert growth < batch_bytes / 2, (f"{what}: {key} grows by {growth / 2**20:.2f} MiB an epoch, a batch is "
                                          f"{batch_bytes / 2**20:.2f} MiB: {[h[key] for h in steady]}")


def _array_loader(backend, device):
    # Batches of 1.5 MiB: a leak of one an epoch stands well above the noise of single readings.
    src = indexed_source(2000, size=28)
    kw = dict(batch_size=500, device=device, num_workers=2, seed=1)
    if backend in ("torch", "prefetch"):
        kw["persistent_workers"] = True
    return make_loader(src, backend, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", backend_params())
def test_array_epochs_are_flat(backend, device):
    history, batch_bytes = measure_isolated("arrays", backend, device)
    # The measuring process and the loader's workers (persistent: the same two each epoch), nothing else.
    assert history[0]["procs"] == (3 if backend in ("torch", "prefetch") else 1), history[0]
    assert_flat(history, f"{backend} arrays", batch_bytes)


@pytest.mark.parametrize("backend", backend_params())
def test_photo_epochs_are_flat(backend, endurance_photos):
    history, batch_bytes = measure_isolated("photos", backend, photos=endurance_photos)
    assert_flat(history, f"{backend} photos", batch_bytes)


def _photo_loader(backend, photos):
    src = ImageFolder(photos)
    # Batches of 1.2 MiB (16 x 3 x 80 x 80 float32): a leak of one an epoch stands above the noise.
    kw = dict(batch_size=16, device="cpu", num_workers=2, seed=1, augment=Augmentation.imagenet_train(size=80))
    if backend == "memory":
        kw["cache_size"] = 96   # a memory option
    if backend in ("torch", "prefetch"):
        kw["persistent_workers"] = True
    return make_loader(src, backend, **kw)


# ------------------------------------------------------------------- the check catches what it claims
class _Leaky:
    """A loader wrapper that leaks what the tests above must catch: per epoch, one batch kept, or one
    process left running (a worker nobody joins)."""

    def __init__(self, loader, what: str):
        self.loader, self.what, self.kept, self.procs = loader, what, [], []

    def __iter__(self):
        import multiprocessing as mp

        for i, (x, y) in enumerate(self.loader):
            if i == 0 and self.what == "batch":
                self.kept.append(x.clone())
            yield x, y
        if self.what == "process":
            p = mp.get_context("fork").Process(target=_sleep_forever, daemon=True)
            p.start()
            self.procs.append(p)

    def close(self):
        for p in self.procs:
            p.kill()
            p.join()
        self.loader.close()


def _sleep_forever():
    import time

    time.sleep(600)


@pytest.mark.parametrize("leak", ["batch", "process"])
def test_a_loader_that_leaks_a_batch_or_a_process_per_epoch_fails_the_check(leak):
    history, batch_bytes = measure_isolated("arrays", "memory", leak=leak)
    with pytest.raises(AssertionError, match="rss grows|processes went"):
        assert_flat(history, f"leaking a {leak}", batch_bytes)


def test_a_process_started_before_the_loader_is_not_the_loaders(tmp_path):
    """issue 29: Inductor's compile worker, started by an earlier test, counted as one of this loader's."""
    import subprocess
    import sys

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        epochs = Epochs(children())
        loader = _array_loader("memory", "cpu")
        history = epochs.run(loader, 1, "cpu")
        assert history[0]["procs"] == 1, history
    finally:
        other.kill()
        other.wait()
