"""The dali backend's outputs: a built pipeline driven through DALI's public scheduling API
(``schedule_run`` / ``share_outputs`` / ``release_outputs``), each batch handed to torch without a host wait.

Why not ``DALIGenericIterator``: it calls ``Pipeline.share_outputs()`` with no stream, which DALI 2.4
documents as "the outputs are synchronized with the host" (``nvidia/dali/pipeline.py``): the training
thread waits for the GPU to finish every batch before it may even queue the step that uses it. Given the
consumer's stream instead, DALI 2.4's ``Executor2::Impl::PopOutputs`` (behind ``ShareOutputs``) makes that
stream wait for the iteration's event (``AccessOrder::wait(event)``: a ``cudaStreamWaitEvent``, where a host
order is a ``cudaEventSynchronize``) and returns once the iteration's host work is done: the GPU work is
ordered before whatever the consumer queues next on that stream, with no host wait. The outputs keep
DALI's own stream (``Executor2::Outputs`` passes ``set_output_order=false``: ``out.stream`` is not the
consumer's) and their ready event. A stream handle of 0 (torch's default stream) is a device order in
DALI (``AccessOrder``: only the sentinels 4321, host, and -1, none, are not): the legacy default stream,
of the pipeline's device (``PopOutputs`` runs under a ``DeviceGuard`` of it). ``torch.from_dlpack``
then passes the same stream to ``TensorGPU.__dlpack__`` (1 for the legacy default stream, on the current
device: ``Outputs`` makes it the batch's), which waits for the ready event on it once more: a
``cudaStreamWaitEvent`` too, never a host wait.

A buffer outlives ``release_outputs``: under DALI 2.4's default executor (``exec_dynamic``) outputs are
reference counted and ``release_outputs`` does not invalidate them (its docstring), and the DLPack capsule
holds a reference until torch frees the tensor. On a GPU the batch is copied into torch's memory anyway,
because of when DALI may reuse a buffer torch dropped (``Outputs``). The pipelines here always run that
executor; where one does not (``Pipeline.exec_dynamic`` false), the batch is copied out, and on a GPU
waited for, before its buffers are released, as DALI's own iterator does (``feed_ndarray``: a
host-synchronous copy); such an executor takes no stream (``share_outputs`` refuses one), so its batches
are handed over by the host.
"""
from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time

import numpy as np
import torch


