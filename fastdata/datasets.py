"""Data sources. A source says what the samples are; backends decide how to load them fast.

Three kinds, which backends treat differently:
- ``ArraySource`` (MNIST, SyntheticDigits, any uint8 array): pixels already in memory.
- ``ImageFolder``: encoded files on disk (JPEG/PNG), one sub-folder per class.
- ``DatasetSource``: any map-style torch Dataset returning (PIL image or uint8 tensor, int).
"""
from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from .config import Augmentation, SourceKind  # noqa: F401  (SourceKind: re-exported, it is public here)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


class Source:
    """Common attributes: ``labels`` (int64 array), ``num_classes``, ``channels``, ``mean``/``std``."""

    kind = SourceKind.ABSTRACT
    name = "source"
    labels: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int
    num_classes: int

    def __len__(self) -> int:
        return len(self.labels)

    def default_augmentation(self, train: bool) -> Augmentation:
        """The recipe a loader uses when ``LoaderConfig.augment`` is None (``train``: the training one)."""
        return Augmentation.none()

    def fingerprint(self) -> str:
        """A short, readable identity of the data, stored with a loader's position: resuming on other
        data of the same size would silently read different samples. Cheap, so not a full hash."""
        return f"{type(self).__name__} n={len(self)}"

    def __repr__(self):
        return f"{type(self).__name__}(n={len(self)}, classes={self.num_classes}, name={self.name!r})"


