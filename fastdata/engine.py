"""The training loop: ``fit`` and ``evaluate``, with AMP, per-epoch figures, progress and checkpoints.

``fit`` is split the way torchvision's references split ``train.py``: ``train_one_epoch`` runs the
steps into an ``EpochMeter`` (device-side sums, data wait, CUDA event pairs), which yields the
``epoch_record``; a ``TrainingState`` saves and restores everything a resume needs, with the loader's
``state_dict`` as the one record of the position. The examples' shared tail (``run_result``,
``report_run``, ``write_result``) lives in ``fastdata.report``, above this module.

The loop says ``for images, labels in loader`` and nothing else about data: batches arrive on
``loader.device`` already normalized, so any backend (or any object honouring the loader contract:
``len``, ``set_epoch``, ``state_dict``/``load_state_dict``, ``device``) plugs in unchanged. Labels
are class indices or soft (N, classes) targets (MixUp/CutMix); accuracy then compares argmaxes.

Schedulers are stepped per batch or per epoch by one documented rule (``resolve_scheduler_interval``):
OneCycleLR/CyclicLR per batch, the rest per epoch, ``ReduceLROnPlateau`` per epoch with the epoch's
loss. Each epoch record carries its learning rate.

What keeps the GPU busy here:
- no host synchronization inside a step: loss and accuracy are summed on the device and read once per
  epoch (and once per progress refresh, at most about once a second, only when a bar is shown);
- ``zero_grad(set_to_none=True)``: no kernel writes zeros into every gradient, and the next backward
  writes the gradients instead of accumulating into them;
- ``cudnn.benchmark`` (the fastest convolution algorithm picked once per input shape) and TF32, on
  CUDA, for the run only: ``fit(cudnn_benchmark=True, tf32=True)`` turns them on and restores the
  caller's process-wide values on the way out (``cuda_switches``);
- bf16 autocast where the GPU has it (no loss scaling, so no per-step check for infs), else fp16 with
  a GradScaler; optional ``torch.compile`` and channels-last;
- the default AdamW is fused on CUDA: GradScaler leaves its fp16 inf check on the device for a fused
  optimizer, and reads it on the host (one sync per step) for any other;
- the loader's GPU is made current for the run, so CUDA events, streams and capability queries refer
  to it and not to cuda:0.
"""
from __future__ import annotations

import contextlib
import copy
import math
import numbers
import os
import sys
import time
import warnings

import torch
from torch import nn

from . import checkpoint as ckpt
from . import distributed as fdist

AMP_CHOICES = ("auto", "bf16", "fp16", "off")
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# When fit steps a scheduler (see ``resolve_scheduler_interval``). None picks by the scheduler's class.
SCHEDULER_INTERVALS = ("step", "epoch")
# Schedules whose period is counted in optimizer steps: torch's own examples step them after every batch.
PER_STEP_SCHEDULERS = (torch.optim.lr_scheduler.OneCycleLR, torch.optim.lr_scheduler.CyclicLR)
# Format 2 dropped format 1's ``global_step``: the loader's state is the one record of the position.
CHECKPOINT_FORMAT = "fastdata-checkpoint-2"


# ------------------------------------------------------------------------------------------ AMP
def choose_amp(amp: str, device_type: str, bf16_supported: bool = False) -> str:
    """The precision a run uses: ``"bf16"``, ``"fp16"`` or ``"off"``. A pure function of its arguments.

    ``"auto"``: on CUDA bf16 when the GPU supports it (Ampere and newer), else fp16 with loss scaling;
    on CPU off, because bf16 autocast made a small CNN 5.5x slower than fp32 on a CPU without AMX.
    ``"bf16"``, ``"fp16"``, ``"off"`` are honoured as given.
    """
    if amp not in AMP_CHOICES:
        raise ValueError(f"unknown amp {amp!r}; choose from {list(AMP_CHOICES)}")
    if amp != "auto":
        return amp
    if device_type == "cuda":
        return "bf16" if bf16_supported else "fp16"
    return "off"


