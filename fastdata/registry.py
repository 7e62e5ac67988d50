"""make_loader: one name → backend table, imported lazily so that a missing extra only hurts its user."""
from __future__ import annotations

import importlib
import logging
from functools import lru_cache

from .config import LoaderConfig
from .datasets import as_source
from .errors import MissingDependency

log = logging.getLogger("fastdata")

# name → (module, class, the import that must work, how to install it)
BACKENDS = {
    "torch": ("fastdata.backends.torch_loader", "TorchLoader", None, None),
    "memory": ("fastdata.backends.memory", "MemoryLoader", None, None),
    "prefetch": ("fastdata.backends.prefetch", "PrefetchLoader", None, None),
    "dali": ("fastdata.backends.dali", "DaliLoader", "nvidia.dali.plugin.pytorch",
             "pip install nvidia-dali-cuda120  (or: pip install 'fastdata[dali]')"),
}
CHOICES = ("auto",) + tuple(BACKENDS)


@lru_cache(maxsize=None)
def _importable(module: str | None) -> bool:
    if module is None:
        return True
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def available_backends() -> list[str]:
    """Backend names usable here: ``auto`` plus those whose packages import. Feeds argparse ``choices``."""
    return ["auto"] + [name for name, (_, _, need, _) in BACKENDS.items() if _importable(need)]


def backend_class(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {list(CHOICES)}")
    module, cls, need, install = BACKENDS[name]
    if need is not None:
        try:
            importlib.import_module(need)
        except ImportError as e:
            raise MissingDependency(f"backend {name!r} needs {need.split('.')[0]}.{need.split('.')[1]}, "
                                    f"which does not import here ({e}); install it with: {install}") from e
    return getattr(importlib.import_module(module), cls)


def make_loader(source, backend: str = "auto", *, config: LoaderConfig | None = None, **kwargs):
    """Build a loader of ``(images, labels)`` batches on the device.

    Args:
        source: a fastdata source (MNIST, ImageFolder, SyntheticDigits, ArraySource), a map-style torch
            Dataset (torch/prefetch backends), or an ``(images, labels)`` pair of uint8 arrays.
        backend: one of ``available_backends()``; ``auto`` picks the fastest that fits and logs why.
        config: a LoaderConfig; keyword arguments that name its fields override it.
        **kwargs: LoaderConfig fields (batch_size, device, train, ...) and backend-specific options.
    """
    if not isinstance(backend, str) or backend not in CHOICES:
        raise ValueError(f"unknown backend {backend!r}; choose from {list(CHOICES)}")
    cfg, options = LoaderConfig.from_kwargs(config, kwargs)
    src = as_source(source)
    if backend == "auto":
        from .backends.auto import choose

        # auto passes each backend only the options it knows, so a misspelt one (prefetch_factr=4) must
        # be refused here, against every backend's options, or it would vanish without a word.
        known = set()
        for name in available_backends()[1:]:
            known |= set(backend_class(name).options)
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"backend 'auto' got unknown option(s) {unknown}; the backends' options are "
                            f"{sorted(known)} and the shared ones are LoaderConfig's fields")
        backend, reason = choose(src, cfg, options)
        log.info("fastdata: backend 'auto' picked %r: %s", backend, reason)
        options = {k: v for k, v in options.items() if k in backend_class(backend).options}
    return backend_class(backend)(src, cfg, **options)
