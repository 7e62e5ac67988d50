"""Shared loader options and the augmentation recipe.

Every backend reads the same two frozen dataclasses, so swapping the backend changes speed and never
what the model sees. Backend-specific options (DALI's thread count, the prefetch depth, ...) are not
here: each backend validates its own.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from enum import Enum

import torch

from . import checks

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class StrChoice(str, Enum):
    """An enum whose members are also their string values, so users keep passing and comparing strings
    (``crop="center"``, ``source.kind == "files"``) while the code branches on members and properties.

    ``str``/``format``/``repr``/``hash`` are the value's: messages read as before, a member and its
    string are interchangeable as dict keys, and pickling (DataLoader workers) is by value-lookup.
    """

    __str__ = str.__str__
    __hash__ = str.__hash__

    def __format__(self, format_spec: str) -> str:
        # As the value, like __str__: f-strings and specs such as ``:>10`` read "center", whatever
        # Enum.__format__ does on this Python version.
        return str.__format__(self, format_spec)

    def __repr__(self):
        return repr(self.value)

    @classmethod
    def parse(cls, value, name: str):
        """``value`` (a member or its string) as a member; anything else is a ValueError naming
        ``name`` and the valid choices (``checks.check_choice``: a string only)."""
        return cls(checks.check_choice(name, value, [m.value for m in cls]))


class SourceKind(StrChoice):
    """What a source holds, which decides how a backend reads it (each backend declares the kinds it
    ``reads``)."""

    ARRAY = "array"        # decoded uint8 pixels in memory
    FILES = "files"        # encoded photos on disk, of mixed sizes
    DATASET = "dataset"    # an arbitrary map-style torch Dataset (Python __getitem__)
    ABSTRACT = "abstract"  # the Source base class itself: no backend reads it


class Crop(StrChoice):
    """The crop of an Augmentation. See Augmentation for what each does."""

    NONE = "none"
    TRANSLATE = "translate"
    RANDOM_RESIZED = "random_resized"
    CENTER = "center"

    @property
    def fixes_size(self) -> bool:
        """The output is ``size`` x ``size`` whatever the source's size (what photos of mixed sizes need)."""
        return self in (Crop.RANDOM_RESIZED, Crop.CENTER)

    @property
    def is_random(self) -> bool:
        """The crop itself draws random numbers (flips aside)."""
        return self in (Crop.TRANSLATE, Crop.RANDOM_RESIZED)

    @property
    def resamples(self) -> bool:
        """The output is interpolated from a box (a resize), not a shifted copy of the source's pixels."""
        return self.fixes_size


class Padding(StrChoice):
    """What ``translate`` shifts in at the border. See Augmentation."""

    CONSTANT = "constant"  # zeros (black), as torchvision's RandomCrop(padding=p) by default
    REFLECT = "reflect"    # mirrored without repeating the edge pixel (numpy/torch "reflect")
    EDGE = "edge"          # the edge pixel repeated (torchvision's "edge", torch's "replicate")


CROPS = tuple(c.value for c in Crop)
PADDINGS = tuple(p.value for p in Padding)
ON_ERROR = ("raise", "skip")


# The integer and flag checks live in ``checks`` (the ground floor, so modules below this one share
# them); they stay importable from here, where earlier code and users found them.
check_integer, check_flag = checks.check_integer, checks.check_flag


def _pair(name: str, value) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a (low, high) pair of numbers, got {value!r}")
    return checks.check_number(f"{name}[0]", value[0]), checks.check_number(f"{name}[1]", value[1])


def check_unit_stats(name: str, values, where: str = "") -> None:
    """Refuse a mean/std in 0-255 units where [0, 1] units are expected: every batch would be garbage
    (a mean of 125 shifts each pixel by -125 standard deviations), and nothing else would say so."""
    if any(v > 1 for v in values):
        raise ValueError(f"{name}={tuple(values)}{where} is above 1: mean/std are in [0, 1] units (pixel/255, "
                         f"torchvision's convention); for 0-255 units (FFCV's, DALI's) pass scale=255, or "
                         f"divide by 255")


