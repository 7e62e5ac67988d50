"""Errors that name what went wrong: the file, the argument, the numbers."""
import ast
import os
import re
import sys

# The message DecodeError writes, found again inside the text DataLoader re-raises from a worker.
_HINT = "; on_error='skip' skips and counts such files"
_MESSAGE = re.compile(r"cannot decode image ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"): (.*?)(?:"
                      + re.escape(_HINT) + r")?$", re.M)


class DecodeError(ValueError):
    """An image file that cannot be decoded (truncated, empty, not an image, too large)."""

    def __init__(self, path, reason: str | None = None):
        if reason is None:
            # One argument is a ready message: how DataLoader re-raises a worker's exception in the parent
            # ("Caught DecodeError in DataLoader worker process 0. Original Traceback: ..."). Recover
            # .path and .reason from the worker's message, so `except DecodeError as e: e.path` works
            # in the main process too (torch rebuilds the exception from its text, not by pickling).
            self.path: str | None = None
            self.reason: str | None = None
            self._message: str | None = str(path)
            found = _MESSAGE.findall(str(path))
            if found:
                quoted, self.reason = found[-1]
                try:
                    self.path = ast.literal_eval(quoted)
                except (ValueError, SyntaxError):
                    self.path = quoted[1:-1]
            super().__init__(path)
            return
        self.path = str(path)
        self.reason = reason
        self._message = None
        # The hint matters on real data: ImageNet's training set holds a few PNG files named .JPEG, and
        # one such file should not end a run whose user would rather skip it.
        super().__init__(f"cannot decode image {self.path!r}: {reason}{_HINT}")

    @property
    def why(self) -> str:
        """The reason, for a caller that records or words it: ``reason``, or the whole message for an
        error rebuilt from a worker's text whose reason could not be recovered."""
        return self.reason if self.reason is not None else str(self)

    def __reduce__(self):  # survives the trip from a worker process
        return (DecodeError, (self._message,) if self._message is not None else (self.path, self.reason))


class CacheDoesNotFit(MemoryError):
    """The memory backend's cache would not fit; raised before anything is allocated."""


class MissingDependency(ImportError):
    """A backend whose package is not installed; the message says how to install it."""


class PositionMismatch(ValueError):
    """A saved position taken under another seed, dataset, shuffle or drop_last. ``detail`` names what
    changed; the advice depends on who resumes (``fit`` says how to start a new run instead)."""

    def __init__(self, detail: str):
        super().__init__(f"cannot resume this loader from the saved position: {detail}; the samples left in "
                         f"the epoch would not be the interrupted run's (restart the epoch with set_epoch() "
                         f"instead)")
        self.detail = detail

    def __reduce__(self):   # rebuilt from its detail, as raised (args holds the whole message)
        return (PositionMismatch, (self.detail,))


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from the function calling this one, that names the first frame
    outside fastdata and torch (``torch.no_grad``'s decorator adds a frame of its own; a DataLoader's
    iterator, several): the user's line, whichever of fit, evaluate, a loader's pass or a direct call
    got there. A fixed stacklevel named a line inside fastdata (``self._end_pass(epoch, offset)``) or
    the wrong caller, as the depth differs between the paths."""
    inside = [os.path.dirname(os.path.abspath(__file__)) + os.sep]   # fastdata/
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        inside.append(os.path.dirname(os.path.abspath(torch_file)) + os.sep)
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(tuple(inside)):
        frame, level = frame.f_back, level + 1
    return level
