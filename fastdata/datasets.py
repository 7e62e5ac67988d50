"""Data sources. A source says what the samples are; backends decide how to load them fast.

Three kinds, which backends treat differently:
- ``ArraySource`` (MNIST, SyntheticDigits, any uint8 array): pixels already in memory.
- ``ImageFolder``: encoded files on disk (JPEG/PNG), one sub-folder per class.
- ``DatasetSource``: any map-style torch Dataset returning (PIL image or uint8 tensor, int).
"""
from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np

from .config import Augmentation

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


class Source:
    """Common attributes: ``labels`` (int64 array), ``num_classes``, ``channels``, ``mean``/``std``."""

    kind = "abstract"
    name = "source"
    labels: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int
    num_classes: int

    def __len__(self) -> int:
        return len(self.labels)

    def default_augmentation(self, train: bool) -> Augmentation:
        return Augmentation.none()

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

    kind = "array"

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
        # Writable and contiguous: torch.from_numpy shares it without a copy, and warns on read-only
        # buffers (read_idx's frombuffer is one).
        images = np.ascontiguousarray(images)
        self.images = images if images.flags.writeable else images.copy()  # (N, H, W, C)
        self.labels = labels.astype(np.int64)
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

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image."""
        return self.images.shape[1:]

    def default_augmentation(self, train: bool) -> Augmentation:
        return Augmentation.digits_train() if (train and self.digits) else Augmentation.none()

    def __getitem__(self, i):
        import torch

        return torch.from_numpy(self.images[i]), int(self.labels[i])


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
    expected = int(np.prod(shape))
    if len(data) - header < expected:
        raise ValueError(f"IDX file '{path}' is truncated: header says {shape} = {expected} bytes, "
                         f"body has {len(data) - header}")
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
            raise ValueError(f"'{paths[1]}' holds label {labels.max()}; MNIST labels are 0-9")
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
    3: [[(0.25, 0.15), (0.72, 0.14), (0.45, 0.44), (0.64, 0.52), (0.73, 0.7), (0.62, 0.87), (0.42, 0.91), (0.25, 0.82)]],
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
class ImageFolder(Source):
    """One sub-folder per class of JPEG/PNG files (ImageNet's layout); classes sorted by name.

    Args:
        root: the folder whose sub-folders are the classes.
        extensions: file endings that count as images (case-insensitive).
    """

    kind = "files"

    def __init__(self, root, extensions=IMAGE_EXTENSIONS, *, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"image folder '{root}' does not exist")
        if not root.is_dir():
            raise NotADirectoryError(f"image folder '{root}' is not a directory")
        exts = tuple(e.lower() for e in extensions)
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise FileNotFoundError(f"image folder '{root}' has no class sub-folders "
                                    f"(expected root/<class>/<image>{exts[0]})")
        paths, labels = [], []
        for label, cls in enumerate(classes):
            files = sorted(
                os.path.join(dp, f)
                for dp, _, fs in os.walk(root / cls, followlinks=True)
                for f in fs if f.lower().endswith(exts) and not f.startswith("."))
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

    def default_augmentation(self, train: bool) -> Augmentation:
        return Augmentation.imagenet_train() if train else Augmentation.imagenet_eval()


class DatasetSource(Source):
    """Any map-style torch Dataset returning (PIL image or uint8 tensor (C,H,W), int). torch backend only.

    Args:
        dataset: the Dataset; ``__getitems__`` is used for batched fetching when it exists.
        mean, std: normalization; None → ImageNet's for 3 channels, 0.5/0.5 otherwise.
        channels: channels of the samples (probed from the first one when None).
    """

    kind = "dataset"

    def __init__(self, dataset, *, mean=None, std=None, channels: int | None = None, num_classes=None):
        self.dataset = dataset
        n = len(dataset)
        if n == 0:
            raise ValueError(f"dataset {type(dataset).__name__} is empty")
        if channels is None:
            first = dataset[0][0]
            channels = len(first.getbands()) if hasattr(first, "getbands") else int(first.shape[0])
            channels = 3 if channels >= 3 else 1
        self.channels = channels
        targets = getattr(dataset, "targets", None)
        self.labels = np.asarray(targets, dtype=np.int64) if targets is not None and len(targets) == n \
            else np.full(n, -1, dtype=np.int64)  # unknown until loaded
        self.num_classes = num_classes or (int(self.labels.max()) + 1 if targets is not None else 0)
        self.mean = tuple(mean) if mean else (IMAGENET_MEAN if channels == 3 else (0.5,))
        self.std = tuple(std) if std else (IMAGENET_STD if channels == 3 else (0.5,))
        self.name = type(dataset).__name__

    def __len__(self):
        return len(self.dataset)


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
