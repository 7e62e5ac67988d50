"""MNIST from torchvision's IDX files on disk (downloaded where the network allows)."""
from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from .arrays import ArraySource

MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


#: The most a gzip stream inflates: deflate's best ratio is about 1032:1 (a run of one byte).
_GZIP_MAX_RATIO = 1032
#: Read in pieces: memory follows the bytes that arrive, not a size a header claims.
_CHUNK = 1 << 22


def read_idx(path) -> np.ndarray:
    """Read an IDX file (gzipped or not); a wrong magic number, a short body, or a body longer than its
    header says names the file.

    The header is read first, then at most one byte past the body it announces: a ``.gz`` that inflates
    without end (a gzip bomb) is refused after that byte, never read whole into memory.

    Args:
        path: the file (``.gz``: gzipped).
    """
    path = Path(path)
    gzipped = path.suffix == ".gz"
    try:
        with (gzip.open if gzipped else open)(path, "rb") as f:
            shape, header = _idx_header(f, path)
            expected = math.prod(shape)  # Python ints: sizes near 2**32 overflow np.prod's int64 silently
            if gzipped and expected > _GZIP_MAX_RATIO * (size := os.path.getsize(path)) + 2**16:
                raise ValueError(f"IDX file '{path}' does not match its header: header says {shape} = "
                                 f"{expected} bytes, more than a gzip file of {size} bytes can inflate to "
                                 f"(a wrong header or a damaged file)")
            body = _read_at_most(f, expected + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"cannot read IDX file '{path}': {e}") from None
    if len(body) < expected:
        raise ValueError(f"IDX file '{path}' is truncated: header says {shape} = {expected} bytes, "
                         f"body has {len(body)}")
    if len(body) > expected:
        has = f"more than {expected}" if gzipped else str(os.path.getsize(path) - header)
        raise ValueError(f"IDX file '{path}' does not match its header: header says {shape} = {expected} "
                         f"bytes, body has {has} (a wrong header or another file appended)")
    if shape[0] == 0:
        raise ValueError(f"IDX file '{path}' holds no items (header says {shape})")
    if len(shape) == 3 and 0 in shape[1:]:
        raise ValueError(f"IDX file '{path}' holds {shape[1]}x{shape[2]} images; they need at least one pixel")
    return np.frombuffer(body, dtype=np.uint8, count=expected).reshape(shape)


def _idx_header(f, path: Path) -> tuple[tuple[int, ...], int]:
    """(shape, header bytes) of the IDX file open as ``f``, checked; ``f`` is left at the body."""
    magic = f.read(4)
    if len(magic) < 4:
        raise ValueError(f"IDX file '{path}' is too short ({len(magic)} bytes) to hold a header")
    zero, dtype_code, ndim = struct.unpack(">HBB", magic)
    if zero != 0 or dtype_code != 0x08 or ndim not in (1, 3):
        raise ValueError(f"IDX file '{path}' has a wrong magic number 0x{magic.hex()} "
                         f"(expected 0x00000801 for labels or 0x00000803 for images)")
    dims = f.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise ValueError(f"IDX file '{path}' is truncated inside its header")
    return struct.unpack(">" + "I" * ndim, dims), 4 + 4 * ndim


def _read_at_most(f, limit: int) -> bytearray:
    """Up to ``limit`` bytes of ``f``, read a piece at a time (a single ``read(limit)`` allocates
    ``limit`` bytes up front, whatever the file holds)."""
    body = bytearray()
    while len(body) < limit:
        piece = f.read(min(_CHUNK, limit - len(body)))
        if not piece:
            break
        body += piece
    return body


def _find_idx(raw: Path, stem: str) -> Path | None:
    for candidate in (raw / stem, raw / (stem + ".gz")):
        if candidate.is_file():
            return candidate
    return None


class MNIST(ArraySource):
    """MNIST from IDX files in torchvision's layout: ``root/MNIST/raw/train-images-idx3-ubyte[.gz]`` ...

    Args:
        root: the folder that holds ``MNIST/raw``.
        train: the 60,000 training images, else the 10,000 test images.
        download: fetch through torchvision when the files are missing and the network allows.
    """

    def __init__(self, root="./data", train: bool = True, download: bool = True):
        raw = Path(root) / "MNIST" / "raw"
        stems = MNIST_FILES[bool(train)]
        paths = [_find_idx(raw, s) for s in stems]
        if None in paths and download:
            try:
                import torchvision

                torchvision.datasets.MNIST(str(root), train=train, download=True)
            except Exception as e:  # no network is the usual case here
                download_error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            else:
                download_error = ""
            paths = [_find_idx(raw, s) for s in stems]
        if None in paths:
            missing = [s for s, p in zip(stems, paths) if p is None]
            hint = f"; download failed ({download_error})" if download and download_error else ""
            raise FileNotFoundError(
                f"MNIST files not found: expected {', '.join(str(raw / m) + '[.gz]' for m in missing)}{hint}")
        images, labels = read_idx(paths[0]), read_idx(paths[1])
        if images.ndim != 3 or labels.ndim != 1:
            raise ValueError(f"'{paths[0]}' must hold images (3-D) and '{paths[1]}' labels (1-D)")
        if len(images) != len(labels):
            raise ValueError(f"'{paths[0]}' has {len(images)} images but '{paths[1]}' has {len(labels)} labels")
        if labels.max() > 9:
            i = int(np.argmax(labels > 9))
            raise ValueError(f"'{paths[1]}' holds label {labels[i]} at index {i}; MNIST labels are 0-9")
        self.root = Path(root)
        self.train = bool(train)
        super().__init__(images, labels, mean=(0.1307,), std=(0.3081,), name="mnist", digits=True,
                         num_classes=10)


# ----------------------------------------------------------------------------------- synthetic digits
