"""Tests of learning-rate schedulers (fastdata/engine/schedule.py)."""
import pytest
import torch
from torch import nn

from engine_helpers import Crash, ListLoader, Recording, _batches, _params, _plain_net
from fastdata import checkpoint as ckpt
from fastdata.engine import (
    current_lr,
    fit,
    format_record,
    resolve_scheduler_interval,
)
from fastdata.models import SmallCNN


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


def test_a_onecycle_schedule_built_for_batches_is_refused_under_accumulate():
    model = _plain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, epochs=2, steps_per_epoch=2)
    with pytest.raises(ValueError, match=r"2 epochs x 3 optimizer steps of 4 batches.*steps_per_epoch="
                                         r"math.ceil\(len\(train_loader\) / 4\)"):
        fit(model, ListLoader(_batches(10, size=4)), epochs=2, optimizer=opt, scheduler=sched, accumulate=4,
            progress=False)
