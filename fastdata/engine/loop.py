"""The loop itself: ``fit`` (its arguments checked up front, then the epochs), ``train_one_epoch`` and
``evaluate``."""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .. import distributed as fdist
from .amp import autocast, cuda_switches, device_scope, resolve_amp
from .hooks import RunHooks
from .meter import EpochMeter, Progress, format_record, warmup_steps
from .options import FitConfig, check_loss
from .schedule import check_schedule_length
from .state import PeriodicSave, TrainingState, check_diverged
from .step import (
    TrainStep,
    batch_pair,
    check_batch_device,
    check_input_dtype,
    check_labels,
    compiled_original,
    correct_count,
    loss_value,
)


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, amp: str = "auto", loss_fn=None) -> dict:
    """Mean loss and accuracy of ``model`` over one pass of ``loader`` (summed over ranks under DDP).

    Returns ``{"loss", "accuracy" (0-1), "samples"}``. The model's train/eval mode is restored after.
    Labels may be class indices (int64 (N,)) or soft targets (float (N, classes), as MixUp/CutMix make
    them): the default ``nn.CrossEntropyLoss`` takes both, and a soft label counts as right when
    ``argmax(logits) == argmax(labels)``. ``loss_fn`` is the evaluation loss (``fit`` passes its
    ``eval_loss_fn``): give a training loss here only if it takes the evaluation labels (timm's
    ``SoftTargetCrossEntropy`` takes soft targets alone, and evaluation labels are usually class indices).
    """
    check_loss("loss_fn", loss_fn)
    _check_loader("loader", loader)   # before .device: a plain DataLoader was a bare AttributeError
    fdist.check_shard(loader, "the evaluation loader")   # its sums are reduced over ranks
    device = _loader_device(loader)
    _check_eval_model_device(model, device)
    with device_scope(device):
        return _evaluate(model, loader, device, amp, loss_fn)


