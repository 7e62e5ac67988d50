"""The loop itself: ``fit`` (its arguments checked up front, then the epochs), ``train_one_epoch`` and
``evaluate``."""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .. import distributed as fdist
from .amp import autocast, cuda_switches, device_scope, resolve_amp, resolve_compile
from .hooks import RunHooks, check_output_dir
from .meter import EpochMeter, Progress, format_record, warmup_steps
from .schedule import check_schedule_length, resolve_scheduler_interval
from .state import PeriodicSave, TrainingState
from .step import TrainStep, check_ema, check_input_dtype, check_labels, correct_count


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
    _check_loss("loss_fn", loss_fn)
    device = _loader_device(loader)
    with device_scope(device):
        return _evaluate(model, loader, device, amp, loss_fn)


def _evaluate(model, loader, device, amp, loss_fn) -> dict:
    mode = resolve_amp(amp, device)
    loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, samples
    try:
        for images, labels in loader:
            check_input_dtype(images.dtype, model_dtype, mode, "the evaluation loader")
            n = images.shape[0]
            if n == 0:  # a rank's share of the last step can be empty under DDP
                continue
            with autocast(device, mode):
                logits = model(images)
                check_labels(logits, labels)
                loss = loss_fn(logits, labels)
            sums[0] += loss.detach().double() * n
            sums[1] += correct_count(logits, labels)
            sums[2] += n
    finally:
        model.train(was_training)
    loss_sum, correct, samples = fdist.all_sum(sums).tolist()
    if samples == 0:
        return {"loss": math.nan, "accuracy": math.nan, "samples": 0}
    return {"loss": loss_sum / samples, "accuracy": correct / samples, "samples": int(samples)}


