"""One training step (``TrainStep``: forward, backward, optimizer, scaler, scheduler and EMA, with no host
sync), the weight average (``ModelEma``), the default optimizer, and the label and dtype checks a step and
``evaluate`` share."""
from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed as fdist
from ..models import checkpoint_blocks
from .amp import autocast, resolve_amp, resolve_compile
from .hooks import no_region
from .schedule import current_lr, one_or_each, resolve_scheduler_interval


def check_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """The model's output must be one tensor of logits, and soft (N, classes) labels must have one column
    per model output. Metadata only: no sync.

    Without this, a model returning (logits, aux_logits) or a dict failed with "'tuple' object has no
    attribute 'ndim'", and torch reads a (N, 10) target against (N, 100) logits as class indices and
    says "expected scalar type Long but found Float"."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned {_what(logits)}: fit and evaluate need its logits, one (N, classes) "
                        f"tensor. "
                        f"torchvision's inception_v3 and googlenet return (logits, aux_logits) in training: build "
                        f"them with aux_logits=False, or wrap the model so that forward returns the logits alone "
                        f"(a Hugging Face model's output.logits)")
    if logits.ndim == 2 and labels.ndim == 2 and labels.shape != logits.shape:
        raise ValueError(f"soft labels of shape {tuple(labels.shape)} for logits of shape {tuple(logits.shape)}: "
                         f"soft targets need one column per model output (give MixUp/CutMix the model's "
                         f"num_classes, {logits.shape[1]})")


def loss_value(loss, name: str, *, grad: bool = True) -> torch.Tensor:
    """``loss``, what a loss function returned, as the batch's loss: a tensor of one element (a (1,)
    tensor reshaped to a scalar) that, when ``grad`` (training), carries a gradient. Anything else is a
    TypeError naming ``name`` and what it returned; metadata only, no sync. Without this a per-sample
    loss (``reduction='none'``) failed in autograd ("grad can be implicitly created only for scalar
    outputs"), a tuple or a float (``.item()``) with "has no attribute 'backward'"."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and (loss.requires_grad or not grad):
        return loss.reshape(())
    if not isinstance(loss, torch.Tensor):
        what = f"a {type(loss).__name__} ({loss!r:.60})"
    elif loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)} (one loss per sample?)"
    else:
        what = ("a tensor that does not require grad (detached, .item()'d or computed under no_grad, or no "
                "parameter of the model requires grad)")
    raise TypeError(f"{name} returned {what}: fit needs the batch's loss as one number, a tensor computed from "
                    f"the logits: nn.CrossEntropyLoss() (reduction='mean'), or the .mean() of a per-sample loss")


