import contextlib
import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import require
from fastdata import Augmentation, available_backends, make_loader
from fastdata import checkpoint as ckpt
from fastdata.datasets import ArraySource, SyntheticDigits
from fastdata.engine import (
    CHECKPOINT_FORMAT,
    EpochMeter,
    StepTimer,
    TrainStep,
    choose_amp,
    cuda_switches,
    current_lr,
    default_optimizer,
    evaluate,
    fit,
    format_record,
    idle_fraction,
    resolve_amp,
    resolve_scheduler_interval,
    train_one_epoch,
    wants_fused,
)
from fastdata.models import SmallCNN
from fastdata.report import run_result

BACKENDS = [b for b in available_backends() if b != "auto"]
RECORD_KEYS = {"epoch", "train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "lr", "images_per_second",
               "data_wait_fraction", "gpu_idle_fraction", "peak_memory_mb", "seconds", "warmup_seconds", "images"}


@pytest.fixture(scope="module")
def digits():
    return SyntheticDigits(4096, train=True, seed=1), SyntheticDigits(512, train=False, seed=1)


class Crash(Exception):
    pass


class Wrapper:
    """Passes the loader contract (len, set_epoch, state_dict, load_state_dict) through to
    ``self.loader``; subclasses change only what iterating does."""

    def __len__(self):
        return len(self.loader)

    def set_epoch(self, epoch):
        self.loader.set_epoch(epoch)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


class Recording(Wrapper):
    """Passes the loader contract through, records the labels of every batch handed out, and raises
    Crash instead of handing out batch number ``crash_after`` + 1 (counted over the whole run)."""

    def __init__(self, loader, crash_after=None):
        self.loader, self.device, self.crash_after, self.seen = loader, loader.device, crash_after, []

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


def test_fp16_on_the_cpu_is_honoured_with_a_warning_and_nothing_else_warns(monkeypatch):
    """fp16 autocast on the CPU measured ~50x slower than fp32: a run that silently crawls looks hung."""
    import warnings

    import fastdata.engine.amp as engine

    monkeypatch.setattr(engine, "_WARNED_FP16_ON_CPU", False)
    with pytest.warns(RuntimeWarning, match="amp='fp16' on the CPU.*50x slower"):
        assert resolve_amp("fp16", torch.device("cpu")) == "fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for amp in ("auto", "off", "bf16"):
            resolve_amp(amp, torch.device("cpu"))


def test_fit_warns_about_fp16_on_the_cpu_once_at_its_callers_line(monkeypatch):
    """It warned three times (fit, its evaluation, run_result after the run), at fastdata's own lines."""
    import warnings

    import fastdata.engine.amp as engine

    monkeypatch.setattr(engine, "_WARNED_FP16_ON_CPU", False)
    loader = ListLoader(_batches(1, size=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(SmallCNN(width=4), loader, eval_loader=loader, epochs=1, amp="fp16", progress=False)
        run_result(history, train_loader=loader, backend="list", device=torch.device("cpu"), amp="fp16",
                   wall_seconds=1.0, dataset="x", epochs=1, batch_size=4)
    fp16 = [w for w in caught if "amp='fp16' on the CPU" in str(w.message)]
    assert len(fp16) == 1 and fp16[0].filename == __file__, [(w.filename, w.lineno) for w in fp16]
    monkeypatch.setattr(engine, "_WARNED_FP16_ON_CPU", False)
    with warnings.catch_warnings(record=True) as caught:   # evaluate alone (torch.no_grad wraps it)
        warnings.simplefilter("always")
        evaluate(SmallCNN(width=4), loader, amp="fp16")
    fp16 = [w for w in caught if "amp='fp16' on the CPU" in str(w.message)]
    assert len(fp16) == 1 and fp16[0].filename == __file__, [(w.filename, w.lineno) for w in fp16]


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

            def counted(self, *a, _real=real, _calls=calls, **k):
                _calls[0] += 1
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
    assert idle_fraction(starts, ends) == pytest.approx((2 + 5) / 30)
    assert idle_fraction([], []) is None


# ------------------------------------------------------------------------- warm-up and steady state
def _fake_cuda_events(monkeypatch, times):
    """torch.cuda.Event / current_stream stand-ins: each recorded event takes the next of ``times`` (ms)."""
    times = iter(times)

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = next(times)

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "training stream")


def _slow_first_step_times(steps, first_ms=3000.0, step_ms=10.0, gap_ms=5.0):
    """Start and end times of ``steps`` steps: the first takes ``first_ms`` (cuDNN's autotuning, lazy CUDA
    loading), every later one ``step_ms``, each after a ``gap_ms`` gap on the GPU timeline."""
    times, t = [0.0, first_ms], first_ms
    for _ in range(steps - 1):
        times += [t + gap_ms, t + gap_ms + step_ms]
        t += gap_ms + step_ms
    return times


def test_gpu_idle_is_the_steady_states_a_slow_first_step_is_warm_up(monkeypatch):
    """Issue 29: a first step of 3 s (cuDNN autotuning) in the span hid a loader that left the GPU idle a
    third of the time (0.099 read on an H200 where the slow loader's idle is over half). The steps after
    the warm-up are the steady state: their gaps ÷ their span."""
    _fake_cuda_events(monkeypatch, _slow_first_step_times(6))
    meter = EpochMeter(torch.device("cpu"), warmup_steps=2)
    meter.timer = StepTimer(torch.device("cuda", 0))   # CUDA events, faked, on a CPU meter
    train_one_epoch(CountingStep(), ListLoader(_batches(6, size=8)), meter)
    record = meter.record(1)
    # Steps 3-6: 3 gaps of 5 ms over 4 steps of 10 ms and those gaps; the whole epoch would read 25 / 3075.
    assert record["gpu_idle_fraction"] == pytest.approx(15 / 55)
    assert meter.timer.idle_fraction() == pytest.approx(15 / 55)
    assert record["images"] == 48 and record["warmup_seconds"] > 0
    # images/s is the steady state's: the 4 steps after the warm-up, over the seconds after it.
    steady = record["seconds"] - record["warmup_seconds"]
    assert record["images_per_second"] * steady == pytest.approx(32)


def test_a_step_timer_without_a_warm_up_divides_by_the_whole_span(monkeypatch):
    _fake_cuda_events(monkeypatch, _slow_first_step_times(3))
    timer = StepTimer(torch.device("cuda", 0))
    for _ in range(3):
        timer.start()
        timer.end()
    assert timer.idle_fraction() == pytest.approx(10 / 3030)
    timer.mark_steady()                     # nothing timed after the mark: no steady figure
    assert timer.idle_fraction() is None


class SlowStart(Wrapper):
    """Sleeps before the first batch of every pass (a worker start-up, a first shard over the network)."""

    def __init__(self, loader, seconds):
        self.loader, self.device, self.seconds = loader, loader.device, seconds

    def __iter__(self):
        import time

        time.sleep(self.seconds)
        yield from self.loader


def test_a_slow_first_batch_is_warm_up_in_the_first_epoch_only(capsys):
    """The first epoch of a fit call leaves its first steps out of images/s and data wait (one-time costs:
    CUDA and cuDNN start-up, compilation, the first workers) and shows them as warmup_seconds; a later
    epoch counts everything, so a cost every epoch pays (a loader that restarts slowly) is in its figures."""
    loader = SlowStart(ListLoader(_batches(16, size=8)), 0.6)
    model = nn.Sequential(nn.Flatten(), nn.Linear(256, 10))
    first, second = fit(model, loader, epochs=2, progress=False)
    # In seconds, not fractions: the steps' time depends on the machine's load, the sleep does not.
    steady = first["seconds"] - first["warmup_seconds"]
    assert first["warmup_seconds"] >= 0.6 and first["images"] == 128, first
    assert first["data_wait_fraction"] * steady < 0.3, first    # the 0.6 s was all in the warm-up
    assert first["images_per_second"] * steady == pytest.approx(128 - 5 * 8), first   # after 5 warm-up steps
    assert second["warmup_seconds"] == 0.0 and second["data_wait_fraction"] * second["seconds"] >= 0.59, second
    assert second["images_per_second"] == pytest.approx(second["images"] / second["seconds"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert "warm-up" in lines[0] and "warm-up" not in lines[1], lines
    old = {k: v for k, v in first.items() if k not in ("warmup_seconds", "images")}   # a checkpoint's older record
    assert "warm-up" not in format_record(old, 2) and "img/s" in format_record(old, 2)


@pytest.mark.parametrize("batches, accumulate, timing_warmup, steady_images", [
    (16, 1, 5, 88),    # 5 steps of warm-up, 11 steady (8 images each)
    (4, 1, 5, 16),     # a short epoch: at most half its steps are warm-up
    (1, 1, 5, 8),      # one step: no warm-up, the whole epoch
    (8, 2, 5, 32),     # a step is 2 batches: 2 of the 4 steps are warm-up
    (16, 1, 0, 128),   # timing_warmup=0: every step counts
])
def test_the_warm_up_is_counted_in_optimizer_steps(batches, accumulate, timing_warmup, steady_images):
    model = nn.Sequential(nn.Flatten(), nn.Linear(256, 10))
    (record,) = fit(model, ListLoader(_batches(batches, size=8)), epochs=1, accumulate=accumulate,
                    timing_warmup=timing_warmup, progress=False)
    steady = record["seconds"] - record["warmup_seconds"]
    assert record["images_per_second"] * steady == pytest.approx(steady_images)
    assert record["images"] == 8 * batches
    assert (record["warmup_seconds"] > 0) == (steady_images < 8 * batches)


@pytest.mark.parametrize("value, error", [(-1, ValueError), (True, TypeError), (2.0, TypeError)])
def test_a_bad_timing_warmup_is_refused_by_name(value, error):
    with pytest.raises(error, match="timing_warmup"):
        fit(nn.Linear(1, 1), ListLoader(_batches(2)), epochs=1, timing_warmup=value, progress=False)


def test_the_progress_bar_shows_the_steady_state(monkeypatch):
    from fastdata.engine import Progress
    from fastdata.engine import meter as meter_module

    class Bar:
        def update(self, n):
            pass

        def set_postfix_str(self, text):
            self.text = text

    now = [0.0]
    monkeypatch.setattr(meter_module.time, "perf_counter", lambda: now[0])
    meter = EpochMeter(torch.device("cpu"), warmup_steps=1)
    bar = Progress(Bar())
    now[0], meter.images, meter.wait = 5.0, 0, 4.5     # still waiting for a slow first batch
    bar.last = -math.inf
    bar.update(meter)
    assert "warm-up" in bar.bar.text, bar.bar.text
    now[0], meter.images, meter.wait = 10.0, 100, 9.0   # the first step ends the warm-up at 10 s
    meter.stepped()
    now[0], meter.images, meter.wait = 12.0, 300, 9.5   # 2 s later: 200 images, 0.5 s of waiting
    bar.last = -math.inf
    bar.update(meter)
    assert "100 img/s" in bar.bar.text and "data wait 25%" in bar.bar.text, bar.bar.text


def test_the_steady_figures_are_reduced_over_ranks(monkeypatch):
    """Under DDP: images added, wait the mean of the ranks' steady fractions, seconds the slowest rank's,
    and the steady span the longest rank's (warmup_seconds is the rest), so images/s is every rank's steady
    images over it. The other rank is simulated: 40 images, 16 of them warm-up, a steady wait of 0.5, a
    100 s epoch with a 60 s steady span."""
    import fastdata.distributed as fdist

    monkeypatch.setattr(fdist, "all_sum", lambda t: t + torch.tensor([0, 0, 0, 40, 16, 0.5, 0], dtype=t.dtype))
    monkeypatch.setattr(fdist, "all_max", lambda t: torch.maximum(t, torch.tensor([100.0, 60.0, 0.0], dtype=t.dtype)))
    monkeypatch.setattr(fdist, "world_size", lambda: 2)
    meter = EpochMeter(torch.device("cpu"), warmup_steps=1)
    train_one_epoch(CountingStep(), ListLoader(_batches(4, size=8)), meter)   # 32 images, 8 of warm-up
    record = meter.record(1)
    assert record["images"] == 72 and record["seconds"] == 100.0
    assert record["warmup_seconds"] == pytest.approx(40.0)
    assert record["images_per_second"] == pytest.approx((72 - 8 - 16) / 60)
    assert record["data_wait_fraction"] == pytest.approx(0.25, abs=0.05)   # this rank waited next to nothing


@pytest.mark.parametrize("kwargs, match", [({"epochs": -1}, "epochs"), ({"epochs": 1, "resume": True}, "checkpoint"),
                                           ({"epochs": 1, "amp": "fp32"}, "choose from"),
                                           ({"epochs": 1, "checkpoint_every": 0}, "checkpoint_every")])
def test_fit_rejects_bad_arguments(kwargs, match):
    loader = make_loader(SyntheticDigits(64, seed=4), "torch", batch_size=32, num_workers=0, device="cpu")
    with pytest.raises(ValueError, match=match):
        fit(SmallCNN(width=4), loader, progress=False, **kwargs)


# ---------------------------------------------------------------------------------- checkpoints
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


class ListLoader:
    """The loader contract over fixed batches (the same every epoch), with a position; ``iters`` counts
    the passes started."""

    def __init__(self, batches, device="cpu"):
        self.batches, self.device = list(batches), torch.device(device)
        self._next = self._pos = (0, 0)
        self.iters = 0

    def __len__(self):
        return len(self.batches)

    def set_epoch(self, epoch):
        self._next = (epoch, 0)

    def state_dict(self):
        epoch, done = self._pos
        return {"epoch": epoch + 1, "batch": 0} if done >= len(self) else {"epoch": epoch, "batch": done}

    def load_state_dict(self, state):
        self._next = self._pos = (state["epoch"], state["batch"])

    def __iter__(self):
        epoch, start = self._next
        self._next, self._pos = (epoch + 1, 0), (epoch, start)
        self.iters += 1
        for i in range(start, len(self.batches)):
            self._pos = (epoch, i + 1)
            yield self.batches[i]


def _batches(count, size=16, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 1, 16, 16, generator=g).to(device, dtype),
             torch.randint(0, 10, (size,), generator=g).to(device)) for _ in range(count)]


def _params(model):
    return torch.cat([p.detach().flatten().float().cpu() for p in model.parameters()])


# ---------------------------------------------------------------------------------- empty batches
def test_an_empty_batch_is_left_out_of_the_figures_and_moves_nothing():
    """on_error='skip' can empty a batch: cross-entropy over zero rows is NaN and used to poison the
    epoch's loss. An empty batch must count nowhere and step nothing (AdamW would still move the
    weights on a zero gradient)."""
    full = _batches(2)
    empty = (full[0][0][:0], full[0][1][:0])
    torch.manual_seed(0)
    ref = SmallCNN(width=4)
    ref_hist = fit(ref, ListLoader(full), epochs=2, progress=False)
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, ListLoader([full[0], empty, full[1], empty]), epochs=2, progress=False)
    for got, want in zip(hist, ref_hist):
        assert math.isfinite(got["train_loss"])
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
        assert got["train_accuracy"] == want["train_accuracy"]
    assert torch.equal(_params(model), _params(ref))
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    ref_bn = next(m for m in ref.modules() if isinstance(m, nn.BatchNorm2d))
    assert torch.equal(bn.running_mean, ref_bn.running_mean)


