"""Upgrading fastdata mid-project: what an older release wrote, this version reads or refuses clearly.

The fixtures under ``tests/data/upgrade/<revision>/`` were written by older revisions of this repository
(``make_fixture.py`` there; its README says which and how): a checkpoint that ``fit`` saved mid-epoch
before the run was killed, the weights the uninterrupted run ended on, every backend's loader
``state_dict`` after two batches, a ``fastdata.pack`` folder and the run log of the killed run. This
version must resume each exactly (same weights, learning rate, samples) or refuse it naming what changed:
never a KeyError/TypeError, never a silent wrong resume.
"""
from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import require
from fastdata import make_loader
from fastdata.datasets import Shards, SyntheticDigits

DATA = Path(__file__).parent / "data" / "upgrade"
sys.path.insert(0, str(DATA))
from upgrade_run import BACKENDS, loader_args, run  # noqa: E402

#: The revisions that wrote the fixtures, oldest first (README.md there).
REVISIONS = ("8b022e1", "effeab8", "b7af964", "0a8b2c5")


def _expect(rev: str) -> dict:
    return json.loads((DATA / rev / "expect.json").read_text())


@pytest.mark.parametrize("rev", REVISIONS)
def test_old_checkpoint_resumes_to_the_uninterrupted_runs_weights(rev, tmp_path, capsys):
    shutil.copy(DATA / rev / "mid.pt", tmp_path / "mid.pt")
    log_dir = None
    if (DATA / rev / "runlog").is_dir():
        log_dir = tmp_path / "runlog"
        shutil.copytree(DATA / rev / "runlog", log_dir)
    # Another global seed than the old run's: the checkpoint's RNG states (dropout) must win.
    history, model = run(tmp_path / "mid.pt", resume=True, log_dir=log_dir, seed=123)
    assert "epoch 1, batch 4/6" in capsys.readouterr().out   # resumed where it was saved, not from scratch
    want = torch.load(DATA / rev / "full_weights.pt", weights_only=True)
    for name, value in model.state_dict().items():
        # Not bit for bit: the fixtures were written on another CPU, and torch's CPU kernels sum in another
        # order under AVX-512 than under AVX2 (2e-8 apart on this model, measured). atol is 50x that, and
        # still tight: a 1e-5 offset of one weight at the checkpoint comes through to the end unchanged.
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{rev}: {name} differs from the uninterrupted old "
                                                            f"run's: {m}")
    assert len(history) == 2 and history[-1]["lr"] == pytest.approx(4e-7)   # OneCycleLR's end, stepped 12 times
    if log_dir is not None:
        # The killed run logged steps 0-5, its checkpoint is at step 4: the resumed log holds each step once.
        with open(log_dir / "steps.csv", newline="") as f:
            steps = [int(row["step"]) for row in csv.DictReader(f)]
        assert steps == list(range(12))
        with open(log_dir / "epochs.csv", newline="") as f:
            assert [row["epoch"] for row in csv.DictReader(f)] == ["1", "2"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rev", REVISIONS)
def test_old_loader_state_resumes_the_same_samples(rev, backend):
    if backend == "dali":
        require("nvidia.dali")
    states = torch.load(DATA / rev / "loader_states.pt", weights_only=True)
    expect = _expect(rev)["loaders"][backend]
    loader = make_loader(SyntheticDigits(48, seed=2), backend=backend, **loader_args(backend))
    try:
        loader.load_state_dict(states[backend])
        assert [y.tolist() for _, y in loader] == expect["rest"]
        assert [y.tolist() for _, y in loader] == expect["next_epoch"]
    finally:
        loader.close()


@pytest.mark.parametrize("rev", [r for r in REVISIONS if (DATA / r / "packed").is_dir()])
def test_old_pack_reads_the_same_samples(rev):
    expect = _expect(rev)["loaders"]["shards"]
    shards = Shards(DATA / rev / "packed")
    assert [int(y) for y in shards.labels] == expect["labels"]
    assert len(shards) == 12 and shards.num_classes == 10


def test_old_pack_position_resumes():
    """0a8b2c5's pack records the images' shape (an array pack): its position resumes exactly."""
    rev = "0a8b2c5"
    expect = _expect(rev)["loaders"]["shards"]
    shards = Shards(DATA / rev / "packed")
    assert shards.fingerprint() == expect["fingerprint"]
    loader = make_loader(shards, backend="torch", batch_size=4, device="cpu", seed=1, num_workers=0)
    loader.load_state_dict(torch.load(DATA / rev / "loader_states.pt", weights_only=True)["shards"])
    assert [y.tolist() for _, y in loader] == expect["rest"]


def test_pack_position_saved_before_the_window_was_recorded_resumes_under_the_default_window():
    """b7af964's Shards fingerprint had no ``window=`` (added in b328565): its pack of digits (an index
    without the image shape, read as photos) is ordered by a window the position does not say. Under the
    default window, the only one a run could have had without setting it, it resumes exactly, with a
    warning saying what was assumed (it was refused, naming a window the user never set)."""
    rev = "b7af964"
    expect = _expect(rev)["loaders"]["shards"]
    state = torch.load(DATA / rev / "loader_states.pt", weights_only=True)["shards"]
    loader = make_loader(Shards(DATA / rev / "packed"), backend="torch", batch_size=4, device="cpu", seed=1,
                         num_workers=0)
    with pytest.warns(RuntimeWarning, match="older fastdata.*window=4"):
        loader.load_state_dict(state)
    assert [y.tolist() for _, y in loader] == expect["rest"]


def test_pack_position_saved_before_the_window_was_recorded_is_refused_under_another_window():
    """Under a window the user set, the old position's order is not known: refused, naming the window."""
    from fastdata.errors import PositionMismatch

    rev = "b7af964"
    loader = make_loader(Shards(DATA / rev / "packed", window=2), backend="torch", batch_size=4, device="cpu",
                         seed=1, num_workers=0)
    with pytest.raises(PositionMismatch, match="window=2"):
        loader.load_state_dict(torch.load(DATA / rev / "loader_states.pt", weights_only=True)["shards"])


@pytest.mark.parametrize("rev", REVISIONS)
def test_old_checkpoint_under_another_peak_rate_is_refused_naming_it(rev, tmp_path):
    """PeakLrChanged came after these checkpoints; it reads their optimizer state as they wrote it."""
    from upgrade_run import Tiny

    from fastdata import fit
    from fastdata.engine.schedule import PeakLrChanged

    shutil.copy(DATA / rev / "mid.pt", tmp_path / "mid.pt")
    model = Tiny()
    train = make_loader(SyntheticDigits(96, seed=1), backend="memory", batch_size=16, device="cpu", seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=12)
    with pytest.raises(PeakLrChanged, match="max_lr=0.1"):
        fit(model, train, epochs=2, optimizer=opt, scheduler=sched, scheduler_interval="step",
            checkpoint=tmp_path / "mid.pt", resume=True, progress=False)


@pytest.mark.parametrize("rev", REVISIONS)
def test_old_loader_state_resumes_under_another_batch_size(rev):
    """Elastic resume of an old position: the samples left are re-split, each read once."""
    state = torch.load(DATA / rev / "loader_states.pt", weights_only=True)["memory"]
    left = sorted(y for batch in _expect(rev)["loaders"]["memory"]["rest"] for y in batch)
    loader = make_loader(SyntheticDigits(48, seed=2), backend="memory", **{**loader_args("memory"), "batch_size": 4})
    loader.load_state_dict(state)
    assert sorted(y for _, labels in loader for y in labels.tolist()) == left


@pytest.mark.parametrize("rev", [r for r in REVISIONS if (DATA / r / "runlog").is_dir()])
def test_old_run_log_plots(rev, tmp_path):
    require("matplotlib")
    from fastdata.runlog import plot_curves

    shutil.copytree(DATA / rev / "runlog", tmp_path / "log")
    drawn = plot_curves(tmp_path / "log", tmp_path / "curves.png")
    assert drawn["loss"] and (tmp_path / "curves.png").stat().st_size > 0
