"""Errors that name what went wrong: the file, the argument, the numbers."""


class DecodeError(ValueError):
    """An image file that cannot be decoded (truncated, empty, not an image, too large)."""

    def __init__(self, path, reason: str | None = None):
        # One argument is a ready message: how DataLoader re-raises a worker's exception in the parent.
        self.path = str(path) if reason is not None else None
        self.reason = reason
        super().__init__(f"cannot decode image {self.path!r}: {reason}" if reason is not None else path)

    def __reduce__(self):  # survives the trip from a worker process
        return (DecodeError, (self.path, self.reason))


class CacheDoesNotFit(MemoryError):
    """The memory backend's cache would not fit; raised before anything is allocated."""


class MissingDependency(ImportError):
    """A backend whose package is not installed; the message says how to install it."""
