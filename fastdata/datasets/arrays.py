"""ArraySource: pixels already in memory (any uint8 (N, H, W[, C]) array with its labels)."""
from __future__ import annotations

import numpy as np

from ..config import Augmentation, SourceKind
from .base import Source, channel_stats, check_labels, count_classes, crc, float_pixels, host_array


def array_augmentation(train: bool, digits: bool, image_shape: tuple[int, int, int]) -> Augmentation:
    """The default recipe of images held as one array (``ArraySource.default_augmentation``, and
    ``Shards`` packed from arrays): digits, CIFAR-like or none."""
    if not train:
        return Augmentation.none()
    if digits:
        return Augmentation.digits_train()
    h, w, c = image_shape
    if c == 3 and min(h, w) > 4:
        return Augmentation.cifar_train()
    return Augmentation.none()


def take_images(images: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``images[idx]``; a run of consecutive ids is a view (no copy of a large array), anything else
    a gather."""
    contiguous = len(idx) > 0 and idx[-1] - idx[0] == len(idx) - 1 and (np.diff(idx) == 1).all()
    return images[idx[0]: idx[-1] + 1] if contiguous else images[idx]


class ArraySource(Source):
    """Decoded uint8 images in memory: (N, H, W) grey or (N, H, W, C).

    Args:
        images: uint8 array (numpy, or a torch tensor on any device: copied to the host).
        labels: integer labels, one per image, in ``[0, num_classes)``.
        mean, std: per-channel statistics in [0, 1] units; None → measured on the images.
        name: how messages and ``repr`` name the source.
        digits: small grey digits (use the digits augmentation recipe: translation, no flip).
        classes: class names, index = label; None → ``0 .. num_classes-1``.
        num_classes: None → ``len(classes)`` if given, else the largest label + 1. When known, a label
            outside ``[0, num_classes)`` is an error naming it.
    """

    kind = SourceKind.ARRAY
    hwc_samples = True

    def __init__(self, images, labels, *, mean=None, std=None, name: str = "array", digits: bool = False,
                 classes=None, num_classes: int | None = None):
        images, labels = host_array(images), host_array(labels)
        if images.dtype != np.uint8:
            fix = (" " + float_pixels(images, "(images{scale}).round().clip(0, 255).astype(np.uint8)")
                   if np.issubdtype(images.dtype, np.floating) else "")
            raise TypeError(f"images must be uint8, got {images.dtype}{fix}")
        if images.ndim == 3:
            images = images[..., None]
        if images.ndim != 4 or images.shape[-1] not in (1, 3):
            hint = ""
            if images.ndim == 4 and images.shape[1] in (1, 3):   # torch's layout, as a TensorDataset holds it
                hint = ("; this looks like (N, C, H, W), torch's layout: pass images.transpose(0, 2, 3, 1) "
                        "(a tensor: images.permute(0, 2, 3, 1))")
            elif images.ndim == 4 and images.shape[-1] == 4:
                hint = "; RGBA: drop the alpha channel (images[..., :3])"
            raise ValueError(f"images must be (N, H, W) or (N, H, W, C) with C in (1, 3), got {images.shape}{hint}")
        if labels.shape != (len(images),):
            raise ValueError(f"labels must have shape ({len(images)},), got {labels.shape}")
        if len(images) == 0:
            raise ValueError(f"{name}: no images")
        if images.shape[1] == 0 or images.shape[2] == 0:
            raise ValueError(f"images must have at least one pixel, got {images.shape[1]}x{images.shape[2]} "
                             f"images {images.shape}")
        num_classes = count_classes(classes, num_classes)
        labels = check_labels(labels, num_classes=num_classes)
        labels = labels if labels.flags.writeable else labels.copy()   # small: shared with torch freely
        # Contiguous, and never copied when it already is: a read-only array (np.load(mmap_mode="r"),
        # read_idx's frombuffer) is kept as it is, so a memmap larger than RAM stays on disk. Nothing
        # in fastdata writes to it; __getitem__ hands out a writable copy of such a sample.
        self.images = np.ascontiguousarray(images)  # (N, H, W, C)
        self.labels = labels
        self.name = name
        self.digits = digits
        self.channels = images.shape[-1]
        self.num_classes = num_classes if num_classes is not None else int(self.labels.max()) + 1
        self.classes = classes
        if mean is None or std is None:
            measured_mean, measured_std = channel_stats(self.images)
            mean = measured_mean if mean is None else mean
            std = measured_std if std is None else std
        self.mean, self.std = tuple(mean), tuple(std)

    def fingerprint(self) -> str:
        # Shape plus a CRC of the labels and of up to 64 evenly spaced images: tens of KB for MNIST,
        # a few MB for a cached photo set, so it is cheap to compute at every checkpoint.
        picks = np.linspace(0, len(self.images) - 1, min(64, len(self.images))).astype(np.int64)
        return (f"{type(self).__name__} n={len(self)} image={'x'.join(map(str, self.image_shape))} "
                f"crc={crc(self.labels, self.images[picks])}{self._subset_tag()}")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image."""
        return self.images.shape[1:]

    def default_augmentation(self, train: bool) -> Augmentation:
        """Training: digits (``digits=True``) → ``Augmentation.digits_train()`` (shifts of ±2 px, no flip);
        RGB images → ``Augmentation.cifar_train()`` (reflect-pad 4, random crop, flip), unless a side
        is 4 px or less, too small to reflect-pad by 4 (then none); grey images that are not digits →
        none (a flip or shift may change what a grey image means: give ``augment=`` to choose).
        Evaluation: none.

        Args:
            train: the training recipe (else the evaluation one).
        """
        return array_augmentation(train, self.digits, self.image_shape)

    def _take(self, idx: np.ndarray) -> None:
        self.images = take_images(self.images, idx)
        self.labels = self.labels[idx]

    def __getitem__(self, i):
        """(uint8 tensor (H, W, C), int label) of sample ``i``: the stored pixels, no augmentation.

        Args:
            i: an integer in ``[-len, len)``.
        """
        import torch

        i = self._index(i)
        image = self.images[i]
        # A read-only array's sample is copied (one image): torch.from_numpy warns on such buffers, and
        # a caller writing into the tensor would fault on a read-only memory map.
        return torch.from_numpy(image if image.flags.writeable else image.copy()), int(self.labels[i])
