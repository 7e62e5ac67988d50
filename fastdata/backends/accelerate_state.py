"""Where a pass stands, told to Hugging Face accelerate as its own DataLoader wrappers tell it (used by
``Loader`` in backends/base.py; no import of accelerate here)."""
from __future__ import annotations

import sys
from typing import Any

import torch

from ..images.on_error import OnError


class AccelerateTracker:
    """Tells Hugging Face accelerate where a pass stands, as its own DataLoader wrappers do.

    ``accelerator.gather_for_metrics`` drops the padding of an evenly split evaluation set on the last
    batch, and ``accumulate()`` syncs gradients at the end of a loader: both read the GradientState
    singleton, which accelerate's DataLoaderShard feeds (``begin``/``end`` in accelerate/data_loader.py)
    and a loader passed through ``prepare()`` unchanged never would. Only when the user's program has
    imported accelerate (no import here); a change of its private API leaves the loader working, the
    metric then un-trimmed."""

    __slots__ = ("state", "loader")

    def __init__(self, loader: Any, offset: int):   # a backends.base.Loader (no import: a cycle)
        self.state = self.loader = None
        if "accelerate.state" not in sys.modules:
            return
        try:
            state = sys.modules["accelerate.state"].GradientState()
            loader.end_of_dataloader = False
            # accelerate's meaning: how many samples of the last global step are real (0: no padding;
            # -1: unknown, gather_for_metrics then returns everything gathered).
            loader.remainder = loader.plan.remainder(offset)
            state._add_dataloader(loader)
        except Exception:  # pragma: no cover - another accelerate version's internals
            return
        self.state, self.loader = state, loader

    def last_batch(self, real_rows: int, device: torch.device) -> None:
        """The pass hands out its last batch, holding ``real_rows`` rows that are not even_batches'
        padding. Under ``on_error="skip"`` a rank's last batch can come out shorter than the plan said,
        so the ranks sum the real rows they hold (whether to is decided by the plan and config alone, the
        same on every rank, so every rank joins the sum on its last batch): otherwise a padding row lands
        inside accelerate's ``[:remainder]`` and a sample is counted twice. Only in a program that made an
        Accelerator (``gather_for_metrics`` needs one; every rank makes it): a program that only imported
        accelerate (transformers does) may iterate a loader on some ranks alone, and would hang here."""
        if self.loader is None:
            return
        plan, rest = self.loader.plan, self.loader.remainder
        made = getattr(sys.modules.get("accelerate.state"), "is_initialized", lambda: False)
        if (rest > 0 and plan.even and plan.world_size > 1 and rest % plan.world_size
                and OnError(self.loader.config.on_error).skips and made()):
            from .. import distributed
            self.loader.remainder = int(distributed.all_sum(torch.tensor([real_rows], device=device)).item())
        self.loader.end_of_dataloader = True

    def close(self) -> None:
        """The pass is over (ended, left, or failed): accelerate forgets the loader."""
        if self.state is not None:
            try:
                self.state._remove_dataloader(self.loader)
            except Exception:  # pragma: no cover
                pass
            self.state = self.loader = None