def check_pixel_stats(name: str, values, where: str = "") -> None:
    """Refuse a mean/std in [0, 1] units where ``scale=255`` says 0-255 units: divided by 255 again, they
    would give batches in the thousands (a std of 0.25 grey levels). The mirror of ``check_unit_stats``.
    A mean of all zeros (no shift) is the same in both units, so only a std or a non-zero mean tells."""
    if all(v <= 1 for v in values) and any(v != 0 for v in values):
        raise ValueError(f"{name}={tuple(values)}{where} is at most 1 with scale=255: scale=255 means mean/std in "
                         f"0-255 pixel units (FFCV's, DALI's convention), and these are fractions; for [0, 1] "
                         f"units (pixel/255, torchvision's) drop scale=255, or multiply by 255")


def check_reals(name: str, value) -> tuple[float, ...]:
    """``value`` (one number or a sequence) as a non-empty tuple of finite floats; errors name ``name``
    and the index."""
    if hasattr(value, "tolist") and hasattr(value, "ndim"):
        # Statistics a user measured (x.mean(axis=(0, 1, 2)) / 255) come as a numpy array or a tensor:
        # refused as "must be a number, got array([...])" where a list of the same numbers passed.
        value = value.tolist()
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not values:
        raise ValueError(f"{name} must hold one value per channel, got {value!r}")
    return tuple(checks.check_number(f"{name}[{i}]" if len(values) > 1 else name, v)
                 for i, v in enumerate(values))