def fit(model: nn.Module, train_loader, *, epochs: int, optimizer=None, scheduler=None, eval_loader=None,
        amp: str = "auto", compile: bool | str = False, channels_last: bool = False, checkpoint=None,
        resume: bool = False, progress: bool = True, checkpoint_every: int | None = None,
        loss_fn=None, eval_loss_fn=None, cudnn_benchmark: bool = True, tf32: bool = True,
        scheduler_interval: str | None = None, checkpoint_storage=None, accumulate: int = 1,
        clip_grad_norm: float | None = None, ema=None, gradient_checkpointing: bool = False, profile=None,
        log_dir=None, log_every: int = 50, timing_warmup: int = 5) -> list[dict]:
    """Train ``model`` for ``epochs`` passes over ``train_loader``; return one record per epoch.

    Args:
        model: an ``nn.Module``; moved to ``train_loader.device`` when its parameters are on the CPU. A
            model already on another device than the loader's is an error. Under ``torchrun`` it is
            wrapped in DistributedDataParallel on the loader's GPU (the process group is initialized
            here if the caller did not), and on CUDA that GPU must be ``cuda:LOCAL_RANK``.
        train_loader: any fastdata loader (or an object with the same contract). It decides the device:
            training runs with that CUDA device made current (restored afterwards). Labels may be
            class indices (int64 (N,)) or soft targets (float (N, classes), e.g. from MixUp/CutMix
            batch transforms): the default loss takes both, and accuracy against a soft label counts
            ``argmax(logits) == argmax(labels)``.
        epochs: total epochs, counting those a resumed checkpoint already finished.
        optimizer: default ``default_optimizer``: AdamW (lr 1e-3, weight decay 0.01), fused on CUDA.
        scheduler: a learning-rate scheduler on ``optimizer`` (one built on another optimizer is
            refused), stepped as ``scheduler_interval`` says. A OneCycleLR that the run would step past
            its ``total_steps`` (a fresh run longer than it was built for, or a resume with more
            epochs) is refused before training starts.
        scheduler_interval: ``"step"`` (after every optimizer step), ``"epoch"`` (once at each
            epoch's end, after evaluation) or None (default): ``"step"`` for OneCycleLR and CyclicLR,
            ``"epoch"`` for every other scheduler (``MultiStepLR(milestones=[30])`` decays after epoch
            30). ``ReduceLROnPlateau`` is stepped once per epoch with the epoch's eval loss, or its
            training loss when there is no ``eval_loader``; ``"step"`` is refused for it. A mid-epoch
            resume steps an epoch scheduler exactly once for the resumed epoch (the checkpoint holds
            the scheduler as it was before that epoch's end).
        eval_loader: evaluated after every epoch (eval_loss / eval_accuracy); it may be
            ``train_loader`` itself: the checkpoint keeps the training position either way.
        amp: ``"auto"``, ``"bf16"``, ``"fp16"`` or ``"off"`` (see ``choose_amp``). With amp off, a loader
            whose dtype differs from the model's (a bf16 loader, a float32 model) is refused at the
            start: casting every batch would throw away what the bf16 loader saves.
        compile: ``True``: ``torch.compile`` the model; ``"reduce-overhead"``: compile it into CUDA graphs
            (``torch.compile(mode="reduce-overhead")``), for small models whose GPU step is launch-bound.
            On the CPU ``"reduce-overhead"`` falls back to ``True`` with a one-line warning. Graphs are
            recorded for one shape: training batches of the first batch's size run the graphs, any other
            size (the last short batch of an epoch, an empty one) runs the model eagerly, and so does
            evaluation, so no shape records a graph it uses once or recompiles every epoch.
        accumulate: batches per optimizer step (default 1): each batch's loss is scaled by 1/N, their
            gradients add up, and the optimizer, the fp16 scaler, the EMA and a per-step scheduler step
            once per N batches (a per-step schedule's length is counted in optimizer steps:
            ``steps_per_epoch=math.ceil(len(train_loader) / N)``). Under DDP the first N-1 batches run in
            ``no_sync``: one gradient all-reduce per step. An epoch's batches are grouped from its start;
            when N does not divide them, the last group is the remainder, its losses scaled by 1/its size,
            so every step's gradient is the mean over the batches it saw (with equal batches, the mean
            over its samples: the gradient one batch of them all would give). Checkpoints fall on step
            boundaries only (a ``checkpoint_every`` save due inside a step waits for the step's end), so a
            resume gives the uninterrupted run's weights.
        clip_grad_norm: clip the gradients' total norm to this before each optimizer step (after
            ``scaler.unscale_`` under fp16, so the threshold is in the gradients' own units). The epoch
            record gets ``grad_norm``: the mean pre-clip norm of its steps (steps fp16 skipped for
            infinite gradients left out; a resumed epoch's mean covers the steps after the resume).
        ema: keep an exponential moving average of the weights: a decay (a float in (0, 1), e.g. 0.999,
            for a ``ModelEma``) or an object with ``update(model)`` and ``module`` (timm's
            ``ModelEmaV3``), updated after every optimizer step without a host sync. The evaluation then
            runs the averaged weights (the record says ``eval_ema: True``); the checkpoint keeps the
            average (key ``"ema"``) and a resume continues it. ``model`` keeps its trained weights; to use
            the average after fit, pass ``ModelEma(model, 0.999)`` and read its ``module`` (fit moves a
            ``ModelEma`` to the loader's device with the model).
        gradient_checkpointing: recompute each block's activations in backward instead of keeping them
            (``fastdata.models.checkpoint_blocks``, applied to the model on its device before DDP and
            compile): SmallCNN, torchvision ResNets, an ``nn.Sequential``, timm models. Same gradients, less
            activation memory, about one more forward of compute. Another model is refused, named, before
            training.
        profile: a folder: a ``torch.profiler`` trace of a few steps after warm-up (``StepProfiler``'s
            defaults: 1 skipped, 2 warm-up, 5 recorded; a run of fewer batches writes none and warns),
            readable in TensorBoard or ui.perfetto.dev, one file per rank; its per-step table (data wait vs
            host-to-device copy vs forward/backward vs optimizer) is printed when the run ends, by rank 0.
        log_dir: a folder: the run log (``fastdata.runlog.RunLog``, rank 0 writes): ``epochs.csv`` with every
            epoch record, ``steps.csv`` with the loss, lr, images/s and data wait of every ``log_every``-th
            batch (numbered ``epoch * len(train_loader) + batch`` so a resume continues), and TensorBoard
            scalars when the tensorboard package is installed. ``fastdata.runlog.plot_curves`` draws it.
            Both folders are checked before training (writable; a file is refused).
        log_every: the batches between two rows of ``steps.csv`` (default 50).
        timing_warmup: optimizer steps at the start of this call's first epoch that are timed apart as
            warm-up (default 5; at most half that epoch's steps; 0: none; not a learning-rate warm-up).
            They pay once-a-process costs (lazy CUDA loading, cuDNN's autotuning, compilation, the first
            worker start-up: a first step of 3 s where the next take milliseconds), so that epoch's
            ``images_per_second``, ``data_wait_fraction`` and ``gpu_idle_fraction`` are of the steps after
            them, and their wall time is the record's ``warmup_seconds``. Later epochs are measured whole:
            a cost every epoch pays (a loader's restart) is in their figures.
        channels_last: convert the model to channels-last (give the loaders ``channels_last=True`` too).
        checkpoint: a path, or a URL (``s3://...``, ``gs://...``, ``memory://...``: through fsspec, see
            ``fastdata.checkpoint.storage_for``); saved at the end of every epoch and every
            ``checkpoint_every`` batches (see ``TrainingState``), by rank 0. Checked before training
            starts: not a folder, and its folder writable (created if missing). Numpy values in the
            optimizer's or scheduler's state are saved as Python numbers and tensors
            (``checkpoint.loadable``); a value no checkpoint can read back is refused, naming its key.
        resume: continue from ``checkpoint`` when it exists (mid-epoch included: the remaining batches
            are exactly those an uninterrupted run sees); start fresh when it does not. Under torchrun
            rank 0 decides whether it exists and what it holds: a rank that cannot read the same file
            (another node's disk) gets rank 0's over the process group. A checkpoint written under
            another world size or batch size resumes too (the rest of the epoch is re-split over the
            new ranks, every sample once; a OneCycleLR built for the old steps per epoch is refused
            when the run would step past its end).
        progress: a tqdm bar with live images/s and data-wait %, shown only when stderr is a terminal.
        checkpoint_every: also save every this many batches (None: only at epoch ends).
        checkpoint_storage: where ``checkpoint`` is read and written: any object with ``exists``,
            ``read_bytes`` and ``write_bytes`` (``fastdata.checkpoint.Storage``); None: the local file
            system for a path, fsspec for a URL.
        loss_fn: the training loss, ``loss_fn(logits, labels)``; default ``nn.CrossEntropyLoss()``
            (class indices or class probabilities; under autocast it computes in float32 whatever the
            logits' dtype). It is not used for evaluation: see ``eval_loss_fn``.
        eval_loss_fn: the loss ``evaluate`` reports as ``eval_loss``; default ``nn.CrossEntropyLoss()``
            on the evaluation labels, hard or soft. Separate from ``loss_fn`` because a training loss
            often does not take the evaluation labels: timm's recipe trains with
            ``SoftTargetCrossEntropy`` on MixUp/CutMix's float (N, classes) targets, which fails on the
            int64 class indices of an eval loader (it used to, after a whole epoch of training); a
            label-smoothing loss would report a smoothed figure. Give one to evaluate with your own
            (it also feeds ``ReduceLROnPlateau``).
        cudnn_benchmark: on CUDA, turn ``torch.backends.cudnn.benchmark`` on while fit runs (cuDNN
            times its algorithms once per input shape and keeps the fastest). ``False``: fit leaves
            the flag as the caller set it.
        tf32: on CUDA, let fp32 matmuls and convolutions use TF32 tensor cores while fit runs (only
            what autocast leaves in fp32 is affected). ``False``: fit leaves the flags as they are.
            Both switches are process-wide, so fit sets them for the run only and restores the
            caller's values on the way out (``cuda_switches``); on the CPU it touches neither.

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
    _check_fit_arguments(model, train_loader, eval_loader, optimizer, scheduler, loss_fn, eval_loss_fn, epochs=epochs,
                         checkpoint=checkpoint, resume=resume, checkpoint_every=checkpoint_every,
                         flags={"channels_last": channels_last, "progress": progress,
                                "cudnn_benchmark": cudnn_benchmark, "tf32": tf32,
                                "gradient_checkpointing": gradient_checkpointing})
    _check_step_options(accumulate=accumulate, clip_grad_norm=clip_grad_norm, ema=ema, compile=compile)
    _check_records(profile=profile, log_dir=log_dir, log_every=log_every, timing_warmup=timing_warmup)
    resolve_scheduler_interval(None, scheduler_interval)  # an unknown value fails before anything starts
    device = _loader_device(train_loader)
    if eval_loader is not None and _loader_device(eval_loader) != device:
        raise ValueError(f"eval_loader is on {eval_loader.device} but train_loader is on {device}: the "
                         f"model trains and evaluates on one device; build both loaders with the same one")
    fdist.check_device(device)
    raw = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    _check_model_device(raw, device)
    if fdist.env_world_size() > 1 and not fdist.is_distributed():
        # Before the device scope below: init_distributed makes cuda:LOCAL_RANK current for good.
        fdist.init_distributed(device.type)
    with device_scope(device), cuda_switches(device, cudnn_benchmark=cudnn_benchmark, tf32=tf32):
        mode = resolve_amp(amp, device)
        step = TrainStep.build(raw, optimizer, scheduler, loss_fn, device, mode, channels_last=channels_last,
                               scheduler_interval=scheduler_interval, accumulate=accumulate,
                               clip_grad_norm=clip_grad_norm, ema=ema,
                               gradient_checkpointing=gradient_checkpointing)
        for name, loader in (("train_loader", train_loader), ("eval_loader", eval_loader)):
            if loader is not None:
                step.check_dtype(_loader_dtype(loader), name)
        state = TrainingState(step, train_loader, storage=checkpoint_storage)
        built_total = getattr(step.scheduler, "total_steps", None)  # before a checkpoint replaces it
        if checkpoint is not None:
            state.start(checkpoint, resume, epochs)
        check_schedule_length(step.scheduler, step.interval, epochs=epochs, start_epoch=state.epoch,
                              start_batch=state.batch, batches=len(train_loader), built_total=built_total,
                              accumulate=accumulate)
        step.wrap(compile=compile)  # after the restore: DDP broadcasts rank 0's (restored) weights
        with RunHooks(device, profile=profile, log_dir=log_dir, log_every=log_every) as hooks:
            step.region = hooks.region
            run = _Run(step, state, hooks, eval_loader, eval_loss_fn, epochs, checkpoint, checkpoint_every, progress,
                       timing_warmup)
            for epoch in range(state.epoch, epochs):
                run.epoch(epoch)
        return state.history


class _Run:
    """The epochs of one ``fit`` call, with what every epoch needs: the step, the state, the hooks."""

    def __init__(self, step, state, hooks, eval_loader, eval_loss_fn, epochs, checkpoint, checkpoint_every,
                 progress, timing_warmup):
        self.step, self.state, self.hooks, self.loader = step, state, hooks, state.loader
        self.eval_loader, self.eval_loss_fn, self.epochs = eval_loader, eval_loss_fn, epochs
        self.checkpoint, self.checkpoint_every, self.progress = checkpoint, checkpoint_every, progress
        self.timing_warmup = timing_warmup   # for the first epoch this call trains; 0 after it

    def epoch(self, epoch: int) -> None:
        """Train one epoch, evaluate, record (printed, logged) and save."""
        step, state, loader = self.step, self.state, self.loader
        first = state.first_batch(epoch)
        if not state.mid_epoch(epoch):  # a resumed half epoch keeps the position its loader restored
            loader.set_epoch(epoch)
        bar = Progress.open(self.progress and fdist.is_main(), len(loader), first, epoch, self.epochs)
        meter = EpochMeter(step.device, state.carried(epoch),
                           warmup_steps(self.timing_warmup, len(loader) - first, step.accumulate))
        self.timing_warmup = 0   # the process is warm: later epochs are measured whole
        step.last_step_lrs = None   # an epoch with no step (all of it resumed past) reports the rate now
        saver = PeriodicSave(state, self.checkpoint, self.checkpoint_every, epoch, meter)
        self.hooks.begin_epoch(epoch, len(loader), meter.wait)
        train_one_epoch(step, loader, meter, first_batch=first, after_batch=saver, progress=bar, hooks=self.hooks)
        # The position, taken before evaluation: eval_loader may be this very loader, and iterating
        # it again would move the position a whole epoch on (a resume would skip an epoch).
        position = loader.state_dict()
        record = _epoch_figures(step, meter, epoch, self.eval_loader, self.eval_loss_fn)
        # Before the save: a checkpoint taken at an epoch's end holds the scheduler already stepped
        # for it, and a mid-epoch one the scheduler before it, so a resume steps it exactly once.
        step.end_epoch(record)
        state.history.append(record)
        if fdist.is_main():
            print(format_record(record, self.epochs), flush=True)
        # With its eval figures, before the save: a crash in between re-runs the epoch, whose row RunLog replaces.
        self.hooks.epoch(record)
        if self.checkpoint is not None:
            state.save(self.checkpoint, position, every_rank=True)


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


def _check_records(*, profile, log_dir, log_every, timing_warmup) -> None:
    """``fit``'s profiler, run-log and figure options, refused before anything starts and named."""
    from ..config import check_integer

    check_output_dir("profile", profile)
    check_output_dir("log_dir", log_dir)
    check_integer("log_every", log_every, minimum=1)
    check_integer("timing_warmup", timing_warmup, minimum=0)


