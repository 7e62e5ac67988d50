"""Tests of checkpoints and resume (fastdata/engine/state.py)."""
import math

import pytest
import torch
from torch import nn

from engine_helpers import BACKENDS, Crash, ListLoader, Recording, _batches, _params
from fastdata import Augmentation, make_loader
from fastdata import checkpoint as ckpt
from fastdata.datasets import ArraySource, SyntheticDigits
from fastdata.engine import (
    CHECKPOINT_FORMAT,
    fit,
)
from fastdata.models import SmallCNN


def _run(train, backend, workers, path, *, crash_after=None, resume=False, init_seed=0, every=None,
         device="cpu", amp="auto"):
    torch.manual_seed(init_seed)
    model = SmallCNN(width=8)
    loader = Recording(make_loader(train, backend, batch_size=64, num_workers=workers, device=device, seed=3),
                       crash_after)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, epochs=2, steps_per_epoch=len(loader))
    history = fit(model, loader, epochs=2, optimizer=opt, scheduler=sched, checkpoint=path, resume=resume,
                  checkpoint_every=every, progress=False, amp=amp)
    return model, loader, history


RESUME_CASES = [("torch", 0, 4), ("torch", 0, 13), ("torch", 2, 13)] + \
               [(b, 0, 13) for b in BACKENDS if b != "torch"]


@pytest.mark.parametrize("backend, workers, k", RESUME_CASES)
def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tmp_path, backend, workers, k):
    train = SyntheticDigits(640, train=True, seed=5)   # 10 batches of 64 per epoch, 20 in the run
    ref_model, ref_loader, ref_hist = _run(train, backend, workers, tmp_path / "ref.pt", every=k)
    # Crash two batches after the step-k checkpoint: the work after the last checkpoint is redone.
    with pytest.raises(Crash):
        _run(train, backend, workers, tmp_path / "c.pt", crash_after=k + 2, every=k)
    state = ckpt.load(tmp_path / "c.pt")
    # One record of the position: the loader's.
    assert "epoch" not in state and "step" not in state and "global_step" not in state
    assert state["format"] == CHECKPOINT_FORMAT
    assert (state["loader"]["epoch"], state["loader"]["batch"]) == divmod(k, 10)
    model, loader, hist = _run(train, backend, workers, tmp_path / "c.pt", resume=True, init_seed=99, every=k)
    assert len(loader.seen) == 20 - k
    assert all(torch.equal(a, b) for a, b in zip(loader.seen, ref_loader.seen[k:]))
    ref, got = ref_model.state_dict(), model.state_dict()
    assert all(torch.equal(ref[name], got[name]) for name in ref), "weights differ from the uninterrupted run"
    assert [r["epoch"] for r in hist] == [1, 2]
    # The half-done epoch's figures carry over, so the resumed epoch reports the whole epoch.
    assert hist[-1]["train_loss"] == pytest.approx(ref_hist[-1]["train_loss"], rel=1e-9)
    assert hist[-1]["train_accuracy"] == pytest.approx(ref_hist[-1]["train_accuracy"])


def test_checkpoint_loads_weights_only_and_stale_temporaries_are_cleaned(tmp_path, capsys):
    path = tmp_path / "run.pt"
    stale = tmp_path / "run.pt.tmp.k1ll3d"
    stale.write_bytes(b"left by a crash")
    train = SyntheticDigits(256, seed=6)
    model, _, hist = _run(train, "torch", 0, path)
    assert not stale.exists()
    state = torch.load(path, weights_only=True)   # OneCycleLR, SGD, scaler, RNG: all plain types
    assert state["loader"]["epoch"] == 2 and state["loader"]["batch"] == 0
    assert state["scheduler"]["last_epoch"] == 2 * 4
    assert state["history"] == hist
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state["model"].items())

    # Resuming a finished run trains nothing and returns the saved history.
    capsys.readouterr()
    again, loader, hist2 = _run(train, "torch", 0, path, resume=True, init_seed=7)
    assert loader.seen == [] and hist2 == hist
    out = capsys.readouterr().out
    assert "holds a finished run (2 epoch(s), epochs=2): nothing left to train" in out and "resumed" not in out
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in state["model"].items())


def test_resume_without_a_checkpoint_starts_fresh(tmp_path, capsys):
    _, loader, hist = _run(SyntheticDigits(256, seed=6), "torch", 0, tmp_path / "none.pt", resume=True)
    assert len(hist) == 2 and len(loader.seen) == 8
    assert "starting from scratch" in capsys.readouterr().out
    assert (tmp_path / "none.pt").exists()