@dataclass(frozen=True)
class Augmentation:
    """One augmentation recipe, applied identically by every backend.

    Args:
        crop: ``"none"`` (keep the source size), ``"translate"`` (pad by ``pad`` pixels as ``padding`` says and
            take a random crop of the original size: shifts of up to ±pad px), ``"random_resized"`` (torchvision's
            RandomResizedCrop with ``scale``/``ratio`` to ``size``), or ``"center"`` (resize the shorter
            side to ``resize``, then center-crop ``size``; the evaluation path for photos).
        size: output side length for ``random_resized`` and ``center``.
        pad: maximum shift in pixels for ``translate``.
        padding: what ``translate`` shifts in at the border: ``"constant"`` (zeros), ``"reflect"``
            (mirrored, as CIFAR recipes use; needs pad < the image's height and width) or ``"edge"``
            (the edge pixel repeated).
        scale, ratio: RandomResizedCrop's area fraction and aspect-ratio ranges.
        resize: shorter side before the center crop.
        hflip: probability of a horizontal flip.
    """

    crop: Crop = Crop.NONE
    size: int | None = None
    pad: int = 0
    padding: Padding = Padding.CONSTANT
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    resize: int | None = None
    hflip: float = 0.0

    def __post_init__(self):
        def fix(name, value):  # frozen: normalized values are written once, here
            object.__setattr__(self, name, value)

        fix("crop", Crop.parse(self.crop, "crop"))  # users pass strings; the code reads the enum
        for name in ("size", "resize"):
            if getattr(self, name) is not None:
                fix(name, check_integer(name, getattr(self, name), minimum=1))
        fix("pad", check_integer("pad", self.pad, minimum=0))
        fix("padding", Padding.parse(self.padding, "padding"))
        fix("hflip", checks.check_number("hflip", self.hflip, minimum=0, maximum=1))   # a probability
        fix("scale", _pair("scale", self.scale))
        fix("ratio", _pair("ratio", self.ratio))
        if self.crop.fixes_size and self.size is None:
            raise ValueError(f"crop={self.crop!r} needs a positive size, got size={self.size!r}")
        if self.crop is Crop.CENTER and self.resize is not None and self.resize < self.size:
            raise ValueError(f"resize={self.resize} is smaller than the center crop size={self.size}")
        if self.crop is Crop.TRANSLATE and self.pad <= 0:
            raise ValueError(f"crop='translate' needs pad > 0, got pad={self.pad}")
        if self.padding is not Padding.CONSTANT and self.crop is not Crop.TRANSLATE:
            raise ValueError(f"padding={self.padding!r} only applies to crop='translate', got "
                             f"crop={self.crop!r}")
        # A field the crop does not read would be ignored silently: the recipe would not be the one meant.
        ignored = [f"{name}={getattr(self, name)!r} only applies to crop={crop!r}"
                   for name, crop, unset in (("pad", "translate", 0), ("resize", "center", None),
                                             ("scale", "random_resized", (0.08, 1.0)),
                                             ("ratio", "random_resized", (3 / 4, 4 / 3)))
                   if getattr(self, name) != unset and self.crop.value != crop]
        if self.size is not None and not self.crop.fixes_size:
            ignored.append(f"size={self.size} only applies to crop='random_resized' or 'center'")
        if ignored:
            raise ValueError(f"{'; '.join(ignored)}, got crop={self.crop.value!r}: drop it, or choose that crop")
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"scale must satisfy 0 < lo <= hi <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < lo <= hi, got {self.ratio}")

    @property
    def is_random(self) -> bool:
        """Whether the recipe draws random numbers (a random crop or a flip)."""
        return self.crop.is_random or self.hflip > 0

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) of an augmented sample whose source is height x width."""
        if self.crop.fixes_size:
            return self.crop_size, self.crop_size
        return height, width

    @property
    def crop_size(self) -> int:
        """``size`` where the crop fixes the output size (``random_resized``, ``center``: set, checked
        when the recipe is built); a ValueError for a crop that keeps the source's size."""
        if self.size is None:
            raise ValueError(f"crop={self.crop!r} keeps the source's size: it has no crop size")
        return self.size

    # Presets: keyword-only factories, as in torchvision's references/classification/presets.py.
    @classmethod
    def none(cls) -> "Augmentation":
        """No augmentation: the source's pixels as they are."""
        return cls()

    @classmethod
    def digits_train(cls, *, pad: int = 2) -> "Augmentation":
        """Training recipe for small digits: random shifts of up to ``pad`` px."""
        # Random translation of up to ±2 px and no flip: a flipped digit is another symbol.
        return cls(crop=Crop.TRANSLATE, pad=pad)

    @classmethod
    def cifar_train(cls, *, pad: int = 4, padding: str = "reflect", hflip: float = 0.5) -> "Augmentation":
        """Training recipe for small colour images (CIFAR-10/100, 32x32): pad ``pad`` px by ``padding``,
        take a random crop of the original size, flip horizontally with probability ``hflip``."""
        return cls(crop=Crop.TRANSLATE, pad=pad, padding=Padding.parse(padding, "padding"), hflip=hflip)

    @classmethod
    def imagenet_train(cls, *, size: int = 224) -> "Augmentation":
        """Training recipe for photos: RandomResizedCrop to ``size`` and a horizontal flip half the time."""
        return cls(crop=Crop.RANDOM_RESIZED, size=size, hflip=0.5)

    @classmethod
    def imagenet_eval(cls, *, size: int = 224, resize: int | None = None) -> "Augmentation":
        """Evaluation recipe for photos: shorter side to ``resize``, center crop ``size``. ``resize``
        defaults to ``size`` in the standard proportion, ``round(size * 256 / 224)`` (256 for 224, 73
        for 64): a fixed 256 made ``size=64`` a small patch of the middle of each photo."""
        if resize is None:
            resize = max(size, round(size * 256 / 224)) if isinstance(size, int) else size
        return cls(crop=Crop.CENTER, size=size, resize=resize)


#: torch DataLoader keywords a user moving to make_loader passes out of habit, and where each job went.
DATALOADER_KEYWORDS = {
    "pin_memory": "drop it: on CUDA the batches are pinned (and normalized on the device) already",
    "pin_memory_device": "drop it: the loader's device= decides where batches go",
    "collate_fn": "batches are collated by the backend (uint8, normalized on the device): change a batch in "
                  "batch_transforms=[...], a sample in the source's transform",
    "sampler": "the order is the loader's (shuffle=, seed=, drop_last=; sharded by rank under torchrun and "
               "resumable): for a subset pass torch.utils.data.Subset(dataset, ids) as the source",
    "batch_sampler": "the batches are the loader's (batch_size=, shuffle=, seed=, drop_last=)",
    "worker_init_fn": "the workers' random generators are seeded per batch from (seed, epoch, batch): give seed=",
    "generator": "give seed=: the order and every draw follow from it",
    "in_order": "batches always come in order (a resumed run gets the same ones)",
}

