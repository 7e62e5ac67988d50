"""Checks of the transforms' constructor and bind-time arguments, each error naming the transform, the
argument and what it accepts."""
from __future__ import annotations

import dataclasses
import math

from ..checks import check_number
from .base import BatchContext, BatchTransform
from .validation import describe


def probability(owner: str, name: str, value) -> float:
    """``value`` as a float in [0, 1] (``checks.check_number``), the error naming ``owner`` and ``name``."""
    return check_number(f"{owner}: {name} (a probability)", value, minimum=0, maximum=1)


def positive(owner: str, name: str, value) -> float:
    """``value`` as a finite float > 0 (``checks.check_number``), the error naming ``owner`` and ``name``."""
    return check_number(f"{owner}: {name}", value, above=0)


def value_range(owner: str, name: str, value, *, low: float = 0.0, high: float = math.inf) -> tuple[float, float]:
    """``value`` as a ``(min, max)`` pair of floats with ``low <= min <= max <= high``, else a ValueError."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{owner}: {name} must be a (min, max) pair with {low} <= min <= max <= {high}, "
                         f"got {value!r}")
    lo, hi = (check_number(f"{owner}: {name}[{i}]", v, minimum=low, maximum=None if math.isinf(high) else high)
              for i, v in enumerate(value))
    if lo > hi:
        raise ValueError(f"{owner}: {name} must be a (min, max) pair with {low} <= min <= max <= {high}, "
                         f"got {value!r}")
    return lo, hi


def mean_std(owner: str, mean, std) -> tuple:
    """``(mean, std)`` as tuples of floats (a number is one channel's), or ``(None, None)`` if neither is given."""
    if (mean is None) != (std is None):
        raise ValueError(f"{owner}: give both mean and std, or neither (the loader's are used)")
    if mean is None:
        return None, None
    mean = tuple(float(m) for m in (mean if isinstance(mean, (tuple, list)) else (mean,)))
    std = tuple(float(s) for s in (std if isinstance(std, (tuple, list)) else (std,)))
    if not all(math.isfinite(v) for v in mean + std) or any(s <= 0 for s in std):
        raise ValueError(f"{owner}: mean/std must be finite and std > 0, got mean={mean} std={std}")
    if any(v > 1 for v in mean + std):
        # un-normalizing with 0-255 statistics makes "pixels" in the hundreds, all clamped to 1
        raise ValueError(f"{owner}: mean={mean} std={std} is above 1: mean/std are in [0, 1] units (pixel/255, "
                         f"torchvision's convention, as the loader holds them); divide 0-255 statistics by 255")
    return mean, std


def set_field(obj, name, value):
    """Write ``value`` to a frozen dataclass's field: normalized arguments are written once, in __post_init__."""
    object.__setattr__(obj, name, value)


def check_class_count(t, context: BatchContext) -> None:
    """Refuse a transform's own num_classes that differs from the source's, when the loader is built: at
    the first batch a label past it would be an index error (a device-side assert on CUDA), and a wider
    one fails the pipeline's (N, num_classes) check of every batch."""
    if context.num_classes and t.num_classes != context.num_classes:
        raise ValueError(f"{type(t).__name__}(num_classes={t.num_classes}) does not match the source, which "
                         f"has {context.num_classes} classes (soft labels are (N, {context.num_classes})): drop "
                         f"num_classes= (the source's is used), or give the source its true count "
                         f"(DatasetSource(dataset, num_classes=N))")


def with_stats(t, context: BatchContext):
    """``t`` holding the batches' mean/std: its own, else the loader's from ``context`` (an error if neither).

    Its own must be the loader's where the loader has them (a number stands for every channel): the
    batches are normalized with the loader's, and un-normalizing with others shifts and rescales every
    pixel before the [0, 1] clamp, without a word."""
    if t.mean is not None:
        if context.mean is not None and context.std is not None and not (
                _same_stats(t.mean, context.mean) and _same_stats(t.std, context.std)):
            raise ValueError(f"{type(t).__name__}(mean={t.mean}, std={t.std}) differs from the loader's "
                             f"normalization, mean={tuple(context.mean)} std={tuple(context.std)}, which the "
                             f"batches are normalized with: drop mean=/std= (the loader's are used), or pass "
                             f"these to make_loader")
        return t
    if context.mean is None or context.std is None:
        raise ValueError(f"{type(t).__name__} works on un-normalized pixels, so it needs the batches' "
                         f"mean/std: the loader passes them; a BatchPipeline built by hand needs mean=/std= "
                         f"(or give them to {type(t).__name__}(..., mean=, std=))")
    return dataclasses.replace(t, mean=tuple(context.mean), std=tuple(context.std))


def nested(transforms):
    """Every BatchTransform in ``transforms``, depth first, a OneOf's branches after the OneOf (plain
    callables are not BatchTransforms and hold no class count or smoothing)."""
    for t in transforms:
        if isinstance(t, BatchTransform):
            yield t
            children = getattr(t, "transforms", None)   # a OneOf's branches
            if isinstance(children, tuple):
                yield from nested(children)


def given_classes(transforms) -> int:
    """The class count the transforms were given themselves (``MixUp(num_classes=N)``, also inside a
    OneOf), for a source that does not know its own; 0 if none was. Counts that differ are refused:
    soft labels have one width."""
    found: dict[int, str] = {}
    for t in nested(transforms):
        n = getattr(t, "num_classes", None)
        if isinstance(n, int) and n > 0:
            found.setdefault(n, describe(t, 60))
    if len(found) > 1:
        raise ValueError(f"batch_transforms give different num_classes: "
                         f"{'; '.join(f'{n} ({where})' for n, where in sorted(found.items()))}; soft labels "
                         f"have one width, the source's class count: give them all the same num_classes")
    return next(iter(found), 0)


def agreed_smoothing(owner: str, transforms) -> float:
    """The ``label_smoothing`` that the soft-label transforms among ``transforms`` (a OneOf's branches
    included) share; 0.0 if there is none. Values that differ are a ValueError naming each.

    One list's targets get one smoothing, as timm's Mixup and torchvision's references (smoothing in the
    loss) give every batch: in a OneOf the batches a branch does not mix get it too, and in a sequence a
    later transform's value would be ignored (the labels are soft already), so a different one is refused.
    """
    found: dict[float, str] = {}
    for t in nested(transforms):
        # a OneOf's own (a property) is its branches', which speak for it
        if not isinstance(getattr(t, "transforms", None), tuple) and t.soft_labels \
                and isinstance(getattr(t, "label_smoothing", None), float):
            # equal to float32 rounding is the same value (a config read as float32)
            same = next((v for v in found if math.isclose(v, t.label_smoothing, rel_tol=1e-6, abs_tol=1e-9)), None)
            found.setdefault(t.label_smoothing if same is None else same, describe(t, 60))
    if len(found) > 1:
        raise ValueError(f"{owner}: its mixing transforms give different label_smoothing: "
                         f"{'; '.join(f'{v} ({where})' for v, where in sorted(found.items()))}. Every batch's "
                         f"targets get one smoothing (in a OneOf the unmixed batches too; in a sequence the "
                         f"labels are soft after the first): give them all the same label_smoothing")
    return next(iter(found), 0.0)


def _same_stats(mine: tuple, theirs) -> bool:
    """Whether two per-channel statistics agree (to float32 rounding); one value stands for every channel."""
    theirs = tuple(theirs)
    if len(mine) == 1 and len(theirs) > 1:
        mine = mine * len(theirs)
    elif len(theirs) == 1 and len(mine) > 1:
        theirs = theirs * len(mine)
    return len(mine) == len(theirs) and all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
                                            for a, b in zip(mine, theirs))
