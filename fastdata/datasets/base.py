"""The Source base class and the checks every source shares (indices, labels, statistics)."""
from __future__ import annotations

import copy
import pickle
import zlib
from typing import Protocol

import numpy as np
import torch

from ..checks import check_integer
from ..config import Augmentation, SourceKind

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Source:
    """What every source has: ``labels`` (int64 array), ``num_classes``, ``classes`` (names), ``channels``,
    ``mean``/``std`` (in [0, 1] units), ``len()``, ``subset()`` and the hooks backends read.

    ``indices``: for a subset, the sample ids of the source it was taken from (composed through nested
    subsets, so always into the first, full source); None for a full source.
    ``refusal_hint``: None, or a sentence a backend that cannot read this source appends to its error
    (set by ``as_source`` when it keeps a dataset it could not convert, saying why and what to do).
    """

    kind = SourceKind.ABSTRACT
    #: ``source[i]``'s image is an (H, W, C) tensor (arrays, image folders), not a wrapped dataset's own.
    hwc_samples = False
    name = "source"
    refusal_hint: str | None = None
    indices: np.ndarray | None = None
    labels: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int
    num_classes: int
    _classes: list | None = None
    _classes_unnamed = False   # _classes is 0 .. num_classes-1, made for a source without names

    #: Whether samples cost the same read in any order (files, arrays), or the source is a stream best
    #: read in its own order (shards: whole shards fetched a window at a time, see ``epoch_order``).
    random_access = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("fastdata."):   # fastdata's own name their samples in their errors
            return
        # A source of one's own: an OSError from its read (a file gone, a network error) is the sample's
        # DecodeError, which on_error="skip" skips, as an image folder's is; anything else is a bug and
        # stays as it is.
        for name in ("read", "read_stamped"):
            if name in cls.__dict__:
                setattr(cls, name, _naming_read_errors(cls.__dict__[name]))

    def __len__(self) -> int:
        return len(self.labels)

    # ------------------------------------------------------------------ the bytes (encoded sources)
    # Sources of encoded images (SourceKind.FILES) own their bytes: every backend decodes what
    # read(i) returns and names sample_name(i) in its errors; none opens a path itself. A new storage
    # format (tar shards, an object store) is one Source subclass, read by every backend unchanged.
    def read(self, i: int) -> bytes:
        """Sample ``i``'s encoded bytes (a JPEG or PNG file's contents). A failure to read them is a
        ``DecodeError`` naming ``sample_name(i)`` (with ``on_error="skip"``, the sample is skipped)."""
        return self.read_stamped(i)[0]

    def read_stamped(self, i: int) -> tuple[bytes, int]:
        """(``read(i)``, a stamp that changes when the sample's bytes change): a backend that learns a
        sample's header once (its size, for the crop boxes) learns it again when the stamp moves. The
        stamp is an int in ``[0, 2**63)`` (dali keeps them in an int64 array). A source that gives
        ``read`` alone is stamped with its bytes' CRC-32 (a pass over bytes being decoded anyway)."""
        if type(self).read is not Source.read:
            data = self.read(i)
            return data, zlib.crc32(data)
        raise TypeError(f"{self!r} holds decoded pixels or samples, not encoded files: it has no bytes to read"
                        + (" (a source of kind FILES implements read_stamped(i) -> (bytes, stamp), or read(i))"
                           if self.kind is SourceKind.FILES else ""))

    def stamp(self, i: int) -> tuple[int, int] | None:
        """(``len(read(i))``, a stamp that changes when those bytes change) known without reading them
        (a file's ``stat``, an archive's directory, an index), or None: only reading tells. ``pack``
        plans its shards and recognises finished ones from these: with None it reads every sample once
        to plan, and again to write. The stamp is an int in ``[0, 2**63)``, like ``read_stamped``'s."""
        return None

    def sample_name(self, i: int) -> str:
        """What errors call sample ``i``: its file's path, or its shard and member (ending in the
        format's extension, which decoders check the bytes against)."""
        return f"{self.name}[{i}]"

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray | None:
        """A shuffled epoch's order of sample ids when the source has its own (shards: shards shuffled,
        then samples within a window of shards), from ``(seed, epoch)`` alone; None: a permutation of all
        samples. It must not depend on the world size, so ranks split it and resume it elastically."""
        return None

    def reading(self, order: np.ndarray, position: int, next_order=None, padding: int = 0) -> None:
        """The running pass reads ``order`` (the epoch's sample ids over every rank) and has handed out
        its first ``position``: a streaming source fetches ahead. Called by the loader in its own
        process, for sources without ``random_access``, when a pass starts and after each batch.
        ``next_order``: a callable that gives the next epoch's order (computed when called), for
        fetching its start while this pass ends. ``padding``: samples the pass reads again after its
        end, ``order[:padding]`` (even_batches' padding of the last step, over every rank). A source
        whose ``reading`` takes neither is called without them (``reading_call``)."""

    def plan_in_flight(self, batches: int, batch_size: int, read: int = 0, ranks: int = 1) -> None:
        """How far the loader's readers run past the position it tells ``reading``: ``batches`` batches of
        ``batch_size`` (global) samples, the first ``read`` of them read already, over ``ranks`` ranks.
        Called once by the loader, in its own process (``tell_in_flight``); a streaming source
        (``Shards``) keeps their shards cached."""

    @property
    def classes(self) -> list:
        """Class names, index = label: folder names, a dataset's ``classes``, or ``0 .. num_classes-1``.
        The source's own list, the same object at every access (a per-sample name lookup copied 10,000
        names each time); ``list(source.classes)`` for one to change. A plain list, not a read-only
        kind of one: it goes into checkpoints (``torch.load``'s weights_only), Lightning's hparams.yaml
        and pickles read where fastdata is not installed."""
        if self._classes is None or self._classes_unnamed and len(self._classes) != self.num_classes:
            self._classes, self._classes_unnamed = list(range(self.num_classes)), True
        return self._classes

    @classes.setter
    def classes(self, value) -> None:
        """Set the class names (None: ``0 .. num_classes-1``)."""
        self._classes, self._classes_unnamed = (None, False) if value is None else (list(value), False)

    @property
    def sample_transform(self):
        """The per-sample callable applied after decoding (``ImageFolder(transform=...)``, a torchvision
        dataset's own ``transform``), or None. Only backends that decode per sample on the CPU run it."""
        return None

    def default_augmentation(self, train: bool) -> Augmentation:
        """The recipe a loader uses when ``LoaderConfig.augment`` is None: for encoded photos (kind
        FILES, no per-sample transform) an image folder's, ImageNet's crops, since photos of mixed
        sizes need a crop that fixes the size; none otherwise.

        Args:
            train: the training recipe (else the evaluation one).
        """
        if self.kind is SourceKind.FILES and self.sample_transform is None:
            return Augmentation.imagenet_train() if train else Augmentation.imagenet_eval()
        return Augmentation.none()

    def fingerprint(self) -> str:
        """A short, readable identity of the data, stored with a loader's position: resuming on other
        data of the same size would silently read different samples. Cheap, so not a full hash."""
        return f"{type(self).__name__} n={len(self)}{self._subset_tag()}"

    def _subset_tag(self) -> str:
        # Resuming on another subset of the same data (another validation split) is refused by this.
        return "" if self.indices is None else f" subset={crc(self.indices)}"

    def subset(self, indices) -> "Source":
        """A source of the same kind over the samples ``indices`` (in that order).

        The subset keeps this source's ``classes``, ``num_classes``, ``channels``, ``name`` and its
        ``mean``/``std``: a validation split must be normalized like its training split, not with its
        own statistics. Sharding, order and resume then apply to the subset; its fingerprint includes
        the indices, so a position saved on one subset is refused on another.

        Args:
            indices: 1-D integers in ``[0, len(self))`` (list, range, numpy array or tensor), each at most
                once, or a boolean mask of length ``len(self)``. A duplicate or an index out of range is
                an error naming the first one.
        """
        idx = check_indices(indices, len(self), f"{type(self).__name__}.subset")
        sub = copy.copy(self)
        sub._take(idx)
        sub.indices = idx if self.indices is None else self.indices[idx]
        return sub

    def _take(self, idx: np.ndarray) -> None:
        """Restrict this (copied) source to samples ``idx``; each kind keeps what its backends read."""
        raise NotImplementedError(f"{type(self).__name__} does not implement subset(): give it _take(idx), which "
                                  f"restricts a copy of the source to samples idx (its labels and what its "
                                  f"reads index), as examples/custom_source.py's ZipImages does")

    def __getitem__(self, i):
        """Sample ``i`` as ``(image, label)`` (each kind says what its image is). ``torch.utils.data.Subset``
        and ``random_split`` need only ``len``; ``as_source`` turns their result into ``subset()``.

        Args:
            i: an integer in ``[-len, len)``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement __getitem__")

    def _index(self, i) -> int:
        import numbers

        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{type(self).__name__} indices must be integers, got {i!r} ({type(i).__name__}); "
                            f"for several samples use subset()")
        n = len(self)
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"index {i} is out of range for {type(self).__name__} with {n} samples")
        return j

    def __repr__(self):
        return f"{type(self).__name__}(n={len(self)}, classes={self.num_classes}, name={self.name!r})"


def loader_classes(source, made=None) -> tuple[list, object]:
    """(``source``'s class names as a list, a key to pass back as ``made``): a source's own list as it
    is (``Source.classes``: the same object at every access); for a source of one's own that gives a
    tuple, a range or a new list at each access, the list made for the previous call while the source
    gives the same names object at the same length, a copy (once) otherwise."""
    classes = getattr(source, "classes", None)
    if classes is None:
        classes = range(source.num_classes)
    if type(classes) is list:
        return classes, None
    if made is not None and made[0] is classes and made[1] == len(classes):
        return made[2], made
    names = list(classes)
    return names, (classes, len(classes), names)


def _naming_read_errors(read):
    """``read`` (a Source's ``read`` or ``read_stamped``) raising an OSError as the sample's DecodeError."""
    import functools

    from ..errors import DecodeError

    @functools.wraps(read)
    def reading(self, i, *args, **kwargs):
        try:
            return read(self, i, *args, **kwargs)
        except OSError as e:
            raise DecodeError(self.sample_name(i), f"cannot read it ({type(e).__name__}: {e})") from e

    return reading


def tell_in_flight(source, plan, batches: int, read: int = 0) -> None:
    """``source.plan_in_flight(batches, plan's global batch, read, plan's world size)``, for a streaming
    source (without ``random_access``) that has it: a source written before the method existed, or not
    derived from ``Source``, is left alone."""
    tell = None if getattr(source, "random_access", True) else getattr(source, "plan_in_flight", None)
    if tell is not None:
        tell(batches, plan.global_batch, read, plan.world_size)


def reading_call(source, plan, epoch: int, offset: int):
    """``source.reading`` for a pass of ``plan`` over ``epoch`` from ``offset``, as ``(order, position)``:
    given the next epoch's order and the pass's padding where it takes them (a stream written before
    either existed takes ``order`` and ``position`` only)."""
    import functools
    import inspect

    try:
        takes = set(inspect.signature(source.reading).parameters)
    except (TypeError, ValueError):
        takes = set()
    given: dict = {}
    if "next_order" in takes:
        given["next_order"] = functools.partial(plan.order, epoch + 1)
    padded = plan.padded(offset) if "padding" in takes else 0
    if padded:
        given["padding"] = padded
    return functools.partial(source.reading, **given) if given else source.reading


#: What every source sets (in its ``__init__``), checked by ``check_source`` on a source of one's own.
SOURCE_ATTRIBUTES = ("labels", "num_classes", "channels", "mean", "std")


def check_source(source: Source) -> None:
    """Refuse a source of one's own (a ``Source`` subclass written outside fastdata) that breaks what
    every backend relies on, naming the problem and the fix, before any backend reads it: a missing
    attribute, a ``len`` other than the labels' (an IndexError inside a batch, or samples never read),
    labels that are names, fractions or past ``num_classes``, and photos (kind FILES, decoded to RGB)
    said to have other than 3 channels. Integer labels of another dtype (a list, int32, whole floats)
    are set back as the int64 array the contract hands out; backends index them as they are.

    Args:
        source: a Source (fastdata's own check themselves when made, and are left alone).
    """
    what = type(source).__name__
    missing = [a for a in SOURCE_ATTRIBUTES if not hasattr(source, a)]
    if missing:
        raise TypeError(f"{what} has no {', '.join(missing)}: a Source sets labels (one class index per "
                        f"sample), num_classes, channels, and mean and std (per channel, in [0, 1] units) in "
                        f"its __init__ (docs/sources.md, 'Your own source')")
    if source.kind is SourceKind.ABSTRACT:
        raise TypeError(f"{what} sets no kind: a source of encoded photos sets kind = SourceKind.FILES (and "
                        f"read_stamped(i) or read(i)), one holding every image in a uint8 (N, H, W, C) array "
                        f"kind = SourceKind.ARRAY (and images, image_shape); docs/sources.md, 'Your own source'")
    num_classes = check_integer(f"{what}.num_classes", source.num_classes, minimum=0)
    if source.kind not in (SourceKind.FILES, SourceKind.ARRAY):
        return
    if source.kind is SourceKind.FILES and source.channels != 3:
        raise ValueError(f"{what} has channels={source.channels!r}, but it is of kind FILES, whose photos every "
                         f"backend decodes to RGB: set channels = 3 (and mean/std of 3 values, or 1)")
    labels = source.labels
    named = np.asarray(labels)
    if named.dtype.kind in "USO" and named.size:
        raise TypeError(f"{what}.labels holds names ({named.flat[0]!r}, ...), not class indices: set "
                        f"classes = sorted(set(names)) and labels = [classes.index(n) for n in names]")
    checked = check_labels(labels, f"{what}.labels", num_classes or None)
    if len(source) != len(checked):
        raise ValueError(f"len({what}) is {len(source)} but {what}.labels has {len(checked)}: one label per "
                         f"sample, and len counts the samples (Source.__len__ is len(labels); an override "
                         f"must agree)")
    if source.kind is SourceKind.ARRAY and hasattr(source, "images") and hasattr(source, "image_shape"):
        _check_array_images(source, what, len(checked))   # without them, the backend says what the kind needs
    if not (isinstance(labels, np.ndarray) and labels.dtype == np.int64):
        try:
            source.labels = checked
        except AttributeError:   # a read-only property: its owner converts
            raise TypeError(f"{what}.labels is {type(labels).__name__} of {named.dtype}: the batches' labels are "
                            f"int64; make it np.asarray(labels, dtype=np.int64)") from None


def check_picklable(source: Source, why: str) -> None:
    """Refuse ``source`` when it cannot be pickled, naming the attribute that cannot and the fix: DataLoader
    workers started by ``spawn`` or ``forkserver`` receive the source pickled, and an open file, a lock or
    a lambda in it failed at the first batch with pickle's words, naming no attribute. Arrays, tensors and
    byte strings are not pickled here, at any depth (they always can be, and may be large); an array of
    Python objects is.

    Args:
        source: the source the workers read.
        why: what sends it (``"multiprocessing_context='spawn'"``), for the message.
    """
    what, cls = type(source).__name__, type(source)
    if cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__:
        parts = [("__reduce__()", source)]   # pickled its own way: as a whole, as the workers get it
    else:
        state = source.__getstate__() if hasattr(source, "__getstate__") else vars(source)
        parts = list(state.items()) if isinstance(state, dict) else [("__getstate__()", state)]
    for name, value in [("class", cls), *parts]:
        try:   # arrays, tensors and bytes are left out, at any depth (_BuffersLeftOut): never copied
            _BuffersLeftOut(_Discard(), pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception as e:
            if "through inheritance" in str(e):
                # multiprocessing's own Lock, Queue, Value (of the spawn context): plain pickling refuses
                # them, the pickling that starts a worker sends them (multiprocessing.context.assert_spawning).
                continue
            part = f"the class {what} itself" if name == "class" else f"its attribute {name!r} ({type(value).__name__})"
            raise TypeError(
                f"{what} cannot be sent to the DataLoader workers, which {why} starts by pickling it: {part} "
                f"cannot be pickled ({type(e).__name__}: {e}). Give {what} a __getstate__ that leaves it out, "
                f"to be opened or made again in the worker (examples/custom_source.py's ZipImages does so for "
                f"its archive and lock); define classes and functions at a module's top level (not a lambda "
                f"or a local one); or use multiprocessing_context='fork' or num_workers=0") from None


class _Discard:
    """A file that keeps nothing: check_picklable needs pickling to succeed, not its bytes."""

    def write(self, data) -> int:
        return len(data)


class _BuffersLeftOut(pickle.Pickler):
    """A pickler that writes a stand-in for arrays, tensors and byte strings (they always pickle; not a
    memoryview, which never does):
    nested in a source (a dict of arrays, an ImageFolder's PathTable, a source pickled whole by its own
    __reduce__) they were copied into pickle's output, gigabytes for a dataset held in memory, only to
    be thrown away. An object array is pickled: its elements may be anything."""

    def persistent_id(self, obj):
        if isinstance(obj, (bytes, bytearray, torch.Tensor)) or \
                isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            return id(obj)
        # A list of plain values (ImageNet's 1.28M paths, its labels): pickling it element by element, each
        # memoized, took 1.2 s here at every loader made under spawn; checking the elements' exact types
        # takes 40 ms. A str subclass or any other object is still pickled, so it is still checked.
        if type(obj) in (list, tuple) and all(type(x) in _PLAIN for x in obj):
            return id(obj)
        return None


#: Values that always pickle (exact types: a subclass may define its own __reduce__).
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _check_array_images(source, what: str, n: int) -> None:   # an ArrayPixels Source
    """Refuse the ``images`` of an ARRAY source of one's own that backends would misread: not a uint8
    (N, H, W, C) array (float pixels read as bytes, (N, H, W) failing inside a batch), an
    ``image_shape`` or ``channels`` other than the array's, or another count than ``n`` labels."""
    images = source.images
    shape = tuple(getattr(images, "shape", ()))
    dtype = str(getattr(images, "dtype", type(images).__name__)).replace("torch.", "")
    if len(shape) != 4 or dtype != "uint8":
        raise TypeError(f"{what}.images is {dtype} of shape {shape}: a source of kind ARRAY holds every image in "
                        f"one uint8 (N, H, W, C) array (fastdata.datasets.ArraySource takes (N, H, W) arrays too, "
                        f"and says how to make float ones uint8)")
    if tuple(source.image_shape) != shape[1:]:
        raise ValueError(f"{what}.image_shape is {tuple(source.image_shape)} but its images are {shape[1:]} "
                         f"(H, W, C): image_shape is images.shape[1:]")
    if shape[3] != source.channels:
        raise ValueError(f"{what} has channels={source.channels!r} but its images have {shape[3]}: set "
                         f"channels = images.shape[3] (and mean/std of as many values, or 1)")
    if shape[0] != n:
        raise ValueError(f"{what}.images holds {shape[0]} images but {what}.labels has {n}: one label per image")


class ArrayPixels(Protocol):
    """What a source of kind ``SourceKind.ARRAY`` (``ArraySource``, ``Shards`` packed from arrays) holds
    beyond ``Source``: every image in one uint8 (N, H, W, C) array, which backends read as it is (the
    memory backend shares it, dali slices it). A type, not a check: a backend ``cast``s a source of that
    kind to it, and one that lacks ``images`` fails with the AttributeError that names it."""

    images: np.ndarray
    labels: np.ndarray

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image: ``images.shape[1:]``."""
        ...


def check_indices(indices, n: int, what: str = "indices") -> np.ndarray:
    """Sample ids as an int64 array: 1-D integers in [0, n), each at most once, or a boolean mask of
    length n. Why no duplicates: a subset promises every selected sample once per epoch, and a repeated
    id is far more often a bug (two overlapping splits concatenated) than an intended oversampling.

    Args:
        indices: list, range, numpy array or torch tensor of integers, or a boolean mask.
        n: the number of samples of the source being indexed.
        what: how errors name the argument.
    """
    if isinstance(indices, (set, frozenset, dict)):
        raise TypeError(f"{what}: indices must be ordered (a list, range, array or tensor), got a "
                        f"{type(indices).__name__}")
    if hasattr(indices, "detach"):  # a torch tensor, possibly on a GPU
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices)
    if idx.dtype == np.bool_:
        if idx.shape != (n,):
            raise ValueError(f"{what}: a boolean mask must have one entry per sample ({n}), got shape {idx.shape}")
        idx = np.flatnonzero(idx)
    elif idx.size == 0 and idx.dtype == np.float64:
        idx = idx.astype(np.int64)  # np.asarray([]) is float64: an empty list is not a float index
    if not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"{what}: indices must be integers (or a boolean mask), got dtype {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"{what}: indices must be 1-D, got shape {idx.shape}")
    if idx.size == 0:
        raise ValueError(f"{what}: indices select no samples; a source needs at least one")
    idx = idx.astype(np.int64)
    bad = (idx < 0) | (idx >= n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise IndexError(f"{what}: indices[{i}] is {idx[i]}, outside [0, {n}) (the source has {n} samples)")
    _, first, inverse = np.unique(idx, return_index=True, return_inverse=True)
    repeated = np.flatnonzero(first[inverse] != np.arange(len(idx)))
    if repeated.size:
        at = int(repeated[0])
        raise ValueError(f"{what}: index {idx[at]} appears more than once (indices[{int(first[inverse[at]])}] "
                         f"and indices[{at}]); a subset holds each sample once")
    return idx


def channel_stats(images: np.ndarray, *, most: int = 10_000, most_values: int = 2**26,
                  chunk_bytes: int = 8 * 2**20):
    """Per-channel (mean, std) in [0, 1] units of uint8 (N, H, W, C) ``images``, each std at least
    1e-3. A strided subset of at most ``most`` images and about ``most_values`` pixel values (CIFAR's and
    MNIST's 10,000 images are under it; large photos are sampled more sparsely) gives them to 3 digits
    without a pass over a large array. The subset is counted into one 256-bin histogram per channel, a
    chunk of about ``chunk_bytes`` of pixels at a time: exact, and the memory used is bounded whatever
    the image size (a float32 copy of 10,000 photos of 224² was 6 GB, and numpy's std made a second)."""
    per_image = max(1, int(np.prod(images.shape[1:])))
    sub = images[:: max(1, -(-len(images) // most), -(-len(images) * per_image // most_values))]
    channels = sub.shape[-1]
    step = max(1, chunk_bytes // per_image)
    offsets = (np.arange(channels, dtype=np.int32) * 256)
    counts = np.zeros(256 * channels, np.int64)
    for a in range(0, len(sub), step):
        block = sub[a: a + step].reshape(-1, channels).astype(np.int32)
        block += offsets   # channel c counts into bins c*256 .. c*256+255
        counts += np.bincount(block.ravel(), minlength=256 * channels)
    hist = counts.reshape(channels, 256).astype(np.float64)
    values = np.arange(256, dtype=np.float64) / 255.0
    n = hist.sum(axis=1)
    mean = hist @ values / n
    var = np.maximum(hist @ values**2 / n - mean**2, 0.0)
    return tuple(float(m) for m in mean), tuple(max(float(v) ** 0.5, 1e-3) for v in var)


def host_array(x) -> np.ndarray:
    """A numpy view or copy of ``x``: a torch tensor on a GPU, or one that requires grad, is copied to
    the host (``Tensor.numpy()`` alone refuses both); other array-likes go through ``np.asarray``."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.numpy(force=True)
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def float_pixels(images, remedy: str) -> str:
    """The advice for float images where uint8 pixels are read: what their values say (negative ones:
    normalized already, which the loader's normalization would repeat), then ``remedy`` (a text with
    ``{scale}``, filled with " * 255" for values in [0, 1] and "" for values in [0, 255]).

    Args:
        images: the float images (numpy array or tensor); the first 64 are looked at.
        remedy: how to pass them as uint8.
    """
    few = images[:64]
    few = host_array(few.detach().float() if hasattr(few, "detach") else few).astype(np.float64)   # bfloat16 too
    low, high = (float(few.min()), float(few.max())) if few.size else (0.0, 0.0)
    seen = f"values from {low:.3g} to {high:.3g}"
    first = ""
    if low < 0:
        seen += ": normalized already, which the loader's normalization would repeat"
        first = "un-normalize them (images * std + mean), then "
    scale = "" if low >= 0 and high > 1 else " * 255"
    return (f"({seen}); fastdata reads uint8 pixels and normalizes them on the device with mean=/std=: {first}"
            f"pass {remedy.format(scale=scale)}, with mean=/std= in [0, 1] units")


def count_classes(classes, num_classes) -> int | None:
    """``num_classes`` checked, or ``len(classes)``; the two must agree when both are given."""
    num_classes = check_integer("num_classes", num_classes, minimum=1, optional=True)
    if classes is not None:
        if isinstance(classes, (str, bytes)) or not hasattr(classes, "__len__"):
            raise TypeError(f"classes must be a list of class names, got {type(classes).__name__}")
        if num_classes is not None and num_classes != len(classes):
            raise ValueError(f"num_classes={num_classes} but classes has {len(classes)} names")
        return len(classes)
    return num_classes


def merge_classes(names: list, where: list[str]) -> list | None:
    """The class names of datasets read as one (a ConcatDataset's parts): the longest list, when every
    part's names (None: unnamed) begin it; a part whose class i has another name is an error naming
    both, since label i would mean two classes. None when no part names its classes.

    Args:
        names: each part's class names, or None.
        where: how errors name each part.
    """
    named = [(n, w) for n, w in zip(names, where) if n]
    if not named:
        return None
    longest, at = max(named, key=lambda nw: len(nw[0]))
    for n, w in named:
        if list(n) != list(longest[:len(n)]):
            i = next(k for k, (a, b) in enumerate(zip(n, longest)) if a != b)
            raise ValueError(f"the classes of {w} differ from those of {at}: class {i} is {n[i]!r} in the one "
                             f"and {longest[i]!r} in the other, so label {i} would mean two classes; give every "
                             f"part the same class folders (or class names), or remap the labels in a Dataset "
                             f"of your own")
    return list(longest)


def check_labels(labels, what: str = "labels", num_classes: int | None = None) -> np.ndarray:
    """Labels as int64, refusing what a cast would silently change: fractions (1.7 → 1), NaN (→ INT64_MIN),
    negatives (a negative class count), non-numbers, and, with ``num_classes``, labels past the last
    class (a loss would index out of range, or a model silently get too few outputs). The error names
    the first bad one and its index.

    Args:
        labels: array-like of numbers.
        what: how errors name the labels.
        num_classes: when given, labels must lie in ``[0, num_classes)``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:   # an error below would name labels[i], a row, and fail formatting it
        raise ValueError(f"{what} must hold one integer per sample, got shape {labels.shape}")
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
    if num_classes is not None:
        over = labels >= num_classes
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ValueError(f"{what} must be integers in [0, {num_classes}) (num_classes={num_classes}); "
                             f"{what}[{i}] is {labels[i].item()!r}")
    return labels.astype(np.int64)


def crc(*arrays: np.ndarray) -> str:
    """CRC-32 of the arrays' bytes, in order, as 8 hex digits (the sources' fingerprints)."""
    value = 0
    for a in arrays:
        value = zlib.crc32(np.ascontiguousarray(a).data, value)
    return f"{value:08x}"


# ---------------------------------------------------------------------------------------------- MNIST
