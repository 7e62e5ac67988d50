"""``OnError``: the one owner of the ``on_error`` choice for every per-file failure.

Every backend meets files it cannot use: a header PIL cannot read, a truncated scan, a file DALI's
decoder refuses. What happens then is the loader's ``on_error`` ("raise" the ``DecodeError`` naming the
file, or "skip" the file and let the caller count it), decided here and nowhere else, so a backend never
compares ``on_error`` itself and every backend raises or skips the same files the same way.
"""
from __future__ import annotations

from ..checks import check_choice
from ..config import ON_ERROR
from ..errors import DecodeError


class OnError:
    """A loader's ``on_error`` policy, applied to one failure at a time.

    Two ways in: ``attempt(fn, ...)`` runs a decode and turns its ``DecodeError`` into None under
    "skip"; ``refuse(name, reason)`` is for a failure found without an exception (a file already known
    to be broken, a reason a reader thread returned): it raises under "raise" and returns under "skip".
    The caller counts what it skipped.

    Args:
        policy: ``"raise"`` or ``"skip"`` (an ``OnError`` is taken as it is).
    """

    policy: str   # "raise" or "skip"

    def __init__(self, policy: "str | OnError" = "raise"):
        if isinstance(policy, OnError):
            policy = policy.policy
        self.policy = check_choice("on_error", policy, ON_ERROR)

    def __repr__(self):
        return f"OnError({self.policy!r})"

    @property
    def skips(self) -> bool:
        """True under "skip": the caller drops the file and counts it."""
        return self.policy == "skip"

    def attempt(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``; None when it raised a ``DecodeError`` under "skip" (re-raised under
        "raise"). Any other error propagates: only a file that cannot be decoded is skipped."""
        try:
            return fn(*args, **kwargs)
        except DecodeError:
            if not self.skips:
                raise
            return None

    def refuse(self, name, reason: str) -> None:
        """A file that cannot be used: ``DecodeError(name, reason)`` under "raise" (without the context of
        an exception being handled, e.g. DALI's own, whose text the reason already holds); nothing under
        "skip", where the caller drops the file."""
        if not self.skips:
            raise DecodeError(name, reason) from None
