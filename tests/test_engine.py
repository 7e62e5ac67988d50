import math

import pytest
import torch
from torch import nn

from fastdata import available_backends, make_loader
from fastdata import checkpoint as ckpt
from fastdata.datasets import ArraySource, SyntheticDigits
from fastdata.engine import _idle_fraction, choose_amp, evaluate, fit, resolve_amp, summarize
from fastdata.models import SmallCNN

BACKENDS = [b for b in available_backends() if b != "auto"]
RECORD_KEYS = {"epoch", "train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "images_per_second",
               "data_wait_fraction", "gpu_idle_fraction", "peak_memory_mb", "seconds"}


@pytest.fixture(scope="module")
def digits():
    return SyntheticDigits(4096, train=True, seed=1), SyntheticDigits(512, train=False, seed=1)


class Crash(Exception):
    pass


class Recording:
    """Passes the loader contract through, records the labels of every batch handed out, and raises
    Crash instead of handing out batch number ``crash_after`` + 1 (counted over the whole run)."""

    def __init__(self, loader, crash_after=None):
        self.loader, self.device, self.crash_after, self.seen = loader, loader.device, crash_after, []

    def __len__(self):
        return len(self.loader)

    def set_epoch(self, epoch):
        self.loader.set_epoch(epoch)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)

    def __iter__(self):
        it = iter(self.loader)
        while True:
            if self.crash_after is not None and len(self.seen) >= self.crash_after:
                raise Crash
            try:
                images, labels = next(it)
            except StopIteration:
                return
            self.seen.append(labels.clone())
            yield images, labels


# ------------------------------------------------------------------------------------------- AMP
@pytest.mark.parametrize("amp, device, bf16, expected", [
    ("auto", "cpu", False, "off"),
    ("auto", "cpu", True, "off"),        # bf16 autocast is slower than fp32 on CPUs without AMX
    ("auto", "cuda", True, "bf16"),
    ("auto", "cuda", False, "fp16"),     # pre-Ampere GPUs: fp16 with loss scaling
    ("bf16", "cuda", False, "bf16"),     # forced choices are honoured
    ("fp16", "cuda", True, "fp16"),
    ("off", "cuda", True, "off"),
    ("bf16", "cpu", False, "bf16"),
])
def test_choose_amp(amp, device, bf16, expected):
    assert choose_amp(amp, device, bf16) == expected


def test_invalid_amp_lists_choices():
    with pytest.raises(ValueError, match=r"unknown amp 'fp8'; choose from \['auto', 'bf16', 'fp16', 'off'\]"):
        choose_amp("fp8", "cuda", True)
    assert resolve_amp("auto", torch.device("cpu")) == "off"


class AutocastProbe(nn.Module):
    """Records whether autocast was on, and with which dtype, when forward ran."""

    def __init__(self):
        super().__init__()
        self.net = SmallCNN(width=4)
        self.seen = set()

    def forward(self, x):
        on = torch.is_autocast_enabled("cpu")
        self.seen.add((on, torch.get_autocast_dtype("cpu") if on else None))
        return self.net(x).float()


@pytest.mark.parametrize("amp, expected", [("auto", (False, None)), ("off", (False, None)),
                                           ("bf16", (True, torch.bfloat16)), ("fp16", (True, torch.float16))])
def test_fit_applies_the_amp_choice(amp, expected):
    src = SyntheticDigits(128, train=True, seed=2)
    model = AutocastProbe()
    hist = fit(model, make_loader(src, "torch", batch_size=64, num_workers=0, device="cpu"), epochs=1,
               amp=amp, progress=False)
    assert model.seen == {expected}
    assert math.isfinite(hist[0]["train_loss"])


