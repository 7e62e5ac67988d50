"""QA of interactive use (a Jupyter notebook, an IPython session): one Python process kept for hours, cells
run again, interrupted (Jupyter's "interrupt kernel") and run again, loaders dropped and rebuilt.

Each test runs its scenario in a fresh Python process (``run_script``): signals, threads, child processes
and the module-level state they touch are process-wide, and pytest's own process carries other tests'
leftovers. Jupyter interrupts a kernel by sending SIGINT to its whole process group (jupyter_client's
local provisioner, ``os.killpg``): the scenarios that need that run in a session of their own, so the
signal reaches the script and its loader's workers and nothing else.
"""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import backend_params
from engine_helpers import Wrapper

TESTS = Path(__file__).resolve().parent

#: Put at the top of every script: this folder on sys.path (conftest's data, procs), a loader's epoch
#: read whole with the ids each batch holds checked against its pixels and labels.
_PRELUDE = f"""
import os, signal, sys, threading, time, gc
# Ctrl-C raises KeyboardInterrupt, as in a Jupyter kernel, however pytest was started: a shell's
# background job starts with SIGINT ignored, and Python keeps an ignored SIGINT ignored (a CI run
# from nohup ... & failed every interrupt test with "no KeyboardInterrupt").
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {str(TESTS)!r})
import numpy as np
from conftest import indexed_source, decode_ids, label_of
from procs import children, wait_until
from fastdata import make_loader

def epoch_ids(loader):
    got = []
    for x, y in loader:
        ids = decode_ids(x)
        assert (label_of(ids) == y.numpy()).all(), "labels out of step with their images"
        assert (ids == loader.batch_ids).all(), (ids[:4], loader.batch_ids[:4])
        got.append(ids)
    return np.concatenate(got)

def planned(loader, epoch):
    return np.concatenate([loader.source_ids(b) for b in loader.plan.batches_from(epoch, 0)])
"""


def run_script(body: str, *, timeout: float = 120, session: bool = False) -> str:
    """``body`` (after ``_PRELUDE``) in a fresh Python process; its stdout. ``session``: in a process
    group of its own (a killpg there reaches the script and its children only). A failure shows stderr."""
    code = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=TESTS.parent, start_new_session=session)
    assert done.returncode == 0, f"the script failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


# ------------------------------------------------------------------ a cell run again and again
_RERUN = """
import test_reliability_endurance as endurance
from procs import usage
endurance.steady_allocator()        # RSS that follows what is alive (see there)
backend = {backend!r}
src = indexed_source(2000, size=28)

def reading():
    gc.collect()
    u = usage([os.getpid()])
    return dict(u, shm=len(os.listdir("/dev/shm")), workers=len(children()))

readings = []
for run in range(RUNS):
    # The cell: a loader built, a few batches looked at, a break; the name rebound next run.
    loader = make_loader(src, backend, batch_size=500, device="cpu", num_workers=2, seed=1, quiet=True,
                         **({{"persistent_workers": True}} if backend in ("torch", "prefetch") else {{}}))
    for i, (x, y) in enumerate(loader):
        if i == 1:
            break
    del x, y
    if WARMUP - 3 <= run < WARMUP or run >= RUNS - 3:
        readings.append(reading())
print("READINGS", readings)
# The fewest of three readings after the warm-up against the fewest of the last three: a pipe or thread of
# the previous run's loader still closing comes and goes (single readings differed by 2 descriptors).
first, last = ({{key: min(r[key] for r in part) for key in part[0]}} for part in (readings[:3], readings[-3:]))
assert last["workers"] == first["workers"] <= 2, readings     # the current loader's own, no more
# A leak of one a run adds RUNS - WARMUP (15) by the end; the slack is for what comes and goes: the
# descriptors read 14 or 16 in turn on a loaded CI machine, all three last readings on 16 once.
for key, slack in (("threads", 1), ("fds", 4), ("shm", 1)):
    assert last[key] <= first[key] + slack, (key, readings)
batch = 500 * 28 * 28 * 4
assert last["rss"] - first["rss"] < (RUNS - WARMUP) * batch / 2, ("rss", readings)
print("OK")
"""


@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_a_cell_run_again_and_again_leaks_nothing(backend):
    """A notebook cell that builds a loader, looks at a few batches and breaks, run again and again in
    one process: after the first runs, no worker process, thread, descriptor or /dev/shm segment more per
    run, and less than half a batch of memory a run (a batch kept per run grows by one)."""
    script = "RUNS, WARMUP = 20, 5\n" + _RERUN.format(backend=backend)
    assert "OK" in run_script(script, timeout=300)


