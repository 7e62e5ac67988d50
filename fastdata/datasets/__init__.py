"""Data sources. A source says what the samples are; backends decide how to load them fast.

Three kinds, which backends treat differently:
- ``ArraySource`` (MNIST, SyntheticDigits, CIFAR-like arrays, any uint8 array): pixels already in memory.
- ``ImageFolder``: encoded files on disk (JPEG/PNG), one sub-folder per class, or a given file list.
- ``DatasetSource``: any map-style torch Dataset returning (PIL image or uint8 tensor, int).

``as_source`` turns what people already have into one of these: torchvision's ImageFolder/DatasetFolder
become an ``ImageFolder`` over their file list, CIFAR10/100 and the MNIST family become an ``ArraySource``
over their arrays (so every backend reads them), a ``torch.utils.data.Subset`` becomes ``subset()`` of its
dataset's source. Every source has ``len``, ``classes``, ``num_classes``, ``__getitem__`` and ``subset``.

One module per format: ``base`` (the Source class and shared checks), ``arrays``, ``mnist`` (IDX files),
``digits`` (the synthetic set), ``folders`` (ImageFolder), ``torch_datasets`` (DatasetSource),
``sample_transforms`` (checks of torchvision transforms), ``adapters`` (as_source, split).
"""
from ..config import SourceKind
from .adapters import as_source, from_torchvision, split
from .arrays import ArraySource
from .base import IMAGENET_MEAN, IMAGENET_STD, Source, channel_stats, check_indices, check_labels
from .digits import SyntheticDigits, render_digits
from .folders import IMAGE_EXTENSIONS, ImageFolder, make_image_folder
from .mnist import MNIST, MNIST_FILES, read_idx
from .sample_transforms import check_sample_transform, check_transform_and_augment, transform_output
from .shards import Shards
from .torch_datasets import DatasetSource

__all__ = [
    "IMAGE_EXTENSIONS", "IMAGENET_MEAN", "IMAGENET_STD", "MNIST", "MNIST_FILES", "ArraySource", "DatasetSource",
    "ImageFolder", "Shards", "Source", "SourceKind", "SyntheticDigits", "as_source", "channel_stats", "check_indices",
    "check_labels", "check_sample_transform", "check_transform_and_augment", "from_torchvision",
    "make_image_folder", "read_idx", "render_digits", "split", "transform_output",
]
