"""Which samples a batch holds: ``loader.batch_ids`` and ``loader.skipped_ids``, for every backend.

Why: a user writing predictions per file (evaluation, inference) maps each row of a batch to its
sample. The planned ids (``loader.batch_sampler``) say that only while every sample of the batch is
yielded: ``on_error="skip"`` drops an undecodable file from its batch (which comes out shorter), and the
memory backend leaves such files out of its cache up front (its plan then counts positions among the
files kept, ``kept``). So a backend that drops a file says what it kept, batch by batch in the order it
yields them (``ids_keeper``, from any thread: prefetch's producer runs ahead of the consumer), and the base
loader hands the ids out with each batch. The contract's batches stay ``(images, labels)``.
"""
from __future__ import annotations

import collections

import numpy as np

_NONE = np.empty(0, dtype=np.int64)


class _PassIds:
    """One pass's ids: what the backend kept per batch (a FIFO, in yield order), the last batch's ids and
    padding rows, the ids it skipped so far."""

    __slots__ = ("kept", "last", "padding", "skipped", "unknown", "rows_of")

    def __init__(self):
        self.kept: collections.deque = collections.deque()   # append/popleft: safe across two threads
        self.last, self.padding, self.skipped = _NONE, 0, []
        self.unknown: str | None = None   # why the last batch's ids are not known (a backend that did not say)
        #: The last batch's labels when its rows are yet to be counted against ``last`` (the common
        #: case counts them when ``batch_ids`` is read, not per batch: see ``SampleIds._hand_out_ids``).
        self.rows_of = None


class SampleIds:
    """The part of ``Loader`` that says which source samples each batch holds (see the module docstring)."""

    #: The source ids the plan's positions stand for when a backend left samples out for good (memory's
    #: cache under ``on_error="skip"``); None: position ``i`` is sample ``i``.
    kept: np.ndarray | None = None
    _pass_ids: _PassIds | None = None

    @property
    def batch_ids(self) -> np.ndarray:
        """int64 source ids of the batch last handed out, one per row of its images, in order (for
        ``source.sample_name(i)``, ``source.labels[i]``): a file skipped with ``on_error="skip"`` has no
        row and no id. Under ``even_batches`` the last batch's padding rows (its last
        ``batch_padding``) repeat ids of the epoch's start. Empty before the first batch of a pass."""
        self._settle_ids()
        p = self._pass_ids
        if p is not None and p.unknown is not None:
            raise RuntimeError(p.unknown)
        ids = (p.last if p is not None else _NONE).view()
        ids.flags.writeable = False   # the loader's own record, shared with the backend: copy it to change it
        return ids

    @property
    def batch_padding(self) -> int:
        """Rows at the end of the batch last handed out that are ``even_batches`` padding (samples another
        rank reads, repeated so every rank's last batch has one size): leave them out of a metric or a
        file of predictions (``evaluate`` does). 0 but on a rank's last batch. It can be fewer than
        ``padding()`` said before the pass: a padding sample skipped with ``on_error="skip"`` has no row."""
        return self._pass_ids.padding if self._pass_ids is not None else 0

    @property
    def skipped_ids(self) -> np.ndarray:
        """int64 source ids skipped with ``on_error="skip"`` in the current pass so far (after it ends:
        in that pass), in the order met, the files a backend left out for good (memory's cache) first.
        ``len(loader.skipped_ids) == loader.skipped``."""
        ids = self._pass_ids.skipped if self._pass_ids is not None else []
        return np.concatenate([self.dropped_ids(), *ids]).astype(np.int64)

    def dropped_ids(self) -> np.ndarray:
        """Source ids left out of every pass (memory's cache under ``on_error="skip"``), ascending."""
        if self.kept is None:
            return _NONE
        return np.setdiff1d(np.arange(len(self.source)), self.kept).astype(np.int64)   # type: ignore[attr-defined]

    def source_ids(self, positions) -> np.ndarray:
        """The source's sample ids of the plan's ``positions`` (the ids ``batch_sampler`` gives)."""
        positions = np.asarray(positions, dtype=np.int64)
        return positions if self.kept is None else self.kept[positions]

    def ids_keeper(self):
        """For backends that drop files from a batch, called as the pass's batches start: a function
        taking the source ids of the samples each batch yielded holds, in row order, to be called once
        per batch, in yield order, for every batch of the pass (or never: the planned ids are then the
        batch's); None says the batch holds its planned samples (no numpy call per batch where nothing
        was dropped). Bound to this pass: a producer thread of a pass left early that records its last
        batch after the next pass began (prefetch) records into its own pass, not into the next one's."""
        p = self._pass_ids
        if p is None:
            return lambda ids: None
        return lambda ids: p.kept.append(None if ids is None else np.asarray(ids, dtype=np.int64))

    def _start_ids(self) -> None:
        self._pass_ids = _PassIds()

    def _settle_ids(self) -> None:
        """Count the last batch's rows against its ids now (the pass ended): its labels are not kept
        past the pass (on a GPU, a view of memory's whole epoch of labels)."""
        p = self._pass_ids
        if p is not None and p.rows_of is not None:
            p.unknown, p.rows_of = self._unknown(p.last, p.rows_of.shape[0]), None

    def _unknown(self, ids: np.ndarray, rows: int) -> str | None:
        """Why ``batch_ids`` cannot name a batch of ``rows`` rows said to hold ``ids`` (None: it can)."""
        return None if len(ids) == rows else (
            f"backend {self.name!r} yielded a batch of {rows} rows for {len(ids)} sample ids without saying "  # type: ignore[attr-defined]
            f"which samples it holds, so loader.batch_ids cannot name its rows: a backend that drops samples "
            f"from a batch records the ids it kept with self.ids_keeper() (fastdata/backends/sample_ids.py)")

    def _hand_out_ids(self, planned: np.ndarray, padding: int, labels) -> None:
        """The batch of ``planned`` positions, its last ``padding`` of them even_batches' padding, is being
        handed out with ``labels`` (a tensor, a row per image): its ids become ``batch_ids``."""
        p = self._pass_ids
        if p is None:
            return
        said = p.kept.popleft() if p.kept else None   # what the backend said this batch holds, if it did
        if said is None and self.kept is None:
            # Positions are the sample ids (the plan's int64 arrays) and the backend said nothing else:
            # the common case, per batch on the training thread, so with no call into numpy or torch
            # (cold after a training step, each costs microseconds). The rows are counted against the
            # ids when batch_ids is read.
            p.last, p.padding, p.unknown, p.rows_of = planned, padding, None, labels
            return
        rows = labels.shape[0]
        planned = self.source_ids(planned)
        p.rows_of = None
        if said is None and len(planned) == rows:
            p.last, p.padding, p.unknown = planned, padding, None
            return
        p.last, p.padding = (planned if said is None else said), padding
        p.unknown = self._unknown(p.last, rows)
        if len(p.last) < len(planned):
            p.skipped.append(planned[~np.isin(planned, p.last)])
            # A padding sample that was skipped has no row (a file fails wherever it is read).
            p.padding = int(np.isin(planned[len(planned) - padding:], p.last).sum()) if padding else 0
