"""The backend table: one row per backend, read by ``make_loader``, ``auto``, the doctor and the benchmarks.

A row (``BackendSpec``) says where the backend's class lives (imported lazily, so a missing extra only
hurts its user), the import that must work, how to install it, ``auto``'s preference and the device
types ``auto`` may pick it on. What a backend *reads* and whether it *fits* a source are asked of the
class itself (``reads``, ``fits``), so adding a backend is its own file plus one ``register`` call::

    from fastdata import registry
    registry.register("mine", "mypkg.loader:MyLoader", needs="mypkg", install="pip install mypkg")

A backend whose package does not import stays in the table (the doctor prints its install hint) but not
in ``available_backends()``.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from .checks import check_choice
from .config import LoaderConfig, check_pixel_stats, check_reals, unknown_options
from .datasets import as_source
from .errors import MissingDependency
from .sampling import distributed_info

if TYPE_CHECKING:   # the backends are imported by name when one is asked for (lazy, see load)
    from .backends.base import Loader

log = logging.getLogger("fastdata")

DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class BackendSpec:
    """One backend's row.

    Args:
        name: what ``make_loader(backend=...)`` takes.
        target: ``"package.module:Class"`` (imported on first use) or the class itself.
        needs: a module that must import for the backend to work (None: nothing beyond fastdata's own).
        install: the command that installs ``needs``, shown when it does not import.
        order: ``auto``'s preference, lowest first (ties keep the table's order).
        devices: device types ``auto`` may pick the backend on; a user can still name it on any device.
        overlaps_on_cuda: the backend prepares the next batch while a CUDA step runs (worker processes,
            threads, a side stream); ``fastdata bench`` predicts its training rate as overlapped.
    """

    name: str
    target: str | type
    needs: str | None = None
    install: str | None = None
    order: int = 100
    devices: tuple[str, ...] = DEVICE_TYPES
    overlaps_on_cuda: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name == "auto":
            raise ValueError(f"backend name must be an identifier other than 'auto', got {self.name!r}")
        if isinstance(self.target, str) and self.target.count(":") != 1:
            raise ValueError(f"backend {self.name!r}: target must be 'package.module:Class' or a class, "
                             f"got {self.target!r}")
        bad = sorted(set(self.devices) - set(DEVICE_TYPES))
        if bad:
            raise ValueError(f"backend {self.name!r}: unknown device type(s) {bad}; choose from "
                             f"{list(DEVICE_TYPES)}")

    @property
    def available(self) -> bool:
        """Whether ``needs`` imports here."""
        return _importable(self.needs)

    @property
    def unavailable_reason(self) -> str | None:
        """Why the backend cannot be used here and how to fix it (None when it can): what the doctor
        prints, and the reason a test parametrized over the table skips it with."""
        if self.available:
            return None
        return f"backend {self.name!r} needs {self.needs}, which does not import here; install: {self.install}"

    def load(self) -> type[Loader]:
        """The backend class; MissingDependency (with the install hint) when ``needs`` does not import."""
        if self.needs is not None:
            try:
                importlib.import_module(self.needs)
            except Exception as e:  # ImportError, or a broken install raising anything at import
                raise MissingDependency(f"backend {self.name!r} needs {self.needs}, which does not import "
                                        f"here ({type(e).__name__}: {e}); install it with: "
                                        f"{self.install or 'its package'}") from e
        return self._class()

    def option_names(self) -> frozenset[str] | None:
        """The backend's own options, read off its class even where ``needs`` does not import (a module
        that imports its package lazily, like DALI's, still declares them); None when the class itself
        cannot be imported here."""
        try:
            return frozenset(self._class().options)
        except Exception:  # a third-party module that imports its missing package at the top
            return None

    def _class(self) -> type[Loader]:
        if not isinstance(self.target, str):
            return self.target
        module, cls = self.target.split(":")
        try:
            found = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError) as e:   # a typo in the row, or its package's own import failing
            detail = f"{type(e).__name__}: {e}" if isinstance(e, ImportError) else str(e)
            raise ImportError(f"backend {self.name!r}: cannot import {self.target!r} ({detail}); fix the "
                              f"target given to registry.register, or unregister({self.name!r})") from e
        return _check_loader_class(self.name, found)


def _check_loader_class(name: str, cls) -> type[Loader]:
    """``cls``, if it is a backend class (a subclass of ``Loader``); TypeError naming the row otherwise."""
    from .backends.base import Loader  # at the call: the table is read before any backend is imported

    if not (isinstance(cls, type) and issubclass(cls, Loader)):
        raise TypeError(f"backend {name!r}: target {getattr(cls, '__name__', cls)!s} is not a subclass of "
                        f"fastdata.backends.base.Loader (which holds the contract; a backend implements its "
                        f"_epoch, see examples/custom_backend.py)")
    return cls


_DALI_INSTALL = "pip install nvidia-dali-cuda120  (or: pip install 'fastdata[dali]')"

#: name → row, in the order backends are listed (argparse choices, benchmarks, the doctor).
#: ``order``: memory first (no decoding after its one-time cache, when that fits), then DALI (nvJPEG
#: decodes on the GPU) and prefetch (copies overlap compute) on CUDA only, torch last: it reads every
#: source kind and always fits. benchmarks/results holds the measurements behind this order.
BACKENDS: dict[str, BackendSpec] = {}


def register(name: str, target: str | type, *, needs: str | None = None, install: str | None = None,
             order: int | None = None, devices: str | tuple[str, ...] = DEVICE_TYPES,
             overlaps_on_cuda: bool = False, replace: bool = False) -> BackendSpec:
    """Add a backend row; returns it. ``order`` None puts the backend after every existing one in
    ``auto``'s preference; ``devices`` may be one device type (``"cuda"``). See ``BackendSpec`` for the
    other arguments.

    A name already in the table is refused unless ``replace`` (a row of one's own called ``torch``
    would silently stand in for the built-in for the whole process), except for the same target again
    (a script's ``register()`` run twice); so is a name that differs from one only in case.
    """
    if isinstance(devices, str):
        devices = (devices,)
    if isinstance(target, type):
        _check_loader_class(name, target)
    same_case = [n for n in BACKENDS if n.lower() == str(name).lower() and n != name]
    if same_case:
        raise ValueError(f"backend {name!r} differs from {same_case[0]!r} only in case; choose a name that is "
                         f"not one of {choices()} in other letters")
    held = BACKENDS.get(name)
    if held is not None and not replace and _target_name(held.target) != _target_name(target):
        raise ValueError(f"backend {name!r} is registered already ({_target_name(held.target)}); register "
                         f"{_target_name(target)} under another name, or pass replace=True to replace it")
    if order is None:
        order = max((s.order for s in BACKENDS.values() if s.name != name), default=0) + 10
    spec = BackendSpec(name, target, needs=needs, install=install, order=order, devices=tuple(devices),
                       overlaps_on_cuda=overlaps_on_cuda)
    BACKENDS[name] = spec
    return spec


def _target_name(target: str | type) -> str:
    """``package.module:Class`` for a row's target (a class re-imported by a second run of a script is
    another object with the same name: the same backend)."""
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def unregister(name: str) -> None:
    """Remove a row (tests that register a backend of their own remove it again)."""
    check_choice("backend", name, BACKENDS)
    del BACKENDS[name]


register("torch", "fastdata.backends.torch_loader:TorchLoader", order=40, overlaps_on_cuda=True)
register("memory", "fastdata.backends.memory:MemoryLoader", order=10)
register("prefetch", "fastdata.backends.torch_loader:PrefetchLoader", order=30, devices=("cuda",),
         overlaps_on_cuda=True)
register("dali", "fastdata.backends.dali:DaliLoader", needs="nvidia.dali.plugin.pytorch", install=_DALI_INSTALL,
         order=20, devices=("cuda",), overlaps_on_cuda=True)


@lru_cache(maxsize=None)
def _importable(module: str | None) -> bool:
    if module is None:
        return True
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def clear_import_cache() -> None:
    """Forget which packages imported (tests that fake a missing package call it before and after)."""
    _importable.cache_clear()


def choices() -> list[str]:
    """Every name ``make_loader`` knows: ``auto`` and each row, installed or not."""
    return ["auto", *BACKENDS]


def spec(name: str) -> BackendSpec:
    """The row of backend ``name``; ValueError listing the choices for an unknown one."""
    if name not in BACKENDS:   # the message lists choices(), "auto" included: what make_loader takes
        raise ValueError(f"unknown backend {name!r}; choose from {choices()}")
    return BACKENDS[name]


def specs() -> list[BackendSpec]:
    """Every row in table order, installed or not (the doctor shows the missing ones' install hints)."""
    return list(BACKENDS.values())


def by_preference() -> list[BackendSpec]:
    """Every row in ``auto``'s preference order (``order``, then table order)."""
    return sorted(BACKENDS.values(), key=lambda s: s.order)  # sorted is stable: ties keep table order


def available_backends() -> list[str]:
    """Backend names usable here: ``auto`` plus those whose packages import. Feeds argparse ``choices``."""
    return ["auto"] + [s.name for s in BACKENDS.values() if s.available]


def backend_class(name: str) -> type[Loader]:
    """The class of backend ``name``: ValueError for an unknown name, MissingDependency (saying how to
    install it) when its package does not import."""
    return spec(name).load()


def all_options() -> set[str]:
    """The union of every row's options, installed or not: what ``auto`` accepts. A DALI option passed
    to ``auto`` where DALI is missing is not a typo; auto simply does not pass it to the backend it picks."""
    known: set[str] = set()
    for s in BACKENDS.values():
        known |= s.option_names() or set()
    return known


def choose(source, config, options: dict | None = None) -> tuple[str, str]:
    """(backend name, reason) that ``auto`` picks for ``source`` under ``config`` from this table."""
    from .backends.auto import choose as choose_from

    return choose_from(source, config, options, by_preference())


def make_loader(source, backend: str = "auto", *, config: LoaderConfig | None = None, indices=None,
                like=None, quiet: bool = False, **kwargs):
    """Build a loader of ``(images, labels)`` batches on the device.

    Args:
        source: a fastdata source (MNIST, ImageFolder, SyntheticDigits, ArraySource), a torchvision
            dataset (ImageFolder/DatasetFolder → its files; CIFAR10/100, MNIST-like → its arrays), a
            ``Subset`` of one, any other map-style torch Dataset (torch/prefetch backends), or an
            ``(images, labels)`` pair of uint8 arrays.
        backend: one of ``available_backends()``; ``auto`` picks the fastest that fits and says which
            in one line (logger ``fastdata``, WARNING) unless ``quiet``.
        config: a LoaderConfig; keyword arguments that name its fields override it.
        indices: read only these samples of ``source`` (``source.subset(indices)``); sharding, order
            and resume then apply to the subset.
        like: a training loader this one evaluates against: its device, dtype, layout, batch size,
            seed and, above all, its normalization statistics (a test set must be normalized with
            the training set's mean/std, not its own), with ``train=False``; after a training crop to
            ``s`` (``imagenet_train(size=s)``, or a crop to ``s`` in the training source's torchvision
            transform), the evaluation crop at ``s`` too
            (``imagenet_eval(size=s, resize=s*256/224)``). Keyword arguments and ``config`` fields still override,
            except a config's ``train`` (True by default, not by choice): only a ``train=True`` keyword
            makes it a training loader.
        quiet: do not report ``auto``'s choice.
        **kwargs: LoaderConfig fields (batch_size, device, train, ...) and backend-specific options.
    """
    check_choice("backend", backend, choices())
    src = as_source(source)
    if indices is not None:
        src = src.subset(indices)
    if like is not None:
        config, kwargs = _like(like, src, config, kwargs)
    cfg, options = LoaderConfig.from_kwargs(config, kwargs)
    if backend == "auto":
        # auto passes each backend only the options it knows, so a misspelt one (prefetch_factr=4) must
        # be refused here, against every backend's options, or it would vanish without a word.
        known = all_options()
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(unknown_options("backend 'auto'", unknown, f"the backends' options are {sorted(known)}"))
        backend, reason = choose(src, cfg, options)
        # WARNING, so it shows without any logging set up (Python's last-resort handler prints it):
        # which backend ran decides the speed, and an INFO line nobody saw explained nothing. One
        # line per job: rank 0 speaks.
        if not quiet and distributed_info(cfg.rank, cfg.world_size)[0] == 0:
            log.warning("fastdata: backend 'auto' picked %r: %s (make_loader(..., quiet=True) hides this)",
                        backend, reason)
        options = {k: v for k, v in options.items() if k in backend_class(backend).options}
    return backend_class(backend)(src, cfg, **options)


def _like(train_loader, source, config, kwargs) -> tuple:
    """(config, kwargs) for an evaluation loader built ``like=train_loader`` (see ``make_loader``)."""
    base = getattr(train_loader, "config", None)
    if not isinstance(base, LoaderConfig):
        raise TypeError(f"like= takes a fastdata loader (the training loader), got {type(train_loader).__name__}")
    theirs = list(getattr(train_loader, "classes", []) or [])
    mine = list(getattr(source, "classes", None) or [])
    # Names: strings, or tuples of synonyms (torchvision's ImageNet); 0 .. n-1 name nothing to compare.
    if theirs and mine and any(isinstance(c, (str, tuple)) for c in theirs + mine) and mine != theirs[:len(mine)]:
        first = next(i for i, (a, b) in enumerate(zip(mine, theirs + [None] * len(mine))) if a != b)
        raise ValueError(f"the classes of {source!r} differ from the training loader's: class {first} is "
                         f"{mine[first]!r} here and {theirs[first] if first < len(theirs) else None!r} there; "
                         f"label {first} would mean two different things (give both folders the same "
                         f"class sub-folders)")
    # The training loader's resolved statistics (its config's, or its source's), not this source's.
    inherited = {"device": train_loader.device, "dtype": base.dtype, "channels_last": base.channels_last,
                 "batch_size": base.batch_size, "seed": base.seed, "num_workers": base.num_workers,
                 "mean": tuple(train_loader.mean), "std": tuple(train_loader.std), "train": False,
                 "rank": base.rank, "world_size": base.world_size, "on_error": base.on_error}
    if config is not None:
        # An explicit config is the caller's choice of everything it sets; it still takes the training
        # statistics (unless it names its own) and the training loader's device. And it evaluates:
        # like= promises an evaluation loader, and a config's train is True by default, not by choice
        # (a dataclass cannot tell the two apart), so only a train= keyword overrides it.
        given = config.given
        inherited = {k: inherited[k] for k in ("mean", "std", "device", "train")
                     if k == "train" or given.get(k) is None}
    else:
        given = {}
    caller = {**given, **kwargs}   # what the caller set: its config's fields, then the keywords over them
    recipe = None if kwargs.get("train") is True else _eval_recipe(train_loader, source, caller)
    if recipe is not None:
        kwargs = {**kwargs, "augment": recipe}
    taken = [k for k in ("mean", "std") if k in inherited and k not in kwargs]
    scale = caller.get("scale", 1)
    if taken and not isinstance(scale, bool) and scale == 255:
        # The inherited statistics are in [0, 1] units, converted once already; the caller's scale=255
        # would divide them by 255 again. So every statistic goes over in [0, 1] units with scale=1, the
        # caller's own divided by 255 exactly as LoaderConfig divides them: eval batches of the same
        # data then equal the training loader's.
        for name in {"mean", "std"} - set(taken):
            if caller.get(name) is None:   # mean=None said: the source's own, in [0, 1] units
                continue
            values = check_reals(name, caller[name])
            check_pixel_stats(name, values)
            kwargs = {**kwargs, name: tuple(v / 255.0 for v in values)}
        kwargs = {**kwargs, "scale": 1}
    return config, {**{k: v for k, v in inherited.items() if k not in kwargs}, **kwargs}


def _eval_recipe(train_loader, source, caller: dict):
    """The evaluation recipe of a ``like=`` loader whose training loader crops to a size
    (``imagenet_train(size=s)``) its source's own evaluation recipe would not give: the center crop at
    ``s``, the shorter side resized in proportion (the source's evaluation ratio, else ``256 / 224``,
    as torchvision's references and timm's ``crop_pct`` keep it), or the training loader's own center
    crop. Photos evaluated at 224 after training at 32, and arrays (CIFAR trained upscaled to 64) at
    their own 32: another resolution than the model learnt (a ViT's position embeddings refuse it).
    The training size may also be set inside the training source's per-sample transform (a torchvision
    ``Compose`` with ``RandomResizedCrop(96)``: ``output_size``).
    None: the source's default stands (the caller gave ``augment``, the source has a per-sample
    transform, the training loader keeps the size, or the sizes already agree)."""
    from .config import Augmentation, Crop
    from .datasets.sample_transforms import output_size, rescales

    theirs = getattr(train_loader, "augment", None)
    if caller.get("augment") is not None or not isinstance(theirs, Augmentation):
        return None
    if getattr(source, "sample_transform", None) is not None:
        return None
    if theirs.crop.fixes_size:
        size = theirs.crop_size
    else:
        # The size set inside the training source's per-sample transform (RandomResizedCrop(96) in a
        # torchvision Compose): evaluated at 224 otherwise, the model's 96 unknown to the recipe.
        trained = getattr(getattr(train_loader, "source", None), "sample_transform", None)
        at = output_size(trained) if trained is not None else None
        # A crop that rescales nothing (RandomCrop(32, padding=4) on CIFAR) trained at the images' own
        # scale: an ImageNet-style resize and center crop would zoom the test images and cut their borders.
        if at is None or at[0] != at[1] or not rescales(trained):
            return None
        size, theirs = at[0], Augmentation.imagenet_train(size=at[0])
    mine = source.default_augmentation(False)
    if mine.crop.fixes_size and mine.crop_size == size:
        return None
    if theirs.crop is Crop.CENTER and theirs.resize is not None:
        return Augmentation.imagenet_eval(size=size, resize=theirs.resize)
    ratio = mine.resize / mine.crop_size if mine.crop is Crop.CENTER and mine.resize is not None else 256 / 224
    return Augmentation.imagenet_eval(size=size, resize=max(size, round(size * ratio)))
