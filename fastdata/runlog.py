"""Run logs a person can look at after the run: every epoch record and every N-th step's figures as CSV, the
same as TensorBoard scalars where the tensorboard package is installed, and a PNG of the curves.

Files in ``log_dir``:

- ``epochs.csv``: one row per ``epoch(record)`` (``fit``'s ``epoch_record`` dicts, plus any keys a caller
  adds), and ``last_step``: the last step given to ``step()`` before that epoch ended (empty if none), which
  ``plot_curves`` uses to place the step curves on the epoch axis. The header is the first record's keys; a
  later record with a new key rewrites the file with the new column added (older rows empty there), so the
  columns are always a superset, in first-seen order.
- ``steps.csv``: ``step, loss, lr, images_per_s, data_wait, gpu_idle`` every ``every_steps`` steps.
- ``runlog.lock``: held (flocked) while a run logs here, removed by ``close()``: a second run given the
  same folder meanwhile is refused (``LogDirInUse``) instead of replacing the first run's rows. A run
  that died leaves it unlocked; the next run takes it over.
- ``events.out.tfevents.*``: TensorBoard scalars (``tensorboard --logdir log_dir``). Epoch tags, x = epoch:
  ``train/loss``, ``train/accuracy``, ``eval/loss``, ``eval/accuracy``, ``train/lr``,
  ``perf/images_per_second``, ``perf/peak_memory_mb``, ``perf/epoch_seconds``, ``data/wait_fraction``,
  ``data/gpu_idle_fraction``, and ``epoch/<key>`` for any other number. Step tags, x = step: ``step/loss``,
  ``step/lr``, ``step/images_per_s``, ``step/data_wait_fraction``, ``step/gpu_idle_fraction``. A learning
  rate per parameter group is ``.../lr/group<i>``.

Values in the CSVs: None (an epoch without evaluation, a CPU run's GPU idle) is an empty cell; NaN is
``nan`` (``float()`` reads both back: an empty cell as missing, ``nan`` as NaN); a list (one lr per
parameter group) is JSON text. Tensors are read with ``float()`` only on the steps written, so an
unwritten step never waits for the GPU.

Resume: opening an existing ``log_dir`` appends, never truncates. A resumed run that repeats an epoch or
a step the log already holds (a crash after the log was written but before the checkpoint) replaces those
rows: the first write after opening drops the rows at or past its epoch (or step), and a last row cut off
mid-write (the run killed in it, a full disk), which the next row would otherwise be glued onto. TensorBoard is told the
same with ``purge_step`` (torch's ``SummaryWriter``: TensorBoard hides the points at or past it written
before), which ``fit`` sets to the step it resumes from; a repeated epoch point (a crash after the epoch
was logged, before its checkpoint) still shows twice there.

Under DDP only rank 0 writes (``fastdata.distributed.is_main``); on other ranks every call is a no-op.

How to wire it (``fit(log_dir=DIR)``; the examples' ``--log-dir DIR``)::

    log = RunLog(DIR, every_steps=50)           # once, before the first epoch (rank 0 writes, others no-op)
    # per step, after TrainStep.__call__ (global step = epoch * len(loader) + batch, so a resume continues):
    log.step(global_step, loss=loss, lr=current_lr(optimizer), images_per_s=n / step_seconds,
             data_wait=wait_seconds / step_seconds, gpu_idle=None)
    log.epoch(record)                           # after eval_* are filled in, before the checkpoint is saved
    log.close()                                 # in a finally: flushes TensorBoard
    plot_curves(DIR, os.path.join(DIR, "curves.png"))   # the examples, at the end
"""
from __future__ import annotations

import csv
import json
import math
import numbers
import os
import warnings
from pathlib import Path

from fastdata import distributed as fdist
from fastdata.checks import check_integer
from fastdata.errors import user_stacklevel

STEP_COLUMNS = ("step", "loss", "lr", "images_per_s", "data_wait", "gpu_idle")

# fit's epoch-record keys -> TensorBoard tags; any other numeric key is "epoch/<key>".
EPOCH_TAGS = {
    "train_loss": "train/loss", "train_accuracy": "train/accuracy", "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy", "lr": "train/lr", "images_per_second": "perf/images_per_second",
    "peak_memory_mb": "perf/peak_memory_mb", "seconds": "perf/epoch_seconds",
    "data_wait_fraction": "data/wait_fraction", "gpu_idle_fraction": "data/gpu_idle_fraction",
}
STEP_TAGS = {"loss": "step/loss", "lr": "step/lr", "images_per_s": "step/images_per_s",
             "data_wait": "step/data_wait_fraction", "gpu_idle": "step/gpu_idle_fraction"}