def _check_eval_model_device(model: nn.Module, device: torch.device) -> None:
    """A model wholly on another device than the evaluation loader's batches, named with both (it failed
    inside its first layer with torch's "Tensor on device ... is not on the expected device"). Unlike
    fit, evaluate does not move the model: the caller's model stays where it was put. A model split over
    devices (model parallel, a part offloaded to the CPU) with a part on the loader's passes."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    elsewhere = sorted(str(d) for d in devices)
    if devices and device not in devices:
        raise ValueError(f"the model is on {', '.join(elsewhere)} but the evaluation loader yields batches on "
                         f"{device}: move the model with model.to('{device}'), or build the loader with "
                         f"device='{elsewhere[0]}'")


def _evaluate(model, loader, device, amp, loss_fn) -> dict:
    mode = resolve_amp(amp, device)
    loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, samples
    # even_batches pads the last step with samples other ranks read: counted once, by the rank that read them.
    # A fastdata loader says how many rows of each batch are padding (batch_padding: fewer than padding()
    # when on_error="skip" dropped a padding sample, whose row is then missing, not a real sample's).
    rows = isinstance(getattr(type(loader), "batch_padding", None), property)
    padding = loader.padding() if not rows and callable(getattr(loader, "padding", None)) else 0
    last = len(loader) - 1 if padding else -1
    try:
        for k, pair in enumerate(loader):
            images, labels = batch_pair(pair, "the evaluation loader")
            cut = loader.batch_padding if rows else padding if k == last else 0
            if cut:
                images, labels = images[:images.shape[0] - cut], labels[:labels.shape[0] - cut]
            check_input_dtype(images.dtype, model_dtype, mode, "the evaluation loader")
            if k == 0:
                check_batch_device(images, labels, device, "the evaluation loader")
            n = images.shape[0]
            if n == 0:  # a rank's share of the last step can be empty under DDP
                continue
            with autocast(device, mode):
                logits = model(images)
                check_labels(logits, labels)
                loss = loss_value(loss_fn(logits, labels), "the evaluation loss (evaluate's loss_fn, fit's "
                                  "eval_loss_fn)", grad=False)
            sums[0] += loss.detach().double() * n
            sums[1] += correct_count(logits, labels)
            sums[2] += n
    finally:
        model.train(was_training)
    loss_sum, correct, samples = fdist.all_sum(sums).tolist()
    if samples == 0:
        return {"loss": math.nan, "accuracy": math.nan, "samples": 0}
    return {"loss": loss_sum / samples, "accuracy": correct / samples, "samples": int(samples)}


def fit(model: nn.Module, train_loader, *, config: FitConfig | None = None, **options) -> list[dict]:
    """Train ``model`` for ``epochs`` passes over ``train_loader``; return one record per epoch.

    The options are ``FitConfig``'s fields, given as keywords (``fit(model, loader, epochs=3,
    amp="bf16")``), as one object (``fit(model, loader, config=FitConfig(epochs=3, amp="bf16"))``), or
    both: keywords then override the config's fields (``dataclasses.replace``), so a shared config can
    be run with one option changed. ``epochs`` is required one way or the other; every option is
    documented, with its default, on ``FitConfig``, and checked before anything starts.

    Args:
        model: an ``nn.Module``; moved to ``train_loader.device`` when its parameters are on the CPU. A
            model already on another device than the loader's is an error. Under ``torchrun`` it is
            wrapped in DistributedDataParallel on the loader's GPU (the process group is initialized
            here if the caller did not), and on CUDA that GPU must be ``cuda:LOCAL_RANK``. A model the
            caller wrapped in DistributedDataParallel is trained through that wrapper as it was built
            (its process group, ``find_unused_parameters``, ``static_graph``, bucket sizes).
        train_loader: any fastdata loader, or an object with ``device``, ``len()`` and a new pass over
            ``(images, labels)`` at each ``iter()``; ``set_epoch(epoch)`` is called when it has one, and
            ``checkpoint=`` needs ``state_dict``/``load_state_dict`` (its position). It decides the device:
            training runs with that CUDA device made current (restored afterwards). Labels may be
            class indices (int64 (N,)) or soft targets (float (N, classes), e.g. from MixUp/CutMix
            batch transforms): the default loss takes both, and accuracy against a soft label counts
            ``argmax(logits) == argmax(labels)``.
        config: a ``FitConfig``, or None to build one from ``options``.
        **options: ``FitConfig``'s fields; a name that is not one is a TypeError listing them.

    Each record is an ``epoch_record``; its ``lr`` is the rate the epoch's last step trained at
    (``TrainStep.epoch_lr``). Empty batches (``on_error="skip"`` emptied one; a rank's share of
    the last batch under DDP with ``drop_last=False``) are left out of every figure. In a single
    process they are skipped without an optimizer step, so weights, momentum and the fp16 loss scale do
    not move on no data. Under DDP the rank runs a zero-loss step through the DDP module instead (its
    peers' gradient all-reduce needs it), and steps the optimizer with the averaged gradients like
    every other rank, so replicas stay equal; BatchNorm running statistics do not move on an empty
    batch. Under DDP the model must therefore accept an empty batch (``x.flatten(1)``, not
    ``x.view(x.shape[0], -1)``).
    """
    config = FitConfig.of(config, options)
    _check_model_and_loaders(model, train_loader, config.eval_loader, config.checkpoint is not None)
    device = _loader_device(train_loader)
    eval_loader = config.eval_loader
    if eval_loader is not None and _loader_device(eval_loader) != device:
        raise ValueError(f"eval_loader is on {eval_loader.device} but train_loader is on {device}: the "
                         f"model trains and evaluates on one device; build both loaders with the same one")
    fdist.check_device(device)
    # A model the caller compiled runs compiled, but its weights are saved and restored as the model's
    # own: the OptimizedModule's state_dict prefixes every key with "_orig_mod.", which no plain model loads.
    compiled = model if compiled_original(model) is not None else None
    model = compiled_original(model) or model
    raw = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if compiled is None and compiled_original(raw) is not None:   # DDP(torch.compile(model))
        compiled, raw = raw, compiled_original(raw)
    _check_model_device(raw, device)
    if fdist.env_world_size() > 1 and not fdist.is_distributed():
        # Before the device scope below: init_distributed makes cuda:LOCAL_RANK current for good.
        fdist.init_distributed(device.type)
    # Once the group exists: a loader built before it (torch.multiprocessing.spawn) is rank 0 of 1 everywhere.
    for name, loader in (("train_loader", train_loader), ("eval_loader", eval_loader)):
        fdist.check_shard(loader, name)
    with device_scope(device), cuda_switches(device, cudnn_benchmark=config.cudnn_benchmark, tf32=config.tf32):
        return _train(raw, train_loader, device, config, ddp=model if raw is not model else None,
                      compiled=compiled)


def _train(raw: nn.Module, train_loader, device: torch.device, config: FitConfig, ddp=None,
           compiled=None) -> list[dict]:
    """``fit`` once its arguments are checked, inside the device scope: build the step, restore a
    checkpoint, run the epochs."""
    step = TrainStep.build(raw, config, device)
    for name, loader in (("train_loader", train_loader), ("eval_loader", config.eval_loader)):
        if loader is not None:
            step.check_dtype(_loader_dtype(loader), name)
    state = TrainingState(step, train_loader, storage=config.checkpoint_storage)
    try:
        return _train_from(state, train_loader, config, built_total=getattr(step.scheduler, "total_steps", None),
                           ddp=ddp, compiled=compiled)
    finally:
        state.release()   # the checkpoint path, held by start() for this run


def _train_from(state: TrainingState, train_loader, config: FitConfig, *, built_total, ddp, compiled) -> list[dict]:
    """Restore the checkpoint into ``state`` (``built_total``: the scheduler's length before a checkpoint
    replaced it) and run the epochs."""
    step = state.step
    if config.checkpoint is not None:
        state.start(config.checkpoint, config.resume, config.epochs)
    check_schedule_length(step.scheduler, step.interval, epochs=config.epochs, start_epoch=state.epoch,
                          start_batch=state.batch, batches=len(train_loader), built_total=built_total,
                          accumulate=config.accumulate)
    # After the restore: DDP broadcasts rank 0's (restored) weights.
    step.wrap(compile=config.compile, ddp=ddp, compiled=compiled)
    with RunHooks(step.device, profile=config.profile, log_dir=config.log_dir, log_every=config.log_every,
                  start=(state.epoch, state.batch, len(train_loader))) as hooks:
        step.region = hooks.region
        run = _Run(step, state, hooks, config)
        for epoch in range(state.epoch, config.epochs):
            run.epoch(epoch)
    return state.history


class _Run:
    """The epochs of one ``fit`` call, with what every epoch needs: the step, the state, the hooks."""

    def __init__(self, step: TrainStep, state: TrainingState, hooks: RunHooks, config: FitConfig):
        self.step, self.state, self.hooks, self.loader = step, state, hooks, state.loader
        self.config = config
        self.timing_warmup = config.timing_warmup   # for the first epoch this call trains; 0 after it

    def epoch(self, epoch: int) -> None:
        """Train one epoch, evaluate, record (printed, logged) and save."""
        step, state, loader = self.step, self.state, self.loader
        first = state.first_batch(epoch)
        # A resumed half epoch keeps the position its loader restored. A loader without set_epoch (a
        # wrapper of the contract's three musts) starts its own next pass at each iter().
        if not state.mid_epoch(epoch) and callable(getattr(loader, "set_epoch", None)):
            loader.set_epoch(epoch)
        bar = Progress.open(self.config.progress and fdist.is_main(), len(loader), first, epoch, self.config.epochs)
        meter = EpochMeter(step.device, state.carried(epoch),
                           warmup_steps(self.timing_warmup, len(loader) - first, step.accumulate))
        self.timing_warmup = 0   # the process is warm: later epochs are measured whole
        if state.carried_grad_norms(epoch):
            meter.norms += torch.tensor(state.carried_grad_norms(epoch), dtype=meter.norms.dtype, device=step.device)
        step.last_step_lrs = None   # an epoch with no step (all of it resumed past) reports the rate now
        saver = PeriodicSave(state, self.config.checkpoint, self.config.checkpoint_every, epoch, meter, first)
        self.hooks.begin_epoch(epoch, len(loader), meter.wait)
        train_one_epoch(step, loader, meter, first_batch=first, after_batch=saver, progress=bar, hooks=self.hooks)
        # The position, taken before evaluation: eval_loader may be this very loader, and iterating
        # it again would move the position a whole epoch on (a resume would skip an epoch).
        position = loader.state_dict() if self.config.checkpoint is not None else None
        record = _epoch_figures(step, meter, epoch, self.config.eval_loader, self.config.eval_loss_fn)
        # Before the save: a checkpoint taken at an epoch's end holds the scheduler already stepped
        # for it, and a mid-epoch one the scheduler before it, so a resume steps it exactly once.
        step.end_epoch(record)
        state.history.append(record)
        if fdist.is_main():
            print(format_record(record, self.config.epochs), flush=True)
        # With its eval figures, before the save: a crash in between re-runs the epoch, whose row RunLog replaces.
        self.hooks.epoch(record)
        # With its figures printed and logged, before the save: NaN weights stop the run (check_diverged).
        check_diverged(step, meter, epoch, first, len(loader), self.config.checkpoint)
        if self.config.checkpoint is not None and position is not None:   # position: taken when checkpointing
            state.save(self.config.checkpoint, position, every_rank=True)


def _epoch_figures(step: TrainStep, meter: EpochMeter, epoch: int, eval_loader, eval_loss_fn) -> dict:
    """The ``epoch_record`` of a finished training pass: the meter's figures, ``grad_norm`` when clipping,
    and the evaluation, of the averaged weights when there is an EMA (``eval_ema`` says which)."""
    # The rate the epoch's last step trained at (before an epoch schedule's own step).
    record = meter.record(epoch + 1, lr=step.epoch_lr())
    if step.clip_grad_norm is not None:
        record["grad_norm"] = meter.grad_norm()
    if eval_loader is not None:
        model = step.ema.module if step.ema is not None else step.eval_net
        result = evaluate(model, eval_loader, amp=step.mode, loss_fn=eval_loss_fn)
        record["eval_loss"], record["eval_accuracy"] = result["loss"], result["accuracy"]
    if step.ema is not None:
        record["eval_ema"] = eval_loader is not None
    return record


def _check_model_and_loaders(model, train_loader, eval_loader, checkpoint: bool) -> None:
    """``fit``'s model and loaders of the wrong kind, refused before anything starts and named (the
    options were checked when their ``FitConfig`` was built). ``set_epoch`` is optional; the position
    (``state_dict``/``load_state_dict``) is needed only to checkpoint."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {model!r} ({type(model).__name__})")
    _check_loader("train_loader", train_loader, ("device", "__iter__", "__len__"))
    if eval_loader is not None:
        _check_loader("eval_loader", eval_loader)
    missing = [a for a in ("state_dict", "load_state_dict") if not callable(getattr(train_loader, a, None))]
    if checkpoint and missing:
        raise TypeError(f"checkpoint= needs train_loader's position: {type(train_loader).__name__} has no "
                        f"{', '.join(missing)} (a fastdata loader has both; a loader of your own saves and "
                        f"restores its place in the epoch with them), so its run cannot be resumed")


