"""The training loop: ``fit`` and ``evaluate``, with AMP, per-epoch figures, progress and checkpoints.

The loop says ``for images, labels in loader`` and nothing else about data: batches arrive on
``loader.device`` already normalized, so any backend (or any object honouring the loader contract:
``len``, ``set_epoch``, ``state_dict``/``load_state_dict``, ``device``) plugs in unchanged.

What keeps the GPU busy here:
- no host synchronization inside a step: loss and accuracy are summed on the device and read once per
  epoch (and once per progress refresh, at most about once a second, only when a bar is shown);
- ``zero_grad(set_to_none=True)``: no kernel writes zeros into every gradient, and the next backward
  writes the gradients instead of accumulating into them;
- ``cudnn.benchmark``: the fastest convolution algorithm is picked once per input shape;
- bf16 autocast where the GPU has it (no loss scaling, so no per-step check for infs), else fp16 with
  a GradScaler; optional ``torch.compile`` and channels-last;
- the default AdamW is fused on CUDA: GradScaler leaves its fp16 inf check on the device for a fused
  optimizer, and reads it on the host (one sync per step) for any other;
- the loader's GPU is made current for the run, so CUDA events, streams and capability queries refer
  to it and not to cuda:0.
"""
from __future__ import annotations

import contextlib
import math
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
CHECKPOINT_FORMAT = "fastdata-checkpoint-1"


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


def resolve_amp(amp: str, device: torch.device) -> str:
    """``choose_amp`` with this machine's capabilities filled in."""
    device = torch.device(device)
    bf16 = False
    if device.type == "cuda":
        # is_bf16_supported() asks the *current* device (cuda:0 unless set), not necessarily ``device``.
        # Without emulation: pre-Ampere GPUs "support" bf16 only through slow emulated kernels.
        with torch.cuda.device(device):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return choose_amp(amp, device.type, bf16)


def _autocast(device: torch.device, mode: str):
    # One code path for every precision: autocast disabled is a no-op context.
    return torch.autocast(device.type, dtype=_AMP_DTYPES.get(mode, torch.bfloat16), enabled=mode != "off")