_WARNED_FP16_ON_CPU = False


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from the function calling this one, that names the first frame
    outside fastdata and torch (``torch.no_grad``'s decorator adds a frame of its own): the user's
    line, whichever of fit, evaluate or a direct call got there."""
    inside = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def resolve_amp(amp: str, device: torch.device, *, warn: bool = True) -> str:
    """``choose_amp`` with this machine's capabilities filled in. ``warn``: say once per process that
    fp16 on the CPU is slow, at the user's line (``_user_stacklevel``); ``report.run_result`` only records
    the mode."""
    device = torch.device(device)
    bf16 = False
    if device.type == "cuda":
        # is_bf16_supported() asks the *current* device (cuda:0 unless set), not necessarily ``device``.
        # Without emulation: pre-Ampere GPUs "support" bf16 only through slow emulated kernels.
        with torch.cuda.device(device):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    mode = choose_amp(amp, device.type, bf16)
    global _WARNED_FP16_ON_CPU
    if mode == "fp16" and device.type == "cpu" and warn and not _WARNED_FP16_ON_CPU:
        # Asked for, so honoured; but a run that silently takes 50x longer looks like a hang. Once: fit
        # evaluates every epoch with the same mode, and the warning said the same thing each time.
        _WARNED_FP16_ON_CPU = True
        warnings.warn("amp='fp16' on the CPU: torch's CPU kernels have few fp16 paths, and a SmallCNN step "
                      "measured about 50x slower than fp32 here (bf16 2x slower); use amp='off' (or 'bf16' on "
                      "a CPU with AMX)", RuntimeWarning, stacklevel=_user_stacklevel())
    return mode


def _autocast(device: torch.device, mode: str):
    # One code path for every precision: autocast disabled is a no-op context.
    return torch.autocast(device.type, dtype=_AMP_DTYPES.get(mode, torch.bfloat16), enabled=mode != "off")


#: ``fit(compile=...)``: off, ``torch.compile``'s default mode, or its CUDA-graph mode.
COMPILE_CHOICES = (False, True, "reduce-overhead")


def resolve_compile(compile, device) -> str | None:
    """``torch.compile``'s mode for ``fit(compile=...)`` on ``device``: None (not compiled), ``"default"``
    or ``"reduce-overhead"``.

    ``"reduce-overhead"`` records the step into CUDA graphs: for a small CNN a GPU step is a few hundred
    tiny kernels, and launching them from Python costs more than running them. CUDA graphs exist only on
    CUDA, so on the CPU it falls back to ``compile=True``, saying so in one line.
    """
    if not isinstance(compile, (bool, str)):   # 1 or "yes" taken as truthy would hide a typo
        raise TypeError(f"compile must be True, False or 'reduce-overhead', got {compile!r} "
                        f"({type(compile).__name__})")
    if isinstance(compile, str) and compile not in COMPILE_CHOICES:
        raise ValueError(f"compile must be True, False or 'reduce-overhead', got {compile!r}")
    if compile is False:
        return None
    if compile == "reduce-overhead" and torch.device(device).type != "cuda":
        warnings.warn(f"compile='reduce-overhead' (CUDA graphs) needs a CUDA device; on {torch.device(device)} "
                      f"fit compiles with compile=True instead", RuntimeWarning, stacklevel=_user_stacklevel())
        return "default"
    return "default" if compile is True else "reduce-overhead"


# ------------------------------------------------------------------------------------ schedulers
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


def _check_schedule_length(scheduler, interval, *, epochs: int, start_epoch: int, start_batch: int,
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
    if resumed and needed < total and unit == "batch":
        # Resumed with more samples a step (another world size or batch size): fewer steps are left than
        # the schedule has, and the run would stop mid-anneal at a high rate without a word.
        warnings.warn(f"resuming: the checkpoint's OneCycleLR has total_steps={total} but this run ends it at "
                      f"step {needed} (the steps per epoch changed: another world size or batch size), so "
                      f"its learning rate stops before annealing to its end", RuntimeWarning, stacklevel=3)
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
        f"(resume=False) from the checkpoint's weights with the scheduler built for the new epochs")


def current_lr(optimizer) -> float | list[float]:
    """The optimizer's learning rate: one float when every parameter group has the same, else one per
    group (a list, in group order). A tensor lr is read on the host (once per epoch in ``fit``)."""
    return _one_or_each([group["lr"] for group in optimizer.param_groups])


def _one_or_each(lrs) -> float | list[float]:
    """Learning rates (floats or tensors) as one float when every group has the same, else a list."""
    lrs = [float(lr) for lr in lrs]
    return lrs[0] if len(set(lrs)) == 1 else lrs


# ----------------------------------------------------------------------------------- soft labels
def _check_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Soft (N, classes) labels must have one column per model output. Metadata only: no sync.

    Without this, torch reads a (N, 10) target against (N, 100) logits as class indices and says
    "expected scalar type Long but found Float"."""
    if logits.ndim == 2 and labels.ndim == 2 and labels.shape != logits.shape:
        raise ValueError(f"soft labels of shape {tuple(labels.shape)} for logits of shape {tuple(logits.shape)}: "
                         f"soft targets need one column per model output (give MixUp/CutMix the model's "
                         f"num_classes, {logits.shape[1]})")


def _correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many predictions are right, as a device tensor: ``argmax(logits) == labels``, or for soft
    labels (the logits' shape: MixUp/CutMix targets) ``argmax(logits) == argmax(labels)``, ties going to
    the lower class index (``torch.argmax``'s first maximum)."""
    target = labels.argmax(1) if labels.shape == logits.shape and labels.ndim >= 2 else labels
    return (logits.argmax(1) == target).sum()


# ------------------------------------------------------------------------------------- evaluate
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
    with _device_scope(device):
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
            _check_input_dtype(images.dtype, model_dtype, mode, "the evaluation loader")
            n = images.shape[0]
            if n == 0:  # a rank's share of the last step can be empty under DDP
                continue
            with _autocast(device, mode):
                logits = model(images)
                _check_labels(logits, labels)
                loss = loss_fn(logits, labels)
            sums[0] += loss.detach().double() * n
            sums[1] += _correct(logits, labels)
            sums[2] += n
    finally:
        model.train(was_training)
    loss_sum, correct, samples = fdist.all_sum(sums).tolist()
    if samples == 0:
        return {"loss": math.nan, "accuracy": math.nan, "samples": 0}
    return {"loss": loss_sum / samples, "accuracy": correct / samples, "samples": int(samples)}


# ------------------------------------------------------------------------------------------ fit
def default_optimizer(params, device) -> torch.optim.Optimizer:
    """``fit``'s optimizer when none is given: AdamW (lr 1e-3, weight decay 0.01), fused on CUDA.

    AdamW is forgiving for a model it knows nothing of. Fused matters for fp16: GradScaler hands a
    fused optimizer its inf check as a device tensor (``_step_supports_amp_scaling``), while for any
    other optimizer it reads the check with ``.item()`` before deciding to step: one host sync per step.
    """
    params = list(params)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True if wants_fused(params, device) else None)


def wants_fused(params, device) -> bool:
    """Whether the default optimizer is fused: on CUDA, when every parameter is a floating-point CUDA
    tensor (torch 2.14 refuses ``fused=True`` otherwise: ``optimizer._device_dtype_check_for_fused``).
    On the CPU the default implementation stays: the per-step sync fused avoids is a CUDA problem."""
    return torch.device(device).type == "cuda" and all(
        p.device.type == "cuda" and p.is_floating_point() for p in params)


def fit(model: nn.Module, train_loader, *, epochs: int, optimizer=None, scheduler=None, eval_loader=None,
        amp: str = "auto", compile: bool | str = False, channels_last: bool = False, checkpoint=None,
        resume: bool = False, progress: bool = True, checkpoint_every: int | None = None,
        loss_fn=None, eval_loss_fn=None, cudnn_benchmark: bool = True, tf32: bool = True,
        scheduler_interval: str | None = None, checkpoint_storage=None, accumulate: int = 1,
        clip_grad_norm: float | None = None, ema=None) -> list[dict]:
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
                                "cudnn_benchmark": cudnn_benchmark, "tf32": tf32})
    _check_step_options(accumulate=accumulate, clip_grad_norm=clip_grad_norm, ema=ema, compile=compile)
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
    with _device_scope(device), cuda_switches(device, cudnn_benchmark=cudnn_benchmark, tf32=tf32):
        mode = resolve_amp(amp, device)
        step = TrainStep.build(raw, optimizer, scheduler, loss_fn, device, mode, channels_last=channels_last,
                               scheduler_interval=scheduler_interval, accumulate=accumulate,
                               clip_grad_norm=clip_grad_norm, ema=ema)
        for name, loader in (("train_loader", train_loader), ("eval_loader", eval_loader)):
            if loader is not None:
                step.check_dtype(_loader_dtype(loader), name)
        state = TrainingState(step, train_loader, storage=checkpoint_storage)
        built_total = getattr(step.scheduler, "total_steps", None)  # before a checkpoint replaces it
        if checkpoint is not None:
            state.start(checkpoint, resume, epochs)
        _check_schedule_length(step.scheduler, step.interval, epochs=epochs, start_epoch=state.epoch,
                               start_batch=state.batch, batches=len(train_loader), built_total=built_total,
                               accumulate=accumulate)
        step.wrap(compile=compile)  # after the restore: DDP broadcasts rank 0's (restored) weights
        for epoch in range(state.epoch, epochs):
            first = state.first_batch(epoch)
            if not state.mid_epoch(epoch):  # a resumed half epoch keeps the position its loader restored
                train_loader.set_epoch(epoch)
            bar = _Progress.open(progress and fdist.is_main(), len(train_loader), first, epoch, epochs)
            meter = EpochMeter(device, state.carried(epoch))
            step.last_step_lrs = None   # an epoch with no step (all of it resumed past) reports the rate now
            saver = _PeriodicSave(state, checkpoint, checkpoint_every, epoch, meter)
            train_one_epoch(step, train_loader, meter, first_batch=first, after_batch=saver, progress=bar)
            # The position, taken before evaluation: eval_loader may be this very loader, and iterating
            # it again would move the position a whole epoch on (a resume would skip an epoch).
            position = train_loader.state_dict()
            record = _epoch_figures(step, meter, epoch, eval_loader, eval_loss_fn)
            # Before the save: a checkpoint taken at an epoch's end holds the scheduler already stepped
            # for it, and a mid-epoch one the scheduler before it, so a resume steps it exactly once.
            step.end_epoch(record)
            state.history.append(record)
            if fdist.is_main():
                print(format_record(record, epochs), flush=True)
            if checkpoint is not None:
                state.save(checkpoint, position, every_rank=True)
        return state.history


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


