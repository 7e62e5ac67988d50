"""How the dali backend feeds its pipeline: one endless stream of batches, prepared ahead by threads that
never keep a program from ending.

**One stream, not one DALI epoch per pass.** DALI ends an epoch only when the external source raises
StopIteration, and its pipeline must then be drained (one more ``next``) and reset. A consumer that
takes exactly ``len(loader)`` batches (Lightning, ``islice``) never asks for that one more batch, so the
pipeline was left mid-epoch and rebuilt every pass (threads, buffers and, on a GPU, nvJPEG state and
device memory each time). Instead DALI sees no epoch boundary at all: ``stream`` hands it the running
pass's batches and then every later epoch's from its start, and the loader's generator ends a pass by
counting. The next epoch's first batches are so read ahead while the current one ends. The stream is
restarted (a new pipeline) only when the consumer asks for something else than what it holds next:
``set_epoch``/``load_state_dict`` to another position, a pass left early, an error.

**Threads of our own, daemon.** ``concurrent.futures.ThreadPoolExecutor``'s workers are not daemon
threads: the interpreter joins them at exit, after a test session's summary, and a loader that was
never closed kept a program waiting on a read or a decode. ``WorkerPool`` runs daemon threads that hold
no reference to their owner between calls (so a dropped loader is collected and closes them), and
``shutdown`` cancels what is queued and joins them.
"""
from __future__ import annotations

import collections
import queue
import threading
import weakref
from concurrent import futures
from concurrent.futures import Future

import numpy as np

from ..errors import DecodeError


