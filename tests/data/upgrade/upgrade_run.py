"""The run every upgrade fixture records (``make_fixture.py``) and ``tests/test_qa_upgrade.py`` resumes.
Only what every fastdata release has: the same definitions give the same weights under the old release
and this one."""
import torch
from torch import nn

BACKENDS = ("torch", "memory", "prefetch", "dali")


class Tiny(nn.Module):
    """28x28 grey -> 7x7 average -> dropout (the RNG states must be restored) -> 10 classes: 500
    parameters, a checkpoint of a few KB. ``crash_at``: the training forward call that raises, as a
    killed run stops."""

    def __init__(self, crash_at=None):
        super().__init__()
        self.pool, self.drop, self.fc = nn.AvgPool2d(4), nn.Dropout(0.2), nn.Linear(49, 10)
        self.calls, self.crash_at = 0, crash_at

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.crash_at:
                raise KeyboardInterrupt("the run is killed here")
        return self.fc(self.drop(self.pool(x).flatten(1)))


def loader_args(backend: str) -> dict:
    return {"batch_size": 8, "device": "cpu", "seed": 5, **({"num_workers": 0} if backend == "torch" else {})}


def run(path, *, crash_at=None, resume=False, log_dir=None, seed=0):
    """Two epochs of 6 steps under a per-step OneCycleLR, saving every 4 steps; returns (history, model),
    history None when the run was killed."""
    from fastdata import fit, make_loader
    from fastdata.datasets import SyntheticDigits

    torch.manual_seed(seed)
    model = Tiny(crash_at)
    train = make_loader(SyntheticDigits(96, seed=1), backend="memory", batch_size=16, device="cpu", seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=2 * len(train))
    options = dict(epochs=2, optimizer=opt, scheduler=sched, scheduler_interval="step", checkpoint=path,
                   checkpoint_every=4, progress=False, resume=resume)
    if not _accepts(fit, "scheduler_interval"):   # before it the scheduler was stepped per step, as here
        del options["scheduler_interval"]
    if log_dir is not None:
        options.update(log_dir=log_dir, log_every=1)
    try:
        return fit(model, train, **options), model
    except KeyboardInterrupt:
        return None, model


def _accepts(fit, name: str) -> bool:
    """Whether this release's ``fit`` takes the keyword ``name`` (its own or ``FitConfig``'s)."""
    import inspect

    import fastdata

    fields = getattr(getattr(fastdata, "FitConfig", None), "__dataclass_fields__", {})
    return name in fields or name in inspect.signature(fit).parameters
