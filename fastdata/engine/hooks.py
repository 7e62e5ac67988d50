"""What ``fit`` records besides its epoch records, both optional: a profiler trace of a few steps
(``fit(profile=DIR)``, ``fastdata.profiling.StepProfiler``) and a run log of the epochs and every N-th step
(``fit(log_dir=DIR)``, ``fastdata.runlog.RunLog``). ``RunHooks`` holds the two, so the loop calls one object
whether either is on or not: ``region`` labels a part of the step, ``batch_done`` ends a batch, ``epoch``
logs a record, and leaving the ``with`` block stops the profiler and closes the log."""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

from .. import distributed as fdist
from ..profiling import StepProfiler
from ..runlog import RunLog


def check_output_dir(name: str, value) -> None:
    """Refuse, before anything trains, a folder ``fit`` cannot write to: ``name`` is the argument
    (``profile``, ``log_dir``); None is fine (off). A missing folder is fine when the nearest existing
    folder above it is writable (it is created when the run starts)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a folder path (str or os.PathLike) or None, got {value!r} "
                        f"({type(value).__name__})")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}={str(path)!r} is a file; give a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={str(path)!r} cannot be written: {str(existing)!r} is not a writable folder")


def no_region(name: str):
    """A part of the step that nobody times: a no-op context (``TrainStep.region`` without a profiler)."""
    return contextlib.nullcontext()


class RunHooks:
    """``fit``'s profiler and run log (either may be off). Use as a context manager around the epochs.

    Args:
        device: the training device (the profiler times CUDA streams on it).
        profile: folder for the profiler's trace, or None (no profiler). The per-step table is printed
            when the run ends (rank 0); every rank writes its own trace.
        log_dir: folder for the run log, or None. Only rank 0 writes it (``RunLog`` decides).
        log_every: a step row every this many batches (the run's batch count, ``epoch * len + batch``).
        start: ``(epoch, batch, batches)``: where the run starts (a resume's position) and ``len(loader)``.
            TensorBoard hides the points an earlier run logged in ``log_dir`` at or past this run's first
            step (``RunLog``'s ``purge_step``: all of them for a fresh run), as the CSVs drop those rows.
    """

    def __init__(self, device, *, profile=None, log_dir=None, log_every: int = 50, start=(0, 0, 1)):
        self.profiler = StepProfiler(profile, device=device, print_table=False) if profile is not None else None
        epoch, batch, batches = start
        # At least epoch + 1: the finished epochs' points (x = 1..epoch) stay when an epoch is one batch.
        purge = max(epoch * batches + batch, epoch + 1) if epoch else batch
        self.log = RunLog(log_dir, every_steps=log_every, purge_step=purge) if log_dir is not None else None
        self.region = self.profiler.region if self.profiler is not None else no_region
        self.offset = 0
        self.mark, self.wait = 0.0, 0.0

    def __enter__(self) -> RunHooks:
        if self.profiler is not None:
            self.profiler.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.profiler is not None:
                self.profiler.stop(warn=exc_type is None)   # a failed run has its own error to report
                if exc_type is None and self.profiler.rows and fdist.is_main():
                    print(self.profiler.table(), flush=True)
        finally:
            if self.log is not None:
                self.log.close()

    def begin_epoch(self, epoch: int, batches: int, wait: float) -> None:
        """An epoch starts: its batches count from ``epoch * batches``; ``wait`` is the meter's data wait now."""
        self.offset = epoch * batches
        self.mark, self.wait = time.perf_counter(), wait

    def batch_done(self, batch: int, *, loss, images: int, wait: float, lr) -> None:
        """Batch number ``batch`` of the epoch is done: the profiler's step, and the log's step row when one
        is due. ``loss``: its device tensor (read on the host only for a written row), or None; ``wait``:
        the meter's data wait so far; ``lr``: a callable giving the rate the batch trained at
        (``TrainStep.batch_lr``), called only for a written row (a tensor lr is a sync)."""
        if self.profiler is not None:
            self.profiler.step()
        if self.log is None:
            return
        now = time.perf_counter()
        seconds, waited = now - self.mark, wait - self.wait
        self.mark, self.wait = now, wait
        step = self.offset + batch
        due = step % self.log.every_steps == 0
        self.log.step(step, loss=loss if due else None, lr=lr() if due else None,
                      images_per_s=images / seconds if seconds > 0 else math.nan,
                      data_wait=min(1.0, waited / seconds) if seconds > 0 else math.nan,
                      gpu_idle=None)   # per step it would need a sync; the epoch record has gpu_idle_fraction

    def epoch(self, record: dict) -> None:
        """Log one epoch record (after its evaluation, before the checkpoint save)."""
        if self.log is not None:
            self.log.epoch(record)