def _check_step_options(*, accumulate, clip_grad_norm, ema, compile) -> None:
    """``fit``'s options of the step itself, refused before anything starts and named."""
    from ..config import check_integer

    check_integer("accumulate", accumulate, minimum=1)
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, numbers.Real):
            raise TypeError(f"clip_grad_norm must be a number > 0 (the gradients' largest total norm) or None, "
                            f"got {clip_grad_norm!r} ({type(clip_grad_norm).__name__})")
        if not (math.isfinite(clip_grad_norm) and clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be a finite number > 0, got {clip_grad_norm!r}")
    check_ema(ema)
    resolve_compile(compile, "cuda")   # the value alone: the device's fallback is said when wrapping


def _check_fit_arguments(model, train_loader, eval_loader, optimizer, scheduler, loss_fn, eval_loss_fn, *, epochs,
                         checkpoint, resume, checkpoint_every, flags: dict) -> None:
    """Every argument of ``fit`` of the wrong kind, refused before anything starts and named: a string
    where a scheduler belongs would otherwise fail only when the first epoch ends, and ``progress="no"``
    or ``epochs=True`` would be taken as truthy values."""
    from ..config import check_flag, check_integer

    check_integer("epochs", epochs, minimum=0)
    if checkpoint_every is not None:
        check_integer("checkpoint_every", checkpoint_every, minimum=1)
    for name, value in flags.items():   # True or False, not 1 or "no"
        check_flag(name, value)
    check_flag("resume", resume)
    if (resume or checkpoint_every) and checkpoint is None:
        raise ValueError("resume and checkpoint_every need a checkpoint path")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {model!r} ({type(model).__name__})")
    for name, loader in (("train_loader", train_loader), ("eval_loader", eval_loader)):
        if name == "eval_loader" and loader is None:
            continue
        # evaluate never asks an eval_loader its length; fit counts the training batches.
        needed = ("device", "__iter__", "__len__") if name == "train_loader" else ("device", "__iter__")
        missing = [a for a in needed if not hasattr(loader, a)]
        if missing:
            plain = isinstance(loader, torch.utils.data.DataLoader)
            hint = (": a torch DataLoader does not say where its batches are; build the loader with "
                    "fastdata.make_loader(source, 'torch', ...)") if plain else ""
            raise TypeError(f"{name} must be a fastdata loader (fastdata.make_loader) or an object with its "
                            f"contract (.device, len(), iteration over (images, labels)); got "
                            f"{type(loader).__name__} without {', '.join(missing)}{hint}")
    # By what fit uses, not by class: an optimizer or scheduler of another library that does not
    # subclass torch's still trains. state_dict() is needed only to write checkpoints.
    saving = checkpoint is not None
    wants = ("step", "zero_grad", "state_dict", "load_state_dict") if saving else ("step", "zero_grad")
    if optimizer is not None and (not hasattr(optimizer, "param_groups")
                                  or not all(callable(getattr(optimizer, a, None)) for a in wants)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer on the model's parameters (or an object "
                        f"with param_groups and {', '.join(a + '()' for a in wants)}), or None (AdamW); got "
                        f"{optimizer!r} ({type(optimizer).__name__})")
    wants = ("step", "state_dict", "load_state_dict") if saving else ("step",)
    if scheduler is not None and not all(callable(getattr(scheduler, a, None)) for a in wants):
        raise TypeError(f"scheduler must be a torch.optim.lr_scheduler scheduler built on the optimizer (an "
                        f"object with {', '.join(a + '()' for a in wants)}), or None; got {scheduler!r} "
                        f"({type(scheduler).__name__})")
    _check_loss("loss_fn", loss_fn)
    _check_loss("eval_loss_fn", eval_loss_fn)


def _check_loss(name: str, loss_fn) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{name} must be callable as {name}(logits, labels) (e.g. nn.CrossEntropyLoss()), "
                        f"or None (cross-entropy); got {loss_fn!r} ({type(loss_fn).__name__})")


