"""Where a training step's time goes: a torch.profiler trace of a few steps and a per-step table of data wait
vs host-to-device copy vs forward/backward vs optimizer, so a user sees whether the data or the model holds
the GPU back.

``StepProfiler`` wraps ``torch.profiler.profile`` with a ``schedule(wait, warmup, active, repeat=1)``: it
records ``active`` steps after ``wait`` skipped and ``warmup`` warm-up steps (the first steps pay for cuDNN's
autotuning, allocator growth and worker start-up, which is not what a step costs), writes the trace with
``tensorboard_trace_handler`` (``<out_dir>/<host>_<pid>.<ns>.pt.trace.json``: TensorBoard's profiler plugin
``tensorboard --logdir out_dir`` and https://ui.perfetto.dev open it) and prints the table.

How the parts are timed. Each labelled region (``data_wait``, ``h2d``, ``forward_backward``, ``optimizer``)
is a ``torch.profiler.record_function`` range in the trace, and is timed by marks at its edges: on CUDA,
CUDA events recorded on the device's current (training) stream, so a part is the time the *GPU* spent
between its edges (``data_wait`` then counts the stream standing idle until the next batch's work is
queued: host time would count the wait even while the GPU was still busy with the previous step's
kernels); on the CPU, host ``perf_counter``. A step runs from one ``step()`` call to the next; ``other`` is
the rest of it (the loss sums, the scheduler, Python between regions), so the parts sum to the step.
On CUDA, a loader that copies inside its ``__next__`` (fastdata's ``torch`` and ``prefetch`` backends) puts
its host-to-device copies inside ``data_wait``: their device time, read from the trace's ``Memcpy HtoD``
events whose launch (matched by correlation id) the training thread made in that region, is moved to
``h2d`` (a step that uses its own ``h2d`` region keeps that instead).

How to wire it (``fit(profile=DIR)``)::

    prof = StepProfiler(DIR, device=device)        # once, before the first epoch
    with prof:                                     # start(); stop() on the way out (an early end is fine)
        for images, labels in loader:              # in EpochMeter.timed: wrap the blocking next(it):
            ...                                    #     with prof.region("data_wait"): batch = next(it)
            with prof.region("forward_backward"):  # TrainStep.__call__: autocast forward, loss, backward
                ...
            with prof.region("optimizer"):         # scaler.step(optimizer), scaler.update()
                ...
            prof.step()                            # once per training step, after it (train_one_epoch)

Regions outside the traced steps (warm-up and active) cost a counter check; ``prof.rows`` holds the table as
dicts and ``prof.table()`` formats it (printed on rank 0 once the active steps end, or at ``stop()`` if the
run ended in the middle of them). Every rank writes its own trace file. A run shorter than
``wait + warmup + 1`` steps writes no trace and warns.
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import socket
import time
import warnings
from pathlib import Path

import torch

from fastdata import distributed as fdist
from fastdata.checks import check_choice, check_integer
from fastdata.errors import user_stacklevel

REGIONS = ("data_wait", "h2d", "forward_backward", "optimizer")
_PARTS = (*REGIONS, "other")


class StepProfiler:
    """A torch.profiler trace of ``active`` training steps and a per-step table of where their time went.

    Args:
        out_dir: folder for the trace (created if missing; an existing file is refused).
        wait: steps skipped before the profiler starts (>= 0).
        warmup: steps traced but discarded, after ``wait`` (>= 0; 0 lets the first profiled step carry
            the profiler's own start-up cost).
        active: steps recorded, in the trace and the table (>= 1).
        device: the training device (``torch.device`` or a string): CUDA activity is traced and the
            parts are timed with CUDA events where it is a CUDA device.
        record_shapes: record operator input shapes in the trace (larger trace, more overhead).
        print_table: print the table on rank 0 when the active steps end.

    Raises:
        ValueError: an argument out of range or of the wrong type, naming it.
    """

    def __init__(self, out_dir, *, wait: int = 1, warmup: int = 2, active: int = 5, device,
                 record_shapes: bool = False, print_table: bool = True):
        for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
            check_integer(f"StepProfiler: {name} (steps)", value, minimum=least)
        try:
            self.device = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"StepProfiler: device must be a torch.device or a device string such as 'cuda:0' "
                             f"or 'cpu', got {device!r}") from e
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise ValueError(f"StepProfiler: out_dir {str(self.out_dir)!r} is a file; give a folder for the trace")
        self.wait, self.warmup, self.active = wait, warmup, active
        self.record_shapes, self.print_table = record_shapes, print_table
        self.cuda = self.device.type == "cuda"
        self.rows: list[dict] = []
        self.trace_files: list[Path] = []
        self._prof: torch.profiler.profile | None = None
        self._steps = 0                  # step() calls so far: the index of the step running now
        self._marks: list = []           # per active step: [(name, start, end), ...] and its start mark
        self._step_start = None
        self._open: str | None = None
        self._reported = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> StepProfiler:
        """Start the profiler (its schedule counts steps from here)."""
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # The handler's own default name, given explicitly: under DDP every rank writes into out_dir, and
        # a file another rank wrote meanwhile must not be taken (and read) as this rank's trace.
        worker = f"{socket.gethostname()}_{os.getpid()}"
        handler = tensorboard_trace_handler(str(self.out_dir), worker_name=worker)

        def on_trace_ready(prof):
            pattern = f"{glob.escape(worker)}.*.pt.trace.json"
            before, partial = set(self.out_dir.glob(pattern)), set(self.out_dir.glob(pattern + ".tmp"))
            handler(prof)
            written = sorted(set(self.out_dir.glob(pattern)) - before)
            if not written:
                self._unwritten(sorted(set(self.out_dir.glob(pattern + ".tmp")) - partial))
            self.trace_files += written
            self._report(written)

        with warnings.catch_warnings():   # warmup=0 is the user's choice; torch warns about it at length
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            sched = schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1)
        self._prof = prof = profile(activities=activities, schedule=sched, on_trace_ready=on_trace_ready,
                                    record_shapes=self.record_shapes)
        prof.start()
        self._steps = 0
        self._begin_step()
        return self

    def stop(self, *, warn: bool = True) -> None:
        """Stop the profiler; a run that ended inside the active steps gets its trace and table now.
        ``warn``: say so when the run was too short for any step to be recorded."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        if warn and not self._reported and fdist.is_main():
            warnings.warn(f"StepProfiler: the run took {self._steps} step(s), fewer than wait + warmup + 1 = "
                          f"{self.wait + self.warmup + 1}: no trace was written to {self.out_dir}",
                          RuntimeWarning, stacklevel=user_stacklevel())

    def __enter__(self) -> StepProfiler:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(warn=exc_type is None)   # a run that failed has its own error to report

    # ------------------------------------------------------------------ per step
    def _active(self, step: int) -> bool:
        return self.wait + self.warmup <= step < self.wait + self.warmup + self.active

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _ms(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1000.0

    def _begin_step(self) -> None:
        self._step_start = self._mark() if self._active(self._steps) else None
        self._regions: list = []

    @contextlib.contextmanager
    def region(self, name: str):
        """A labelled part of the step: one of ``REGIONS``. Regions do not nest."""
        check_choice("StepProfiler region", name, REGIONS)
        if self._prof is None:
            raise RuntimeError("StepProfiler.region outside the profiler: use `with StepProfiler(...) as prof:` "
                               "or call prof.start() first")
        if self._open is not None:
            raise RuntimeError(f"StepProfiler.region({name!r}) inside region {self._open!r}: regions do not "
                               f"nest (their times would be counted twice)")
        self._open = name
        try:
            if not self.wait <= self._steps < self.wait + self.warmup + self.active:
                yield   # a step the profiler neither warms up on nor records: no range, no marks
                return
            timed = self._step_start is not None
            with torch.profiler.record_function(name):
                start = self._mark() if timed else None
                yield
                if timed:
                    self._regions.append((name, start, self._mark()))
        finally:
            self._open = None

    def step(self) -> None:
        """End the current training step (call once per step, after its optimizer step)."""
        if self._prof is None:
            raise RuntimeError("StepProfiler.step outside the profiler: use `with StepProfiler(...) as prof:` "
                               "or call prof.start() first")
        if self._step_start is not None:
            self._marks.append((self._steps, self._step_start, self._regions, self._mark()))
        self._steps += 1
        if self._reported:
            return   # the schedule is over (repeat=1): nothing left for torch's profiler to step
        self._prof.step()   # after the last active step this writes the trace and calls _report
        self._begin_step()

    def _unwritten(self, partial: list[Path]) -> None:
        """The trace was not written: kineto writes ``<trace>.tmp`` and renames it, and a failed write
        (a full disk, a quota, a folder made read-only) only logs "Failed to write to log file!" from
        C++, naming nothing, and leaves the cut-off ``.tmp``. Remove that and say so."""
        for path in partial:
            try:
                path.unlink()
            except OSError:
                pass
        h2d = ": its h2d column needs the trace" if self.cuda else ""
        warnings.warn(f"StepProfiler: the trace could not be written to {self.out_dir} (torch's profiler says only "
                      f"'Failed to write to log file': a full disk, a quota, a folder made read-only?); "
                      f"{len(partial)} cut-off file(s) removed. The table is fastdata's own timing{h2d}",
                      RuntimeWarning, stacklevel=user_stacklevel())

    # ------------------------------------------------------------------ the table
    def _report(self, written: list[Path]) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)   # once, after the active steps: the events are read now
        copies = _htod_ms_per_step(_read_trace(written[-1])) if self.cuda and written else {}
        self.rows = []
        for step, start, regions, end in self._marks:
            total = self._ms(start, end)
            parts = dict.fromkeys(REGIONS, 0.0)
            for name, a, b in regions:
                parts[name] += self._ms(a, b)
            if not any(name == "h2d" for name, _, _ in regions):
                moved = min(copies.get(step, 0.0), parts["data_wait"])
                parts["data_wait"] -= moved
                parts["h2d"] += moved
            parts["other"] = max(0.0, total - sum(parts.values()))
            row = {"step": step, "step_ms": total}
            for name in _PARTS:
                row[f"{name}_ms"] = parts[name]
                row[f"{name}_share"] = parts[name] / total if total > 0 else math.nan
            self.rows.append(row)
        self._marks = []
        self._reported = True
        if not self.rows:
            # stop() inside the first recorded step (a run of exactly wait + warmup steps): torch writes
            # the trace of the unfinished step, but no step ended, so there is no table to print.
            if fdist.is_main():
                warnings.warn(f"StepProfiler: the run took {self._steps} step(s) and ended inside the first "
                              f"recorded one (wait + warmup + 1 = {self.wait + self.warmup + 1} are needed): no "
                              f"step was recorded; the trace in {self.out_dir} holds only that unfinished step",
                              RuntimeWarning, stacklevel=user_stacklevel())
            return
        if self.print_table and fdist.is_main():
            print(self.table(), flush=True)

    def table(self) -> str:
        """The per-step table as text: ms of each part and its share of the step, a mean row, and which
        side holds the step back (data: wait + copy; model: forward/backward + optimizer)."""
        return format_table(self.rows, device=self.device, trace_files=self.trace_files)


def format_table(rows: list[dict], *, device=None, trace_files=()) -> str:
    """``StepProfiler.rows`` as a text table (see ``StepProfiler.table``)."""
    if not rows:
        return "profile: no step was recorded"
    clock = "GPU stream time (CUDA events)" if device is not None and torch.device(device).type == "cuda" \
        else "host time"
    head = f"{'step':>6} {'total ms':>9}" + "".join(f" {name:>22}" for name in _PARTS)
    lines = [f"profile: where each step's time went ({clock})", head]

    def line(label, row):
        cells = "".join(f" {row[f'{n}_ms']:9.2f} ms {100 * row[f'{n}_share']:5.1f}%   " for n in _PARTS)
        return f"{label:>6} {row['step_ms']:9.2f}" + cells.rstrip()

    lines += [line(str(r["step"]), r) for r in rows]
    mean = {"step_ms": sum(r["step_ms"] for r in rows) / len(rows)}
    for n in _PARTS:
        mean[f"{n}_ms"] = sum(r[f"{n}_ms"] for r in rows) / len(rows)
        mean[f"{n}_share"] = mean[f"{n}_ms"] / mean["step_ms"] if mean["step_ms"] > 0 else math.nan
    lines.append(line("mean", mean))
    data = mean["data_wait_share"] + mean["h2d_share"]
    model = mean["forward_backward_share"] + mean["optimizer_share"]
    side = "the data (loading + copy)" if data > model else "the model (forward/backward + optimizer)"
    lines.append(f"profile: {side} takes most of the step: data {100 * data:.0f}%, model {100 * model:.0f}%")
    lines += [f"profile: trace {f} (tensorboard --logdir {Path(f).parent}, or ui.perfetto.dev)" for f in trace_files]
    return "\n".join(lines)


# Which events of the chrome trace (kineto's ``output_json``: "cat" is kineto's ActivityType name) say what.
_CPU_RANGES = ("user_annotation", "cpu_op")      # host-side ranges: record_function, ProfilerStep#N, ops
_LAUNCHES = ("cuda_runtime", "cuda_driver")     # the host's API call that queued the device work


def _htod_ms_per_step(trace_events) -> dict[int, float]:
    """Device ms of the host-to-device copies launched inside each step's ``data_wait`` regions: step
    index -> ms, from the chrome trace ``tensorboard_trace_handler`` wrote (its ``traceEvents`` list).

    Why the trace file and not ``prof.events()``: a GPU copy is no event under the CPU range it was
    queued in. It runs later on the device clock, and is tied to its launch only by the CUPTI correlation
    id. The trace says that in plain fields: the ``gpu_memcpy`` event and the ``cuda_runtime`` call that
    launched it (``cudaMemcpyAsync``, on the launching thread's pid/tid and host timestamp) share
    ``args.correlation``, and every event has a ``cat`` telling host ranges from the GPU-side copies of
    ``ProfilerStep#N`` and of ``record_function`` ranges (``gpu_user_annotation``, on the device clock, which
    lag and overlap the next step's host range). ``prof.events()`` gives the same data through torch's
    post-processing: its FunctionEvents lose the category (a runtime call and an op are both "CPU" and
    their ids come from two counters that overlap), hold the GPU-side ranges under the same names, and its
    fields move between torch releases; the trace file is kineto's stable output, already written, and
    is what TensorBoard and Perfetto show, so the table agrees with what the user opens.

    So: a copy counts for step N when the host call that launched it falls inside a host ``data_wait``
    range on the same process and thread, and inside the host ``ProfilerStep#N`` range.
    """
    waits: dict[tuple, list[tuple[float, float]]] = {}
    steps: list[tuple[object, float, float, int]] = []
    launches: dict[object, dict] = {}
    copies: list[dict] = []
    for e in trace_events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), e.get("name", "")
        if cat in _CPU_RANGES:
            span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
            if name == "data_wait":
                waits.setdefault((e.get("pid"), e.get("tid")), []).append(span)
            elif name.startswith("ProfilerStep#") and name.split("#", 1)[1].isdigit():
                steps.append((e.get("pid"), *span, int(name.split("#", 1)[1])))
        elif cat in _LAUNCHES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
        elif cat == "gpu_memcpy" and "HtoD" in name:
            copies.append(e)
    out: dict[int, float] = {}
    for copy in copies:
        launch = launches.get(copy.get("args", {}).get("correlation"))
        if launch is None:
            continue
        ts, pid = float(launch["ts"]), launch.get("pid")
        if not any(a <= ts <= b for a, b in waits.get((pid, launch.get("tid")), ())):
            continue
        for step_pid, a, b, index in steps:
            if step_pid == pid and a <= ts <= b:
                out[index] = out.get(index, 0.0) + float(copy.get("dur", 0.0)) / 1000.0
                break
    return out


def _read_trace(path) -> list[dict]:
    """The ``traceEvents`` of a chrome trace file."""
    with open(path) as f:
        return json.load(f).get("traceEvents", [])
