"""Per-sample transforms (torchvision's) and torchvision datasets: what they output, what the recipe may add."""
from __future__ import annotations

import numpy as np

from ..config import Augmentation, Crop
from .base import Source

_FLOAT_FIX = ("drop ToDtype/Normalize/ToTensor from the transform and pass mean=/std= to make_loader: "
              "fastdata keeps batches uint8 until the device and normalizes there")
#: What a Dataset's sample image may be, and the fix for a float one.
EXPECTED_IMAGES = ("the torch backend expects PIL images, uint8 (C, H, W) tensors or uint8 (H, W, C) arrays. "
                    f"If the dataset's transform ends in ToTensor, ToDtype or Normalize: {_FLOAT_FIX}")

#: The backends that run a source's per-sample transform, and those that run none (they augment whole
#: batches with the loader's ``Augmentation``, on the device or in DALI). Each backend class says which it
#: is (``Loader.runs_sample_transforms``); a source refuses its transform when it is made, before any
#: backend is named, so its message names both (tests/test_datasets.py holds these to the classes).
PER_SAMPLE_BACKENDS = ("torch", "prefetch")
BATCH_BACKENDS = ("memory", "dali")


def recipe_choices() -> str:
    """The ``Augmentation`` presets and fields, read from the class, for a message that sends a user to
    ``augment=Augmentation(...)``."""
    import dataclasses

    presets = [f"Augmentation.{n}()" for n, v in vars(Augmentation).items() if isinstance(v, classmethod)]
    fields = [f.name for f in dataclasses.fields(Augmentation)]
    fields[fields.index("crop")] = f"crop (one of {[c.value for c in Crop]})"
    return f"presets {', '.join(presets)}; or fields {', '.join(fields)}"


def batch_backends_fix(route: str) -> str:
    """What memory and dali need instead of a per-sample transform: ``route`` (how the data reaches them
    without one), then the loader's recipe."""
    return (f"Backends {' and '.join(map(repr, BATCH_BACKENDS))} run no per-sample transform (they augment "
            f"whole batches, on the device or in DALI): for them {route}, and pass augment=Augmentation(...) "
            f"with mean=/std= to make_loader ({recipe_choices()}), plus batch_transforms=[...] for batched "
            f"ops the recipe lacks")


def float_fix(route: str) -> str:
    """The fix for a transform that ends with float images, for every backend: the per-sample way (drop
    the float steps) and memory/dali's (``route``, then the recipe)."""
    per_sample = " or ".join(map(repr, PER_SAMPLE_BACKENDS))
    return (f"drop ToDtype/Normalize/ToTensor from the transform and pass mean=/std= to make_loader for backend "
            f"{per_sample}, which run per-sample transforms ('auto' picks one of them for a source with a "
            f"transform). {batch_backends_fix(route)}. fastdata keeps batches uint8 until the device and "
            f"normalizes there")


_FLOAT_MAKERS = {"ToTensor", "Normalize"}        # always float out
_DTYPE_SETTERS = {"ToDtype", "ConvertImageDtype"}  # float or uint8 out, by their dtype


#: torchvision containers that run their steps only sometimes, or in a random order.
_RANDOM_CONTAINERS = ("RandomApply", "RandomChoice", "RandomOrder")


def _walk(transform, before: frozenset, leaf) -> frozenset:
    """Every state ``transform`` may leave, from the states that may come in (``before``); ``leaf(step,
    states)`` gives a step's that is not a composition. Compositions are walked (``composition_parts``:
    Compose, nn.Sequential, a module's children, in order); RandomApply may run or skip its steps,
    RandomChoice runs one of them and RandomOrder runs them in any order, so each contributes every
    possible end."""
    from itertools import islice, permutations

    from ..batch_transforms import composition_parts

    parts = [child for _, child in composition_parts(transform)]
    if not parts:
        return leaf(transform, before)
    kind = type(transform).__name__ if type(transform).__module__.startswith("torchvision.") else None

    def in_order(steps, states):
        for step in steps:
            states = _walk(step, states, leaf)
        return states

    if kind == "RandomApply":
        return before | in_order(parts, before)
    if kind == "RandomChoice":
        return frozenset().union(*(_walk(p, before, leaf) for p in parts))
    if kind == "RandomOrder":   # every order (720 for 6 steps; more steps: the first 720 orders)
        return frozenset().union(*(in_order(order, before) for order in islice(permutations(parts), 720)))
    return in_order(parts, before)


