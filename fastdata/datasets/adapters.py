"""as_source: what people already have (torchvision datasets, Subsets, arrays) as a fastdata source; split."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..checks import check_integer, check_number
from .arrays import ArraySource
from .base import Source, check_source, float_pixels, merge_classes
from .folders import ImageFolder
from .sample_transforms import (
    TV_CHW,
    TV_FOLDERS,
    batch_route,
    describe,
    own_getitem,
    own_transforms,
    readable_kind,
    recipe_choices,
    torchvision_names,
)
from .torch_datasets import DatasetSource


def from_torchvision(obj) -> Source | None:
    """A fastdata source for a torchvision dataset every backend can read, or None (not one, or one
    that cannot be converted without changing what it returns; ``as_source`` then keeps it as a
    ``DatasetSource`` with a ``refusal_hint`` saying why).

    - ``ImageFolder``/``DatasetFolder`` (and subclasses, e.g. ImageNet) with PIL's loader →
      ``ImageFolder.from_samples`` over ``.samples`` with its ``.classes``.
    - ``CIFAR10``/``CIFAR100`` → ``ArraySource`` over ``.data`` (N, 32, 32, 3) and ``.targets``.
    - ``MNIST``/``FashionMNIST``/``KMNIST``/``EMNIST`` → ``ArraySource`` over ``.data`` (N, 28, 28)
      and ``.targets`` (digit recipe for MNIST itself only: the others are not digits); ``QMNIST`` with
      ``compat=True`` (its default) → the same, labelled by the first field of its targets, the digit;
      ``USPS`` (16 x 16 digits) → the same.
    - ``SVHN``/``STL10`` → ``ArraySource`` over ``.data`` (N, 3, H, W) turned (N, H, W, 3) and ``.labels``
      (an STL10 split with unlabeled samples, label -1, stays a Dataset).

    Class names are kept, statistics are measured (arrays) or ImageNet's (files). A dataset with its own
    ``transform``, ``target_transform`` or ``transforms`` is not converted: the transform would be
    silently dropped. Nor is a subclass with a ``__getitem__`` of its own: what it returns is what the
    user means, and only calling it gives that.

    Args:
        obj: any object.
    """
    kind = readable_kind(obj)   # the classes above, with PIL's loader, no __getitem__ of their own
    if kind is None or own_transforms(obj):
        return None
    classes = list(getattr(obj, "classes", None) or [])
    label = type(obj).__name__
    if kind in TV_FOLDERS:
        root = getattr(obj, "root", None)
        return ImageFolder.from_samples(obj.samples, classes, root=root,
                                        name=f"{label.lower()}:{Path(root).name if root else ''}")
    if kind in TV_CHW:   # their __getitem__ turns each (C, H, W) image into PIL's (H, W, C)
        return ArraySource(np.asarray(obj.data).transpose(0, 2, 3, 1), np.asarray(obj.labels),
                           classes=classes or None, name=label.lower())
    # The nearest known class: FashionMNIST, KMNIST, EMNIST are not digits; USPS's are.
    digits = kind in ("MNIST", "QMNIST", "USPS")
    targets = np.asarray(obj.targets)
    if kind == "QMNIST":   # rows of 8 fields (digit, NIST class, writer, ...): the digit, as compat returns
        targets = targets[:, 0]
    return ArraySource(obj.data, targets, classes=classes or None, name=label.lower(), digits=digits)


def _refusal_hint(obj) -> str | None:
    """Why ``obj`` (a torchvision dataset kept as a DatasetSource) is not read by memory/dali, and what
    to pass instead; None when there is nothing specific to say."""
    names = torchvision_names(obj)
    label = type(obj).__name__
    own = own_transforms(obj)
    getitem = own_getitem(obj) if names else None
    if getitem:
        return (f"{label} has its own __getitem__ ({getitem}.__getitem__), which only the torch and prefetch "
                f"backends call; memory and dali read files or arrays: pass an ImageFolder.from_samples or an "
                f"ArraySource holding what it returns, or use the torch backend")
    readable = readable_kind(obj)
    if names and own and (readable or not any(n in TV_FOLDERS for n in names)):
        # Only a dataset fastdata reads as files or arrays is served by memory/dali without its transform.
        return (f"{label} has its own {', '.join(own)}, which only the torch and prefetch backends run per "
                f"sample; for memory/dali {batch_route(obj)}, and express the augmentation as "
                f"augment=Augmentation(...) ({recipe_choices()}) plus batch_transforms=[...]")
    if any(n in TV_FOLDERS for n in names):
        return (f"{label} has its own loader={describe(getattr(obj, 'loader', None))}, which only the torch "
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
    - a ``ConcatDataset``: one source (``_concat``); a ``TensorDataset`` of uint8 images and integer
      labels: an ``ArraySource`` (``_tensor_arrays``);
    - any other map-style Dataset (``__getitem__`` and ``__len__``): a ``DatasetSource`` (torch and
      prefetch backends), whose ``refusal_hint`` tells the others' error what to do.

    Args:
        obj: the data.
    """
    if isinstance(obj, Source):
        if not type(obj).__module__.startswith("fastdata."):   # fastdata's own check themselves when made
            check_source(obj)
        return obj
    if isinstance(obj, tuple) and len(obj) == 2:
        return ArraySource(*obj)
    if _is_subset(obj):
        return as_source(obj.dataset).subset(obj.indices)
    if _is_torch("ConcatDataset", obj):
        return _concat(obj)
    if _is_torch("TensorDataset", obj):
        arrays = _tensor_arrays(obj)
        if arrays is not None:
            return arrays
    converted = from_torchvision(obj)
    if converted is not None:
        return converted
    # An IterableDataset inherits Dataset's __getitem__ (which raises NotImplementedError) and often has
    # a __len__ (for progress bars): it is no map-style Dataset all the same.
    if hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not _is_torch("IterableDataset", obj):
        src = DatasetSource(obj)
        hint = _refusal_hint(obj)
        if hint:
            src.refusal_hint = hint
        return src
    raise TypeError(f"cannot load from {type(obj).__name__}: pass a fastdata source (MNIST, ImageFolder, "
                    f"SyntheticDigits, ArraySource), a torchvision dataset, a map-style torch Dataset, or "
                    f"(images, labels) arrays{_not_a_dataset(obj)}")