class WorkerPool:
    """``threads`` daemon threads named ``name-N`` running submitted calls, started on first use.

    Args:
        threads: how many calls run at once.
        name: the threads' name prefix (``fastdata-...``: tests find leftovers by it).
    """

    def __init__(self, threads: int, name: str):
        self._size, self._name = threads, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` in a pool thread; its Future."""
        future: Future = Future()
        with self._lock:   # put under the lock: no job lands in the queue after shutdown emptied it
            if self._closed:
                raise RuntimeError(f"{self._name}: the pool was shut down (the loader was closed)")
            if len(self._threads) < self._size:
                t = threading.Thread(target=_work, args=(self._jobs,), daemon=True,
                                     name=f"{self._name}-{len(self._threads)}")
                t.start()
                self._threads.append(t)
            self._jobs.put((future, fn, args))
        return future

    def map(self, fn, items) -> list:
        """``[fn(x) for x in items]`` run in the pool; the first failure is raised."""
        futures = [self.submit(fn, x) for x in items]
        return [f.result() for f in futures]

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Cancel what is queued, let the running calls finish and join the threads (not the calling one:
        a loader collected inside its own pool thread closes from there)."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in threads:
            self._jobs.put(None)
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(timeout)


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        future, fn, args = job
        del job
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args)
            except BaseException as e:   # handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(result)
                del result
        # Nothing of the call stays referenced while the thread waits: a loader whose last reference was
        # its own pending call is collected (and closed) now, not when the next call arrives.
        del future, fn, args


def stream(plan, epoch: int, batches: list, start: int):
    """(epoch, batch number, sample ids) of the running pass from its position (``batches``, numbered
    from ``start``), then of every later epoch from its start: what DALI is fed, without an end."""
    while True:
        for j, ids in enumerate(batches):
            yield epoch, start + j, ids
        epoch, start = epoch + 1, 0
        batches = plan.batches_from(epoch, 0)


def batch_record(k: int, ids, labels, skipped: int = 0) -> dict:
    """What ``Feeder.records`` holds for batch ``k``: the ids DALI decodes (those kept, an int array),
    their count, the files skipped, and the source's ``labels`` array (labels never go through DALI;
    ``record_labels`` gathers the batch's where the pass's planned ones do not serve: an array batch's
    callback runs on the training thread, where a gather per batch is time the step waits for)."""
    return {"k": k, "ids": ids, "n": len(ids), "skipped": skipped, "labels_of": labels}


def record_labels(record: dict) -> np.ndarray:
    """The labels of the samples a ``batch_record`` holds, in order."""
    return record["labels_of"][record["ids"]]


class Feeder:
    """The external_source callback: turns the stream's batches into DALI inputs, one batch per call.

    ``records`` holds one entry per batch handed to DALI (or found empty), in order, so the consumer
    side knows which batch each DALI output is and which files it held.

    Files are read ahead: ``ahead`` batches are prepared in the loader's assembler thread (reading the
    files and, the first time, their headers and integrity) while DALI works on the batches already
    fed, so the call DALI makes on the training thread only picks up a finished batch. Array batches
    are a vectorized gather: prepared right here.

    A batch whose preparation raised (a ``DecodeError`` with ``on_error="raise"``) is not raised into
    DALI, which asks for batches ahead of the consumer (possibly in the next epoch): the previous
    batch's inputs are fed again in its place and the record carries the error, which the consumer
    raises when it reaches that batch, after every batch before it.
    """

    def __init__(self, loader, ahead: int, give_up: int):
        # A weak reference: the pipeline holds this callback, and a strong one back to the loader would
        # put every loader in a reference cycle that only the cyclic GC frees, possibly inside a forked
        # DataLoader worker, where destroying a DALI pipeline deadlocks.
        self.loader = weakref.proxy(loader)
        self.ahead = ahead
        # Empty batches in a row after which a call gives up (StopIteration): more than an epoch of them
        # (a rank whose every batch is empty) would otherwise be scanned forever, the stream being endless.
        self.give_up = give_up
        self.jobs = iter(())
        self.pending: collections.deque = collections.deque()   # futures of the batches read ahead
        self.records: collections.deque = collections.deque()
        self.last = None   # the last inputs handed to DALI

    def start(self, jobs) -> None:
        """Feed ``jobs`` ((epoch, batch number, sample ids), see ``stream``) from DALI's next call."""
        self.cancel()
        self.jobs = iter(jobs)
        self.records.clear()
        self.last = None

    def cancel(self) -> None:
        """Drop the batches read ahead (a stream abandoned or failed): none may reach another stream."""
        for f in self.pending:
            f.cancel()   # one already running finishes in the background; its result is dropped
        self.pending.clear()
        self.jobs = iter(())

    def prime(self) -> None:
        """Start reading ahead now and wait for the first batch (its files' sizes are then known), before
        DALI's first call: the pipeline built meanwhile can size nvJPEG's buffers from them."""
        pool = self.loader.assembler
        if pool is not None:
            self._fill(pool)
            if self.pending:
                futures.wait([self.pending[0]])

    def _fill(self, pool) -> None:
        while len(self.pending) < self.ahead:
            job = next(self.jobs, None)
            if job is None:
                return
            self.pending.append(pool.submit(self.loader.prepare, *job))

    def _next_batch(self):
        pool = self.loader.assembler
        if pool is None:
            return self.loader.prepare(*next(self.jobs))   # StopIteration ends DALI's epoch
        self._fill(pool)
        if not self.pending:
            raise StopIteration   # ends DALI's epoch (a finite stream)
        done = self.pending.popleft()
        self._fill(pool)
        # Asked without raising: a DecodeError raised here would carry this frame, whose callers
        # (DALI's, running this callback) hold the pipeline, into the record.
        error = done.exception()
        if isinstance(error, DecodeError) and self.last is not None:
            return self.last, {"n": -1, "skipped": 0, "ids": (), "error": error}
        return done.result()   # nothing to stand in for a failed one: the consumer is at it anyway

    def __call__(self):
        for _ in range(self.give_up):
            inputs, record = self._next_batch()
            self.records.append(record)
            if inputs is not None:
                self.last = inputs
                return inputs
            # An empty batch (every sample skipped, or a rank's share of a tiny last step): DALI cannot
            # run a batch of 0 samples, so the consumer side yields it without DALI.
        raise StopIteration   # DALI's stream ends here; the consumer restarts it if it needs more
