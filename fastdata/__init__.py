"""fastdata: keep the GPU busy. ``make_loader(source, backend=...)`` → (images, labels) on the device;
``fastdata.pack(source, out)`` writes a dataset as tar shards, read back by ``fastdata.Shards(out)``."""
from .config import Augmentation, LoaderConfig
from .datasets import Shards
from .engine import FitConfig, evaluate, fit
from .errors import CacheDoesNotFit, DecodeError, MissingDependency
from .models import SmallCNN
from .registry import available_backends, make_loader

__version__ = "0.1.0"
__all__ = ["make_loader", "available_backends", "LoaderConfig", "Augmentation", "Shards", "pack", "fit", "FitConfig",
           "evaluate", "SmallCNN", "DecodeError", "CacheDoesNotFit", "MissingDependency", "__version__"]


def __getattr__(name: str):
    # pack is imported on first use: the writer (tarfile, its process pool, the command line) is not
    # needed to train, and `import fastdata` stays as fast as it was.
    if name == "pack":
        from .packing import pack

        return pack
    raise AttributeError(f"module 'fastdata' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"pack"})