def _not_a_dataset(obj) -> str:
    """What to pass instead of a DataLoader (a script switching to fastdata hands over the loader it
    had) or an iterable-style Dataset (no index: nothing to shuffle, shard or resume by)."""
    if _is_torch("DataLoader", obj):
        return (f"; this is a DataLoader: pass its dataset (make_loader(loader.dataset, batch_size="
                f"{getattr(obj, 'batch_size', None)}, ...)), fastdata makes the batches itself (its sampler and "
                f"collate_fn are not used)")
    if _is_torch("IterableDataset", obj):
        return ("; an IterableDataset has no __getitem__ to read sample i by, which fastdata needs to shuffle, "
                "shard and resume: make it a map-style Dataset (__getitem__ and __len__), or write its "
                "samples to an image folder or into (images, labels) arrays")
    return ""


def _is_subset(obj) -> bool:
    return _is_torch("Subset", obj)


def _is_torch(name: str, obj) -> bool:
    """Whether ``obj`` is an instance of ``torch.utils.data.<name>`` (without importing torch)."""
    import sys

    data = sys.modules.get("torch.utils.data")  # a Subset exists only once torch is imported
    return data is not None and isinstance(obj, getattr(data, name))


def _tensor_arrays(obj) -> ArraySource | None:
    """A ``TensorDataset(images, labels)`` of uint8 images, (N, C, H, W) with C in 1, 3, 4 (alpha dropped)
    or (N, H, W), and integer labels (N,), as the ``ArraySource`` it is, so every backend reads it (as a
    Dataset, memory and dali refused it and its class count was unknown). Its samples are read as a
    Dataset's tensors are, (C, H, W), into one (N, H, W, C) copy. Float images are refused, saying how
    to hand them over (and whether they look normalized already); None for anything else (more
    tensors, other shapes): the ``DatasetSource`` then says what it expects."""
    import torch

    tensors = obj.tensors
    if len(tensors) != 2:
        return None
    images, labels = tensors
    if images.is_floating_point() and images.numel():
        _refuse_float_tensors(images)
    if images.dtype != torch.uint8 or labels.dim() != 1 or labels.is_floating_point() or labels.dtype == torch.bool:
        return None
    if images.dim() == 4 and images.shape[1] in (1, 3, 4):
        images = images[:, :3].permute(0, 2, 3, 1)
    elif images.dim() != 3:
        return None
    return ArraySource(images.contiguous(), labels, name="tensordataset")