def _check_loader(name: str, loader, needed=("device", "__iter__")) -> None:
    """A loader without what fit or evaluate asks of it (``needed``), refused naming it; evaluate never
    asks a loader its length, fit counts the training batches."""
    missing = [a for a in needed if not hasattr(loader, a)]
    if missing:
        plain = isinstance(loader, torch.utils.data.DataLoader)
        hint = (": a torch DataLoader does not say where its batches are; build the loader with "
                "fastdata.make_loader(source, 'torch', ...)") if plain else ""
        raise TypeError(f"{name} must be a fastdata loader (fastdata.make_loader) or an object with its "
                        f"contract (.device, len(), iteration over (images, labels)); got "
                        f"{type(loader).__name__} without {', '.join(missing)}{hint}")


def train_one_epoch(step: TrainStep, loader, meter: EpochMeter, *, first_batch: int = 0, after_batch=None,
                    progress: Progress | None = None, hooks: RunHooks | None = None) -> None:
    """One pass over ``loader``: ``step.backward`` per batch, ``step.optimizer_step`` per ``step.accumulate``
    batches (the last group of the epoch holds the remainder, see ``TrainStep.group``), their figures added
    to ``meter``. Groups are planned from ``len(loader)`` (a loader without ``len()`` plans every group
    whole); a group the loader cuts short still steps, on the mean of the batches it got
    (``TrainStep.finish_group``), so whatever the loader really yields, every step's gradient is the
    mean over its batches.

    ``first_batch`` is where a resumed epoch starts (the loader already skips the batches before it).
    ``after_batch(batch)`` runs after each batch with the count of batches done in the epoch (``fit``
    saves periodic checkpoints there). An empty batch takes no backward in a single process (its
    group still steps on the batches before it); under DDP it takes a zero-loss one, which keeps this
    rank in its peers' gradient all-reduce. ``hooks`` (``fit(profile=, log_dir=)``): the wait for each
    batch is the profiler's ``data_wait``, and ``hooks.batch_done`` ends every batch. ``meter.stepped()``
    follows every optimizer step, so the meter's warm-up ends after the step it names.
    """
    step.net.train()  # evaluation (or the caller) may have left the model in eval mode
    batches = _length(loader) if step.accumulate > 1 else None
    batch = start = end = first_batch
    try:
        for pair in meter.timed(loader, hooks.region if hooks is not None else None):
            images, labels = batch_pair(pair, "train_loader")
            if batch == first_batch:  # metadata only: no sync
                step.check_dtype(images.dtype, "train_loader")
                check_batch_device(images, labels, meter.device, "train_loader")
            start, end = step.group(batch, first_batch, batches)
            n, last, loss = images.shape[0], batch + 1 == end, None
            stepped = False
            if n or step.ddp or (last and step.accumulated):
                meter.timer.start()
                if n or step.ddp:
                    # Each batch's mean loss over 1/(batches in its group): the step's gradient is the mean
                    # over the group's batches, as one batch of all their samples would give.
                    loss = step.backward(images, labels, meter.sums, scale=1.0 / (end - start), sync=last)
                if last:
                    meter.add_grad_norm(step.optimizer_step())
                    stepped = True
                meter.timer.end()
            meter.images += n
            meter.count_finite()
            if stepped:   # after the images: the warm-up's last step counts in the warm-up
                meter.stepped()
            if hooks is not None:
                hooks.batch_done(batch, loss=loss if n else None, images=n, wait=meter.wait,
                                 lr=functools.partial(step.batch_lr, stepped))
            batch += 1
            if progress is not None:
                progress.update(meter)
            if after_batch is not None:
                after_batch(batch)
        # A loader that ended inside a group (before len() said, or without one): the batches that came
        # still make a step, their mean (the group's batches were scaled by 1/its planned size).
        meter.add_grad_norm(step.finish_group(end - start, batch - start))
    finally:
        if progress is not None:
            progress.close()


