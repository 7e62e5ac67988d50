"""``prefetch`` backend: the torch backend plus prefetching of batches k+1 … k+depth.

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

import torch

from .torch_loader import TorchLoader

_DONE = object()


class PrefetchLoader(TorchLoader):
    """Torch backend with side-stream (CUDA) or background-thread (CPU) prefetching.

    Options (besides the torch backend's):
        depth: batches prepared ahead of the consumer (default 2).
    """

    name = "prefetch"
    options = {**TorchLoader.options, "depth": 2}

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        depth = self.opts["depth"]
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        self.depth = depth
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _epoch(self, epoch, batches, start):
        host = self.host_batches(epoch, batches, start)
        if self._stream is not None:
            return self._cuda_epoch(host)
        return self._thread_epoch(host)

    def _cuda_epoch(self, host):
        stream = self._stream
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
                x = self.normalize(images.to(self.device, non_blocking=True))
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
            host.close()

    def _thread_epoch(self, host):
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
                    if not put((self.normalize(images), labels)):
                        return
                put(_DONE)
            except BaseException as e:  # handed to the consumer, never swallowed
                put(e)
            finally:
                host.close()

        worker = threading.Thread(target=produce, name="fastdata-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # the producer's next put() returns, so it ends instead of blocking forever
            worker.join(timeout=10)