def _refuse_float_tensors(images) -> None:
    """A TensorDataset of float images: the error saying how to hand them over as uint8."""
    raise TypeError(f"TensorDataset holds {images.dtype} images " + float_pixels(
        images, "TensorDataset((images{scale}).round().clamp(0, 255).to(torch.uint8), labels), or "
                "ArraySource(uint8 (N, H, W, C) images, labels)"))


def _concat(obj) -> Source:
    """A ``torch.utils.data.ConcatDataset`` (a training folder and an extra one, CIFAR's train and test
    sets) as one source: image folders as one ``ImageFolder.from_samples`` over their files, arrays of
    one shape as one ``ArraySource`` (copied into one array; statistics measured anew unless every
    part has the same), so every backend reads it; anything else stays a ``DatasetSource`` of the
    ConcatDataset (torch and prefetch), with the parts' classes and targets. The parts' class names must
    agree (label i is one class in every part; a part may lack the last classes): two folders whose
    class sub-folders differ are an error, as the DataLoader would have mixed their labels silently."""
    parts = [as_source(d) for d in obj.datasets]
    # Names only (strings, or ImageNet's tuples of synonyms): a part without them answers 0 .. n-1,
    # which names nothing to compare.
    names = merge_classes([p.classes if any(isinstance(c, (str, tuple)) for c in p.classes) else None
                           for p in parts],
                          [f"part {i} ({p.name})" for i, p in enumerate(parts)])
    name = "+".join(p.name for p in parts)
    same_stats = all(p.mean == parts[0].mean and p.std == parts[0].std for p in parts)
    # The exact classes (a subclass may read its files or arrays its own way) and no transform.
    folders = [p for p in parts if isinstance(p, ImageFolder) and type(p) is ImageFolder and p.transform is None]
    if len(folders) == len(parts) and same_stats:
        roots = {os.fspath(p.root) for p in folders}
        samples = [(path, int(label)) for p in folders for path, label in zip(p.paths, p.labels)]
        return ImageFolder.from_samples(samples, names or parts[0].classes, root=roots.pop() if len(roots) == 1
                                        else None, mean=parts[0].mean, std=parts[0].std, name=name)
    arrays = [p for p in parts if isinstance(p, ArraySource) and type(p) is ArraySource]
    if len(arrays) == len(parts) and len({(p.image_shape, p.digits) for p in arrays}) == 1:
        stats = dict(mean=parts[0].mean, std=parts[0].std) if same_stats else {}
        return ArraySource(np.concatenate([p.images for p in arrays]), np.concatenate([p.labels for p in arrays]),
                           classes=names, num_classes=None if names else max(p.num_classes for p in arrays),
                           name=name, digits=arrays[0].digits, **stats)
    src = DatasetSource(obj, num_classes=len(names) if names else None)
    if names:
        src.classes = names
    labels = np.concatenate([p.labels for p in parts])
    if (labels >= 0).all():   # every part knows its labels (targets, files, arrays): fingerprint, class count
        src.labels = labels
        src.num_classes = max(src.num_classes, int(labels.max()) + 1)
    return src


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
        check_number(f"fractions[{i}] (a fraction or a count)", f, minimum=0)
    if all(isinstance(f, numbers.Integral) for f in values) and sum(values) == n:
        counts = [int(f) for f in values]
    elif any(isinstance(f, numbers.Integral) and int(f) > 1 for f in values):
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
    seed = check_integer("seed", seed, minimum=0)
    order = np.random.default_rng([seed, 0x5B1D]).permutation(n)
    bounds = np.cumsum([0] + counts)
    return tuple(src.subset(np.sort(order[a:b])) for a, b in zip(bounds[:-1], bounds[1:]))


# ---------------------------------------------------------------------------- test/benchmark photos