class RunLog:
    """Epoch records and every N-th step's figures, as CSV files and TensorBoard scalars in ``log_dir``.

    Args:
        log_dir: the folder (created if missing; an existing one is appended to). A file is refused.
        every_steps: ``step()`` writes a row when ``step % every_steps == 0`` (>= 1).
        tensorboard: write TensorBoard scalars: None (default) when the tensorboard package is installed,
            True to require it (ImportError with the install command otherwise), False for CSV only.
        purge_step: the first step this run logs, when it resumes a run whose log is in ``log_dir``:
            TensorBoard then hides the earlier run's points at or past it (on every tag, epoch tags too:
            give a step past the epochs already logged), as the CSVs drop their repeated rows. None: none.

    Raises:
        ValueError: ``log_dir`` is a file, or ``every_steps`` is not a positive int.
        LogDirInUse: (a ValueError) another live run logs into ``log_dir``.
    """

    def __init__(self, log_dir, *, every_steps: int = 50, tensorboard: bool | None = None,
                 purge_step: int | None = None):
        check_integer("RunLog: every_steps", every_steps, minimum=1)
        self.log_dir = Path(log_dir)
        if self.log_dir.exists() and not self.log_dir.is_dir():
            raise ValueError(f"RunLog: log_dir {str(self.log_dir)!r} is a file; give a folder")
        self.every_steps = every_steps
        self.enabled = fdist.is_main()
        self._last_step: int | None = None
        self._resumed = {"epochs.csv": False, "steps.csv": False}   # the first write checks for repeats
        # Each file's header once read or written: an append needs no read of the file. Reading it every
        # write made a long run's writes cost more and more (20,000 step rows read every 50 steps).
        self._headers: dict[str, list[str]] = {}
        self._writer = None
        self._claim = None
        self._warned: set[str] = set()   # what could not be written, said once
        if self.enabled:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._claim = _hold(self.log_dir)
            try:
                self._writer = _summary_writer(self.log_dir, tensorboard, purge_step)
            except BaseException:
                self.close()
                raise

    @property
    def epochs_csv(self) -> Path:
        """``log_dir/epochs.csv``."""
        return self.log_dir / "epochs.csv"

    @property
    def steps_csv(self) -> Path:
        """``log_dir/steps.csv``."""
        return self.log_dir / "steps.csv"

    def step(self, step: int, *, loss, lr, images_per_s, data_wait, gpu_idle=None) -> bool:
        """Log step ``step``'s figures if ``step % every_steps == 0``; return whether it was written.

        ``loss`` may be a device tensor (read only when written); ``lr`` a float or a list (one per
        parameter group); ``data_wait`` and ``gpu_idle`` are fractions of the step's time (None: not known)."""
        self._last_step = int(step)
        if not self.enabled or step % self.every_steps:
            return False
        row = {"step": int(step), "loss": _number(loss), "lr": _number(lr), "images_per_s": _number(images_per_s),
               "data_wait": _number(data_wait), "gpu_idle": _number(gpu_idle)}
        self._csv("steps.csv", row, key="step")
        def scalars(writer):
            for name, tag in STEP_TAGS.items():
                _scalar(writer, tag, row[name], row["step"])

        self._tensorboard(scalars)
        return True

    def epoch(self, record: dict) -> None:
        """Log one epoch record (``fit``'s dict: ``epoch`` must be in it) to epochs.csv and TensorBoard."""
        if not self.enabled:
            return
        if "epoch" not in record:
            raise ValueError(f"RunLog.epoch: the record has no 'epoch' key (keys: {sorted(record)}); pass the "
                             f"dict fit builds (fastdata.engine.epoch_record)")
        row = {k: _number(v) for k, v in record.items()}
        row["last_step"] = self._last_step
        self._csv("epochs.csv", row, key="epoch")

        def scalars(writer):
            for key, value in row.items():
                if key not in ("epoch", "last_step"):
                    _scalar(writer, EPOCH_TAGS.get(key, f"epoch/{key}"), value, int(record["epoch"]))
            writer.flush()   # an epoch is worth keeping if the run dies before close()

        self._tensorboard(scalars)

    def close(self) -> None:
        """Flush and close TensorBoard's writer (the CSVs are written through on every row)."""
        self._tensorboard(lambda writer: writer.close())
        self._writer = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # A log that cannot be written (a full disk, a quota) is said once and training goes on: the log is
    # the run's account, not its result, and a run of days ended by a CSV row ("[Errno 28] No space left
    # on device", naming no file) lost the hours since its last checkpoint. A checkpoint save that fails
    # still stops the run (checkpoint.save), naming the file.
    def _csv(self, name: str, row: dict, *, key: str) -> None:
        try:
            self._write(name, row, key=key)
        except OSError as e:
            self._resumed[name] = False   # the next write reads the file again: a row cut off here is dropped
            self._cannot_write(str(self.log_dir / name), e)

    def _tensorboard(self, write) -> None:
        """``write(writer)``; TensorBoard's writer is given up at its first failure (its thread is broken)."""
        if self._writer is None:
            return
        try:
            write(self._writer)
        except OSError as e:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except Exception:
                pass
            self._cannot_write(f"TensorBoard's event file in {self.log_dir}", e)

    def _cannot_write(self, what: str, e: OSError) -> None:
        if what in self._warned:
            return
        self._warned.add(what)
        warnings.warn(f"RunLog: cannot write {what} ({e.strerror or e}); training goes on, and what it would "
                      f"have logged is lost until it can be written", RuntimeWarning, stacklevel=user_stacklevel())

    def _write(self, name: str, row: dict, *, key: str) -> None:
        path = self.log_dir / name
        first = not self._resumed[name]
        self._resumed[name] = True
        header = self._headers.get(name)
        rows: list[dict] | None = None
        if first or header is None:   # the file as this run found it (a resume's rows)
            header, rows = _read(path) if path.exists() else (None, [])
        repeated = first and any(_at_or_past(r.get(key), row[key]) for r in rows or [])
        # A row cut off mid-write (the run killed in it, the disk full): appending glued the next row onto
        # it, one garbage row ("6,0.97,0.5,...") for two. It is dropped, as a repeated row is.
        torn = first and bool(rows) and _torn(path)
        if torn and rows:
            rows = rows[:-1]
        new = header is None or any(k not in header for k in row)
        if header is not None and not repeated and not new and not torn:   # (not new: there is a header)
            with open(path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=header)
                if f.tell() == 0:   # deleted (or emptied) while the run went on: a file of rows without a header
                    writer.writeheader()
                writer.writerow(_cells(row))
            self._headers[name] = header
            return
        if rows is None:   # a new column: the file is rewritten whole
            header, rows = _read(path) if path.exists() else (None, [])
        if repeated:
            rows = [r for r in rows if not _at_or_past(r.get(key), row[key])]
        header = list(header or []) + [k for k in row if k not in (header or [])]
        tmp = path.with_suffix(".csv.tmp")
        try:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=header)
                writer.writeheader()
                writer.writerows(rows)           # already cell text, as read
                writer.writerow(_cells(row))
            os.replace(tmp, path)                # a crash mid-rewrite leaves the old file, not half of one
        except OSError:
            tmp.unlink(missing_ok=True)          # a full disk: no half-written copy beside the old file
            raise
        self._headers[name] = header


