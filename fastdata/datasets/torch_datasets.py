"""DatasetSource: any map-style torch Dataset, read through its own __getitem__."""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from ..config import SourceKind
from .base import IMAGENET_MEAN, IMAGENET_STD, Source, check_labels, count_classes, crc, host_array
from .sample_transforms import (
    EXPECTED_IMAGES,
    batch_backends_fix,
    batch_route,
    check_sample_transform,
    fastdata_samples,
    own_getitem,
    torchvision_names,
)

if TYPE_CHECKING:
    from ..images.on_error import OnError


@contextmanager
def _global_rngs_kept():
    """Run a Dataset's ``__getitem__`` outside an epoch (to learn what its samples are) with the global
    generators its transform draws from (torch's CPU one, ``random``, ``numpy.random``) restored after,
    so that ``make_loader`` leaves the caller's random state where it was. CUDA's generators are not
    touched: a per-sample transform runs on the host."""
    import random

    import torch

    with torch.random.fork_rng(devices=[]):
        state = random.getstate(), np.random.get_state()
        try:
            yield
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])


def _grey_data(dataset) -> bool:
    """Whether ``dataset`` holds grey pixels by construction: a ``data`` array or tensor of shape
    (N, H, W), as torchvision's MNIST family, USPS and SEMEION keep theirs (their PIL samples are mode
    "L"); torch's ConcatDataset of such datasets too."""
    parts = getattr(dataset, "datasets", None)
    if isinstance(parts, (list, tuple)) and parts:
        return all(_grey_data(d) for d in parts)
    shape = getattr(getattr(dataset, "data", None), "shape", None)   # numpy's tuple, torch's Size
    return isinstance(shape, tuple) and len(shape) == 3


def _class_names(names) -> list | None:
    """A Dataset's ``classes`` as a list: a list or tuple, or any other sequence of names (a numpy array
    from ``np.unique``, a pandas Index), which was dropped before (classes unknown, labels unchecked);
    None when it has none (a dict, a string, empty)."""
    if isinstance(names, (str, bytes, dict)) or not hasattr(names, "__len__") or not hasattr(names, "__getitem__"):
        return None
    names = [n.item() if isinstance(n, np.generic) else n for n in names]
    return names or None


def _label_column(targets, n: int) -> np.ndarray | None:
    """A Dataset's ``targets`` as its labels, when it holds one per sample (a list, array or tensor of n
    numbers); else None, and the labels are those ``__getitem__`` returns (checked batch by batch). Rows
    per sample (QMNIST's 8 fields, a multi-label matrix) are not class labels: read as such, QMNIST
    crashed on "can only convert an array of size 1 to a Python scalar"."""
    if targets is None or not hasattr(targets, "__len__") or len(targets) != n:
        return None
    column = host_array(targets)
    # Names (strings) that __getitem__ turns into indices are not labels either: the dataset was refused
    # for an attribute fastdata only peeks at ("targets must be integers"), whatever __getitem__ returned.
    return column if column.ndim == 1 and column.dtype.kind in "iuf" else None


def _what(value) -> str:
    """How an error names what a Dataset returned instead of what fastdata reads."""
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))[:6]}"
    if isinstance(value, (tuple, list)):
        return f"a {len(value)}-item {type(value).__name__}"
    return f"an object of type {type(value).__name__}"


@functools.cache
def _unreadable() -> tuple:
    """The errors that say a Dataset's image could not be read (see ``DatasetSource.read_pair``)."""
    from PIL import Image

    return OSError, Image.DecompressionBombError


