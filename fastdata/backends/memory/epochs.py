"""An epoch of the memory backend as a few device tensors, so that a batch is a slice and one gather
(on a GPU, one gather per group of batches).

Why this shape: a batch of the memory backend should cost what gathering ready float batches costs
(the benchmark's limit for digits; docs/backends.md has the figures). It used to slice the epoch's ids
and offsets, gather the images with a three-tensor advanced index into a 6-D view and gather the labels
with a second index: two gathers and an index parse of four tensors per batch (ten kernels for a uint8
cache), host work that the training step waits for. Now everything that depends on the sample but not on the
batch is computed once per epoch, on the device, in a handful of kernels:

- ``starts``: each sample's first element in the cache's storage, its shift included
  (``id * s_n + dy * s_row + dx * s_col``). The cache is viewed through ``window``: a view whose row
  ``s`` is the sample-shaped block starting at element ``s``. A batch is then ``window[starts[a:b]]``:
  ONE gather kernel, the same op as indexing ready float batches, with the shift folded into the
  index instead of a second and third index tensor (or, for the uint8 cache, instead of an int64 index
  of every pixel, 8x the batch's bytes, built per batch).
- ``labels``: the epoch's labels in its order; a batch's are a slice (no kernel).
- resampled crops: each sample's sampling lines (``grid_lines``), so a batch builds its grid in one
  stack instead of eight small ops.

On a GPU, consecutive batches are gathered together (``group_bounds``: up to 16 MiB at once) and
handed out as slices: a batch of digits is then no launch at all on most steps (on an H200: 0.66x the
gather of ready batches with one gather per batch, >= 0.8x with groups).

No per-batch host sync either: no ``.item()``, ``.tolist()``, ``nonzero()`` or mask indexing (each waits
for the GPU), and nothing copied from the host per batch.

The host part of an epoch (each batch's augmentation draws: a numpy generator per batch, seeded from
``(seed, epoch, batch)`` as every backend draws them: tens of microseconds a batch, so milliseconds an
epoch) is made for the NEXT epoch on a thread while this one runs (``DrawAhead``), so that the
first batch of an epoch does not wait for it. The thread holds the GIL only for numpy's small calls and
gets it while the training thread is in torch's C++ (every op, and the whole backward, release it); at
worst it takes that time from the training thread, as drawing in ``next()`` did.
"""
from __future__ import annotations

import operator
import os
import queue
import threading
import weakref
from typing import Callable, NamedTuple

import numpy as np
import torch


class Draws(NamedTuple):
    """One epoch's host side: sample ids and augmentation parameters (pinned on CUDA), and what they are for."""

    key: tuple              # (epoch, first batch number)
    bounds: list            # (start, end) of each batch in the flat arrays below
    ids: torch.Tensor       # int64 (samples,)
    off: torch.Tensor | None    # int64 (samples, 2) translation offsets
    flip: torch.Tensor | None   # bool (samples,)
    lin: torch.Tensor | None    # float32 (samples, 6) resized crops: see MemoryLoader._sampling
    exact: list             # per batch: (top, left) when its crop is an exact slice, else None
    batches: list           # the batches drawn for (the plan's read-only arrays)

    def matches(self, key: tuple, batches: list) -> bool:
        """Whether these draws are those of ``batches`` as epoch ``key`` reads them (a set_epoch or a
        resume in between changes which batches an epoch reads: then they are drawn again)."""
        if key != self.key or len(batches) != len(self.bounds):
            return False
        # The same arrays (EpochPlan.batches_from hands out the ones it made, read-only): no need to
        # compare them, on the training thread at the epoch's first batch.
        if all(map(operator.is_, batches, self.batches)):
            return True
        if any(len(b) != e - s for b, (s, e) in zip(batches, self.bounds, strict=True)):
            return False
        # One comparison of the whole order (a Python loop over the batches costs more than it).
        return not batches or np.array_equal(np.concatenate(batches), self.ids.numpy())


