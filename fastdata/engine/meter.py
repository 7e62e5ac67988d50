"""What an epoch is measured by: device-side sums, data wait and CUDA event pairs (``EpochMeter``,
``StepTimer``), the record they give (``epoch_record``, printed by ``format_record``), and the progress bar
(``Progress``)."""
from __future__ import annotations

import contextlib
import math
import sys
import time

import torch

from .. import distributed as fdist


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
        self.timer = StepTimer(device)
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

    def timed(self, loader, region=None):
        """Iterate ``loader``, adding the host time spent blocked in it to ``wait``. ``region``: a
        profiler's ``region`` (``RunHooks.region``), entered as ``"data_wait"`` around each ``next``."""
        t = time.perf_counter()
        it = iter(loader)
        self.wait += time.perf_counter() - t  # starting workers / pipelines is waiting for data too
        end = object()
        while True:
            t = time.perf_counter()
            with region("data_wait") if region is not None else contextlib.nullcontext():
                batch = next(it, end)
            if batch is end:
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
        wall_max, peak_max = fdist.all_max(torch.tensor([wall, peak_memory_mb(device)], dtype=torch.float64,
                                                        device=device)).tolist()
        world = fdist.world_size()
        return epoch_record(epoch, loss_sum=loss_sum, correct=correct, seen=seen, images=images, seconds=wall_max,
                            data_wait_fraction=wait / world,
                            gpu_idle_fraction=idle_sum / world if idle is not None else None,
                            peak_memory_mb=peak_max, lr=lr)


class StepTimer:
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
        """Mark a step's start (CUDA only)."""
        if self.enabled:
            self._mark(self.starts)

    def end(self) -> None:
        """Mark a step's end (CUDA only)."""
        if self.enabled:
            self._mark(self.ends)

    def idle_fraction(self) -> float | None:
        """Read after ``torch.cuda.synchronize``; None on CPU."""
        return idle_fraction(self.starts, self.ends) if self.enabled else None


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


def idle_fraction(starts, ends) -> float | None:
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


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory in MB since the last reset on CUDA; the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # CPU: the device memory is the process's memory

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Progress:
    """A tqdm bar over an epoch's batches with live loss, images/s and data-wait %.

    Refreshed at most about once a second: each refresh reads the device-side sums on the host (one
    sync), which per step would stall the GPU."""

    @classmethod
    def open(cls, enabled: bool, total: int, initial: int, epoch: int, epochs: int) -> Progress | None:
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
        """One batch more; the figures refreshed when a second has passed."""
        self.bar.update(1)
        now = time.perf_counter()
        if now - self.last < 1.0:
            return
        self.last, elapsed = now, now - meter.t0
        loss_sum, _, seen = meter.sums.tolist()
        self.bar.set_postfix_str(f"loss {loss_sum / max(seen, 1):.4f}  {meter.images / elapsed:,.0f} img/s  "
                                 f"data wait {meter.wait / elapsed:.0%}")

    def close(self) -> None:
        """Remove the bar."""
        self.bar.close()
