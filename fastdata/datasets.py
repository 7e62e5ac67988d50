"""Data sources. A source says what the samples are; backends decide how to load them fast.

Three kinds, which backends treat differently:
- ``ArraySource`` (MNIST, SyntheticDigits, CIFAR-like arrays, any uint8 array): pixels already in memory.
- ``ImageFolder``: encoded files on disk (JPEG/PNG), one sub-folder per class, or a given file list.
- ``DatasetSource``: any map-style torch Dataset returning (PIL image or uint8 tensor, int).

``as_source`` turns what people already have into one of these: torchvision's ImageFolder/DatasetFolder
become an ``ImageFolder`` over their file list, CIFAR10/100 and the MNIST family become an ``ArraySource``
over their arrays (so every backend reads them), a ``torch.utils.data.Subset`` becomes ``subset()`` of its
dataset's source. Every source has ``len``, ``classes``, ``num_classes``, ``__getitem__`` and ``subset``.
"""
from __future__ import annotations

import copy
import gzip
import math
import os
import struct
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .config import Augmentation, SourceKind  # noqa: F401  (SourceKind: re-exported, it is public here)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: torchvision's ``IMG_EXTENSIONS``: the same folder lists the same files in both ImageFolders (their
#: fingerprints agree, so a checkpoint resumes across the two), and every file Pillow decodes counts.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_FLOAT_FIX = ("drop ToDtype/Normalize/ToTensor from the transform and pass mean=/std= to make_loader: "
              "fastdata keeps batches uint8 until the device and normalizes there")
#: What a Dataset's sample image may be, and the fix for a float one.
_EXPECTED_IMAGES = ("the torch backend expects PIL images, uint8 (C, H, W) tensors or uint8 (H, W, C) arrays. "
                    f"If the dataset's transform ends in ToTensor, ToDtype or Normalize: {_FLOAT_FIX}")


class Source:
    """What every source has: ``labels`` (int64 array), ``num_classes``, ``classes`` (names), ``channels``,
    ``mean``/``std`` (in [0, 1] units), ``len()``, ``subset()`` and the hooks backends read.

    ``indices``: for a subset, the sample ids of the source it was taken from (composed through nested
    subsets, so always into the first, full source); None for a full source.
    ``refusal_hint``: None, or a sentence a backend that cannot read this source appends to its error
    (set by ``as_source`` when it keeps a dataset it could not convert, saying why and what to do).
    """

    kind = SourceKind.ABSTRACT
    #: ``source[i]``'s image is an (H, W, C) tensor (arrays, image folders), not a wrapped dataset's own.
    hwc_samples = False
    name = "source"
    refusal_hint: str | None = None
    indices: np.ndarray | None = None
    labels: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int
    num_classes: int
    _classes: list | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def classes(self) -> list:
        """Class names, index = label: folder names, a dataset's ``classes``, or ``0 .. num_classes-1``."""
        return list(self._classes) if self._classes is not None else list(range(self.num_classes))

    @classes.setter
    def classes(self, value) -> None:
        """Set the class names (None: ``0 .. num_classes-1``)."""
        self._classes = None if value is None else list(value)

    @property
    def sample_transform(self):
        """The per-sample callable applied after decoding (``ImageFolder(transform=...)``, a torchvision
        dataset's own ``transform``), or None. Only backends that decode per sample on the CPU run it."""
        return None

    def default_augmentation(self, train: bool) -> Augmentation:
        """The recipe a loader uses when ``LoaderConfig.augment`` is None.

        Args:
            train: the training recipe (else the evaluation one).
        """
        return Augmentation.none()

    def fingerprint(self) -> str:
        """A short, readable identity of the data, stored with a loader's position: resuming on other
        data of the same size would silently read different samples. Cheap, so not a full hash."""
        return f"{type(self).__name__} n={len(self)}{self._subset_tag()}"

    def _subset_tag(self) -> str:
        # Resuming on another subset of the same data (another validation split) is refused by this.
        return "" if self.indices is None else f" subset={_crc(self.indices)}"

    def subset(self, indices) -> "Source":
        """A source of the same kind over the samples ``indices`` (in that order).

        The subset keeps this source's ``classes``, ``num_classes``, ``channels``, ``name`` and its
        ``mean``/``std``: a validation split must be normalized like its training split, not with its
        own statistics. Sharding, order and resume then apply to the subset; its fingerprint includes
        the indices, so a position saved on one subset is refused on another.

        Args:
            indices: 1-D integers in ``[0, len(self))`` (list, range, numpy array or tensor), each at most
                once, or a boolean mask of length ``len(self)``. A duplicate or an index out of range is
                an error naming the first one.
        """
        idx = check_indices(indices, len(self), f"{type(self).__name__}.subset")
        sub = copy.copy(self)
        sub._take(idx)
        sub.indices = idx if self.indices is None else self.indices[idx]
        return sub

    def _take(self, idx: np.ndarray) -> None:
        """Restrict this (copied) source to samples ``idx``; each kind keeps what its backends read."""
        raise NotImplementedError(f"{type(self).__name__} does not implement subset()")

    def __getitem__(self, i):
        """Sample ``i`` as ``(image, label)`` (each kind says what its image is). ``torch.utils.data.Subset``
        and ``random_split`` need only ``len``; ``as_source`` turns their result into ``subset()``.

        Args:
            i: an integer in ``[-len, len)``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement __getitem__")

    def _index(self, i) -> int:
        import numbers

        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{type(self).__name__} indices must be integers, got {i!r} ({type(i).__name__}); "
                            f"for several samples use subset()")
        n = len(self)
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"index {i} is out of range for {type(self).__name__} with {n} samples")
        return j

    def __repr__(self):
        return f"{type(self).__name__}(n={len(self)}, classes={self.num_classes}, name={self.name!r})"


def check_indices(indices, n: int, what: str = "indices") -> np.ndarray:
    """Sample ids as an int64 array: 1-D integers in [0, n), each at most once, or a boolean mask of
    length n. Why no duplicates: a subset promises every selected sample once per epoch, and a repeated
    id is far more often a bug (two overlapping splits concatenated) than an intended oversampling.

    Args:
        indices: list, range, numpy array or torch tensor of integers, or a boolean mask.
        n: the number of samples of the source being indexed.
        what: how errors name the argument.
    """
    if isinstance(indices, (set, frozenset, dict)):
        raise TypeError(f"{what}: indices must be ordered (a list, range, array or tensor), got a "
                        f"{type(indices).__name__}")
    if hasattr(indices, "detach"):  # a torch tensor, possibly on a GPU
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices)
    if idx.dtype == np.bool_:
        if idx.shape != (n,):
            raise ValueError(f"{what}: a boolean mask must have one entry per sample ({n}), got shape {idx.shape}")
        idx = np.flatnonzero(idx)
    elif idx.size == 0 and idx.dtype == np.float64:
        idx = idx.astype(np.int64)  # np.asarray([]) is float64: an empty list is not a float index
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"{what}: indices must be integers (or a boolean mask), got dtype {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"{what}: indices must be 1-D, got shape {idx.shape}")
    if idx.size == 0:
        raise ValueError(f"{what}: indices select no samples; a source needs at least one")
    idx = idx.astype(np.int64)
    bad = (idx < 0) | (idx >= n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise IndexError(f"{what}: indices[{i}] is {idx[i]}, outside [0, {n}) (the source has {n} samples)")
    _, first, inverse = np.unique(idx, return_index=True, return_inverse=True)
    repeated = np.flatnonzero(first[inverse] != np.arange(len(idx)))
    if repeated.size:
        at = int(repeated[0])
        raise ValueError(f"{what}: index {idx[at]} appears more than once (indices[{int(first[inverse[at]])}] "
                         f"and indices[{at}]); a subset holds each sample once")
    return idx


class ArraySource(Source):
    """Decoded uint8 images in memory: (N, H, W) grey or (N, H, W, C).

    Args:
        images: uint8 array (numpy, or a torch tensor on any device: copied to the host).
        labels: integer labels, one per image, in ``[0, num_classes)``.
        mean, std: per-channel statistics in [0, 1] units; None → measured on the images.
        name: how messages and ``repr`` name the source.
        digits: small grey digits (use the digits augmentation recipe: translation, no flip).
        classes: class names, index = label; None → ``0 .. num_classes-1``.
        num_classes: None → ``len(classes)`` if given, else the largest label + 1. When known, a label
            outside ``[0, num_classes)`` is an error naming it.
    """

    kind = SourceKind.ARRAY
    hwc_samples = True

    def __init__(self, images, labels, *, mean=None, std=None, name: str = "array", digits: bool = False,
                 classes=None, num_classes: int | None = None):
        images, labels = _host_array(images), _host_array(labels)
        if images.dtype != np.uint8:
            raise TypeError(f"images must be uint8, got {images.dtype}")
        if images.ndim == 3:
            images = images[..., None]
        if images.ndim != 4 or images.shape[-1] not in (1, 3):
            raise ValueError(f"images must be (N, H, W) or (N, H, W, C) with C in (1, 3), got {images.shape}")
        if labels.shape != (len(images),):
            raise ValueError(f"labels must have shape ({len(images)},), got {labels.shape}")
        if len(images) == 0:
            raise ValueError(f"{name}: no images")
        if images.shape[1] == 0 or images.shape[2] == 0:
            raise ValueError(f"images must have at least one pixel, got {images.shape[1]}x{images.shape[2]} "
                             f"images {images.shape}")
        num_classes = _num_classes(classes, num_classes)
        labels = check_labels(labels, num_classes=num_classes)
        labels = labels if labels.flags.writeable else labels.copy()   # small: shared with torch freely
        # Contiguous, and never copied when it already is: a read-only array (np.load(mmap_mode="r"),
        # read_idx's frombuffer) is kept as it is, so a memmap larger than RAM stays on disk. Nothing
        # in fastdata writes to it; __getitem__ hands out a writable copy of such a sample.
        self.images = np.ascontiguousarray(images)  # (N, H, W, C)
        self.labels = labels
        self.name = name
        self.digits = digits
        self.channels = images.shape[-1]
        self.num_classes = num_classes if num_classes is not None else int(self.labels.max()) + 1
        self.classes = classes
        if mean is None or std is None:
            measured_mean, measured_std = channel_stats(self.images)
            mean = measured_mean if mean is None else mean
            std = measured_std if std is None else std
        self.mean, self.std = tuple(mean), tuple(std)

    def fingerprint(self) -> str:
        # Shape plus a CRC of the labels and of up to 64 evenly spaced images: tens of KB for MNIST,
        # a few MB for a cached photo set, so it is cheap to compute at every checkpoint.
        picks = np.linspace(0, len(self.images) - 1, min(64, len(self.images))).astype(np.int64)
        return (f"{type(self).__name__} n={len(self)} image={'x'.join(map(str, self.image_shape))} "
                f"crc={_crc(self.labels, self.images[picks])}{self._subset_tag()}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image."""
        return self.images.shape[1:]

    def default_augmentation(self, train: bool) -> Augmentation:
        """Training: digits (``digits=True``) → ``Augmentation.digits_train()`` (shifts of ±2 px, no flip);
        RGB images → ``Augmentation.cifar_train()`` (reflect-pad 4, random crop, flip), unless a side
        is 4 px or less, too small to reflect-pad by 4 (then none); grey images that are not digits →
        none (a flip or shift may change what a grey image means: give ``augment=`` to choose).
        Evaluation: none.

        Args:
            train: the training recipe (else the evaluation one).
        """
        if not train:
            return Augmentation.none()
        if self.digits:
            return Augmentation.digits_train()
        h, w, c = self.image_shape
        if c == 3 and min(h, w) > 4:
            return Augmentation.cifar_train()
        return Augmentation.none()

    def _take(self, idx: np.ndarray) -> None:
        contiguous = len(idx) > 0 and idx[-1] - idx[0] == len(idx) - 1 and (np.diff(idx) == 1).all()
        # A run of consecutive ids is a view (no copy of a large array); anything else is a gather.
        self.images = self.images[idx[0]: idx[-1] + 1] if contiguous else self.images[idx]
        self.labels = self.labels[idx]

    def __getitem__(self, i):
        """(uint8 tensor (H, W, C), int label) of sample ``i``: the stored pixels, no augmentation.

        Args:
            i: an integer in ``[-len, len)``.
        """
        import torch

        i = self._index(i)
        image = self.images[i]
        # A read-only array's sample is copied (one image): torch.from_numpy warns on such buffers, and
        # a caller writing into the tensor would fault on a read-only memory map.
        return torch.from_numpy(image if image.flags.writeable else image.copy()), int(self.labels[i])