def test_a_loader_of_only_empty_batches_reports_nan_not_an_error():
    empty = [(torch.zeros(0, 1, 16, 16), torch.zeros(0, dtype=torch.long))] * 2
    model = SmallCNN(width=4)
    before = _params(model)
    hist = fit(model, ListLoader(empty), epochs=1, progress=False)
    assert math.isnan(hist[0]["train_loss"]) and torch.equal(_params(model), before)


# ------------------------------------------------------------------------------------ dtype (10.20)
def test_a_bf16_loader_with_amp_off_is_refused_before_training():
    """Decision: refuse, not cast (casting would throw away what a bf16 loader saves)."""
    src = SyntheticDigits(128, seed=2)
    loader = make_loader(src, "torch", batch_size=64, num_workers=0, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"train_loader yields bfloat16 images.*float32 and amp is off: "
                                        r"pass amp='bf16'.*dtype=torch.float32"):
        fit(SmallCNN(width=4), loader, epochs=1, amp="off", progress=False)
    # An object with the loader contract but no config: refused at its first batch, before any step.
    model = SmallCNN(width=4)
    before = _params(model)
    with pytest.raises(TypeError, match="bfloat16"):
        fit(model, ListLoader(_batches(2, dtype=torch.bfloat16)), epochs=1, amp="off", progress=False)
    assert torch.equal(_params(model), before)
    # With autocast the same loader trains.
    hist = fit(SmallCNN(width=4), loader, epochs=1, amp="bf16", progress=False)
    assert math.isfinite(hist[0]["train_loss"])


# ------------------------------------------------------------------------- position and checkpoints
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


# ------------------------------------------------------------------------------ devices (CPU stubs)
def test_a_model_on_another_device_than_the_loader_is_refused():
    model = nn.Sequential(nn.Flatten(), nn.Linear(256, 10, device="meta"))
    with pytest.raises(ValueError, match=r"the model is on meta but train_loader yields batches on cpu"):
        fit(model, ListLoader(_batches(1)), epochs=1, progress=False)


def test_eval_loader_on_another_device_is_refused():
    with pytest.raises(ValueError, match=r"eval_loader is on cuda:1 but train_loader is on cpu"):
        fit(SmallCNN(width=4), ListLoader(_batches(1)), eval_loader=ListLoader([], device="cuda:1"), epochs=1,
            progress=False)


def test_resolve_amp_asks_the_loaders_gpu_not_the_current_one(monkeypatch):
    """is_bf16_supported() looks at the current device; resolve_amp must make the loader's GPU current."""
    current = [0]

    class FakeDeviceScope:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "device", FakeDeviceScope)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: current[0] == 1)
    assert resolve_amp("auto", torch.device("cuda", 1)) == "bf16"   # only GPU 1 has bf16 here
    assert resolve_amp("auto", torch.device("cuda", 0)) == "fp16"
    assert current == [0]