class DatasetSource(Source):
    """Any map-style torch Dataset returning (PIL image or uint8 tensor (C,H,W) or (H,W), int).
    torch and prefetch backends. fastdata's own sources inside torch's ``Subset``/``ConcatDataset``
    hand out (H, W, C) tensors, read as such.

    Every sample comes out with ``channels`` channels (``as_array``). With ``channels=None``:

    - PIL images: 3, every photo converted to RGB as torchvision's default loader does (grey, palette,
      RGBA, CMYK, 16-bit alike), whatever the first photo's mode: a grey first photo (ImageNet has grey
      JPEGs) does not make the colour ones after it an error. The exception is a dataset whose pixels
      are grey by construction, a ``data`` array of shape (N, H, W) (torchvision's MNIST family, USPS):
      its grey samples keep 1 channel.
    - tensors and arrays: the first sample decides (one shape serves every sample): colour → 3, and
      later grey samples are replicated to RGB (lossless); grey → 1 (MNIST-like tensors), and a later
      colour sample is an error rather than silently turned grey.

    Pass ``channels=1`` to convert colour samples to grey (Pillow's luma) on purpose, or ``channels=3``.
    A first sample that is a float tensor (a transform ending in ToTensor/Normalize) is refused here,
    naming the fix for every backend: for torch and prefetch, drop the float steps and pass mean=/std=;
    memory and dali run no per-sample transform and read no DatasetSource, so for them it says how they get
    the data (``batch_route``: the torchvision dataset with transform=None, which ``make_loader`` reads as
    files or arrays, or an ArraySource) and the augmentation (``augment=Augmentation(...)``). ``source[i]``
    is the dataset's own sample.

    Args:
        dataset: the Dataset; ``__getitems__`` is used for batched fetching when it exists.
        mean, std: normalization; None → ImageNet's for 3 channels, 0.5/0.5 otherwise.
        channels: 1 or 3; None → from the samples' kind (see above).
        num_classes: None → ``len(dataset.classes)`` when it has them, else ``dataset.num_classes`` (an
            int), else from ``dataset.targets``; 0 when none of these exists (labels unread).
    """

    kind = SourceKind.DATASET

    def __init__(self, dataset, *, mean=None, std=None, channels: int | None = None, num_classes=None):
        self.dataset = dataset
        self.name = type(dataset).__name__
        n = len(dataset)
        if n == 0:
            raise ValueError(f"dataset {type(dataset).__name__} is empty")
        self._convert_colour = channels is not None  # RGB → grey only when asked for
        # fastdata's own sources hand out (H, W, C) tensors: wrapped in torch's Subset/ConcatDataset,
        # their tensors are read as such, not as torch's (C, H, W) (which refused them, or silently
        # transposed an image 3 or 4 px high).
        self._hwc_tensors = fastdata_samples(dataset)
        first = None
        if self.sample_transform is not None and torchvision_names(dataset) and not own_getitem(dataset):
            # torchvision's datasets end __getitem__ with the transform, so its steps say what comes out
            # (a user's Dataset may convert back after it: its samples are checked as they come).
            check_sample_transform(self.sample_transform, self.name, batch_route(dataset))
        if channels is None:
            with _global_rngs_kept():   # building a loader must not move the caller's RNG (dropout, init)
                first, at = self._first_image()
            self._refuse_float(first, at)
            channels = self._default_channels(first)
        elif isinstance(channels, bool) or channels not in (1, 3):
            raise ValueError(f"channels must be 1, 3 or None (from the samples' kind), got {channels!r}")
        self.channels = channels
        #: (H, W) of the first sample where it was read (channels=None), else None: what an empty batch's
        #: images are shaped as before any batch was read (``augment.output_size``).
        self.sample_size = tuple(self.as_array(first).shape[:2]) if first is not None else None
        names = _class_names(getattr(dataset, "classes", None))
        own = getattr(dataset, "num_classes", None)   # torchvision's FakeData, and many a user's Dataset
        if num_classes is None and names is None and isinstance(own, int) and not isinstance(own, bool) and own > 0:
            num_classes = own
        num_classes = count_classes(names if num_classes is None else None, num_classes)
        self._classes_known = num_classes is not None  # as_label then checks labels against it
        targets = _label_column(getattr(dataset, "targets", None), n)
        known = targets is not None
        self.labels = check_labels(targets, f"{self.name}.targets", num_classes) if known \
            else np.full(n, -1, dtype=np.int64)  # unknown until loaded
        self.num_classes = num_classes or (int(self.labels.max()) + 1 if known else 0)
        if names is not None and len(names) == self.num_classes:
            self.classes = names
        self.mean = tuple(mean) if mean else (IMAGENET_MEAN if channels == 3 else (0.5,))
        self.std = tuple(std) if std else (IMAGENET_STD if channels == 3 else (0.5,))
        self.refusal_hint = ("memory and dali read arrays or files, not a Dataset's __getitem__: pass "
                             "ArraySource(images, labels) or an image folder (ImageFolder(root), or "
                             "ImageFolder.from_samples), or use the torch backend")

    def _first_image(self, tries: int = 16) -> tuple:
        """(the image of the first sample that can be read, its index): what decides the channels.
        One broken file at the start (a torchvision folder's first photo) must not refuse a dataset
        that ``on_error="skip"`` reads; when none of the first ``tries`` can be read, the first one's
        ``DecodeError``."""
        from ..errors import DecodeError

        failed = None
        for i in range(min(tries, len(self.dataset))):
            try:
                return self.read_pair(i)[0], i
            except DecodeError as e:
                failed = failed or e
        assert failed is not None
        raise failed

    @property
    def sample_transform(self):
        """The dataset's own per-sample transform (torchvision's ``transform``/``transforms``), or None."""
        ds = self.dataset
        transform = getattr(ds, "transform", None)
        if transform is not None:
            return transform
        joint = getattr(ds, "transforms", None)  # torchvision wraps transform/target_transform in one
        if joint is not None and type(joint).__name__ == "StandardTransform":
            return getattr(joint, "transform", None)   # a target_transform alone is not an image transform
        return joint

    def fingerprint(self) -> str:
        # A Dataset's data cannot be read cheaply from here: its type, length and targets.
        t = type(self.dataset)
        known = bool(len(self.labels)) and self.labels[0] >= 0
        return (f"{t.__module__}.{t.__qualname__} n={len(self)}"
                + (f" targets={crc(self.labels)}" if known else "") + self._subset_tag())

    def _take(self, idx: np.ndarray) -> None:
        self.labels = self.labels[idx]

    def dataset_index(self, i: int) -> int:
        """The index in ``dataset`` of this source's sample ``i`` (they differ for a subset).

        Args:
            i: an index of this source.
        """
        return int(self.indices[i]) if self.indices is not None else int(i)

    def fetch(self, ids) -> tuple[list, list[int]]:
        """(the dataset's samples for this source's ``ids``, their indices in ``dataset``), batched
        through ``__getitems__`` where the dataset offers it (one call, one lock, one seek pattern).
        A sample that cannot be read is the ``DecodeError`` naming it (``read_pair``).

        Args:
            ids: indices of this source.
        """
        pairs, kept = self.fetch_kept(ids)
        return pairs, [self.dataset_index(i) for i in kept]

    def fetch_kept(self, ids, on_error: "OnError | str" = "raise") -> tuple[list, list[int]]:
        """(the (image, label) pairs of this source's ``ids`` that could be read, those ids): ``fetch``
        with ``on_error``, which under "skip" leaves out a sample whose image cannot be read.

        Args:
            ids: indices of this source.
            on_error: ``"raise"`` or ``"skip"`` (or its ``OnError``).
        """
        from ..images.on_error import OnError

        on_error = OnError(on_error)
        ds = self.dataset
        if hasattr(ds, "__getitems__"):
            ds_ids = [self.dataset_index(i) for i in ids]
            try:
                samples = ds.__getitems__(ds_ids)
            except _unreadable():
                samples = None   # one sample of the batch: read them one by one to tell which
            if samples is not None:
                return self._batched(samples, ds_ids), [int(i) for i in ids]
        pairs, kept = [], []
        for i in ids:
            pair = on_error.attempt(self.read_pair, int(i))
            if pair is not None:
                pairs.append(pair)
                kept.append(int(i))
        return pairs, kept

    def _batched(self, samples, ds_ids: list[int]) -> list:
        """``__getitems__``'s result as pairs. torch's contract: a list of the samples (its default
        collate takes them one by one). A batch collated already, a dict, or a short list was zipped
        with the ids: the first refused as "[i] returned a Tensor", the last silently dropped samples."""
        call = f"{self.name}.__getitems__({len(ds_ids)} indices)"
        if not isinstance(samples, (list, tuple)) or len(samples) != len(ds_ids):
            raise TypeError(f"{call} returned {_what(samples)}; fastdata reads a list of {len(ds_ids)} (image, "
                            f"label) pairs from it, one per index, as torch's default collate does: return "
                            f"[self[i] for i in indices], or remove __getitems__")
        return [self.pair(sample, i, f"{call}[{k}]") for k, (sample, i) in enumerate(zip(samples, ds_ids))]

    def read_pair(self, i: int) -> tuple | list:
        """This source's sample ``i`` as an (image, label) pair, read through the dataset's
        ``__getitem__``. An image that cannot be read there (Pillow cannot identify or finish the file,
        the file is gone: an ``OSError``, or a decompression bomb) is the ``DecodeError`` naming the
        sample (``sample_name``), as a broken file is on every backend, so ``on_error="skip"`` skips it
        (a torchvision ImageFolder with a transform stays a Dataset, and its broken file ended the run).

        Args:
            i: an index of this source.
        """
        from ..errors import DecodeError

        index = self.dataset_index(i)
        try:
            sample = self.dataset[index]
        except _unreadable() as e:
            raise DecodeError(self.sample_name(i), f"{type(e).__name__}: {e}") from e
        return self.pair(sample, index)

    def sample_name(self, i: int) -> str:
        """What errors call sample ``i``: its file where the dataset lists files (a torchvision
        DatasetFolder's ``samples``), else ``Name[index in the dataset]``."""
        index = self.dataset_index(i)
        files = getattr(self.dataset, "samples", None)
        if isinstance(files, list) and len(files) == len(self.dataset) and isinstance(files[index], tuple) \
                and isinstance(files[index][0], (str, os.PathLike)):
            return os.fspath(files[index][0])
        return f"{self.name}[{index}]"

    def pair(self, sample, index: int, where: str | None = None) -> tuple | list:
        """``sample`` as the (image, label) pair every fastdata source yields; anything else (a dict, as
        Hugging Face datasets return, a triple, a bare image) is refused, naming the dataset and index
        (``where``: how the error names the call that returned it; None: ``dataset[index]``)."""
        if isinstance(sample, (tuple, list)) and len(sample) == 2:
            return sample
        raise TypeError(f"{where or f'{self.name}[{index}]'} returned {_what(sample)}; fastdata reads (image, "
                        f"label) pairs: wrap the dataset so that __getitem__ returns (image, label), e.g. "
                        f"(s['image'], s['label'])")

    def __getitem__(self, i):
        """The dataset's own sample for this source's sample ``i``.

        Args:
            i: an integer in ``[-len, len)``.
        """
        return self.dataset[self.dataset_index(self._index(i))]

    def _default_channels(self, first) -> int:
        """The channels when none were given (see the class docstring), from the first sample's kind."""
        if hasattr(first, "getbands"):
            # Photos come out RGB whatever the first one's mode, as torchvision's loader converts every
            # photo: ImageNet holds grey and CMYK JPEGs among its colour ones, and a grey first photo
            # must not make the colour ones after it an error. Only a dataset whose pixels are grey by
            # construction keeps one channel.
            return 1 if _grey_data(self.dataset) and not self._is_colour(first) else 3
        # Tensors and arrays have one shape for every sample (MNIST-like tensors stay grey).
        return 3 if self._is_colour(first) else 1

    def _is_colour(self, image) -> bool:
        """Whether a sample has colour: 3 or more bands, or a palette with a colour in use (a palette
        image has one band, but its entries are RGB: red stays red)."""
        if hasattr(image, "getbands"):
            if image.mode in ("P", "PA"):
                rgb = np.asarray(image.convert("RGB"))
                return not ((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all())
            return len(image.getbands()) >= 3
        return self._array(image).shape[-1] >= 3

    def _refuse_float(self, image, index=None) -> None:
        dtype = getattr(image, "dtype", None)
        if getattr(image, "mode", None) == "F":   # a float PIL image: its values would be clipped to 0..255
            dtype = "float32 (PIL mode 'F')"
        elif dtype is None or hasattr(image, "getbands") or not (
                getattr(dtype, "is_floating_point", False) or
                (isinstance(dtype, np.dtype) and np.issubdtype(dtype, np.floating))):
            return
        where = self.name if index is None else f"{self.name}[{index}]"
        # Said when the source is made, before any backend is named: memory and dali's way too.
        raise TypeError(f"{where} returned a {dtype} image; {EXPECTED_IMAGES}. "
                        f"{batch_backends_fix(batch_route(self.dataset))}")

    def _array(self, image) -> np.ndarray:
        """A tensor or array sample as uint8 (H, W, C): tensors are (C, H, W) or (H, W), torch's layout;
        numpy arrays (H, W, C) or (H, W), PIL's and numpy's (what ``np.asarray(pil_image)`` gives)."""
        import torch

        if isinstance(image, np.ndarray):
            if image.dtype != np.uint8:
                self._refuse_float(image)
                raise TypeError(f"{self.name} returned a {image.dtype} array; expected uint8 (H, W, C) or (H, W)")
            if image.ndim == 2:
                image = image[..., None]
            if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
                raise ValueError(f"{self.name} returned an array of shape {image.shape}; expected uint8 "
                                 f"(H, W, C) with C in (1, 3, 4), or (H, W) (a tensor is (C, H, W))")
            return image
        t = torch.as_tensor(image)
        if t.dtype != torch.uint8:
            raise TypeError(f"{self.name} returned a {t.dtype} tensor; {EXPECTED_IMAGES}")
        if self._hwc_tensors and t.dim() == 3:   # a fastdata source's sample: (H, W, C) already
            return t.numpy()
        if t.dim() == 2:
            t = t[None]
        if t.dim() != 3 or t.shape[0] not in (1, 3, 4):
            raise ValueError(f"{self.name} returned a tensor of shape {tuple(image.shape)}; expected uint8 "
                             f"(C, H, W) with C in (1, 3, 4), or (H, W) (an array is (H, W, C))")
        return t.permute(1, 2, 0).numpy()

    def as_array(self, image) -> np.ndarray:
        """One sample's image → uint8 (H, W, ``self.channels``), converted the same way for every sample.

        PIL images: any mode → RGB as ImageFolder does (grey replicated, alpha dropped, 16-bit scaled),
        or → L with Pillow's luma. Tensors: uint8 (C, H, W) or (H, W); grey is replicated to RGB, RGB(A)
        becomes grey exactly as Pillow's convert("L") computes it. A float tensor is refused, naming the
        fix (drop ToTensor/ToDtype/Normalize from the transform, pass mean=/std=; memory and dali's way
        as the class docstring says).

        Args:
            image: the dataset's sample image.
        """
        if hasattr(image, "getbands"):  # PIL image
            from ..images.photo import to_rgb

            self._refuse_float(image)
            if self.channels == 1 and not self._convert_colour and self._is_colour(image):
                self._refuse_colour(image.mode)
            arr = np.asarray(to_rgb(image) if self.channels == 3 else
                             (image if image.mode == "L" else to_rgb(image).convert("L")))
            return arr[..., None] if arr.ndim == 2 else arr
        arr = self._array(image)
        c = arr.shape[-1]
        if c == 4:  # alpha dropped, as to_rgb does for PIL images
            arr, c = arr[..., :3], 3
        if c == self.channels:
            return np.ascontiguousarray(arr)
        if self.channels == 3:  # grey → RGB: lossless
            return np.repeat(arr, 3, axis=-1)
        if not self._convert_colour:
            self._refuse_colour(f"{c}-channel tensor")
        rgb = arr.astype(np.uint32)  # Pillow's L conversion (Convert.c, L24), bit for bit
        luma = (rgb[..., 0] * 19595 + rgb[..., 1] * 38470 + rgb[..., 2] * 7471 + 0x8000) >> 16
        return luma.astype(np.uint8)[..., None]

    def as_label(self, label, index: int) -> int:
        """One sample's label → int, refusing what int() would silently change (1.7, NaN, -3, "2") and,
        when ``num_classes`` is known from the dataset, a label past the last class.

        Args:
            label: the dataset's sample label.
            index: the sample's index in the dataset, named in errors.
        """
        import torch

        if isinstance(label, torch.Tensor) and label.numel() == 1:
            label = label.item()
        if isinstance(label, np.generic):
            label = label.item()
        if isinstance(label, float) and label.is_integer():
            label = int(label)
        if isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"{self.name}[{index}] returned label {label!r}; labels must be integers >= 0")
        if self._classes_known and label >= self.num_classes:
            raise ValueError(f"{self.name}[{index}] returned label {label}; labels must be integers in "
                             f"[0, {self.num_classes}) ({self.name} has {self.num_classes} classes)")
        return label

    def _refuse_colour(self, what) -> None:
        raise ValueError(f"{self.name} returned a colour sample ({what}) but its first sample was grey, so "
                         f"the source has 1 channel; pass DatasetSource(dataset, channels=3) to keep colour "
                         f"(grey samples are replicated), or channels=1 to convert colour samples to grey")


# --------------------------------------------------------------------- what people already have