# ------------------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate(model: nn.Module, loader, *, amp: str = "auto", loss_fn=None) -> dict:
    """Mean loss and accuracy of ``model`` over one pass of ``loader`` (summed over ranks under DDP).

    Returns ``{"loss", "accuracy" (0-1), "samples"}``. The model's train/eval mode is restored after.
    """
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
                loss = loss_fn(logits, labels)
            sums[0] += loss.detach().double() * n
            sums[1] += (logits.argmax(1) == labels).sum()
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
        amp: str = "auto", compile: bool = False, channels_last: bool = False, checkpoint=None,
        resume: bool = False, progress: bool = True, checkpoint_every: int | None = None,
        loss_fn=None) -> list[dict]:
    """Train ``model`` for ``epochs`` passes over ``train_loader``; return one record per epoch.

    Args:
        model: an ``nn.Module``; moved to ``train_loader.device`` when its parameters are on the CPU. A
            model already on another device than the loader's is an error. Under ``torchrun`` it is
            wrapped in DistributedDataParallel on the loader's GPU (the process group is initialized
            here if the caller did not), and on CUDA that GPU must be ``cuda:LOCAL_RANK``.
        train_loader: any fastdata loader (or an object with the same contract). It decides the device:
            training runs with that CUDA device made current (restored afterwards).
        epochs: total epochs, counting those a resumed checkpoint already finished.
        optimizer: default ``default_optimizer``: AdamW (lr 1e-3, weight decay 0.01), fused on CUDA.
        scheduler: stepped after every optimizer step (per-step schedules such as OneCycleLR).
        eval_loader: evaluated after every epoch (eval_loss / eval_accuracy); it may be
            ``train_loader`` itself: the checkpoint keeps the training position either way.
        amp: ``"auto"``, ``"bf16"``, ``"fp16"`` or ``"off"`` (see ``choose_amp``). With amp off, a loader
            whose dtype differs from the model's (a bf16 loader, a float32 model) is refused at the
            start: casting every batch would throw away what the bf16 loader saves.
        compile: ``torch.compile`` the model.
        channels_last: convert the model to channels-last (give the loaders ``channels_last=True`` too).
        checkpoint: a path; saved at the end of every epoch and every ``checkpoint_every`` batches.
            Checked before training starts: not a folder, and its folder writable (created if missing).
        resume: continue from ``checkpoint`` when it exists (mid-epoch included: the remaining batches
            are exactly those an uninterrupted run sees); start fresh when it does not.
        progress: a tqdm bar with live images/s and data-wait %, shown only when stderr is a terminal.
        checkpoint_every: also save every this many batches (None: only at epoch ends).
        loss_fn: default ``nn.CrossEntropyLoss()``.

    Each record: ``epoch`` (1-based), ``train_loss``, ``train_accuracy``, ``eval_loss``,
    ``eval_accuracy`` (None without eval_loader), ``images_per_second``, ``data_wait_fraction`` (host
    time blocked waiting for the next batch ÷ epoch wall time), ``gpu_idle_fraction`` (None on CPU; see
    below), ``peak_memory_mb`` (device memory on CUDA, the process's peak resident memory on CPU) and
    ``seconds`` (training wall time of the epoch).

    ``gpu_idle_fraction``: CUDA events are recorded on the loader device's current stream (the
    training stream) right before and right after each step; the figure is the sum of the gaps from
    one step's end event to the next step's start event ÷ the time from the first start to the last
    end. A gap is time the training stream spent on anything but training steps: waiting for the host
    to hand it the next batch, plus any loader work queued on that same stream between steps (the
    ``torch`` backend's copy and normalization, the ``memory`` backend's gather and augmentation, a
    wait for a side stream's batch that is not ready yet). Work on other streams that overlaps the
    steps (``prefetch``'s side-stream copies, DALI's GPU decoding) is not counted. Under DDP it is the
    mean over ranks.

    Empty batches (``on_error="skip"`` emptied one; a rank's share of the last batch under DDP with
    ``drop_last=False``) are left out of every figure. In a single process they are skipped without an
    optimizer step, so weights, momentum and the fp16 loss scale do not move on no data. Under DDP the
    rank runs a zero-loss step through the DDP module instead (its peers' gradient all-reduce needs it),
    and steps the optimizer with the averaged gradients like every other rank, so replicas stay equal;
    BatchNorm running statistics do not move on an empty batch. Under DDP the model must therefore
    accept an empty batch (``x.flatten(1)``, not ``x.view(x.shape[0], -1)``).
    """
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be a positive integer or None, got {checkpoint_every!r}")
    if (resume or checkpoint_every) and checkpoint is None:
        raise ValueError("resume and checkpoint_every need a checkpoint path")
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
    with _device_scope(device):
        return _fit(raw, train_loader, device, epochs=epochs, optimizer=optimizer, scheduler=scheduler,
                    eval_loader=eval_loader, amp=amp, compile=compile, channels_last=channels_last,
                    checkpoint=checkpoint, resume=resume, progress=progress,
                    checkpoint_every=checkpoint_every, loss_fn=loss_fn)


