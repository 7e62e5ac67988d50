"""Learning-rate schedules in ``fit``: when a scheduler is stepped (``resolve_scheduler_interval``), a
OneCycleLR refused before training when the run would step past its end (``check_schedule_length``), and
the rate an epoch reports (``current_lr``), a resume under another peak rate refused (``check_same_peak_lr``)."""
from __future__ import annotations

import math
import warnings

import torch

from .. import checkpoint as ckpt
from .. import distributed as fdist
from ..errors import user_stacklevel

# When fit steps a scheduler (see ``resolve_scheduler_interval``). None picks by the scheduler's class.
SCHEDULER_INTERVALS = ("step", "epoch")


# Schedules whose period is counted in optimizer steps: torch's own examples step them after every batch.
PER_STEP_SCHEDULERS = (torch.optim.lr_scheduler.OneCycleLR, torch.optim.lr_scheduler.CyclicLR)


def resolve_scheduler_interval(scheduler, interval: str | None = None) -> str | None:
    """When ``fit`` steps ``scheduler``: ``"step"`` (after every optimizer step) or ``"epoch"`` (once at
    each epoch's end, after evaluation); None when there is no scheduler.

    ``interval=None`` picks by class: OneCycleLR and CyclicLR (periods counted in batches) → ``"step"``;
    every other scheduler → ``"epoch"``, so ``MultiStepLR(milestones=[30])`` decays after epoch 30 as
    its docs mean. A scheduler built in steps of another kind (a per-step ``LambdaLR`` warm-up, a
    ``CosineAnnealingLR(T_max=total_steps)``) needs ``interval="step"`` said. ``ReduceLROnPlateau`` is
    always ``"epoch"``: its ``step`` takes the epoch's loss, which a batch does not have.
    """
    if interval is not None and interval not in SCHEDULER_INTERVALS:
        raise ValueError(f"unknown scheduler_interval {interval!r}; choose from ['step', 'epoch', None] "
                         f"(None: 'step' for OneCycleLR/CyclicLR, 'epoch' for any other scheduler)")
    if scheduler is None:
        return None
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        if interval == "step":
            raise ValueError("ReduceLROnPlateau cannot be stepped per batch: fit steps it once per epoch with "
                             "the eval loss (the training loss without an eval_loader); pass "
                             "scheduler_interval='epoch' or None")
        return "epoch"
    if interval is not None:
        return interval
    return "step" if isinstance(scheduler, PER_STEP_SCHEDULERS) else "epoch"


