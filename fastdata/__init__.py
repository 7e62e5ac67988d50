"""fastdata: keep the GPU busy. ``make_loader(source, backend=...)`` → (images, labels) on the device."""
from .config import Augmentation, LoaderConfig
from .engine import evaluate, fit
from .errors import CacheDoesNotFit, DecodeError, MissingDependency
from .models import SmallCNN
from .registry import available_backends, make_loader

__version__ = "0.1.0"
__all__ = ["make_loader", "available_backends", "LoaderConfig", "Augmentation", "fit", "evaluate",
           "SmallCNN", "DecodeError", "CacheDoesNotFit", "MissingDependency", "__version__"]