def _fit(raw, train_loader, device, *, epochs, optimizer, scheduler, eval_loader, amp, compile,
         channels_last, checkpoint, resume, progress, checkpoint_every, loss_fn) -> list[dict]:
    """``fit``'s body, run with ``device`` current; the arguments are checked."""
    mode = resolve_amp(amp, device)
    main = fdist.is_main()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (bf16-safe nets)
        torch.backends.cudnn.allow_tf32 = True

    raw.to(device)
    if channels_last:
        raw.to(memory_format=torch.channels_last)
    model_dtype = next((p.dtype for p in raw.parameters() if p.is_floating_point()), None)
    for name, loader in (("train_loader", train_loader), ("eval_loader", eval_loader)):
        if loader is not None:
            _check_input_dtype(_loader_dtype(loader), model_dtype, mode, name)
    if optimizer is None:
        optimizer = default_optimizer(raw.parameters(), device)
    # A disabled scaler passes the loss and the step straight through: one step path for all modes.
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")
    loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()

    history: list[dict] = []
    start_epoch, start_batch, global_step, partial = 0, 0, 0, [0.0, 0.0, 0.0]
    if checkpoint is not None:
        if main:  # an unusable path fails now, not after an epoch of training
            ckpt.prepare(checkpoint)
        if resume and os.path.isfile(checkpoint):
            state = ckpt.load(checkpoint)
            if state.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"'{checkpoint}' is not a fastdata checkpoint (format "
                                 f"{state.get('format')!r}, expected {CHECKPOINT_FORMAT!r})")
            raw.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if state["amp"] != mode:
                warnings.warn(f"checkpoint was trained with amp={state['amp']!r}, resuming with {mode!r}")
            if state["scaler"]:
                scaler.load_state_dict(state["scaler"])
            if scheduler is not None and state["scheduler"] is not None:
                scheduler.load_state_dict(state["scheduler"])
            # The loader's state is the one record of the position: fit reads it back from the loader.
            train_loader.load_state_dict(state["loader"])
            ckpt.set_rng_state(state["rng"])
            position = train_loader.state_dict()
            start_epoch, start_batch = position["epoch"], position["batch"]
            global_step, history = state["global_step"], list(state["history"])
            # The figures of a half-done epoch are global sums; one rank carries them on.
            partial = list(state["partial"]) if main else [0.0, 0.0, 0.0]
            if main:
                print(f"resumed from '{checkpoint}': epoch {start_epoch + 1}, batch {start_batch}/"
                      f"{len(train_loader)}", flush=True)
        elif resume and main:
            print(f"no checkpoint at '{checkpoint}' yet: starting from scratch", flush=True)

    net = fdist.wrap_ddp(raw, device)
    ddp = net is not raw
    if compile:
        net = torch.compile(net)
    # DDP's forward takes part in collectives; evaluation goes around it (each rank evaluates its shard
    # and the sums are reduced), so uneven eval batches cannot deadlock.
    eval_net = raw if fdist.is_distributed() else net
    step = _Step(net, raw, optimizer, scaler, scheduler, loss_fn, device, mode, ddp)

    def save(position: dict, sums: list[float]):
        state = {
            "format": CHECKPOINT_FORMAT, "model": raw.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None,
            "global_step": global_step, "loader": position, "rng": ckpt.rng_state(), "partial": sums,
            "history": history, "amp": mode, "world_size": fdist.world_size(),
        }
        if main:
            ckpt.save(state, checkpoint)

    for epoch in range(start_epoch, epochs):
        mid_epoch = epoch == start_epoch and start_batch > 0
        if not mid_epoch:
            train_loader.set_epoch(epoch)
        first = start_batch if mid_epoch else 0
        net.train()
        sums = torch.tensor(partial if mid_epoch else [0.0, 0.0, 0.0], dtype=torch.float64, device=device)
        images_now, wait = 0, 0.0
        timer = _StepTimer(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        bar = _progress_bar(progress and main, len(train_loader), first, epoch, epochs)
        last_refresh = t0 = time.perf_counter()
        it = iter(train_loader)
        wait += time.perf_counter() - t0  # starting workers / pipelines is waiting for data too
        batch = first
        while True:
            t = time.perf_counter()
            try:
                images, labels = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - t
            if batch == first:  # metadata only: no sync
                _check_input_dtype(images.dtype, model_dtype, mode, "train_loader")
            n = images.shape[0]
            if n or ddp:
                timer.start()
                step(images, labels, sums)
                timer.end()
            images_now += n
            batch += 1
            global_step += 1  # counts batches, empty ones included: checkpoint positions stay regular
            if bar is not None:
                bar.update(1)
                now = time.perf_counter()
                if now - last_refresh >= 1.0:  # one host sync per refresh, not per step
                    last_refresh = now
                    loss_sum, correct, seen = sums.tolist()
                    bar.set_postfix_str(f"loss {loss_sum / max(seen, 1):.4f}  "
                                        f"{images_now / (now - t0):,.0f} img/s  data wait {wait / (now - t0):.0%}")
            if checkpoint is not None and checkpoint_every and global_step % checkpoint_every == 0 \
                    and batch < len(train_loader):
                save(train_loader.state_dict(), fdist.all_sum(sums).tolist())
        # The training position, taken before evaluation: eval_loader may be this very loader, and
        # iterating it again would move the position a whole epoch on (a resume would skip an epoch).
        position = train_loader.state_dict()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        idle = timer.idle_fraction()
        peak = _peak_memory_mb(device)
        summed = fdist.all_sum(torch.tensor(
            [*sums.tolist(), images_now, wait / wall if wall > 0 else 0.0, idle or 0.0],
            dtype=torch.float64, device=device)).tolist()
        wall_max, peak_max = fdist.all_max(torch.tensor([wall, peak], dtype=torch.float64, device=device)).tolist()
        world = fdist.world_size()
        loss_sum, correct, seen, images_all, wait_frac, idle_frac = summed
        record = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / seen if seen else math.nan,
            "train_accuracy": correct / seen if seen else math.nan,
            "eval_loss": None,
            "eval_accuracy": None,
            "images_per_second": images_all / wall_max if wall_max > 0 else math.nan,
            "data_wait_fraction": wait_frac / world,
            "gpu_idle_fraction": idle_frac / world if idle is not None else None,
            "peak_memory_mb": peak_max,
            "seconds": wall_max,
        }
        if eval_loader is not None:
            result = evaluate(eval_net, eval_loader, amp=mode, loss_fn=loss_fn)
            record["eval_loss"], record["eval_accuracy"] = result["loss"], result["accuracy"]
        history.append(record)
        if main:
            print(format_record(record, epochs), flush=True)
        if checkpoint is not None:
            save(position, [0.0, 0.0, 0.0])
    return history


