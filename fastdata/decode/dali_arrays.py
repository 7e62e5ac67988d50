"""The dali backend's array side: a batch of an array source (digits, CIFAR) as DALI's inputs, and every
batch's random numbers, drawn ahead. ``DaliArrays`` is that part of ``DaliLoader``.

Why draws ahead: for an array source the input callback runs on the training thread, inside DALI's
``schedule_run`` (``driver="caller"``), and behind a training step every call into numpy is slow (the
step has run through the caches): one batch's ``draw_params`` took ~100 us there on this CPU, against
~15 us a batch in a loop over the next batches. So the generators of the next ``DRAW_AHEAD`` batches
are seeded at once (``EpochPlan.batch_rngs``) and, for arrays, their draws are made in the same loop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from ..augment import NUMPY_PAD_MODE, Params, draw_params
from ..datasets import SourceKind
from ..datasets.base import ArrayPixels
from .dali_feed import batch_record

if TYPE_CHECKING:
    from ..config import Augmentation, LoaderConfig
    from ..datasets import Source

#: Batches whose generators are seeded (and, for arrays, whose draws are made) at once: seeding one
#: generator per batch took a third of an array batch's input callback (30 of 90 us here); 64 at once
#: cost 3 us a batch.
DRAW_AHEAD = 64


class DaliArrays:
    """Inputs for ``DaliLoader``: a batch's pixels and parameters (arrays), its generator (every source)."""

    # What the mixin reads from DaliLoader and its bases, declared for type checkers.
    source: Source
    augment: Augmentation
    config: LoaderConfig
    _host_pad: bool               # translations of a padding DALI's slice lacks: padded here first
    _rngs: dict                   # (epoch, batch) -> its generator, seeded ahead (_seeded)
    _drawn: dict                  # (epoch, batch) -> its Params, drawn ahead for a full batch (_params)

    if TYPE_CHECKING:   # declared for type checkers only: at run time they are Loader's and DaliFiles'
        def batch_rngs(self, epoch: int, first: int, count: int) -> list: ...
        def _prepare_files(self, rng, k: int, ids: np.ndarray): ...

    def prepare(self, epoch: int, k: int, ids: np.ndarray):
        """DALI inputs of batch ``k`` of ``epoch`` (None when it is empty) and its record (the feeder's
        job; files run in the assembler thread)."""
        if self.source.kind is SourceKind.FILES:
            return self._prepare_files(self._seeded(epoch, k), k, ids)
        src, aug = cast(ArrayPixels, self.source), self.augment   # not FILES: the kind's pixels array
        n = len(ids)
        record = batch_record(k, ids, src.labels)
        if n == 0:
            return None, record
        images = src.images[ids]
        params = self._params(epoch, k, n)   # the recipe's one source of random numbers (draw_params)
        # Each input is a feed through DALI's Python on the training thread (~90 us a feed behind a
        # training step here): the samples' parameters go in one array, split in the graph by
        # subscripts (a cast there cost more than the feed it saved: the flips stay an int32 input
        # where the array is float). 4 inputs a batch before; 2 for translations, 3 for boxes.
        flips = params.flips.astype(np.int32)
        if params.offsets is not None:   # int32 (n, 3): the slice's anchor (y, x), the flip
            par = np.empty((n, 3), np.int32)
            par[:, 2] = flips
            if self._host_pad:   # the window inside the padded images: anchor = offset
                p = aug.pad
                images = np.pad(images, ((0, 0), (p, p), (p, p), (0, 0)), mode=NUMPY_PAD_MODE[aug.padding])
                par[:, :2] = params.offsets
            else:                # the window shifted by offset - pad: out of bounds by up to pad px
                par[:, :2] = params.offsets - aug.pad
            return (images, par), record
        if params.boxes is not None:     # float32 (n, 4): the box's start (y, x), end (y, x)
            boxes = params.boxes.astype(np.float32)                            # (top, left, h, w)
            return (images, np.concatenate([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], axis=1), flips), record
        return (images, flips), record

    def _params(self, epoch: int, k: int, n: int) -> Params:
        """``draw_params(augment, batch_rng(epoch, k), n, image size)``: drawn ahead, in one loop, for
        the next ``DRAW_AHEAD`` batches of ``batch_size`` samples (see the module docstring). A batch of
        another size (a pass's last) draws from a generator of its own, as the torch backend does; each
        draw is handed out once (a batch prepared again, after a restart, draws again: the same numbers)."""
        made = self._drawn.pop((epoch, k), None)
        if made is not None and len(made.flips) == n:
            return made
        size = cast(ArrayPixels, self.source).image_shape[:2]
        full = self.config.batch_size
        if made is None and n == full:
            rngs = self.batch_rngs(epoch, k, DRAW_AHEAD)
            self._drawn = {(epoch, k + j): draw_params(self.augment, g, full, size) for j, g in enumerate(rngs)}
            return self._drawn.pop((epoch, k))
        return draw_params(self.augment, self.batch_rngs(epoch, k, 1)[0], n, size)

    def _seeded(self, epoch: int, k: int):
        """``batch_rng(epoch, k)``, from generators seeded ahead for the next batches. Each is handed out
        once (a batch prepared again, after a restart, gets a fresh one: the same draws). Called by one
        thread at a time: the assembler, for files."""
        rng = self._rngs.pop((epoch, k), None)
        if rng is None:
            self._rngs = {(epoch, k + j): g for j, g in enumerate(self.batch_rngs(epoch, k, DRAW_AHEAD))}
            rng = self._rngs.pop((epoch, k))
        return rng