def test_evaluating_on_the_training_loader_keeps_the_saved_position(tmp_path):
    """fit(eval_loader=train_loader): evaluation iterates the same loader and used to move the saved
    position a whole epoch on, so a resume skipped an epoch (history [1, 3])."""
    src = SyntheticDigits(128, seed=8)

    def run(epochs, resume):
        loader = make_loader(src, "torch", batch_size=64, num_workers=0, device="cpu")
        return fit(SmallCNN(width=4), loader, epochs=epochs, eval_loader=loader, checkpoint=tmp_path / "c.pt",
                   resume=resume, progress=False)

    run(1, False)
    assert ckpt.load(tmp_path / "c.pt")["loader"]["epoch"] == 1
    assert [r["epoch"] for r in run(3, True)] == [1, 2, 3]


def test_an_unusable_checkpoint_path_is_refused_before_training(tmp_path):
    loader = ListLoader(_batches(2))
    (tmp_path / "runs").mkdir()
    with pytest.raises(IsADirectoryError, match=r"checkpoint path '.*runs' is a directory"):
        fit(SmallCNN(width=4), loader, epochs=1, checkpoint=tmp_path / "runs", progress=False)
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(OSError, match=r"cannot create the folder '.*blocker' for checkpoint"):
        fit(SmallCNN(width=4), loader, epochs=1, checkpoint=tmp_path / "blocker" / "c.pt", progress=False)
    assert loader.iters == 0  # found before the first epoch, not after it
    fit(SmallCNN(width=4), loader, epochs=1, checkpoint=tmp_path / "new" / "deeper" / "c.pt", progress=False)
    assert (tmp_path / "new" / "deeper" / "c.pt").is_file()


def _flip_a_tensor_byte(data: bytes) -> bytes:
    """``data`` (a torch.save zip archive) with one byte of its largest tensor's storage inverted."""
    import io
    import struct
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        entry = max(archive.infolist(), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[entry.header_offset + 26: entry.header_offset + 30])
    at = entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


@pytest.mark.parametrize("damage", ["truncated", "empty", "corrupt"])
def test_resuming_from_a_damaged_checkpoint_names_it(tmp_path, damage):
    """"corrupt": one flipped byte in a weight. torch.load does not check the archive's CRCs, so the
    run resumed from the damaged weights without a word."""
    path = tmp_path / "c.pt"
    fit(SmallCNN(width=4), ListLoader(_batches(2)), epochs=1, checkpoint=path, progress=False)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                      "corrupt": _flip_a_tensor_byte(data)}[damage])
    loader = ListLoader(_batches(2))
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint '.*c.pt'.* is {damage}"):
        fit(SmallCNN(width=4), loader, epochs=2, checkpoint=path, resume=True, progress=False)
    assert loader.iters == 0


