"""What an epoch is measured by: device-side sums, data wait and CUDA event pairs (``EpochMeter``,
``StepTimer``), the record they give (``epoch_record``, printed by ``format_record``), and the progress bar
(``Progress``).

Warm-up and steady state: the first steps of a process pay one-time costs (lazy CUDA module loading,
cuDNN's autotuning, ``torch.compile``, the allocator's growth, the first worker start-up): about 3 s for a
first step on an H200 against milliseconds for the next ones. Counted in, they decide the figures of a
short epoch: a loader that left the GPU idle most of the time read 0.099. So an ``EpochMeter`` may be
given a warm-up of N optimizer steps (``fit`` gives its first epoch one): ``images_per_second``,
``data_wait_fraction`` and ``gpu_idle_fraction`` are then the steady state's (the steps after those N),
and the warm-up's wall time is a figure of its own, ``warmup_seconds``."""
from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from .. import distributed as fdist


def epoch_record(epoch: int, *, loss_sum: float, correct: float, seen: float, images: float, seconds: float,
                 data_wait_fraction: float, gpu_idle_fraction: float | None, peak_memory_mb: float,
                 lr: float | list[float] | None = None, warmup_seconds: float = 0.0,
                 warmup_images: float = 0) -> dict:
    """One epoch's figures, as ``fit`` returns them (a plain dict: it goes into checkpoints and JSON).

    Keys: ``epoch`` (1-based), ``train_loss`` and ``train_accuracy`` (NaN when no sample was seen;
    against soft labels a sample is right when ``argmax(logits) == argmax(labels)``), ``eval_loss`` and
    ``eval_accuracy`` (None until an eval_loader fills them), ``lr`` (the learning rate when the epoch's
    training pass ended, before an epoch-interval scheduler stepped: for an epoch schedule the rate the
    epoch trained at, for a per-step one the rate its next step uses; a float when every parameter
    group shares it, else a list, one per group; see ``current_lr``), ``images_per_second`` (the
    steady state's: ``images - warmup_images`` ÷ ``seconds - warmup_seconds``), ``data_wait_fraction``
    (host time blocked waiting for the next batch ÷ wall time, of the steady state: the caller measures
    it so), ``gpu_idle_fraction`` (None on CPU; see ``EpochMeter``), ``peak_memory_mb`` (device memory on
    CUDA, the process's peak resident memory on CPU), ``seconds`` (training wall time, warm-up included),
    ``warmup_seconds`` (the part of ``seconds`` left out of the three rates; 0.0 without a warm-up) and
    ``images`` (the images trained, warm-up included). Records from before the last two existed lack them:
    read them with ``.get``.
    """
    steady = seconds - warmup_seconds
    return {
        "epoch": epoch,
        "train_loss": loss_sum / seen if seen else math.nan,
        "train_accuracy": correct / seen if seen else math.nan,
        "eval_loss": None,
        "eval_accuracy": None,
        "lr": lr,
        "images_per_second": (images - warmup_images) / steady if steady > 0 else math.nan,
        "data_wait_fraction": data_wait_fraction,
        "gpu_idle_fraction": gpu_idle_fraction,
        "peak_memory_mb": peak_memory_mb,
        "seconds": seconds,
        "warmup_seconds": warmup_seconds,
        "images": int(images),
    }