def test_step_events_are_recorded_on_the_loaders_gpu(monkeypatch):
    """Event.record() without a stream uses the current device's stream (cuda:0 unless set): the
    timer must name the training stream of the loader's device."""
    times = iter([0.0, 8.0, 10.0, 20.0, 25.0, 30.0])

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.stream = self.t = None

        def record(self, stream=None):
            self.stream, self.t = stream, next(times)

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("training stream of", device))
    timer = StepTimer(torch.device("cuda", 1))
    for _ in range(3):
        timer.start()
        timer.end()
    assert {e.stream for e in timer.starts + timer.ends} == {("training stream of", torch.device("cuda", 1))}
    assert timer.idle_fraction() == pytest.approx((2 + 5) / 30)
    cpu = StepTimer(torch.device("cpu"))
    cpu.start(), cpu.end()
    assert cpu.idle_fraction() is None and cpu.starts == []


def test_default_optimizer_is_fused_on_cuda_only():
    """Fused AdamW takes GradScaler's inf check as a device tensor; the non-fused one makes the scaler
    call .item() every fp16 step. torch refuses fused=True for non-floating or non-supported params."""
    def param(device, floating=True):
        return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: floating)

    assert wants_fused([param("cuda:0"), param("cuda:0")], torch.device("cuda", 0))
    assert not wants_fused([param("cuda:0"), param("cuda:0", floating=False)], "cuda:0")
    assert not wants_fused([param("cuda:0"), param("cpu")], "cuda:0")
    assert not wants_fused([param("cpu")], "cpu")
    opt = default_optimizer(SmallCNN(width=4).parameters(), "cpu")
    assert isinstance(opt, torch.optim.AdamW) and not opt.param_groups[0]["fused"]
    assert (opt.defaults["lr"], opt.defaults["weight_decay"]) == (1e-3, 0.01)


# ------------------------------------------------------------------------------------------ GPU
class SyncFreeSteps(Wrapper):
    """Passes a loader through and runs fit's steps, from the second on (the first one initializes
    cuDNN's algorithm choice and the optimizer state), under set_sync_debug_mode('error'): any
    synchronizing call inside a step raises. The mode is off while the wrapped loader works and after
    the last batch, so fit's end-of-epoch reads are not counted."""

    def __init__(self, loader):
        self.loader, self.device, self.steps = loader, loader.device, 0

    def __iter__(self):
        it = iter(self.loader)
        try:
            while True:
                torch.cuda.set_sync_debug_mode(0)
                try:
                    batch = next(it)
                except StopIteration:
                    return
                torch.cuda.set_sync_debug_mode("error" if self.steps >= 1 else 0)
                self.steps += 1
                yield batch
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])   # fp16: the default optimizer is fused, so no .item()
def test_fit_steps_do_not_synchronize(amp):
    loader = SyncFreeSteps(ListLoader(_batches(6, size=64, device="cuda"), device="cuda"))
    hist = fit(SmallCNN(width=8), loader, epochs=1, amp=amp, progress=False)
    assert loader.steps == 6 and math.isfinite(hist[0]["train_loss"])


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


class SlowHost(Wrapper):
    """Sleeps on the host before handing out each batch: the GPU has nothing to do meanwhile."""

    def __init__(self, loader, seconds):
        self.loader, self.device, self.seconds = loader, loader.device, seconds

    def __iter__(self):
        import time

        for batch in self.loader:
            time.sleep(self.seconds)
            yield batch


class SlowFirstStep(nn.Module):
    """``model`` with a first training forward that sleeps ``seconds`` on the host: a first step as slow as
    cuDNN's autotuning and lazy CUDA loading made it on an H200 (about 3 s), the GPU idle inside it."""

    def __init__(self, model, seconds):
        super().__init__()
        self.model, self.seconds, self.slept = model, seconds, False

    def forward(self, x):
        if self.training and not self.slept:
            import time

            self.slept = True
            time.sleep(self.seconds)
        return self.model(x)


@pytest.mark.cuda
def test_gpu_idle_fraction_tells_a_slow_loader_from_a_fast_one():
    """Issue 29: with the first step in its span, the slow loader read 0.099 on an H200. The warm-up (the
    first steps of the first epoch) is left out of the figure and shown as warmup_seconds."""
    slow = SlowHost(make_loader(SyntheticDigits(1024, seed=9), "memory", batch_size=128, device="cuda"), 0.05)
    hist = fit(SlowFirstStep(SmallCNN(width=8), 3.0), slow, epochs=1, progress=False)
    assert hist[0]["warmup_seconds"] >= 3.0, hist
    assert hist[0]["gpu_idle_fraction"] > 0.5, hist
    # A model big enough that the GPU, not the host, sets the pace: the first epoch's steady state, after
    # the slow first step and cuDNN's algorithm search, keeps the GPU busy.
    rng = torch.Generator().manual_seed(9)
    images = torch.randint(0, 256, (16384, 28, 28), dtype=torch.uint8, generator=rng).numpy()
    src = ArraySource(images, (torch.arange(16384) % 10).numpy(), mean=(0.5,), std=(0.25,))
    fast = make_loader(src, "memory", batch_size=1024, device="cuda")
    hist = fit(SlowFirstStep(SmallCNN(width=64), 3.0), fast, epochs=1, progress=False)
    assert hist[0]["warmup_seconds"] >= 3.0, hist
    assert hist[0]["gpu_idle_fraction"] < 0.1, hist


@pytest.mark.cuda(devices=2)
def test_fit_on_the_second_gpu_times_the_second_gpu(monkeypatch):
    from fastdata.engine import meter

    timers = []

    class Recorded(meter.StepTimer):
        def __init__(self, device):
            super().__init__(device)
            timers.append(self)

    monkeypatch.setattr(meter, "StepTimer", Recorded)
    before = torch.cuda.current_device()
    loader = make_loader(SyntheticDigits(512, seed=1), "memory", batch_size=128, device="cuda:1")
    model = SmallCNN(width=8)
    hist = fit(model, loader, epochs=1, progress=False)
    events = [e for t in timers for e in t.starts + t.ends]
    assert len(events) == 2 * len(loader)
    assert {e.device for e in events} == {torch.device("cuda", 1)}
    assert 0.0 <= hist[0]["gpu_idle_fraction"] <= 1.0
    assert {p.device for p in model.parameters()} == {torch.device("cuda", 1)}
    assert torch.cuda.current_device() == before   # fit's device scope is undone on the way out


def test_a_model_that_cannot_take_an_empty_batch_under_ddp_gets_a_clear_error():
    """Under DDP an empty rank still runs a (zero-loss) step through the model; a model whose forward
    fails on N=0 must be told why it met an empty batch and what to do."""
    class ViewFlatten(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 10)

        def forward(self, x):
            return self.fc(x.view(x.shape[0], -1))   # -1 is ambiguous with 0 rows

    model = ViewFlatten()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                 torch.device("cpu"), "off", ddp=True)
    sums = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"this rank's batch is empty.*x.flatten\(1\).*drop_last=True"):
        step(torch.zeros(0, 1, 16, 16), torch.zeros(0, dtype=torch.long), sums)
    step(torch.zeros(4, 1, 16, 16), torch.zeros(4, dtype=torch.long), sums)   # a real batch trains
    assert sums[2].item() == 4


# ------------------------------------------------------------------------- the parts of fit
class CountingStep:
    """A stand-in training step: records the size of every batch it is given."""

    ddp, accumulate = False, 1

    def __init__(self):
        self.sizes, self.steps, self.accumulated = [], 0, 0
        self.net = nn.Linear(1, 1).eval()

    def check_dtype(self, dtype, name):
        pass

    def group(self, batch, first_batch, batches):
        return batch, batch + 1

    def backward(self, images, labels, sums, *, scale, sync):
        self.sizes.append(images.shape[0])
        self.accumulated += 1
        sums += torch.tensor([float(images.shape[0]), 1.0, float(images.shape[0])], dtype=torch.float64)

    def optimizer_step(self):
        self.steps += bool(self.accumulated)
        self.accumulated = 0


def test_train_one_epoch_steps_real_batches_and_fills_the_meter():
    batches = _batches(4, size=8)
    batches[2] = (batches[2][0][:0], batches[2][1][:0])     # an emptied batch takes no step
    step, meter, after = CountingStep(), EpochMeter(torch.device("cpu"), [10.0, 2.0, 10.0]), []
    train_one_epoch(step, ListLoader(batches), meter, first_batch=0, after_batch=after.append)
    assert step.sizes == [8, 8, 8] and step.net.training      # the step's module trains in train mode
    assert step.steps == 3
    assert after == [1, 2, 3, 4]                              # batches done in the epoch, empty one included
    assert meter.images == 24 and meter.wait >= 0.0
    record = meter.record(3)
    assert set(record) == RECORD_KEYS and record["epoch"] == 3
    # The carried sums of a resumed half epoch count: (10 + 3 * 8) / (10 + 24).
    assert record["train_loss"] == pytest.approx(34 / 34) and record["train_accuracy"] == pytest.approx(5 / 34)
    assert record["gpu_idle_fraction"] is None and record["images_per_second"] > 0


def _read(owner, name):
    try:
        return getattr(owner, name)
    except RuntimeError:   # torch's legacy TF32 getters raise when the two APIs disagree
        return "raises"