def _outcomes(transform, before: frozenset) -> frozenset:
    """What ``transform`` may leave, from what may come in (``_walk``): a set of (floats, the step that
    made them) pairs, (False, None) for uint8/PIL."""
    def leaf(step, states):
        made = _makes_float(step)
        return states if made is None else frozenset({(made, type(step).__name__)})

    return _walk(transform, before, leaf)


def output_size(transform, size: tuple | None = None) -> tuple[int, int] | None:
    """The (height, width) every image leaves ``transform`` at, where its steps fix it (a crop to a size,
    a resize to a (height, width)), else None (a resize of the shorter side alone, or no such step: the
    photos keep sizes of their own). ``size``: what comes in. Compositions are walked as ``_outcomes``
    walks them (``_walk``); a step that runs only sometimes, or in a random order, counts where every
    outcome agrees.

    Steps are known by their ``size`` and their class name (``...Crop...``, ``...Resize...``), not only
    torchvision's own classes: timm's ``RandomResizedCropAndInterpolation`` and ``ResizeKeepRatio``
    follow torchvision's fields. ``like=`` evaluates at this size (``registry._eval_recipe``)."""
    ends = _walk(transform, frozenset({size}), lambda step, at: frozenset(_step_size(step, s) for s in at))
    return next(iter(ends)) if len(ends) == 1 else None


def rescales(transform) -> bool:
    """Whether a step of ``transform`` rescales the images (a ``...Resize...`` class: ``Resize``,
    ``RandomResizedCrop``). A crop alone (CIFAR's ``RandomCrop(32, padding=4)``) keeps the images at
    their own scale, and so does their evaluation: ``like=`` reads a training size from a transform
    that rescales only."""
    from ..batch_transforms import composition_parts

    parts = [child for _, child in composition_parts(transform)]
    return any(rescales(p) for p in parts) if parts else "Resize" in type(transform).__name__


def _step_size(step, size):
    """``output_size`` of one step that is not a composition."""
    name, given = type(step).__name__, getattr(step, "size", None)
    if given is None or not ("Crop" in name or "Resize" in name) or isinstance(given, bool):
        # A resize to None (torchvision 2's max_size alone) leaves sizes of the photos' own.
        return None if "Resize" in name and "Crop" not in name and hasattr(step, "size") else size
    if isinstance(given, int):
        given = [given]
    try:
        values = [int(v) for v in given]
    except (TypeError, ValueError):
        return None
    if len(values) == 2:
        return values[0], values[1]
    if len(values) == 1:
        # A crop to one number is square; a resize to one number sets the shorter side only.
        return (values[0], values[0]) if "Crop" in name else None
    return None


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


def check_sample_transform(transform, where: str = "the source", route: str | None = None):
    """Refuse, before any batch, a per-sample transform that cannot work here: not callable, or one
    whose steps may leave the images float (ToTensor, Normalize or ToDtype(float) with no later
    conversion back to uint8), wherever they sit: in a Compose, an ``nn.Sequential``, or a RandomApply/
    RandomChoice/RandomOrder that runs them only in some draws. Returns the transform. The refusal names
    the fix for every backend: no backend is named yet when a source is made.

    Args:
        transform: the callable.
        where: how the error names the source holding it.
        route: how memory and dali, which run no per-sample transform, read the data without it (None:
            drop the transform from ``where``).
    """
    if not callable(transform):
        raise TypeError(f"transform of {where} must be callable, got {transform!r}")
    ends = _outcomes(transform, frozenset({(False, None)}))
    floating = sorted(maker for is_float, maker in ends if is_float)
    if floating:
        when = "" if all(is_float for is_float, _ in ends) else " in some of its random draws"
        raise TypeError(f"the transform of {where} ends with float images ({', '.join(floating)}){when}: "
                        f"{float_fix(route or f'drop the transform from {where}')}")
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
        from ..images.photo import to_rgb

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
    raise ValueError(f"{source!r} has its own per-sample transform ({describe(transform)}), which is its "
                     f"augmentation; augment={aug} would apply a second recipe after it. Pass augment=None "
                     f"(the default), or drop the transform and express it as augment=Augmentation(...) plus "
                     f"batch_transforms=[...]")