def channel_stats(images: np.ndarray, *, most: int = 10_000, most_values: int = 2**26,
                  chunk_bytes: int = 8 * 2**20):
    """Per-channel (mean, std) in [0, 1] units of uint8 (N, H, W, C) ``images``, each std at least
    1e-3. A strided subset of at most ``most`` images and about ``most_values`` pixel values (CIFAR's and
    MNIST's 10,000 images are under it; large photos are sampled more sparsely) gives them to 3 digits
    without a pass over a large array. The subset is counted into one 256-bin histogram per channel, a
    chunk of about ``chunk_bytes`` of pixels at a time: exact, and the memory used is bounded whatever
    the image size (a float32 copy of 10,000 photos of 224² was 6 GB, and numpy's std made a second)."""
    per_image = max(1, int(np.prod(images.shape[1:])))
    sub = images[:: max(1, -(-len(images) // most), -(-len(images) * per_image // most_values))]
    channels = sub.shape[-1]
    step = max(1, chunk_bytes // per_image)
    offsets = (np.arange(channels, dtype=np.int32) * 256)
    counts = np.zeros(256 * channels, np.int64)
    for a in range(0, len(sub), step):
        block = sub[a: a + step].reshape(-1, channels).astype(np.int32)
        block += offsets   # channel c counts into bins c*256 .. c*256+255
        counts += np.bincount(block.ravel(), minlength=256 * channels)
    hist = counts.reshape(channels, 256).astype(np.float64)
    values = np.arange(256, dtype=np.float64) / 255.0
    n = hist.sum(axis=1)
    mean = hist @ values / n
    var = np.maximum(hist @ values**2 / n - mean**2, 0.0)
    return tuple(float(m) for m in mean), tuple(max(float(v) ** 0.5, 1e-3) for v in var)


def _host_array(x) -> np.ndarray:
    """A numpy view or copy of ``x``: a torch tensor on a GPU, or one that requires grad, is copied to
    the host (``Tensor.numpy()`` alone refuses both); other array-likes go through ``np.asarray``."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.numpy(force=True)
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _num_classes(classes, num_classes) -> int | None:
    """``num_classes`` checked, or ``len(classes)``; the two must agree when both are given."""
    if num_classes is not None:
        import numbers

        if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
        num_classes = int(num_classes)
    if classes is not None:
        if isinstance(classes, (str, bytes)) or not hasattr(classes, "__len__"):
            raise TypeError(f"classes must be a list of class names, got {type(classes).__name__}")
        if num_classes is not None and num_classes != len(classes):
            raise ValueError(f"num_classes={num_classes} but classes has {len(classes)} names")
        return len(classes)
    return num_classes


def check_labels(labels, what: str = "labels", num_classes: int | None = None) -> np.ndarray:
    """Labels as int64, refusing what a cast would silently change: fractions (1.7 → 1), NaN (→ INT64_MIN),
    negatives (a negative class count), non-numbers, and, with ``num_classes``, labels past the last
    class (a loss would index out of range, or a model silently get too few outputs). The error names
    the first bad one and its index.

    Args:
        labels: array-like of numbers.
        what: how errors name the labels.
        num_classes: when given, labels must lie in ``[0, num_classes)``.
    """
    labels = np.asarray(labels)
    if labels.dtype == np.bool_ or not (np.issubdtype(labels.dtype, np.integer)
                                         or np.issubdtype(labels.dtype, np.floating)):
        raise TypeError(f"{what} must be integers >= 0, got dtype {labels.dtype}")
    if np.issubdtype(labels.dtype, np.floating):
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(labels) | (labels != np.round(labels))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{what} must be integers >= 0; {what}[{i}] is {labels[i].item()!r}")
    negative = labels < 0
    if negative.any():
        i = int(np.flatnonzero(negative)[0])
        raise ValueError(f"{what} must be integers >= 0; {what}[{i}] is {labels[i].item()!r}")
    if num_classes is not None:
        over = labels >= num_classes
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ValueError(f"{what} must be integers in [0, {num_classes}) (num_classes={num_classes}); "
                             f"{what}[{i}] is {labels[i].item()!r}")
    return labels.astype(np.int64)


def _crc(*arrays: np.ndarray) -> str:
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
    return f"{crc:08x}"


# ---------------------------------------------------------------------------------------------- MNIST
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
                download_error = None
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
def _ellipse(cx, cy, rx, ry, n=14, start=0.0, end=2 * np.pi):
    t = np.linspace(start, end, n)
    return [(cx + rx * np.cos(a), cy + ry * np.sin(a)) for a in t]


# Each digit is a few polylines in a unit box (x right, y down), drawn like a hand would.
_DIGIT_STROKES = {
    0: [_ellipse(0.5, 0.5, 0.24, 0.38, 17)],
    1: [[(0.34, 0.26), (0.52, 0.1), (0.52, 0.9)]],
    2: [[(0.25, 0.3), (0.33, 0.15), (0.5, 0.1), (0.67, 0.15), (0.74, 0.3), (0.68, 0.46), (0.25, 0.9), (0.78, 0.9)]],
    3: [[(0.25, 0.15), (0.72, 0.14), (0.45, 0.44), (0.64, 0.52), (0.73, 0.7), (0.62, 0.87), (0.42, 0.91),
         (0.25, 0.82)]],
    4: [[(0.64, 0.9), (0.64, 0.1), (0.2, 0.64), (0.82, 0.64)]],
    5: [[(0.73, 0.1), (0.31, 0.1), (0.27, 0.46), (0.5, 0.4), (0.7, 0.5), (0.73, 0.72), (0.56, 0.9), (0.28, 0.85)]],
    6: [[(0.68, 0.12), (0.45, 0.2), (0.31, 0.44), (0.28, 0.7), (0.4, 0.88), (0.6, 0.88), (0.71, 0.7),
         (0.6, 0.53), (0.4, 0.52), (0.29, 0.63)]],
    7: [[(0.22, 0.12), (0.78, 0.12), (0.42, 0.9)], [(0.4, 0.5), (0.68, 0.5)]],
    8: [_ellipse(0.5, 0.29, 0.18, 0.18, 13), _ellipse(0.5, 0.68, 0.23, 0.21, 13)],
    9: [_ellipse(0.48, 0.32, 0.2, 0.2, 13, -0.1, 2 * np.pi - 0.1), [(0.68, 0.3), (0.62, 0.9)]],
}
def _digit_segments(digit: int) -> np.ndarray:
    """(S, 2, 2) segment end points of one digit's strokes."""
    return np.asarray([(a, b) for line in _DIGIT_STROKES[digit] for a, b in zip(line[:-1], line[1:])],
                      dtype=np.float32)


def _distance_to_segments(grid, pts):
    """(c, P) distance from each grid point to the nearest of each image's segments pts (c, S, 2, 2)."""
    a0, d = pts[:, :, 0], pts[:, :, 1] - pts[:, :, 0]                               # (c, S, 2)
    rel = grid[None, :, None, :] - a0[:, None]                                        # (c, P, S, 2)
    t = ((rel * d[:, None]).sum(-1) / (d * d).sum(-1).clamp_min(1e-6)[:, None]).clamp_(0, 1)
    return (rel - t[..., None] * d[:, None]).square_().sum(-1).amin(-1).sqrt_()


def render_digits(labels: np.ndarray, rng: np.random.Generator, size: int = 28) -> np.ndarray:
    """Draw one anti-aliased digit per label, each with its own jitter, slant, scale, stroke and noise.

    Pixels are shaded by their distance to the nearest stroke segment. The distance field runs in torch
    (multi-threaded float32), one digit class at a time so no work goes to padding segments: 60,000
    digits take a few seconds on two cores. Half the images carry a distractor stroke and a fifth an
    occluding patch, so some digits are genuinely ambiguous: a small CNN learns them well, not perfectly.

    Args:
        labels: the digit (0-9) of each image.
        rng: all random draws come from it, in a fixed order.
        size: side of the square images.
    """
    import torch

    n = len(labels)
    # All random draws happen up front in a fixed order, so the images depend on the seed alone.
    angle = rng.uniform(-0.45, 0.45, n)
    shear = rng.uniform(-0.45, 0.45, n)
    sx, sy = rng.uniform(0.45, 0.9, n), rng.uniform(0.5, 0.9, n)
    a = np.stack([np.cos(angle) * sx, -np.sin(angle) * sy + shear * sx,
                  np.sin(angle) * sx, np.cos(angle) * sy], -1).reshape(n, 2, 2).astype(np.float32)
    shift = np.stack([rng.uniform(-0.14, 0.14, n), rng.uniform(-0.14, 0.14, n)], -1).astype(np.float32)
    width = rng.uniform(0.7, 2.6, n).astype(np.float32)
    ink = rng.uniform(0.5, 1.0, n).astype(np.float32)
    noise_level = rng.uniform(0.0, 0.3, n).astype(np.float32)
    noise = rng.standard_normal((n, size * size), dtype=np.float32)
    clutter = rng.uniform(0, size, (n, 1, 2, 2)).astype(np.float32)                   # one stray stroke
    clutter[:, :, 1] = clutter[:, :, 0] + rng.normal(0, size / 5, (n, 1, 2)).astype(np.float32)
    clutter_ink = np.where(rng.random(n) < 0.5, rng.uniform(0.3, 0.9, n), 0).astype(np.float32)
    occlude = rng.random(n) < 0.2
    box = rng.integers(0, size, (n, 2)), rng.integers(5, 11, (n, 2))
    jitter_seed = int(rng.integers(2 ** 62))
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    grid = torch.from_numpy(np.stack([xs.ravel(), ys.ravel()], -1))                   # (P, 2)
    dist = np.empty((n, size * size), dtype=np.float32)
    for digit in range(10):
        ids = np.flatnonzero(labels == digit)
        if len(ids) == 0:
            continue
        base = _digit_segments(digit)
        jit = np.random.default_rng([jitter_seed, digit]).normal(0, 0.045, (len(ids),) + base.shape)
        segs = torch.from_numpy((base[None] + jit.astype(np.float32)) - 0.5)            # (m, S, 2, 2)
        pts = torch.einsum("nij,nsej->nsei", torch.from_numpy(a[ids]), segs)
        pts = (pts + 0.5 + torch.from_numpy(shift[ids])[:, None, None, :]) * size
        for lo in range(0, len(ids), 1024):  # bounds the (chunk, P, S, 2) temporaries to ~100 MB
            dist[ids[lo:lo + 1024]] = _distance_to_segments(grid, pts[lo:lo + 1024]).numpy()
    stray = np.concatenate([_distance_to_segments(grid, torch.from_numpy(clutter[lo:lo + 4096])).numpy()
                            for lo in range(0, n, 4096)])
    img = np.maximum(np.clip(width[:, None] - dist + 0.5, 0, 1) * ink[:, None],
                     np.clip(1.2 - stray + 0.5, 0, 1) * clutter_ink[:, None])
    img = img.reshape(n, size, size)
    for i in np.flatnonzero(occlude):  # a dark patch over part of the digit
        (y, x), (h, w) = box[0][i], box[1][i]
        img[i, y:y + h, x:x + w] = 0
    img = img.reshape(n, -1) + noise * noise_level[:, None]
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8).reshape(n, size, size)


class SyntheticDigits(ArraySource):
    """Procedurally drawn 28x28 grey digits, deterministic by seed.

    Stroke, scale, slant, position and noise vary per image, so a small CNN has to learn shapes (it
    reaches high but not perfect accuracy). Train and test sets differ for the same seed.

    Args:
        n: number of images (labels are balanced over 0-9).
        train: draws the training stream, else a disjoint test stream.
        seed: the same seed always gives the same images.
    """

    def __init__(self, n: int = 60_000, train: bool = True, seed: int = 0):
        if n <= 0:
            raise ValueError(f"n must be positive, got {n}")
        rng = np.random.default_rng([seed, 1 if train else 2, 0xD161])
        labels = rng.permutation(np.arange(n) % 10)
        images = render_digits(labels, rng)
        self.seed, self.train = seed, train
        # MNIST's statistics differ; measuring keeps normalized inputs near zero mean, unit variance.
        super().__init__(images, labels, name="synthetic", digits=True, num_classes=10)


# ------------------------------------------------------------------------------------ image folders
def _scandir(folder) -> list:
    """os.scandir that names the folder it cannot read (os.walk skips it silently: its images vanish)."""
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as e:
        raise type(e)(e.errno, f"cannot read folder '{folder}' of the image folder: {e.strerror}; its "
                                f"images would be missing (fix its permissions or remove it)") from None


def _walk_images(folder, exts, visited: set, real_root: str):
    """Image files under ``folder``, following links to folders, each real folder once."""
    for entry in _scandir(folder):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():  # follows links
            real = os.path.realpath(entry.path)
            if real_root.startswith(real.rstrip(os.sep) + os.sep):
                raise ValueError(f"folder link '{entry.path}' points to '{real}', which contains the image "
                                 f"folder '{real_root}' itself: reading it would loop")
            if real in visited:  # a loop, or a folder already read (under its own class)
                continue
            visited.add(real)
            yield from _walk_images(entry.path, exts, visited, real_root)
        elif entry.name.lower().endswith(exts):
            yield entry.path


class ImageFolder(Source):
    """One sub-folder per class of image files (ImageNet's layout); classes sorted by name. The files
    are those torchvision's ImageFolder lists (``IMAGE_EXTENSIONS``: JPEG, PNG, BMP, TIFF, WebP, PPM/PGM),
    except names starting with a dot (macOS's ``._`` AppleDouble files are not images).

    ``ImageFolder.from_samples`` builds one over a given file list instead (what torchvision's
    ImageFolder/DatasetFolder hold in ``.samples``). ``source[i]`` is ``(uint8 tensor (H, W, 3), label)``:
    the file decoded at full size (EXIF orientation applied, converted to RGB), then ``transform``.

    Args:
        root: the folder whose sub-folders are the classes.
        extensions: file endings that count as images (case-insensitive).
        mean, std: normalization statistics in [0, 1] units (ImageNet's by default).
        transform: a per-sample callable applied to each decoded RGB PIL image (after EXIF orientation
            and RGB conversion) by the backends that decode per sample on the CPU (torch, prefetch). It
            returns a PIL image, a uint8 tensor (C, H, W) or a uint8 array (H, W, C), of one size for
            every sample (end it with a fixed-size crop or resize). A float output (ToTensor, ToDtype,
            Normalize at the end) is refused: normalization happens on the device (pass mean=/std=).
            With a transform the source's default augmentation is none (the transform is the
            augmentation) and a loader's ``augment`` other than none is refused. Its random draws use
            torch's, Python's and numpy's global generators, seeded per sample from the batch's seed,
            so runs repeat whatever the number of workers (the caller's generators are restored).
    """

    kind = SourceKind.FILES
    hwc_samples = True

    def __init__(self, root, extensions=IMAGE_EXTENSIONS, *, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                 transform=None):
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"image folder '{root}' does not exist")
        if not root.is_dir():
            raise NotADirectoryError(f"image folder '{root}' is not a directory")
        exts = tuple(e.lower() for e in extensions)
        classes = sorted(e.name for e in _scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise FileNotFoundError(f"image folder '{root}' has no class sub-folders "
                                    f"(expected root/<class>/<image>{exts[0]})")
        # Every real directory is walked once. The root and the class folders are marked up front, so a
        # link back to them (a/loop -> ..) neither loops (os.walk(followlinks=True) re-reads the tree
        # through it: 6 images became 2,706) nor relabels another class's images.
        real_root = os.path.realpath(root)
        visited = {real_root} | {os.path.realpath(root / c) for c in classes}
        paths, labels = [], []
        for label, cls in enumerate(classes):
            # torchvision's order: folders by path, then the files of each by name (its
            # sorted(os.walk(...)) then sorted(fnames)), so a nested class folder lists "z.jpg" before
            # "more/b.jpg" in both, and sample i is the same file in both (fingerprints, indices=).
            files = sorted(_walk_images(root / cls, exts, visited, real_root),
                           key=lambda p: (os.path.dirname(p), os.path.basename(p)))
            if not files:
                raise FileNotFoundError(f"class folder '{root / cls}' has no images with endings {list(exts)}")
            paths += files
            labels += [label] * len(files)
        self._init(root, classes, paths, np.asarray(labels, dtype=np.int64), mean, std, transform,
                   f"imagefolder:{root.name}")

    @classmethod
    def from_samples(cls, samples, classes, *, root=None, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                     transform=None, name: str | None = None) -> "ImageFolder":
        """An image-folder source over a given file list: torchvision's ``DatasetFolder.samples``, or
        any list of ``(path, class index)``. Read by every backend, as a walked folder is.

        Args:
            samples: ``(path, label)`` pairs; labels are integers in ``[0, len(classes))``.
            classes: the class names, index = label (classes with no file are allowed).
            root: the folder paths are relative to in the fingerprint (a copy of the data elsewhere
                still resumes); None → the paths' common folder.
            mean, std, transform: as for ``ImageFolder``.
            name: how messages name the source; None → ``imagefolder:<root's name>``.
        """
        samples = list(samples)
        if not samples:
            raise ValueError("samples is empty: an image-folder source needs at least one (path, label)")
        for i, s in enumerate(samples):
            if not isinstance(s, (tuple, list)) or len(s) != 2 or not isinstance(s[0], (str, os.PathLike)):
                raise TypeError(f"samples[{i}] must be a (path, label) pair, got {s!r}")
        classes = list(classes)
        if not classes:
            raise ValueError("classes is empty: name at least one class")
        paths = [os.fspath(p) for p, _ in samples]
        labels = check_labels([lab for _, lab in samples], "samples' labels", num_classes=len(classes))
        root = Path(root) if root is not None else Path(os.path.commonpath([os.path.dirname(p) or "."
                                                                            for p in paths]))
        self = cls.__new__(cls)
        self._init(root, classes, paths, labels, mean, std, transform, name or f"imagefolder:{root.name}")
        return self

    def _init(self, root, classes, paths, labels, mean, std, transform, name) -> None:
        if transform is not None:
            check_sample_transform(transform, f"ImageFolder '{root}'")
        self.root = root
        self.classes = classes
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        self.paths = paths
        self.labels = labels
        self.channels = 3
        self.num_classes = len(classes)
        self.mean, self.std = tuple(mean), tuple(std)
        self.name = name
        self.transform = transform
        self._fingerprint = None

    @property
    def sample_transform(self):
        """The ``transform`` given, or None."""
        return self.transform

    def fingerprint(self) -> str:
        # The file list (relative paths and labels) and the file sizes. Not the mtimes: copying a data
        # set to a node's local disk changes them but not the data. Computed once (one stat per file).
        if self._fingerprint is None:
            crc = zlib.crc32("\n".join(self.classes).encode())
            for path, label in zip(self.paths, self.labels):
                try:
                    size = os.stat(path).st_size
                except OSError:  # gone since the walk: its batch will name it; a checkpoint must not fail
                    size = -1
                rel = os.path.relpath(path, self.root)
                crc = zlib.crc32(f"{rel}\0{label}\0{size}\n".encode(), crc)
            self._fingerprint = (f"{type(self).__name__} n={len(self)} classes={self.num_classes} "
                                 f"files={crc:08x}{self._subset_tag()}")
        return self._fingerprint

    def default_augmentation(self, train: bool) -> Augmentation:
        """Training: ``Augmentation.imagenet_train()``; evaluation: ``imagenet_eval()``. With a
        ``transform``: none (the transform is the augmentation).

        Args:
            train: the training recipe (else the evaluation one).
        """
        if self.transform is not None:
            return Augmentation.none()
        return Augmentation.imagenet_train() if train else Augmentation.imagenet_eval()

    def _take(self, idx: np.ndarray) -> None:
        self.paths = [self.paths[i] for i in idx]
        self.labels = self.labels[idx]
        self._fingerprint = None

    def __getitem__(self, i):
        """(uint8 tensor (H, W, 3), int label) of sample ``i``: decoded at full size, then ``transform``.

        Args:
            i: an integer in ``[-len, len)``.
        """
        import torch

        from .transforms import load_photo

        i = self._index(i)
        image = load_photo(self.paths[i], Augmentation.none(), np.random.default_rng(0))
        if self.transform is not None:
            from PIL import Image

            image = transform_output(self.transform(Image.fromarray(image)), self, self.paths[i])
        return torch.from_numpy(np.array(image)), int(self.labels[i])  # a writable copy: PIL's is read-only


# ------------------------------------------------------------------------------ per-sample transforms
_FLOAT_MAKERS = {"ToTensor", "Normalize"}        # always float out
_DTYPE_SETTERS = {"ToDtype", "ConvertImageDtype"}  # float or uint8 out, by their dtype


#: torchvision containers that run their steps only sometimes, or in a random order.
_RANDOM_CONTAINERS = ("RandomApply", "RandomChoice", "RandomOrder")


def _outcomes(transform, before: frozenset) -> frozenset:
    """What ``transform`` may leave, from what may come in: a set of (floats, the step that made them)
    pairs, (False, None) for uint8/PIL. Compositions are walked (``composition_parts``: Compose,
    nn.Sequential, a module's children, in order); RandomApply may run or skip its steps, RandomChoice
    runs one of them and RandomOrder runs them in any order, so each contributes every possible end."""
    from itertools import islice, permutations

    from .batch_transforms import composition_parts

    parts = [child for _, child in composition_parts(transform)]
    if not parts:
        made = _makes_float(transform)
        return before if made is None else frozenset({(made, type(transform).__name__)})
    kind = type(transform).__name__ if type(transform).__module__.startswith("torchvision.") else None

    def in_order(steps, states):
        for step in steps:
            states = _outcomes(step, states)
        return states

    if kind == "RandomApply":
        return before | in_order(parts, before)
    if kind == "RandomChoice":
        return frozenset().union(*(_outcomes(p, before) for p in parts))
    if kind == "RandomOrder":   # every order (720 for 6 steps; more steps: the first 720 orders)
        return frozenset().union(*(in_order(order, before) for order in islice(permutations(parts), 720)))
    return in_order(parts, before)


def _makes_float(step) -> bool | None:
    """True: this torchvision step outputs floats; False: uint8; None: it keeps the dtype or is unknown."""
    if not type(step).__module__.startswith("torchvision."):
        return None  # a user's own class of the same name may do anything; the first batch checks it
    name = type(step).__name__
    if name in _FLOAT_MAKERS:
        return True
    if name in _DTYPE_SETTERS:
        dtype = getattr(step, "dtype", None)
        dtypes = list(dtype.values()) if isinstance(dtype, dict) else [dtype]
        return any(getattr(d, "is_floating_point", False) for d in dtypes if d is not None)
    return None


def check_sample_transform(transform, where: str = "the source"):
    """Refuse, before any batch, a per-sample transform that cannot work here: not callable, or one
    whose steps may leave the images float (ToTensor, Normalize or ToDtype(float) with no later
    conversion back to uint8), wherever they sit: in a Compose, an ``nn.Sequential``, or a RandomApply/
    RandomChoice/RandomOrder that runs them only in some draws. Returns the transform.

    Args:
        transform: the callable.
        where: how the error names the source holding it.
    """
    if not callable(transform):
        raise TypeError(f"transform of {where} must be callable, got {transform!r}")
    ends = _outcomes(transform, frozenset({(False, None)}))
    floating = sorted(maker for is_float, maker in ends if is_float)
    if floating:
        when = "" if all(is_float for is_float, _ in ends) else " in some of its random draws"
        raise TypeError(f"the transform of {where} ends with float images ({', '.join(floating)}){when}: "
                        f"{_FLOAT_FIX}")
    return transform


def transform_output(out, source, where) -> np.ndarray:
    """A per-sample transform's output as uint8 (H, W, 3): a PIL image (any mode, as ImageFolder
    converts), a uint8 tensor (C, H, W) or (H, W), or a uint8 array (H, W, C) or (H, W). Grey is
    replicated, alpha dropped; a float output is the error that names the fix.

    Args:
        out: what the transform returned.
        source: the source, named in errors.
        where: the sample (its path or index), named in errors.
    """
    if hasattr(out, "getbands"):  # PIL image
        from .transforms import to_rgb

        return np.asarray(to_rgb(out))
    if hasattr(out, "detach"):  # torch tensor (tv_tensors.Image included)
        import torch

        if out.dtype != torch.uint8:
            raise TypeError(f"the transform of {source!r} returned a {out.dtype} tensor for {where!r}: "
                            f"{_FLOAT_FIX}")
        t = out.detach().cpu()
        t = t[None] if t.dim() == 2 else t
        if t.dim() != 3 or t.shape[0] not in (1, 3, 4):
            raise ValueError(f"the transform of {source!r} returned a tensor of shape {tuple(out.shape)} for "
                             f"{where!r}; expected uint8 (C, H, W) with C in (1, 3, 4)")
        arr = t.permute(1, 2, 0).numpy()
    elif isinstance(out, np.ndarray):
        if out.dtype != np.uint8:
            raise TypeError(f"the transform of {source!r} returned a {out.dtype} array for {where!r}: "
                            f"{_FLOAT_FIX}")
        arr = out[..., None] if out.ndim == 2 else out
        if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
            raise ValueError(f"the transform of {source!r} returned an array of shape {out.shape} for "
                             f"{where!r}; expected uint8 (H, W, C) with C in (1, 3, 4)")
    else:
        raise TypeError(f"the transform of {source!r} returned a {type(out).__name__} for {where!r}; expected "
                        f"a PIL image, a uint8 tensor (C, H, W) or a uint8 array (H, W, C)")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    return np.ascontiguousarray(arr[..., :3])


def check_transform_and_augment(source, aug) -> None:
    """Refuse a loader recipe on top of a source's per-sample transform: the transform is the
    augmentation, and applying a second one (two crops, two flips) is never what was meant.

    Args:
        source: the source (its ``sample_transform`` is read).
        aug: the loader's ``Augmentation`` (None or ``Augmentation.none()`` pass).
    """
    transform = getattr(source, "sample_transform", None)
    if transform is None or aug is None or aug == Augmentation.none():
        return
    raise ValueError(f"{source!r} has its own per-sample transform ({_describe(transform)}), which is its "
                     f"augmentation; augment={aug} would apply a second recipe after it. Pass augment=None "
                     f"(the default), or drop the transform and express it as augment=Augmentation(...) plus "
                     f"batch_transforms=[...]")


def _describe(transform, limit: int = 120) -> str:
    """A one-line, bounded repr of a transform (Compose's repr spans lines)."""
    import re

    text = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", " ".join(repr(transform).split())))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fastdata_samples(dataset) -> bool:
    """Whether every sample of ``dataset`` comes from a fastdata source whose ``source[i]`` is an (H, W, C)
    tensor (``hwc_samples``: arrays and image folders, not a DatasetSource, which hands out its dataset's
    own samples): such a source, or torch's ``Subset``/``ConcatDataset`` of them, nested."""
    from torch.utils.data import ConcatDataset, Subset

    if isinstance(dataset, Source):
        return dataset.hwc_samples
    if isinstance(dataset, ConcatDataset):
        return all(_fastdata_samples(d) for d in dataset.datasets)
    if isinstance(dataset, Subset):
        return _fastdata_samples(dataset.dataset)
    return False


@contextmanager
def _global_rngs_kept():
    """Run a Dataset's ``__getitem__`` outside an epoch (to learn what its samples are) with the global
    generators its transform draws from (torch's CPU one, ``random``, ``numpy.random``) restored after,
    so that ``make_loader`` leaves the caller's random state where it was. CUDA's generators are not
    touched: a per-sample transform runs on the host."""
    import random

    import torch

    with torch.random.fork_rng(devices=[]):
        state = random.getstate(), np.random.get_state()
        try:
            yield
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])


def _grey_data(dataset) -> bool:
    """Whether ``dataset`` holds grey pixels by construction: a ``data`` array or tensor of shape
    (N, H, W), as torchvision's MNIST family, USPS and SEMEION keep theirs (their PIL samples are mode
    "L"); torch's ConcatDataset of such datasets too."""
    parts = getattr(dataset, "datasets", None)
    if isinstance(parts, (list, tuple)) and parts:
        return all(_grey_data(d) for d in parts)
    shape = getattr(getattr(dataset, "data", None), "shape", None)   # numpy's tuple, torch's Size
    return isinstance(shape, tuple) and len(shape) == 3


class DatasetSource(Source):
    """Any map-style torch Dataset returning (PIL image or uint8 tensor (C,H,W) or (H,W), int).
    torch and prefetch backends. fastdata's own sources inside torch's ``Subset``/``ConcatDataset``
    hand out (H, W, C) tensors, read as such.

    Every sample comes out with ``channels`` channels (``as_array``). With ``channels=None``:

    - PIL images: 3, every photo converted to RGB as torchvision's default loader does (grey, palette,
      RGBA, CMYK, 16-bit alike), whatever the first photo's mode: a grey first photo (ImageNet has grey
      JPEGs) does not make the colour ones after it an error. The exception is a dataset whose pixels
      are grey by construction, a ``data`` array of shape (N, H, W) (torchvision's MNIST family, USPS):
      its grey samples keep 1 channel.
    - tensors and arrays: the first sample decides (one shape serves every sample): colour → 3, and
      later grey samples are replicated to RGB (lossless); grey → 1 (MNIST-like tensors), and a later
      colour sample is an error rather than silently turned grey.

    Pass ``channels=1`` to convert colour samples to grey (Pillow's luma) on purpose, or ``channels=3``.
    A first sample that is a float tensor (a transform ending in ToTensor/Normalize) is refused here,
    naming the fix. ``source[i]`` is the dataset's own sample.

    Args:
        dataset: the Dataset; ``__getitems__`` is used for batched fetching when it exists.
        mean, std: normalization; None → ImageNet's for 3 channels, 0.5/0.5 otherwise.
        channels: 1 or 3; None → from the samples' kind (see above).
        num_classes: None → ``len(dataset.classes)`` when it has them, else ``dataset.num_classes`` (an
            int), else from ``dataset.targets``; 0 when none of these exists (labels unread).
    """

    kind = SourceKind.DATASET

    def __init__(self, dataset, *, mean=None, std=None, channels: int | None = None, num_classes=None):
        self.dataset = dataset
        self.name = type(dataset).__name__
        n = len(dataset)
        if n == 0:
            raise ValueError(f"dataset {type(dataset).__name__} is empty")
        self._convert_colour = channels is not None  # RGB → grey only when asked for
        # fastdata's own sources hand out (H, W, C) tensors: wrapped in torch's Subset/ConcatDataset,
        # their tensors are read as such, not as torch's (C, H, W) (which refused them, or silently
        # transposed an image 3 or 4 px high).
        self._hwc_tensors = _fastdata_samples(dataset)
        first = None
        if self.sample_transform is not None and _torchvision_names(dataset) and not _own_getitem(dataset):
            # torchvision's datasets end __getitem__ with the transform, so its steps say what comes out
            # (a user's Dataset may convert back after it: its samples are checked as they come).
            check_sample_transform(self.sample_transform, self.name)
        if channels is None:
            with _global_rngs_kept():   # building a loader must not move the caller's RNG (dropout, init)
                first = self.pair(dataset[0], 0)[0]
            self._refuse_float(first, 0)
            channels = self._default_channels(first)
        elif isinstance(channels, bool) or channels not in (1, 3):
            raise ValueError(f"channels must be 1, 3 or None (from the samples' kind), got {channels!r}")
        self.channels = channels
        #: (H, W) of the first sample where it was read (channels=None), else None: what an empty batch's
        #: images are shaped as before any batch was read (``transforms.output_size``).
        self.sample_size = tuple(self.as_array(first).shape[:2]) if first is not None else None
        names = getattr(dataset, "classes", None)
        names = list(names) if isinstance(names, (list, tuple)) and names else None
        own = getattr(dataset, "num_classes", None)   # torchvision's FakeData, and many a user's Dataset
        if num_classes is None and names is None and isinstance(own, int) and not isinstance(own, bool) and own > 0:
            num_classes = own
        num_classes = _num_classes(names if num_classes is None else None, num_classes)
        self._classes_known = num_classes is not None  # as_label then checks labels against it
        targets = getattr(dataset, "targets", None)
        known = targets is not None and len(targets) == n
        self.labels = check_labels(targets, f"{self.name}.targets", num_classes) if known \
            else np.full(n, -1, dtype=np.int64)  # unknown until loaded
        self.num_classes = num_classes or (int(self.labels.max()) + 1 if known else 0)
        if names is not None and len(names) == self.num_classes:
            self.classes = names
        self.mean = tuple(mean) if mean else (IMAGENET_MEAN if channels == 3 else (0.5,))
        self.std = tuple(std) if std else (IMAGENET_STD if channels == 3 else (0.5,))
        self.refusal_hint = ("memory and dali read arrays or files, not a Dataset's __getitem__: pass "
                             "ArraySource(images, labels) or an image folder (ImageFolder(root), or "
                             "ImageFolder.from_samples), or use the torch backend")

    @property
    def sample_transform(self):
        """The dataset's own per-sample transform (torchvision's ``transform``/``transforms``), or None."""
        ds = self.dataset
        transform = getattr(ds, "transform", None)
        if transform is not None:
            return transform
        joint = getattr(ds, "transforms", None)  # torchvision wraps transform/target_transform in one
        if joint is not None and type(joint).__name__ == "StandardTransform":
            return getattr(joint, "transform", None)   # a target_transform alone is not an image transform
        return joint

    def fingerprint(self) -> str:
        # A Dataset's data cannot be read cheaply from here: its type, length and targets.
        t = type(self.dataset)
        known = bool(len(self.labels)) and self.labels[0] >= 0
        return (f"{t.__module__}.{t.__qualname__} n={len(self)}"
                + (f" targets={_crc(self.labels)}" if known else "") + self._subset_tag())

    def _take(self, idx: np.ndarray) -> None:
        self.labels = self.labels[idx]

    def dataset_index(self, i: int) -> int:
        """The index in ``dataset`` of this source's sample ``i`` (they differ for a subset).

        Args:
            i: an index of this source.
        """
        return int(self.indices[i]) if self.indices is not None else int(i)

    def fetch(self, ids) -> tuple[list, list[int]]:
        """(the dataset's samples for this source's ``ids``, their indices in ``dataset``), batched
        through ``__getitems__`` where the dataset offers it (one call, one lock, one seek pattern).

        Args:
            ids: indices of this source.
        """
        ds_ids = [self.dataset_index(i) for i in ids]
        ds = self.dataset
        samples = ds.__getitems__(ds_ids) if hasattr(ds, "__getitems__") else [ds[i] for i in ds_ids]
        return [self.pair(sample, i) for sample, i in zip(samples, ds_ids)], ds_ids

    def pair(self, sample, index: int) -> tuple:
        """``sample`` as the (image, label) pair every fastdata source yields; anything else (a dict, as
        Hugging Face datasets return, a triple, a bare image) is refused, naming the dataset and index."""
        if isinstance(sample, (tuple, list)) and len(sample) == 2:
            return sample
        what = (f"a dict with keys {sorted(map(str, sample))[:6]}" if isinstance(sample, dict) else
                f"a {len(sample)}-item {type(sample).__name__}" if isinstance(sample, (tuple, list)) else
                f"an object of type {type(sample).__name__}")
        raise TypeError(f"{self.name}[{index}] returned {what}; fastdata reads (image, label) pairs: wrap the "
                        f"dataset so that __getitem__ returns (image, label), e.g. (s['image'], s['label'])")

    def __getitem__(self, i):
        """The dataset's own sample for this source's sample ``i``.

        Args:
            i: an integer in ``[-len, len)``.
        """
        return self.dataset[self.dataset_index(self._index(i))]

    def _default_channels(self, first) -> int:
        """The channels when none were given (see the class docstring), from the first sample's kind."""
        if hasattr(first, "getbands"):
            # Photos come out RGB whatever the first one's mode, as torchvision's loader converts every
            # photo: ImageNet holds grey and CMYK JPEGs among its colour ones, and a grey first photo
            # must not make the colour ones after it an error. Only a dataset whose pixels are grey by
            # construction keeps one channel.
            return 1 if _grey_data(self.dataset) and not self._is_colour(first) else 3
        # Tensors and arrays have one shape for every sample (MNIST-like tensors stay grey).
        return 3 if self._is_colour(first) else 1

    def _is_colour(self, image) -> bool:
        """Whether a sample has colour: 3 or more bands, or a palette with a colour in use (a palette
        image has one band, but its entries are RGB: red stays red)."""
        if hasattr(image, "getbands"):
            if image.mode in ("P", "PA"):
                rgb = np.asarray(image.convert("RGB"))
                return not ((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all())
            return len(image.getbands()) >= 3
        return self._array(image).shape[-1] >= 3

    def _refuse_float(self, image, index=None) -> None:
        dtype = getattr(image, "dtype", None)
        if getattr(image, "mode", None) == "F":   # a float PIL image: its values would be clipped to 0..255
            dtype = "float32 (PIL mode 'F')"
        elif dtype is None or hasattr(image, "getbands") or not (
                getattr(dtype, "is_floating_point", False) or
                (isinstance(dtype, np.dtype) and np.issubdtype(dtype, np.floating))):
            return
        where = self.name if index is None else f"{self.name}[{index}]"
        raise TypeError(f"{where} returned a {dtype} image; {_EXPECTED_IMAGES}")

    def _array(self, image) -> np.ndarray:
        """A tensor or array sample as uint8 (H, W, C): tensors are (C, H, W) or (H, W), torch's layout;
        numpy arrays (H, W, C) or (H, W), PIL's and numpy's (what ``np.asarray(pil_image)`` gives)."""
        import torch

        if isinstance(image, np.ndarray):
            if image.dtype != np.uint8:
                self._refuse_float(image)
                raise TypeError(f"{self.name} returned a {image.dtype} array; expected uint8 (H, W, C) or (H, W)")
            if image.ndim == 2:
                image = image[..., None]
            if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
                raise ValueError(f"{self.name} returned an array of shape {image.shape}; expected uint8 "
                                 f"(H, W, C) with C in (1, 3, 4), or (H, W) (a tensor is (C, H, W))")
            return image
        t = torch.as_tensor(image)
        if t.dtype != torch.uint8:
            raise TypeError(f"{self.name} returned a {t.dtype} tensor; {_EXPECTED_IMAGES}")
        if self._hwc_tensors and t.dim() == 3:   # a fastdata source's sample: (H, W, C) already
            return t.numpy()
        if t.dim() == 2:
            t = t[None]
        if t.dim() != 3 or t.shape[0] not in (1, 3, 4):
            raise ValueError(f"{self.name} returned a tensor of shape {tuple(image.shape)}; expected uint8 "
                             f"(C, H, W) with C in (1, 3, 4), or (H, W) (an array is (H, W, C))")
        return t.permute(1, 2, 0).numpy()

    def as_array(self, image) -> np.ndarray:
        """One sample's image → uint8 (H, W, ``self.channels``), converted the same way for every sample.

        PIL images: any mode → RGB as ImageFolder does (grey replicated, alpha dropped, 16-bit scaled),
        or → L with Pillow's luma. Tensors: uint8 (C, H, W) or (H, W); grey is replicated to RGB, RGB(A)
        becomes grey exactly as Pillow's convert("L") computes it. A float tensor is refused, naming the
        fix (drop ToTensor/ToDtype/Normalize from the transform, pass mean=/std=).

        Args:
            image: the dataset's sample image.
        """
        if hasattr(image, "getbands"):  # PIL image
            from .transforms import to_rgb

            self._refuse_float(image)
            if self.channels == 1 and not self._convert_colour and self._is_colour(image):
                self._refuse_colour(image.mode)
            arr = np.asarray(to_rgb(image) if self.channels == 3 else
                             (image if image.mode == "L" else to_rgb(image).convert("L")))
            return arr[..., None] if arr.ndim == 2 else arr
        arr = self._array(image)
        c = arr.shape[-1]
        if c == 4:  # alpha dropped, as to_rgb does for PIL images
            arr, c = arr[..., :3], 3
        if c == self.channels:
            return np.ascontiguousarray(arr)
        if self.channels == 3:  # grey → RGB: lossless
            return np.repeat(arr, 3, axis=-1)
        if not self._convert_colour:
            self._refuse_colour(f"{c}-channel tensor")
        rgb = arr.astype(np.uint32)  # Pillow's L conversion (Convert.c, L24), bit for bit
        luma = (rgb[..., 0] * 19595 + rgb[..., 1] * 38470 + rgb[..., 2] * 7471 + 0x8000) >> 16
        return luma.astype(np.uint8)[..., None]

    def as_label(self, label, index: int) -> int:
        """One sample's label → int, refusing what int() would silently change (1.7, NaN, -3, "2") and,
        when ``num_classes`` is known from the dataset, a label past the last class.

        Args:
            label: the dataset's sample label.
            index: the sample's index in the dataset, named in errors.
        """
        import torch

        if isinstance(label, torch.Tensor) and label.numel() == 1:
            label = label.item()
        if isinstance(label, np.generic):
            label = label.item()
        if isinstance(label, float) and label.is_integer():
            label = int(label)
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"{self.name}[{index}] returned label {label!r}; labels must be integers >= 0")
        if self._classes_known and label >= self.num_classes:
            raise ValueError(f"{self.name}[{index}] returned label {label}; labels must be integers in "
                             f"[0, {self.num_classes}) ({self.name} has {self.num_classes} classes)")
        return label

    def _refuse_colour(self, what) -> None:
        raise ValueError(f"{self.name} returned a colour sample ({what}) but its first sample was grey, so "
                         f"the source has 1 channel; pass DatasetSource(dataset, channels=3) to keep colour "
                         f"(grey samples are replicated), or channels=1 to convert colour samples to grey")


# --------------------------------------------------------------------- what people already have
_TV_FOLDERS = ("ImageFolder", "DatasetFolder")
_TV_CIFAR = ("CIFAR10", "CIFAR100")
_TV_MNIST = ("MNIST", "FashionMNIST", "KMNIST", "EMNIST")
_TV_LOADERS = ("default_loader", "pil_loader", "accimage_loader")


def _torchvision_names(obj) -> list[str]:
    """Names of the torchvision.datasets classes ``obj`` is an instance of, nearest first. Read from the
    class's MRO, so torchvision is never imported here and a user's subclass counts as its base."""
    return [c.__name__ for c in type(obj).__mro__ if c.__module__.startswith("torchvision.datasets")]


def _own_transforms(obj) -> list[str]:
    """``name=value`` for each per-sample transform a torchvision dataset carries."""
    found = [f"{a}={_describe(getattr(obj, a))}" for a in ("transform", "target_transform")
             if getattr(obj, a, None) is not None]
    if not found and getattr(obj, "transforms", None) is not None:
        found.append(f"transforms={_describe(obj.transforms)}")
    return found


def _own_getitem(obj) -> str | None:
    """The class that gives ``obj`` its ``__getitem__`` when that is not torchvision's (a subclass that
    remaps labels, resizes, or reads pixels its own way), else None."""
    for cls in type(obj).__mro__:
        if "__getitem__" in vars(cls):
            return None if cls.__module__.startswith("torchvision.datasets") else cls.__qualname__
    return None


def from_torchvision(obj) -> Source | None:
    """A fastdata source for a torchvision dataset every backend can read, or None (not one, or one
    that cannot be converted without changing what it returns; ``as_source`` then keeps it as a
    ``DatasetSource`` with a ``refusal_hint`` saying why).

    - ``ImageFolder``/``DatasetFolder`` (and subclasses, e.g. ImageNet) with PIL's loader →
      ``ImageFolder.from_samples`` over ``.samples`` with its ``.classes``.
    - ``CIFAR10``/``CIFAR100`` → ``ArraySource`` over ``.data`` (N, 32, 32, 3) and ``.targets``.
    - ``MNIST``/``FashionMNIST``/``KMNIST``/``EMNIST`` → ``ArraySource`` over ``.data`` (N, 28, 28)
      and ``.targets`` (digit recipe for MNIST itself only: the others are not digits).

    Class names are kept, statistics are measured (arrays) or ImageNet's (files). A dataset with its own
    ``transform``, ``target_transform`` or ``transforms`` is not converted: the transform would be
    silently dropped. Nor is a subclass with a ``__getitem__`` of its own: what it returns is what the
    user means, and only calling it gives that.

    Args:
        obj: any object.
    """
    names = _torchvision_names(obj)
    if not names:
        return None
    kind = next((n for n in names if n in _TV_FOLDERS + _TV_CIFAR + _TV_MNIST), None)
    if kind is None or "QMNIST" in names:  # QMNIST's targets are rows of 8 fields, not class indices
        return None
    if _own_transforms(obj) or _own_getitem(obj):
        return None
    classes = list(getattr(obj, "classes", None) or [])
    label = type(obj).__name__
    if kind in _TV_FOLDERS:
        loader = getattr(obj, "loader", None)
        if getattr(loader, "__module__", "") != "torchvision.datasets.folder" or \
                getattr(loader, "__name__", "") not in _TV_LOADERS:
            return None  # a loader of its own (npy files, ...): only its __getitem__ knows the pixels
        root = getattr(obj, "root", None)
        return ImageFolder.from_samples(obj.samples, classes, root=root,
                                        name=f"{label.lower()}:{Path(root).name if root else ''}")
    data, targets = getattr(obj, "data", None), getattr(obj, "targets", None)
    if data is None or targets is None:
        return None
    digits = kind == "MNIST"  # the nearest known class: FashionMNIST, KMNIST, EMNIST are not digits
    return ArraySource(data, np.asarray(targets), classes=classes or None, name=label.lower(), digits=digits)


def _refusal_hint(obj) -> str | None:
    """Why ``obj`` (a torchvision dataset kept as a DatasetSource) is not read by memory/dali, and what
    to pass instead; None when there is nothing specific to say."""
    names = _torchvision_names(obj)
    label = type(obj).__name__
    own = _own_transforms(obj)
    getitem = _own_getitem(obj) if names else None
    if getitem:
        return (f"{label} has its own __getitem__ ({getitem}.__getitem__), which only the torch and prefetch "
                f"backends call; memory and dali read files or arrays: pass an ImageFolder.from_samples or an "
                f"ArraySource holding what it returns, or use the torch backend")
    if names and own:
        return (f"{label} has its own {', '.join(own)}, which only the torch and prefetch backends run per "
                f"sample; for memory/dali pass {label}(..., transform=None) and express the augmentation "
                f"as augment=/batch_transforms=")
    if any(n in _TV_FOLDERS for n in names):
        return (f"{label} has its own loader={_describe(getattr(obj, 'loader', None))}, which only the torch "
                f"and prefetch backends call; memory and dali read image files with PIL: use its default "
                f"loader, or the torch backend")
    return None


def as_source(obj) -> Source:
    """The fastdata source for what a user passes to ``make_loader``.

    - a fastdata ``Source``: itself;
    - an ``(images, labels)`` pair of uint8 arrays: an ``ArraySource``;
    - a torchvision dataset: its files or arrays (``from_torchvision``), so every backend reads it;
    - a ``torch.utils.data.Subset`` (what ``random_split`` returns): ``as_source(subset.dataset)
      .subset(subset.indices)`` (nested Subsets compose);
    - any other map-style Dataset (``__getitem__`` and ``__len__``): a ``DatasetSource`` (torch and
      prefetch backends), whose ``refusal_hint`` tells the others' error what to do.

    Args:
        obj: the data.
    """
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2:
        return ArraySource(*obj)
    if _is_subset(obj):
        return as_source(obj.dataset).subset(obj.indices)
    converted = from_torchvision(obj)
    if converted is not None:
        return converted
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        src = DatasetSource(obj)
        hint = _refusal_hint(obj)
        if hint:
            src.refusal_hint = hint
        return src
    raise TypeError(f"cannot load from {type(obj).__name__}: pass a fastdata source (MNIST, ImageFolder, "
                    f"SyntheticDigits, ArraySource), a torchvision dataset, a map-style torch Dataset, or "
                    f"(images, labels) arrays")


def _is_subset(obj) -> bool:
    import sys

    data = sys.modules.get("torch.utils.data")  # a Subset exists only once torch is imported
    return data is not None and isinstance(obj, data.Subset)


def split(source, fractions, seed: int = 0) -> tuple[Source, ...]:
    """Split ``source`` into disjoint subsets that together cover it, at random but deterministically by
    ``seed``: e.g. ``train, val = split(CIFAR10(...), [0.9, 0.1])``.

    Each part is ``source.subset(ids)`` (ids in ascending order, so files are read in folder order): it
    keeps the source's classes and its mean/std, so a validation part is normalized like the training
    part. Not stratified: class proportions vary by chance.

    Args:
        source: anything ``as_source`` accepts.
        fractions: fractions that sum to 1 (each part gets ``floor(f * n)`` samples, and the samples left
            over go one each to the first parts, as ``torch.utils.data.random_split`` does), or integer
            counts that sum to ``len(source)``. Every part must get at least one sample.
        seed: the same seed always gives the same parts.
    """
    import numbers

    src = as_source(source)
    n = len(src)
    if isinstance(fractions, (str, bytes)) or not hasattr(fractions, "__len__") or len(fractions) == 0:
        raise TypeError(f"fractions must be a non-empty list of fractions or counts, got {fractions!r}")
    values = list(fractions)
    for i, f in enumerate(values):
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not math.isfinite(f) or f < 0:
            raise ValueError(f"fractions[{i}] is {f!r}; fractions and counts must be finite numbers >= 0")
    if all(isinstance(f, numbers.Integral) for f in values) and sum(values) == n:
        counts = [int(f) for f in values]
    elif any(isinstance(f, numbers.Integral) and f > 1 for f in values):
        raise ValueError(f"counts {values} sum to {sum(values)}, but {src!r} has {n} samples")
    else:
        total = math.fsum(values)
        if abs(total - 1) > 1e-6:
            raise ValueError(f"fractions {values} sum to {total:g}, not 1 (or give integer counts that sum to "
                             f"{n})")
        counts = [int(math.floor(f * n)) for f in values]
        for i in range(n - sum(counts)):  # the remainder, round-robin, as random_split does
            counts[i % len(counts)] += 1
    empty = [i for i, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(f"part {empty[0]} of split {values} gets no sample of the {n} in {src!r}; "
                         f"make it larger")
    from .config import check_integer

    seed = check_integer("seed", seed, minimum=0)
    order = np.random.default_rng([seed, 0x5B1D]).permutation(n)
    bounds = np.cumsum([0] + counts)
    return tuple(src.subset(np.sort(order[a:b])) for a, b in zip(bounds[:-1], bounds[1:]))


# ---------------------------------------------------------------------------- test/benchmark photos
def _natural_image(rng: np.random.Generator, h: int, w: int, label: int, classes: int) -> np.ndarray:
    """1/f^2-spectrum colour noise (the statistics of photos) plus a class-dependent tint and shapes."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    amp = 1.0 / f ** 1.05
    out = np.empty((h, w, 3), np.float32)
    base = rng.normal(size=(h, w // 2 + 1)) + 1j * rng.normal(size=(h, w // 2 + 1))
    for c in range(3):  # channels share most of their structure, as in photos
        spec = (base + 0.5 * (rng.normal(size=base.shape) + 1j * rng.normal(size=base.shape))) * amp
        spec[0, 0] = 0
        ch = np.fft.irfft2(spec, s=(h, w))
        out[..., c] = ch / (ch.std() + 1e-8)
    hue = 2 * np.pi * label / max(classes, 1)
    tint = np.array([np.cos(hue), np.cos(hue - 2.1), np.cos(hue + 2.1)], np.float32)
    img = 118 + 42 * out + 35 * tint
    # A few class-specific bright blobs so that classes are learnable from content, not only colour.
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(2 + label % 3):
        cy, cx, r = rng.uniform(0.2, 0.8) * h, rng.uniform(0.2, 0.8) * w, rng.uniform(0.06, 0.15) * min(h, w)
        mask = ((yy - cy) ** 2 + (xx - cx) ** 2) < r * r
        img[mask] += 60 * tint
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_folder(root, classes: int = 10, per_class: int = 20, seed: int = 0, *,
                      size_range=((400, 500), (300, 400)), quality: int = 90) -> Path:
    """Write a JPEG folder that looks like ImageNet's: 400-500 x 300-400 px, quality 90, ~80-120 KB.

    Deterministic by seed; existing files of the same name are overwritten. Returns ``root``.

    Args:
        root: the folder to write (created if missing).
        classes: number of class sub-folders.
        per_class: photos per class.
        seed: the same seed writes the same photos.
        size_range: ((min width, max width), (min height, max height)) in pixels; half the photos are
            then turned to portrait.
        quality: JPEG quality.
    """
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng([seed, 0x1A6E])
    for c in range(classes):
        d = root / f"class_{c:03d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w = int(rng.integers(size_range[0][0], size_range[0][1] + 1))
            h = int(rng.integers(size_range[1][0], size_range[1][1] + 1))
            if rng.random() < 0.5:  # ImageNet has portrait images too
                w, h = h, w
            arr = _natural_image(rng, h, w, c, classes)
            Image.fromarray(arr).save(d / f"img_{i:05d}.jpg", quality=quality)
    return root
