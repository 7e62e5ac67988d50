"""Prefetching as a stage: ``PrefetchStage`` wraps any iterator of host uint8 batches (pinned on CUDA)
and yields them normalized on the device, batches k+1 … k+depth prepared ahead of the consumer.
It belongs to no backend: the ``prefetch`` backend (``backends/torch_loader.py``) is the torch backend's
``host_batches`` + this stage, and any backend that produces host batches can add it the same way.

On CUDA the host-to-device copy and the normalization of upcoming batches run on a side stream, so
they overlap the model's kernels on the default stream (timm's PrefetchLoader, DALI's
data_prefetcher). The consumer's stream waits on an event recorded after each batch's work, and every
tensor handed across streams gets ``record_stream``: without it the caching allocator may give the
batch's memory to the side stream again while the consumer still reads it (timm issue #2781).

On a CPU device there are no streams: a background thread pulls host batches and normalizes them
into a bounded queue, so that work overlaps the training step (torch ops release the GIL).
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Callable, Iterator

import torch

_DONE = object()
Normalize = Callable[[torch.Tensor], torch.Tensor]


def _close(host) -> None:
    """End the source's epoch now (a generator's finally blocks release its workers); a plain iterator
    without close() has nothing to release."""
    close = getattr(host, "close", None)
    if close is not None:
        close()


class PrefetchStage:
    """Side-stream (CUDA) or background-thread (CPU) prefetching of host batches.

    Args:
        device: where the batches go.
        depth: batches prepared ahead of the consumer (>= 1).

    ``stage(host, normalize)``: ``host`` is an epoch's iterator of host ``(uint8 images (N, H, W, C),
    labels)``, pinned for CUDA; ``normalize`` maps uint8 images on ``device`` to the output batch (e.g.
    ``Loader.normalize``). Returns that epoch's iterator of device batches.

    One stage serves all epochs of its loader: it owns one CUDA stream (one per loader, not per epoch:
    streams are never freed by torch) and, on the CPU, waits for the previous epoch's producer thread
    before starting another.
    """

    def __init__(self, device: torch.device, depth: int = 2):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        self.device, self.depth = torch.device(device), depth
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The CPU path's latest producer thread and its stop flag (see _finish_producer).
        self._producer: tuple[threading.Thread, threading.Event] | None = None

    def __call__(self, host: Iterator, normalize: Normalize) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.stream is not None:
            return self._cuda_epoch(host, normalize)
        return self._thread_epoch(host, normalize)

    def _cuda_epoch(self, host, normalize):
        stream = self.stream
        pending = deque()

        def launch():
            try:
                images, labels = next(host)
            except StopIteration:
                return
            # No wait on the consumer's stream here: that would queue the copy behind the running
            # step and remove the overlap. The pinned source buffer is safe without it (the caching
            # host allocator keeps it until the copy's event completes).
            with torch.cuda.stream(stream):
                x = normalize(images.to(self.device, non_blocking=True))
                y = labels.to(self.device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            pending.append((x, y, done))

        try:
            for _ in range(self.depth):
                launch()
            while pending:
                x, y, done = pending.popleft()
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_event(done)
                # x and y were allocated on the side stream; tell the allocator the consumer uses them.
                x.record_stream(consumer)
                y.record_stream(consumer)
                launch()  # queue the next copy before handing this batch over: it overlaps the step
                yield x, y
        finally:
            _close(host)

    def _finish_producer(self) -> None:
        """Wait until the previous epoch's producer thread has left the DataLoader iterator.

        Why: a break, or Ctrl-C, ends the consumer at once without waiting for the producer, which may be
        inside the (shared, persistent-worker) DataLoader iterator waiting for a slow batch. A new epoch
        that reset that iterator under it would race it: lost batches, or the workers' shared memory
        torn down under a read (FileNotFoundError, EOFError). The stop flag is already set, so the
        producer leaves after its current batch. The wait is in short joins, so Ctrl-C interrupts it.
        """
        old, self._producer = self._producer, None
        if old is None or old[0] is threading.current_thread():
            return
        thread, stop = old
        stop.set()
        while thread.is_alive():
            thread.join(timeout=0.1)

    def _thread_epoch(self, host, normalize):
        self._finish_producer()
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                for images, labels in host:
                    # The consumer may have left while this batch was read (a break during a slow batch):
                    # end now, without normalizing a batch nobody takes or asking the source for another.
                    if stop.is_set() or not put((normalize(images), labels)):
                        return
                put(_DONE)
            except BaseException as e:  # handed to the consumer, never swallowed
                put(e)
            finally:
                _close(host)

        worker = threading.Thread(target=produce, name="fastdata-prefetch", daemon=True)
        self._producer = (worker, stop)
        worker.start()
        ended = False
        try:
            while True:
                item = q.get()   # a plain lock wait: Ctrl-C interrupts it at once
                if item is _DONE:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
        except GeneratorExit:
            # A break: the producer sees `stop` within its put() timeout if it is between batches, so a
            # short wait usually lets it end here. If it is waiting for a slow batch, it is not waited
            # for: it ends as soon as that batch returns (unused), and the next epoch (or close()) waits
            # for that (see _finish_producer).
            stop.set()
            worker.join(timeout=0.5)
            raise
        finally:
            # Ctrl-C or an error in the consumer: return at once; the daemon thread ends after its batch.
            stop.set()
            if ended:
                worker.join()

    def close(self) -> None:
        """Wait for the CPU producer to leave its source (the DataLoader iterator) before the source is
        shut down (see _finish_producer)."""
        self._finish_producer()
