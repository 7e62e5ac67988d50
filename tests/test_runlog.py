"""RunLog: a CSV row for every epoch record and every N-th step, TensorBoard scalars its own reader reads
back, NaN and None written one way, a resumed log appended to; plot_curves: a PNG of the curves."""
from __future__ import annotations

import csv
import math

import pytest
import torch

from conftest import require
from fastdata import distributed as fdist
from fastdata.engine import epoch_record
from fastdata.runlog import RunLog, plot_curves


def _record(epoch: int, *, eval_: bool = True, **extra) -> dict:
    r = epoch_record(epoch, loss_sum=2.0 / epoch * 100, correct=50 + 10 * epoch, seen=100, images=100,
                     seconds=2.0, data_wait_fraction=0.1 * epoch, gpu_idle_fraction=None, peak_memory_mb=12.5,
                     lr=0.1 / epoch)
    if eval_:
        r["eval_loss"], r["eval_accuracy"] = 1.5 / epoch, 0.5 + 0.1 * epoch
    r.update(extra)
    return r


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _run(log_dir, epochs=3, steps_per_epoch=10, every_steps=5, first_epoch=1, **kwargs):
    with RunLog(log_dir, every_steps=every_steps, **kwargs) as log:
        for epoch in range(first_epoch, epochs + 1):
            for i in range(1, steps_per_epoch + 1):
                step = (epoch - 1) * steps_per_epoch + i
                log.step(step, loss=torch.tensor(3.0 / step), lr=0.1 / epoch, images_per_s=1000.0 + step,
                         data_wait=0.25, gpu_idle=None)
            log.epoch(_record(epoch))
    return log


def test_every_epoch_record_and_every_nth_step_is_a_csv_row(tmp_path):
    _run(tmp_path, epochs=3)
    epochs = _rows(tmp_path / "epochs.csv")
    assert [r["epoch"] for r in epochs] == ["1", "2", "3"]
    assert list(epochs[0]) == [*_record(1), "last_step"]       # the record's keys, in its order
    for r, n in zip(epochs, (1, 2, 3)):
        expected = _record(n)
        assert float(r["train_loss"]) == pytest.approx(expected["train_loss"])
        assert float(r["eval_accuracy"]) == pytest.approx(expected["eval_accuracy"])
        assert float(r["lr"]) == pytest.approx(0.1 / n)
        assert r["last_step"] == str(10 * n)
    steps = _rows(tmp_path / "steps.csv")
    assert [int(r["step"]) for r in steps] == [5, 10, 15, 20, 25, 30]
    assert float(steps[0]["loss"]) == pytest.approx(3.0 / 5)   # a tensor, read on the written step
    assert list(steps[0]) == ["step", "loss", "lr", "images_per_s", "data_wait", "gpu_idle"]


def test_none_is_an_empty_cell_and_nan_is_nan(tmp_path):
    with RunLog(tmp_path, every_steps=1, tensorboard=False) as log:
        log.step(1, loss=float("nan"), lr=[0.1, 0.01], images_per_s=math.nan, data_wait=0.0, gpu_idle=None)
        log.epoch(epoch_record(1, loss_sum=0, correct=0, seen=0, images=0, seconds=0.0, data_wait_fraction=0.0,
                               gpu_idle_fraction=None, peak_memory_mb=0.0, lr=0.1))
    step = _rows(tmp_path / "steps.csv")[0]
    assert step["loss"] == "nan" and step["images_per_s"] == "nan" and step["gpu_idle"] == ""
    assert step["lr"] == "[0.1, 0.01]"                     # one rate per parameter group, as JSON
    epoch = _rows(tmp_path / "epochs.csv")[0]
    assert epoch["train_loss"] == "nan" and epoch["images_per_second"] == "nan"   # no sample seen
    assert epoch["eval_loss"] == "" and epoch["gpu_idle_fraction"] == ""          # not measured
    assert math.isnan(float(epoch["train_loss"]))


def test_a_new_key_in_a_later_record_adds_a_column(tmp_path):
    with RunLog(tmp_path, tensorboard=False) as log:
        log.epoch(_record(1))
        log.epoch(_record(2, grad_norm=1.25))
        log.epoch(_record(3))
    rows = _rows(tmp_path / "epochs.csv")
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert [r["grad_norm"] for r in rows] == ["", "1.25", ""]
    assert list(rows[0])[-1] == "grad_norm"