#: Keywords users reach for to set the image size, and where it is set (the training and evaluation
#: recipes take it; ``like=`` carries it to an evaluation loader).
_SIZE_HINT = ("the size is the augmentation recipe's: augment=Augmentation.imagenet_train(size=S) to train, "
              "Augmentation.imagenet_eval(size=S) to evaluate (like=train_loader takes it from there)")

#: Every refused keyword with a hint (``unknown_options``).
OPTION_HINTS = {**DATALOADER_KEYWORDS, **dict.fromkeys(
    ("size", "image_size", "img_size", "input_size", "crop_size", "resolution"), _SIZE_HINT)}


def unknown_options(owner: str, unknown: list, known: str) -> str:
    """The refusal of options ``owner`` does not take, with where each torch DataLoader keyword's job went
    (and where the image size is set, for the names users give it)."""
    hints = "".join(f"; {k}: {OPTION_HINTS[k]}" for k in unknown if k in OPTION_HINTS)
    return f"{owner} got unknown option(s) {unknown}; {known} and the shared ones are LoaderConfig's fields{hints}"


def resolve_dtype(dtype) -> torch.dtype:
    """A torch dtype or its name (float32/bfloat16/float16 and aliases) as the torch dtype; an unknown
    one is a ValueError listing the choices."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; choose from float32, bfloat16, float16")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}") from None


def _local_rank() -> int | None:
    """torchrun's LOCAL_RANK (this process's GPU on its node), or None outside torchrun."""
    return checks.env_integer("LOCAL_RANK", None, minimum=0)


def rank_gpu(local: int, count: int, device="cuda") -> int:
    """The index of the GPU that the process with ``LOCAL_RANK=local`` trains on, among the ``count``
    it sees: ``local`` where it sees every GPU of its node (torchrun's usual set-up), 0 where each
    process sees only its own GPU (``CUDA_VISIBLE_DEVICES`` set per rank, as SLURM's
    ``--gpus-per-task`` and per-rank launchers do: ``device_count()`` is 1 whatever LOCAL_RANK is).
    Anything else is more processes than GPUs, refused. ``device`` is what was asked, for the error."""
    if local < count:
        return local
    if count == 1 and os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return 0
    raise RuntimeError(
        f"LOCAL_RANK={local} asks for cuda:{local} (device={str(device)!r} under torchrun means the rank's "
        f"own GPU) but this process sees {count} CUDA device(s); run at most {count} processes per node "
        f"(torchrun --nproc-per-node), or give each process its own GPU with CUDA_VISIBLE_DEVICES")


def resolve_device(device) -> torch.device:
    """None → CUDA when available, else CPU. A CUDA device that is not there is an error, not a fallback.

    Under torchrun (LOCAL_RANK set), None and ``"cuda"`` mean this rank's GPU (``rank_gpu``:
    ``cuda:LOCAL_RANK``, or ``cuda:0`` where each process sees only its own): before the process group
    exists ``torch.cuda.current_device()`` is 0 on every rank, so all ranks would share GPU 0.
    An explicit ``"cuda:N"`` is kept as given.
    """
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        device = "cuda"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', an int or a torch.device, "
                        f"got {device!r} ({type(device).__name__})")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device {str(device)!r} was requested but CUDA is not available here "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); use device='cpu'")
        count = torch.cuda.device_count()
        if dev.index is None:
            local = _local_rank()
            if local is not None:
                return torch.device("cuda", rank_gpu(local, count, device))
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= count:
            raise RuntimeError(f"device {str(device)!r} does not exist; this machine has "
                               f"{count} CUDA device(s)")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise ValueError(f"device {str(device)!r} is not supported; use 'cpu' or 'cuda[:N]'")
    return dev


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), whatever other processes share them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """This process's share of the usable cores: the default for workers, cache workers, DALI threads.

    torchrun starts LOCAL_WORLD_SIZE processes per node, each of which would otherwise take every core
    (8 ranks on 16 cores: 128 DataLoader workers plus 128 DALI threads, all thrashing).
    """
    return max(1, usable_cores() // checks.env_integer("LOCAL_WORLD_SIZE", 1, minimum=1))


@dataclass(frozen=True)
class LoaderConfig:
    """Options shared by every backend. Checked once, here, so each backend can trust them.

    Args:
        batch_size: samples per batch (per rank under DDP).
        train: training (shuffle, drop_last and the source's training augmentation by default) or
            evaluation (sequential order, keep the partial last batch, deterministic preprocessing).
        shuffle, drop_last: None → follow ``train``.
        seed: the order of epoch ``e`` and its random augmentation derive from ``(seed, e)`` alone.
        device: None → CUDA when available (under torchrun this rank's GPU, ``cuda:LOCAL_RANK``), else CPU.
        dtype: dtype of the normalized images: float32, bfloat16 or float16.
        channels_last: images in channels-last memory format.
        augment: the recipe; None → the source's default for ``train``.
        num_workers: worker processes (threads for DALI); None → this process's share of the usable
            cores (``default_workers``: the usable cores ÷ ``LOCAL_WORLD_SIZE``, at least 1).
        mean, std: per-channel normalization in [0, 1] units (``scale=255``: in 0-255 pixel units, FFCV's
            and DALI's convention); None → the source's statistics.
        scale: the units of ``mean``/``std``: 1 (fractions, torchvision's convention) or 255. A mean or
            std above 1 with ``scale=1`` is refused: it is 0-255 units by mistake, and would give garbage;
            so is one with every value at most 1 (a non-zero mean, or a std) with ``scale=255``: fractions.
        batch_transforms: callables applied to every normalized batch on the device, after the recipe,
            by every backend (``fastdata.batch_transforms``: Cutout, ColorJitter, MixUp, ...; or a
            torchvision v2 transform that takes batched tensors). Their random draws derive from
            ``(seed, epoch, batch)``, so runs and resumes repeat exactly.
        rank, world_size: the shard to read; None → from torch.distributed or the launcher's variables
            (``RANK``, else ``NODE_RANK`` × ``LOCAL_WORLD_SIZE`` + ``LOCAL_RANK``, and ``WORLD_SIZE``).
        even_batches: with ``drop_last=False`` under several ranks, pad the epoch's last step as
            DistributedSampler does (with samples from the epoch's start) so every rank's last batch has
            the same size: collectives that need equal shapes (``accelerator.gather_for_metrics``, an
            all-gather of predictions) then work. Where accelerate is imported, each pass sets
            ``loader.remainder``, how many samples of the last step are real, which accelerate's
            ``gather_for_metrics`` reads to drop the padding (without accelerate, nothing sets it).
        on_error: ``"raise"`` an error naming a file that cannot be decoded, or ``"skip"`` it (counted).
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
    scale: float = 1
    batch_transforms: tuple = ()
    even_batches: bool = False

    def __post_init__(self):
        # The values as given, before defaults are derived: replace() starts from these, so that
        # replace(train=False) re-derives shuffle/drop_last from the new train instead of keeping the
        # training config's derived True (evaluation would shuffle and drop its last batch).
        object.__setattr__(self, "_given", {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        self._check_counts()
        self._check_flags()
        self._check_recipe()
        self._check_stats()
        self._check_shard()
        self._derive_defaults()

    def _fix(self, name: str, value) -> None:
        """Frozen: a normalized value is written once, by __post_init__'s checks."""
        object.__setattr__(self, name, value)

    def _check_counts(self) -> None:
        """batch_size, num_workers and seed as ints in range."""
        self._fix("batch_size", check_integer("batch_size", self.batch_size, minimum=1))
        if self.num_workers is not None:   # 0 loads in the main process
            self._fix("num_workers", check_integer("num_workers", self.num_workers, minimum=0))
        # seed_for() mixes 32-bit words: seeds 2**32 apart would give identical orders.
        self._fix("seed", check_integer("seed", self.seed, minimum=0, maximum=2 ** 32 - 1))

    def _check_flags(self) -> None:
        """The booleans (shuffle/drop_last may stay None until derived) and on_error's choice."""
        self._fix("train", check_flag("train", self.train))
        self._fix("shuffle", check_flag("shuffle", self.shuffle, optional=True))
        self._fix("drop_last", check_flag("drop_last", self.drop_last, optional=True))
        self._fix("channels_last", check_flag("channels_last", self.channels_last))
        self._fix("even_batches", check_flag("even_batches", self.even_batches))
        checks.check_choice("on_error", self.on_error, ON_ERROR)

    def _check_recipe(self) -> None:
        """augment is an Augmentation (or None); batch_transforms are batched callables."""
        if self.augment is not None and not isinstance(self.augment, Augmentation):
            raise TypeError(
                f"augment must be a fastdata.Augmentation (crop/pad/flip recipes every backend runs), got "
                f"{type(self.augment).__name__}. Other augmentation: batch_transforms=[...] runs batched "
                f"tensor transforms on the device for every backend (fastdata.batch_transforms, or "
                f"torchvision v2 transforms that take batches); per-sample PIL transforms go on the "
                f"source, ImageFolder(root, transform=...), and run on the torch/prefetch backends")
        from .batch_transforms import check_batch_transforms  # here: it imports torch only, not config

        self._fix("batch_transforms", check_batch_transforms(self.batch_transforms))

    def _check_stats(self) -> None:
        """scale, then mean/std: numbers in the units scale says, kept in [0, 1] units."""
        if isinstance(self.scale, bool) or self.scale not in (1, 255):
            raise ValueError(f"scale (the units of mean/std) must be 1 or 255, got {self.scale!r}")
        self._fix("scale", int(self.scale))
        for name in ("mean", "std"):
            if getattr(self, name) is not None:
                self._fix(name, check_reals(name, getattr(self, name)))
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values is not None:
                if self.scale == 1:
                    check_unit_stats(name, values)
                else:
                    check_pixel_stats(name, values)
                    self._fix(name, tuple(v / 255.0 for v in values))
        if self.std is not None and any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        if self.mean is not None and self.std is not None and len(self.mean) != len(self.std) \
                and 1 not in (len(self.mean), len(self.std)):
            raise ValueError(f"mean and std must have one value per channel, got {len(self.mean)} and "
                             f"{len(self.std)} values")

    def _check_shard(self) -> None:
        """rank and world_size, each optional, and the rank inside the world."""
        if self.world_size is not None:
            self._fix("world_size", check_integer("world_size", self.world_size, minimum=1))
        if self.rank is not None:
            self._fix("rank", check_integer("rank", self.rank, minimum=0))
        if self.rank is not None and self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, world_size={self.world_size})")

    def _derive_defaults(self) -> None:
        """What None means: shuffle/drop_last follow train; the dtype, device and workers resolved."""
        self._fix("shuffle", self.train if self.shuffle is None else self.shuffle)
        self._fix("drop_last", self.train if self.drop_last is None else self.drop_last)
        self._fix("dtype", resolve_dtype(self.dtype))
        self._fix("device", resolve_device(self.device))
        if self.num_workers is None:
            self._fix("num_workers", default_workers())

    @classmethod
    def from_kwargs(cls, config: "LoaderConfig | None", kwargs: dict) -> tuple["LoaderConfig", dict]:
        """Split ``kwargs`` into config fields (applied over ``config``) and backend-specific options."""
        if config is not None and not isinstance(config, LoaderConfig):
            raise TypeError(f"config must be a fastdata.LoaderConfig, got {type(config).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in kwargs.items() if k in names}
        rest = {k: v for k, v in kwargs.items() if k not in names}
        if config is None:
            return cls(**ours), rest
        return config.replace(**ours), rest


    @property
    def given(self) -> dict:
        """The fields as the caller gave them (name → value), before defaults were derived: what
        ``replace`` starts from, and what ``make_loader(like=..., config=...)`` reads as the caller's
        choices."""
        return dict(vars(self)["_given"])   # set in __post_init__, not a field (fields() lists options)

    def replace(self, **changes) -> "LoaderConfig":
        """A copy with ``changes``. Defaults derived from other fields (shuffle and drop_last from
        ``train``, the device, num_workers) are derived again unless they were given explicitly.
        Use this, not ``dataclasses.replace``, which copies the derived values."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"LoaderConfig has no field(s) {unknown}; its fields are {sorted(names)}")
        given = getattr(self, "_given", None) or {n: getattr(self, n) for n in names}
        return type(self)(**{**given, **changes})