def _tf32_state():
    """cudnn.benchmark, the legacy TF32 booleans and (torch 2.9+) the fp32_precision strings."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    strings = (cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision, matmul.fp32_precision) \
        if hasattr(cudnn, "rnn") and hasattr(cudnn.rnn, "fp32_precision") else ()
    return (cudnn.benchmark, _read(cudnn, "allow_tf32"), _read(matmul, "allow_tf32"), *strings)


TF32_ON = (True, True, True, "tf32", "tf32", "tf32")


@pytest.fixture
def switches_restored():
    """The process-wide switches as they were before the test, put back after it whatever happens."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    benchmark = cudnn.benchmark
    strings = [(o, "fp32_precision", o.fp32_precision) for o in (cudnn.conv, cudnn.rnn, matmul, cudnn)]
    yield
    cudnn.benchmark = benchmark
    cudnn.allow_tf32, matmul.allow_tf32 = True, False     # torch's defaults, then the exact strings
    for owner, name, value in strings:
        setattr(owner, name, value)


def test_cuda_switches_are_on_for_the_block_only(switches_restored):
    """The flags are process-wide: fit turns them on for its run and gives the caller's values back.
    (Setting them needs no GPU, so this runs anywhere.)"""
    torch.backends.cudnn.benchmark = False
    before = _tf32_state()
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=True, tf32=True):
        inside = _tf32_state()
    assert inside == TF32_ON[:len(inside)]
    assert _tf32_state() == before


@pytest.mark.parametrize("callers_way", ["legacy", "new"])
def test_tf32_reads_back_through_both_apis_inside_and_the_callers_flags_return(switches_restored, callers_way):
    """torch raises on a legacy TF32 read when the legacy and fp32_precision settings disagree, and
    torch.compile reads both: inside the block both must read back, whichever API the caller used."""
    if callers_way == "legacy":
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    before = _tf32_state()
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=False, tf32=True):
        inside = _tf32_state()
    assert inside[1:] == TF32_ON[1:len(inside)]
    assert _tf32_state() == before


def test_cuda_switches_told_not_to_touch_leave_the_callers_values(switches_restored):
    torch.backends.cudnn.benchmark = True                   # the caller's own choice
    before = _tf32_state()
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=False, tf32=False):
        assert _tf32_state() == before
    torch.backends.cudnn.benchmark = False
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=False, tf32=True):
        assert torch.backends.cudnn.benchmark is False      # not switched on when told not to
    with cuda_switches(torch.device("cpu"), cudnn_benchmark=True, tf32=True):
        assert torch.backends.cudnn.benchmark is False      # the CPU touches nothing
    assert _tf32_state()[0] is False


class SwitchProbe(nn.Module):
    """Records the process-wide switches each time forward runs."""

    def __init__(self):
        super().__init__()
        self.net = SmallCNN(width=4)
        self.seen = set()

    def forward(self, x):
        self.seen.add(_tf32_state())
        return self.net(x)


def test_fit_on_the_cpu_leaves_the_process_wide_switches_alone(switches_restored):
    torch.backends.cudnn.benchmark = False
    before = _tf32_state()
    model = SwitchProbe()
    fit(model, ListLoader(_batches(2)), epochs=1, progress=False)
    assert model.seen == {before} and _tf32_state() == before


@pytest.mark.cuda
def test_fit_on_cuda_switches_cudnn_benchmark_and_tf32_for_the_run_only(switches_restored):
    torch.backends.cudnn.benchmark = False
    before = _tf32_state()
    model = SwitchProbe()
    fit(model, ListLoader(_batches(2, device="cuda"), device="cuda"), epochs=1, progress=False)
    (inside,) = model.seen
    assert inside == TF32_ON[:len(inside)]
    assert _tf32_state() == before
    model = SwitchProbe()
    fit(model, ListLoader(_batches(2, device="cuda"), device="cuda"), epochs=1, progress=False,
        cudnn_benchmark=False, tf32=False)
    assert model.seen == {before} and _tf32_state() == before


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


def test_fit_sets_each_epoch_on_the_loader_except_a_resumed_half_epoch(tmp_path):
    """set_epoch reshuffles (a DistributedSampler-style loader depends on it); a resumed half epoch
    must keep the order that load_state_dict restored."""
    class EpochLog(ListLoader):
        def __init__(self, batches):
            super().__init__(batches)
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)
            super().set_epoch(epoch)

    loader = EpochLog(_batches(4))
    fit(SmallCNN(width=4), loader, epochs=2, progress=False)
    assert loader.epochs == [0, 1]
    path = tmp_path / "c.pt"
    with pytest.raises(Crash):
        fit(SmallCNN(width=4), Recording(EpochLog(_batches(4)), crash_after=3), epochs=2, checkpoint=path,
            checkpoint_every=2, progress=False)
    loader = EpochLog(_batches(4))
    fit(SmallCNN(width=4), loader, epochs=3, checkpoint=path, resume=True, progress=False)
    assert loader.epochs == [1, 2] and loader.iters == 3   # epoch 0 resumed at batch 2, not re-set


# ---------------------------------------------------------------------------------- soft labels
def _soft(batches, classes=10, seed=0):
    """``batches`` with soft labels: a random probability vector over ``classes`` per sample, as MixUp and
    CutMix make them (float32 (N, classes))."""
    g = torch.Generator().manual_seed(seed)
    return [(x, torch.softmax(3 * torch.randn(x.shape[0], classes, generator=g), 1).to(x.device)) for x, _ in batches]


class LogitsLog(nn.Module):
    """SmallCNN that keeps a copy of every output it returns."""

    def __init__(self):
        super().__init__()
        self.net = SmallCNN(width=4)
        self.outputs = []

    def forward(self, x):
        out = self.net(x)
        self.outputs.append(out.detach().clone())
        return out


def _soft_ce(logits, targets):
    """Cross-entropy against class probabilities, summed over the batch, written out by hand."""
    return -(targets * torch.log_softmax(logits.double(), 1)).sum().item()


def test_fit_trains_on_soft_labels_and_counts_argmax_agreement():
    batches = _soft(_batches(3))
    torch.manual_seed(0)
    model = LogitsLog()
    before = _params(model)
    hist = fit(model, ListLoader(batches), epochs=2, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
               progress=False)
    assert not torch.equal(_params(model), before)       # the soft targets trained the model
    assert len(model.outputs) == 6
    agreements = []
    for epoch, record in enumerate(hist):
        outputs = model.outputs[3 * epoch: 3 * epoch + 3]
        agree = sum((o.argmax(1) == y.argmax(1)).sum().item() for o, (_, y) in zip(outputs, batches))
        agreements.append(agree)
        assert record["train_accuracy"] == agree / 48
        assert record["train_loss"] == pytest.approx(sum(_soft_ce(o, y) for o, (_, y) in zip(outputs, batches)) / 48,
                                                     rel=1e-5)
    # The comparison above would pass vacuously at 0 (what comparing argmax with probabilities gives).
    assert sum(agreements) > 0, agreements


class Prior(nn.Module):
    """Logits that are a parameter: ``log p`` for every sample, in ``dtype``."""

    def __init__(self, p, dtype=torch.float32):
        super().__init__()
        self.logits = nn.Parameter(torch.tensor(p).log())
        self.dtype = dtype

    def forward(self, x):
        return self.logits.expand(x.shape[0], -1).to(self.dtype)


P = [0.5, 0.25, 0.25]
SOFT = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.2, 0.6]])
# -(0.7 ln .5 + 0.3 ln .25) and -(0.2 ln .5 + 0.8 ln .25), averaged over the two samples.
SOFT_LOSS = (-(0.7 * math.log(0.5) + 0.3 * math.log(0.25)) - (0.2 * math.log(0.5) + 0.8 * math.log(0.25))) / 2


@pytest.mark.parametrize("dtype, amp, rel", [(torch.float32, "off", 1e-6), (torch.bfloat16, "bf16", 1e-2),
                                             (torch.float16, "fp16", 1e-3)])
def test_soft_label_loss_accuracy_and_gradient_by_hand(dtype, amp, rel):
    """Logits log p against targets t: loss -sum(t log p), right when argmax p == argmax t (the first
    sample, not the second), and one SGD step at lr 1 moves the logits by -(p - mean t). bf16 and fp16
    logits under CPU autocast with float32 targets give the same figures (cross-entropy runs in float32)."""
    images = torch.zeros(2, 1, 4, 4)
    model = Prior(P, dtype)
    result = evaluate(model, ListLoader([(images, SOFT)]), amp=amp)
    assert result["loss"] == pytest.approx(SOFT_LOSS, rel=rel) and result["accuracy"] == 0.5

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    step = TrainStep(model, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                     torch.device("cpu"), amp, ddp=False)
    sums = torch.zeros(3, dtype=torch.float64)
    step(images, SOFT, sums)
    assert sums[0].item() / 2 == pytest.approx(SOFT_LOSS, rel=rel) and sums[1:].tolist() == [1.0, 2.0]
    expected = torch.tensor(P).log() - (torch.tensor(P) - SOFT.mean(0))
    assert torch.allclose(model.logits.detach(), expected, rtol=rel, atol=rel)