class _Step:
    """One training step: forward, backward, optimizer (and scaler, scheduler) step, device-side sums.

    Nothing in it reads a device value on the host: with a fused optimizer (the default on CUDA) or
    bf16, a step never waits for the GPU (a GPU test runs steps under ``set_sync_debug_mode("error")``).
    """

    def __init__(self, net, raw, optimizer, scaler, scheduler, loss_fn, device, mode, ddp):
        self.net, self.optimizer, self.scaler, self.scheduler = net, optimizer, scaler, scheduler
        self.loss_fn, self.device, self.mode, self.ddp = loss_fn, device, mode, ddp
        self.params = [p for p in raw.parameters() if p.requires_grad]

    def __call__(self, images, labels, sums):
        n = images.shape[0]
        with _autocast(self.device, self.mode):
            try:
                logits = self.net(images)
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
            loss = self.loss_fn(logits, labels) if n else _zero_loss(logits, self.params)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        # With fp16 the scaler reads its inf check on the host (one sync per step) unless the
        # optimizer is fused; bf16 needs no scaler, one reason it is preferred. Under DDP an empty
        # rank steps too: its gradients are the all-reduced ones, and a rank that skipped the step
        # would leave its replica behind the others'.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        if n:
            # Device-side sums: reading them here (.item()) would stall the host on every step.
            sums[0] += loss.detach().double() * n
            sums[1] += (logits.detach().argmax(1) == labels).sum()
            sums[2] += n


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
    """One line per epoch: the figures of a ``fit`` record."""
    parts = [f"epoch {r['epoch']}" + (f"/{epochs}" if epochs else ""),
             f"loss {r['train_loss']:.4f}", f"train acc {r['train_accuracy']:.2%}"]
    if r["eval_accuracy"] is not None:
        parts.append(f"eval acc {r['eval_accuracy']:.2%}")
    parts += [f"{r['images_per_second']:,.0f} img/s", f"data wait {r['data_wait_fraction']:.1%}"]
    if r["gpu_idle_fraction"] is not None:
        parts.append(f"gpu idle {r['gpu_idle_fraction']:.1%}")
    parts += [f"peak mem {r['peak_memory_mb']:,.0f} MB", f"{r['seconds']:.1f} s"]
    return "  ".join(parts)


def summarize(history: list[dict]) -> dict:
    """Whole-run figures from ``fit``'s records: time-weighted means and the final eval accuracy."""
    seconds = sum(r["seconds"] for r in history)

    def weighted(key):
        if not history or seconds <= 0 or any(r[key] is None for r in history):
            return None
        return sum(r[key] * r["seconds"] for r in history) / seconds

    return {
        "train_seconds": seconds,
        "images_per_second": weighted("images_per_second"),
        "data_wait_fraction": weighted("data_wait_fraction"),
        "gpu_idle_fraction": weighted("gpu_idle_fraction"),
        "peak_memory_mb": max((r["peak_memory_mb"] for r in history), default=None),
        "final_train_loss": history[-1]["train_loss"] if history else None,
        "test_accuracy": history[-1]["eval_accuracy"] if history else None,
    }


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


def _progress_bar(enabled: bool, total: int, initial: int, epoch: int, epochs: int):
    # A bar redrawn into a log file or a pipe is noise: only for a terminal.
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{epochs}", unit="batch",
                leave=False, dynamic_ncols=True)
