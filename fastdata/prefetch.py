"""Prefetching as a stage: ``PrefetchStage`` wraps any iterator of host uint8 batches (pinned on CUDA)
and yields them normalized on the device, prepared by a background thread up to ``depth`` batches
ahead of the consumer. It belongs to no backend: the ``prefetch`` backend (``backends/torch_loader.py``)
is the torch backend's ``host_batches`` + this stage, and any backend that produces host batches can
add it the same way.

Why a thread on CUDA too (issue 30.5). The stage used to issue batch k+depth's copy from the training
thread, inside the ``next()`` that handed out batch k. A side stream then overlapped only the GPU copy
(a few microseconds for a 200 KB batch of digits) with the step, while everything on the host stayed
in the training thread's ``next()``: waiting for the DataLoader's workers and its pinning thread, the
DataLoader's own Python, the copy and normalize launches, plus the stage's stream switch, event and
``record_stream`` on top of the torch backend's work. On an H200 it hid nothing and ran slower than
the torch backend (docs/backends.md has the figures). What the training thread waits for in ``next()``
is host work, and a stream cannot take host work off a thread; another thread can.

So the producer is a thread, on every device. It pulls each host batch (the DataLoader iterator is
advanced there), issues its copy and normalization on the side stream, records an event after them and
puts ``(images, labels, event)`` in a queue bounded by ``depth``. The training thread's ``next()`` is a
queue get, one ``wait_event`` and two ``record_stream``: no launch of its own and no wait for a worker
unless the producer fell behind. Stream semantics across threads:

- The current stream and the current device are per host thread (c10/cuda/CUDAStream.h: "every OS
  thread has a separate current stream"): the producer makes the loader's GPU current and selects the
  side stream in its own thread; the consumer's current stream (the training stream, whatever the
  caller made current) is untouched.
- The consumer's stream waits on the batch's event when the batch is handed over, not earlier: an
  earlier wait would queue the step behind copies it does not need yet. The side stream never waits on
  the consumer: that would queue the copy behind the running step and remove the overlap.
- Every tensor handed across streams gets ``record_stream(consumer)``: without it the caching allocator
  may give the batch's memory to the side stream again while the consumer still reads it (timm issue
  #2781). The pinned source buffer needs nothing: the caching host allocator records the copy's stream
  and does not reuse the block before the copy's event completes (ATen/core/CachingHostAllocator.h).
- No host sync per batch: no ``synchronize``, no ``.item()``, events are only waited on by streams.

Where it cannot help. The producer runs Python (the DataLoader's, the stage's) and needs the GIL for
it: it progresses while the training thread is in torch's C++ (every op releases the GIL; autograd runs
the backward without it) or blocked in a sync. A training thread that holds the GIL nearly all the time
(a small model whose step is host-bound Python) leaves it little room, and a small batch has no copy
worth hiding: then the stage is no faster than the torch backend. ``PrefetchStage.helps`` states the
rule ``auto`` uses (batches of at least ``MIN_BATCH_BYTES``), and docs/backends.md the measurements.

On a CPU device there are no streams: the same thread normalizes the batches into the queue, so that
work overlaps the training step (torch ops release the GIL).
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Callable, Iterator

import torch

from .checks import check_integer

_DONE = object()
Normalize = Callable[[torch.Tensor], torch.Tensor]

#: The smallest uint8 batch (bytes) for which ``auto`` prefers the prefetch stage over the plain torch
#: backend on CUDA. The stage takes off the training stream the batch's copy and normalization (on the
#: order of bytes / 25 GB/s for pinned host-to-device copies: 40 us a MiB) and off the training thread
#: the DataLoader's per-batch Python, at the price of a thread hand-off per batch. Below a MiB the copy
#: is a few tens of microseconds: digits (200 KB batches) measured no gain on an H200.
MIN_BATCH_BYTES = 2**20


def _close(host) -> None:
    """End the source's epoch now (a generator's finally blocks release its workers); a plain iterator
    without close() has nothing to release."""
    close = getattr(host, "close", None)
    if close is not None:
        close()


class _Producer:
    """A pass's producer thread, its ``stop`` flag, and ``left``: set by the thread as its last act,
    once it is out of its source.

    Why ``left`` and not ``Thread.join``/``is_alive``: on Python 3.11 a join that Ctrl-C interrupts
    marks the thread stopped while it still runs (``threading._wait_for_tstate_lock``: on any exception
    it releases the tstate lock when ``lock.locked()``, which the running thread itself holds), and
    ``is_alive()`` is False from then on. A notebook interrupted while a pass waited for the previous
    producer (stuck in a slow batch) then started the next pass beside it, in the same source.
    Waiting on an Event cannot be corrupted that way."""

    __slots__ = ("thread", "stop", "left")

    def __init__(self, target, args):
        self.stop, self.left = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=target, args=(*args, self.stop, self.left),
                                       name="fastdata-prefetch", daemon=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (in short slices: Ctrl-C gets through) until the thread has left its source, at most
        ``timeout`` seconds (None: as long as it takes); whether it has."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.left.wait(0.1):
            if end is not None and time.monotonic() >= end:
                return False
        # Out of its source, the thread has only its exit left: joined, so that a pass that has ended
        # leaves no thread behind in threading.enumerate(). Whatever a Ctrl-C here does to its state,
        # nothing reads is_alive().
        self.thread.join(timeout=1.0)
        return True


def _take(q: queue.Queue, producer: _Producer):
    """The next item of the producer's queue. A producer that ended without queueing the end of the
    pass was stopped from outside (close(): its loader's source is being shut down); a plain get()
    then waited forever, so the wait is in short slices that check the producer is still there.
    (A timed lock wait still lets Ctrl-C through at once.)"""
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if not producer.left.is_set():
                continue
        try:   # it may have queued its last item between the timeout and the check
            return q.get_nowait()
        except queue.Empty:
            raise RuntimeError("prefetch: the loader was closed while this pass ran (its producer thread "
                               "has stopped); a new iter(loader) starts a fresh pass") from None


class Inline:
    """The CPU hand-over: the producer normalizes, the consumer takes the result as it is."""

    def scope(self):
        """The context the producer thread runs in: nothing to select on the CPU."""
        return contextlib.nullcontext()

    def prepare(self, images, labels, normalize: Normalize):
        """(images, labels, ready) for the queue, made on the producer thread."""
        return normalize(images), labels, None

    def hand_over(self, x, y, ready):
        """The batch as the consumer receives it, on the consumer's thread."""
        return x, y


class SideStream:
    """The CUDA hand-over: copies and normalization on one side stream, an event per batch.

    Args:
        device: the loader's GPU.
    """

    def __init__(self, device: torch.device):
        self.device = device
        # One per loader, not per epoch: streams are never freed by torch.
        self.stream = torch.cuda.Stream(device)

    def scope(self):
        """The producer thread's context: the loader's GPU current in that thread (the current device
        is per thread; a new thread starts on cuda:0), for the DataLoader's pinning and every launch."""
        return torch.cuda.device(self.device)

    def prepare(self, images, labels, normalize: Normalize):
        """Queue the batch's copy and normalization on the side stream (producer thread) and record an
        event after them. Pinned sources make the copies asynchronous; the host does not wait for them."""
        with torch.cuda.stream(self.stream):
            x = normalize(images.to(self.device, non_blocking=True))
            y = labels.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return x, y, ready

    def hand_over(self, x, y, ready):
        """On the consumer's thread, when it takes the batch: its current stream waits for the batch's
        work (on the GPU; the host goes on), and the allocator learns that stream uses the tensors."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(ready)
        x.record_stream(consumer)
        y.record_stream(consumer)
        return x, y


class PrefetchStage:
    """Background-thread prefetching of host batches, through a side stream on CUDA.

    Args:
        device: where the batches go.
        depth: batches prepared ahead of the consumer (>= 1): the queue's size; the producer holds one
            more while it waits for room.

    ``stage(host, normalize)``: ``host`` is an epoch's iterator of host ``(uint8 images (N, H, W, C),
    labels)``, pinned for CUDA; ``normalize`` maps uint8 images on ``device`` to the output batch (e.g.
    ``Loader.normalize``). Returns that epoch's iterator of device batches.

    One stage serves all epochs of its loader: it owns one CUDA stream and waits for the previous
    epoch's producer thread before starting another.
    """

    def __init__(self, device: torch.device, depth: int = 2):
        depth = check_integer("depth", depth, minimum=1)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            # "cuda" means the GPU current HERE: the producer thread's own current device is cuda:0, and
            # torch.cuda.device("cuda") resolves the index in the thread that makes it (torch/cuda/
            # __init__.py, device.__init__), so its pinning and launches went to cuda:0.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.depth = device, depth
        #: How batches cross from the producer thread to the consumer (``Inline`` or ``SideStream``).
        self.handoff = SideStream(self.device) if self.device.type == "cuda" else Inline()
        # The latest pass's producer (see _finish_producer).
        self._producer: _Producer | None = None

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream the copies run on (None on the CPU)."""
        return getattr(self.handoff, "stream", None)

    @staticmethod
    def helps(batch_bytes: int | None) -> tuple[bool, str]:
        """(whether the stage is expected to beat the plain torch backend on CUDA, why) for uint8
        batches of ``batch_bytes`` (None: not known before the first batch; the benefit of the doubt)."""
        if batch_bytes is None:
            return True, "its batches' size is known only once read"
        kib = batch_bytes / 1024
        if batch_bytes < MIN_BATCH_BYTES:
            return False, (f"a batch is {kib:,.0f} KiB of uint8, under {MIN_BATCH_BYTES // 1024:,} KiB: its "
                           f"copy takes microseconds, nothing a side stream can hide, and the thread hand-off "
                           f"costs as much (measured no faster than 'torch'; docs/backends.md)")
        return True, (f"a batch is {kib:,.0f} KiB of uint8: its copy and normalization run on a side stream "
                      f"while the step runs")

    def _produce(self, host, normalize, q: queue.Queue, stop: threading.Event, left: threading.Event) -> None:
        """The producer thread: pull, prepare, queue; an error is queued for the consumer to raise.
        ``left`` is set last, once the source is closed (see ``_Producer``)."""
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        handoff = self.handoff
        try:
            with handoff.scope():
                for images, labels in host:
                    # The consumer may have left while this batch was read (a break during a slow
                    # batch): end now, without preparing a batch nobody takes or asking for another.
                    if stop.is_set() or not put(handoff.prepare(images, labels, normalize)):
                        return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, never swallowed
            put(e)
        finally:
            try:
                _close(host)
            finally:
                left.set()

    def __call__(self, host: Iterator, normalize: Normalize) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The consumer's side (a generator: the producer starts with the epoch's first ``next()``)."""
        self._finish_producer()
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        worker = _Producer(self._produce, (host, normalize, q))
        worker.thread.start()
        self._producer = worker   # once started: a thread that never ran would never set `left`
        hand_over = self.handoff.hand_over
        ended = False
        try:
            while True:
                item = _take(q, worker)
                if item is _DONE:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield hand_over(*item)
        except GeneratorExit:
            # A break: the producer sees `stop` within its put() timeout if it is between batches, so a
            # short wait usually lets it end here. If it is waiting for a slow batch, it is not waited
            # for: it ends as soon as that batch returns (unused), and the next epoch (or close()) waits
            # for that (see _finish_producer).
            worker.stop.set()
            worker.wait(timeout=0.5)
            raise
        finally:
            # Ctrl-C or an error in the consumer: return at once; the daemon thread ends after its batch.
            worker.stop.set()
            if ended:
                worker.wait()

    def _finish_producer(self) -> None:
        """Wait until the previous epoch's producer thread has left the DataLoader iterator.

        Why: a break, or Ctrl-C, ends the consumer at once without waiting for the producer, which may be
        inside the (shared, persistent-worker) DataLoader iterator waiting for a slow batch. A new epoch
        that reset that iterator under it would race it: lost batches, or the workers' shared memory
        torn down under a read (FileNotFoundError, EOFError). The stop flag is already set, so the
        producer leaves after its current batch. The wait is in short slices (``_Producer.wait``), so
        Ctrl-C interrupts it; the producer is forgotten only once it has left: a wait interrupted (Ctrl-C
        on a pass that hangs on a slow batch, in a notebook) left it running unrecorded, and the pass
        started next did not wait for it, the race above.
        """
        old = self._producer
        if old is None or old.thread is threading.current_thread():
            return
        old.stop.set()
        old.wait()
        self._producer = None

    def close(self) -> None:
        """Wait for the producer to leave its source (the DataLoader iterator) before the source is
        shut down (see _finish_producer)."""
        self._finish_producer()