def test_fit_on_soft_labels_under_cpu_bf16_autocast():
    batches = _soft(_batches(2))
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    before = _params(model)
    hist = fit(model, ListLoader(batches), epochs=1, amp="bf16", progress=False)
    assert math.isfinite(hist[0]["train_loss"]) and not torch.equal(_params(model), before)
    ev = evaluate(model, ListLoader(batches), amp="bf16")
    ref = evaluate(model, ListLoader(batches), amp="off")
    assert ev["loss"] == pytest.approx(ref["loss"], rel=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_fit_on_soft_labels_under_cuda_autocast(amp):
    """CUDA autocast runs cross-entropy in float32 too: bf16/fp16 logits against float32 soft targets."""
    batches = _soft(_batches(2, device="cuda"))
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, ListLoader(batches, device="cuda"), epochs=2, amp=amp, progress=False)
    assert all(math.isfinite(r["train_loss"]) for r in hist)
    model.eval()
    with torch.no_grad():
        agree = sum((model(x).argmax(1) == y.argmax(1)).sum().item() for x, y in batches)
    assert evaluate(model, ListLoader(batches, device="cuda"), amp="off")["accuracy"] == agree / 32


def test_empty_soft_label_batches_keep_working():
    """An emptied batch with soft labels is (0, classes): skipped in one process, a zero-loss step under
    DDP, and nowhere in the figures."""
    full = _soft(_batches(2))
    empty = (full[0][0][:0], full[0][1][:0])
    assert empty[1].shape == (0, 10)
    torch.manual_seed(0)
    ref = SmallCNN(width=4)
    ref_hist = fit(ref, ListLoader(full), epochs=1, progress=False)
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, ListLoader([full[0], empty, full[1]]), epochs=1, progress=False)
    assert hist[0]["train_loss"] == pytest.approx(ref_hist[0]["train_loss"], rel=1e-6)
    assert hist[0]["train_accuracy"] == ref_hist[0]["train_accuracy"]
    assert torch.equal(_params(model), _params(ref))
    assert evaluate(model, ListLoader([empty]))["samples"] == 0

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                     torch.device("cpu"), "off", ddp=True)
    sums = torch.zeros(3, dtype=torch.float64)
    step(*empty, sums)                                    # the DDP path: a zero-loss step
    assert sums.tolist() == [0.0, 0.0, 0.0]


def test_soft_labels_with_the_wrong_number_of_classes_are_named():
    model = SmallCNN(width=4)
    step = TrainStep(model, model, torch.optim.SGD(model.parameters(), lr=0.1),
                     torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(), torch.device("cpu"),
                     "off", ddp=False)
    images, labels = _soft(_batches(1), classes=5)[0]
    with pytest.raises(ValueError, match=r"soft labels of shape \(16, 5\) for logits of shape \(16, 10\).*"
                                         r"num_classes, 10"):
        step(images, labels, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="one column per model output"):
        evaluate(model, ListLoader([(images, labels)]))


def test_fit_trains_on_timm_soft_target_loss_with_mixup_and_evaluates_on_class_indices():
    """timm's recipe: SoftTargetCrossEntropy takes MixUp's (N, classes) targets only. fit used it for the
    eval loader's int64 labels too and crashed after the whole first epoch; the eval loss is now
    cross-entropy on the evaluation labels, whatever the training loss."""
    timm_loss = require("timm.loss")
    from fastdata.batch_transforms import MixUp

    train = make_loader(SyntheticDigits(64, seed=1), "memory", batch_size=32, device="cpu", seed=0,
                        batch_transforms=[MixUp(alpha=0.4)])
    test = make_loader(SyntheticDigits(48, train=False, seed=1), "memory", batch_size=16, train=False, device="cpu")
    seen = []
    soft_loss = timm_loss.SoftTargetCrossEntropy()
    soft_loss.register_forward_pre_hook(lambda module, args: seen.append(args[1].shape))
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, train, epochs=2, eval_loader=test, loss_fn=soft_loss, progress=False)
    assert len(hist) == 2 and seen == [(32, 10)] * 4      # trained on soft targets alone
    # What the run reported is cross-entropy over the eval loader's class indices.
    assert hist[-1]["eval_loss"] == pytest.approx(evaluate(model, test)["loss"], rel=1e-6)
    assert math.isfinite(hist[0]["eval_loss"]) and hist[-1]["eval_accuracy"] is not None


def test_fit_evaluates_with_the_eval_loss_fn_given_and_not_the_training_loss():
    labels_seen = {"train": [], "eval": []}

    def logged(kind, value):
        def loss(logits, labels):
            labels_seen[kind].append(labels.dtype)
            return nn.functional.cross_entropy(logits, labels) * 0 + value if kind == "eval" else \
                nn.functional.cross_entropy(logits, labels)
        return loss

    torch.manual_seed(0)
    hist = fit(SmallCNN(width=4), ListLoader(_batches(3)), epochs=2, eval_loader=ListLoader(_batches(2, seed=1)),
               loss_fn=logged("train", None), eval_loss_fn=logged("eval", 7.25), progress=False)
    assert [r["eval_loss"] for r in hist] == [7.25, 7.25]
    assert labels_seen == {"train": [torch.int64] * 6, "eval": [torch.int64] * 4}


def test_evaluate_refuses_a_loss_that_is_not_callable():
    with pytest.raises(TypeError, match=r"loss_fn must be callable .* got 'ce' \(str\)"):
        evaluate(SmallCNN(width=4), ListLoader(_batches(1)), loss_fn="ce")


# ---------------------------------------------------------------------------------- schedulers
def _sched_run(make_scheduler, *, epochs=2, batches=3, interval=None, momentum=0.0, **kwargs):
    """fit a small model for ``epochs`` over ``batches`` fixed batches; returns (scheduler, optimizer,
    history, the lr every training step saw)."""
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    sched = make_scheduler(opt)
    seen = []
    def log_lr(module, args):   # training forwards only: evaluation runs the model too
        if module.training:
            seen.append(opt.param_groups[0]["lr"])

    model.register_forward_pre_hook(log_lr)
    if interval is not None:
        kwargs["scheduler_interval"] = interval
    hist = fit(model, ListLoader(_batches(batches)), epochs=epochs, optimizer=opt, scheduler=sched, progress=False,
               **kwargs)
    return sched, opt, hist, seen


def test_multistep_milestones_count_epochs_not_steps():
    """MultiStepLR(milestones=[1]) means "after epoch 1": it used to be stepped per batch, so it decayed
    after the first step."""
    sched, opt, hist, seen = _sched_run(lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[1], gamma=0.1))
    assert seen == [0.1] * 3 + [0.1 * 0.1] * 3            # every step of epoch 1 at lr, epoch 2 at lr * gamma
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.1 * 0.1
    assert [r["lr"] for r in hist] == [0.1, 0.1 * 0.1]   # the lr each epoch trained at


S = torch.optim.lr_scheduler


@pytest.mark.parametrize("make, interval, expected, steps", [
    (lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=6), None, "step", 6),
    (lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=2), None, "step", 6),
    (lambda o: S.StepLR(o, step_size=10), None, "epoch", 2),
    (lambda o: S.LambdaLR(o, lambda i: 1.0), None, "epoch", 2),
    (lambda o: S.StepLR(o, step_size=10), "step", "step", 6),
    (lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=2), "epoch", "epoch", 2),
])
def test_scheduler_interval_default_rule_and_override(make, interval, expected, steps):
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1, momentum=0.9)
    assert resolve_scheduler_interval(make(opt), interval) == expected
    sched, *_ = _sched_run(make, interval=interval, momentum=0.9)
    assert sched.last_epoch == steps                      # 2 epochs x 3 batches


def test_an_unknown_scheduler_interval_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown scheduler_interval 'batch'; choose from \['step', 'epoch', None\]"):
        resolve_scheduler_interval(None, "batch")
    loader = ListLoader(_batches(1))
    with pytest.raises(ValueError, match="scheduler_interval 'batch'"):
        fit(SmallCNN(width=4), loader, epochs=1, scheduler_interval="batch", progress=False)
    assert loader.iters == 0
    assert resolve_scheduler_interval(None) is None