@pytest.mark.cuda
def test_fp16_resume_restores_the_loss_scale(tmp_path, monkeypatch):
    scalers = []

    class Recorded(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scalers.append(self)

    monkeypatch.setattr(torch.amp, "GradScaler", Recorded)
    train = SyntheticDigits(640, train=True, seed=5)
    path = tmp_path / "c.pt"
    with pytest.raises(Crash):
        _run(train, "torch", 0, path, crash_after=6, every=4, device="cuda", amp="fp16")
    state = ckpt.load(path)
    assert state["amp"] == "fp16" and state["scaler"]["scale"] > 0
    # A scale no fresh scaler starts at: resuming must bring it back, not start at 65536 again.
    state["scaler"]["scale"] = 512.0
    ckpt.save(state, path)
    _, loader, hist = _run(train, "torch", 0, path, resume=True, every=4, device="cuda", amp="fp16")
    assert len(loader.seen) == 20 - 4 and math.isfinite(hist[-1]["train_loss"])
    assert scalers[-1].get_scale() == 512.0


@pytest.mark.cuda
def test_a_gpu_checkpoint_loads_and_resumes_on_the_cpu(tmp_path):
    train = SyntheticDigits(640, train=True, seed=5)
    path = tmp_path / "c.pt"
    with pytest.raises(Crash):
        _run(train, "torch", 0, path, crash_after=6, every=4, device="cuda")

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    state = torch.load(path, map_location="cpu", weights_only=True)
    assert all(t.device.type == "cpu" for t in tensors(ckpt.load(path, map_location="cpu")))
    assert any(t.is_floating_point() for t in tensors(state["model"]))
    with pytest.warns(UserWarning, match="checkpoint was trained with amp="):
        model, loader, hist = _run(train, "torch", 0, path, resume=True, every=4, device="cpu", amp="off")
    assert len(loader.seen) == 20 - 4 and [r["epoch"] for r in hist] == [1, 2]
    assert all(p.device.type == "cpu" for p in model.parameters()) and math.isfinite(hist[-1]["train_loss"])


def test_a_format_1_checkpoint_still_resumes(tmp_path):
    """Format 1 kept the position twice (``global_step`` beside the loader's); it must still resume,
    from the loader's record, to the same weights as an uninterrupted run."""
    batches = _batches(3)
    torch.manual_seed(0)
    ref = SmallCNN(width=4)
    fit(ref, ListLoader(batches), epochs=2, progress=False)
    path = tmp_path / "c.pt"
    torch.manual_seed(0)
    fit(SmallCNN(width=4), ListLoader(batches), epochs=1, checkpoint=path, progress=False)
    state = ckpt.load(path)
    ckpt.save({**state, "format": "fastdata-checkpoint-1", "global_step": 3}, path)
    torch.manual_seed(5)
    model, loader = SmallCNN(width=4), ListLoader(batches)
    hist = fit(model, loader, epochs=2, checkpoint=path, resume=True, progress=False)
    assert [r["epoch"] for r in hist] == [1, 2] and loader.iters == 1
    assert torch.equal(_params(model), _params(ref))


def test_a_checkpoint_of_an_unknown_format_is_refused_with_the_formats_read(tmp_path):
    path = tmp_path / "c.pt"
    fit(SmallCNN(width=4), ListLoader(_batches(1)), epochs=1, checkpoint=path, progress=False)
    ckpt.save({**ckpt.load(path), "format": "fastdata-checkpoint-9"}, path)
    loader = ListLoader(_batches(1))
    with pytest.raises(ValueError, match=r"c.pt' is not a fastdata checkpoint this version reads \(format "
                                         r"'fastdata-checkpoint-9'; reads \['fastdata-checkpoint-1', "
                                         r"'fastdata-checkpoint-2'\]\)"):
        fit(SmallCNN(width=4), loader, epochs=2, checkpoint=path, resume=True, progress=False)
    assert loader.iters == 0


def test_resuming_on_another_dataset_is_a_resume_error_naming_the_checkpoint(tmp_path):
    """A CheckpointError (ResumeError): the examples turn it into one line instead of a traceback."""
    import numpy as np

    def loader(seed):
        images = np.random.default_rng(seed).integers(0, 256, (32, 8, 8), dtype=np.uint8)
        return make_loader(ArraySource(images, np.arange(32) % 4), "memory", batch_size=8, device="cpu",
                           augment=Augmentation.none())

    path = tmp_path / "c.pt"
    fit(nn.Sequential(nn.Flatten(1), nn.Linear(64, 4)), loader(0), epochs=1, checkpoint=path, progress=False)
    with pytest.raises(ckpt.ResumeError, match=r"'.*c.pt' cannot resume this run: source was ") as info:
        fit(nn.Sequential(nn.Flatten(1), nn.Linear(64, 4)), loader(1), epochs=2, checkpoint=path, resume=True,
            progress=False)
    assert issubclass(ckpt.ResumeError, ckpt.CheckpointError)
    # fit's advice, not the loader's: set_epoch() is not something a run resumed by fit can act on.
    assert "set_epoch" not in str(info.value) and "start a new run (resume=False)" in str(info.value)


def test_a_position_of_a_newer_loader_state_format_is_refused_before_anything_is_restored(tmp_path):
    """The checkpoint's format is this version's, its loader position a newer fastdata's: refused as a
    ResumeError naming both formats and the upgrade, before the model is touched."""
    import numpy as np

    def loader():
        images = np.random.default_rng(0).integers(0, 256, (32, 8, 8), dtype=np.uint8)
        return make_loader(ArraySource(images, np.arange(32) % 4), "memory", batch_size=8, device="cpu",
                           augment=Augmentation.none())

    path = tmp_path / "c.pt"
    fit(nn.Sequential(nn.Flatten(1), nn.Linear(64, 4)), loader(), epochs=1, checkpoint=path, progress=False)
    state = ckpt.load(path)
    assert state["loader"]["format"] == 2   # saved in the checkpoint as the loader wrote it
    ckpt.save({**state, "loader": {**state["loader"], "format": 3}}, path)
    model = nn.Sequential(nn.Flatten(1), nn.Linear(64, 4))
    before = _params(model).clone()
    with pytest.raises(ckpt.ResumeError, match=r"c.pt' cannot resume this run: loader state 'format' is 3, "
                                               r"written by a newer fastdata.*formats 1 to 2.*Upgrade fastdata"):
        fit(model, loader(), epochs=2, checkpoint=path, resume=True, progress=False)
    assert torch.equal(_params(model), before)


def _saved_run(path, model=None, optimizer=None):
    model = model or SmallCNN(width=4)
    fit(model, ListLoader(_batches(2)), epochs=1, checkpoint=path, optimizer=optimizer, progress=False)
    return model


def _resume(path, model, loader=None, **kwargs):
    return fit(model, loader or ListLoader(_batches(2)), epochs=2, checkpoint=path, resume=True, progress=False,
               **kwargs)


def test_a_file_that_is_not_a_whole_fastdata_checkpoint_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "c.pt"
    torch.save(SmallCNN(width=4).state_dict(), path)   # a plain state_dict, as torch users save them
    with pytest.raises(ckpt.CheckpointError, match=r"c.pt' is not a fastdata checkpoint this version reads "
                                                   r"\(format None"):
        _resume(path, SmallCNN(width=4))
    _saved_run(path)
    state = ckpt.load(path)
    del state["optimizer"]
    ckpt.save(state, path)
    with pytest.raises(ckpt.CheckpointError, match=r"c.pt' is a fastdata-checkpoint-2 checkpoint without "
                                                   r"\['optimizer'\]"):
        _resume(path, SmallCNN(width=4))


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_before_anything_is_restored(tmp_path):
    path = tmp_path / "c.pt"
    _saved_run(path)                                      # SmallCNN(width=4), fit's AdamW
    wider = SmallCNN(width=8)
    before = _params(wider).clone()
    with pytest.raises(ckpt.ResumeError, match=r"holds the weights of another model than SmallCNN: \d+ of another "
                                               r"shape \(.*\(4, 1, 3, 3\) saved, \(8, 1, 3, 3\) here"):
        _resume(path, wider)
    assert torch.equal(_params(wider), before)
    other = nn.Sequential(nn.Flatten(1), nn.Linear(256, 10))
    with pytest.raises(ckpt.ResumeError, match=r"another model than Sequential: 2 missing \(1.weight, 1.bias\); "
                                               r"\d+ unexpected"):
        _resume(path, other)
    model = SmallCNN(width=4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = _params(model).clone()
    # Before: accepted, then the first step died inside torch with KeyError: 'momentum'.
    with pytest.raises(ckpt.ResumeError, match=r"was trained with a AdamW optimizer; this run's is SGD"):
        _resume(path, model, optimizer=sgd)
    assert torch.equal(_params(model), before) and sgd.state_dict()["state"] == {}


def test_a_refused_position_leaves_the_model_and_optimizer_as_they_were(tmp_path):
    """The loader refuses the position (another dataset here) before the model or optimizer is touched."""
    path = tmp_path / "c.pt"
    _saved_run(path)

    class OtherData(ListLoader):
        def load_state_dict(self, state):
            raise ValueError("seed was 0 and is now 1")

    model = SmallCNN(width=4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    before = _params(model).clone()
    with pytest.raises(ckpt.ResumeError, match=r"c.pt' cannot resume this run: seed was 0 and is now 1"):
        _resume(path, model, loader=OtherData(_batches(2)), optimizer=opt)
    assert torch.equal(_params(model), before)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.state_dict()["state"] == {}


def test_resuming_under_another_peak_lr_is_refused_before_anything_is_restored(tmp_path):
    """Loading the optimizer restores each group's max_lr: a resumed run given OneCycleLR(max_lr=0.5)
    trained on at the saved 0.1 without a word. Refused now, naming both rates, with the model as it was;
    the same rate resumes."""
    from fastdata.engine.schedule import PeakLrChanged

    def run(max_lr, resume):
        model = SmallCNN(width=4)
        optimizer = torch.optim.SGD(model.parameters(), lr=max_lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=4)
        return model, lambda: fit(model, ListLoader(_batches(2)), epochs=2, optimizer=optimizer,
                                  scheduler=scheduler, checkpoint=tmp_path / "c.pt", resume=resume, progress=False)

    _, first = run(0.1, False)
    first()
    model, again = run(0.5, True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PeakLrChanged, match=r"schedule peaks at lr 0\.1, .* this run's 0\.5 would be ignored. "
                                            r"Resume with max_lr=0\.1, or start a new run \(resume=False\)") as info:
        again()
    assert (info.value.was, info.value.now) == (0.1, 0.5) and isinstance(info.value, ckpt.ResumeError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    run(0.1, True)[1]()   # the saved rate: resumes


def test_a_changed_lr_without_a_scheduler_is_not_judged(tmp_path):
    """Without a scheduler the groups hold no peak (max_lr/initial_lr), only the rate the saved run had
    reached, which a decay of the user's own may have lowered: not a changed setting, so not refused."""
    for lr, resume in ((0.1, False), (0.01, True)):
        model = SmallCNN(width=4)
        fit(model, ListLoader(_batches(2)), epochs=1 + resume, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            checkpoint=tmp_path / "c.pt", resume=resume, progress=False)