def test_a_write_reads_the_file_only_when_it_must(tmp_path, monkeypatch):
    """Every write read the whole CSV back (to find its header), so a long run's step writes cost more and
    more: 20,000 rows read every 50 steps. The file is read at the first write after opening (a resume's
    rows) and when a new column makes it rewritten; appends read nothing."""
    import fastdata.runlog as runlog

    reads = []
    real = runlog._read
    monkeypatch.setattr(runlog, "_read", lambda path: reads.append(path.name) or real(path))
    with RunLog(tmp_path, every_steps=1, tensorboard=False) as log:
        for step in range(1, 201):
            log.step(step, loss=1.0, lr=0.1, images_per_s=10.0, data_wait=0.0)
        log.epoch(_record(1))
        log.epoch(_record(2, grad_norm=1.25))   # a new column: one read to rewrite the file
        log.epoch(_record(3))
    assert reads == ["epochs.csv"]   # steps.csv did not exist yet at its first write: nothing to read
    assert len(_rows(tmp_path / "steps.csv")) == 200 and len(_rows(tmp_path / "epochs.csv")) == 3
    reads.clear()
    with RunLog(tmp_path, every_steps=1, tensorboard=False) as log:   # a resume: each file read once
        for step in range(201, 301):
            log.step(step, loss=1.0, lr=0.1, images_per_s=10.0, data_wait=0.0)
    assert reads == ["steps.csv"] and len(_rows(tmp_path / "steps.csv")) == 300


def test_reopening_a_log_dir_appends_and_a_repeated_epoch_replaces_its_row(tmp_path):
    _run(tmp_path, epochs=2, tensorboard=False)
    _run(tmp_path, epochs=4, first_epoch=3, tensorboard=False)       # a resume after epoch 2: appended
    assert [r["epoch"] for r in _rows(tmp_path / "epochs.csv")] == ["1", "2", "3", "4"]
    assert [r["step"] for r in _rows(tmp_path / "steps.csv")] == [str(s) for s in range(5, 41, 5)]
    # A crash after epoch 4 was logged but before its checkpoint: the resume repeats epoch 4.
    _run(tmp_path, epochs=4, first_epoch=4, tensorboard=False)
    assert [r["epoch"] for r in _rows(tmp_path / "epochs.csv")] == ["1", "2", "3", "4"]
    assert [r["step"] for r in _rows(tmp_path / "steps.csv")] == [str(s) for s in range(5, 41, 5)]


def test_tensorboards_reader_reads_the_scalars_back(tmp_path):
    EventAccumulator = require("tensorboard.backend.event_processing.event_accumulator").EventAccumulator

    _run(tmp_path, epochs=3)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/accuracy", "eval/loss", "eval/accuracy", "train/lr", "data/wait_fraction",
            "perf/images_per_second", "step/loss", "step/lr", "step/data_wait_fraction"} <= tags
    assert "data/gpu_idle_fraction" not in tags     # None on the CPU: nothing to plot
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([_record(n)["train_loss"] for n in (1, 2, 3)])
    assert [e.step for e in acc.Scalars("step/loss")] == [5, 10, 15, 20, 25, 30]


def test_per_group_learning_rates_are_one_tag_each(tmp_path):
    EventAccumulator = require("tensorboard.backend.event_processing.event_accumulator").EventAccumulator

    with RunLog(tmp_path) as log:
        log.epoch(_record(1, lr=[0.1, 0.01]))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Scalars("train/lr/group1")[0].value == pytest.approx(0.01)


def test_only_rank_0_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(fdist, "is_main", lambda: False)
    log = _run(tmp_path / "rank1", epochs=1)
    assert not log.enabled and not (tmp_path / "rank1").exists()


def test_bad_arguments_are_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="log_dir .* is a file"):
        RunLog(tmp_path / "f")
    for bad in (0, -5, True, 2.5):
        with pytest.raises(ValueError, match=rf"RunLog: every_steps must be an integer >= 1, got {bad}"):
            RunLog(tmp_path, every_steps=bad)
    with pytest.raises(ValueError, match="the record has no 'epoch' key"):
        RunLog(tmp_path, tensorboard=False).epoch({"train_loss": 1.0})


def test_plot_curves_writes_a_png_of_the_curves(tmp_path):
    from PIL import Image

    _run(tmp_path, epochs=3, tensorboard=False)
    drawn = plot_curves(tmp_path, tmp_path / "curves.png")
    assert drawn == {"loss": ["step loss", "train loss", "eval loss"],
                     "accuracy": ["train accuracy", "eval accuracy"],
                     "lr": ["step lr", "lr"],
                     "data": ["step data wait", "data wait fraction"]}
    with Image.open(tmp_path / "curves.png") as im:
        assert im.format == "PNG" and im.size == (1100, 700)
        assert len(im.convert("RGB").getcolors(maxcolors=100_000)) > 20   # not a blank canvas


def test_plot_curves_of_steps_alone_and_of_nothing(tmp_path):
    with RunLog(tmp_path, every_steps=1, tensorboard=False) as log:
        for s in range(1, 4):
            log.step(s, loss=1.0 / s, lr=0.1, images_per_s=10.0, data_wait=0.5)
    assert plot_curves(tmp_path, tmp_path / "c.png")["loss"] == ["step loss"]
    with pytest.raises(FileNotFoundError, match="has no epochs.csv or steps.csv"):
        plot_curves(tmp_path / "empty", tmp_path / "e.png")
