"""Shared loader options and the augmentation recipe.

Every backend reads the same two frozen dataclasses, so swapping the backend changes speed and never
what the model sees. Backend-specific options (DALI's thread count, the prefetch depth, ...) are not
here: each backend validates its own.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
CROPS = ("none", "translate", "random_resized", "center")
ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class Augmentation:
    """One augmentation recipe, applied identically by every backend.

    Args:
        crop: ``"none"`` (keep the source size), ``"translate"`` (zero-pad by ``pad`` pixels and take a
            random crop of the original size: shifts of up to ±pad px), ``"random_resized"`` (torchvision's
            RandomResizedCrop with ``scale``/``ratio`` to ``size``), or ``"center"`` (resize the shorter
            side to ``resize``, then center-crop ``size``; the evaluation path for photos).
        size: output side length for ``random_resized`` and ``center``.
        pad: maximum shift in pixels for ``translate``.
        scale, ratio: RandomResizedCrop's area fraction and aspect-ratio ranges.
        resize: shorter side before the center crop.
        hflip: probability of a horizontal flip.
    """

    crop: str = "none"
    size: int | None = None
    pad: int = 0
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    resize: int | None = None
    hflip: float = 0.0

    def __post_init__(self):
        if self.crop not in CROPS:
            raise ValueError(f"unknown crop {self.crop!r}; choose from {list(CROPS)}")
        if self.crop in ("random_resized", "center") and (self.size is None or self.size <= 0):
            raise ValueError(f"crop={self.crop!r} needs a positive size, got size={self.size!r}")
        if self.crop == "center" and self.resize is not None and self.resize < self.size:
            raise ValueError(f"resize={self.resize} is smaller than the center crop size={self.size}")
        if self.crop == "translate" and self.pad <= 0:
            raise ValueError(f"crop='translate' needs pad > 0, got pad={self.pad}")
        if not 0.0 <= self.hflip <= 1.0:
            raise ValueError(f"hflip is a probability in [0, 1], got {self.hflip}")
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {self.ratio}")

    @property
    def is_random(self) -> bool:
        return self.crop in ("translate", "random_resized") or self.hflip > 0

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) of an augmented sample whose source is height x width."""
        if self.crop in ("random_resized", "center"):
            return self.size, self.size
        return height, width

    # Presets: keyword-only factories, as in torchvision's references/classification/presets.py.
    @classmethod
    def none(cls) -> "Augmentation":
        return cls()

    @classmethod
    def digits_train(cls, *, pad: int = 2) -> "Augmentation":
        # Random translation of up to ±2 px and no flip: a flipped digit is another symbol.
        return cls(crop="translate", pad=pad)

    @classmethod
    def imagenet_train(cls, *, size: int = 224) -> "Augmentation":
        return cls(crop="random_resized", size=size, hflip=0.5)

    @classmethod
    def imagenet_eval(cls, *, size: int = 224, resize: int = 256) -> "Augmentation":
        return cls(crop="center", size=size, resize=resize)


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose from float32, bfloat16, float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}") from None


def resolve_device(device) -> torch.device:
    """None → CUDA when available, else CPU. A CUDA device that is not there is an error, not a fallback."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device {str(device)!r} was requested but CUDA is not available here "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); use device='cpu'")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"device {str(device)!r} does not exist; this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s)")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise ValueError(f"device {str(device)!r} is not supported; use 'cpu' or 'cuda[:N]'")
    return dev


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class LoaderConfig:
    """Options shared by every backend. Checked once, here, so each backend can trust them.

    Args:
        batch_size: samples per batch (per rank under DDP).
        train: training (shuffle, drop_last and the source's training augmentation by default) or
            evaluation (sequential order, keep the partial last batch, deterministic preprocessing).
        shuffle, drop_last: None → follow ``train``.
        seed: the order of epoch ``e`` and its random augmentation derive from ``(seed, e)`` alone.
        device: None → CUDA when available, else CPU.
        dtype: dtype of the normalized images: float32, bfloat16 or float16.
        channels_last: images in channels-last memory format.
        augment: the recipe; None → the source's default for ``train``.
        num_workers: worker processes (threads for DALI); None → the usable cores.
        mean, std: per-channel normalization in [0, 1] units; None → the source's statistics.
        rank, world_size: the shard to read; None → from torch.distributed or the torchrun variables.
        on_error: ``"raise"`` an error naming a file that cannot be decoded, or ``"skip"`` it (counted).
        cache_size: side of the square that ``memory`` caches photos at (shorter side resized to it,
            then center-cropped): the evaluation crop 256 → 224 comes out exact.
    """

    batch_size: int = 256
    train: bool = True
    shuffle: bool | None = None
    drop_last: bool | None = None
    seed: int = 0
    device: object = None
    dtype: object = torch.float32
    channels_last: bool = False
    augment: Augmentation | None = None
    num_workers: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    rank: int | None = None
    world_size: int | None = None
    on_error: str = "raise"
    cache_size: int = 256

    def __post_init__(self):
        def fix(name, value):  # frozen: normalized values are written once, here
            object.__setattr__(self, name, value)

        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 0):
            raise ValueError(f"num_workers must be an integer >= 0 (0 loads in the main process), "
                             f"got {self.num_workers!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"unknown on_error {self.on_error!r}; choose from {list(ON_ERROR)}")
        if self.augment is not None and not isinstance(self.augment, Augmentation):
            raise TypeError(f"augment must be a fastdata.Augmentation, got {type(self.augment).__name__}")
        if self.cache_size <= 0:
            raise ValueError(f"cache_size must be positive, got {self.cache_size}")
        for name in ("mean", "std"):
            v = getattr(self, name)
            if v is not None:
                v = tuple(float(x) for x in (v if isinstance(v, (tuple, list)) else (v,)))
                fix(name, v)
        if self.std is not None and any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        fix("shuffle", self.train if self.shuffle is None else bool(self.shuffle))
        fix("drop_last", self.train if self.drop_last is None else bool(self.drop_last))
        fix("dtype", resolve_dtype(self.dtype))
        fix("device", resolve_device(self.device))
        if self.num_workers is None:
            fix("num_workers", usable_cores())
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.rank is not None and self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, world_size={self.world_size})")

    @classmethod
    def from_kwargs(cls, config: "LoaderConfig | None", kwargs: dict) -> tuple["LoaderConfig", dict]:
        """Split ``kwargs`` into config fields (applied over ``config``) and backend-specific options."""
        names = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in kwargs.items() if k in names}
        rest = {k: v for k, v in kwargs.items() if k not in names}
        base = config if config is not None else cls.__new__(cls)
        if config is None:
            return cls(**ours), rest
        return dataclasses.replace(base, **ours), rest

    def replace(self, **changes) -> "LoaderConfig":
        return dataclasses.replace(self, **changes)