class PlateauLog(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """ReduceLROnPlateau that keeps the metric of every step."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.metrics = []

    def step(self, metrics, epoch=None):
        self.metrics.append(metrics)
        super().step(metrics)


def test_reduce_lr_on_plateau_is_stepped_once_per_epoch_with_the_eval_loss(tmp_path):
    """ReduceLROnPlateau.step needs a metric: stepped per batch it failed with a raw TypeError."""
    path = tmp_path / "c.pt"
    sched, opt, hist, seen = _sched_run(lambda o: PlateauLog(o, mode="max", factor=0.5, patience=0), epochs=3,
                                        eval_loader=ListLoader(_batches(2, seed=9)), checkpoint=path)
    assert sched.metrics == [r["eval_loss"] for r in hist] and len(set(sched.metrics)) == 3
    # mode="max", patience 0: the first metric is the best so far; the second halves the lr unless it
    # beats the first (by torch's default relative threshold 1e-4). Changes happen between epochs only.
    lrs = [r["lr"] for r in hist]
    assert seen == [lr for lr in lrs for _ in range(3)]
    m = sched.metrics
    assert lrs[1] == lrs[0] == 0.1 and lrs[2] == (0.1 if m[1] > m[0] * (1 + 1e-4) else 0.05)
    assert torch.load(path, weights_only=True)["scheduler"]["last_epoch"] == 3   # its state saves
    # Without an eval_loader the training loss stands in.
    sched, _, hist, _ = _sched_run(lambda o: PlateauLog(o))
    assert sched.metrics == [r["train_loss"] for r in hist]
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau cannot be stepped per batch.*"
                                         r"scheduler_interval='epoch' or None"):
        _sched_run(lambda o: PlateauLog(o), interval="step")


@pytest.mark.parametrize("crash_after", [7, 9])   # mid-epoch 2 (saved at its batch 2); epoch 3's start
def test_resuming_steps_an_epoch_scheduler_exactly_once_per_epoch(tmp_path, crash_after):
    """The checkpoint at an epoch's end holds the scheduler stepped for that epoch; a mid-epoch one holds it
    before: a resume must neither step it twice nor skip a step (StepLR halving every epoch shows both)."""
    batches = _batches(4)

    def run(loader, resume=False, seed=0):
        torch.manual_seed(seed)
        model = SmallCNN(width=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        hist = fit(model, loader, epochs=3, optimizer=opt, scheduler=sched, checkpoint=tmp_path / "c.pt",
                   checkpoint_every=2, resume=resume, progress=False)
        return model, sched, hist

    ref_model, ref_sched, ref_hist = run(ListLoader(batches))
    assert [r["lr"] for r in ref_hist] == [0.1, 0.05, 0.025] and ref_sched.last_epoch == 3
    (tmp_path / "c.pt").unlink()
    with pytest.raises(Crash):
        run(Recording(ListLoader(batches), crash_after=crash_after))
    saved = ckpt.load(tmp_path / "c.pt")
    assert (saved["loader"]["epoch"], saved["loader"]["batch"]) == ((1, 2) if crash_after == 7 else (2, 0))
    model, sched, hist = run(ListLoader(batches), resume=True, seed=5)
    assert [r["lr"] for r in hist] == [0.1, 0.05, 0.025]
    assert sched.last_epoch == 3 and sched.get_last_lr() == ref_sched.get_last_lr() == [0.0125]
    assert torch.equal(_params(model), _params(ref_model))


def test_a_one_cycle_schedule_too_short_for_a_fresh_run_is_refused_up_front():
    loader = ListLoader(_batches(3))
    model = SmallCNN(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    short = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=5)
    with pytest.raises(ValueError, match=r"OneCycleLR has total_steps=5 but this run steps it 6 times \(2 epochs x "
                                         r"3 batches, stepped per batch\): torch would fail at step 6\. Build it "
                                         r"for this run: OneCycleLR\(optimizer, max_lr, epochs=2, "
                                         r"steps_per_epoch=len\(train_loader\)\)"):
        fit(model, loader, epochs=2, optimizer=opt, scheduler=short, progress=False)
    assert loader.iters == 0                             # before the first batch, not at step 6
    exact = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=2, steps_per_epoch=3)
    fit(model, loader, epochs=2, optimizer=opt, scheduler=exact, progress=False)
    assert exact.last_epoch == 6


def test_resuming_a_one_cycle_schedule_with_fewer_steps_left_warns_that_it_stops_mid_anneal(tmp_path):
    """Resumed on more ranks (or bigger batches) an epoch has fewer steps: the schedule, built for the
    old count, would end at a high rate without a word."""
    path = tmp_path / "c.pt"

    def run(epochs, batches, resume):
        model = SmallCNN(width=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=2, steps_per_epoch=4)
        return fit(model, ListLoader(_batches(batches)), epochs=epochs, optimizer=opt, scheduler=sched,
                   checkpoint=path, resume=resume, progress=False)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a fresh run of fewer steps than built for: no warning
        run(1, 4, False)
    with pytest.warns(RuntimeWarning, match=r"OneCycleLR has total_steps=8 but this run ends it at step 6 "
                                            r"\(the steps per epoch changed"):
        run(2, 2, True)


def test_resuming_beyond_a_finished_one_cycle_schedule_is_refused_up_front(tmp_path):
    """Extending a finished one-cycle run by an epoch used to fail with torch's "Tried to step 7 times"
    after a whole epoch of work."""
    path = tmp_path / "c.pt"

    def run(epochs, loader, resume):
        model = SmallCNN(width=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=epochs, steps_per_epoch=len(loader))
        return fit(model, loader, epochs=epochs, optimizer=opt, scheduler=sched, checkpoint=path, resume=resume,
                   checkpoint_every=2, progress=False)

    run(2, ListLoader(_batches(3)), False)
    loader = ListLoader(_batches(3))
    with pytest.raises(ckpt.ResumeError, match=r"resuming: the checkpoint's OneCycleLR has total_steps=6 \(the one "
                                         r"passed to fit was built for 9, but a checkpoint's scheduler state replaces "
                                         r"it\) and has taken 6; epochs=3 needs 3 more \(9 in all, 3 epochs x 3 "
                                         r"batches, stepped per batch\).*Resume with epochs <= 2, or start a new "
                                         r"run \(resume=False\)"):
        run(3, loader, True)
    assert loader.iters == 0
    assert len(run(2, ListLoader(_batches(3)), True)) == 2   # the epochs it was built for still resume


def test_each_epoch_records_its_lr_one_per_group_when_groups_differ():
    model = SmallCNN(width=4)
    params = list(model.parameters())
    opt = torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.01}])
    (record,) = fit(model, ListLoader(_batches(2)), epochs=1, optimizer=opt, progress=False)
    assert record["lr"] == [0.1, 0.01] and current_lr(opt) == [0.1, 0.01]
    assert "  lr 0.1/0.01  " in format_record(record, 1)
    (record,) = fit(SmallCNN(width=4), ListLoader(_batches(2)), epochs=1, progress=False)
    assert record["lr"] == 1e-3 and "  lr 0.001  " in format_record(record, 1)   # the default AdamW
    old = {**record}
    del old["lr"]                                        # a record from a checkpoint written before lr
    assert " lr " not in format_record(old, 1)


def test_a_scheduler_on_another_optimizer_is_refused():
    """Without optimizer=, fit makes its own AdamW: a scheduler built on the caller's optimizer would then
    step nothing that trains."""
    model = SmallCNN(width=4)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    loader = ListLoader(_batches(1))
    with pytest.raises(ValueError, match=r"scheduler was built on another optimizer.*fit\(optimizer=opt"):
        fit(model, loader, epochs=1, scheduler=sched, progress=False)
    assert loader.iters == 0


# ---------------------------------------------------------------- torch.compile
def _compiled_fit(device: str, compile: bool, amp: str = "off"):
    """Two epochs of 44 samples in batches of 16 (the last one 12: a second shape) with evaluation."""
    import numpy as np

    images = np.random.default_rng(0).integers(0, 256, (44, 8, 8), dtype=np.uint8)
    src = ArraySource(images, np.arange(44) % 4)
    train = make_loader(src, "memory", batch_size=16, drop_last=False, device=device, augment=Augmentation.none())
    evaluation = make_loader(src, "memory", batch_size=16, drop_last=False, device=device, train=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(1), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))
    return fit(model, train, epochs=2, eval_loader=evaluation, compile=compile, amp=amp, progress=False)


def _check_compiled_fit(monkeypatch, device: str, amp: str = "off"):
    compiled = []
    real = torch.compile

    def counting(model, *args, **kwargs):
        compiled.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    eager = _compiled_fit(device, compile=False, amp=amp)
    assert compiled == []
    history = _compiled_fit(device, compile=True, amp=amp)
    assert compiled == ["Sequential"]
    # Autocast's reduced precision lets fused kernels round differently: a loose bound there (one sample
    # of 44 may flip its prediction), a tight one in fp32.
    loss_tol, acc_tol = (2e-2, 0.05) if amp != "off" else (1e-4, 1e-6)
    for a, b in zip(history, eager, strict=True):
        for key in ("train_loss", "eval_loss"):
            assert math.isclose(a[key], b[key], rel_tol=loss_tol), (key, a, b)
        for key in ("train_accuracy", "eval_accuracy"):
            assert abs(a[key] - b[key]) <= acc_tol, (key, a, b)


def test_fit_compiles_the_model_and_trains_as_eager_does(monkeypatch):
    """compile=True runs the model through torch.compile (inductor's C++ backend on the CPU): a short
    last batch (a second shape) and evaluation under no_grad both run, and the figures are eager's."""
    _check_compiled_fit(monkeypatch, "cpu")


@pytest.mark.cuda
def test_fit_compiles_the_model_on_a_gpu(monkeypatch):
    _check_compiled_fit(monkeypatch, "cuda", amp="auto")   # bf16 where the GPU has it, else fp16


# ---------------------------------------------------------------- fit's arguments
@pytest.mark.parametrize("kwargs, error, match", [
    ({"epochs": True}, TypeError, r"epochs must be an integer >= 0, got True"),
    ({"epochs": 1.5}, TypeError, r"epochs must be an integer >= 0, got 1.5"),
    ({"epochs": -1}, ValueError, r"epochs must be an integer >= 0, got -1"),
    ({"checkpoint_every": True}, TypeError, r"checkpoint_every must be an integer >= 1, got True"),
    ({"compile": "yes"}, ValueError, r"compile must be True, False or 'reduce-overhead', got 'yes'"),
    ({"compile": 1}, TypeError, r"compile must be True, False or 'reduce-overhead', got 1 \(int\)"),
    ({"progress": "no"}, TypeError, r"progress must be True or False, got 'no'"),
    ({"channels_last": 1}, TypeError, r"channels_last must be True or False, got 1"),
    ({"cudnn_benchmark": "x"}, TypeError, r"cudnn_benchmark must be True or False"),
    ({"tf32": None}, TypeError, r"tf32 must be True or False, got None"),
    ({"resume": "yes"}, TypeError, r"resume must be True or False, got 'yes'"),
    ({"scheduler": "cos"}, TypeError, r"scheduler must be a torch.optim.lr_scheduler scheduler .* got 'cos' \(str\)"),
    ({"optimizer": "sgd"}, TypeError, r"optimizer must be a torch.optim.Optimizer .* got 'sgd' \(str\)"),
    ({"eval_loader": [1, 2]}, TypeError, r"eval_loader must be a fastdata loader .* got list without device"),
    ({"loss_fn": "ce"}, TypeError, r"loss_fn must be callable .* got 'ce' \(str\)"),
    ({"eval_loss_fn": 0.1}, TypeError, r"eval_loss_fn must be callable .* got 0.1 \(float\)"),
    ({"eval_loader": "x"}, TypeError, r"eval_loader must be a fastdata loader .* got str without device"),
    ({"accumulate": 0}, ValueError, r"accumulate must be an integer >= 1, got 0"),
    ({"accumulate": 2.0}, TypeError, r"accumulate must be an integer >= 1, got 2.0"),
    ({"clip_grad_norm": 0}, ValueError, r"clip_grad_norm must be a finite number > 0, got 0"),
    ({"clip_grad_norm": math.inf}, ValueError, r"clip_grad_norm must be a finite number > 0, got inf"),
    ({"clip_grad_norm": "1"}, TypeError, r"clip_grad_norm must be a number > 0 .* got '1' \(str\)"),
    ({"ema": 1.0}, ValueError, r"ema must be a decay in \(0, 1\) such as 0.999, got 1.0"),
    ({"ema": True}, TypeError, r"ema must be a decay .* got True \(bool\)"),
    ({"ema": nn.Linear(1, 1)}, TypeError, r"ema must be a decay .*update\(model\) and a .module"),
])
def test_fit_refuses_an_argument_of_the_wrong_kind_before_training(kwargs, error, match):
    """Before: a string scheduler failed after a whole epoch, "no" showed the bar, True trained an epoch."""
    loader = ListLoader(_batches(2))
    args = {"epochs": 1, "progress": False, **kwargs}
    with pytest.raises(error, match=match):
        fit(SmallCNN(width=4), loader, **args)
    assert loader.iters == 0


def test_fit_takes_a_scheduler_optimizer_and_eval_loader_by_what_it_uses():
    """The checks refused what trained before: a hand-written scheduler with step() alone (state_dict
    is needed only for checkpoints), and an eval_loader without len() (evaluate never asks)."""
    model = SmallCNN(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Warmup:
        def __init__(self):
            self.steps = 0

        def step(self):
            self.steps += 1

    class NoLen:
        device = torch.device("cpu")

        def __iter__(self):
            return iter(_batches(1))

    warmup = Warmup()
    hist = fit(model, ListLoader(_batches(2)), epochs=1, optimizer=opt, scheduler=warmup, eval_loader=NoLen(),
               progress=False)
    assert warmup.steps == 1 and hist[0]["eval_accuracy"] is not None


def test_fit_names_a_plain_dataloader_and_a_model_that_is_not_a_module():
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1, 8, 8),
                                                                      torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TypeError, match=r"train_loader must be a fastdata loader .* got DataLoader without device: "
                                        r"a torch DataLoader .* fastdata.make_loader\(source, 'torch', ...\)"):
        fit(SmallCNN(width=4), data, epochs=1, progress=False)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got 'cnn' \(str\)"):
        fit("cnn", ListLoader(_batches(2)), epochs=1, progress=False)


def test_resuming_on_another_dataset_is_a_resume_error_naming_the_checkpoint(tmp_path):
    """A CheckpointError (ResumeError): the examples turn it into one line instead of a traceback."""
    import numpy as np

    def loader(seed):
        images = np.random.default_rng(seed).integers(0, 256, (32, 8, 8), dtype=np.uint8)
        return make_loader(ArraySource(images, np.arange(32) % 4), "memory", batch_size=8, device="cpu",
                           augment=Augmentation.none())

    path = tmp_path / "c.pt"
    fit(nn.Sequential(nn.Flatten(1), nn.Linear(64, 4)), loader(0), epochs=1, checkpoint=path, progress=False)
    with pytest.raises(ckpt.ResumeError, match=r"'.*c.pt' cannot resume this run: cannot resume this loader"):
        fit(nn.Sequential(nn.Flatten(1), nn.Linear(64, 4)), loader(1), epochs=2, checkpoint=path, resume=True,
            progress=False)
    assert issubclass(ckpt.ResumeError, ckpt.CheckpointError)


# ---------------------------------------------------------------- checkpoints of another run
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


def test_a_per_step_schedule_records_the_rate_the_epochs_last_step_used():
    """After a OneCycleLR's last step torch extrapolates past its end (the rate rises again): the last
    epoch recorded 0.0346 where its steps had annealed to ~0. Each record is now its last step's rate."""
    model = SmallCNN(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=3, steps_per_epoch=4)
    used = []

    class Log(ListLoader):
        def __iter__(self):
            for batch in super().__iter__():
                used.append(opt.param_groups[0]["lr"])   # the rate this batch's step will use
                yield batch

    hist = fit(model, Log(_batches(4)), epochs=3, optimizer=opt, scheduler=sched, progress=False)
    assert [r["lr"] for r in hist] == [used[3], used[7], used[11]]
    assert hist[-1]["lr"] < 1e-4 < opt.param_groups[0]["lr"]   # not the extrapolated rate after the end


# ------------------------------------------------------- accumulation, clipping, EMA (issue 26)
def _plain_net():
    """No BatchNorm, no dropout: a batch's gradient is the mean of its samples', whatever the split."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(1), nn.Linear(4 * 16 * 16, 10))


def _concat(batches):
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def test_accumulating_4_batches_of_64_gives_the_weights_of_batches_of_256():
    """10 batches of 64 with accumulate=4 step on groups of 4, 4 and a remainder of 2; the same samples in
    batches of 256, 256 and 128 (each the group's batches concatenated, as fastdata's plan orders them)
    train to the same weights, momentum and per-step schedule included: within atol 1e-5 in float32
    (sums of the same terms in another order)."""
    small = _batches(10, size=64, seed=5)
    large = [_concat(small[i:i + 4]) for i in range(0, 10, 4)]
    runs = []
    for batches, accumulate in ((small, 4), (large, 1)):
        model = _plain_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=2, steps_per_epoch=3)
        history = fit(model, ListLoader(batches), epochs=2, optimizer=opt, scheduler=sched, accumulate=accumulate,
                      progress=False)
        runs.append((model, history, sched.last_epoch))
    (acc, acc_hist, acc_steps), (big, big_hist, big_steps) = runs
    assert acc_steps == big_steps == 6                     # the schedule counts optimizer steps
    torch.testing.assert_close(_params(acc), _params(big), atol=1e-5, rtol=0)
    for a, b in zip(acc_hist, big_hist):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5) and a["lr"] == pytest.approx(b["lr"])
    model = _plain_net()
    fit(model, ListLoader(small), epochs=2, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        progress=False)
    assert not torch.allclose(_params(model), _params(big), atol=1e-3)   # without accumulate: other weights


def test_a_onecycle_schedule_built_for_batches_is_refused_under_accumulate():
    model = _plain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=2, steps_per_epoch=2)
    with pytest.raises(ValueError, match=r"2 epochs x 3 optimizer steps of 4 batches.*steps_per_epoch="
                                         r"math.ceil\(len\(train_loader\) / 4\)"):
        fit(model, ListLoader(_batches(10, size=4)), epochs=2, optimizer=opt, scheduler=sched, accumulate=4,
            progress=False)


class _FakeDDP(nn.Module):
    """Stands for DistributedDataParallel on the CPU: counts the batches run inside ``no_sync``."""

    def __init__(self, module):
        super().__init__()
        self.module, self.quiet, self.inside = module, 0, False

    def forward(self, x):
        self.quiet += self.inside
        return self.module(x)

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def test_under_ddp_all_but_the_last_batch_of_a_step_run_in_no_sync():
    """One gradient all-reduce per optimizer step: 10 batches in steps of 4, 4 and 2 run 3 + 3 + 1 of
    them inside no_sync; an empty batch (a rank's share of a short last step) still runs its part."""
    model = _plain_net()
    ddp = _FakeDDP(model)
    stepped = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda *a: stepped.append(1))
    step = TrainStep(ddp, model, opt, torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(),
                     torch.device("cpu"), "off", ddp=True, accumulate=4)
    step.eager = ddp
    batches = _batches(10, size=4)
    batches[9] = (batches[9][0][:0], batches[9][1][:0])
    train_one_epoch(step, ListLoader(batches), EpochMeter(torch.device("cpu")))
    assert ddp.quiet == 7 and len(stepped) == 3


def test_an_empty_last_batch_of_a_step_still_steps_on_the_batches_before_it():
    batches = _batches(4, size=8)
    emptied = batches[:1] + [(batches[1][0][:0], batches[1][1][:0])] + batches[2:]
    model = _plain_net()
    fit(model, ListLoader(emptied), epochs=1, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2,
        progress=False)
    # The first step saw one batch (its loss over 1/2: a step of its group's mean, with one batch missing).
    ref = _plain_net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for group in ([batches[0]], batches[2:]):
        opt.zero_grad()
        for x, y in group:
            (nn.functional.cross_entropy(ref(x), y) / 2).backward()
        opt.step()
    torch.testing.assert_close(_params(model), _params(ref), atol=1e-6, rtol=0)


def test_clipping_bounds_a_huge_step_to_the_manually_clipped_one():
    """lr 100: unclipped, the step is enormous; clipped to norm 0.5 it equals clip_grad_norm_ by hand, and
    the record's grad_norm is the norm before clipping."""
    (x, y), = _batches(1, size=16, seed=2)
    ref = _plain_net()
    nn.functional.cross_entropy(ref(x), y).backward()
    norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 100 * p.grad
    model = _plain_net()
    (record,) = fit(model, ListLoader([(x, y)]), epochs=1, optimizer=torch.optim.SGD(model.parameters(), lr=100.0),
                    clip_grad_norm=0.5, progress=False)
    torch.testing.assert_close(_params(model), _params(ref), atol=1e-5, rtol=1e-5)
    assert record["grad_norm"] == pytest.approx(norm.item(), rel=1e-5) and norm.item() > 0.5
    start = _params(_plain_net())
    assert (_params(model) - start).norm() <= 100 * 0.5 * 1.001          # bounded by lr x clip
    unclipped = _plain_net()
    (plain,) = fit(unclipped, ListLoader([(x, y)]), epochs=1, progress=False,
                   optimizer=torch.optim.SGD(unclipped.parameters(), lr=100.0))
    assert (_params(unclipped) - start).norm() > 100 * 0.5 * 1.5 and "grad_norm" not in plain


def test_ema_after_k_steps_is_the_reference_recurrence_and_is_what_is_evaluated():
    from fastdata.engine import ModelEma

    model = _plain_net()
    ema = ModelEma(model, 0.8)
    avg = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def follow(*_):   # the recurrence, from the weights after every optimizer step
        for a, p in zip(avg, model.parameters()):
            a.mul_(0.8).add_(p.detach(), alpha=0.2)

    opt.register_step_post_hook(follow)
    loader = ListLoader(_batches(5, size=8))
    (record,) = fit(model, loader, epochs=1, optimizer=opt, ema=ema, eval_loader=loader, progress=False)
    for a, e in zip(avg, ema.module.parameters()):
        torch.testing.assert_close(e, a, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(_params(ema.module), _params(model))
    assert record["eval_ema"] is True
    assert record["eval_loss"] == pytest.approx(evaluate(ema.module, loader)["loss"], rel=1e-6)
    assert record["eval_loss"] != pytest.approx(evaluate(model, loader)["loss"], rel=1e-6)


def test_a_resume_with_accumulate_clip_and_ema_gives_the_uninterrupted_run(tmp_path):
    """checkpoint_every=3 under accumulate=2: the save due after batch 3 waits for the step's end (batch 4),
    so no checkpoint holds half a step; the crash after 5 batches resumes from batch 4 to the uninterrupted
    run's weights and weight average; the checkpoint keeps the average."""
    from fastdata.engine import ModelEma

    batches = _batches(7, size=8, seed=9)

    def run(loader, path, resume):
        model = _plain_net()
        ema = ModelEma(model, 0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        fit(model, loader, epochs=2, optimizer=opt, accumulate=2, clip_grad_norm=1.0, ema=ema, checkpoint=path,
            checkpoint_every=3, resume=resume, progress=False)
        return model, ema

    whole, whole_ema = run(ListLoader(batches), tmp_path / "whole.pt", False)
    path = tmp_path / "c.pt"
    with pytest.raises(Crash):
        run(Recording(ListLoader(batches), crash_after=5), path, False)
    saved = torch.load(path, weights_only=True)
    assert saved["loader"] == {"epoch": 0, "batch": 4} and saved["ema"] is not None
    model, ema = run(ListLoader(batches), path, True)
    torch.testing.assert_close(_params(model), _params(whole), atol=0, rtol=0)
    torch.testing.assert_close(_params(ema.module), _params(whole_ema.module), atol=0, rtol=0)


def test_compile_reduce_overhead_on_the_cpu_falls_back_to_compile_with_one_warning(monkeypatch):
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: modes.append(mode) or model)
    loader = ListLoader(_batches(2, size=4))
    with pytest.warns(RuntimeWarning, match=r"compile='reduce-overhead' \(CUDA graphs\) needs a CUDA device; on "
                                            r"cpu fit compiles with compile=True instead") as caught:
        fit(_plain_net(), loader, epochs=1, compile="reduce-overhead", progress=False)
    assert modes == [None] and len([w for w in caught if "reduce-overhead" in str(w.message)]) == 1
    fit(_plain_net(), loader, epochs=1, compile=True, progress=False)
    assert modes == [None, None]


def test_under_cuda_graphs_only_batches_of_the_first_size_run_the_compiled_module():
    """A CUDA graph is recorded per shape: the last short batch, an empty one and evaluation go eager,
    so none records a graph used once (checked here with the graphs flag set by hand on the CPU)."""
    class Seen(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.sizes = inner, []

        def forward(self, x):
            self.sizes.append(x.shape[0])
            return self.inner(x)

    model = _plain_net()
    compiled = Seen(model)
    step = TrainStep(compiled, model, torch.optim.SGD(model.parameters(), lr=0.1),
                     torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(), torch.device("cpu"),
                     "off", ddp=False)
    step.graphs, step.eager = True, model
    batches = _batches(3, size=8) + [(b[0][:5], b[1][:5]) for b in _batches(1, size=8, seed=3)]
    meter = EpochMeter(torch.device("cpu"))
    train_one_epoch(step, ListLoader(batches), meter)
    assert compiled.sizes == [8, 8, 8] and meter.sums[2].item() == 29
    assert step.eval_net is model


@pytest.mark.cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_accumulate_clip_and_ema_under_amp_on_a_gpu(amp):
    from fastdata.engine import ModelEma

    model = _plain_net()
    ema = ModelEma(model, 0.9)
    loader = ListLoader(_batches(7, size=16, device="cuda"), device="cuda")
    history = fit(model, loader, epochs=2, amp=amp, accumulate=3, clip_grad_norm=1.0, ema=ema, eval_loader=loader,
                  progress=False)
    assert all(math.isfinite(r[k]) for r in history for k in ("train_loss", "eval_loss", "grad_norm"))
    assert history[-1]["eval_ema"] is True and ema.module.training is False
    assert not torch.allclose(_params(ema.module), _params(model))
    assert all(torch.isfinite(p).all() for p in ema.module.parameters())


@pytest.mark.cuda
def test_compile_reduce_overhead_on_a_gpu_trains_with_a_short_last_batch_and_evaluates():
    eager = _compiled_fit("cuda", compile=False)
    graphs = _compiled_fit("cuda", compile="reduce-overhead")
    for a, b in zip(graphs, eager, strict=True):
        assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=1e-2)
        assert math.isfinite(a["eval_loss"])


# ------------------------------------------------------------- profiler, run log, checkpointing (issue 26)
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


def test_fit_gradient_checkpointing_trains_the_same_weights(tmp_path):
    batches = _batches(4, size=16)
    trained = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = SmallCNN(width=4)
        fit(model, ListLoader(batches), epochs=1, amp="off", progress=False, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9), gradient_checkpointing=checkpointing)
        trained.append(model)
    assert type(trained[1].features).__name__ == "CheckpointedSequential"   # it was switched on
    torch.testing.assert_close(_params(trained[1]), _params(trained[0]), atol=1e-5, rtol=0)
    for a, b in zip(trained[0].buffers(), trained[1].buffers()):   # BatchNorm statistics moved once per step
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_fit_refuses_a_model_gradient_checkpointing_cannot_split_before_training():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 10)

        def forward(self, x):
            return self.fc(x.flatten(1))

    loader = ListLoader(_batches(2))
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True.*cannot split a .*Plain"):
        fit(Plain(), loader, epochs=1, progress=False, gradient_checkpointing=True)
    assert loader.iters == 0


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