def _check_step_options(*, accumulate, clip_grad_norm, ema, compile) -> None:
    """``fit``'s options of the step itself, refused before anything starts and named."""
    from .config import check_integer

    check_integer("accumulate", accumulate, minimum=1)
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, numbers.Real):
            raise TypeError(f"clip_grad_norm must be a number > 0 (the gradients' largest total norm) or None, "
                            f"got {clip_grad_norm!r} ({type(clip_grad_norm).__name__})")
        if not (math.isfinite(clip_grad_norm) and clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be a finite number > 0, got {clip_grad_norm!r}")
    _check_ema(ema)
    resolve_compile(compile, "cuda")   # the value alone: the device's fallback is said when wrapping


def _check_fit_arguments(model, train_loader, eval_loader, optimizer, scheduler, loss_fn, eval_loss_fn, *, epochs,
                         checkpoint, resume, checkpoint_every, flags: dict) -> None:
    """Every argument of ``fit`` of the wrong kind, refused before anything starts and named: a string
    where a scheduler belongs would otherwise fail only when the first epoch ends, and ``progress="no"``
    or ``epochs=True`` would be taken as truthy values."""
    from .config import check_flag, check_integer

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


@contextlib.contextmanager
def cuda_switches(device: torch.device, *, cudnn_benchmark: bool, tf32: bool):
    """Turn cuDNN autotuning and TF32 on for the block when ``device`` is CUDA; restore them after.

    These flags are process-wide: a library call that flipped them for good would change the numerics
    and the speed of everything else the process runs. A switch passed as False is not touched, so a
    caller who set it keeps their value; on the CPU nothing is touched.
    """
    if torch.device(device).type != "cuda" or not (cudnn_benchmark or tf32):
        yield
        return
    cudnn = torch.backends.cudnn
    saved_benchmark = cudnn.benchmark
    restore_tf32 = _enable_tf32() if tf32 else None
    if cudnn_benchmark:
        cudnn.benchmark = True
    try:
        yield
    finally:
        cudnn.benchmark = saved_benchmark
        if restore_tf32 is not None:
            restore_tf32()


def _enable_tf32():
    """Allow TF32 for fp32 matmuls and cuDNN; return a function that puts the caller's flags back.

    torch 2.9+ has two APIs for this: the legacy ``allow_tf32`` booleans and the ``fp32_precision``
    strings. Its legacy getters raise ("mix of the legacy and new APIs") when the two disagree, and
    torch reads both inside a run (inductor's conv template reads ``cudnn.allow_tf32``, its matmul
    code ``matmul.fp32_precision``). So TF32 is turned on through the legacy setters, which keep the
    two in agreement (cuDNN's covers conv and RNN alike), and the restore writes the legacy booleans
    first (where the caller's state let them be read) and then the exact ``fp32_precision`` strings:
    a legacy write alone would leave ``"ieee"`` where the caller had ``"none"`` (inherit).
    """
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    legacy = [(cudnn, "allow_tf32"), (matmul, "allow_tf32")]
    strings = [(cudnn.conv, "fp32_precision"), (cudnn.rnn, "fp32_precision"), (matmul, "fp32_precision")] \
        if hasattr(cudnn, "rnn") and hasattr(cudnn.rnn, "fp32_precision") else []  # torch < 2.9: none
    saved_legacy = [(owner, name, _read_flag(owner, name)) for owner, name in legacy]
    saved_strings = [(owner, name, getattr(owner, name)) for owner, name in strings]
    for owner, name in legacy:
        setattr(owner, name, True)

    def restore():
        for owner, name, value in saved_legacy:
            if value is not None:
                setattr(owner, name, value)
        for owner, name, value in saved_strings:
            setattr(owner, name, value)

    return restore


def _read_flag(owner, name):
    # A legacy TF32 getter raises when the caller mixed the two APIs: there is no boolean to restore.
    try:
        return getattr(owner, name)
    except RuntimeError:
        return None


def train_one_epoch(step: TrainStep, loader, meter: EpochMeter, *, first_batch: int = 0, after_batch=None,
                    progress: _Progress | None = None) -> None:
    """One pass over ``loader``: ``step.backward`` per batch, ``step.optimizer_step`` per ``step.accumulate``
    batches (the last group of the epoch holds the remainder, see ``TrainStep.group``), their figures added
    to ``meter``.

    ``first_batch`` is where a resumed epoch starts (the loader already skips the batches before it).
    ``after_batch(batch)`` runs after each batch with the count of batches done in the epoch (``fit``
    saves periodic checkpoints there). An empty batch takes no backward in a single process (its
    group still steps on the batches before it); under DDP it takes a zero-loss one, which keeps this
    rank in its peers' gradient all-reduce.
    """
    step.net.train()  # evaluation (or the caller) may have left the model in eval mode
    batches = len(loader) if step.accumulate > 1 else None
    batch = first_batch
    try:
        for images, labels in meter.timed(loader):
            if batch == first_batch:  # metadata only: no sync
                step.check_dtype(images.dtype, "train_loader")
            start, end = step.group(batch, first_batch, batches)
            n, last = images.shape[0], batch + 1 == end
            if n or step.ddp or (last and step.accumulated):
                meter.timer.start()
                if n or step.ddp:
                    # Each batch's mean loss over 1/(batches in its group): the step's gradient is the mean
                    # over the group's batches, as one batch of all their samples would give.
                    step.backward(images, labels, meter.sums, scale=1.0 / (end - start), sync=last)
                if last:
                    meter.add_grad_norm(step.optimizer_step())
                meter.timer.end()
            meter.images += n
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


# ----------------------------------------------------------------------------- the epoch record
def epoch_record(epoch: int, *, loss_sum: float, correct: float, seen: float, images: float, seconds: float,
                 data_wait_fraction: float, gpu_idle_fraction: float | None, peak_memory_mb: float,
                 lr: float | list[float] | None = None) -> dict:
    """One epoch's figures, as ``fit`` returns them (a plain dict: it goes into checkpoints and JSON).

    Keys: ``epoch`` (1-based), ``train_loss`` and ``train_accuracy`` (NaN when no sample was seen;
    against soft labels a sample is right when ``argmax(logits) == argmax(labels)``), ``eval_loss`` and
    ``eval_accuracy`` (None until an eval_loader fills them), ``lr`` (the learning rate when the epoch's
    training pass ended, before an epoch-interval scheduler stepped: for an epoch schedule the rate the
    epoch trained at, for a per-step one the rate its next step uses; a float when every parameter
    group shares it, else a list, one per group; see ``current_lr``), ``images_per_second``,
    ``data_wait_fraction`` (host time blocked waiting for the next batch ÷ epoch wall time),
    ``gpu_idle_fraction`` (None on CPU; see ``EpochMeter``), ``peak_memory_mb`` (device memory on
    CUDA, the process's peak resident memory on CPU) and ``seconds`` (training wall time).
    """
    return {
        "epoch": epoch,
        "train_loss": loss_sum / seen if seen else math.nan,
        "train_accuracy": correct / seen if seen else math.nan,
        "eval_loss": None,
        "eval_accuracy": None,
        "lr": lr,
        "images_per_second": images / seconds if seconds > 0 else math.nan,
        "data_wait_fraction": data_wait_fraction,
        "gpu_idle_fraction": gpu_idle_fraction,
        "peak_memory_mb": peak_memory_mb,
        "seconds": seconds,
    }


class EpochMeter:
    """The running figures of one epoch: device-side sums, host-side data wait, CUDA event pairs.

    ``sums`` (loss × samples, correct, samples) stay on the device and are added to inside each step,
    so no step reads a device value on the host; ``record`` reads them once, at the epoch's end.
    ``wait`` is host time blocked in the loader (``timed``). ``timer`` records CUDA events right
    before and after each step on the loader device's current stream (the training stream);
    ``gpu_idle_fraction`` is the sum of the gaps from one step's end event to the next step's start
    event ÷ the time from the first start to the last end. A gap is time the training stream spent on
    anything but training steps: waiting for the host to hand it the next batch, plus any loader work
    queued on that same stream between steps (the ``torch`` backend's copy and normalization, the
    ``memory`` backend's gather and augmentation, a wait for a side stream's batch that is not ready
    yet). Work on other streams that overlaps the steps (``prefetch``'s side-stream copies, DALI's GPU
    decoding) is not counted. Under DDP every figure is reduced over ranks (idle and wait: the mean).

    Args:
        device: the loader's device.
        carried: sums a resumed half-done epoch carries over (global sums, held by one rank).
    """

    def __init__(self, device: torch.device, carried: list[float] | None = None):
        self.device = device
        self.sums = torch.tensor(carried or [0.0, 0.0, 0.0], dtype=torch.float64, device=device)
        self.images, self.wait = 0, 0.0
        self.timer = _StepTimer(device)
        self.norms = torch.zeros(2, dtype=torch.float64, device=device)  # sum, count of finite grad norms
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.t0 = time.perf_counter()

    def add_grad_norm(self, norm: torch.Tensor | None) -> None:
        """Add one optimizer step's gradient norm (None: not clipped) on the device. A step fp16's scaler
        skips has an infinite norm and changes no weight: it is left out of the mean."""
        if norm is not None:
            finite = torch.isfinite(norm)
            self.norms += torch.stack([torch.where(finite, norm.double(), 0.0), finite.double()])

    def grad_norm(self) -> float:
        """The mean pre-clip gradient norm of the epoch's optimizer steps (NaN when none). Every rank
        holds the same norms (the gradients are all-reduced before clipping): no collective."""
        total, count = self.norms.tolist()
        return total / count if count else math.nan

    def timed(self, loader):
        """Iterate ``loader``, adding the host time spent blocked in it to ``wait``."""
        t = time.perf_counter()
        it = iter(loader)
        self.wait += time.perf_counter() - t  # starting workers / pipelines is waiting for data too
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.wait += time.perf_counter() - t
            yield batch

    def global_sums(self) -> list[float]:
        """The sums over every rank (a collective: every rank calls it at the same step)."""
        return fdist.all_sum(self.sums).tolist()

    def record(self, epoch: int, lr: float | list[float] | None = None) -> dict:
        """The ``epoch_record`` (with ``lr`` as given), reduced over ranks. Synchronizes the device once:
        the events and the sums are read here, not during the steps."""
        device = self.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - self.t0
        idle = self.timer.idle_fraction()
        local = torch.tensor([*self.sums.tolist(), self.images, self.wait / wall if wall > 0 else 0.0, idle or 0.0],
                             dtype=torch.float64, device=device)
        loss_sum, correct, seen, images, wait, idle_sum = fdist.all_sum(local).tolist()
        wall_max, peak_max = fdist.all_max(torch.tensor([wall, _peak_memory_mb(device)], dtype=torch.float64,
                                                        device=device)).tolist()
        world = fdist.world_size()
        return epoch_record(epoch, loss_sum=loss_sum, correct=correct, seen=seen, images=images, seconds=wall_max,
                            data_wait_fraction=wait / world,
                            gpu_idle_fraction=idle_sum / world if idle is not None else None,
                            peak_memory_mb=peak_max, lr=lr)


# ---------------------------------------------------------------------------- the training state
def _state_dict_mismatch(saved: dict, now: dict, shown: int = 3) -> str:
    """What differs between a saved model state_dict and this model's (names missing, unexpected, of
    another shape), the first few of each, or "" when they match."""
    missing = [k for k in now if k not in saved]
    unexpected = [k for k in saved if k not in now]
    shapes = [f"{k} {tuple(saved[k].shape)} saved, {tuple(now[k].shape)} here" for k in now
              if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(now[k].shape)]
    parts = []
    for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)):
        if names:
            more = f", ... ({len(names)} in all)" if len(names) > shown else ""
            parts.append(f"{len(names)} {what} ({', '.join(names[:shown])}{more})")
    return "; ".join(parts)