def output_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of the pipeline's output for loader dtype ``dtype``: float16 is made in DALI
    (``crop_mirror_normalize``'s dtype), anything else leaves it as float32 (DALI has no bfloat16: see
    the dali backend's ``_build`` and ``_convert``)."""
    return 2 if dtype == torch.float16 else 4


class PassLabels:
    """A pass's labels on the loader's device, uploaded once, one view per batch: the labels a batch is
    handed out with when DALI's record of it holds the batch's planned samples (no file skipped).

    Why: per batch, ``labels_on`` (the batch's int64 labels pinned and copied to the GPU) is several
    calls into torch on the training thread: 161 us of each batch's ~1.2 ms data wait in the H200's first
    command (a 5 ms step), and the part of DALI's hand-over left on that thread under driver="thread".
    Uploaded lazily, at the pass's first batch, and split in one call (no torch call per batch).
    On a GPU the upload is ordered on the stream current at that batch, as the memory backend's epoch
    labels are: a consumer that moves to another stream mid-pass waits for that one first (the images
    are handed over on each batch's current stream).
    """

    def __init__(self, batches: list, upload):
        self._batches, self._upload = batches, upload   # upload(flat ids) -> the labels on the device
        self._parts: tuple | None = None

    def of(self, k: int, ids, skipped: int) -> torch.Tensor | None:
        """Batch ``k``'s labels if its record holds ``ids`` with nothing ``skipped`` and they are its
        planned samples (the same array, as arrays' batches are, or equal), else None."""
        planned = self._batches[k] if k < len(self._batches) else None
        if skipped or planned is None or not (ids is planned or np.array_equal(ids, planned)):
            return None
        if self._parts is None:
            flat = np.concatenate(self._batches) if self._batches else np.empty(0, np.int64)
            self._parts = self._upload(flat).split([len(b) for b in self._batches])
        return self._parts[k]


#: ``handover`` values: "stream" has the consumer's current CUDA stream wait for each batch (no host wait);
#: "host" waits on the host for each batch, as ``DALIGenericIterator`` does (kept for measurement).
HANDOVER_CHOICES = ("stream", "host")
#: ``driver`` values: "caller" runs DALI's iteration in the thread that asks for the batch (the training
#: thread); "thread" runs it in a thread of its own, batches ahead (``DrivenOutputs``).
DRIVER_CHOICES = ("caller", "thread")
#: Decoded batches a driver thread keeps ready beyond DALI's own queue: enough to cover one slow
#: iteration (a GIL wait) without holding much more memory.
DRIVEN_AHEAD = 2


def output_stream(device: torch.device, handover: str):
    """The stream ``share_outputs`` makes wait for a batch: the consumer's current stream on ``device`` for
    ``"stream"`` on a GPU; None (DALI synchronizes the host) for ``"host"`` and on the CPU."""
    if device.type != "cuda" or handover == "host":
        return None
    return torch.cuda.current_stream(device)


class Outputs:
    """Iterator over a built pipeline's first output as torch tensors on ``device``. ``StopIteration``
    when the pipeline's input ended (its external source raised it) and every scheduled batch was taken.

    The first ``next`` schedules ``prefetch_queue_depth`` iterations (DALI's ``schedule_run`` prefetches
    on its first call); each batch taken schedules one more, after its buffers were handed over: the
    order ``DALIGenericIterator`` keeps, so DALI's queue stays full.

    On a GPU each batch is copied into memory of torch's own (converted to ``dtype`` in the same kernel),
    on the consumer's stream. Why: a DLPack view of DALI's buffer, once torch drops it, goes back to DALI's
    pool ordered on DALI's stream (the output keeps DALI's order, see the module doc), where DALI's next
    iteration may reuse it while the consumer's stream still reads it: a step queued behind a slow one, or
    the float32 batch a bfloat16 conversion has just been queued to read. torch's allocator orders the
    copy's reuse on the consumer's stream. The copy is one device pass (38 MB for 64 ImageNet crops: tens
    of microseconds on an H200), and DALI's buffer is kept until an event after it completes (polled at
    each ``next``, never waited for on the host but at ``close``)."""

    def __init__(self, pipe, device: torch.device, handover: str = "stream", dtype: torch.dtype | None = None):
        self.pipe, self.device, self.handover, self.dtype = pipe, device, handover, dtype
        self._started = False
        self._lent: collections.deque = collections.deque()   # (DALI's buffer, event after our copy of it)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        pipe = self.pipe
        if not self._started:
            self._started = True
            pipe.schedule_run()
        # The batch's device current: stream 0 (torch's default) names the current device's, and the copy
        # and its event go to that device.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            # A stream only under exec_dynamic: DALI refuses one otherwise (the copy is then waited for).
            stream = output_stream(self.device, self.handover) if pipe.exec_dynamic else None
            (out, *_rest) = pipe.share_outputs(cuda_stream=stream)   # StopIteration once drained
            images = self._take(out.as_tensor(), reused=not pipe.exec_dynamic)
        pipe.release_outputs()
        pipe.schedule_run()
        return images

    def _take(self, tensor, reused: bool) -> torch.Tensor:
        """The batch as torch's: on the CPU a DLPack view (copied where DALI reuses the buffer once
        released, an executor other than ``exec_dynamic``); on a GPU a copy (see the class doc)."""
        view = torch.from_dlpack(tensor)   # passes torch's current stream to __dlpack__ (see module doc)
        if self.device.type != "cuda":
            return view.clone() if reused else view
        owned = view.to(self.dtype or view.dtype, copy=True)
        if reused:
            # The buffer goes back to DALI right after: the copy must have run (DALI's iterator waits too).
            torch.cuda.current_stream(self.device).synchronize()
            return owned
        done = torch.cuda.Event()
        done.record()
        self._lent.append((view, done))
        while self._lent and self._lent[0][1].query():
            self._lent.popleft()
        return owned

    def close(self, timeout: float | None = None) -> None:
        """Wait for the copies still reading DALI's buffers and let the buffers go: before the pipeline
        is dropped. Not in a forked child (no CUDA there): the caller keeps the object instead.
        ``timeout``: unused here (``DrivenOutputs.close`` bounds its thread's join with it)."""
        while self._lent:
            self._lent.popleft()[1].synchronize()


class DrivenOutputs:
    """``Outputs`` run by a thread of their own, up to ``ahead`` batches ahead of the consumer, who takes
    ready batches from a queue (``driver="thread"``).

    Why: DALI's iteration runs in whichever thread asks for the next batch: ``schedule_run`` calls the
    input callback and feeds DALI, ``share_outputs`` hands back the oldest iteration. On an H200 the
    first command's training thread spent 1.0 ms a batch there, of a 5 ms step (22.8% data wait). Here
    this thread asks instead. ``share_outputs`` releases the GIL while it waits (a Python loop beside a
    thread waiting there kept 0.61x its pace on 2 busy cores); the callback and DALI's Python wrapper
    need it, as ``prefetch``'s producer does, which on that launch-bound step ran at 0.85x ``torch``:
    whether this helps is for a GPU to measure (bench_dali_gpu's ``driver`` rows, the first-command
    test), so it is not the default.

    On a GPU the thread runs on a side stream of its own: DALI's event, the copy into torch's memory and
    an event after it are ordered there; the consumer's current stream waits for that event when it
    takes the batch (no host wait), and the batch is marked used on the consumer's stream
    (``record_stream``), so the allocator does not hand its memory to a later copy on the side stream
    before the step has read it. An error (StopIteration, DALI's, the callback's) ends the thread and is
    raised to the consumer in its turn, after the batches before it; it is raised again at every later
    ``next``. The pipeline is used by this thread alone until ``close`` has joined it."""

    _END = object()
    _CLOSED = "these DALI outputs were closed: their thread is stopped"

    def __init__(self, outputs: Outputs, ahead: int = DRIVEN_AHEAD):
        self.outputs, self.device = outputs, outputs.device
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._final: BaseException | None = None   # what ended the thread, raised again at each next
        self._side = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        # Started at the first next(), as Outputs schedules its first iterations then.
        self._thread = threading.Thread(target=self._drive, name="fastdata-dali-driver", daemon=True)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self._final is not None:
            raise self._final
        if self._stop.is_set():
            raise RuntimeError(self._CLOSED)
        if self._thread.ident is None:
            self._thread.start()
        item, done = self._get()
        if item is self._END or isinstance(item, BaseException):
            # Kept to raise again; this frame drops it (its traceback holds the frame: a cycle that kept
            # the pipeline until the cyclic GC), and close() drops the kept one.
            self._final = item if isinstance(item, BaseException) else StopIteration()
            item = None
            raise self._final
        if done is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(done)
            item.record_stream(consumer)
        return item

    def _get(self):
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._stop.is_set():   # closed from another thread while this one waited
                    raise RuntimeError(self._CLOSED) from None

    def _drive(self) -> None:
        side = torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()
        try:
            with side:
                while not self._stop.is_set():
                    try:
                        batch = next(self.outputs)
                    except StopIteration:
                        self._put((self._END, None))
                        return
                    done = None
                    if self._side is not None:
                        done = torch.cuda.Event()
                        done.record(self._side)
                    if not self._put((batch, done)):
                        return
        except BaseException as e:   # handed to the consumer, which raises it
            self._put((e, None))

    def _put(self, item) -> bool:
        """Queue ``item`` unless ``close`` asked the thread to stop meanwhile (then False)."""
        while not self._stop.is_set():
            try:
                # A second: close() makes room at once (it empties the queue), so this only bounds how
                # often an idle thread wakes up (a validation pass, between epochs).
                self._queue.put(item, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread (it ends the DALI call it is in first: a batch being read or decoded), drop the
        batches it queued, and close the outputs: before the pipeline is dropped or its feeder cancelled.
        A thread still in that call after ``timeout`` seconds (a read that hangs), or this very thread (a
        loader whose last reference went inside the input callback), is left to end on its own: what it
        uses, the pipeline among it, stays alive through its frames until it does."""
        self._stop.set()
        if self._thread is threading.current_thread():
            return
        deadline = time.monotonic() + timeout
        if self._thread.ident is not None:
            while self._thread.is_alive():
                if time.monotonic() > deadline:
                    return
                with contextlib.suppress(queue.Empty):
                    self._queue.get(timeout=0.05)   # a put waiting for room returns at once
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._final = None
        self.outputs.close()
