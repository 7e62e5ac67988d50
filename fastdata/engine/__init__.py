"""The training loop: ``fit`` and ``evaluate``, with AMP, per-epoch figures, progress and checkpoints.

``fit`` is split the way torchvision's references split ``train.py``: ``train_one_epoch`` runs the
steps into an ``EpochMeter`` (device-side sums, data wait, CUDA event pairs), which yields the
``epoch_record``; a ``TrainingState`` saves and restores everything a resume needs, with the loader's
``state_dict`` as the one record of the position. The examples' shared tail (``run_result``,
``report_run``, ``write_result``) lives in ``fastdata.report``, above this module.

The loop says ``for images, labels in loader`` and nothing else about data: batches arrive on
``loader.device`` already normalized, so any backend (or any object honouring the loader contract:
``device``, ``len``, iteration; ``set_epoch`` when it has one; ``state_dict``/``load_state_dict`` to
checkpoint) plugs in unchanged. Labels
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

from .amp import (
    AMP_CHOICES,
    COMPILE_CHOICES,
    autocast,
    choose_amp,
    cuda_switches,
    device_scope,
    resolve_amp,
    resolve_compile,
)
from .loop import evaluate, fit, train_one_epoch
from .meter import EpochMeter, Progress, StepTimer, epoch_record, format_record, idle_fraction, peak_memory_mb
from .options import FitConfig
from .schedule import (
    PER_STEP_SCHEDULERS,
    SCHEDULER_INTERVALS,
    check_schedule_length,
    current_lr,
    resolve_scheduler_interval,
)
from .state import CHECKPOINT_FORMAT, PeriodicSave, TrainingState, resumed_batch
from .step import (
    ModelEma,
    TrainStep,
    check_ema,
    check_input_dtype,
    check_labels,
    correct_count,
    default_optimizer,
    wants_fused,
)

__all__ = [
    "AMP_CHOICES", "CHECKPOINT_FORMAT", "COMPILE_CHOICES", "PER_STEP_SCHEDULERS", "SCHEDULER_INTERVALS",
    "EpochMeter", "FitConfig", "ModelEma", "PeriodicSave", "Progress", "StepTimer", "TrainStep", "TrainingState",
    "autocast", "check_ema", "check_input_dtype", "check_labels", "check_schedule_length", "choose_amp",
    "correct_count", "cuda_switches", "current_lr", "default_optimizer", "device_scope", "epoch_record", "evaluate",
    "fit", "format_record", "idle_fraction", "peak_memory_mb", "resolve_amp", "resolve_compile",
    "resolve_scheduler_interval", "resumed_batch", "train_one_epoch", "wants_fused",
]