def describe(transform, limit: int = 120) -> str:
    """A one-line, bounded repr of a transform (Compose's repr spans lines)."""
    import re

    text = re.sub(r"\(\s+", "(", re.sub(r"\s+\)", ")", " ".join(repr(transform).split())))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fastdata_samples(dataset) -> bool:
    """Whether every sample of ``dataset`` comes from a fastdata source whose ``source[i]`` is an (H, W, C)
    tensor (``hwc_samples``: arrays and image folders, not a DatasetSource, which hands out its dataset's
    own samples): such a source, or torch's ``Subset``/``ConcatDataset`` of them, nested."""
    from torch.utils.data import ConcatDataset, Subset

    if isinstance(dataset, Source):
        return dataset.hwc_samples
    if isinstance(dataset, ConcatDataset):
        return all(fastdata_samples(d) for d in dataset.datasets)
    if isinstance(dataset, Subset):
        return fastdata_samples(dataset.dataset)
    return False


TV_FOLDERS = ("ImageFolder", "DatasetFolder")
TV_CIFAR = ("CIFAR10", "CIFAR100")
TV_MNIST = ("MNIST", "FashionMNIST", "KMNIST", "EMNIST", "USPS")
#: Colour arrays kept (N, C, H, W) with their labels in ``labels`` (not ``targets``).
TV_CHW = ("SVHN", "STL10")
TV_LOADERS = ("default_loader", "pil_loader", "accimage_loader")


def torchvision_names(obj) -> list[str]:
    """Names of the torchvision.datasets classes ``obj`` is an instance of, nearest first. Read from the
    class's MRO, so torchvision is never imported here and a user's subclass counts as its base."""
    return [c.__name__ for c in type(obj).__mro__ if c.__module__.startswith("torchvision.datasets")]


def own_transforms(obj) -> list[str]:
    """``name=value`` for each per-sample transform a torchvision dataset carries."""
    found = [f"{a}={describe(getattr(obj, a))}" for a in ("transform", "target_transform")
             if getattr(obj, a, None) is not None]
    if not found and getattr(obj, "transforms", None) is not None:
        found.append(f"transforms={describe(obj.transforms)}")
    return found


def readable_kind(obj) -> str | None:
    """The torchvision class by which ``as_source`` reads ``obj`` as files or arrays (so every backend
    reads it) once it carries no transform of its own, or None: ImageFolder/DatasetFolder with PIL's
    loader, CIFAR, the MNIST family and USPS with ``data`` and ``targets``, SVHN and STL10 with ``data``
    and ``labels`` (STL10 without unlabeled samples) (QMNIST only with ``compat=True``:
    its targets are rows of 8 fields, whose first is the digit its ``__getitem__`` then returns), none
    with a ``__getitem__`` of its own (only calling it gives what the user means)."""
    names = torchvision_names(obj)
    kind = next((n for n in names if n in TV_FOLDERS + TV_CIFAR + TV_MNIST + TV_CHW), None)
    if kind is None or own_getitem(obj):
        return None
    if "QMNIST" in names:   # with compat (its default) __getitem__'s label is the first field, the digit
        kind = "QMNIST" if getattr(obj, "compat", False) else None
        if kind is None:
            return None
    if kind in TV_FOLDERS:
        loader = getattr(obj, "loader", None)
        pil = (getattr(loader, "__module__", "") == "torchvision.datasets.folder"
               and getattr(loader, "__name__", "") in TV_LOADERS)
        return kind if pil else None  # a loader of its own (npy files, ...): only it knows the pixels
    labels = getattr(obj, "labels" if kind in TV_CHW else "targets", None)
    if kind in TV_CHW and labels is not None and (np.asarray(labels) < 0).any():
        return None   # STL10's unlabeled samples (-1): left to __getitem__, whose label -1 is refused by name
    return kind if getattr(obj, "data", None) is not None and labels is not None else None


def batch_route(obj) -> str:
    """How memory and dali, which run no per-sample transform, read Dataset ``obj``'s data without it."""
    label = type(obj).__name__
    kind = readable_kind(obj)
    if kind:
        return (f"pass {label}(..., transform=None), which fastdata reads as "
                f"{'image files' if kind in TV_FOLDERS else 'arrays'}")
    return (f"{label} cannot serve at all, transform or not (they read arrays and image files, not a "
            f"Dataset's __getitem__): pass ArraySource(images, labels) or ImageFolder.from_samples(samples, "
            f"classes) holding its images")


def own_getitem(obj) -> str | None:
    """The class that gives ``obj`` its ``__getitem__`` when that is not torchvision's (a subclass that
    remaps labels, resizes, or reads pixels its own way), else None."""
    for cls in type(obj).__mro__:
        if "__getitem__" in vars(cls):
            return None if cls.__module__.startswith("torchvision.datasets") else cls.__qualname__
    return None
