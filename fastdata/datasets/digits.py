"""The built-in synthetic digits: a source a small CNN can learn where no dataset can be downloaded."""
from __future__ import annotations

import numpy as np

from .arrays import ArraySource


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
