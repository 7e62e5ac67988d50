"""``python -m fastdata doctor``: what this machine gives each backend."""
from __future__ import annotations

import platform
import shutil
import subprocess
from functools import lru_cache


@lru_cache(maxsize=None)
def pil_info() -> dict:
    """{'version', 'simd', 'avx2'}: Pillow-SIMD versions end in '.postN'; AVX2 is read off the binary.

    Pillow-SIMD exposes no flag for the instruction set it was built with, so the AVX2 check counts
    256-bit (ymm) instructions in ``PIL._imaging`` with objdump: an SSE4 build has none. None where
    objdump is missing.
    """
    import PIL
    from PIL import _imaging

    simd = ".post" in PIL.__version__
    avx2 = None
    objdump = shutil.which("objdump")
    if objdump:
        try:
            out = subprocess.run([objdump, "-d", "--no-show-raw-insn", _imaging.__file__],
                                 capture_output=True, text=True, timeout=60).stdout
            avx2 = "%ymm" in out
        except (OSError, subprocess.SubprocessError):
            avx2 = None
    return {"version": PIL.__version__, "simd": simd, "avx2": avx2}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dali_info() -> dict:
    try:
        import nvidia.dali as dali
    except Exception as e:
        return {"version": None, "gpu": False, "note": f"not installed ({type(e).__name__}); "
                                                         f"pip install nvidia-dali-cuda120"}
    import torch

    gpu = torch.cuda.is_available()
    return {"version": dali.__version__, "gpu": gpu,
            "note": "GPU pipelines (nvJPEG)" if gpu else "CPU-only pipelines (no CUDA device)"}


def report() -> dict:
    import numpy
    import torch
    import torchvision

    from .config import usable_cores
    from .registry import available_backends

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        "cuda_devices": devices,
        "bf16_supported": bool(devices) and torch.cuda.is_bf16_supported(),
        "cpu": cpu_model(), "usable_cores": usable_cores(),
        "pil": pil_info(), "dali": dali_info(),
        "backends": available_backends(),
    }


def main(argv=None) -> int:
    r = report()
    pil = r["pil"]
    flavour = ("Pillow-SIMD" + (" (AVX2)" if pil["avx2"] else " (SSE4, no AVX2)" if pil["avx2"] is False else "")
               if pil["simd"] else "Pillow (not SIMD: run ./install.sh to swap in Pillow-SIMD)")
    rows = [
        ("python", r["python"]),
        ("torch", f"{r['torch']} (built for CUDA {r['torch_cuda']})"),
        ("torchvision", r["torchvision"]),
        ("CUDA devices", ", ".join(r["cuda_devices"]) or "none (loaders run on the CPU)"),
        ("bf16 on GPU", r["bf16_supported"]),
        ("CPU", f"{r['cpu']}, {r['usable_cores']} usable cores"),
        ("PIL", f"{pil['version']}: {flavour}"),
        ("DALI", f"{r['dali']['version'] or '-'}: {r['dali']['note']}"),
        ("backends", ", ".join(r["backends"])),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
