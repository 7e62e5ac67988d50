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
  a GradScaler; optional ``torch.compile`` and channels-last.
"""
from __future__ import annotations

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
    # Without emulation: pre-Ampere GPUs "support" bf16 only through slow emulated kernels.
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
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
    device = loader.device
    mode = resolve_amp(amp, device)
    loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, samples
    try:
        for images, labels in loader:
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
def fit(model: nn.Module, train_loader, *, epochs: int, optimizer=None, scheduler=None, eval_loader=None,
        amp: str = "auto", compile: bool = False, channels_last: bool = False, checkpoint=None,
        resume: bool = False, progress: bool = True, checkpoint_every: int | None = None,
        loss_fn=None) -> list[dict]:
    """Train ``model`` for ``epochs`` passes over ``train_loader``; return one record per epoch.

    Args:
        model: an ``nn.Module``; moved to ``train_loader.device``. Under ``torchrun`` it is wrapped in
            DistributedDataParallel (the process group is initialized here if the caller did not).
        train_loader: any fastdata loader (or an object with the same contract).
        epochs: total epochs, counting those a resumed checkpoint already finished.
        optimizer: default AdamW (lr 1e-3, weight decay 0.01): forgiving for a model it knows nothing of.
        scheduler: stepped after every optimizer step (per-step schedules such as OneCycleLR).
        eval_loader: evaluated after every epoch (eval_loss / eval_accuracy).
        amp: ``"auto"``, ``"bf16"``, ``"fp16"`` or ``"off"`` (see ``choose_amp``).
        compile: ``torch.compile`` the model.
        channels_last: convert the model to channels-last (give the loaders ``channels_last=True`` too).
        checkpoint: a path; saved at the end of every epoch and every ``checkpoint_every`` steps.
        resume: continue from ``checkpoint`` when it exists (mid-epoch included: the remaining batches
            are exactly those an uninterrupted run sees); start fresh when it does not.
        progress: a tqdm bar with live images/s and data-wait %, shown only when stderr is a terminal.
        checkpoint_every: also save every this many optimizer steps (None: only at epoch ends).
        loss_fn: default ``nn.CrossEntropyLoss()``.

    Each record: ``epoch`` (1-based), ``train_loss``, ``train_accuracy``, ``eval_loss``,
    ``eval_accuracy`` (None without eval_loader), ``images_per_second``, ``data_wait_fraction`` (host
    time blocked waiting for the next batch ÷ epoch wall time), ``gpu_idle_fraction`` (gaps between
    consecutive steps on the GPU timeline ÷ the epoch's GPU time span; None on CPU),
    ``peak_memory_mb`` (device memory on CUDA, the process's peak resident memory on CPU) and
    ``seconds`` (training wall time of the epoch).
    """
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}")
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
        raise ValueError(f"checkpoint_every must be a positive integer or None, got {checkpoint_every!r}")
    if (resume or checkpoint_every) and checkpoint is None:
        raise ValueError("resume and checkpoint_every need a checkpoint path")
    device = torch.device(train_loader.device)
    mode = resolve_amp(amp, device)
    if fdist.env_world_size() > 1 and not fdist.is_distributed():
        fdist.init_distributed(device.type)
    main = fdist.is_main()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (bf16-safe nets)
        torch.backends.cudnn.allow_tf32 = True

    raw = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    raw.to(device)
    if channels_last:
        raw.to(memory_format=torch.channels_last)
    if optimizer is None:
        optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-3, weight_decay=0.01)
    # A disabled scaler passes the loss and the step straight through: one step path for all modes.
    scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")
    loss_fn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()

    history: list[dict] = []
    start_epoch, start_batch, global_step, partial = 0, 0, 0, [0.0, 0.0, 0.0]
    if checkpoint is not None:
        if main:
            os.makedirs(os.path.dirname(os.path.abspath(checkpoint)), exist_ok=True)
            ckpt.clean_stale(checkpoint)
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
            train_loader.load_state_dict(state["loader"])
            ckpt.set_rng_state(state["rng"])
            start_epoch, start_batch = state["loader"]["epoch"], state["loader"]["batch"]
            global_step, history = state["global_step"], list(state["history"])
            # The figures of a half-done epoch are global sums; one rank carries them on.
            partial = list(state["partial"]) if main else [0.0, 0.0, 0.0]
            if main:
                print(f"resumed from '{checkpoint}': epoch {start_epoch + 1}, batch {start_batch}/"
                      f"{len(train_loader)}", flush=True)
        elif resume and main:
            print(f"no checkpoint at '{checkpoint}' yet: starting from scratch", flush=True)

    net = fdist.wrap_ddp(raw, device)
    if compile:
        net = torch.compile(net)
    # DDP's forward takes part in collectives; evaluation goes around it (each rank evaluates its shard
    # and the sums are reduced), so uneven eval batches cannot deadlock.
    eval_net = raw if fdist.is_distributed() else net

    def save(epoch: int, batch: int, sums: list[float]):
        state = {
            "format": CHECKPOINT_FORMAT, "model": raw.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None,
            "epoch": epoch, "step": batch, "global_step": global_step, "loader": train_loader.state_dict(),
            "rng": ckpt.rng_state(), "partial": sums, "history": history, "amp": mode,
            "world_size": fdist.world_size(),
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
        starts, ends = [], []
        timed = device.type == "cuda"
        if timed:
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
            n = images.shape[0]
            if timed:
                starts.append(torch.cuda.Event(enable_timing=True))
                starts[-1].record()
            with _autocast(device, mode):
                logits = net(images)
                loss = loss_fn(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            # With fp16 the scaler reads its inf check on the host (one sync per step) unless the
            # optimizer is fused; bf16 needs no scaler, one reason it is preferred.
            scaler.step(optimizer)
            scaler.update()
            if scheduler is not None:
                scheduler.step()
            # Device-side sums: reading them here (.item()) would stall the host on every step.
            sums[0] += loss.detach().double() * n
            sums[1] += (logits.detach().argmax(1) == labels).sum()
            sums[2] += n
            if timed:
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record()
            images_now += n
            batch += 1
            global_step += 1
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
                save(epoch, batch, fdist.all_sum(sums).tolist())
        if timed:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        idle = _idle_fraction(starts, ends)
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
            save(epoch + 1, 0, [0.0, 0.0, 0.0])
    return history


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