def train_one_epoch(step: TrainStep, loader, meter: EpochMeter, *, first_batch: int = 0, after_batch=None,
                    progress: Progress | None = None, hooks: RunHooks | None = None) -> None:
    """One pass over ``loader``: ``step.backward`` per batch, ``step.optimizer_step`` per ``step.accumulate``
    batches (the last group of the epoch holds the remainder, see ``TrainStep.group``), their figures added
    to ``meter``.

    ``first_batch`` is where a resumed epoch starts (the loader already skips the batches before it).
    ``after_batch(batch)`` runs after each batch with the count of batches done in the epoch (``fit``
    saves periodic checkpoints there). An empty batch takes no backward in a single process (its
    group still steps on the batches before it); under DDP it takes a zero-loss one, which keeps this
    rank in its peers' gradient all-reduce. ``hooks`` (``fit(profile=, log_dir=)``): the wait for each
    batch is the profiler's ``data_wait``, and ``hooks.batch_done`` ends every batch. ``meter.stepped()``
    follows every optimizer step, so the meter's warm-up ends after the step it names.
    """
    step.net.train()  # evaluation (or the caller) may have left the model in eval mode
    batches = len(loader) if step.accumulate > 1 else None
    batch = first_batch
    try:
        for images, labels in meter.timed(loader, hooks.region if hooks is not None else None):
            if batch == first_batch:  # metadata only: no sync
                step.check_dtype(images.dtype, "train_loader")
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
            if stepped:   # after the images: the warm-up's last step counts in the warm-up
                meter.stepped()
            if hooks is not None:
                hooks.batch_done(batch, loss=loss if n else None, images=n, wait=meter.wait,
                                 optimizer=step.optimizer)
            batch += 1
            if progress is not None:
                progress.update(meter)
            if after_batch is not None:
                after_batch(batch)
        # A loader that ended before len() said: its last group's gradients still make a step.
        meter.add_grad_norm(step.optimizer_step())
    finally:
        if progress is not None:
            progress.close()


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
