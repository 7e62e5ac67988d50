"""Helpers shared by the engine's tests (tests/test_engine_*.py): loaders of the contract, a crash
to stop a run, small batches and models, and a clock moved only by the costs charged to it."""
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