class TrainingState:
    """Everything a resumed run needs, saved to and restored from one checkpoint.

    The position has ONE record: the loader's ``state_dict()`` (epoch, the global sample offset and
    batches done, plus what the position is valid for: seed and dataset, checked by the loader when it
    is restored; the world size and batch size may differ, and the rest of the epoch is then re-split,
    see ``resumed_batch``). Format 1 also kept a ``global_step`` beside it, which restore no longer needs: the
    periodic-save count is ``epoch × len(loader) + batch``. Format 1 files still load (that key is
    ignored); any other format is refused with the formats this version reads.

    A checkpoint also holds the model, optimizer, GradScaler and scheduler states, the RNG states,
    the finished epochs' records (``history``), a half-done epoch's global sums (``partial``), the
    precision, the world size and the weight average (``ema``, None without one). Rank 0 writes it
    (atomically: ``checkpoint.save``). Under ``accumulate`` every save falls on an optimizer step's
    boundary (``_PeriodicSave``): no checkpoint holds half-accumulated gradients.
    """

    FORMAT = CHECKPOINT_FORMAT
    READS = ("fastdata-checkpoint-1", CHECKPOINT_FORMAT)

    def __init__(self, step: TrainStep, loader, storage=None):
        self.step, self.loader, self.storage = step, loader, storage
        self.history: list[dict] = []
        self.epoch, self.batch = 0, 0         # where training starts
        self.samples = 0                      # the global sample offset into the start epoch's order
        self.partial = [0.0, 0.0, 0.0]        # the sums the half-done start epoch carries

    def start(self, path, resume: bool, epochs: int | None = None) -> None:
        """Check ``path`` before any training, then restore from it when ``resume`` and it exists.
        ``epochs``: the run's total, to say so when the checkpoint has finished them all already.

        Both are decided once, by rank 0, and shared: an unusable path fails on every rank (naming
        rank 0's error), and a checkpoint only rank 0 can see (its own disk) resumes every rank."""
        # An unusable path fails now, not after an epoch of training; so does a state a checkpoint
        # could not hold (a scheduler keeping a Fraction): it would fail at the first save.
        fdist.decide_on_main(ckpt.prepare, path, self.storage, what=f"checking checkpoint path '{path}'")
        ckpt.loadable(self.state_dict(self.loader.state_dict(), self.partial), f"checkpoint '{path}'")
        if not resume:
            return
        main = fdist.is_main()
        state = ckpt.load_shared(path, storage=self.storage)
        if state is None:
            if main:
                print(f"no checkpoint at '{path}' yet: starting from scratch", flush=True)
            return
        self.load_state_dict(state, path)
        if main:
            saved, now = state.get("loader", {}), self.loader.state_dict()
            layout = [(d.get("world_size"), d.get("batch_size")) for d in (saved, now)]
            resplit = f" (saved by {layout[0][0]} rank(s) x batch {layout[0][1]}: the rest of the epoch is " \
                      f"re-split over {layout[1][0]} x {layout[1][1]})" if layout[0] != layout[1] else ""
            if epochs is not None and self.epoch >= epochs:
                # Not "resumed at epoch 4" of a 3-epoch run: nothing trains, and fit returns the history.
                print(f"'{path}' holds a finished run ({self.epoch} epoch(s), epochs={epochs}): nothing left to "
                      f"train; its figures are the result", flush=True)
            else:
                print(f"resumed from '{path}': epoch {self.epoch + 1}, batch {self.batch}/{len(self.loader)}"
                      f"{resplit}", flush=True)

    def state_dict(self, position: dict, partial: list[float], rng_ranks: list[dict] | None = None) -> dict:
        """The checkpoint's contents at ``position`` (the loader's state_dict) with ``partial`` sums.
        ``rng_ranks``: every rank's ``ckpt.rng_state()`` in rank order (default: this process's alone).
        ``"rng"`` is rank 0's (what a checkpoint before ``"rng_ranks"`` held, and what a resume on
        another world size restores on every rank)."""
        step = self.step
        rng_ranks = rng_ranks or [ckpt.rng_state()]
        return {
            "format": self.FORMAT, "model": step.raw.state_dict(), "optimizer": step.optimizer.state_dict(),
            "scaler": step.scaler.state_dict(),
            "scheduler": step.scheduler.state_dict() if step.scheduler is not None else None,
            "loader": position, "rng": rng_ranks[0], "rng_ranks": rng_ranks, "partial": list(partial),
            "history": list(self.history), "amp": step.mode, "world_size": fdist.world_size(),
            # Class names, checked on resume: an optimizer's or scheduler's state loads into any other
            # class without complaint and fails (or silently misbehaves) later.
            "optimizer_class": type(step.optimizer).__name__,
            "scheduler_class": type(step.scheduler).__name__ if step.scheduler is not None else None,
            # The moving average of the weights (fit(ema=...)), or None: a resume continues the average.
            "ema": step.ema.state_dict() if step.ema is not None else None,
        }

    #: What every checkpoint this version reads holds (format 1 as well as 2).
    KEYS = ("model", "optimizer", "scaler", "scheduler", "loader", "rng", "partial", "history", "amp")

    def check_restorable(self, state: dict, path="checkpoint") -> None:
        """Refuse, before anything is restored, a checkpoint this run cannot take: another format, keys
        missing, another model (names or shapes), another optimizer class or parameter layout, another
        scheduler class. ``CheckpointError`` for a file that is not a whole fastdata checkpoint,
        ``ResumeError`` for one of another run. Without these checks torch's own errors came after the
        model was overwritten (hundreds of key names, no path), or not at all (an AdamW state loaded
        into SGD failed at its first step with KeyError: 'momentum')."""
        if state.get("format") not in self.READS:
            raise ckpt.CheckpointError(f"'{path}' is not a fastdata checkpoint this version reads (format "
                                       f"{state.get('format')!r}; reads {list(self.READS)})")
        missing = [k for k in self.KEYS if k not in state]
        if missing:
            raise ckpt.CheckpointError(f"'{path}' is a {state['format']} checkpoint without {missing}: it was "
                                       f"not written whole by fit")
        step = self.step
        problems = _state_dict_mismatch(state["model"], step.raw.state_dict())
        if problems:
            raise ckpt.ResumeError(f"'{path}' holds the weights of another model than "
                                   f"{type(step.raw).__name__}: {problems}")
        for part, now in (("optimizer", step.optimizer), ("scheduler", step.scheduler)):
            saved = state.get(f"{part}_class")
            if saved is not None and now is not None and saved != type(now).__name__:
                raise ckpt.ResumeError(f"'{path}' was trained with a {saved} {part}; this run's is "
                                       f"{type(now).__name__}: its state does not fit it. Resume with the "
                                       f"{part} of that run, or start a new run (resume=False)")
        saved_ema = state.get("ema")
        problems = _state_dict_mismatch(saved_ema, step.ema.state_dict()) if saved_ema and step.ema else ""
        if problems:
            raise ckpt.ResumeError(f"'{path}' holds a weight average (ema) of another model: {problems}")
        layout = [len(g["params"]) for g in state["optimizer"].get("param_groups", [])]
        here = [len(g["params"]) for g in step.optimizer.param_groups]
        if layout != here:
            raise ckpt.ResumeError(f"'{path}' has an optimizer of {len(layout)} parameter group(s) of "
                                   f"{layout} parameters; this run's has {len(here)} of {here}")

    def load_state_dict(self, state: dict, path="checkpoint") -> None:
        """Restore a checkpoint's contents, all or nothing: ``check_restorable`` first, then the loader
        (it checks the position against its dataset and order before taking it), and only then the
        model, optimizer and the rest, so a refused checkpoint leaves every object as it was."""
        self.check_restorable(state, path)
        try:
            self.loader.load_state_dict(state["loader"])
        except (ValueError, TypeError) as e:   # another dataset, order or loader kind: not this run's
            raise ckpt.ResumeError(f"'{path}' cannot resume this run: {e}") from e
        step = self.step
        step.raw.load_state_dict(state["model"])
        step.optimizer.load_state_dict(state["optimizer"])
        if state["amp"] != step.mode:
            warnings.warn(f"checkpoint was trained with amp={state['amp']!r}, resuming with {step.mode!r}",
                          stacklevel=2)
        if state["scaler"]:
            step.scaler.load_state_dict(state["scaler"])
        if step.scheduler is not None and state["scheduler"] is not None:
            step.scheduler.load_state_dict(state["scheduler"])
        self._restore_ema(state.get("ema"), path)
        # Each rank its own generators (dropout and a model's other random ops draw from them; under DDP
        # rank r's GPU generator is cuda:r's, which only rank r's process ever advanced). Resumed on
        # another world size, every rank takes rank 0's, as before "rng_ranks" existed.
        ranks = state.get("rng_ranks") or []
        ckpt.set_rng_state(ranks[fdist.rank()] if len(ranks) == fdist.world_size() else state["rng"])
        # Read back from the loader, which has validated it: the one record of the position, in this
        # run's layout (a checkpoint of another world size or batch size re-splits the epoch's rest).
        position = self.loader.state_dict()
        self.epoch = position["epoch"]
        self.samples = position.get("samples", position["batch"])
        self.batch = resumed_batch(position, len(self.loader))
        self.history = list(state["history"])
        # The figures of a half-done epoch are global sums, whatever the world size that summed them;
        # one rank carries them on.
        self.partial = list(state["partial"]) if fdist.is_main() else [0.0, 0.0, 0.0]

    def _restore_ema(self, saved: dict | None, path) -> None:
        """The checkpoint's weight average, or, when it kept none (saved without ``ema``), a new one from
        the restored weights, said in a warning: the average starts again from here."""
        ema = self.step.ema
        if ema is None:
            return
        if saved is not None:
            ema.load_state_dict(saved)
            return
        warnings.warn(f"'{path}' holds no weight average (saved without ema): the average starts again from "
                      f"its weights", RuntimeWarning, stacklevel=3)
        if callable(getattr(ema, "set", None)):   # ModelEma and timm's ModelEmaV3 have it
            ema.set(self.step.raw)

    def save(self, path, position: dict, partial: list[float] | None = None, *, every_rank: bool = False) -> None:
        """Save at ``position`` (rank 0 writes one file for the run). ``every_rank`` (what ``fit`` does):
        a collective under DDP, every rank calls it at the same batch and sends rank 0 its RNG states, so
        a resume gives each rank its own; without it only rank 0 needs to call it (a loop of your own
        that saves ``if is_main()``), and the checkpoint holds rank 0's RNG states alone."""
        state = ckpt.rng_state()
        rng_ranks = fdist.gather_on_cpu(state) if every_rank else [state]
        if fdist.is_main():
            ckpt.save(self.state_dict(position, partial or [0.0, 0.0, 0.0], rng_ranks), path,
                      storage=self.storage)

    def mid_epoch(self, epoch: int) -> bool:
        """Whether ``epoch`` is a resumed half-done epoch (its loader must not be ``set_epoch``'d: that
        would restart it). Decided on the sample offset: under a re-split layout with ``drop_last`` a
        few samples read can leave a whole epoch's batches still to run."""
        return epoch == self.epoch and (self.samples > 0 or self.batch > 0)

    def first_batch(self, epoch: int) -> int:
        """The batch number ``epoch`` starts at: for the resumed epoch, ``len(loader)`` minus the
        batches left (``resumed_batch``), so the epoch's count ends at ``len(loader)`` as a whole epoch
        does; else 0."""
        return self.batch if epoch == self.epoch else 0

    def carried(self, epoch: int) -> list[float] | None:
        """The sums ``epoch`` starts from: a resumed half-done epoch's, else None (zeros)."""
        return self.partial if self.mid_epoch(epoch) else None