def warmup_steps(timing_warmup: int, batches: int, accumulate: int = 1) -> int:
    """The warm-up of an epoch of ``batches`` batches (``accumulate`` a step): ``timing_warmup`` optimizer
    steps, but at most half the epoch's steps, so that a short epoch keeps a steady state to measure (4
    steps: 2 of warm-up; 1 step: none)."""
    return min(timing_warmup, math.ceil(batches / accumulate) // 2)


class EpochMeter:
    """The running figures of one epoch: device-side sums, host-side data wait, CUDA event pairs.

    ``sums`` (loss × samples, correct, samples) stay on the device and are added to inside each step,
    so no step reads a device value on the host; ``record`` reads them once, at the epoch's end.
    ``wait`` is host time blocked in the loader while the GPU may idle (``timed``). ``timer`` records CUDA events right
    before and after each step on the loader device's current stream (the training stream);
    ``gpu_idle_fraction`` is the sum of the gaps from one step's end event to the next step's start
    event ÷ the time from the first start to the last end, both of the steady state. A gap is time the
    training stream spent on anything but training steps: waiting for the host to hand it the next batch,
    plus any loader work queued on that same stream between steps (the ``torch`` backend's copy and
    normalization, the ``memory`` backend's gather and augmentation, a wait for a side stream's batch
    that is not ready yet). Work on other streams that overlaps the steps (``prefetch``'s side-stream
    copies, DALI's GPU decoding) is not counted.

    Warm-up: the first ``warmup_steps`` optimizer steps (the loop calls ``stepped`` after each) are left
    out of ``images_per_second``, ``data_wait_fraction`` and ``gpu_idle_fraction``; their wall time, from
    the meter's start (so the loader's start-up too) to the end of the last of them on the device, is
    ``warmup_seconds``. An epoch that has no step after its warm-up is measured whole (``warmup_seconds``
    0.0). Under DDP every figure is reduced over ranks: sums and images added, idle and wait the mean of
    the ranks' fractions, ``seconds`` the slowest rank's, the steady span the longest rank's.

    Args:
        device: the loader's device.
        carried: sums a resumed half-done epoch carries over (global sums, held by one rank).
        warmup_steps: optimizer steps of warm-up (default 0: the whole epoch is the steady state).
    """

    def __init__(self, device: torch.device, carried: list[float] | None = None, warmup_steps: int = 0):
        self.device = device
        self.sums = torch.tensor(carried or [0.0, 0.0, 0.0], dtype=torch.float64, device=device)
        self.images, self.wait = 0, 0.0
        #: None, or a list that ``timed`` appends ``(start, seconds, counted)`` to for every wait (the
        #: first for ``iter()``): where a data-wait figure came from, for a diagnosis (the CUDA tests').
        self.trace: list | None = None
        self.timer = StepTimer(device)
        self.norms = torch.zeros(2, dtype=torch.float64, device=device)  # sum, count of finite grad norms
        # The loss sum after each batch of this pass, on the device: once a NaN or inf is in, it stays, so
        # the first non-finite entry is where the loss first went non-finite (``nonfinite_batch``). One
        # copy kernel a batch, no host read; grown by doubling.
        self._trail: torch.Tensor | None = None
        self._trailed = 0
        self.warmup_steps, self.steps = warmup_steps, 0
        self.steady: tuple | None = None   # (host time, images, wait, steps) when the warm-up ended
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.t0 = time.perf_counter()

    def stepped(self) -> None:
        """One optimizer step is done (its batch timed and counted in ``images``). The ``warmup_steps``-th
        ends the warm-up: the steady state's figures count from here."""
        self.steps += 1
        if self.steps != self.warmup_steps:
            return
        if self.device.type == "cuda":
            # Once an epoch, at most: the host runs ahead of the GPU, and without the sync the steady
            # clock would start while the warm-up's queued kernels still run.
            torch.cuda.synchronize(self.device)
        self.steady = (time.perf_counter(), self.images, self.wait, self.steps)
        self.timer.mark_steady()

    def steady_start(self) -> tuple[float, int, float] | None:
        """(host time, images, wait) where the steady state starts, where the warm-up ended; None when
        there is no warm-up or no step came after it: the epoch is then measured whole."""
        if self.steady is None or self.steady[3] == self.steps:
            return None
        return self.steady[:3]

    def live(self, now: float) -> tuple[float, float] | None:
        """The steady state's images/s and data-wait fraction so far (the progress bar's figures, from host
        counters only: no sync), or None while the warm-up lasts."""
        if self.steady is None and self.warmup_steps:
            return None
        mark, images, wait = self.steady[:3] if self.steady is not None else (self.t0, 0, 0.0)
        elapsed = now - mark
        return ((self.images - images) / elapsed, (self.wait - wait) / elapsed) if elapsed > 0 else (0.0, 0.0)

    def count_finite(self) -> None:
        """A batch is done: keep the loss sum it left (on the device: one copy, no sync). Not a count of
        ``isfinite`` per batch: that is five kernel launches a step (isfinite is composite), and a
        host-bound training step pays for each launch."""
        k = self._trailed
        if self._trail is None or k == len(self._trail):
            grown = torch.empty(max(256, 2 * k), dtype=torch.float64, device=self.device)
            if self._trail is not None:
                grown[:k].copy_(self._trail)
            self._trail = grown
        self._trail[k].copy_(self.sums[0])
        self._trailed = k + 1

    def nonfinite_batch(self) -> int | None:
        """How many of this pass's batches came before the one whose loss first was NaN or inf (this
        rank's), or None while its loss sum is finite. Reads the device: once, when the epoch's figures
        already said the loss is not finite."""
        if torch.isfinite(self.sums[0]).item():
            return None
        if self._trail is None:
            return 0
        bad = (~torch.isfinite(self._trail[:self._trailed])).nonzero()
        return int(bad[0]) if len(bad) else self._trailed

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
        profiler's ``region`` (``RunHooks.region``), entered as ``"data_wait"`` around each ``next``.

        On a GPU, a ``next`` counts only if the GPU ran out of work during it (``gpu_starved``): when
        the host is ahead, each kernel launch blocks on a full launch queue, and the loader's own
        launches then take a share of the host's time although the GPU never waits. On an H200 a gather
        of ready batches in ``next`` read 2.4% data wait that way with the GPU busy throughout."""
        t = time.perf_counter()
        it = iter(loader)
        waited = time.perf_counter() - t
        self.wait += waited  # starting workers / pipelines is waiting for data too
        if self.trace is not None:
            self.trace.append((t, waited, True))
        end = object()
        mark = torch.cuda.Event() if self.device.type == "cuda" else None
        while True:
            if mark is not None:   # what the GPU was given before this wait
                mark.record(torch.cuda.current_stream(self.device))
            # The clock starts after the mark and stops before the query: the meter's own calls (tens
            # of microseconds a batch) are not the loader's, and a host-bound step would count them.
            t = time.perf_counter()
            if region is None:   # no context manager inside the clock where there is no profiler
                batch = next(it, end)
            else:
                with region("data_wait"):
                    batch = next(it, end)
            waited = time.perf_counter() - t
            if batch is end:
                return
            counted = gpu_starved(mark)
            if counted:
                self.wait += waited
            if self.trace is not None:
                self.trace.append((t, waited, counted))
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
        end = time.perf_counter()
        start = self.steady_start()
        if start is None:   # measured whole: the timer counts every step too
            self.timer.steady_from = 0
        mark, images0, wait0 = start if start is not None else (self.t0, 0, 0.0)
        steady = end - mark
        idle = self.timer.idle_fraction()
        local = torch.tensor([*self.sums.tolist(), self.images, images0,
                              (self.wait - wait0) / steady if steady > 0 else 0.0, idle or 0.0],
                             dtype=torch.float64, device=device)
        loss_sum, correct, seen, images, warm_images, wait, idle_sum = fdist.all_sum(local).tolist()
        wall, steady_max, peak_max = fdist.all_max(torch.tensor([end - self.t0, steady, peak_memory_mb(device)],
                                                                dtype=torch.float64, device=device)).tolist()
        world = fdist.world_size()
        # warmup_seconds is what is left of the epoch's seconds besides the longest steady span, so that
        # seconds - warmup_seconds is the span the steady images are divided by (0.0 without a warm-up).
        return epoch_record(epoch, loss_sum=loss_sum, correct=correct, seen=seen, images=images, seconds=wall,
                            data_wait_fraction=wait / world,
                            gpu_idle_fraction=idle_sum / world if idle is not None else None,
                            peak_memory_mb=peak_max, lr=lr, warmup_seconds=wall - steady_max,
                            warmup_images=warm_images)


class StepTimer:
    """CUDA events before and after each step, on the training stream of ``device``; a no-op on CPU.

    The stream is named explicitly: ``Event.record()`` without one uses the *current* device's stream,
    which is cuda:0's unless something set the device, and would time an idle GPU for ``cuda:1``.
    ``steady_from`` is the index of the first step of the steady state (``mark_steady``): the idle
    fraction counts the gaps and the span from there on.

    Bounded: an epoch of 40,000 steps (ImageNet at batch 32) held 80,000 events until its end, and
    read them all there. Once ``FOLD`` x 2 steps are kept, the oldest ``FOLD`` whose events the GPU has
    completed (the step after them has started: a stream runs in order) are read and folded into gap
    sums, keeping only the start events a span begins at. ``starts``/``ends``: the steps not folded."""

    #: Steps folded at once (their events read with no wait: ``query`` says they completed).
    FOLD = 512

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda"
        self.starts: list = []
        self.ends: list = []
        self.steady_from = 0
        self.folded = 0             # steps folded away: ``starts[0]`` is step ``folded``
        self._gaps = [0.0, 0.0]     # folded gaps (ms): all of them, those before steady_from
        self._first: Any = None          # the start event of step 0, once folded
        self._steady_first: Any = None   # and of step steady_from

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
            if len(self.ends) >= 2 * self.FOLD and len(self.ends) % 64 == 0:
                self._fold()

    def _fold(self) -> None:
        """Fold the oldest ``FOLD`` steps into the gap sums, if the GPU has completed them."""
        k = self.FOLD
        if not self.starts[k].query():   # the GPU is still behind them: not yet (no wait, no sync)
            return
        if self.folded == 0:
            self._first = self.starts[0]
        if self.folded <= self.steady_from < self.folded + k:
            self._steady_first = self.starts[self.steady_from - self.folded]
        for j in range(k):
            gap = _gap(self.ends[j], self.starts[j + 1])
            self._gaps[0] += gap
            if self.folded + j < self.steady_from:
                self._gaps[1] += gap
        del self.starts[:k], self.ends[:k]
        self.folded += k

    def mark_steady(self) -> None:
        """The steps timed so far are warm-up: the next one starts the steady state."""
        self.steady_from = self.folded + len(self.starts)
        self._gaps[1] = self._gaps[0]   # every gap folded so far is the warm-up's

    def idle_fraction(self) -> float | None:
        """The steady state's idle fraction (``idle_fraction`` of the steps from ``steady_from`` on): a
        slow first step in the span would hide the gaps of every later one. Read after
        ``torch.cuda.synchronize``; None on CPU, or when no step was timed after ``mark_steady``."""
        if not self.enabled:
            return None
        first = self.steady_from - self.folded
        if first >= 0:   # nothing of the steady state folded (or no step after the mark)
            return idle_fraction(self.starts[first:], self.ends[first:])
        # steady_from is 0 (the meter measures the epoch whole) or a step folded since it was marked.
        return idle_fraction(self.starts, self.ends,
                             first=self._first if self.steady_from == 0 else self._steady_first,
                             folded=self._gaps[0] - (self._gaps[1] if self.steady_from else 0.0))


def gpu_starved(mark) -> bool:
    """Whether a wait for the loader may have left the GPU idle: on the CPU (``mark`` None) always; on a
    GPU when ``mark``, an event recorded on the training stream as the wait began, has completed by its
    end. Work runs in order on a stream, so an event still pending means the GPU was busy with work
    queued before the wait for all of it. ``query`` does not synchronize."""
    return mark is None or mark.query()


def format_record(r: dict, epochs: int | None = None) -> str:
    """One line per epoch: the figures of a ``fit`` record (``lr`` in 3 significant digits, one per
    parameter group joined by "/" when they differ; records from before ``lr`` existed print none). An
    epoch with a warm-up ends in ``(warm-up 1.5 s)``: its img/s, data wait and gpu idle leave it out."""
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
    warmup = r.get("warmup_seconds")   # records from before warmup_seconds existed have none
    parts += [f"peak mem {r['peak_memory_mb']:,.0f} MB",
              f"{r['seconds']:.1f} s" + (f" (warm-up {warmup:.1f} s)" if warmup else "")]
    return "  ".join(parts)


def _gap(end, start) -> float:
    """Milliseconds the GPU had nothing to run between a step's ``end`` event and the next ``start``."""
    return max(0.0, end.elapsed_time(start))


def idle_fraction(starts, ends, *, first=None, folded: float = 0.0) -> float | None:
    """Gaps between one step's end event and the next step's start event ÷ the first-to-last span.
    ``first``, ``folded``: the span's start event and the gaps (ms) of steps before ``starts`` that
    ``StepTimer`` folded away (None, 0: ``starts`` is the whole).

    A start event completes on the GPU as soon as the work queued before it is done; if the GPU was
    still busy with the previous step, the gap is zero, and any gap is time the GPU had nothing from the
    training loop to run (it includes the loader's own copy/normalize kernels, which run between steps).
    Read once per epoch, after a synchronize, so no step waits for it.
    """
    if not starts:
        return None
    span = (starts[0] if first is None else first).elapsed_time(ends[-1])
    gaps = folded + sum(_gap(ends[i], starts[i + 1]) for i in range(len(starts) - 1))
    return gaps / span if span > 0 else 0.0


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory in MB since the last reset on CUDA; the process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource  # CPU: the device memory is the process's memory

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def shows_live(stream) -> bool:
    """Whether ``stream`` shows a line redrawn in place: a terminal, or a Jupyter kernel's output
    stream (ipykernel's ``OutStream``), which says it is no terminal (``isatty()`` False) and which a
    notebook renders carriage returns in, as a terminal does. Keyed to the terminal alone,
    ``progress=True`` (fit's default) showed nothing in a notebook, without a word. tqdm's text bar,
    not its widget (``tqdm.notebook`` needs ipywidgets, and warns without it)."""
    isatty = getattr(stream, "isatty", None)
    try:
        if callable(isatty) and isatty():
            return True
    except ValueError:   # a closed stream
        return False
    return type(stream).__module__.startswith("ipykernel.")


class Progress:
    """A tqdm bar over an epoch's batches with live loss, images/s and data-wait % (the steady state's,
    as the epoch record will say them: ``EpochMeter.live``; "warm-up" while it lasts).

    Refreshed at most about once a second: each refresh reads the device-side sums on the host (one
    sync), which per step would stall the GPU."""

    @classmethod
    def open(cls, enabled: bool, total: int, initial: int, epoch: int, epochs: int) -> Progress | None:
        """A bar, or None when not ``enabled`` or stderr shows no live line (``shows_live``: a bar
        redrawn into a log file or a pipe is noise)."""
        if not enabled or not shows_live(sys.stderr):
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
        self.last = now
        loss_sum, _, seen = meter.sums.tolist()
        live = meter.live(now)
        rates = f"{live[0]:,.0f} img/s  data wait {live[1]:.0%}" if live is not None else "warm-up"
        self.bar.set_postfix_str(f"loss {loss_sum / max(seen, 1):.4f}  {rates}")

    def close(self) -> None:
        """Remove the bar."""
        self.bar.close()