# ------------------------------------------------------------------ Ctrl-C in a notebook
_GROUP_INTERRUPT = """
backend = {backend!r}
loader = make_loader(indexed_source(600, size=8), backend, batch_size=50, device="cpu", num_workers=2,
                     seed=1, persistent_workers=True)
epoch_ids(loader)                                  # a first epoch: the persistent workers are up
workers = children()
assert len(workers) == 2, workers
try:
    for i, _ in enumerate(loader):
        if i == 2:
            os.killpg(os.getpgid(0), signal.SIGINT)   # Jupyter's "interrupt kernel"
            time.sleep(5)                               # the KeyboardInterrupt lands here
    raise AssertionError("no KeyboardInterrupt")
except KeyboardInterrupt:
    pass
# The cell run again: the same loader, the next full epoch, every sample once, in the plan's order.
epoch = loader.epoch
assert np.array_equal(epoch_ids(loader), planned(loader, epoch)), "the epoch after Ctrl-C read other samples"
assert children() == workers, ("the workers were replaced", workers, children())
loader.close()
assert wait_until(lambda: not children(), 10), children()
print("OK")
"""


@pytest.mark.parametrize("backend", ["torch", "prefetch"])
def test_a_notebook_interrupt_leaves_the_persistent_workers_running(backend):
    """Jupyter's interrupt is a SIGINT to the kernel's process group, workers included: they left their
    loop on it (torch's worker loop ends on KeyboardInterrupt) and exited, and the same loader's next pass
    failed with "DataLoader worker (pid(s) ...) exited unexpectedly" (or a FileNotFoundError from a
    batch's shared memory). Workers ignore SIGINT now; the main process alone handles Ctrl-C."""
    assert "OK" in run_script(_GROUP_INTERRUPT.format(backend=backend), session=True)


_INTERRUPTS = """
import random
from fastdata import Augmentation
from fastdata.datasets import ImageFolder, make_image_folder

backend = {backend!r}
photos = make_image_folder({folder!r}, classes=2, per_class=24, seed=5, size_range=((160, 240), (120, 200)))
options = dict(persistent_workers=True) if backend in ("torch", "prefetch") else {{}}
loader = make_loader(ImageFolder(photos), backend, batch_size=8, device="cpu", num_workers=2, seed=1,
                     augment=Augmentation.imagenet_train(size=48), quiet=True, **options)

def ids_of_epoch():
    return np.concatenate([loader.batch_ids.copy() for _ in loader])

start = time.monotonic()
ids_of_epoch()
took = time.monotonic() - start
workers = children()
rng = random.Random(0)
for trial in range(TRIALS):
    delay = rng.uniform(0, took)

    def interrupt():
        time.sleep(delay)
        os.killpg(os.getpgid(0), signal.SIGINT)    # Jupyter's "interrupt kernel"

    try:
        threading.Thread(target=interrupt, daemon=True).start()   # (daemon: no join at exit)
        for _ in loader:
            pass
        time.sleep(took + 5)                        # an interrupt after the pass lands here
        raise AssertionError("no KeyboardInterrupt")
    except KeyboardInterrupt:
        pass
    epoch = loader.epoch
    got = ids_of_epoch()                            # the cell run again
    assert np.array_equal(got, planned(loader, epoch)), (trial, delay, "the epoch after Ctrl-C read other samples")
    assert children() == workers, (trial, delay, workers, children())
loader.close()
assert wait_until(lambda: not children(), 10), children()
print("OK")
"""


@pytest.mark.parametrize("backend", backend_params())
def test_ctrl_c_anywhere_in_a_pass_then_the_same_loader_reads_the_next_epoch_whole(backend, tmp_path):
    """Jupyter's interrupt (SIGINT to the kernel's process group) at seeded random points of a pass over
    photos: inside next(), a worker-queue get, DALI's outputs wait, the prefetch hand-over, or between
    batches. Each time the same loader's next pass reads its epoch whole, in the plan's order (ids
    checked against ``loader.batch_ids``), with the same workers: no hang, no sample lost or doubled."""
    script = "TRIALS = 6\n" + _INTERRUPTS.format(backend=backend, folder=str(tmp_path / "photos"))
    assert "OK" in run_script(script, timeout=300, session=True)