def check_schedule_length(scheduler, interval, *, epochs: int, start_epoch: int, start_batch: int,
                           batches: int, built_total: int | None = None, accumulate: int = 1) -> None:
    """Refuse, before any training, a OneCycleLR that the run would step past its ``total_steps``.

    torch raises only when the step beyond the end comes ("Tried to step 51 times"), possibly hours
    in. The steps the run takes are counted from the scheduler's own count (``last_epoch``: restored
    from a checkpoint when resuming) plus the batches (or epochs) left; batches a single process skips
    (empty ones) only make the real count smaller. ``built_total``: the ``total_steps`` of the
    scheduler as passed, before a checkpoint's state replaced it. ``accumulate``: batches per optimizer
    step, so an epoch is ``ceil(batches / accumulate)`` steps, of which a resume at ``start_batch`` (a
    step boundary) has taken ``start_batch // accumulate``.
    """
    if not isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) or epochs <= start_epoch:
        return
    steps_hint = "len(train_loader)" if accumulate == 1 else f"math.ceil(len(train_loader) / {accumulate})"
    batches, start_batch = -(-batches // accumulate), start_batch // accumulate
    total, taken = scheduler.total_steps, scheduler.last_epoch
    unit = "batch" if interval == "step" else "epoch"
    left = (epochs - start_epoch) * batches - start_batch if unit == "batch" else epochs - start_epoch
    needed = taken + left
    resumed = taken > 0 or start_epoch > 0 or start_batch > 0
    if resumed and needed < total and unit == "batch" and fdist.is_main():
        # Resumed with more samples a step (another world size, batch size or accumulate): fewer steps are left than
        # the schedule has, and the run would stop mid-anneal at a high rate without a word. Rank 0 says it
        # (every rank computes the same numbers): 8 ranks printed it 8 times.
        warnings.warn(f"resuming: the checkpoint's OneCycleLR has total_steps={total} but this run ends it at "
                      f"step {needed} (the steps per epoch changed: another world size, batch size or "
                      f"accumulate than the saved run's, or fewer epochs), so "
                      f"its learning rate stops before annealing to its end", RuntimeWarning,
                      stacklevel=user_stacklevel())
    if needed <= total:
        return
    per_epoch = batches if unit == "batch" else 1
    per = "batches" if accumulate == 1 else f"optimizer steps of {accumulate} batches"
    shape = f"{epochs} epochs x {batches} {per}" if unit == "batch" else f"{epochs} epochs"
    if taken == 0 and start_epoch == 0 and start_batch == 0:
        build = (f"epochs={epochs}, steps_per_epoch={steps_hint}" if unit == "batch"
                 else f"total_steps={epochs}")
        raise ValueError(f"OneCycleLR has total_steps={total} but this run steps it {needed} times ({shape}, "
                         f"stepped per {unit}): torch would fail at step {total + 1}. Build it for this run: "
                         f"OneCycleLR(optimizer, max_lr, {build}), or train for fewer epochs")
    most = start_epoch + max(0, (total - taken + (start_batch if unit == "batch" else 0)) // per_epoch)
    passed = (f" (the one passed to fit was built for {built_total}, but a checkpoint's scheduler state "
              f"replaces it)" if built_total is not None and built_total != total else "")
    raise ckpt.ResumeError(
        f"resuming: the checkpoint's OneCycleLR has total_steps={total}{passed} and has taken {taken}; "
        f"epochs={epochs} needs {left} more ({needed} in all, {shape}, stepped per {unit}): a one-cycle "
        f"schedule cannot be stretched once it has started. Resume with epochs <= {most}, or start a new run "
        f"(resume=False) with the scheduler built for the new epochs (its model may start from the checkpoint's "
        f"weights: fastdata.checkpoint.load(path)['model'])")


class PeakLrChanged(ckpt.ResumeError):
    """A resume under another peak learning rate than the checkpoint's schedule: ``was`` (saved) and
    ``now`` (this run's), so that a training script can name its own flag (see ``cli.fit_errors``)."""

    def __init__(self, path, was: float, now: float, arg: str = "max_lr"):
        # ``arg``: what sets the rate. OneCycleLR's max_lr; any other scheduler starts from the
        # optimizer's lr (its initial_lr), and a StepLR user told "max_lr" has no such argument.
        super().__init__(f"'{path}' was saved by a run whose schedule peaks at lr {was:g}, and resuming restores "
                         f"it: this run's {now:g} would be ignored. Resume with {arg}={was:g}, or start a new "
                         f"run (resume=False)")
        self.path, self.was, self.now, self.arg = path, was, now, arg

    def __reduce__(self):
        return (PeakLrChanged, (self.path, self.was, self.now, self.arg))


def check_same_peak_lr(state: dict, optimizer, path) -> None:
    """Refuse a resume whose scheduler peaks at another rate than the saved one's: loading the optimizer
    restores each group's ``max_lr`` (OneCycleLR) or ``initial_lr`` (any other scheduler), so a changed
    rate trained at the saved one without a word. Groups without either (no scheduler) are not judged."""
    def peaks(groups) -> list:
        return [g.get("max_lr", g.get("initial_lr")) for g in groups]

    was = peaks((state.get("optimizer") or {}).get("param_groups") or [])
    now = peaks(optimizer.param_groups)
    if not was or None in was or None in now or len(was) != len(now):
        return
    for a, b, group in zip(was, now, optimizer.param_groups):
        if not math.isclose(float(a), float(b), rel_tol=1e-6):
            raise PeakLrChanged(path, float(a), float(b), "max_lr" if "max_lr" in group else "the optimizer's lr")


def current_lr(optimizer) -> float | list[float]:
    """The optimizer's learning rate: one float when every parameter group has the same, else one per
    group (a list, in group order). A tensor lr is read on the host (once per epoch in ``fit``)."""
    return one_or_each([group["lr"] for group in optimizer.param_groups])


def one_or_each(lrs) -> float | list[float]:
    """Learning rates (floats or tensors) as one float when every group has the same, else a list."""
    lrs = [float(lr) for lr in lrs]
    return lrs[0] if len(set(lrs)) == 1 else lrs
