"""The recipe (``Augmentation``) on the host: its random parameters drawn, in one place for every
backend (``draw_params``), and applied to uint8 (N, H, W, C) arrays with numpy and PIL.

Everything here returns uint8 HWC arrays: float conversion and normalization happen once per batch on
the device (a float sample is 4x the bytes to collate, pin and copy). Random parameters come from a
numpy Generator passed in, seeded per batch, so the result does not depend on which worker ran it.
Photos get the same boxes and flips, decoded from their bytes by ``images.photo``.
"""
from __future__ import annotations

import math
from typing import Literal, NamedTuple

import numpy as np
from PIL import Image

from .config import Augmentation, Crop, Padding, SourceKind

#: ``Augmentation.padding`` → ``np.pad``'s mode. numpy's "reflect" is torch's "reflect" and torchvision's
#: padding_mode="reflect" (the edge pixel is not repeated); numpy's "edge" is torch's "replicate".
NUMPY_PAD_MODE: dict[Padding, Literal["constant", "reflect", "edge"]] = {
    Padding.CONSTANT: "constant", Padding.REFLECT: "reflect", Padding.EDGE: "edge"}


#: RandomResizedCrop's uniforms per sample: torchvision's 10 tries, each an area fraction then a log aspect
#: ratio, then the crop's top and left. Every sample takes all 22 (tries past the first that fits, and the
#: position of a center-crop fallback, go unused) so that a batch is ONE ``rng.random((n, 22))``: boxes are
#: computed for the whole batch with array operations, and a sample drawn alone takes the same numbers it
#: takes inside its batch. (Drawing only what each try needs, torchvision's way, makes sample i's first
#: number depend on every earlier sample's outcome: a scan, one sample at a time, in Python.)
RRC_TRIES = 10
RRC_DRAWS = 2 * RRC_TRIES + 2