class ArraySource(Source):
    """Decoded uint8 images in memory: (N, H, W) grey or (N, H, W, C).

    Args:
        images: uint8 array (numpy or torch).
        labels: integer labels, one per image.
        mean, std: per-channel statistics in [0, 1] units; None → measured on the images.
        digits: small grey digits (use the digits augmentation recipe: translation, no flip).
    """

    kind = SourceKind.ARRAY

    def __init__(self, images, labels, *, mean=None, std=None, name: str = "array", digits: bool = False):
        images = images.numpy() if hasattr(images, "numpy") else np.asarray(images)
        labels = labels.numpy() if hasattr(labels, "numpy") else np.asarray(labels)
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
        labels = check_labels(labels)
        # Writable and contiguous: torch.from_numpy shares it without a copy, and warns on read-only
        # buffers (read_idx's frombuffer is one).
        images = np.ascontiguousarray(images)
        self.images = images if images.flags.writeable else images.copy()  # (N, H, W, C)
        self.labels = labels
        self.name = name
        self.digits = digits
        self.channels = images.shape[-1]
        self.num_classes = int(self.labels.max()) + 1
        if mean is None or std is None:
            # A strided subset gives the statistics to 3 digits without a pass over a large array.
            sub = self.images[:: max(1, len(self.images) // 10_000)].astype(np.float32) / 255.0
            mean = tuple(float(m) for m in sub.mean(axis=(0, 1, 2))) if mean is None else mean
            std = tuple(max(float(s), 1e-3) for s in sub.std(axis=(0, 1, 2))) if std is None else std
        self.mean, self.std = tuple(mean), tuple(std)

    def fingerprint(self) -> str:
        # Shape plus a CRC of the labels and of up to 64 evenly spaced images: tens of KB for MNIST,
        # a few MB for a cached photo set, so it is cheap to compute at every checkpoint.
        picks = np.linspace(0, len(self.images) - 1, min(64, len(self.images))).astype(np.int64)
        return (f"{type(self).__name__} n={len(self)} image={'x'.join(map(str, self.image_shape))} "
                f"crc={_crc(self.labels, self.images[picks])}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image."""
        return self.images.shape[1:]

    def default_augmentation(self, train: bool) -> Augmentation:
        return Augmentation.digits_train() if (train and self.digits) else Augmentation.none()

    def __getitem__(self, i):
        import torch

        return torch.from_numpy(self.images[i]), int(self.labels[i])


def check_labels(labels, what: str = "labels") -> np.ndarray:
    """Labels as int64, refusing what a cast would silently change: fractions (1.7 → 1), NaN (→ INT64_MIN),
    negatives (a negative class count), non-numbers. The error names the first bad one and its index."""
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
    """Read an IDX file (gzipped or not); a wrong magic number or a short body names the file."""
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
        super().__init__(images, labels, mean=(0.1307,), std=(0.3081,), name="mnist", digits=True)


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
        super().__init__(images, labels, name="synthetic", digits=True)


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
    """One sub-folder per class of JPEG/PNG files (ImageNet's layout); classes sorted by name.

    Args:
        root: the folder whose sub-folders are the classes.
        extensions: file endings that count as images (case-insensitive).
    """

    kind = SourceKind.FILES

    def __init__(self, root, extensions=IMAGE_EXTENSIONS, *, mean=IMAGENET_MEAN, std=IMAGENET_STD):
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
            files = sorted(_walk_images(root / cls, exts, visited, real_root))
            if not files:
                raise FileNotFoundError(f"class folder '{root / cls}' has no images with endings {list(exts)}")
            paths += files
            labels += [label] * len(files)
        self.root = root
        self.classes = classes
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        self.paths = paths
        self.labels = np.asarray(labels, dtype=np.int64)
        self.channels = 3
        self.num_classes = len(classes)
        self.mean, self.std = tuple(mean), tuple(std)
        self.name = f"imagefolder:{root.name}"
        self._fingerprint = None

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
                                 f"files={crc:08x}")
        return self._fingerprint

    def default_augmentation(self, train: bool) -> Augmentation:
        return Augmentation.imagenet_train() if train else Augmentation.imagenet_eval()


class DatasetSource(Source):
    """Any map-style torch Dataset returning (PIL image or uint8 tensor (C,H,W) or (H,W), int).
    torch and prefetch backends.

    Every sample comes out with ``channels`` channels (``as_array``). With ``channels=None`` the first
    sample decides: colour → 3, and later grey samples are replicated to RGB (lossless, as ImageFolder
    does); grey → 1, and a later colour sample is an error rather than silently turned grey. Pass
    ``channels=1`` to convert colour samples to grey (Pillow's luma) on purpose, or ``channels=3``.

    Args:
        dataset: the Dataset; ``__getitems__`` is used for batched fetching when it exists.
        mean, std: normalization; None → ImageNet's for 3 channels, 0.5/0.5 otherwise.
        channels: 1 or 3; None → from the first sample (see above).
        num_classes: None → from ``dataset.targets`` when it has them.
    """

    kind = SourceKind.DATASET

    def __init__(self, dataset, *, mean=None, std=None, channels: int | None = None, num_classes=None):
        self.dataset = dataset
        self.name = type(dataset).__name__
        n = len(dataset)
        if n == 0:
            raise ValueError(f"dataset {type(dataset).__name__} is empty")
        self._convert_colour = channels is not None  # RGB → grey only when asked for
        if channels is None:
            channels = 3 if self._channels_of(dataset[0][0]) >= 3 else 1
        elif isinstance(channels, bool) or channels not in (1, 3):
            raise ValueError(f"channels must be 1, 3 or None (from the first sample), got {channels!r}")
        self.channels = channels
        targets = getattr(dataset, "targets", None)
        known = targets is not None and len(targets) == n
        self.labels = check_labels(targets, f"{self.name}.targets") if known \
            else np.full(n, -1, dtype=np.int64)  # unknown until loaded
        self.num_classes = num_classes or (int(self.labels.max()) + 1 if known else 0)
        self.mean = tuple(mean) if mean else (IMAGENET_MEAN if channels == 3 else (0.5,))
        self.std = tuple(std) if std else (IMAGENET_STD if channels == 3 else (0.5,))

    def __len__(self):
        return len(self.dataset)

    def fingerprint(self) -> str:
        # A Dataset's data cannot be read cheaply from here: its type, length and targets.
        t = type(self.dataset)
        known = bool(len(self.labels)) and self.labels[0] >= 0
        return (f"{t.__module__}.{t.__qualname__} n={len(self)}"
                + (f" targets={_crc(self.labels)}" if known else ""))

    def _channels_of(self, image) -> int:
        if hasattr(image, "getbands"):
            return len(image.getbands())
        import torch

        t = torch.as_tensor(image)
        return int(t.shape[0]) if t.dim() == 3 else 1

    def as_array(self, image) -> np.ndarray:
        """One sample's image → uint8 (H, W, ``self.channels``), converted the same way for every sample.

        PIL images: any mode → RGB as ImageFolder does (grey replicated, alpha dropped, 16-bit scaled),
        or → L with Pillow's luma. Tensors: uint8 (C, H, W) or (H, W); grey is replicated to RGB, RGB(A)
        becomes grey exactly as Pillow's convert("L") computes it.
        """
        if hasattr(image, "getbands"):  # PIL image
            from .transforms import to_rgb

            if self.channels == 1 and len(image.getbands()) >= 3 and not self._convert_colour:
                self._refuse_colour(image.mode)
            arr = np.asarray(to_rgb(image) if self.channels == 3 else
                             (image if image.mode == "L" else to_rgb(image).convert("L")))
            return arr[..., None] if arr.ndim == 2 else arr
        import torch

        t = torch.as_tensor(image)
        if t.dtype != torch.uint8:
            raise TypeError(f"{self.name} returned a {t.dtype} tensor; the torch backend expects PIL images "
                            f"or uint8 (C, H, W) tensors")
        if t.dim() == 2:
            t = t[None]
        if t.dim() != 3 or t.shape[0] not in (1, 3, 4):
            raise ValueError(f"{self.name} returned a tensor of shape {tuple(image.shape)}; expected uint8 "
                             f"(C, H, W) with C in (1, 3, 4), or (H, W)")
        arr = t.permute(1, 2, 0).numpy()
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
        """One sample's label → int, refusing what int() would silently change (1.7, NaN, -3, "2")."""
        import torch

        if isinstance(label, torch.Tensor) and label.numel() == 1:
            label = label.item()
        if isinstance(label, np.generic):
            label = label.item()
        if isinstance(label, float) and label.is_integer():
            label = int(label)
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"{self.name}[{index}] returned label {label!r}; labels must be integers >= 0")
        return label

    def _refuse_colour(self, what) -> None:
        raise ValueError(f"{self.name} returned a colour sample ({what}) but its first sample was grey, so "
                         f"the source has 1 channel; pass DatasetSource(dataset, channels=3) to keep colour "
                         f"(grey samples are replicated), or channels=1 to convert colour samples to grey")


def as_source(obj) -> Source:
    """Accept a Source, a map-style torch Dataset, or an ``(images, labels)`` pair of uint8 arrays."""
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2:
        return ArraySource(*obj)
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__"):
        return DatasetSource(obj)
    raise TypeError(f"cannot load from {type(obj).__name__}: pass a fastdata source (MNIST, ImageFolder, "
                    f"SyntheticDigits, ArraySource), a map-style torch Dataset, or (images, labels) arrays")


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
