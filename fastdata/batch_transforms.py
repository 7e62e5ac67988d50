"""Batch transforms: augmentation on the normalized device batch, after the recipe, for every backend.

``make_loader(..., batch_transforms=[Cutout(8), MixUp(0.2)])`` runs each transform, in order, on every
batch a backend hands over: images normalized float (N, C, H, W) on the device, labels int64 (N,). Every
backend hands over that same batch, so one implementation serves all of them, on the CPU and on CUDA.

Two kinds of transform are accepted:

- a :class:`BatchTransform` (the ones shipped here, or your own subclass) is called as
  ``t(images, labels, generator)`` and returns ``(images, labels)``. ``generator`` is a
  ``torch.Generator`` on the batch's device, seeded from ``(seed, epoch, batch, rank)`` and the
  transform's position in the list: the same run gives the same draws, a resumed run continues with
  exactly the draws the uninterrupted one made, and adding a transform leaves the others' draws alone.
- any other callable (a torchvision v2 transform that works on batched tensors, a lambda) is called as
  ``t(images)``; labels pass through. It draws from torch's global RNG, so the pipeline runs it under
  ``torch.random.fork_rng`` with the CPU generator and the batch device's generator seeded from the same
  per-batch seed: it is repeatable per batch, and the global RNG (dropout, the model's init) is left as
  it was. A torchvision transform given a batch treats it as one image: it draws once per batch (every
  image gets the same flip or erased box), unlike the per-sample transforms here.

Randomness is drawn on the batch's device (CPU and CUDA generators differ, so the same seed gives
different draws on a CPU and a GPU; on one device it is exact). Per-batch scalars (MixUp's and CutMix's
lambda and box, OneOf's choice) are drawn on the host from the generator's seed (``host_rng``): numbers
the host needs never come back from the GPU, so no transform here synchronizes the host with the device.

Images stay in their dtype (float32/bfloat16/float16) and memory format (contiguous or channels_last).
MixUp and CutMix turn the labels into soft float32 targets (N, num_classes); once one transform in a
pipeline does, every batch of that pipeline has soft labels, so the training loop sees one kind.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from .sampling import seed_for

__all__ = ["BatchTransform", "BatchContext", "BatchPipeline", "check_batch_transforms", "composition_parts", "host_rng",
           "RandomHorizontalFlip", "RandomVerticalFlip", "Cutout", "RandomErasing", "ColorJitter",
           "RandomGrayscale", "MixUp", "CutMix", "OneOf"]

# Tags mixed into derived seeds, so that the device stream, the host stream and OneOf's child streams
# of one transform never coincide.
_STEP, _HOST, _CHILD = 0xBA7C, 0x4057, 0xC41D
# torchvision's luminance weights (rgb_to_grayscale), so grayscale and saturation match it.
_LUMA = (0.2989, 0.587, 0.114)


def _words(seed: int) -> tuple[int, int]:
    # seed_for mixes 32-bit words; a 63-bit seed is split so that no bit of it is lost.
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def host_rng(generator: torch.Generator) -> np.random.Generator:
    """A numpy generator on the host, seeded from ``generator``'s seed (not from its state).

    For per-batch numbers the host needs as Python values (a mixing coefficient, a box, a choice):
    drawing them on a CUDA generator and reading them back would make the host wait for the GPU. The
    seed is host state, so this never synchronizes. It is a stream separate from ``generator``'s own.

    Args:
        generator: the generator a BatchTransform was called with.
    """
    return np.random.default_rng(seed_for(*_words(generator.initial_seed()), _HOST))


def _child(generator: torch.Generator, k: int) -> torch.Generator:
    """A new generator on ``generator``'s device, seeded from its seed and ``k``."""
    g = torch.Generator(device=generator.device)
    g.manual_seed(seed_for(*_words(generator.initial_seed()), k, _CHILD))
    return g


@dataclass(frozen=True)
class BatchContext:
    """What the loader knows and some transforms need: given to :meth:`BatchTransform.bind` once.

    Args:
        num_classes: classes of the source (soft labels are (N, num_classes)).
        device: where the batches are.
        mean, std: the per-channel normalization of the batches in [0, 1] units; None if unknown.
    """

    num_classes: int
    device: torch.device
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


class BatchTransform:
    """Base class of the transforms that get the labels and a generator.

    A subclass implements ``__call__(images, labels, generator) -> (images, labels)``:

    - ``images``: normalized float (N, C, H, W) on the device; return the same shape's N and C, dtype
      and device (the pipeline restores the memory format). Don't modify it in place: the batch may
      share memory with a backend's cache.
    - ``labels``: int64 (N,), or float (N, num_classes) soft targets once a mixing transform ran.
    - ``generator``: a ``torch.Generator`` on the device, seeded for this batch and this transform.
      Draw every random number from it (``torch.rand(n, generator=generator, device=images.device)``)
      or from ``host_rng(generator)`` for host-side scalars; never from the global RNG.

    Keep the object stateless (a frozen dataclass is the easy way): one object serves every batch, is
    shared with DataLoader workers and may be saved with a config. Avoid host syncs (``.item()``,
    ``.tolist()``, boolean-mask indexing, ``nonzero``) on CUDA: they stall the training loop.

    Set the class attribute ``soft_labels = True`` when the transform outputs soft labels.
    """

    soft_labels: ClassVar[bool] = False

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement "
                                  f"__call__(images, labels, generator) -> (images, labels)")

    def bind(self, context: BatchContext) -> "BatchTransform":
        """This transform completed with what only the loader knows (statistics, class count).

        The default returns ``self``. Overrides return a new object and leave ``self`` unchanged.

        Args:
            context: the loader's BatchContext.
        """
        return self