def resumed_batch(position: dict, batches: int) -> int:
    """Where a resumed epoch's batch count starts so that it ends at ``batches`` (``len(loader)``).

    Under the layout that saved ``position`` this is its ``batch``. Under another world size or batch
    size (elastic resume) the rest of the epoch, ``num_samples - samples`` samples, is re-split into
    steps of ``batch_size x world_size`` (the loader's, as ``state_dict()`` reports them after the
    restore), and ``ceil(samples / global batch)`` can be one more than the batches already run: the
    step count, the periodic saves and a per-step schedule would run past the epoch's end. A position
    without the sample keys (a loader of another kind) gives its ``batch`` as it is.
    """
    keys = ("samples", "num_samples", "batch_size", "world_size", "drop_last")
    if any(k not in position for k in keys):
        return position["batch"]
    rest = max(0, position["num_samples"] - position["samples"])
    step = position["batch_size"] * position["world_size"]
    left = rest // step if position["drop_last"] else -(-rest // step)
    return max(0, batches - left)


class _PeriodicSave:
    """``train_one_epoch``'s ``after_batch`` in ``fit``: saves every ``every`` batches of the run.

    The batch count of the run is ``epoch × len(loader) + batch``, computed from the position, so a
    resumed run saves at the same batches as an uninterrupted one. No save at the epoch's last batch:
    the end-of-epoch save follows. A mid-epoch save carries the sums so far (a collective under DDP:
    every rank reaches the same batch).

    With ``accumulate`` > 1 a save falls only on an optimizer step's boundary (the first at or after
    each ``every`` batches): the gradients of a half-accumulated step live only in memory, and a
    checkpoint without them would resume to other weights than the uninterrupted run's."""

    def __init__(self, state: TrainingState, path, every: int | None, epoch: int, meter: EpochMeter):
        self.state, self.path, self.every, self.meter = state, path, every, meter
        self.length = len(state.loader)
        self.offset = epoch * self.length
        self.accumulate = state.step.accumulate
        self.due = False

    def __call__(self, batch: int) -> None:
        if self.path is None or not self.every:
            return
        self.due = self.due or (self.offset + batch) % self.every == 0
        if not self.due or batch % self.accumulate or batch >= self.length:
            return
        self.due = False
        self.state.save(self.path, self.state.loader.state_dict(), self.meter.global_sums(), every_rank=True)