class LogDirInUse(ValueError):
    """Another live run logs into the same ``log_dir``."""


LOCK_NAME = "runlog.lock"


def _hold(log_dir: Path):
    """This run's hold on ``log_dir`` (``log_dir/runlog.lock``, flocked until ``close``), or
    ``LogDirInUse``. Two runs logging into one folder each dropped the other's rows (the first write of a
    run replaces the rows at or past its step: all of an earlier run's) and then interleaved theirs, and
    TensorBoard drew both runs' points as one curve."""
    from fastdata.pathlock import hold

    return hold(log_dir / LOCK_NAME, lambda holder: LogDirInUse(
        f"RunLog: log_dir {str(log_dir)!r} is in use by another run ({holder}): two runs logging into one "
        f"folder replace each other's rows. Give this run its own log_dir, or stop the other run first"))


def _summary_writer(log_dir: Path, tensorboard: bool | None, purge_step: int | None = None):
    if tensorboard is False:
        return None
    try:
        # torch's writer, which needs the tensorboard package
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        if tensorboard:
            raise ImportError("RunLog(tensorboard=True) needs the tensorboard package: pip install tensorboard "
                              "(or pip install 'fastdata[integrations]')") from e
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _number(value):
    """A tensor or numpy scalar as a Python number (a list element-wise); other values unchanged."""
    if isinstance(value, (list, tuple)):
        return [_number(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _cells(row: dict) -> dict:
    return {k: _cell(v) for k, v in row.items()}


def _at_or_past(cell, value) -> bool:
    try:
        return float(cell) >= float(value)
    except (TypeError, ValueError):
        return False


def _torn(path: Path) -> bool:
    """Whether the file's last row was cut off: it does not end with a line end."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) not in (b"\n", b"\r")


def _read(path: Path) -> tuple[list[str] | None, list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return (list(reader.fieldnames) if reader.fieldnames else None), rows


def _scalar(writer, tag: str, value, step: int) -> None:
    if isinstance(value, list):
        for i, v in enumerate(value):
            _scalar(writer, f"{tag}/group{i}", v, step)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        writer.add_scalar(tag, float(value), step)


# ------------------------------------------------------------------------------------------ the plot
def _float(cell: str | None) -> float:
    """A CSV cell as a number: empty or unreadable -> NaN; a JSON list (one lr per group) -> its first."""
    cell = (cell or "").strip()
    try:
        if cell.startswith("["):
            values = json.loads(cell)
            return float(values[0]) if values and values[0] is not None else math.nan
        return float(cell) if cell else math.nan
    except (ValueError, TypeError):
        return math.nan


def _floats(rows: list[dict], key: str) -> list[float]:
    return [_float(r.get(key)) for r in rows]


def _step_positions(steps: list[float], epochs: list[float], last_steps: list[float]) -> list[float] | None:
    """Each step's place on the epoch axis (epoch e's last step at x = e), or None without last_step."""
    import numpy as np

    ends = [(s, e) for s, e in zip(last_steps, epochs) if not math.isnan(s)]
    if not ends:
        return None
    xs, ys = [0.0] + [s for s, _ in ends], [ends[0][1] - 1] + [e for _, e in ends]
    per_epoch = (xs[-1] - xs[-2]) or 1.0     # steps past the last logged epoch: that epoch's pace
    return [float(np.interp(s, xs, ys)) if s <= xs[-1] else ys[-1] + (s - xs[-1]) / per_epoch for s in steps]


def plot_curves(log_dir, out_png) -> dict[str, list[str]]:
    """A PNG of a run log's curves: loss, accuracy, learning rate, and data wait / GPU idle.

    Epoch figures are points joined by lines, against the epoch; the steps (``steps.csv``) are thin grey
    lines, placed on the epoch axis through epochs.csv's ``last_step`` (a log of steps alone is plotted
    against the step). A learning rate per group plots its first group. Uses matplotlib's Agg renderer
    without touching pyplot's global backend. Returns the labels of the curves drawn, per panel.

    Raises:
        FileNotFoundError: ``log_dir`` holds neither epochs.csv nor steps.csv with rows.
        ImportError: matplotlib is not installed (pip install matplotlib).
    """
    log_dir = Path(log_dir)
    epochs = _read(log_dir / "epochs.csv")[1] if (log_dir / "epochs.csv").exists() else []
    steps = _read(log_dir / "steps.csv")[1] if (log_dir / "steps.csv").exists() else []
    if not epochs and not steps:
        raise FileNotFoundError(f"plot_curves: {str(log_dir)!r} has no epochs.csv or steps.csv with rows: "
                                f"is it a RunLog's log_dir (fit(log_dir=...))?")
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_curves needs matplotlib: pip install matplotlib") from e

    ep = _floats(epochs, "epoch")
    step_x = _step_positions(_floats(steps, "step"), ep, _floats(epochs, "last_step"))
    x_label = "epoch"
    if step_x is None:
        if epochs:
            steps = []   # no way to place them on the epoch axis: the epoch curves alone
        else:
            step_x, x_label = _floats(steps, "step"), "step"
    fig = Figure(figsize=(11, 7), layout="constrained")
    axes = fig.subplots(2, 2).flatten()
    panels = {
        "loss": ([("train_loss", "train loss"), ("eval_loss", "eval loss")], [("loss", "step loss")]),
        "accuracy": ([("train_accuracy", "train accuracy"), ("eval_accuracy", "eval accuracy")], []),
        "lr": ([("lr", "lr")], [("lr", "step lr")]),
        "data": ([("data_wait_fraction", "data wait fraction"), ("gpu_idle_fraction", "GPU idle fraction")],
                 [("data_wait", "step data wait"), ("gpu_idle", "step GPU idle")]),
    }
    drawn: dict[str, list[str]] = {}
    for ax, (name, (epoch_curves, step_curves)) in zip(axes, panels.items()):
        drawn[name] = []
        for rows, x, curves, style in ((steps, step_x, step_curves, {"linewidth": 0.8, "alpha": 0.6}),
                                       (epochs, ep, epoch_curves, {"marker": "o"})):
            for key, label in curves:
                ys = _floats(rows, key)
                if rows and not all(math.isnan(y) for y in ys):
                    ax.plot(x, ys, label=label, **style)
                    drawn[name].append(label)
        ax.set_title(name)
        ax.set_xlabel(x_label)
        if drawn[name]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(str(log_dir))
    fig.savefig(out_png, dpi=100)
    return drawn