# ---------------------------------------------------------------------------------------- checks
def _probability(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
        raise ValueError(f"{owner}: {name} is a probability in [0, 1], got {value!r}")
    return float(value)


def _positive(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def _range(owner: str, name: str, value, *, low: float = 0.0, high: float = math.inf) -> tuple[float, float]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not ok or not low <= value[0] <= value[1] <= high:
        raise ValueError(f"{owner}: {name} must be a (min, max) pair with {low} <= min <= max <= {high}, "
                         f"got {value!r}")
    return float(value[0]), float(value[1])


def _stats(owner: str, mean, std) -> tuple:
    if (mean is None) != (std is None):
        raise ValueError(f"{owner}: give both mean and std, or neither (the loader's are used)")
    if mean is None:
        return None, None
    mean = tuple(float(m) for m in (mean if isinstance(mean, (tuple, list)) else (mean,)))
    std = tuple(float(s) for s in (std if isinstance(std, (tuple, list)) else (std,)))
    if not all(math.isfinite(v) for v in mean + std) or any(s <= 0 for s in std):
        raise ValueError(f"{owner}: mean/std must be finite and std > 0, got mean={mean} std={std}")
    return mean, std


def _set(obj, name, value):  # frozen dataclasses: normalized values are written once, in __post_init__
    object.__setattr__(obj, name, value)


# ---------------------------------------------------------------------------------------- helpers
def _rand(n: int, generator: torch.Generator, device, *shape: int) -> torch.Tensor:
    return torch.rand((n, *shape), generator=generator, device=device)


def _constant(values, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Per-channel constants (1, C, 1, 1) on ``like``'s device, made by fill kernels: torch.tensor(...,
    device="cuda") would be a blocking host-to-device copy (a sync) on every batch."""
    return torch.stack([like.new_full((), float(v), dtype=dtype) for v in values]).view(1, -1, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) RGB in [0, 1] → (N, 1, H, W) luminance, as torchvision's rgb_to_grayscale."""
    r, g, b = x.unbind(1)
    return r.mul(_LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(1)


def _soft(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """int64 (N,) → float32 (N, num_classes) targets, label-smoothed; soft labels pass through as float32.

    scatter_ instead of F.one_hot: one_hot checks the label range with .item() on the CPU path, and
    neither needs the range from the device.
    """
    if labels.ndim == 2:
        return labels.float()
    out = torch.full((labels.shape[0], num_classes), smoothing / num_classes, dtype=torch.float32,
                     device=labels.device)
    return out.scatter_(1, labels.view(-1, 1), 1.0 - smoothing + smoothing / num_classes)


def _mix(a: torch.Tensor, b: torch.Tensor, lam: float) -> torch.Tensor:
    return a.mul(lam).add_(b, alpha=1.0 - lam)


def _same_count(t, context: BatchContext) -> None:
    """Refuse a transform's own num_classes that differs from the source's, when the loader is built: at
    the first batch a label past it would be an index error (a device-side assert on CUDA), and a wider
    one fails the pipeline's (N, num_classes) check of every batch."""
    if context.num_classes and t.num_classes != context.num_classes:
        raise ValueError(f"{type(t).__name__}(num_classes={t.num_classes}) does not match the source, which "
                         f"has {context.num_classes} classes (soft labels are (N, {context.num_classes})): drop "
                         f"num_classes= (the source's is used), or give the source its true count "
                         f"(DatasetSource(dataset, num_classes=N))")


def _need_stats(t, context: BatchContext):
    if t.mean is not None:
        return t
    if context.mean is None or context.std is None:
        raise ValueError(f"{type(t).__name__} works on un-normalized pixels, so it needs the batches' "
                         f"mean/std: the loader passes them; a BatchPipeline built by hand needs mean=/std= "
                         f"(or give them to {type(t).__name__}(..., mean=, std=))")
    return dataclasses.replace(t, mean=tuple(context.mean), std=tuple(context.std))


def _unnormalize(t, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixels in [0, 1] as float32, mean, std) for a transform holding mean/std."""
    c = images.shape[1]
    mean, std = t.mean, t.std
    if len(mean) == 1:
        mean, std = mean * c, std * c
    if len(mean) != c or len(std) != c:
        raise ValueError(f"{type(t).__name__}: mean/std have {len(mean)}/{len(std)} values but the batch "
                         f"has {c} channel(s)")
    m, s = _constant(mean, images), _constant(std, images)
    return images.float().mul(s).add_(m), m, s


# ---------------------------------------------------------------------------------------- transforms
@dataclass(frozen=True)
class _RandomFlip(BatchTransform):
    """Flip each image along ``_DIM`` with probability ``p`` (drawn per sample)."""

    p: float = 0.5
    _DIM: ClassVar[int] = -1

    def __post_init__(self):
        _set(self, "p", _probability(type(self).__name__, "p", self.p))

    def __call__(self, images, labels, generator):
        flip = _rand(images.shape[0], generator, images.device) < self.p
        return torch.where(flip.view(-1, 1, 1, 1), images.flip(self._DIM), images), labels


@dataclass(frozen=True)
class RandomHorizontalFlip(_RandomFlip):
    """Flip each image left-right with probability ``p`` (drawn per sample).

    Args:
        p: probability of a flip.
    """

    _DIM: ClassVar[int] = -1


@dataclass(frozen=True)
class RandomVerticalFlip(_RandomFlip):
    """Flip each image upside down with probability ``p`` (drawn per sample).

    Args:
        p: probability of a flip.
    """

    _DIM: ClassVar[int] = -2


@dataclass(frozen=True)
class Cutout(BatchTransform):
    """Zero ``holes`` squares of ``size`` x ``size`` pixels in each image (DeVries & Taylor, 2017).

    Zero in normalized space is the channel mean. Each square's center is uniform over the image and the
    square is clipped at the border (as the paper's code), so a hole near an edge is smaller.

    Args:
        size: side of each square in pixels.
        holes: squares per image (they may overlap).
        p: probability that an image gets its holes (drawn per sample).
    """

    size: int
    holes: int = 1
    p: float = 1.0

    def __post_init__(self):
        for name in ("size", "holes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"Cutout: {name} must be an integer >= 1, got {v!r}")
            _set(self, name, int(v))
        _set(self, "p", _probability("Cutout", "p", self.p))

    def __call__(self, images, labels, generator):
        n, _, h, w = images.shape
        if not images.numel():   # an empty batch, maybe (0, C, 0, 0): nothing to cut, no center to draw
            return images, labels
        dev = images.device
        top = torch.randint(0, h, (n, self.holes), generator=generator, device=dev) - self.size // 2
        left = torch.randint(0, w, (n, self.holes), generator=generator, device=dev) - self.size // 2
        apply = _rand(n, generator, dev) < self.p
        ys, xs = torch.arange(h, device=dev), torch.arange(w, device=dev)
        rows = (ys >= top[..., None]) & (ys < top[..., None] + self.size)      # (n, holes, h)
        cols = (xs >= left[..., None]) & (xs < left[..., None] + self.size)    # (n, holes, w)
        mask = (rows[..., :, None] & cols[..., None, :]).any(1) & apply.view(-1, 1, 1)
        return torch.where(mask.unsqueeze(1), 0.0, images), labels


@dataclass(frozen=True)
class RandomErasing(BatchTransform):
    """Erase one random rectangle per image with probability ``p``: torchvision's RandomErasing, drawn
    per sample (torchvision's, given a batch, erases the same box in every image).

    As torchvision: the box's area is ``scale`` x the image's, its aspect ratio log-uniform in
    ``ratio``; up to 10 tries for a box that fits, none erased if none does; the position is uniform.

    Args:
        p: probability that an image is erased.
        scale: (min, max) fraction of the image's area.
        ratio: (min, max) aspect ratio (height / width) of the box.
        value: what the box is filled with, in normalized units: a number (0, the default, is the
            mean), one number per channel, or ``"random"`` (standard-normal noise per pixel, i.e. noise
            of the data's own spread).
    """

    p: float = 0.5
    scale: tuple[float, float] = (0.02, 0.33)
    ratio: tuple[float, float] = (0.3, 3.3)
    value: float | tuple | str = 0.0

    TRIES: ClassVar[int] = 10

    def __post_init__(self):
        _set(self, "p", _probability("RandomErasing", "p", self.p))
        _set(self, "scale", _range("RandomErasing", "scale", self.scale, high=1.0))
        _set(self, "ratio", _range("RandomErasing", "ratio", self.ratio))
        if self.ratio[0] <= 0:
            raise ValueError(f"RandomErasing: ratio must be > 0, got {self.ratio}")
        v = self.value
        if isinstance(v, str):
            if v != "random":
                raise ValueError(f"RandomErasing: value must be a number, one number per channel or "
                                 f"'random', got {v!r}")
        elif isinstance(v, (tuple, list)) and v and all(isinstance(x, numbers.Real) and not isinstance(x, bool)
                                                         for x in v):
            _set(self, "value", tuple(float(x) for x in v))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            _set(self, "value", float(v))
        else:
            raise ValueError(f"RandomErasing: value must be a number, one number per channel or 'random', "
                             f"got {v!r}")

    def __call__(self, images, labels, generator):
        n, c, h, w = images.shape
        dev = images.device
        if isinstance(self.value, tuple) and len(self.value) not in (1, c):
            raise ValueError(f"RandomErasing: value has {len(self.value)} numbers but the batch has {c} "
                             f"channel(s)")
        tries = self.TRIES
        area = torch.empty((n, tries), device=dev).uniform_(*self.scale, generator=generator) * (h * w)
        log_ratio = torch.empty((n, tries), device=dev).uniform_(
            math.log(self.ratio[0]), math.log(self.ratio[1]), generator=generator)
        aspect = log_ratio.exp()
        eh = torch.round(torch.sqrt(area * aspect))   # round half to even, as Python's round()
        ew = torch.round(torch.sqrt(area / aspect))
        fits = (eh < h) & (ew < w)
        # The first try that fits, per sample, without leaving the device.
        first = torch.where(fits, torch.arange(tries, device=dev), tries).amin(1, keepdim=True).clamp_(max=tries - 1)
        eh, ew = eh.gather(1, first).squeeze(1), ew.gather(1, first).squeeze(1)
        apply = (_rand(n, generator, dev) < self.p) & fits.any(1)
        top = (_rand(n, generator, dev) * (h - eh + 1)).floor_()
        left = (_rand(n, generator, dev) * (w - ew + 1)).floor_()
        ys, xs = torch.arange(h, device=dev), torch.arange(w, device=dev)
        rows = (ys >= top[:, None]) & (ys < (top + eh)[:, None])
        cols = (xs >= left[:, None]) & (xs < (left + ew)[:, None])
        mask = (rows[:, :, None] & cols[:, None, :] & apply.view(-1, 1, 1)).unsqueeze(1)
        if self.value == "random":
            noise = torch.randn(images.shape, generator=generator, device=dev, dtype=images.dtype)
            return torch.where(mask, noise, images), labels
        if isinstance(self.value, tuple) and len(self.value) > 1:
            return torch.where(mask, _constant(self.value, images, images.dtype), images), labels
        fill = self.value[0] if isinstance(self.value, tuple) else self.value
        return torch.where(mask, fill, images), labels


def _jitter_range(name: str, value) -> tuple[float, float] | None:
    """torchvision's ColorJitter argument: a number v → (max(0, 1 - v), 1 + v), or (min, max); the
    identity range (1, 1) → None (the op is skipped, as torchvision does)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"ColorJitter: {name} must be >= 0 or a (min, max) pair, got {value!r}")
        lo, hi = max(0.0, 1.0 - value), 1.0 + value
    elif value is None:
        return None
    else:
        lo, hi = _range("ColorJitter", name, value)
    return None if lo == hi == 1.0 else (lo, hi)


@dataclass(frozen=True)
class ColorJitter(BatchTransform):
    """torchvision's ColorJitter (brightness, contrast, saturation), per sample, on normalized batches.

    The images are un-normalized with the loader's mean/std to [0, 1] pixels, jittered exactly as
    torchvision's functional ops do (each clamps to [0, 1]), and normalized again, in float32. Each
    image draws its own factors and its own order of the three operations (torchvision draws a random
    order too). Hue is not offered (it needs an HSV round trip per pixel).

    Args:
        brightness, contrast, saturation: v ≥ 0 draws the factor from [max(0, 1 - v), 1 + v]; a
            (min, max) pair gives the range; 0 or (1, 1) leaves the property alone.
        mean, std: the batches' normalization; None (the default) takes the loader's. Give them only
            to use the transform outside a loader.
    """

    brightness: float | tuple = 0.0
    contrast: float | tuple = 0.0
    saturation: float | tuple = 0.0
    mean: tuple | None = None
    std: tuple | None = None

    def __post_init__(self):
        for name in ("brightness", "contrast", "saturation"):
            _set(self, name, _jitter_range(name, getattr(self, name)))
        mean, std = _stats("ColorJitter", self.mean, self.std)
        _set(self, "mean", mean)
        _set(self, "std", std)

    def bind(self, context):
        return _need_stats(self, context) if self._ops() else self

    def _ops(self):
        return [(k, r) for k, r in enumerate((self.brightness, self.contrast, self.saturation)) if r is not None]

    def __call__(self, images, labels, generator):
        n, c = images.shape[:2]
        dev = images.device
        # Saturation of a one-channel image is the image itself (torchvision returns it unchanged).
        ops = [k for k, _ in self._ops() if not (k == 2 and c == 1)]
        if not ops:
            return images, labels
        if self.mean is None:
            raise ValueError("ColorJitter needs the batches' mean/std: use it in a loader's batch_transforms, "
                             "a BatchPipeline(..., mean=, std=), or give ColorJitter(..., mean=, std=)")
        # The same draws whatever is enabled (an order key and a factor per operation), so turning one
        # operation on does not change the others' factors.
        keys, u = _rand(n, generator, dev, 3), _rand(n, generator, dev, 3)
        ranges = (self.brightness, self.contrast, self.saturation)
        x, m, s = _unnormalize(self, images)
        # Every operation is torchvision's blend, clamp(f * x + (1 - f) * target, 0, 1), with target 0
        # (brightness), the image's mean grey level (contrast) or its grey image (saturation). So each
        # of the k slots of the per-image random order is one pass over the batch with per-image
        # weights, whichever operation each image does there: no per-image loop, and no operation
        # computed for images that do not do it. (Columns are picked by basic indexing: a list index
        # would upload the list to the device, a blocking copy.)
        f = torch.stack([u[:, k] * (ranges[k][1] - ranges[k][0]) + ranges[k][0] for k in ops], 1)
        zero = torch.zeros_like(f[:, 0])
        to_grey = torch.stack([1 - f[:, j] if k == 2 else zero for j, k in enumerate(ops)], 1)
        to_mean = torch.stack([1 - f[:, j] if k == 1 else zero for j, k in enumerate(ops)], 1)
        order = torch.stack([keys[:, k] for k in ops], 1).argsort(1)
        for slot in range(len(ops)):
            pick = order[:, slot:slot + 1]
            out = x * f.gather(1, pick).view(-1, 1, 1, 1)
            if 1 in ops or 2 in ops:
                grey = _gray(x) if c == 3 else x.mean(1, keepdim=True)
                if 2 in ops:
                    out.add_(grey * to_grey.gather(1, pick).view(-1, 1, 1, 1))
                if 1 in ops:
                    out.add_(grey.mean(dim=(1, 2, 3), keepdim=True) * to_mean.gather(1, pick).view(-1, 1, 1, 1))
            x = out.clamp_(0, 1)
        return x.sub_(m).div_(s).to(images.dtype), labels


@dataclass(frozen=True)
class RandomGrayscale(BatchTransform):
    """Turn each RGB image grey with probability ``p`` (drawn per sample), keeping 3 channels.

    Un-normalizes with the loader's mean/std, takes torchvision's luminance (0.2989 R + 0.587 G +
    0.114 B) and normalizes each channel again with its own statistics. One-channel batches pass as
    they are.

    Args:
        p: probability that an image turns grey.
        mean, std: the batches' normalization; None (the default) takes the loader's.
    """

    p: float = 0.1
    mean: tuple | None = None
    std: tuple | None = None

    def __post_init__(self):
        _set(self, "p", _probability("RandomGrayscale", "p", self.p))
        mean, std = _stats("RandomGrayscale", self.mean, self.std)
        _set(self, "mean", mean)
        _set(self, "std", std)

    def bind(self, context):
        return _need_stats(self, context)

    def __call__(self, images, labels, generator):
        n, c = images.shape[:2]
        pick = _rand(n, generator, images.device) < self.p
        if c == 1:
            return images, labels
        if c != 3:
            raise ValueError(f"RandomGrayscale needs RGB (3-channel) or grey batches, got {c} channels")
        if self.mean is None:
            raise ValueError("RandomGrayscale needs the batches' mean/std: use it in a loader's "
                             "batch_transforms, a BatchPipeline(..., mean=, std=), or give mean=/std=")
        x, m, s = _unnormalize(self, images)
        grey = _gray(x).sub(m).div_(s).to(images.dtype)   # (N, 1, H, W) - (1, 3, 1, 1) → (N, 3, H, W)
        return torch.where(pick.view(-1, 1, 1, 1), grey, images), labels


class _Mixing(BatchTransform):
    """MixUp and CutMix: one lambda per batch, each image mixed with its neighbour (the batch rolled by
    one, as torchvision v2 does), labels as soft float32 targets."""

    soft_labels = True

    def _check(self, owner):
        _set(self, "alpha", _positive(owner, "alpha", self.alpha))
        if isinstance(self.label_smoothing, bool) or not isinstance(self.label_smoothing, numbers.Real) \
                or not 0 <= self.label_smoothing < 1:
            raise ValueError(f"{owner}: label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        _set(self, "label_smoothing", float(self.label_smoothing))
        if self.num_classes is not None and (isinstance(self.num_classes, bool)
                                             or not isinstance(self.num_classes, numbers.Integral)
                                             or self.num_classes < 1):
            raise ValueError(f"{owner}: num_classes must be an integer >= 1, got {self.num_classes!r}")

    def bind(self, context):
        if self.num_classes is not None:
            _same_count(self, context)
            return self
        if not context.num_classes:
            # A Dataset with neither .classes nor .targets: its class count is unknown until every label
            # has been read, and soft labels need it now.
            raise ValueError(f"{type(self).__name__} needs the number of classes, and the source does not know "
                             f"it (a Dataset without .classes or .targets): give "
                             f"{type(self).__name__}(..., num_classes=N), or pass "
                             f"fastdata.datasets.DatasetSource(dataset, num_classes=N) to make_loader")
        return dataclasses.replace(self, num_classes=context.num_classes)

    def _targets(self, labels):
        if labels.ndim == 1 and self.num_classes is None:
            raise ValueError(f"{type(self).__name__} needs num_classes to make soft labels: use it in a "
                             f"loader's batch_transforms, a BatchPipeline, or give num_classes=")
        return _soft(labels, self.num_classes, self.label_smoothing)


@dataclass(frozen=True)
class MixUp(_Mixing):
    """MixUp (Zhang et al., 2018): ``lam * x + (1 - lam) * x_rolled``, ``lam ~ Beta(alpha, alpha)`` once
    per batch; labels become the same mix of (label-smoothed) one-hot targets.

    Args:
        alpha: the Beta distribution's parameter (0.2 mixes a little, 1.0 uniformly).
        label_smoothing: ε of the one-hot targets before mixing: ``(1 - ε) one_hot + ε / num_classes``.
            Applied where integer labels become soft; soft labels from an earlier transform are mixed
            as they are.
        num_classes: None (the default) takes the loader's source's.
    """

    alpha: float = 1.0
    label_smoothing: float = 0.0
    num_classes: int | None = None

    def __post_init__(self):
        self._check("MixUp")

    def __call__(self, images, labels, generator):
        targets = self._targets(labels)
        lam = float(host_rng(generator).beta(self.alpha, self.alpha))
        return _mix(images, images.roll(1, 0), lam), _mix(targets, targets.roll(1, 0), lam)


@dataclass(frozen=True)
class CutMix(_Mixing):
    """CutMix (Yun et al., 2019), as torchvision v2: one box per batch, pasted from the neighbouring
    image (the batch rolled by one); the labels mix by the area actually pasted.

    ``lam ~ Beta(alpha, alpha)``; the box has sides ``sqrt(1 - lam)`` x the image's around a uniform
    center, clipped at the border; the original image's weight is then 1 - (pasted area / image area).

    Args:
        alpha: the Beta distribution's parameter.
        label_smoothing: as MixUp's.
        num_classes: None (the default) takes the loader's source's.
    """

    alpha: float = 1.0
    label_smoothing: float = 0.0
    num_classes: int | None = None

    def __post_init__(self):
        self._check("CutMix")

    def __call__(self, images, labels, generator):
        targets = self._targets(labels)
        h, w = images.shape[-2:]
        if not images.numel():   # an empty batch, maybe (0, C, 0, 0): no box to draw in it
            return images, targets
        rng = host_rng(generator)
        lam = float(rng.beta(self.alpha, self.alpha))
        cx, cy = int(rng.integers(w)), int(rng.integers(h))
        r = 0.5 * math.sqrt(1.0 - lam)
        rw, rh = int(r * w), int(r * h)
        x1, x2, y1, y2 = max(cx - rw, 0), min(cx + rw, w), max(cy - rh, 0), min(cy + rh, h)
        out = images.clone()  # keeps the memory format; the input is never written
        out[:, :, y1:y2, x1:x2] = images[:, :, y1:y2, x1:x2].roll(1, 0)
        kept = 1.0 - (x2 - x1) * (y2 - y1) / (w * h)
        return out, _mix(targets, targets.roll(1, 0), kept)


@dataclass(frozen=True)
class _Plain(BatchTransform):
    """A callable that takes only the images (a torchvision v2 transform, a lambda), run repeatably:
    under ``fork_rng`` with the global CPU generator and the device's seeded from the batch's seed."""

    fn: Callable

    def __call__(self, images, labels, generator):
        dev = images.device
        seed = generator.initial_seed()
        cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        # Only this device's generator is forked and seeded: torch.manual_seed would also reseed every
        # other GPU's, outside the fork.
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            for i in cuda:
                torch.cuda.default_generators[i].manual_seed(seed)
            out = self.fn(images)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"returned {type(out).__name__}, not the images tensor; a transform that also "
                            f"takes or returns labels subclasses fastdata.batch_transforms.BatchTransform")
        # torchvision may hand back a tv_tensors.Image: the batch stays a plain tensor.
        return (out if type(out) is torch.Tensor else out.as_subclass(torch.Tensor)), labels


def _as_transform(t) -> BatchTransform:
    return t if isinstance(t, BatchTransform) else _Plain(t)


@dataclass(frozen=True)
class OneOf(BatchTransform):
    """Apply one of ``transforms``, chosen per batch (torchvision's RandomChoice): ``OneOf([MixUp(0.8),
    CutMix(1.0)])`` is timm's and torchvision's references' "mixup or cutmix".

    The choice is drawn on the host (no device sync); only the chosen transform runs. If any choice
    makes soft labels, every batch gets soft labels.

    Args:
        transforms: BatchTransforms or plain image callables.
        weights: relative probabilities, one per transform; None → equal.
    """

    transforms: tuple
    weights: tuple | None = None
    num_classes: int | None = None

    def __post_init__(self):
        ts = self.transforms
        if not isinstance(ts, (tuple, list)) or not ts:
            raise ValueError(f"OneOf needs a non-empty list of transforms, got {ts!r}")
        for i, t in enumerate(ts):
            _check_one(f"OneOf transforms[{i}]", t)
        _set(self, "transforms", tuple(ts))
        if self.weights is not None:
            w = self.weights
            if not isinstance(w, (tuple, list)) or len(w) != len(ts) or any(
                    isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0
                    for x in w) or sum(w) <= 0:
                raise ValueError(f"OneOf: weights must be {len(ts)} numbers >= 0 with a positive sum, got {w!r}")
            _set(self, "weights", tuple(float(x) for x in w))

    @property
    def soft_labels(self) -> bool:  # type: ignore[override]
        return any(_as_transform(t).soft_labels for t in self.transforms)

    def bind(self, context):
        if self.num_classes is not None:
            _same_count(self, context)
        return dataclasses.replace(self, transforms=tuple(_as_transform(t).bind(context) for t in self.transforms),
                                   num_classes=context.num_classes or self.num_classes)

    def __call__(self, images, labels, generator):
        w = np.asarray(self.weights if self.weights is not None else [1.0] * len(self.transforms))
        k = int(host_rng(generator).choice(len(self.transforms), p=w / w.sum()))
        images, labels = _as_transform(self.transforms[k])(images, labels, _child(generator, k))
        if self.soft_labels and labels.ndim == 1:
            if self.num_classes is None:
                raise ValueError("OneOf needs num_classes to make soft labels: use it in a loader's "
                                 "batch_transforms or a BatchPipeline")
            labels = _soft(labels, self.num_classes)
        return images, labels


# ---------------------------------------------------------------------------------------- validation
def _name(t, limit: int = 80) -> str:
    if inspect.isfunction(t) or inspect.ismethod(t):
        return f"function {t.__name__}"   # its repr's address and qualname say less
    text = repr(t).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


_PER_SAMPLE = ("batch transforms get the whole normalized float (N, C, H, W) batch on the device; "
               "per-sample PIL transforms belong on the source, ImageFolder(root, transform=...) or a "
               "torch Dataset, read by the torch/prefetch backends")


#: torchvision transforms that assume pixels in [0, 1] (or uint8): they clamp to that range, threshold
#: in it, or mix channels by luma weights, none of which holds for a normalized batch (measured: v2's
#: ColorJitter(brightness=0.01) changed 69-96% of the pixels). GaussianNoise is refused too unless built
#: with clip=False (it clamps to [0, 1] by default). Geometric transforms and blurs are exact on
#: normalized values (per-channel affine maps commute with them) and pass.
_PIXEL_RANGE = ("ColorJitter", "RandomPhotometricDistort", "RandomAutocontrast", "RandomAdjustSharpness",
                "RandomEqualize", "RandomPosterize", "RandomSolarize", "RandomInvert", "Grayscale",
                "RandomGrayscale", "AutoAugment", "RandAugment", "TrivialAugmentWide", "AugMix")


def _check_torchvision(where: str, t) -> None:
    """Refuse the torchvision transforms that cannot work on fastdata's batches, saying what to do."""
    import torchvision.transforms as v1  # noqa: PLC0415  (only when a torchvision object is given)
    from torchvision.transforms import v2  # noqa: PLC0415

    def classes(*names):
        return tuple(getattr(m, n) for m in (v1, v2) for n in names if hasattr(m, n))

    name = type(t).__name__
    if isinstance(t, classes("Normalize", "ToDtype", "ConvertImageDtype")):
        raise TypeError(f"{where} is torchvision's {name}: fastdata already hands over normalized float "
                        f"batches; drop it and pass mean=/std= (and dtype=) to make_loader")
    if isinstance(t, classes("ToTensor", "PILToTensor", "ToImage", "ToPILImage")):
        raise TypeError(f"{where} is torchvision's {name}, a conversion of PIL images: {_PER_SAMPLE}")
    if isinstance(t, classes(*_PIXEL_RANGE)) or (isinstance(t, classes("GaussianNoise"))
                                                 and getattr(t, "clip", True)):
        fastdata_one = {"ColorJitter": "ColorJitter", "Grayscale": "RandomGrayscale(p=1.0)",
                        "RandomGrayscale": "RandomGrayscale"}.get(name)
        if getattr(t, "hue", None) is not None:
            fastdata_one = None   # fastdata's ColorJitter has no hue
        instead = (f"use fastdata.batch_transforms.{fastdata_one}, which un-normalizes with the loader's "
                   f"mean/std, applies torchvision's operation and normalizes again" if fastdata_one else
                   "run it per sample on the source (ImageFolder(root, transform=...) or a torch Dataset, "
                   "read by the torch/prefetch backends)")
        raise TypeError(f"{where} is torchvision's {name}, which takes images in [0, 1] (or uint8): fastdata's "
                        f"batches are already normalized (about mean 0, std 1 per channel), so its clamping, "
                        f"thresholds and channel mixing would silently change most pixels; {instead}")
    if isinstance(t, classes("MixUp", "CutMix")):
        raise TypeError(f"{where} is torchvision's {name}, which needs the labels: use "
                        f"fastdata.batch_transforms.{'MixUp' if name == 'MixUp' else 'CutMix'} (same "
                        f"semantics, soft labels, draws from the batch's seed)")


def composition_parts(t) -> list[tuple[str, object]]:
    """The transforms ``t`` composes, each with its place (``.transforms[1]``, ``[0]``): a ``.transforms``
    list or ModuleList (torchvision's Compose, RandomApply, RandomChoice, RandomOrder, v1 and v2), else
    an ``nn.Module``'s children (``nn.Sequential``, torchvision's composition for scripted transforms,
    and any module wrapping one). Empty for a leaf.

    Args:
        t: a transform.
    """
    children = getattr(t, "transforms", None)
    if isinstance(children, (list, tuple, torch.nn.ModuleList)):
        return [(f".transforms[{i}]", child) for i, child in enumerate(children)]
    if isinstance(t, torch.nn.Module):
        return [(f"[{n}]" if n.isdigit() else f".{n}", child) for n, child in t.named_children()]
    return []


def _check_composed(where: str, t, seen: set) -> None:
    """``t`` and, recursively, every transform it composes: a refused torchvision transform inside an
    ``nn.Sequential`` or a RandomApply is refused as it is on its own, named by its place."""
    if type(t).__module__.startswith("torchvision"):
        _check_torchvision(where, t)
    seen.add(id(t))
    for place, child in composition_parts(t):
        if id(child) in seen:   # a module reachable twice (shared, or a cycle) is checked once
            continue
        if isinstance(child, BatchTransform):
            raise TypeError(f"{where} holds fastdata's {type(child).__name__} at {place.lstrip('.')}: fastdata "
                            f"batch transforms go directly in the batch_transforms list (OneOf chooses "
                            f"between them), not inside a torchvision container or module")
        _check_composed(f"{where}{place}", child, seen)


def _check_one(where: str, t) -> None:
    if isinstance(t, type):
        raise TypeError(f"{where} is the class {t.__name__}, not a transform: pass an instance, "
                        f"e.g. {t.__name__}(...)")
    if not callable(t):
        raise TypeError(f"{where} is not callable: {_name(t)} ({type(t).__name__}); a batch transform is a "
                        f"fastdata.batch_transforms.BatchTransform or a callable taking the batch of images")
    if isinstance(t, BatchTransform):
        return
    _check_composed(f"{where} ({_name(t)})", t, set())
    if type(t).__module__.startswith("torchvision"):
        return
    try:
        signature = inspect.signature(t)
    except (TypeError, ValueError):  # builtins and C callables may have none: they are tried at the first batch
        return
    try:
        signature.bind(object())
    except TypeError:
        raise TypeError(f"{where} ({_name(t)}) cannot be called with one argument, the images: its signature "
                        f"is {signature}. A plain callable gets only the images; a transform that takes the "
                        f"labels too subclasses fastdata.batch_transforms.BatchTransform and implements "
                        f"__call__(images, labels, generator)") from None


def check_batch_transforms(value) -> tuple:
    """``LoaderConfig.batch_transforms`` as a tuple of transforms; what cannot work is refused here.

    Refused, each with what to do instead: non-callables, classes instead of instances, callables that
    cannot take the images as their one argument, torchvision's Normalize/ToDtype/ConvertImageDtype
    (fastdata already normalizes: pass ``mean=``/``std=``), its transforms that assume pixels in [0, 1]
    (``_PIXEL_RANGE``: colour jitter, grey, autocontrast, equalize, AutoAugment...), its PIL conversions
    (ToTensor, PILToTensor, ToImage, ToPILImage: a per-sample pipeline that belongs on the source), its
    MixUp/CutMix (use fastdata's), and fastdata transforms nested inside a torchvision container.
    Compositions are walked recursively (``composition_parts``: ``nn.Sequential``, Compose, RandomApply,
    RandomChoice, RandomOrder, a module's children), so a refused transform is refused wherever it sits.

    Args:
        value: None, one callable, or a list/tuple of callables.
    """
    if value is None:
        return ()
    if callable(value) and not isinstance(value, (tuple, list)):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"batch_transforms must be a list of callables, got {type(value).__name__}")
    for i, t in enumerate(value):
        _check_one(f"batch_transforms[{i}]", t)
    return tuple(value)


# ---------------------------------------------------------------------------------------- the pipeline
class BatchPipeline:
    """Runs a loader's batch transforms on each batch, with per-batch, per-transform generators.

    ``pipeline(images, labels, seed)`` → ``(images, labels)``. Transform ``i`` of batch ``seed`` draws
    from a generator on the batch's device seeded with ``seed_for(seed, i)``: the same seed gives the
    same output, and inserting a transform changes only the draws of those after it in position.
    Each transform's output is checked (N, C, dtype, device; labels int64 (N,) or float
    (N, num_classes)), and an error names the transform. The images' memory format is restored.

    Args:
        transforms: as ``LoaderConfig.batch_transforms`` (checked by ``check_batch_transforms``).
        num_classes: classes of the source: the width of soft labels.
        device: the device the batches are on.
        mean, std: the batches' per-channel normalization, [0, 1] units (ColorJitter and
            RandomGrayscale need them); None if unknown.
    """

    def __init__(self, transforms, *, num_classes: int, device, mean=None, std=None):
        self.transforms = check_batch_transforms(transforms)
        if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 0:
            raise ValueError(f"num_classes must be an integer >= 0, got {num_classes!r}")
        mean, std = _stats("BatchPipeline", mean, std)
        self.context = BatchContext(int(num_classes), torch.device(device), mean, std)
        self.steps = tuple(_as_transform(t).bind(self.context) for t in self.transforms)
        #: whether every batch's labels come out soft (float32 (N, num_classes)).
        self.soft_labels = any(s.soft_labels for s in self.steps)
        if self.soft_labels and self.context.num_classes < 1:
            raise ValueError(f"batch_transforms {[_name(t, 40) for t in self.transforms]} make soft labels "
                             f"but the source's number of classes is unknown ({num_classes})")

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self):
        return f"BatchPipeline({list(self.transforms)!r})"

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformed batch.

        Args:
            images: normalized float (N, C, H, W) on the device.
            labels: int64 (N,) or float (N, num_classes).
            seed: the batch's seed (an int >= 0, up to 64 bits).
        """
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if images.ndim != 4:
            raise ValueError(f"batch transforms take images (N, C, H, W), got shape {tuple(images.shape)}")
        layout = _layout(images)
        n, c, dtype, device = images.shape[0], images.shape[1], images.dtype, images.device
        lo, hi = _words(int(seed))
        for i, step in enumerate(self.steps):
            generator = torch.Generator(device=device)
            generator.manual_seed(seed_for(lo, hi, i, _STEP))
            try:
                out = step(images, labels, generator)
            except Exception as e:
                if isinstance(step, _Plain):
                    raise RuntimeError(f"{self._where(i)} failed on a batch of {tuple(images.shape)} "
                                       f"{dtype} images on {device}: {type(e).__name__}: {e}. "
                                       f"{_PER_SAMPLE[0].upper()}{_PER_SAMPLE[1:]}") from e
                raise
            images, labels = self._check(i, out, n, c, dtype, device)
        if self.soft_labels and labels.ndim == 1:
            labels = _soft(labels, self.context.num_classes)
        if layout is not None and not images.is_contiguous(memory_format=layout):
            images = images.contiguous(memory_format=layout)
        return images, labels

    def _where(self, i: int) -> str:
        return f"batch_transforms[{i}] ({_name(self.transforms[i])})"

    def _check(self, i, out, n, c, dtype, device):
        where = self._where(i)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"{where} returned {type(out).__name__}; a BatchTransform returns (images, labels)")
        images, labels = out
        if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
            raise TypeError(f"{where} returned ({type(images).__name__}, {type(labels).__name__}); "
                            f"expected two tensors (images, labels)")
        if images.ndim != 4 or images.shape[0] != n or images.shape[1] != c:
            raise ValueError(f"{where} returned images of shape {tuple(images.shape)}; expected ({n}, {c}, H, W): "
                             f"a batch transform keeps the batch size and the channels")
        if images.dtype != dtype:
            raise TypeError(f"{where} returned {images.dtype} images from {dtype} ones; a batch transform "
                            f"keeps the dtype (the loader's dtype=)")
        if images.device != device or labels.device != device:
            raise ValueError(f"{where} returned images on {images.device} and labels on {labels.device}; "
                             f"the batch is on {device} and stays there")
        hard = labels.dtype == torch.int64 and labels.shape == (n,)
        soft = labels.is_floating_point() and labels.shape == (n, self.context.num_classes)
        if not (hard or soft):
            raise ValueError(f"{where} returned labels {labels.dtype} of shape {tuple(labels.shape)}; expected "
                             f"int64 ({n},) or soft float ({n}, {self.context.num_classes})")
        return images, labels


def _layout(images: torch.Tensor):
    """The memory format to hand back: contiguous NCHW, channels_last, or None (neither: left alone)."""
    if images.is_contiguous():
        return torch.contiguous_format
    if images.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None
