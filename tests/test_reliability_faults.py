"""Reliability, faults: errors in workers and in the prefetch thread, a killed
worker, leaving an epoch early, and buffers reused under the consumer. Each must end in an error that
reaches the caller or a clean exit — never a hang or an orphan process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import BACKENDS, backend_params, decode_ids, indexed_source, skip_missing
from fastdata import Augmentation, make_loader
from fastdata.datasets import DatasetSource
from procs import children, wait_until

NONE = Augmentation.none()
WORKER_BACKENDS = ["torch", "prefetch"]
ROOT = Path(__file__).resolve().parents[1]


class Boom(Exception):
    """A user's own exception type (one-argument constructor, like most)."""


class Flaky(torch.utils.data.Dataset):
    """Returns small uint8 tensors; sample ``bad`` raises ``exc`` from inside its transform."""

    def __init__(self, n=64, bad=37, exc=ValueError, delay=0.0):
        self.n, self.bad, self.exc, self.delay = n, bad, exc, delay

    def __len__(self):
        return self.n

    def transform(self, i):
        if i == self.bad:
            raise self.exc(f"sample {i} is cursed")
        return torch.full((3, 6, 6), i % 256, dtype=torch.uint8)

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return self.transform(i), i % 5


# --------------------------------------------------------------------------- exceptions in workers
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("exc", [KeyError, ValueError, Boom])
@pytest.mark.parametrize("backend", WORKER_BACKENDS)
def test_an_exception_in_a_worker_reaches_the_caller_with_its_type_and_traceback(backend, exc, workers):
    src = DatasetSource(Flaky(exc=exc), channels=3, num_classes=5)
    loader = make_loader(src, backend, batch_size=8, train=False, device="cpu", num_workers=workers)
    got = 0
    t0 = time.monotonic()
    with pytest.raises(exc) as info:
        for _, y in loader:
            got += len(y)
    assert time.monotonic() - t0 < 30, "a hang, not an error"  # generous: the suite may run on busy cores
    assert got <= 32, "sample 37 is in the 5th batch: at most the first 4 batches come out"
    msg = str(info.value)
    assert "sample 37 is cursed" in msg
    if workers:
        # the worker's traceback, down to the line that raised, travels in the message
        assert "Original Traceback" in msg and "in transform" in msg, msg
    else:
        assert any(f.name == "transform" for f in info.traceback)
    # the loader is usable again: the next epoch fails the same way, it does not hang
    with pytest.raises(exc):
        list(loader)
    loader.close()


# --------------------------------------------------------------------------------- a killed worker
@pytest.mark.parametrize("backend", WORKER_BACKENDS)
def test_a_worker_killed_mid_epoch_is_a_runtime_error_and_leaves_no_orphans(backend):
    before = children()
    src = DatasetSource(Flaky(n=400, bad=-1, delay=0.01), channels=3, num_classes=5)
    loader = make_loader(src, backend, batch_size=8, train=False, device="cpu", num_workers=2)
    it = iter(loader)
    next(it)
    workers = children() - before
    assert len(workers) == 2, workers
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"(?i)worker.*{victim}|{victim}.*killed") as info:
        for _ in it:
            pass
    assert time.monotonic() - t0 < 10, "a dead worker must be noticed within seconds"
    assert "Killed" in str(info.value) or "SIGKILL" in str(info.value) or "exited unexpectedly" in str(info.value)
    del it, info
    loader.close()
    assert wait_until(lambda: not (children() & workers), 10), f"orphans: {children() & workers}"


# -------------------------------------------------------------------------- leaving an epoch early
EXIT_SCRIPT = textwrap.dedent("""
    import os, sys, threading, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from conftest import indexed_source
    from procs import children as kids, wait_until
    from fastdata import make_loader, Augmentation


    backend, how = sys.argv[1], sys.argv[2]
    loader = make_loader(indexed_source(4000, size=16), backend, batch_size=32, device="cpu",
                         num_workers=2, persistent_workers=True, augment=Augmentation.none(), prefetch_factor=4,
                         **({{"depth": 4}} if backend == "prefetch" else {{}}))
    for k, (x, y) in enumerate(loader):
        if k == 3:
            break   # the DataLoader and the prefetch thread are busy filling their queues
    threads = [t.name for t in threading.enumerate() if t.name.startswith("fastdata")]
    print("THREADS_AFTER_BREAK", threads, flush=True)
    had = kids()
    print("WORKERS", len(had), flush=True)
    if how == "del":
        del loader, x, y
        wait_until(lambda: not (kids() & had), 15)
        print("WORKERS_AFTER_DEL", len(kids() & had), flush=True)
    print("EXITING", flush=True)
    # how == "exit": leave with the loader alive; the interpreter must still exit promptly
""")


@pytest.mark.parametrize("how", ["del", "exit"])
@pytest.mark.parametrize("backend", WORKER_BACKENDS)
def test_leaving_an_epoch_early_ends_threads_and_workers_and_the_interpreter_exits(backend, how, tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(EXIT_SCRIPT.format(tests=str(ROOT / "tests")))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), backend, how], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own process group: the script and its workers
        out, _ = proc.communicate()
        pytest.fail(f"the interpreter did not exit:\n{out[-3000:]}")
    took = time.monotonic() - t0
    assert proc.returncode == 0, out[-3000:]
    assert "THREADS_AFTER_BREAK []" in out, out   # the prefetch thread ended with the epoch
    assert "WORKERS 2" in out, out
    if how == "del":
        assert "WORKERS_AFTER_DEL 0" in out, out
    assert "EXITING" in out
    assert "Traceback" not in out and "Exception ignored" not in out, out
    # start-up (torch import) is most of it, and seconds longer on busy cores; a hang on exit would be
    # 5 s per worker joined in turn, or forever
    assert took < 60, f"took {took:.1f} s"