def _length(loader) -> int | None:
    """``len(loader)``, or None for a loader without one (a DataLoader over an IterableDataset has
    ``__len__`` and raises TypeError from it)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _loader_device(loader) -> torch.device:
    device = torch.device(loader.device)
    if device.type == "cuda" and device.index is None:
        # A contract object that says just "cuda": the GPU make_loader would pick (cuda:LOCAL_RANK
        # under torchrun, else the current one).
        from ..config import resolve_device

        device = resolve_device(device)
    return device


def _check_model_device(model: nn.Module, device: torch.device) -> None:
    """A model on the CPU is moved to the loader's device; one already on another device is refused
    (moving it silently would leave an optimizer built on its old parameters, and under torchrun it
    usually means every rank put its model on cuda:0)."""
    elsewhere = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())
                        if t.device.type != "cpu" and t.device != device})
    if elsewhere:
        raise ValueError(f"the model is on {', '.join(elsewhere)} but train_loader yields batches on "
                         f"{device}: move the model with model.to('{device}') (or leave it on the CPU "
                         f"and fit moves it), or build the loaders on {elsewhere[0]}")


def _loader_dtype(loader):
    dtype = getattr(loader, "dtype", None)
    if dtype is None:
        dtype = getattr(getattr(loader, "config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None