class Epoch(NamedTuple):
    """One epoch's device side, sliced per batch."""

    bounds: list            # (start, end) of each batch in the flat tensors below
    ids: torch.Tensor       # int64 (samples,)
    starts: torch.Tensor | None     # int64 (samples,): rows of the cache's ``window`` (None: resampled crops)
    labels: torch.Tensor    # the samples' labels, in the epoch's order
    flip: torch.Tensor | None       # bool (samples,)
    lin: torch.Tensor | None        # float32 (samples, 6) resized crops: see MemoryLoader._sampling
    grid: tuple | None      # (gy, gx) float32 (samples, size) each: the crops' sampling lines
    exact: list             # per batch: (top, left) when its crop is an exact slice, else None
    pinned: tuple           # the pinned host buffers, alive until the epoch ends (see MemoryLoader.upload)


def window(t: torch.Tensor, dims: tuple, strides: tuple) -> torch.Tensor:
    """``t`` viewed as ``(L, *dims)``, row ``s`` being the block of shape ``dims`` and element strides
    ``strides`` that starts ``s`` elements into ``t``: ``window(t, ...)[starts]`` gathers arbitrary
    blocks (a sample, shifted) in one indexing kernel. ``L`` is as many rows as the storage holds
    whole blocks for, so any start inside the cache is valid (and the view never reads past it).
    Rows overlap; the view is only read."""
    extent = sum((d - 1) * s for d, s in zip(dims, strides))
    rows = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset() - extent
    return t.as_strided((max(rows, 0), *dims), (1, *strides), t.storage_offset())


def starts(ids: torch.Tensor, off: torch.Tensor | None, strides: tuple) -> torch.Tensor:
    """Each sample's first element in the cache: ``id * s_n`` plus its shift (offsets (dy, dx) in rows
    and columns of the padded cache). A few kernels per epoch, none per batch."""
    s_n, s_row, s_col = strides
    out = ids * s_n
    if off is not None:
        out += off[:, 0] * s_row + off[:, 1] * s_col
    return out


