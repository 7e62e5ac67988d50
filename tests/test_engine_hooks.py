"""Tests of fit's profiler and run log (fastdata/engine/hooks.py)."""

import pytest

from conftest import require, run_as_nobody
from engine_helpers import ListLoader, _batches
from fastdata.engine import (
    fit,
)
from fastdata.models import SmallCNN


def test_fit_profile_writes_a_trace_with_the_step_regions_and_prints_the_table(tmp_path, capsys):
    import json

    loader = ListLoader(_batches(10, size=8))   # 1 skipped + 2 warm-up + 5 recorded steps fit in one epoch
    fit(SmallCNN(width=4), loader, epochs=1, amp="off", progress=False, profile=tmp_path / "prof")
    traces = list((tmp_path / "prof").glob("*.pt.trace.json"))
    assert len(traces) == 1, traces
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"data_wait", "forward_backward", "optimizer"} <= names
    assert sum(1 for n in names if str(n).startswith("ProfilerStep#")) == 5
    out = capsys.readouterr().out
    assert "profile: where each step's time went" in out and "mean" in out
    assert out.index("epoch 1/1") < out.index("profile: where each step's time went")   # at the end of the run


def test_fit_log_dir_writes_every_epoch_record_the_steps_and_tensorboard_scalars(tmp_path):
    import csv

    require("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loader = ListLoader(_batches(6, size=8))
    history = fit(SmallCNN(width=4), loader, eval_loader=loader, epochs=3, amp="off", progress=False,
                  log_dir=tmp_path / "log", log_every=4)
    with open(tmp_path / "log" / "epochs.csv", newline="") as f:
        epochs = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in epochs] == [1, 2, 3]
    for row, record in zip(epochs, history):
        assert float(row["train_loss"]) == pytest.approx(record["train_loss"])
        assert float(row["eval_accuracy"]) == pytest.approx(record["eval_accuracy"])   # after the evaluation
    with open(tmp_path / "log" / "steps.csv", newline="") as f:
        steps = list(csv.DictReader(f))
    assert [int(r["step"]) for r in steps] == [0, 4, 8, 12, 16]   # batches 0..17 of the run, every 4th
    assert all(float(r["loss"]) > 0 and float(r["lr"]) == pytest.approx(1e-3) and float(r["images_per_s"]) > 0
               and 0.0 <= float(r["data_wait"]) <= 1.0 for r in steps)
    events = EventAccumulator(str(tmp_path / "log"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/accuracy")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("step/loss")] == [0, 4, 8, 12, 16]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"gradient_checkpointing": "yes"}, TypeError, "gradient_checkpointing"),
    ({"profile": 3}, TypeError, "profile must be a folder path"),
    ({"log_dir": "FILE"}, ValueError, r"log_dir=.*is a file"),
    ({"profile": "FILE/sub"}, ValueError, r"profile=.*cannot be written"),
    ({"log_every": 0}, ValueError, "log_every"),
])
def test_fit_checks_the_profiler_and_log_arguments_up_front(tmp_path, kwargs, error, match):
    (tmp_path / "FILE").write_text("not a folder")
    kwargs = {k: str(tmp_path / v) if isinstance(v, str) and v.startswith("FILE") else v for k, v in kwargs.items()}
    loader = ListLoader(_batches(2))
    with pytest.raises(error, match=match):
        fit(SmallCNN(width=4), loader, epochs=1, progress=False, **kwargs)
    assert loader.iters == 0


def _fit(log_dir):
    """Start a short fit with ``log_dir`` (run as uid nobody below)."""
    fit(SmallCNN(width=4), ListLoader(_batches(2)), epochs=1, progress=False, log_dir=log_dir)


def test_fit_refuses_a_log_dir_it_cannot_write():
    """Root writes anywhere (CI runs as root), so fit runs as uid nobody (``run_as_nobody``) against a
    root-owned read-only folder: a user's unwritable folder (as test_checkpoint does)."""
    import os
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="fastdata-ro-")  # under /tmp, traversable by others (unlike tmp_path)
    locked = os.path.join(base, "locked")
    try:
        os.chmod(base, 0o755)
        os.mkdir(locked)
        os.chmod(locked, 0o555)
        # A whole run here first: the modules fit imports on the way are loaded before the child gives up
        # root (uid nobody may not read this interpreter's library), so only the folder can stop it.
        _fit(os.path.join(base, "warm"))
        with pytest.raises(ValueError, match=r"log_dir=.*cannot be written.*not a writable folder") as raised:
            run_as_nobody(_fit, os.path.join(locked, "run"), timeout=120)
        assert raised.type is ValueError
        assert os.listdir(locked) == []
    finally:
        shutil.rmtree(base)