# ------------------------------------------------------------------------------------- the step
class TrainStep:
    """One training step: forward, backward, optimizer (and scaler, scheduler, EMA) step, device-side sums.

    Nothing in it reads a device value on the host: with a fused optimizer (the default on CUDA) or
    bf16, a step never waits for the GPU (a GPU test runs steps under ``set_sync_debug_mode("error")``).
    ``fit`` makes one with ``build`` and ``wrap``; ``train_one_epoch`` calls ``backward`` once per batch
    and ``optimizer_step`` once per ``accumulate`` batches. Calling the step itself does both for one
    batch (a loop of your own without accumulation).

    Args:
        net: the module the step runs (``raw``, or its DDP / compiled wrapper).
        raw: the unwrapped model: its parameters, state_dict and dtype.
        optimizer, scaler, scheduler, loss_fn: as in ``fit`` (scaler: a GradScaler, disabled unless fp16).
        device: the loader's device. mode: the resolved precision (``"bf16"``, ``"fp16"``, ``"off"``).
        ddp: whether ``net`` is DDP: an empty batch then still takes a (zero-loss) step.
        scheduler_interval: as in ``fit``: the step calls ``scheduler.step()`` itself when it resolves
            to ``"step"``; ``end_epoch`` steps it when it resolves to ``"epoch"``.
        accumulate, clip_grad_norm: as in ``fit``. ema: None or an object with ``update(model)`` and
            ``module`` (a ``ModelEma``, or timm's ``ModelEmaV3``), updated after every optimizer step.
    """

    def __init__(self, net, raw, optimizer, scaler, scheduler, loss_fn, device, mode, ddp,
                 scheduler_interval: str | None = None, *, accumulate: int = 1,
                 clip_grad_norm: float | None = None, ema=None):
        self.net, self.raw, self.optimizer, self.scaler, self.scheduler = net, raw, optimizer, scaler, scheduler
        self.loss_fn, self.device, self.mode, self.ddp = loss_fn, device, mode, ddp
        self.interval = resolve_scheduler_interval(scheduler, scheduler_interval)
        self.params = [p for p in raw.parameters() if p.requires_grad]
        self.model_dtype = next((p.dtype for p in raw.parameters() if p.is_floating_point()), None)
        # The rates the latest step trained at, kept before a per-step scheduler moves them on: the
        # epoch's lr figure (see ``epoch_lr``). A tensor lr is cloned on its device, not read: no sync.
        self.last_step_lrs: list | None = None
        self.accumulate, self.clip_grad_norm, self.ema = accumulate, clip_grad_norm, ema
        self.accumulated = 0        # batches backpropagated since the last optimizer step
        self.eager = net            # ``net`` before torch.compile: see ``_module_for``
        self.graphs = False         # compiled with mode="reduce-overhead" (CUDA graphs)
        self.static_batch: int | None = None

    @classmethod
    def build(cls, raw, optimizer, scheduler, loss_fn, device, mode, *, channels_last: bool,
              scheduler_interval: str | None = None, accumulate: int = 1, clip_grad_norm: float | None = None,
              ema=None) -> TrainStep:
        """Put ``raw`` on ``device`` (channels-last if asked) and fill in the defaults: the optimizer, a
        GradScaler, the loss, and a ``ModelEma`` when ``ema`` is a decay. The step runs ``raw`` itself
        until ``wrap``."""
        raw.to(device)
        if channels_last:
            raw.to(memory_format=torch.channels_last)
        if optimizer is None:
            optimizer = default_optimizer(raw.parameters(), device)
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            # Stepping it would change the learning rate of an optimizer nothing steps: a silent no-op.
            raise ValueError("the scheduler was built on another optimizer than the one fit steps: pass that "
                             "optimizer too (fit(optimizer=opt, scheduler=...)); without optimizer=, fit "
                             "makes its own AdamW")
        # A disabled scaler passes the loss and the step straight through: one step path for all modes.
        scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")
        loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        # After the move: the average lives beside the weights it follows.
        if isinstance(ema, float):
            ema = ModelEma(raw, ema)
        elif isinstance(ema, ModelEma):
            ema.module.to(device)
        return cls(raw, raw, optimizer, scaler, scheduler, loss_fn, device, mode, ddp=False,
                   scheduler_interval=scheduler_interval, accumulate=accumulate, clip_grad_norm=clip_grad_norm,
                   ema=ema)

    def wrap(self, *, compile: bool | str) -> None:
        """DistributedDataParallel under torchrun (on the loader's GPU), then ``torch.compile`` if asked
        (``compile="reduce-overhead"``: CUDA graphs on CUDA, see ``resolve_compile``)."""
        net = fdist.wrap_ddp(self.raw, self.device)
        self.ddp = net is not self.raw
        self.eager = net
        mode = resolve_compile(compile, self.device)
        self.graphs = mode == "reduce-overhead"
        self.net = net if mode is None else torch.compile(net, mode=None if mode == "default" else mode)

    @property
    def eval_net(self) -> nn.Module:
        """The module ``evaluate`` runs: DDP's forward takes part in collectives, so evaluation goes
        around it (each rank evaluates its shard and the sums are reduced) and uneven eval batches
        cannot deadlock. Under CUDA graphs evaluation runs eagerly (``_module_for``)."""
        if fdist.is_distributed():
            return self.raw
        return self.eager if self.graphs else self.net

    def check_dtype(self, dtype, name: str) -> None:
        """Refuse batches of ``dtype`` from loader ``name`` when amp is off and the model differs."""
        _check_input_dtype(dtype, self.model_dtype, self.mode, name)

    def epoch_lr(self) -> float | list[float]:
        """The epoch's lr figure, read once when its training pass ends: the rate its last step trained
        at. For an epoch schedule that is the optimizer's rate now (the scheduler has not stepped yet);
        a per-step schedule has already moved it on to the next step's, which after a OneCycleLR's
        last step is torch's extrapolation past the schedule's end, a rate no step used."""
        if self.interval == "step" and self.last_step_lrs is not None:
            return _one_or_each(self.last_step_lrs)
        return current_lr(self.optimizer)

    def end_epoch(self, record: dict) -> None:
        """Step an epoch-interval scheduler once, at the end of the epoch ``record`` describes.

        ``ReduceLROnPlateau`` gets the epoch's ``eval_loss``, or its ``train_loss`` when nothing was
        evaluated (the figures are reduced over ranks, so every rank steps it alike)."""
        if self.scheduler is None or self.interval != "epoch":
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            loss = record["eval_loss"] if record.get("eval_loss") is not None else record["train_loss"]
            self.scheduler.step(loss)
        else:
            self.scheduler.step()

    def group(self, batch: int, first_batch: int, batches: int | None) -> tuple[int, int]:
        """The accumulation group of the epoch's batch number ``batch``: ``(start, end)``, batch numbers.

        Groups are ``accumulate`` batches aligned to multiples of it from the epoch's start, so a resumed
        epoch (checkpoints fall on group ends) groups its batches as the uninterrupted run did; the last
        group holds the remainder. A resume that started elsewhere (another world size re-split the
        epoch) makes its first group the rest of the one it started in. A loader yielding more than
        ``batches`` steps on each extra batch alone."""
        n = self.accumulate
        if n == 1 or batches is None:
            return batch, batch + 1
        aligned = batch - batch % n
        return max(first_batch, aligned), max(min(aligned + n, batches), batch + 1)

    def __call__(self, images, labels, sums, *, scale: float = 1.0, last: bool = True):
        """``backward`` on one batch, then ``optimizer_step`` when ``last``; returns its grad norm."""
        self.backward(images, labels, sums, scale=scale, sync=last)
        return self.optimizer_step() if last else None

    def backward(self, images, labels, sums, *, scale: float = 1.0, sync: bool = True) -> None:
        """Forward and backward of one batch, its loss times ``scale`` (1/the batches accumulated for one
        optimizer step), gradients added to those of the step's batches before it. ``sync=False``
        (under DDP): inside ``no_sync``, no gradient all-reduce: one per optimizer step, at its last batch."""
        n = images.shape[0]
        if self.accumulated == 0:
            # set_to_none: no kernel writes zeros, and the first backward writes the gradients.
            self.optimizer.zero_grad(set_to_none=True)
        quiet = self.eager.no_sync() if self.ddp and not sync else contextlib.nullcontext()
        with quiet:
            logits, loss = self._forward(self._module_for(n), images, labels, n)
            self.scaler.scale(loss * scale if scale != 1.0 else loss).backward()
        self.accumulated += 1
        if n:
            # Device-side sums (the unscaled loss): reading them here (.item()) would stall the host on
            # every step.
            sums[0] += loss.detach().double() * n
            sums[1] += _correct(logits.detach(), labels)
            sums[2] += n

    def _module_for(self, n: int) -> nn.Module:
        """The compiled module, or the eager one for a batch of another size than the first under CUDA
        graphs: a graph is recorded per input shape, and the last short batch of every epoch (or an empty
        one) would record one more graph (and recompile) for a single use. Eager costs that one batch its
        launch overhead only."""
        if not self.graphs:
            return self.net
        if self.static_batch is None:
            self.static_batch = n
        if n != self.static_batch:
            return self.eager
        # A new iteration: the graphs' outputs of the previous one may be overwritten (torch's CUDA-graph
        # trees otherwise guess iteration boundaries from forward/backward pairs).
        torch.compiler.cudagraph_mark_step_begin()
        return self.net

    def _forward(self, net, images, labels, n):
        with _autocast(self.device, self.mode):
            try:
                logits = net(images)
            except RuntimeError as e:
                if n:
                    raise
                raise RuntimeError(
                    f"this rank's batch is empty ({tuple(images.shape)}: on_error='skip' emptied it, or "
                    f"drop_last=False left this rank no samples) and the model's forward fails on an "
                    f"empty batch ({e}); under DDP the rank must still run a step to keep its peers' "
                    f"gradient all-reduce going: make the model accept N=0 (x.flatten(1) rather than "
                    f"x.view(x.shape[0], -1)) or build the loader with drop_last=True") from e
            # Cross-entropy over zero rows is NaN (0/0): an empty batch gets a zero loss instead. It
            # only happens under DDP (fit skips empty batches otherwise), where this rank must still
            # run backward through the DDP module so that its peers' gradient all-reduce completes.
            # The parameter term gives every parameter a (zero) gradient even when the model's
            # backward on an empty input leaves some undefined, which would hang DDP's reducer.
            # Soft labels (N, classes) need no cast: autocast runs cross-entropy in float32 on CPU and
            # CUDA, and outside it the product with log-probabilities promotes to the wider dtype.
            _check_labels(logits, labels)
            loss = self.loss_fn(logits, labels) if n else _zero_loss(logits, self.params)
        return logits, loss

    def optimizer_step(self) -> torch.Tensor | None:
        """Step the optimizer on the gradients accumulated since the last step (none: nothing happens),
        clipping them first when ``clip_grad_norm`` is set; then the scaler, the EMA and a per-step
        scheduler. Returns the total gradient norm before clipping (a device tensor), or None."""
        if not self.accumulated:
            return None
        norm = None
        if self.clip_grad_norm is not None:
            # Under fp16 the gradients are scaled: unscale first, or the threshold applies to
            # loss-scale times the norm. The scaler remembers it and does not unscale again in step.
            self.scaler.unscale_(self.optimizer)
            norm = nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        # With fp16 the scaler reads its inf check on the host (one sync per step) unless the
        # optimizer is fused; bf16 needs no scaler, one reason it is preferred. Under DDP an empty
        # rank steps too: its gradients are the all-reduced ones, and a rank that skipped the step
        # would leave its replica behind the others'.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.accumulated = 0
        if self.ema is not None:
            self.ema.update(self.raw)
        if self.interval == "step":
            self.last_step_lrs = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                                  for g in self.optimizer.param_groups]
            self.scheduler.step()
        return norm


