"""Helpers shared by the engine's tests (tests/test_engine_*.py) and the CUDA training tests: loaders of the
contract, a crash to stop a run, small batches and models, a clock moved only by the costs charged to it,
and a diagnosis of where an epoch's data wait came from (``traced_waits``, ``wait_diagnosis``)."""
import contextlib
import statistics
import time

import torch
from torch import nn

from fastdata import available_backends

BACKENDS = [b for b in available_backends() if b != "auto"]


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

    def finish_group(self, planned, arrived):
        self.optimizer_step()


def _plain_net():
    """No BatchNorm, no dropout: a batch's gradient is the mean of its samples', whatever the split."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(1), nn.Linear(4 * 16 * 16, 10))


class Clock:
    """The clock the bench and fit's meter read (their ``time.perf_counter``), moved only by the costs
    charged to it: what they measure is then the cost model, whatever else the cores are doing."""

    def __init__(self, monkeypatch):
        import types

        from fastdata import bench
        from fastdata.engine import hooks, meter

        self.now = 0.0
        fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
        fake.perf_counter = lambda: self.now
        for module in (bench, meter, hooks):
            monkeypatch.setattr(module, "time", fake)

    def charge(self, seconds: float):
        self.now += seconds


@contextlib.contextmanager
def traced_waits():
    """Every ``EpochMeter`` made inside keeps its trace of waits (``EpochMeter.trace``), and Python's
    garbage collections are timed (``gc.callbacks``): yields (the meters, the collections as
    (start, seconds, generation))."""
    import gc

    from fastdata.engine.meter import EpochMeter

    meters: list = []
    collections: list = []
    started: list = []
    original = EpochMeter.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.trace = []
        meters.append(self)

    def on_gc(phase, info):
        now = time.perf_counter()
        if phase == "start":
            started[:] = [now]
        elif started:
            collections.append((started[0], now - started.pop(), info["generation"]))

    EpochMeter.__init__ = init
    gc.callbacks.append(on_gc)
    try:
        yield meters, collections
    finally:
        EpochMeter.__init__ = original
        gc.callbacks.remove(on_gc)


def wait_diagnosis(meter, seconds: float, collections: list) -> str:
    """Where an epoch's counted data wait came from (``meter.trace``: ``iter()`` first, then each
    ``next``): ``iter()``, the first batch, the rest (how many counted, their median, the five longest
    with their batch numbers: periodic ones are the memory backend's group gathers), and the garbage
    collections that ran inside a counted wait. Milliseconds, and percent of the epoch's ``seconds``."""
    trace = meter.trace
    if not trace:
        return "no trace"
    (_, it, _), first, rest = trace[0], trace[1] if len(trace) > 1 else (0.0, 0.0, False), trace[2:]
    counted = [(k + 1, w) for k, (_, w, c) in enumerate(rest) if c]
    top = sorted(counted, key=lambda kw: -kw[1])[:5]
    windows = [(t, t + w) for t, w, c in trace if c]
    in_gc = [(s, d, g) for s, d, g in collections if any(a <= s < b for a, b in windows)]
    ms = 1e3
    total = sum(w for _, w in counted) + it + (first[1] if first[2] else 0.0)
    return (f"counted {total * ms:.2f} ms ({total / seconds:.2%}): iter() {it * ms:.2f} ms, first batch "
            f"{first[1] * ms:.2f} ms{'' if first[2] else ' (not counted)'}, {len(counted)} of {len(rest)} "
            f"later batches counted, median {statistics.median([w for _, w in counted] or [0]) * 1e6:.0f} us, "
            f"longest {', '.join(f'#{k} {w * ms:.2f}' for k, w in top)} ms; gc inside counted waits: "
            f"{len(in_gc)} ({sum(d for _, d, _ in in_gc) * ms:.2f} ms)")


def first_command_run(backend: str, epochs: int = 3, *, device: str = "cuda",
                      samples: int = 60_000, **options) -> tuple[list, str]:
    """``train_mnist.py``'s recipe (SmallCNN on 60,000 digits, batch 256, SGD fused with Nesterov
    momentum, one cycle) on ``backend`` (with the backend's ``options``), its waits traced: (fit's
    records, each epoch's ``wait_diagnosis`` joined by lines). The CUDA data-wait tests of the memory
    and dali backends."""
    from fastdata import make_loader
    from fastdata.datasets import SyntheticDigits
    from fastdata.engine import fit
    from fastdata.models import SmallCNN

    loader = make_loader(SyntheticDigits(samples, seed=0), backend, batch_size=256, device=device, seed=0,
                         **options)
    model = SmallCNN(num_classes=10, in_channels=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                fused=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, epochs=epochs,
                                                    steps_per_epoch=len(loader))
    try:
        with traced_waits() as (meters, collections):
            history = fit(model, loader, epochs=epochs, optimizer=optimizer, scheduler=scheduler, progress=False)
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    diagnosis = "\n".join(f"epoch {e + 1}: {wait_diagnosis(m, r['seconds'], collections)}"
                          for e, (m, r) in enumerate(zip(meters, history, strict=True)))
    return history, diagnosis
