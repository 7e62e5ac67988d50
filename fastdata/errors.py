"""Errors that name what went wrong: the file, the argument, the numbers."""
import ast
import re

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
