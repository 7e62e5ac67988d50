"""QA of checkpoints, resume and the run's records as a long run meets them: a disk that fills up mid-save,
two runs on one checkpoint, a run started while another saves (the QA pass on checkpoints and records)."""
import errno
import os

import pytest
import torch

from fastdata import checkpoint as ckpt
from fastdata import fit, make_loader
from fastdata.datasets import SyntheticDigits
from fastdata.models import SmallCNN


def _loader(n=128, batch_size=32):
    return make_loader(SyntheticDigits(n, seed=0), "memory", batch_size=batch_size, device="cpu", seed=1)


def _fit(path, epochs, **kw):
    return fit(SmallCNN(width=4), _loader(), epochs=epochs, checkpoint=path, progress=False, amp="off",
               timing_warmup=0, **kw)


class _FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does (ENOSPC from write)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def test_a_disk_that_fills_up_mid_save_names_the_checkpoint_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    """torch.save on a full disk raised "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected
    pos 704 vs 598" (measured on a 64 KiB tmpfs): neither the file nor the disk named. It is the disk's
    OSError now, naming the checkpoint and saying the last good save is intact."""
    path = tmp_path / "c.pt"
    _fit(path, 1)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, _FullDisk(f, 4096)))
    with pytest.raises(OSError) as raised:
        _fit(path, 2, resume=True)
    assert raised.value.errno == errno.ENOSPC
    assert str(path) in str(raised.value) and "intact" in str(raised.value), raised.value
    monkeypatch.setattr(torch, "save", real_save)
    assert len(ckpt.load(path)["history"]) == 1                      # the last good save, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]   # no temporary, no lock left