def grid_lines(lin: torch.Tensor, steps: torch.Tensor, hs: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The resized crops' sampling lines for every sample of an epoch, in grid_sample's coordinates.

    ``lin`` rows ``(ay, by, ax, bx, ymax, xmax)`` (see MemoryLoader._sampling): output row i samples cache
    row ``ay + by * i``, clamped to the sample's own pixels (a photo's slot is zero beyond its (h, w),
    and grid_sample's border clamp would reach it). Elementwise, so computing them for the epoch gives
    the bits a batch at a time gave.
    """
    ys = torch.minimum((lin[:, 0:1] + lin[:, 1:2] * steps).clamp_(min=0), lin[:, 4:5])   # (n, size)
    xs = torch.minimum((lin[:, 2:3] + lin[:, 3:4] * steps).clamp_(min=0), lin[:, 5:6])
    # Pixel centres → grid_sample's coordinates (align_corners=False: the slot's edges at ±1).
    return (ys + 0.5) * (2 / hs) - 1, (xs + 0.5) * (2 / ws) - 1


#: Bytes of one group's gathered batches on a GPU (see ``group_bounds``): 16 MiB is 20 batches of 256
#: MNIST digits in float32, one of 256 CIFAR images, less than one batch of 224² photos.
GROUP_BYTES = 16 * 2**20

#: The alignment in bytes every batch of a group starts on (the caching allocator's blocks start on 512).
ALIGN = 16


def group_bounds(bounds: list, sample_bytes: int, device: torch.device, limit: int = GROUP_BYTES) -> list:
    """The epoch's batch bounds in consecutive groups that one gather serves, on a GPU.

    Why: a batch of small samples (digits, CIFAR) is a gather of a few hundred KB that the GPU runs in
    microseconds, and the host's ~50 µs of Python and launches per batch are what the training step
    waits for (issue 30: on an H200 the memory backend ran at 0.66x a gather of ready batches, and its
    training waited 3% of each epoch for data, with the GPU idle meanwhile). Gathering up to ``limit``
    bytes of batches at once and handing out slices of it leaves a batch two slices on the host, and
    the same pixels. Batches as large as ``limit`` stay one gather each; on the CPU there is no launch
    to amortize and a batch read later from a larger buffer would have left the cache: one batch each.
    """
    if device.type == "cpu":
        return [[ab] for ab in bounds]
    groups: list = []
    group: list = []
    size = 0
    for a, b in bounds:
        n = (b - a) * sample_bytes
        # A batch starts at the group's size in bytes into it: one that would not start on ALIGN bytes
        # starts a group of its own (kernels that load 16 bytes at once, cuDNN's and Inductor's among
        # them, take a misaligned input on a slower path or copy it first).
        if group and (size + n > limit or size % ALIGN):
            groups.append(group)
            group, size = [], 0
        group.append((a, b))
        size += n
    if group:
        groups.append(group)
    return groups


class DrawAhead:
    """One epoch's ``Draws`` made on a thread ahead of time, at most one at a time.

    ``start(key, make)`` has ``make()`` run on the loader's draws thread unless draws for ``key`` are
    already made or being made; ``take(key, batches)`` returns them when they are ``batches``' (waiting
    for the thread if it is still drawing), else None: the caller draws in place. A failure on the
    thread is not raised there: the caller draws again and meets it where it can be raised.

    One thread for the loader's life, not one per epoch: starting a thread is 0.1-0.7 ms of the
    training thread's time (the new thread must take the GIL before ``start`` returns), in the first
    batch's counted wait every epoch. It holds no reference to the loader between jobs and ends when
    ``close`` is called or the DrawAhead is collected. A forked child (whose copy has no thread) starts
    its own.
    """

    def __init__(self):
        self._key = None
        self._job: _DrawJob | None = None
        self._jobs: queue.SimpleQueue | None = None   # the thread's, made by the first start()
        self._pid = 0                                 # the process the thread runs in

    def start(self, key: tuple, make: Callable[[], Draws]) -> None:
        """Run ``make()`` on the thread for ``key``, unless that is already made or being made."""
        self._leave_parents()
        if self._key == key:
            return
        self.cancel()
        if self._jobs is None:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_draw, args=(jobs,), name="fastdata-memory-draws", daemon=True).start()
            weakref.finalize(self, jobs.put, None)   # the thread ends with its DrawAhead (no loader ref)
            self._jobs, self._pid = jobs, os.getpid()
        self._key, self._job = key, _DrawJob(make)
        self._jobs.put(self._job)

    def take(self, key: tuple, batches: list) -> Draws | None:
        """The draws made for ``key`` if they are ``batches``' (once the thread made them), else None."""
        self._leave_parents()
        job = self._job
        if self._key != key or job is None:   # a key is set together with its job
            return None
        job.done.wait()
        self._key, self._job = None, None
        made = job.made
        return made if made is not None and made.matches(key, batches) else None

    def _leave_parents(self) -> None:
        """In a forked child, forget the parent's thread and its job: neither runs here, so the job's
        event is never set (take() waited for it forever) and its queue has no reader. The child
        draws in place, and its next start() starts a thread of its own."""
        if self._jobs is not None and self._pid != os.getpid():
            self._key, self._job, self._jobs = None, None, None

    def cancel(self) -> None:
        """Forget the slot; the thread skips its job if it has not begun it (it only draws numbers)."""
        if self._job is not None:
            self._job.make = None
        self._key, self._job = None, None

    def close(self) -> None:
        """Cancel, and end the thread once it is done with what it runs."""
        self.cancel()
        if self._jobs is not None and self._pid == os.getpid():
            self._jobs.put(None)
        self._jobs = None


class _DrawJob:
    __slots__ = ("make", "made", "done")

    def __init__(self, make: Callable[[], Draws]):
        self.make: Callable[[], Draws] | None = make
        self.made: Draws | None = None
        self.done = threading.Event()


def _draw(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        make, job.make = job.make, None   # the loader's draw_epoch: not kept past the job
        try:
            if make is not None:
                job.made = make()
        except BaseException:   # noqa: BLE001 (drawn again, and raised, by the epoch that needs it)
            pass
        finally:
            job.done.set()
            del job, make
