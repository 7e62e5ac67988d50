"""``auto``: pick the fastest backend that fits, and say why.

Order, from what the benchmarks measure (benchmarks/results): ``memory`` (no per-epoch decoding at
all; on a 2-core CPU 2,100 JPEG-sized images/s against 1,100-1,250 for the decoding backends) when
its cache fits in the device's free memory; else ``dali`` on CUDA when DALI imports (nvJPEG decodes
on the GPU); else ``prefetch`` on CUDA (copies overlap compute); else ``torch``. Torch Datasets (arbitrary Python
``__getitem__``) can only be read by the torch-based backends.
"""
from __future__ import annotations

from . import memory
from .memory import FIT_FRACTION, _fmt, cache_bytes


def choose(source, config) -> tuple[str, str]:
    """(backend name, reason) for ``source`` under ``config``."""
    from ..registry import _importable

    cuda = config.device.type == "cuda"
    if source.kind == "dataset":
        return ("prefetch" if cuda else "torch"), "a torch Dataset is read by the DataLoader-based backends"
    dali = _importable("nvidia.dali.plugin.pytorch")
    need, free = cache_bytes(source, config), memory.free_bytes(config.device)
    where = f"GPU {config.device}" if cuda else "RAM"
    if need <= FIT_FRACTION * free:
        return "memory", f"its uint8 cache ({_fmt(need)}) fits in the free {where} ({_fmt(free)})"
    why = f"the cache ({_fmt(need)}) does not fit in the free {where} ({_fmt(free)})"
    if cuda and dali:
        return "dali", why + "; DALI decodes and augments on the GPU"
    if cuda:
        return "prefetch", why + " and DALI is not installed"
    return "torch", why + "; on the CPU the worker processes do the decoding"