class ModelEma:
    """An exponential moving average of a model's weights, as timm's ``ModelEmaV3(exclude_buffers=True)``:
    after every optimizer step ``ema = decay * ema + (1 - decay) * weights`` for the parameters (one
    ``torch._foreach_lerp_``: no host sync), and the buffers (BatchNorm's running statistics) copied.

    Args:
        model: the model to follow (its copy, made now, starts the average).
        decay: in (0, 1); 0.999 averages over about the last 1,000 steps.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999):
        _check_ema(decay)
        self.decay = float(decay)
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s parameters; copy its buffers."""
        torch._foreach_lerp_(list(self.module.parameters()), list(model.parameters()), 1.0 - self.decay)
        for mine, theirs in zip(self.module.buffers(), model.buffers()):
            mine.copy_(theirs)

    @torch.no_grad()
    def set(self, model: nn.Module) -> None:
        """Restart the average at ``model``'s weights."""
        for mine, theirs in zip(self.module.state_dict().values(), model.state_dict().values()):
            mine.copy_(theirs)

    def state_dict(self) -> dict:
        """The averaged weights (the module's state_dict): what a checkpoint keeps."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the averaged weights."""
        self.module.load_state_dict(state)


def _check_ema(ema) -> None:
    """``ema``: None, a decay in (0, 1), or an object with ``update(model)`` and a ``module``."""
    if ema is None:
        return
    if isinstance(ema, float):
        if not (math.isfinite(ema) and 0.0 < ema < 1.0):
            raise ValueError(f"ema must be a decay in (0, 1) such as 0.999, got {ema!r}")
        return
    if isinstance(ema, bool) or not (callable(getattr(ema, "update", None))
                                     and isinstance(getattr(ema, "module", None), nn.Module)):
        raise TypeError(f"ema must be a decay (a float in (0, 1), e.g. 0.999), an object with update(model) "
                        f"and a .module (fastdata.engine.ModelEma, timm's ModelEmaV3), or None; got {ema!r} "
                        f"({type(ema).__name__})")