_PREFETCH_INTERRUPTED_WAIT = """
import _thread
import torch
from fastdata.prefetch import PrefetchStage

inside, overlaps = [0], []

def host(slow_at=None):
    # One source for every pass, as the DataLoader iterator of persistent workers is: a pass's producer
    # must be out of it before the next pass's producer comes in.
    inside[0] += 1
    if inside[0] > 1:
        overlaps.append("a producer entered the source while an earlier one was still in it")
    try:
        for i in range(4):
            if i == slow_at:
                time.sleep(2.0)                      # a slow batch (a hung read, a huge photo)
            yield torch.full((1, 2, 2, 1), i, dtype=torch.uint8), torch.tensor([i])
    finally:
        inside[0] -= 1

stage = PrefetchStage("cpu", depth=1)
norm = lambda x: x.float()
first = stage(host(slow_at=1), norm)
next(first)
first.close()                         # a break: the producer is still inside the slow batch
threading.Timer(0.3, _thread.interrupt_main).start()
try:
    next(stage(host(), norm))         # the next cell waits for that producer ... and is interrupted
    raise AssertionError("no KeyboardInterrupt")
except KeyboardInterrupt:
    pass
got = [int(y) for _, y in stage(host(), norm)]   # the cell run again
assert got == [0, 1, 2, 3], got
assert not overlaps, overlaps
stage.close()
print("OK")
"""


def test_ctrl_c_while_a_prefetch_pass_waits_for_the_last_producer_keeps_waiting_next_time():
    """A new prefetch pass waits for the previous pass's producer to leave the shared source (a break
    leaves it inside a slow batch). Ctrl-C during that wait, the natural reaction to a cell that hangs,
    made the stage forget the producer, and the pass started next ran beside it in the same source: the
    race the wait exists to prevent (lost batches, shared memory torn down under a read)."""
    assert "OK" in run_script(_PREFETCH_INTERRUPTED_WAIT)


_PASS_WORKERS = """
import torch

class Digits(torch.utils.data.Dataset):   # a torch Dataset: its workers are forked per pass
    def __len__(self):
        return 400

    def __getitem__(self, i):
        return torch.full((1, 8, 8), i % 256, dtype=torch.uint8), i % 10

loader = make_loader(Digits(), {backend!r}, batch_size=20, device="cpu", num_workers=2, seed=1, quiet=True)
assert loader.opts["persistent_workers"] is False
for i, _ in enumerate(loader):            # a cell that looks at a few batches
    if i == 2:
        break
assert wait_until(lambda: not children(), 10), ("after a break", children())

def interrupt():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt, daemon=True).start()
try:
    for _ in loader:
        time.sleep(0.05)
    raise AssertionError("no KeyboardInterrupt")
except KeyboardInterrupt as e:
    sys.last_traceback = e.__traceback__  # kept, as IPython keeps it, with the pass's frames
assert wait_until(lambda: not children(), 10), ("after Ctrl-C", children())
assert sum(len(y) for _, y in loader) == 400   # the next pass forks its own
assert wait_until(lambda: not children(), 10), ("after a full pass", children())
print("OK")
"""


@pytest.mark.parametrize("backend", ["torch", "prefetch"])
def test_a_pass_that_owns_its_workers_ends_them_on_a_break_or_ctrl_c(backend):
    """Workers that are not persistent (a torch Dataset's, by default) belong to one pass. A pass left
    early (a break, Ctrl-C) kept them in the loader until its next pass or close(): two idle processes,
    each with its copy of the dataset, for as long as the notebook lived."""
    assert "OK" in run_script(_PASS_WORKERS.format(backend=backend))


class _CtrlC(Wrapper):
    """A loader's contract passed through, with Jupyter's Ctrl-C raised inside ``next()`` when batch
    number ``at`` (counted over the run) is asked for; ``at=None``: never."""

    def __init__(self, loader, at=None):
        self.loader, self.device, self.at, self.asked = loader, loader.device, at, 0

    def __iter__(self):
        for batch in self.loader:
            self.asked += 1
            if self.asked == self.at:
                raise KeyboardInterrupt
            yield batch


