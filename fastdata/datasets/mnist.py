"""MNIST from torchvision's IDX files on disk (downloaded where the network allows)."""
from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import numpy as np

from .arrays import ArraySource

MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path) -> np.ndarray:
    """Read an IDX file (gzipped or not); a wrong magic number or a short body names the file.

    Args:
        path: the file (``.gz``: gzipped).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"cannot read IDX file '{path}': {e}") from None
    if len(data) < 4:
        raise ValueError(f"IDX file '{path}' is too short ({len(data)} bytes) to hold a header")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08 or ndim not in (1, 3):
        raise ValueError(f"IDX file '{path}' has a wrong magic number 0x{data[:4].hex()} "
                         f"(expected 0x00000801 for labels or 0x00000803 for images)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"IDX file '{path}' is truncated inside its header")
    shape = struct.unpack(">" + "I" * ndim, data[4:header])
    expected = math.prod(shape)  # Python ints: sizes near 2**32 overflow np.prod's int64 silently
    if len(data) - header < expected:
        raise ValueError(f"IDX file '{path}' is truncated: header says {shape} = {expected} bytes, "
                         f"body has {len(data) - header}")
    if len(data) - header > expected:
        raise ValueError(f"IDX file '{path}' does not match its header: header says {shape} = {expected} "
                         f"bytes, body has {len(data) - header} (a wrong header or another file appended)")
    if shape[0] == 0:
        raise ValueError(f"IDX file '{path}' holds no items (header says {shape})")
    if ndim == 3 and 0 in shape[1:]:
        raise ValueError(f"IDX file '{path}' holds {shape[1]}x{shape[2]} images; they need at least one pixel")
    return np.frombuffer(data, dtype=np.uint8, count=expected, offset=header).reshape(shape)


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