def _zero_loss(logits, params) -> torch.Tensor:
    return 0.0 * (logits.float().sum() + sum(p.sum() for p in params))


class _StepTimer:
    """CUDA events before and after each step, on the training stream of ``device``; a no-op on CPU.

    The stream is named explicitly: ``Event.record()`` without one uses the *current* device's stream,
    which is cuda:0's unless something set the device, and would time an idle GPU for ``cuda:1``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda"
        self.starts: list = []
        self.ends: list = []

    def _mark(self, marks: list) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        marks.append(event)

    def start(self) -> None:
        if self.enabled:
            self._mark(self.starts)

    def end(self) -> None:
        if self.enabled:
            self._mark(self.ends)

    def idle_fraction(self) -> float | None:
        """Read after ``torch.cuda.synchronize``; None on CPU."""
        return _idle_fraction(self.starts, self.ends) if self.enabled else None


def _device_scope(device: torch.device):
    # The loader's GPU becomes the current device while fit runs: current_stream(),
    # is_bf16_supported() and a model's own torch.zeros(..., device="cuda") all mean the current
    # device, which is cuda:0 until something sets it. Restored on the way out.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _loader_device(loader) -> torch.device:
    device = torch.device(loader.device)
    if device.type == "cuda" and device.index is None:
        # A contract object that says just "cuda": the GPU make_loader would pick (cuda:LOCAL_RANK
        # under torchrun, else the current one).
        from .config import resolve_device

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


def _check_input_dtype(dtype, model_dtype, mode: str, name: str) -> None:
    """With autocast off, the batches must already have the model's dtype.

    Decision: refuse, do not cast. A bf16 loader exists to move and store half the bytes; casting every
    batch back to float32 would pay for the conversion and keep none of the saving."""
    if dtype is None or model_dtype is None or mode != "off" or not dtype.is_floating_point:
        return
    if dtype != model_dtype:
        short, model_short = str(dtype).replace("torch.", ""), str(model_dtype).replace("torch.", "")
        amp = "bf16" if dtype == torch.bfloat16 else "fp16"
        raise TypeError(f"{name} yields {short} images but the model's parameters are {model_short} and "
                        f"amp is off: pass amp='{amp}' to fit (autocast runs the model in {short}), or "
                        f"build the loader with dtype=torch.{model_short}")


def format_record(r: dict, epochs: int | None = None) -> str:
    """One line per epoch: the figures of a ``fit`` record (``lr`` in 3 significant digits, one per
    parameter group joined by "/" when they differ; records from before ``lr`` existed print none)."""
    parts = [f"epoch {r['epoch']}" + (f"/{epochs}" if epochs else ""),
             f"loss {r['train_loss']:.4f}", f"train acc {r['train_accuracy']:.2%}"]
    if r["eval_accuracy"] is not None:
        parts.append(f"eval acc {r['eval_accuracy']:.2%}")
    lr = r.get("lr")
    if lr is not None:
        parts.append("lr " + "/".join(f"{x:.3g}" for x in (lr if isinstance(lr, list) else [lr])))
    parts += [f"{r['images_per_second']:,.0f} img/s", f"data wait {r['data_wait_fraction']:.1%}"]
    if r["gpu_idle_fraction"] is not None:
        parts.append(f"gpu idle {r['gpu_idle_fraction']:.1%}")
    parts += [f"peak mem {r['peak_memory_mb']:,.0f} MB", f"{r['seconds']:.1f} s"]
    return "  ".join(parts)


# -------------------------------------------------------------------------------------- helpers
def _idle_fraction(starts, ends) -> float | None:
    """Gaps between one step's end event and the next step's start event ÷ the first-to-last span.

    A start event completes on the GPU as soon as the work queued before it is done; if the GPU was
    still busy with the previous step, the gap is zero, and any gap is time the GPU had nothing from the
    training loop to run (it includes the loader's own copy/normalize kernels, which run between steps).
    Read once per epoch, after a synchronize, so no step waits for it.
    """
    if not starts:
        return None
    span = starts[0].elapsed_time(ends[-1])
    gaps = sum(max(0.0, ends[i].elapsed_time(starts[i + 1])) for i in range(len(starts) - 1))
    return gaps / span if span > 0 else 0.0


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # CPU: the device memory is the process's memory

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class _Progress:
    """A tqdm bar over an epoch's batches with live loss, images/s and data-wait %.

    Refreshed at most about once a second: each refresh reads the device-side sums on the host (one
    sync), which per step would stall the GPU."""

    @classmethod
    def open(cls, enabled: bool, total: int, initial: int, epoch: int, epochs: int) -> _Progress | None:
        """A bar, or None when not ``enabled`` or stderr is not a terminal (a bar redrawn into a log
        file or a pipe is noise)."""
        if not enabled or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return cls(tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{epochs}", unit="batch",
                        leave=False, dynamic_ncols=True))

    def __init__(self, bar):
        self.bar, self.last = bar, time.perf_counter()

    def update(self, meter: EpochMeter) -> None:
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.last < 1.0:
            return
        self.last, elapsed = now, now - meter.t0
        loss_sum, _, seen = meter.sums.tolist()
        self.bar.set_postfix_str(f"loss {loss_sum / max(seen, 1):.4f}  {meter.images / elapsed:,.0f} img/s  "
                                 f"data wait {meter.wait / elapsed:.0%}")

    def close(self) -> None:
        self.bar.close()