def test_fit_interrupted_then_run_again_in_the_same_process(tmp_path, capsys):
    """Ctrl-C inside fit (in the loader's next(), with workers running and a checkpoint and a run log
    held), then the cell run again in the same process: the checkpoint path and the log folder are not
    refused as held by another run, ``resume=True`` ends with exactly the uninterrupted run's weights
    (the batches after the last save read again, none lost or repeated), and a fresh run may start over
    the same paths."""
    import torch
    from torch import nn

    from conftest import indexed_source
    from fastdata import fit, make_loader

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    loader = make_loader(indexed_source(240, size=8), "torch", batch_size=20, device="cpu", num_workers=2,
                         seed=3, persistent_workers=True)
    reference = model()
    fit(reference, loader, epochs=2, progress=False)
    ck, logs = tmp_path / "run.pt", tmp_path / "logs"
    trained = model()
    wrapped = _CtrlC(loader, at=17)     # the 5th batch of epoch 2: its last save was after batch 4
    with pytest.raises(KeyboardInterrupt) as interrupted:
        fit(trained, wrapped, epochs=2, checkpoint=ck, checkpoint_every=4, log_dir=logs, progress=False)
    # Kept, as IPython keeps sys.last_traceback: the interrupted run's frames (its state, its run log)
    # stay alive, so what they held must have been given up by fit itself, not by the garbage collector.
    sys.last_traceback = interrupted.value.__traceback__
    wrapped.at = None
    history = fit(trained, wrapped, epochs=2, checkpoint=ck, resume=True, log_dir=logs, progress=False)
    assert "resumed from" in capsys.readouterr().out
    assert len(history) == 2
    for name, value in reference.state_dict().items():
        assert torch.equal(value, trained.state_dict()[name]), name
    with pytest.warns(RuntimeWarning, match="holds a checkpoint and resume=False"):
        fit(model(), wrapped, epochs=1, checkpoint=ck, log_dir=logs, progress=False)
    del sys.last_traceback
    loader.close()


# ------------------------------------------------------------------ closed, dropped, iterated twice
@pytest.mark.parametrize("backend", backend_params())
def test_a_closed_loader_iterated_again_says_so_or_reads_whole(backend):
    """A loader closed in one cell and iterated in a later one. dali rebuilt its pipeline for arrays
    (photos met its stopped threads) outside the set of loaders closed before the interpreter exits; it
    now says it was closed, as memory does. torch and prefetch start fresh workers (their own error paths
    close() and go on) and read the epoch whole."""
    from conftest import indexed_source
    from fastdata import make_loader

    loader = make_loader(indexed_source(120, size=8), backend, batch_size=20, device="cpu", num_workers=2,
                         seed=1, quiet=True)
    next(iter(loader))
    loader.close()
    if backend in ("dali", "memory"):
        with pytest.raises(RuntimeError, match=rf"this {backend} loader was closed.*make a new loader"):
            next(iter(loader))
    else:
        assert sum(len(y) for _, y in loader) == 120
        loader.close()


@pytest.mark.parametrize("backend", backend_params())
def test_two_loops_over_one_loader_and_a_dropped_loader(backend):
    """A nested loop over the same loader by mistake, and a generator left suspended in a variable while
    a new loop runs: the older pass raises a RuntimeError that says why, never a batch of the newer pass.
    The loader dropped (``del``) while an iterator is suspended: the iterator reads its pass to the end."""
    import gc

    import numpy as np

    from conftest import decode_ids, indexed_source
    from fastdata import make_loader

    def loader():
        return make_loader(indexed_source(120, size=8), backend, batch_size=20, device="cpu", num_workers=2,
                           seed=1, quiet=True)

    a = loader()
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        for _ in a:
            for _ in a:
                pass
    kept = (ids for ids in (decode_ids(x) for x, _ in a))
    next(kept)
    assert np.array_equal(np.sort(np.concatenate([decode_ids(x) for x, _ in a])), np.arange(120))
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        next(kept)
    a.close()
    b = loader()
    it = iter(b)
    first = decode_ids(next(it)[0])
    del b
    gc.collect()
    rest = [decode_ids(x) for x, _ in it]
    assert np.array_equal(np.sort(np.concatenate([first, *rest])), np.arange(120))


# ------------------------------------------------------------------ fit's progress bar
class _KernelStream(io.StringIO):
    """What a Jupyter kernel makes ``sys.stderr``: ipykernel's OutStream, which is no terminal."""

    def isatty(self):
        return False


_KernelStream.__module__ = "ipykernel.iostream"


@pytest.mark.parametrize("stream", ["notebook", "pipe"])
def test_fits_progress_bar_shows_in_a_notebook_and_not_in_a_pipe(stream, monkeypatch, capsys):
    """``progress=True`` (fit's default) showed its bar on a terminal only, and a notebook's stderr is
    no terminal (ipykernel's OutStream says isatty() False): nothing showed there, without a word. A
    notebook renders the text bar's carriage returns as a terminal does; a pipe or a log file still gets
    no bar (no stray output), only the epoch's line on stdout."""
    from torch import nn

    from engine_helpers import ListLoader, _batches
    from fastdata import fit

    err = _KernelStream() if stream == "notebook" else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    fit(nn.Sequential(nn.Flatten(), nn.Linear(256, 10)), ListLoader(_batches(3)), epochs=1, progress=True)
    shown = err.getvalue()
    if stream == "notebook":
        assert "epoch 1/1" in shown and "/3 [" in shown, shown
    else:
        assert shown == "", shown
    assert "epoch 1/1" in capsys.readouterr().out