def correct_count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many predictions are right, as a device tensor: ``argmax(logits) == labels``, or for soft
    labels (the logits' shape: MixUp/CutMix targets) ``argmax(logits) == argmax(labels)``, ties going to
    the lower class index (``torch.argmax``'s first maximum)."""
    target = labels.argmax(1) if labels.shape == logits.shape and labels.ndim >= 2 else labels
    return (logits.argmax(1) == target).sum()


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
        # A labelled part of the step for fit's profiler (``RunHooks.region``); a no-op without one.
        self.region = no_region

    @classmethod
    def build(cls, raw, config, device) -> TrainStep:
        """Put ``raw`` on ``device`` (channels-last if asked) and fill in the defaults of ``config`` (a
        ``FitConfig``): the precision (``resolve_amp(config.amp, device)``), the optimizer, a GradScaler,
        the loss, and a ``ModelEma`` when ``ema`` is a decay. ``gradient_checkpointing``:
        ``models.checkpoint_blocks(raw)`` on the unwrapped model, before ``wrap`` (DDP, compile); a model
        it cannot split is refused (ValueError naming it). The step runs ``raw`` itself until ``wrap``."""
        # Resolved here, from the config and device the step is built for, so that no caller can hand
        # it a mode of another run (fp16's scaler with bf16's autocast, or amp off on a bf16 model).
        mode = resolve_amp(config.amp, device)
        optimizer, scheduler, ema = config.optimizer, config.scheduler, config.ema
        if config.gradient_checkpointing:
            try:
                checkpoint_blocks(raw)   # before anything else: a refusal leaves the model as it was
            except ValueError as e:
                raise ValueError(f"fit(gradient_checkpointing=True): {e}") from e
        raw.to(device)
        if config.channels_last:
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
        loss_fn = config.loss_fn if config.loss_fn is not None else nn.CrossEntropyLoss()
        # After the move: the average lives beside the weights it follows.
        if isinstance(ema, float):
            ema = ModelEma(raw, ema)
        elif isinstance(ema, ModelEma):
            ema.module.to(device)
        return cls(raw, raw, optimizer, scaler, scheduler, loss_fn, device, mode, ddp=False,
                   scheduler_interval=config.scheduler_interval, accumulate=config.accumulate,
                   clip_grad_norm=config.clip_grad_norm, ema=ema)

    def wrap(self, *, compile: bool | str, ddp=None, compiled=None) -> None:
        """DistributedDataParallel under torchrun (on the loader's GPU), or ``ddp``, the caller's own
        wrapper of the model, kept: rebuilt on the default group, a DDP over another group would average
        gradients with ranks the caller kept apart, and lose its options. Then ``torch.compile`` if
        asked (``compile="reduce-overhead"``: CUDA graphs on CUDA, see ``resolve_compile``).

        ``compiled``: the caller's own ``torch.compile`` of ``raw`` (or of ``ddp``): it runs as they built
        it, unless ``compile=`` asks fit to compile ``raw`` its own way."""
        mode = resolve_compile(compile, self.device)
        own = compiled if mode is None else None
        base = own if own is not None and compiled_original(own) is self.raw else self.raw
        net = ddp if ddp is not None else fdist.wrap_ddp(base, self.device)
        self.ddp = net is not base
        self.eager = net
        self.graphs = mode == "reduce-overhead"
        if own is not None and compiled_original(own) is net:   # torch.compile(DDP(model))
            net = own
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
        check_input_dtype(dtype, self.model_dtype, self.mode, name)

    def epoch_lr(self) -> float | list[float]:
        """The epoch's lr figure, read once when its training pass ends: the rate its last step trained
        at. For an epoch schedule that is the optimizer's rate now (the scheduler has not stepped yet);
        a per-step schedule has already moved it on to the next step's, which after a OneCycleLR's
        last step is torch's extrapolation past the schedule's end, a rate no step used."""
        if self.interval == "step" and self.last_step_lrs is not None:
            return one_or_each(self.last_step_lrs)
        return current_lr(self.optimizer)

    def batch_lr(self, stepped: bool) -> float | list[float]:
        """The rate the batch just done trained at (the run log's step rows): its step's, read before a
        per-step scheduler moved it on, when it ended an optimizer step; else the rate its group's step
        will use, the optimizer's now."""
        return self.epoch_lr() if stepped else current_lr(self.optimizer)

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
        epoch) makes its first group the rest of the one it started in. ``batches`` is the epoch's
        length as ``len()`` says it, None when the loader has none: every group is then planned whole.
        A loader yielding more than ``batches`` steps on each extra batch alone; one that ends before a
        group's planned end leaves that group to ``finish_group``."""
        n = self.accumulate
        if n == 1 or (batches is not None and batch >= batches):
            return batch, batch + 1
        aligned = batch - batch % n
        end = aligned + n if batches is None else min(aligned + n, batches)
        return max(first_batch, aligned), end

    def __call__(self, images, labels, sums, *, scale: float = 1.0, last: bool = True):
        """``backward`` on one batch, then ``optimizer_step`` when ``last``; returns its grad norm."""
        self.backward(images, labels, sums, scale=scale, sync=last)
        return self.optimizer_step() if last else None

    def backward(self, images, labels, sums, *, scale: float = 1.0, sync: bool = True) -> torch.Tensor:
        """Forward and backward of one batch, its loss times ``scale`` (1/the batches accumulated for one
        optimizer step), gradients added to those of the step's batches before it. ``sync=False``
        (under DDP): inside ``no_sync``, no gradient all-reduce: one per optimizer step, at its last batch.
        Returns the batch's (unscaled) loss, a detached device tensor: nothing is read on the host."""
        n = images.shape[0]
        if self.accumulated == 0:
            # set_to_none: no kernel writes zeros, and the first backward writes the gradients.
            self.optimizer.zero_grad(set_to_none=True)
        quiet = self.eager.no_sync() if self.ddp and not sync else contextlib.nullcontext()
        with self.region("forward_backward"), quiet:
            logits, loss = self._forward(self._module_for(n), images, labels, n)
            self.scaler.scale(loss * scale if scale != 1.0 else loss).backward()
        self.accumulated += 1
        if n:
            # Device-side sums (the unscaled loss): reading them here (.item()) would stall the host on
            # every step.
            sums[0] += loss.detach().double() * n
            sums[1] += correct_count(logits.detach(), labels)
            sums[2] += n
        return loss.detach()

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
        with autocast(self.device, self.mode):
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
            check_labels(logits, labels)
            loss = loss_value(self.loss_fn(logits, labels), "loss_fn") if n else _zero_loss(logits, self.params)
        return logits, loss

    def finish_group(self, planned: int, arrived: int) -> torch.Tensor | None:
        """Step on a group the loader ended inside: ``arrived`` of its ``planned`` batches came (empty ones
        counted, as in a whole group), each backpropagated with its loss over ``planned``. Returns
        ``optimizer_step``'s norm; None when no gradient is pending (the group was stepped whole).

        Why after the fact: a batch is known to be the group's last only when the next ``next()`` ends
        the loop, and looking one batch ahead would hold one more batch on the device and move the
        loader's position past what ``after_batch`` (a checkpoint) records. So the gradients are
        rescaled by ``planned / arrived`` here: one multiply a gradient per group cut short (at most once
        an epoch), never a host read per batch. Under DDP its batches all ran in ``no_sync``: they are
        averaged over the ranks by hand (one all-reduce a gradient, no host read; DDP's own reducer
        averages the same way), so replicas stay equal. Like every step, it is a collective there: the
        ranks' loaders must end alike (as they must yield alike for DDP's own all-reduces)."""
        if not self.accumulated:
            return None
        # DDP's own group (the default one when fit wraps the model, but a user's DDP may hold another).
        group = self.eager.process_group if self.ddp else None
        factor = planned / arrived / (dist.get_world_size(group) if self.ddp else 1)
        for grad in (p.grad for p in self.params if p.grad is not None):
            if self.ddp:
                dist.all_reduce(grad, group=group)
            if factor != 1.0:
                grad.mul_(factor)
        return self.optimizer_step()

    def optimizer_step(self) -> torch.Tensor | None:
        """Step the optimizer on the gradients accumulated since the last step (none: nothing happens),
        clipping them first when ``clip_grad_norm`` is set; then the scaler, the EMA and a per-step
        scheduler. Returns the total gradient norm before clipping (a device tensor), or None."""
        if not self.accumulated:
            return None
        with self.region("optimizer"):
            return self._step()

    def _step(self) -> torch.Tensor | None:
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
        check_ema(decay)
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


def check_ema(ema) -> None:
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


def compiled_original(module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, when ``module`` is what it returned (an ``OptimizedModule``,
    whose state_dict prefixes every key with ``_orig_mod.``); None for any other module."""
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else None


def _zero_loss(logits, params) -> torch.Tensor:
    return 0.0 * (logits.float().sum() + sum(p.sum() for p in params))


def _what(value) -> str:
    """What a model or loader gave instead of a tensor (pair), for an error: a dict's keys, a sequence's types."""
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(t).__name__ for t in value)})"
    return f"a {type(value).__name__}"


def batch_pair(batch, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` as ``(images, labels)``, or a TypeError naming ``name`` and what it yielded. Unpacking a
    dict gives its keys, and the error came later and named neither ("'str' object has no attribute
    'dtype'"). Type checks only: nothing is read from the device."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return batch[0], batch[1]
    raise TypeError(f"{name} must yield (images, labels) pairs of tensors; it yielded {_what(batch)}: wrap it so that "
                    f"each batch is (images, labels), e.g. (b['images'], b['labels']) for a loader of dicts")


def check_batch_device(images, labels, device: torch.device, name: str) -> None:
    """Refuse a batch whose tensors are not on ``device`` (the loader's ``device``, where the model is),
    naming the loader: fit never moves batches (the contract puts them there), and torch's own error
    ("Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same")
    names neither the loader nor the cure. Metadata only: no sync."""
    for what, t in (("images", images), ("labels", labels)):
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            raise ValueError(f"{name} says its batches are on {device} but yielded {what} on {t.device}: "
                             f"fit does not move batches; yield them on {device} (a fastdata loader does: "
                             f"make_loader(source, 'torch', device='{device}')) or set the loader's device "
                             f"to where they are")


def check_input_dtype(dtype, model_dtype, mode: str, name: str) -> None:
    """With autocast off, the batches must already have the model's dtype.

    Decision: refuse, do not cast. A bf16 loader exists to move and store half the bytes; casting every
    batch back to float32 would pay for the conversion and keep none of the saving."""
    if dtype is None or model_dtype is None or mode != "off" or not dtype.is_floating_point:
        return
    if dtype != model_dtype:
        short, model_short = str(dtype).replace("torch.", ""), str(model_dtype).replace("torch.", "")
        amp = "bf16" if dtype == torch.bfloat16 else "fp16"
        raise TypeError(f"{name} yields {short} images but the model's parameters are {model_short} and "
                        f"amp is off: pass amp='{amp}' to fit or evaluate (autocast runs the model in {short}), or "
                        f"build the loader with dtype=torch.{model_short}")