def test_a_run_started_on_the_same_path_leaves_a_save_in_progress_alone(tmp_path, monkeypatch):
    """A run starting (prepare's clean_stale) while another saves to the same path removed the saver's
    temporary as a crashed save's, and the saver's os.replace failed: FileNotFoundError on a .tmp file."""
    path = tmp_path / "c.pt"
    ckpt.save({"w": torch.zeros(3)}, path)
    real_save = torch.save

    def another_run_starts_meanwhile(obj, f):
        real_save(obj, f)
        ckpt.prepare(path)

    monkeypatch.setattr(torch, "save", another_run_starts_meanwhile)
    ckpt.save({"w": torch.ones(3)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.equal(ckpt.load(path)["w"], torch.ones(3))
    ckpt.prepare(path)   # a crashed save's temporary (nobody holds it) is still removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_a_second_run_on_a_checkpoint_in_use_is_refused_naming_the_other(tmp_path):
    """Two runs given one checkpoint path each overwrote the other's saves, and the resume of either went
    on from whichever saved last. The second run is refused before it trains, naming the holder; the
    path is free again once the first run ends, or dies (the kernel drops its lock)."""
    path = tmp_path / "c.pt"
    other = ckpt.claim(path)            # another run, holding the path (a flock: per open file)
    with pytest.raises(ckpt.CheckpointInUse, match=f"pid {os.getpid()}") as raised:
        _fit(path, 1)
    assert str(path) in str(raised.value) and not path.exists()
    other.release()
    _fit(path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]    # the run removed its lock at its end
    dead = ckpt.claim(path)
    os.close(dead.fd)                   # a run killed: its lock file stays, unlocked
    dead.fd = None
    _fit(path, 2, resume=True)
    assert len(ckpt.load(path)["history"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_a_restart_without_resume_over_a_checkpoint_says_its_first_save_replaces_it(tmp_path, recwarn):
    """A job restarted without --resume trained from scratch and replaced days of training at its first
    save without a word. It still starts afresh (as asked), saying so before it trains."""
    path = tmp_path / "c.pt"
    _fit(path, 1)
    assert not [w for w in recwarn if "resume" in str(w.message)]   # nothing there yet: nothing to say
    with pytest.warns(RuntimeWarning, match="resume=False: this run starts from scratch and its first save "
                                            "replaces it") as warned:
        _fit(path, 1)
    assert str(path) in str(warned[0].message) and warned[0].filename == __file__


def _clipped_run(path, crash_after=None, resume=False):
    from engine_helpers import Recording

    torch.manual_seed(0)
    model = SmallCNN(width=4)
    loader = Recording(_loader(256), crash_after)
    history = fit(model, loader, epochs=2, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                  clip_grad_norm=1.0, checkpoint=path, checkpoint_every=3, resume=resume, progress=False,
                  amp="off", timing_warmup=0)
    return model, history


def test_a_resumed_epochs_grad_norm_is_the_whole_epochs_as_its_loss_is(tmp_path):
    """A mid-epoch resume carried the loss and accuracy sums of the batches before the crash, not the
    gradient norms: the resumed epoch's grad_norm was the mean of the steps after the resume alone."""
    from engine_helpers import Crash

    _, reference = _clipped_run(tmp_path / "ref.pt")
    with pytest.raises(Crash):
        _clipped_run(tmp_path / "c.pt", crash_after=13)   # the save at batch 12 is mid-epoch 2
    assert ckpt.load(tmp_path / "c.pt")["loader"]["batch"] == 4
    model, history = _clipped_run(tmp_path / "c.pt", resume=True)
    for key in ("train_loss", "grad_norm"):
        assert [r[key] for r in history] == pytest.approx([r[key] for r in reference], rel=1e-9), key


def test_a_second_run_logging_into_a_log_dir_in_use_is_refused_and_the_first_keeps_its_rows(tmp_path):
    """Two runs given one log_dir: the second's first write replaced the rows at or past its step (all
    of the first run's), then both appended, interleaved. The second is refused while the first logs."""
    import csv

    from fastdata.runlog import LogDirInUse, RunLog

    with RunLog(tmp_path, every_steps=1, tensorboard=False) as first:
        for step in range(1, 4):
            first.step(step, loss=1.0, lr=0.1, images_per_s=1.0, data_wait=0.0)
        with pytest.raises(LogDirInUse, match=f"in use by another run \\(pid {os.getpid()}"):
            _fit(tmp_path / "c.pt", 1, log_dir=tmp_path, log_every=1)
        first.step(4, loss=1.0, lr=0.1, images_per_s=1.0, data_wait=0.0)
    with open(tmp_path / "steps.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["1", "2", "3", "4"]
    RunLog(tmp_path, tensorboard=False)   # given up unclosed (a notebook's): the folder is free again
    import gc

    gc.collect()
    with RunLog(tmp_path, tensorboard=False):
        pass
    assert not (tmp_path / "runlog.lock").exists()


def test_a_row_cut_off_mid_write_is_dropped_not_glued_to_the_next_runs_first_row(tmp_path):
    """A run killed while it appended a row (or a full disk) left "6,0.9" without its line end; the
    resumed run's first row was appended onto it: one row "6,0.97,0.5,0.1,..." in place of step 7's."""
    import csv

    from fastdata.runlog import RunLog

    with RunLog(tmp_path, every_steps=1, tensorboard=False) as log:
        for step in range(1, 6):
            log.step(step, loss=1.0, lr=0.1, images_per_s=1.0, data_wait=0.0)
        log.epoch({"epoch": 1, "train_loss": 1.0})
    with open(tmp_path / "steps.csv", "a") as f:
        f.write("6,0.9")
    with open(tmp_path / "epochs.csv", "a") as f:
        f.write("2,0.")
    with RunLog(tmp_path, every_steps=1, tensorboard=False) as log:   # resumed past step 6's checkpoint
        log.step(7, loss=0.5, lr=0.1, images_per_s=1.0, data_wait=0.0)
        log.epoch({"epoch": 3, "train_loss": 0.5})
    with open(tmp_path / "steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert [(r["step"], r["loss"]) for r in steps][-2:] == [("5", "1.0"), ("7", "0.5")]
    assert all(None not in r and len(r) == 6 for r in steps)
    with open(tmp_path / "epochs.csv") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "3"]


def test_a_checkpoint_linked_to_another_disk_is_saved_there_and_stays_a_link(tmp_path):
    """``run/c.pt -> scratch/c.pt`` (a home quota, a big scratch disk): os.replace renamed over the link,
    so the first save replaced it with a file in run/ and the scratch copy stopped being written."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "run").mkdir()
    target, link = tmp_path / "scratch" / "c.pt", tmp_path / "run" / "c.pt"
    link.symlink_to(target)   # dangling until the first save
    _fit(link, 1)
    _fit(link, 2, resume=True)
    assert link.is_symlink() and len(ckpt.load(target)["history"]) == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["c.pt"]
    assert sorted(p.name for p in (tmp_path / "scratch").iterdir()) == ["c.pt"]
    other = ckpt.claim(target)   # another run, given the file itself: the same file, so refused
    with pytest.raises(ckpt.CheckpointInUse):
        _fit(link, 3, resume=True)
    other.release()


def test_a_checkpoint_this_user_may_not_read_is_named_so_not_called_corrupt():
    """torch.load's PermissionError was reported as "truncated or corrupt ... delete it to start afresh":
    advice to delete an intact checkpoint that was merely another user's. Run as uid nobody when root
    (``run_as_nobody``), against a root-owned folder, as test_checkpoint's unwritable-folder test does."""
    import shutil
    import tempfile

    from conftest import run_as_nobody

    base = tempfile.mkdtemp(prefix="fastdata-unreadable-")   # under /tmp, traversable by others
    try:
        os.chmod(base, 0o755)
        path = os.path.join(base, "c.pt")
        ckpt.save({"w": torch.ones(2)}, path)
        os.chmod(path, 0o000)
        with pytest.raises(ckpt.CheckpointError, match="cannot be read by this user") as raised:
            run_as_nobody(ckpt.load, path)
        assert path in str(raised.value) and "corrupt" not in str(raised.value)
    finally:
        shutil.rmtree(base)


def test_a_log_file_deleted_while_the_run_goes_on_comes_back_with_its_header(tmp_path):
    """steps.csv or epochs.csv removed during a run (a clean-up, a user resetting the curves): the next
    rows were appended to a new file without a header, which csv readers and plot_curves read as one."""
    import csv

    from fastdata.runlog import RunLog, plot_curves

    with RunLog(tmp_path, every_steps=1, tensorboard=False) as log:
        log.step(1, loss=1.0, lr=0.1, images_per_s=1.0, data_wait=0.0)
        log.epoch({"epoch": 1, "train_loss": 1.0})
        (tmp_path / "steps.csv").unlink()
        (tmp_path / "epochs.csv").unlink()
        log.step(2, loss=0.5, lr=0.1, images_per_s=1.0, data_wait=0.0)
        log.epoch({"epoch": 2, "train_loss": 0.5})
    with open(tmp_path / "steps.csv") as f:
        assert [(r["step"], r["loss"]) for r in csv.DictReader(f)] == [("2", "0.5")]
    with open(tmp_path / "epochs.csv") as f:
        assert [(r["epoch"], r["train_loss"]) for r in csv.DictReader(f)] == [("2", "0.5")]
    from conftest import require

    require("matplotlib")   # the dev extra: without it this skips naming it (it failed in plot_curves)
    assert plot_curves(tmp_path, tmp_path / "curves.png")["loss"] == ["step loss", "train loss"]


def test_a_trace_the_disk_had_no_room_for_is_said_and_its_cut_off_file_removed(tmp_path, monkeypatch):
    """On a full disk (a 64 KiB tmpfs) torch's profiler logged "Failed to write to log file!" from C++,
    naming nothing, raised nothing, and left a cut-off ``<trace>.pt.trace.json.tmp``; the run's table
    said nothing of a trace, and the user found none after the run. The export here does what kineto did
    there: the temporary, cut off, and no trace."""
    import warnings

    from fastdata.profiling import StepProfiler

    def export_that_runs_out_of_room(self, path, use_python_export=False):
        with open(path + ".tmp", "wb") as f:
            f.write(b'{"traceEvents": [' * 100)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export_that_runs_out_of_room)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with StepProfiler(tmp_path, wait=0, warmup=1, active=2, device="cpu", print_table=False) as prof:
            for _ in range(4):
                with prof.region("forward_backward"):
                    torch.randn(64, 64) @ torch.randn(64, 64)
                prof.step()
    said = [str(w.message) for w in caught if "could not be written" in str(w.message)]
    assert len(said) == 1 and str(tmp_path) in said[0], [str(w.message) for w in caught]
    assert prof.trace_files == [] and len(prof.rows) == 2 and list(tmp_path.iterdir()) == []


def test_a_run_log_the_disk_has_no_room_for_is_said_once_and_training_goes_on(tmp_path, monkeypatch):
    """A full disk under log_dir (64 KiB tmpfs: step 230 of a RunLog) raised "[Errno 28] No space left on
    device" out of fit, naming no file: a run of days ended by a CSV row, losing the hours since its last
    checkpoint. The log says so once and training goes on; once there is room the rows continue."""
    import builtins
    import csv
    import warnings

    real_open, full = builtins.open, {"on": False}

    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        if full["on"] and ".csv" in str(file) and mode[0] in "aw":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_on_a_full_disk)
    log_dir = tmp_path / "log"

    from fastdata.engine import loop

    real_batch_done = loop.RunHooks.batch_done

    def batch_done(self, batch, **kw):   # the disk fills up after the second batch's row
        real_batch_done(self, batch, **kw)
        full["on"] = batch >= 1

    monkeypatch.setattr(loop.RunHooks, "batch_done", batch_done)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(tmp_path / "c.pt", 1, log_dir=log_dir, log_every=1)
    said = [str(w.message) for w in caught if "RunLog: cannot write" in str(w.message)]
    assert len(history) == 1 and ckpt.load(tmp_path / "c.pt")["history"] == history   # trained and saved
    assert len(said) == 2 and all("No space left" in m for m in said), said   # steps.csv, epochs.csv: once each
    assert {p.name for p in log_dir.iterdir()} >= {"steps.csv"} and not list(log_dir.glob("*.tmp"))
    full["on"] = False
    from fastdata.runlog import RunLog

    with RunLog(log_dir, every_steps=1, tensorboard=False) as log:   # room again: the rows continue
        log.step(10, loss=1.0, lr=0.1, images_per_s=1.0, data_wait=0.0)
    with real_open(log_dir / "steps.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "10"]


def test_a_training_script_given_a_checkpoint_or_log_dir_in_use_ends_in_one_line(tmp_path):
    """The examples end a refused --checkpoint in one line (cli.fit_errors); another live run's
    --checkpoint or --log-dir is refused the same way, naming the flag."""
    import argparse

    from fastdata import cli
    from fastdata.runlog import RunLog

    args = argparse.Namespace(checkpoint=str(tmp_path / "c.pt"), checkpoint_every=None, resume=False)
    held = ckpt.claim(tmp_path / "c.pt")
    with pytest.raises(SystemExit, match=r"^error: --checkpoint: checkpoint '.*c\.pt' is in use by another run"):
        with cli.fit_errors(args):
            _fit(tmp_path / "c.pt", 1)
    held.release()
    with RunLog(tmp_path / "log", tensorboard=False):
        with pytest.raises(SystemExit, match=r"^error: --log-dir: RunLog: log_dir '.*log' is in use by another run"):
            with cli.fit_errors(args):
                _fit(tmp_path / "c.pt", 1, log_dir=tmp_path / "log")


def test_a_checkpoint_folder_without_room_for_the_weights_is_refused_before_any_training(tmp_path, monkeypatch):
    """A folder on a nearly full disk: the run trained its first epoch (hours, on a long run), then its
    first save failed. A folder with less room than the weights alone is refused before the first batch."""
    import collections
    import shutil

    from engine_helpers import Recording

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(10**9, 10**9 - 4096, 4096))
    loader = Recording(_loader())
    with pytest.raises(OSError, match=r"has 0\.0 MiB free and a checkpoint of this run takes at least") as raised:
        fit(SmallCNN(width=4), loader, epochs=1, checkpoint=tmp_path / "c.pt", progress=False)
    assert raised.value.errno == errno.ENOSPC and str(tmp_path / "c.pt") in str(raised.value)
    assert loader.seen == [] and not (tmp_path / "c.pt").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(10**9, 0, 10**9))
    fit(SmallCNN(width=4), loader, epochs=1, checkpoint=tmp_path / "c.pt", progress=False)   # room: it runs
    assert len(loader.seen) == 4


def test_a_newer_fastdatas_checkpoint_or_a_models_own_weights_say_what_to_do(tmp_path):
    """Both were "not a fastdata checkpoint this version reads (format None; reads [...])": a model's
    torch.save(model.state_dict()) (the file most often given as --checkpoint) and a newer version's
    checkpoint say what they are and the way on."""
    weights = tmp_path / "weights.pt"
    torch.save(SmallCNN(width=4).state_dict(), weights)
    with pytest.raises(ckpt.CheckpointError, match=r"like a model's state_dict.*model\.load_state_dict"):
        _fit(weights, 1, resume=True)
    newer = tmp_path / "newer.pt"
    _fit(newer, 1)
    state = ckpt.load(newer)
    state["format"] = "fastdata-checkpoint-10"
    ckpt.save(state, newer)
    with pytest.raises(ckpt.CheckpointError, match="written by a newer fastdata"):
        _fit(newer, 2, resume=True)
