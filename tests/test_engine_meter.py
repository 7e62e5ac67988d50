"""Tests of the epoch figures (fastdata/engine/meter.py): warm-up and steady state, GPU idle, data wait, the
progress bar."""
import math

import pytest
import torch
from torch import nn

from engine_helpers import Clock, CountingStep, ListLoader, Wrapper, _batches
from fastdata import make_loader
from fastdata.datasets import ArraySource, SyntheticDigits
from fastdata.engine import (
    EpochMeter,
    StepTimer,
    fit,
    format_record,
    idle_fraction,
    train_one_epoch,
)
from fastdata.models import SmallCNN


def test_idle_fraction_from_event_pairs():
    class Ev:
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):
            return other.t - self.t

    starts, ends = [Ev(0), Ev(10), Ev(25)], [Ev(8), Ev(20), Ev(30)]
    assert idle_fraction(starts, ends) == pytest.approx((2 + 5) / 30)
    assert idle_fraction([], []) is None


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
    # This rank's clock moves by nothing: its wait is exactly 0 (on real time, a millisecond epoch read a
    # wait fraction of 0.2 under a loaded full run, and the mean missed 0.25 +- 0.05).
    Clock(monkeypatch)
    meter = EpochMeter(torch.device("cpu"), warmup_steps=1)
    train_one_epoch(CountingStep(), ListLoader(_batches(4, size=8)), meter)   # 32 images, 8 of warm-up
    record = meter.record(1)
    assert record["images"] == 72 and record["seconds"] == 100.0
    assert record["warmup_seconds"] == pytest.approx(40.0)
    assert record["images_per_second"] == pytest.approx((72 - 8 - 16) / 60)
    assert record["data_wait_fraction"] == pytest.approx(0.25)   # (0 here + 0.5 there) / 2 ranks


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


def test_a_wait_counts_only_where_the_gpu_ran_out_of_work(monkeypatch):
    """On a GPU, EpochMeter.timed adds a next() to the data wait only if the event recorded on the
    training stream as it began has completed by its end (meter.gpu_starved): a wait with the GPU still
    busy on earlier work (a launch blocked on a full queue) cost the GPU nothing. On an H200 a gather
    of ready batches read 2.4% data wait with the GPU busy throughout. On the CPU every wait counts.
    The meter's own calls (the mark's record and query: tens of microseconds a batch, ~0.4% of a 3.5 ms
    step that is host-bound, where every wait counts) are outside the timed span."""
    done = iter([False, True, False])   # the GPU: busy, idle, busy at the end of each of three waits
    recorded = []

    class Mark:
        def record(self, stream=None):
            recorded.append(stream)
            clock.charge(0.02)   # the meter's own call, before the wait: not the loader's

        def query(self):
            clock.charge(0.03)   # the meter's own call, after the wait: not the loader's
            return next(done)

    clock = Clock(monkeypatch)   # each next() costs exactly 50 ms of the meter's clock

    class Slow:
        def __iter__(self):
            for i in range(3):
                clock.charge(0.05)
                yield i

    monkeypatch.setattr(torch.cuda, "Event", Mark)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("training stream of", device))
    meter = EpochMeter(torch.device("cpu"))
    meter.device = torch.device("cuda", 1)   # built on the CPU (its sums), timing as on cuda:1
    assert list(meter.timed(Slow())) == [0, 1, 2]
    assert recorded == [("training stream of", torch.device("cuda", 1))] * 4   # 3 batches and the end
    assert meter.wait == pytest.approx(0.05)   # the one wait that found the GPU idle
    cpu = EpochMeter(torch.device("cpu"))
    assert list(cpu.timed(Slow())) == [0, 1, 2] and cpu.wait == pytest.approx(0.15)
    # The trace (a diagnosis of where a wait figure came from): iter() first, then every next() with
    # its time and whether it counted; None, and nothing kept, unless asked for.
    assert meter.trace is None
    meter.trace, meter.wait = [], 0.0
    done = iter([False, True, False])
    assert list(meter.timed(Slow())) == [0, 1, 2]
    assert [(round(w, 6), c) for _, w, c in meter.trace] == [(0.0, True), (0.05, False), (0.05, True),
                                                              (0.05, False)]
    assert sum(w for _, w, c in meter.trace if c) == pytest.approx(meter.wait)