# ------------------------------------------------------------------- errors in the prefetch thread
def test_an_error_in_the_prefetch_thread_reaches_the_caller():
    loader = make_loader(indexed_source(640), "prefetch", batch_size=64, device="cpu", num_workers=0,
                         augment=NONE, train=False, depth=2)
    real = loader.normalize
    calls = []

    def failing(images):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise RuntimeError("normalization exploded")
        return real(images)

    loader.normalize = failing
    got = []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="normalization exploded"):
        for x, _ in loader:
            got.append(decode_ids(x))
    assert time.monotonic() - t0 < 30, "a hang, not an error"
    assert calls and all(name == "fastdata-prefetch" for name in calls), calls  # it was the thread
    assert len(got) == 2  # the two good batches first, in order
    np.testing.assert_array_equal(np.concatenate(got), np.arange(128))
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == "fastdata-prefetch"], 5)
    # the next epoch works again
    loader.normalize = real
    assert sum(len(y) for _, y in loader) == 640


def test_a_decode_error_from_the_prefetch_threads_source_is_not_a_deadlock():
    """The prefetch thread pulls from the DataLoader; a worker error must surface, not block it."""
    src = DatasetSource(Flaky(n=256, bad=100), channels=3, num_classes=5)
    loader = make_loader(src, "prefetch", batch_size=8, train=False, device="cpu", num_workers=2, depth=1)
    done = []

    def consume():
        try:
            for _ in loader:
                pass
        except ValueError as e:
            done.append(e)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the consumer is stuck"
    assert done and "sample 100 is cursed" in str(done[0])


# ------------------------------------------------------------- no buffer reused under the consumer
@pytest.mark.parametrize("backend", backend_params())
def test_batches_handed_out_are_never_overwritten_later(backend):
    """Keep every batch of two epochs and check that none changes after it was handed out: a backend
    that reuses an output buffer (a ring of pinned/pipeline buffers) would overwrite old batches."""
    src = indexed_source(960, size=8, channels=3)
    loader = make_loader(src, backend, batch_size=32, device="cpu", num_workers=2, shuffle=True,
                         drop_last=False, augment=NONE, **({"depth": 3} if backend == "prefetch" else {}))
    kept = []
    for _ in range(2):
        for x, y in loader:
            kept.append((x, y, x.double().sum().item(), y.sum().item(), decode_ids(x)))
            # checks while the backend keeps producing: the last few batches are intact right now
            for xo, yo, sx, sy, ids in kept[-6:]:
                assert xo.double().sum().item() == sx and yo.sum().item() == sy, backend
    for xo, yo, sx, sy, ids in kept:
        assert xo.double().sum().item() == sx and yo.sum().item() == sy, "a batch changed after hand-out"
        np.testing.assert_array_equal(decode_ids(xo), ids)
    ids0 = np.concatenate([k[4] for k in kept[:30]])
    np.testing.assert_array_equal(np.sort(ids0), np.arange(960))  # and they were real, distinct batches


# ------------------------------------------------------------------------- DALI garbage and forking
FORK_AFTER_DALI = textwrap.dedent("""
    import gc, os, sys
    from pathlib import Path
    from PIL import Image
    import numpy as np
    from fastdata import make_loader, Augmentation
    from fastdata.datasets import ImageFolder
    root = Path({root!r})
    for c in range(2):
        (root / f"c{{c}}").mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((40, 50, 3), 60 * i, np.uint8)).save(root / f"c{{c}}" / f"{{i}}.jpg")
    aug = Augmentation(crop="center", size=32, resize=32)
    gc.disable()   # nothing is collected in this process unless fastdata asks for it

    def finished_dali_loader():
        loader = make_loader(ImageFolder(root), "dali", batch_size=4, device="cpu", num_workers=2,
                             augment=aug, train=False)
        for _ in range(2):
            list(loader)
    finished_dali_loader()   # the DaliLoader <-> feeder cycle: garbage only the cyclic GC frees
    # A forked worker's garbage collector runs sooner or later; here at once, to be deterministic.
    os.register_at_fork(after_in_child=gc.collect)
    t = make_loader(ImageFolder(root), "torch", batch_size=4, device="cpu", num_workers=2, augment=aug,
                    train=False)
    print("READ", sum(len(y) for _, y in t), flush=True)
""")


def test_workers_forked_while_a_dead_dali_pipeline_awaits_collection_do_not_hang(tmp_path):
    """Found here: a dead DALI pipeline collected inside a forked DataLoader worker deadlocks that worker
    in the pipeline's destructor (pthread_cond_destroy) and the main process waits for its batch forever;
    the decode layer now collects such garbage in the parent before it forks
    (fastdata.decode.collect_before_fork)."""
    if "dali" not in BACKENDS:
        skip_missing("needs nvidia-dali")
    script = tmp_path / "fork_after_dali.py"
    script.write_text(FORK_AFTER_DALI.format(tests=str(ROOT / "tests"), root=str(tmp_path / "photos")))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"hung:\n{out[-3000:]}")
    assert proc.returncode == 0 and "READ 8" in out, out[-3000:]