def _fit_as(uid, log_dir, queue):
    """In a forked child: drop to ``uid`` (when root) and start fit with ``log_dir``; report the error."""
    import os

    try:
        if os.geteuid() == 0:
            os.setgid(uid)
            os.setuid(uid)
        fit(SmallCNN(width=4), ListLoader(_batches(2)), epochs=1, progress=False, log_dir=log_dir)
        queue.put(None)
    except BaseException as e:  # reported, not raised: the parent asserts on it
        queue.put(f"{type(e).__name__}: {e}")


def test_fit_refuses_a_log_dir_it_cannot_write():
    """Root writes anywhere (CI runs as root), so fit runs in a forked child that gives up root (uid
    nobody) against a root-owned read-only folder: a user's unwritable folder (as test_checkpoint does)."""
    import multiprocessing as mp
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
        fit(SmallCNN(width=4), ListLoader(_batches(2)), epochs=1, progress=False, log_dir=os.path.join(base, "warm"))
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        child = ctx.Process(target=_fit_as, args=(65534, os.path.join(locked, "run"), q))
        child.start()
        child.join(120)
        error = q.get(timeout=5)
        assert error is not None and error.startswith("ValueError"), error
        assert re.search(r"log_dir=.*cannot be written.*not a writable folder", error), error
        assert os.listdir(locked) == []
    finally:
        shutil.rmtree(base)
