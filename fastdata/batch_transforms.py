"""Batch transforms: augmentation on the normalized device batch, after the recipe, for every backend."""
from __future__ import annotations


def check_batch_transforms(value) -> tuple:
    """``LoaderConfig.batch_transforms`` as a tuple of callables; anything else is a TypeError."""
    if value is None:
        return ()
    if callable(value):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"batch_transforms must be a list of callables, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not callable(t):
            raise TypeError(f"batch_transforms[{i}] is not callable: {t!r}")
    return tuple(value)
