"""``FitConfig``: every option of ``fit`` in one frozen dataclass, checked once when it is built.

Before it, ``fit``'s 26 keywords were listed again by its argument checks, ``TrainStep.build`` and the
epoch loop: four copies of one list, each a place to forget the newest option. Now ``fit`` builds (or
receives) one ``FitConfig`` and hands the object on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..checks import check_choice, check_flag, check_integer, check_number
from .amp import AMP_CHOICES, resolve_compile
from .hooks import check_output_dir
from .schedule import resolve_scheduler_interval
from .step import check_ema

# fit's switches that must be True or False (not 1 or "no", which would be read as truthy values).
_FLAGS = ("channels_last", "resume", "progress", "cudnn_benchmark", "tf32", "gradient_checkpointing")


@dataclass(frozen=True)
class FitConfig:
    """The options of one ``fit`` call: ``fit(model, loader, epochs=3, amp="bf16")`` and
    ``fit(model, loader, config=FitConfig(epochs=3, amp="bf16"))`` train alike. Every field is checked
    when the config is built (a TypeError or ValueError naming the field and what is valid), so a wrong
    option fails before any model or data is touched.

    Args:
        epochs: total epochs, counting those a resumed checkpoint already finished (required).
        optimizer: default ``default_optimizer``: AdamW (lr 1e-3, weight decay 0.01), fused on CUDA. An
            object with ``param_groups``, ``step()`` and ``zero_grad()`` (and ``state_dict()``,
            ``load_state_dict()`` when there is a ``checkpoint``).
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
        eval_loader: evaluated after every epoch (eval_loss / eval_accuracy); it may be the training
            loader itself: the checkpoint keeps the training position either way.
        amp: ``"auto"``, ``"bf16"``, ``"fp16"`` or ``"off"`` (see ``choose_amp``). With amp off, a loader
            whose dtype differs from the model's (a bf16 loader, a float32 model) is refused at the
            start: casting every batch would throw away what the bf16 loader saves.
        compile: ``True``: ``torch.compile`` the model; ``"reduce-overhead"``: compile it into CUDA graphs
            (``torch.compile(mode="reduce-overhead")``), for small models whose GPU step is launch-bound.
            On the CPU ``"reduce-overhead"`` falls back to ``True`` with a one-line warning. Graphs are
            recorded for one shape: training batches of the first batch's size run the graphs, any other
            size (the last short batch of an epoch, an empty one) runs the model eagerly, and so does
            evaluation, so no shape records a graph it uses once or recompiles every epoch.
        channels_last: convert the model to channels-last (give the loaders ``channels_last=True`` too).
        accumulate: batches per optimizer step (default 1): each batch's loss is scaled by 1/N, their
            gradients add up, and the optimizer, the fp16 scaler, the EMA and a per-step scheduler step
            once per N batches (a per-step schedule's length is counted in optimizer steps:
            ``steps_per_epoch=math.ceil(len(train_loader) / N)``). Under DDP the first N-1 batches run in
            ``no_sync``: one gradient all-reduce per step. An epoch's batches are grouped from its start;
            when N does not divide them, the last group is the remainder, its losses scaled by 1/its size
            (a group the loader ends before ``len()`` said is rescaled to the batches that came), so every
            step's gradient is the mean over the batches it saw (with equal batches, the mean
            over its samples: the gradient one batch of them all would give). Checkpoints fall on step
            boundaries only (a ``checkpoint_every`` save due inside a step waits for the step's end), so a
            resume gives the uninterrupted run's weights.
        clip_grad_norm: clip the gradients' total norm to this (a finite number > 0) before each optimizer
            step (after ``scaler.unscale_`` under fp16, so the threshold is in the gradients' own units).
            The epoch record gets ``grad_norm``: the mean pre-clip norm of its steps (steps fp16 skipped
            for infinite gradients left out; a resumed epoch's mean covers the steps after the resume).
        ema: keep an exponential moving average of the weights: a decay (a float in (0, 1), e.g. 0.999,
            for a ``ModelEma``) or an object with ``update(model)`` and ``module`` (timm's
            ``ModelEmaV3``), updated after every optimizer step without a host sync. The evaluation then
            runs the averaged weights (the record says ``eval_ema: True``); the checkpoint keeps the
            average (key ``"ema"``) and a resume continues it. The model keeps its trained weights; to use
            the average after fit, pass ``ModelEma(model, 0.999)`` and read its ``module`` (fit moves a
            ``ModelEma`` to the loader's device with the model).
        gradient_checkpointing: recompute each block's activations in backward instead of keeping them
            (``fastdata.models.checkpoint_blocks``, applied to the model on its device before DDP and
            compile): SmallCNN, torchvision ResNets, an ``nn.Sequential``, timm models. Same gradients, less
            activation memory, about one more forward of compute. Another model is refused, named, before
            training.
        checkpoint: a path, or a URL (``s3://...``, ``gs://...``, ``memory://...``: through fsspec, see
            ``fastdata.checkpoint.storage_for``); saved at the end of every epoch and every
            ``checkpoint_every`` batches (see ``TrainingState``), by rank 0. Checked before training
            starts: not a folder, and its folder writable (created if missing). Numpy values in the
            optimizer's or scheduler's state are saved as Python numbers and tensors
            (``checkpoint.loadable``); a value no checkpoint can read back is refused, naming its key.
            Weights that went NaN or inf are never saved: the run stops with a FloatingPointError naming
            the epoch and batch where the loss first went non-finite (``state.check_diverged``; with
            finite weights, as after fp16 skipped the step, a RuntimeWarning says so and training goes on).
        resume: continue from ``checkpoint`` when it exists (mid-epoch included: the remaining batches
            are exactly those an uninterrupted run sees); start fresh when it does not. Under torchrun
            rank 0 decides whether it exists and what it holds: a rank that cannot read the same file
            (another node's disk) gets rank 0's over the process group. A checkpoint written under
            another world size or batch size resumes too (the rest of the epoch is re-split over the
            new ranks, every sample once; a OneCycleLR built for the old steps per epoch is refused
            when the run would step past its end). Needs ``checkpoint``.
        checkpoint_every: also save every this many batches (an integer >= 1; None: only at epoch ends).
            Needs ``checkpoint``.
        checkpoint_storage: where ``checkpoint`` is read and written: any object with ``exists``,
            ``read_bytes`` and ``write_bytes`` (``fastdata.checkpoint.Storage``); None: the local file
            system for a path, fsspec for a URL.
        progress: a tqdm bar with live images/s and data-wait %, shown only when stderr is a terminal
            or a Jupyter notebook's output (never into a log file or a pipe).
        loss_fn: the training loss, ``loss_fn(logits, labels)``; default ``nn.CrossEntropyLoss()``
            (class indices or class probabilities; under autocast it computes in float32 whatever the
            logits' dtype). It is not used for evaluation: see ``eval_loss_fn``. Both return the batch's
            loss as one number (a scalar tensor, from the logits); a per-sample loss (``reduction='none'``),
            a tuple or a float is a TypeError naming the loss (``step.loss_value``).
        eval_loss_fn: the loss ``evaluate`` reports as ``eval_loss``; default ``nn.CrossEntropyLoss()``
            on the evaluation labels, hard or soft. Separate from ``loss_fn`` because a training loss
            often does not take the evaluation labels: timm's recipe trains with
            ``SoftTargetCrossEntropy`` on MixUp/CutMix's float (N, classes) targets, which fails on the
            int64 class indices of an eval loader; a label-smoothing loss would report a smoothed
            figure. Give one to evaluate with your own (it also feeds ``ReduceLROnPlateau``).
        cudnn_benchmark: on CUDA, turn ``torch.backends.cudnn.benchmark`` on while fit runs (cuDNN
            times its algorithms once per input shape and keeps the fastest). ``False``: fit leaves
            the flag as the caller set it.
        tf32: on CUDA, let fp32 matmuls and convolutions use TF32 tensor cores while fit runs (only
            what autocast leaves in fp32 is affected). ``False``: fit leaves the flags as they are.
            Both switches are process-wide, so fit sets them for the run only and restores the
            caller's values on the way out (``cuda_switches``); on the CPU it touches neither.
        profile: a folder: a ``torch.profiler`` trace of a few steps after warm-up (``StepProfiler``'s
            defaults: 1 skipped, 2 warm-up, 5 recorded; a run of fewer batches writes none and warns),
            readable in TensorBoard or ui.perfetto.dev, one file per rank; its per-step table (data wait vs
            host-to-device copy vs forward/backward vs optimizer) is printed when the run ends, by rank 0.
        log_dir: a folder: the run log (``fastdata.runlog.RunLog``, rank 0 writes): ``epochs.csv`` with every
            epoch record, ``steps.csv`` with the loss, lr, images/s and data wait of every ``log_every``-th
            batch (numbered ``epoch * len(train_loader) + batch`` so a resume continues), and TensorBoard
            scalars when the tensorboard package is installed. ``fastdata.runlog.plot_curves`` draws it.
            Both folders are checked before training (writable; a file is refused).
        log_every: the batches between two rows of ``steps.csv`` (an integer >= 1, default 50).
        timing_warmup: optimizer steps at the start of this call's first epoch that are timed apart as
            warm-up (an integer >= 0, default 5; at most half that epoch's steps; 0: none; not a
            learning-rate warm-up). They pay once-a-process costs (lazy CUDA loading, cuDNN's autotuning,
            compilation, the first worker start-up: a first step of 3 s where the next take
            milliseconds), so that epoch's ``images_per_second``, ``data_wait_fraction`` and
            ``gpu_idle_fraction`` are of the steps after them, and their wall time is the record's
            ``warmup_seconds``. Later epochs are measured whole: a cost every epoch pays (a loader's
            restart) is in their figures.
    """

    epochs: int
    optimizer: Any = None
    scheduler: Any = None
    scheduler_interval: str | None = None
    eval_loader: Any = None
    amp: str = "auto"
    compile: bool | str = False
    channels_last: bool = False
    accumulate: int = 1
    clip_grad_norm: float | None = None
    ema: Any = None
    gradient_checkpointing: bool = False
    checkpoint: Any = None
    resume: bool = False
    checkpoint_every: int | None = None
    checkpoint_storage: Any = None
    progress: bool = True
    loss_fn: Any = None
    eval_loss_fn: Any = None
    cudnn_benchmark: bool = True
    tf32: bool = True
    profile: Any = None
    log_dir: Any = None
    log_every: int = 50
    timing_warmup: int = 5

    def __post_init__(self):
        check_integer("epochs", self.epochs, minimum=0)
        if self.checkpoint_every is not None:
            check_integer("checkpoint_every", self.checkpoint_every, minimum=1)
        for name in _FLAGS:
            check_flag(name, getattr(self, name))
        if (self.resume or self.checkpoint_every) and self.checkpoint is None:
            raise ValueError("resume and checkpoint_every need a checkpoint path")
        self._check_step_options()
        self._check_trainers()
        check_output_dir("profile", self.profile)
        check_output_dir("log_dir", self.log_dir)
        check_integer("log_every", self.log_every, minimum=1)
        check_integer("timing_warmup", self.timing_warmup, minimum=0)
        resolve_scheduler_interval(None, self.scheduler_interval)  # an unknown value fails here

    @classmethod
    def of(cls, config: FitConfig | None = None, options: dict | None = None) -> FitConfig:
        """The config of a ``fit(model, loader, config=..., **options)`` call: ``config`` with ``options``
        overriding its fields (``dataclasses.replace``), or, without a config, one built from ``options``
        alone. A name that is no field is a TypeError listing the fields."""
        options = dict(options or {})
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"fit() got unexpected option(s) {unknown}; the options are FitConfig's fields: "
                            f"{[f.name for f in dataclasses.fields(cls)]}")
        if config is None:
            if "epochs" not in options:
                raise TypeError("fit() needs epochs= (the total epochs to train), or config=FitConfig(epochs=...)")
            return cls(**options)
        if not isinstance(config, cls):
            raise TypeError(f"config must be a fastdata.FitConfig or None, got {config!r} ({type(config).__name__})")
        return dataclasses.replace(config, **options) if options else config

    def _check_step_options(self) -> None:
        """The options of the step itself: amp, accumulation, clipping, the average, compilation."""
        check_choice("amp", self.amp, AMP_CHOICES)
        check_integer("accumulate", self.accumulate, minimum=1)
        # clip_grad_norm: the gradients' largest total norm.
        check_number("clip_grad_norm", self.clip_grad_norm, above=0, optional=True)
        check_ema(self.ema)
        resolve_compile(self.compile, "cuda")   # the value alone: the device's fallback is said when wrapping

    def _check_trainers(self) -> None:
        """The optimizer, the scheduler and the losses, by what fit uses rather than by class: an
        optimizer or scheduler of another library that does not subclass torch's still trains.
        ``state_dict()`` is needed only to write checkpoints. A string where a scheduler belongs would
        otherwise fail only when the first epoch ends."""
        saving = self.checkpoint is not None
        optimizer, scheduler = self.optimizer, self.scheduler
        wants: tuple[str, ...] = ("step", "zero_grad", "state_dict", "load_state_dict") if saving else \
            ("step", "zero_grad")
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
        check_loss("loss_fn", self.loss_fn)
        check_loss("eval_loss_fn", self.eval_loss_fn)


def check_loss(name: str, loss_fn) -> None:
    """``loss_fn``: None (cross-entropy) or a callable ``loss_fn(logits, labels)``, else a TypeError."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{name} must be callable as {name}(logits, labels) (e.g. nn.CrossEntropyLoss()), "
                        f"or None (cross-entropy); got {loss_fn!r} ({type(loss_fn).__name__})")
