"""The argument checks every room shares: an integer that is not a bool, a number in a range, a flag, a
choice among named values, an integer environment variable.

One owner for each rule, on the ground floor, so that modules below ``config`` (prefetch, sampling,
shards, profiling, ...) use the same check as those above it instead of keeping private copies that
drift (one said ValueError for a bool, another TypeError; one named the range, another did not). Every
error names the argument, shows the value, and says what is valid: a range or the choices.

Why so strict: ``bool`` is an ``int`` subclass, and a string or a float where an integer belongs would
otherwise be coerced somewhere deep in a backend (or fail at the first batch), far from the call that
passed it.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Literal, overload

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a bool or a float where an integer belongs, ...).

    A TypeError, as Python's own; also a ValueError because the private checks these replaced raised
    ValueError for every bad argument, and code that catches ValueError around a call keeps working."""


@overload
def check_integer(name: str, value, *, minimum: int | None = ..., maximum: int | None = ...,
                  optional: Literal[False] = ...) -> int: ...
@overload
def check_integer(name: str, value, *, minimum: int | None = ..., maximum: int | None = ...,
                  optional: bool) -> int | None: ...
def check_integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
                  optional: bool = False) -> int | None:
    """``value`` as an int in [minimum, maximum] (or None when ``optional``): ``ArgumentTypeError`` (a
    TypeError) for a non-integer (bool included), ValueError out of range; both name ``name``, the value
    and the valid range."""
    if optional and value is None:
        return None

    def valid() -> str:   # the message's range, built only for an error: some callers check per batch
        return _bounds(minimum, maximum) + (" or None" if optional else "")

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an integer{valid()}, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer{valid()}, got {value}")
    return value


@overload
def check_number(name: str, value, *, minimum: float | None = ..., maximum: float | None = ...,
                 above: float | None = ..., optional: Literal[False] = ...) -> float: ...
@overload
def check_number(name: str, value, *, minimum: float | None = ..., maximum: float | None = ...,
                 above: float | None = ..., optional: bool) -> float | None: ...
def check_number(name: str, value, *, minimum: float | None = None, maximum: float | None = None,
                 above: float | None = None, optional: bool = False) -> float | None:
    """``value`` as a finite float in [minimum, maximum] and > ``above`` (each when given; None too when
    ``optional``): ``ArgumentTypeError`` (a TypeError) for a non-number (bool included), ValueError for a
    NaN, an infinity or a value out of range; all name ``name``, the value and the valid range."""
    if optional and value is None:
        return None

    def valid() -> str:   # the message's range, built only for an error
        return ((f" > {above}" if above is not None else "")
                + (" and" if above is not None and (minimum, maximum) != (None, None) else "")
                + _bounds(minimum, maximum) + (" or None" if optional else ""))

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number{valid()}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{valid()}, got {value!r}")
    value = float(value)
    if (above is not None and value <= above) or (minimum is not None and value < minimum) \
            or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be a number{valid()}, got {value!r}")
    return value


def check_flag(name: str, value, *, optional: bool = False):
    """``value`` as a bool: True or False (or None when ``optional``), else a TypeError naming ``name``.
    numpy's bool_ is accepted (it is what comparisons return); 0/1 are not: an int here is a mistake."""
    if optional and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")
    return bool(value)


def check_choice(name: str, value, choices):
    """``value`` when it is one of ``choices``, else a ValueError naming ``name`` and listing them.

    A value matches a choice of its own kind only (a string a string, None None): ``in`` alone compares
    with ``==``, and a numpy string array equals a name elementwise, so ``np.array('skip')`` would pass
    and fail later, far from the call (the private checks this replaced required a ``str``)."""
    choices = tuple(choices)
    if any(_same_kind(value, c) and value == c for c in choices):
        return value
    raise ValueError(f"unknown {name} {value!r}; choose from {list(choices)}")


@overload
def env_integer(name: str, default: int, *, minimum: int) -> int: ...
@overload
def env_integer(name: str, default: None, *, minimum: int) -> int | None: ...
def env_integer(name: str, default: int | None, *, minimum: int) -> int | None:
    """The integer in the environment variable ``name`` (a launcher's ``RANK``, ``WORLD_SIZE``, ...),
    ``default`` where it is unset; ValueError naming the variable, its value and the valid range where
    it is not an integer >= ``minimum``.

    Unset and empty (or blank) are the same on purpose: a launcher script that forwards a variable it
    does not have (``RANK=$SLURM_PROCID``, a container's ``-e LOCAL_RANK=``) exports an empty string, and
    that says "not given", not "rank 0" nor an error; an environment cannot unset a name it forwards."""
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    try:
        value = int(text)   # int() itself allows the surrounding whitespace a shell may leave
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"the {name} environment variable must be an integer{_bounds(minimum, None)}, "
                         f"got {text!r}")
    return value


def _same_kind(value, choice) -> bool:
    if isinstance(choice, str):
        return isinstance(value, str)
    if choice is None:
        return value is None
    return isinstance(value, type(choice))


def _bounds(minimum, maximum) -> str:
    """The valid range as the messages say it: " >= 1", " in [0, 9]", or nothing without bounds."""
    if minimum is None and maximum is None:
        return ""
    if maximum is None:
        return f" >= {minimum}"
    if minimum is None:
        return f" <= {maximum}"
    return f" in [{minimum}, {maximum}]"