def rrc_boxes(u: np.ndarray, sizes: np.ndarray, scale, ratio) -> np.ndarray:
    """RandomResizedCrop's boxes, float64 (n, 4) (top, left, h, w), torchvision's algorithm on uniforms.

    ``u``: (n, RRC_DRAWS or more) uniforms in [0, 1) (columns past RRC_DRAWS are not read); ``sizes``:
    (n, 2) (height, width). The first of the 10 tries whose box fits the image wins; when none fits, the
    central crop of the ratio range's nearest aspect.
    """
    height = sizes[:, 0].astype(np.float64)
    width = sizes[:, 1].astype(np.float64)
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    target = (height * width)[:, None] * (scale[0] + (scale[1] - scale[0]) * u[:, 0:2 * RRC_TRIES:2])
    aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 1:2 * RRC_TRIES:2])
    tries_w = np.rint(np.sqrt(target * aspect))   # rint rounds half to even, as Python's round does
    tries_h = np.rint(np.sqrt(target / aspect))
    fits = (tries_w > 0) & (tries_w <= width[:, None]) & (tries_h > 0) & (tries_h <= height[:, None])
    rows, first = np.arange(len(u)), fits.argmax(axis=1)
    found = fits[rows, first]
    in_ratio = width / height
    narrow, wide = in_ratio < ratio[0], in_ratio > ratio[1]
    h = np.where(found, tries_h[rows, first],
                 np.where(narrow, np.rint(width / ratio[0]), height))
    w = np.where(found, tries_w[rows, first],
                 np.where(wide, np.rint(height * ratio[1]), width))
    # floor(u * k) is uniform over 0..k-1; the minimum guards u*k rounding up to k for u just under 1.
    top = np.where(found, np.minimum(np.floor(u[:, RRC_DRAWS - 2] * (height - h + 1)), height - h), (height - h) // 2)
    left = np.where(found, np.minimum(np.floor(u[:, RRC_DRAWS - 1] * (width - w + 1)), width - w), (width - w) // 2)
    return np.stack([top, left, h, w], axis=1)


def rrc_params(rng: np.random.Generator, height: int, width: int, scale, ratio) -> tuple[int, int, int, int]:
    """One RandomResizedCrop box (top, left, h, w): ``rrc_boxes`` for one sample (takes RRC_DRAWS uniforms)."""
    top, left, h, w = (int(v) for v in rrc_boxes(rng.random((1, RRC_DRAWS)), np.array([[height, width]]),
                                                  scale, ratio)[0])
    return top, left, h, w


def center_boxes(sizes: np.ndarray, size: int, resize: int | None) -> np.ndarray:
    """Boxes float64 (n, 4) (top, left, h, w) in source pixels equal to torchvision's Resize(resize) +
    CenterCrop(size), for (n, 2) (height, width) sizes.

    torchvision rounds the resized size and the crop offset to whole pixels; the box follows the same
    integers, so one PIL resize of the box gives the same sampling positions and filter widths as
    resizing the whole image and then cropping (a fractional box would shift by up to half a pixel).
    """
    resize = resize or size
    height = sizes[:, 0].astype(np.float64)
    width = sizes[:, 1].astype(np.float64)
    tall = width <= height      # the shorter side becomes `resize`; the other is truncated, as int() does
    rw = np.where(tall, resize, np.floor(resize * width / height))
    rh = np.where(tall, np.floor(resize * height / width), resize)
    top, left = np.rint((rh - size) / 2.0), np.rint((rw - size) / 2.0)
    sy, sx = height / rh, width / rw
    return np.stack([top * sy, left * sx, size * sy, size * sx], axis=1)


def center_params(height: int, width: int, size: int, resize: int | None) -> tuple[float, float, float, float]:
    """One center box (top, left, h, w): ``center_boxes`` for one image."""
    top, left, h, w = (float(v) for v in center_boxes(np.array([[height, width]]), size, resize)[0])
    return top, left, h, w


def clamp_box(left, top, bw, bh, width, height):
    """PIL box (l, t, r, b) inside the image: float rounding must not push an edge a hair outside."""
    return (max(0.0, left), max(0.0, top), min(float(width), left + bw), min(float(height), top + bh))


class Params(NamedTuple):
    """One batch's random augmentation parameters (see ``draw_params``)."""

    offsets: np.ndarray | None  # int64 (n, 2) crop offsets (dy, dx) in [0, 2*pad]: crop "translate"
    boxes: np.ndarray | None    # float64 (n, 4) source boxes (top, left, h, w): resizing crops
    flips: np.ndarray           # bool (n,): mirror the sample (all False when hflip is 0)


def draw_params(aug: Augmentation, rng: np.random.Generator, n: int, sizes) -> Params:
    """The batch's augmentation parameters: THE one place the recipe's random numbers are drawn.

    Every backend consumes these instead of drawing, so for one seed each sees the same shifts, boxes
    and flips, and a new backend gets bit-identical augmentation for free. ``sizes``: the source images'
    (height, width), one pair for the whole batch or an (n, 2) array, one per sample.

    The draw order is part of the contract (the determinism tests compare backends pixel for pixel, and
    a checkpoint resumes with the same draws): crop "translate": all n offsets, then n flips; crops
    "none" and "center": n flips; "random_resized": per sample RRC_DRAWS uniforms for its box, then one
    for its flip, all drawn at once as an (n, RRC_DRAWS + 1) array. So for resizing crops, drawing
    sample by sample (n=1, as files are opened one by one) gives exactly the batch's parameters.
    """
    crop, flip = aug.crop, aug.hflip > 0
    offsets: np.ndarray | None = None
    boxes: np.ndarray | None = None
    if crop is Crop.RANDOM_RESIZED:
        # one row per sample: its box's uniforms, then its flip's (see RRC_DRAWS)
        u = rng.random((n, RRC_DRAWS + flip))
        boxes = rrc_boxes(u, _batch_sizes(sizes, n), aug.scale, aug.ratio)
        flip_u = u[:, RRC_DRAWS] if flip else None
    else:
        if crop is Crop.TRANSLATE:
            offsets = translate_offsets(rng, n, aug.pad)
        elif crop.resamples:   # center
            boxes = center_boxes(_batch_sizes(sizes, n), aug.crop_size, aug.resize)
        flip_u = rng.random(n) if flip else None   # after the offsets; the center box draws nothing
    flips = flip_u < aug.hflip if flip_u is not None else np.zeros(n, dtype=bool)
    return Params(offsets, boxes, flips)


def _batch_sizes(sizes, n: int) -> np.ndarray:
    """``sizes`` (one (height, width) or one per sample) as an (n, 2) array."""
    return np.broadcast_to(np.asarray(sizes).reshape(-1, 2), (n, 2))


def sample_box(aug: Augmentation, rng: np.random.Generator, height: int, width: int):
    """(box (top, left, h, w) or None, flip) for one sample: ``draw_params`` for a batch of one."""
    p = draw_params(aug, rng, 1, (height, width))
    box = tuple(float(v) for v in p.boxes[0]) if p.boxes is not None else None
    return box, bool(p.flips[0])


def require_fixed_size(source, aug: Augmentation) -> None:
    """Photos of mixed sizes cannot be stacked into a batch unless the crop fixes the output size.
    Raises ValueError naming the source, the crop and the crops that work."""
    if source.kind is SourceKind.FILES and not aug.crop.fixes_size:
        raise ValueError(f"{source!r} holds photos of different sizes: its augmentation needs a crop "
                         f"that fixes the output size ('random_resized' or 'center'), got "
                         f"crop={aug.crop!r}")


def recipe(source, config) -> Augmentation:
    """The augmentation a loader made with ``config`` applies to ``source``: ``config.augment``, or the
    source's default for ``config.train``. One rule for every backend (and for ``fits``, which has no loader)."""
    return config.augment if config.augment is not None else source.default_augmentation(config.train)


def output_size(source, aug: Augmentation) -> tuple[int, int] | None:
    """(H, W) of every batch a loader of ``source`` with the recipe ``aug`` hands out, where it is known
    before any batch: a size-fixing crop's ``size``; an array source's image size (``none`` and
    ``translate`` keep it); a torch Dataset's first sample's, its transform applied
    (``DatasetSource.sample_size``, when it was read). None otherwise (an image folder's per-sample
    transform: its output is known only once it ran).

    The loader gives it to its ``Normalizer.size``: an empty batch (a rank's share of a short last
    step) then comes out (0, C, H, W) like every other batch, not (0, C, 0, 0).

    Args:
        source: the loader's source.
        aug: the loader's recipe.
    """
    if aug.crop.fixes_size:
        return aug.crop_size, aug.crop_size
    shape = getattr(source, "image_shape", None) if source.kind is SourceKind.ARRAY else \
        getattr(source, "sample_size", None)
    return (int(shape[0]), int(shape[1])) if shape else None


def require_padding_fits(source_or_shape, aug: Augmentation) -> None:
    """Refuse a reflect-padded translation whose ``pad`` is not smaller than the image: a mirror of
    ``pad`` pixels needs ``pad + 1`` rows and columns to mirror. torch's reflect pad refuses it, and
    numpy's and DALI's would reflect again off the far edge, so the backends could not agree.

    ``source_or_shape``: a source (arrays are checked; files always go through a resizing crop, and a
    torch Dataset's size is known only per batch, where ``apply_params`` checks it) or an image shape
    (H, W) / (H, W, C). Raises ValueError naming the image size, the pad, the padding and the ways out.
    Constant and edge padding fit any size.
    """
    if aug.crop is not Crop.TRANSLATE or aug.padding is not Padding.REFLECT:
        return
    if isinstance(source_or_shape, (tuple, list)):
        shape, where = tuple(source_or_shape), "images"
    elif getattr(source_or_shape, "kind", None) is SourceKind.ARRAY:
        shape, where = tuple(source_or_shape.image_shape), repr(source_or_shape)
    else:
        return
    height, width = int(shape[0]), int(shape[1])
    if aug.pad >= min(height, width):
        raise ValueError(f"{where} of {height}x{width} px cannot be padded by pad={aug.pad} with "
                         f"padding='reflect': a reflection needs pad < height and pad < width (at most "
                         f"{min(height, width) - 1} here); lower pad, or use padding='edge' or "
                         f"'constant'")


def mirrored(img: Image.Image, flip: bool) -> np.ndarray:
    """``img`` as a uint8 array, mirrored left-right when ``flip`` (why with PIL's transpose:
    ``images.photo.crop_photo``)."""
    return np.asarray(img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img)


def resize_box(image: np.ndarray, aug: Augmentation, box, flip: bool) -> np.ndarray:
    """One decoded uint8 (H, W, C) array: ``box`` (top, left, h, w) resized to ``aug.size`` with PIL's
    bilinear filter (the files' path, so arrays and photos are resampled alike), then mirrored."""
    h, w, c = image.shape
    top, left, bh, bw = box
    img = Image.fromarray(image[..., 0] if c == 1 else image)
    side = aug.crop_size
    img = img.resize((side, side), Image.Resampling.BILINEAR, box=clamp_box(left, top, bw, bh, w, h))
    out = mirrored(img, flip)
    return out[..., None] if out.ndim == 2 else out


def apply_params(images: np.ndarray, aug: Augmentation, params: Params, *, owned: bool = False) -> np.ndarray:
    """The recipe on a (N, H, W, C) uint8 batch with drawn ``params``: translate and flip with array
    ops (no per-sample Python), resizing crops through PIL per sample. ``owned``: the caller made
    ``images`` for this call (a gather, a stack), so a flip may write into it; otherwise it is copied
    first, since a Dataset's sample (or a source's row) may be a view of its data.

    Translation pads by ``aug.pad`` with ``aug.padding`` (``NUMPY_PAD_MODE``) and crops the original
    size at each sample's offset (dy, dx): output pixel (y, x) is padded pixel (y + dy, x + dx), as in
    torchvision's ``RandomCrop(size, padding=pad, padding_mode=...)`` with top=dy, left=dx.
    """
    if params.boxes is not None:
        if not len(images):
            return np.empty((0, aug.crop_size, aug.crop_size, images.shape[3]), dtype=np.uint8)
        return np.stack([resize_box(im, aug, box, flip) for im, box, flip in
                         zip(images, params.boxes, params.flips)])
    n, h, w, _ = images.shape
    fresh = owned   # whether ``images`` may be written into
    if params.offsets is not None and n:   # an empty batch has nothing to pad (np.pad refuses reflect on it)
        p, off = aug.pad, params.offsets
        require_padding_fits((h, w), aug)   # a torch Dataset's images are first seen here
        padded = np.pad(images, ((0, 0), (p, p), (p, p), (0, 0)), mode=NUMPY_PAD_MODE[aug.padding])
        rows = off[:, 0, None] + np.arange(h)            # (n, h)
        cols = off[:, 1, None] + np.arange(w)            # (n, w)
        images, fresh = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]], True
    flip = params.flips
    if flip.any():
        images = images if fresh else images.copy()   # never into data a flip would mirror for good
        images[flip] = images[flip, :, ::-1]
    return images


def augment_array(image: np.ndarray, aug: Augmentation, rng: np.random.Generator) -> np.ndarray:
    """The recipe for one decoded uint8 (H, W, C) array."""
    return augment_batch(image[None], aug, rng)[0]


def translate_offsets(rng: np.random.Generator, n: int, pad: int) -> np.ndarray:
    """(n, 2) crop offsets (dy, dx) in [0, 2*pad]: the shift is offset - pad."""
    return rng.integers(0, 2 * pad + 1, size=(n, 2))


def augment_batch(images: np.ndarray, aug: Augmentation, rng: np.random.Generator, *,
                  owned: bool = False) -> np.ndarray:
    """Draw the batch's parameters and apply them to a (N, H, W, C) uint8 batch (``owned``: see
    ``apply_params``)."""
    n, h, w, _ = images.shape
    return apply_params(images, aug, draw_params(aug, rng, n, (h, w)), owned=owned)