# ------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_fit_learns_synthetic_digits(backend, digits):
    train, test = digits
    torch.manual_seed(0)
    loader = make_loader(train, backend, batch_size=64, num_workers=0, device="cpu")
    eval_loader = make_loader(test, backend, batch_size=256, train=False, num_workers=0, device="cpu")
    model = SmallCNN(width=16)
    history = fit(model, loader, epochs=3, eval_loader=eval_loader, progress=False,
                  optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    assert [r["epoch"] for r in history] == [1, 2, 3]
    for r in history:
        assert set(r) == RECORD_KEYS
        assert 0.0 <= r["data_wait_fraction"] <= 1.0
        assert r["gpu_idle_fraction"] is None  # CPU
        assert r["images_per_second"] > 0 and r["seconds"] > 0 and r["peak_memory_mb"] > 0
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["eval_accuracy"] > 0.5, history  # chance is 0.1


def test_evaluate_is_exact_and_restores_mode():
    labels = torch.arange(50) % 10                     # five of each digit
    src = ArraySource(torch.zeros(50, 8, 8, dtype=torch.uint8), labels, mean=(0.0,), std=(1.0,))

    class AlwaysZero(nn.Module):
        def forward(self, x):
            logits = torch.zeros(x.shape[0], 10)
            logits[:, 0] = 1.0
            return logits

    model = AlwaysZero().train()
    loader = make_loader(src, "torch", batch_size=16, train=False, num_workers=0, device="cpu")
    result = evaluate(model, loader)
    assert result["samples"] == 50
    assert result["accuracy"] == pytest.approx(0.1)
    right, wrong = -math.log(math.e / (math.e + 9)), -math.log(1 / (math.e + 9))
    assert result["loss"] == pytest.approx(0.1 * right + 0.9 * wrong)
    assert model.training


def test_no_host_sync_per_step(digits, monkeypatch):
    """Reading a device value (.item(), .tolist()) inside the step would stall a GPU every step: the
    number of reads must not grow with the number of steps."""
    counts = []
    for n in (256, 768):
        calls = [0]
        for name in ("item", "tolist"):
            real = getattr(torch.Tensor, name)

            def counted(self, *a, _real=real, **k):
                calls[0] += 1
                return _real(self, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
        model = SmallCNN(width=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loader = make_loader(SyntheticDigits(n, seed=3), "torch", batch_size=64, num_workers=0, device="cpu")
        fit(model, loader, epochs=1, optimizer=opt, progress=False)
        monkeypatch.undo()
        counts.append(calls[0])
    assert counts[0] == counts[1], counts


def test_idle_fraction_from_event_pairs():
    class Ev:
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):
            return other.t - self.t

    starts, ends = [Ev(0), Ev(10), Ev(25)], [Ev(8), Ev(20), Ev(30)]
    assert _idle_fraction(starts, ends) == pytest.approx((2 + 5) / 30)
    assert _idle_fraction([], []) is None


def test_summarize_weights_by_time():
    h = [{"seconds": 1.0, "images_per_second": 100.0, "data_wait_fraction": 0.5, "gpu_idle_fraction": None,
          "peak_memory_mb": 10.0, "train_loss": 1.0, "eval_accuracy": 0.5},
         {"seconds": 3.0, "images_per_second": 200.0, "data_wait_fraction": 0.1, "gpu_idle_fraction": None,
          "peak_memory_mb": 30.0, "train_loss": 0.5, "eval_accuracy": 0.9}]
    s = summarize(h)
    assert s["train_seconds"] == 4.0
    assert s["images_per_second"] == pytest.approx(175.0)
    assert s["data_wait_fraction"] == pytest.approx(0.2)
    assert s["gpu_idle_fraction"] is None and s["peak_memory_mb"] == 30.0 and s["test_accuracy"] == 0.9


@pytest.mark.parametrize("kwargs, match", [({"epochs": -1}, "epochs"), ({"epochs": 1, "resume": True}, "checkpoint"),
                                           ({"epochs": 1, "amp": "fp32"}, "choose from"),
                                           ({"epochs": 1, "checkpoint_every": 0}, "checkpoint_every")])
def test_fit_rejects_bad_arguments(kwargs, match):
    loader = make_loader(SyntheticDigits(64, seed=4), "torch", batch_size=32, num_workers=0, device="cpu")
    with pytest.raises(ValueError, match=match):
        fit(SmallCNN(width=4), loader, progress=False, **kwargs)


# ---------------------------------------------------------------------------------- checkpoints
def _run(train, backend, workers, path, *, crash_after=None, resume=False, init_seed=0, every=None):
    torch.manual_seed(init_seed)
    model = SmallCNN(width=8)
    loader = Recording(make_loader(train, backend, batch_size=64, num_workers=workers, device="cpu", seed=3),
                       crash_after)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, epochs=2, steps_per_epoch=len(loader))
    history = fit(model, loader, epochs=2, optimizer=opt, scheduler=sched, checkpoint=path, resume=resume,
                  checkpoint_every=every, progress=False)
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
    assert (state["epoch"], state["step"]) == divmod(k, 10)
    model, loader, hist = _run(train, backend, workers, tmp_path / "c.pt", resume=True, init_seed=99, every=k)
    assert len(loader.seen) == 20 - k
    assert all(torch.equal(a, b) for a, b in zip(loader.seen, ref_loader.seen[k:]))
    ref, got = ref_model.state_dict(), model.state_dict()
    assert all(torch.equal(ref[name], got[name]) for name in ref), "weights differ from the uninterrupted run"
    assert [r["epoch"] for r in hist] == [1, 2]
    # The half-done epoch's figures carry over, so the resumed epoch reports the whole epoch.
    assert hist[-1]["train_loss"] == pytest.approx(ref_hist[-1]["train_loss"], rel=1e-9)
    assert hist[-1]["train_accuracy"] == pytest.approx(ref_hist[-1]["train_accuracy"])


def test_checkpoint_loads_weights_only_and_stale_temporaries_are_cleaned(tmp_path):
    path = tmp_path / "run.pt"
    stale = tmp_path / "run.pt.tmp.k1ll3d"
    stale.write_bytes(b"left by a crash")
    train = SyntheticDigits(256, seed=6)
    model, _, hist = _run(train, "torch", 0, path)
    assert not stale.exists()
    state = torch.load(path, weights_only=True)   # OneCycleLR, SGD, scaler, RNG: all plain types
    assert (state["epoch"], state["step"]) == (2, 0)
    assert state["loader"]["epoch"] == 2 and state["loader"]["batch"] == 0
    assert state["scheduler"]["last_epoch"] == 2 * 4
    assert state["history"] == hist
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state["model"].items())

    # Resuming a finished run trains nothing and returns the saved history.
    again, loader, hist2 = _run(train, "torch", 0, path, resume=True, init_seed=7)
    assert loader.seen == [] and hist2 == hist
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in state["model"].items())


def test_resume_without_a_checkpoint_starts_fresh(tmp_path, capsys):
    _, loader, hist = _run(SyntheticDigits(256, seed=6), "torch", 0, tmp_path / "none.pt", resume=True)
    assert len(hist) == 2 and len(loader.seen) == 8
    assert "starting from scratch" in capsys.readouterr().out
    assert (tmp_path / "none.pt").exists()


@pytest.mark.cuda
def test_fit_on_cuda_reports_gpu_idle_and_uses_amp(digits):
    train, test = digits
    loader = make_loader(train, "torch", batch_size=128, num_workers=2, device="cuda")
    history = fit(SmallCNN(), loader, epochs=2, eval_loader=make_loader(test, "torch", batch_size=512, train=False,
                                                                        num_workers=0, device="cuda"),
                  progress=False)
    for r in history:
        assert 0.0 <= r["gpu_idle_fraction"] <= 1.0
        assert r["peak_memory_mb"] > 0
    assert history[-1]["eval_accuracy"] > 0.5
    assert resolve_amp("auto", torch.device("cuda")) in ("bf16", "fp16")
