"""``python -m fastdata doctor``: what this machine gives each backend.

The GPU lines tell the truth when torch cannot use a GPU that the machine has: a driver older than the
CUDA runtime torch was built for makes ``torch.cuda.is_available()`` quietly False, and every loader then
runs on the CPU. The doctor asks the driver itself (``nvidia-smi``) and says which of the two is wrong.
"""
from __future__ import annotations

import platform
import shutil
import subprocess
from functools import lru_cache

# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA Toolkit release notes, table
# "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version Compatibility"): any torch
# built for CUDA 13.x needs >= 580, for 12.x >= 525, for 11.x >= 450. An older driver makes
# torch.cuda.is_available() False without an error.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


#: The image libraries a Pillow wheel bundles and a source build (Pillow-SIMD's) links only where their
#: headers were found; without one, Pillow cannot read its files. Feature name -> what is lost (the
#: Debian/Ubuntu package that provides the headers).
PIL_LIBRARIES = {"webp": "WebP (libwebp-dev)", "libtiff": "compressed TIFF (libtiff-dev)",
                 "jpg_2000": "JPEG 2000 (libopenjp2-7-dev)", "littlecms2": "ICC profiles (liblcms2-dev)"}


def pil_cannot_read() -> list[str]:
    """What this Pillow cannot read (``PIL_LIBRARIES``' values for the libraries it was built without)."""
    from PIL import features

    return [lost for feature, lost in PIL_LIBRARIES.items() if not features.check(feature)]


@lru_cache(maxsize=None)
def pil_info() -> dict:
    """{'version', 'simd', 'avx2', 'cannot_read'}: Pillow-SIMD versions end in '.postN'; AVX2 is read off
    the binary; ``cannot_read``: ``pil_cannot_read()``.

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
    return {"version": PIL.__version__, "simd": simd, "avx2": avx2, "cannot_read": pil_cannot_read()}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_smi() -> dict | None:
    """{'driver': '580.65.06', 'gpus': [names]} from ``nvidia-smi``; None without the tool or a driver
    that answers (no NVIDIA GPU here)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        run = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(run.stdout) if run.returncode == 0 else None


def parse_nvidia_smi(text: str) -> dict | None:
    """``name, driver_version`` lines (nvidia-smi's csv without header) → {'driver', 'gpus'}."""
    gpus, driver = [], None
    for line in text.splitlines():
        name, sep, version = line.rpartition(",")
        if sep and name.strip():
            gpus.append(name.strip())
            driver = version.strip()
    return {"driver": driver, "gpus": gpus} if gpus else None


def _version(text) -> tuple[int, ...]:
    parts = []
    for p in str(text).split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def gpu_verdict(smi: dict | None, torch_cuda: str | None, usable: int) -> tuple[bool, str]:
    """(torch can use the machine's GPUs, or it has none; the sentence that says so).

    Args:
        smi: ``nvidia_smi()``'s answer (None: no NVIDIA driver/GPU).
        torch_cuda: ``torch.version.cuda``, the CUDA runtime torch was built for (None: a CPU build).
        usable: ``torch.cuda.device_count()`` when ``torch.cuda.is_available()``, else 0.
    """
    if usable:
        return True, f"{usable} GPU(s) usable by torch (CUDA {torch_cuda})"
    if smi is None or not smi["gpus"]:
        return True, "no NVIDIA GPU (nvidia-smi absent or lists none): the loaders run on the CPU"
    listed = f"nvidia-smi lists {len(smi['gpus'])} GPU(s) but torch cannot use them"
    if torch_cuda is None:
        return False, f"{listed}: this torch is a CPU-only build; install a CUDA build of torch"
    major = _version(torch_cuda)[:1]
    need = MIN_DRIVER.get(major[0]) if major else None
    have = _version(smi["driver"])
    if need is not None and have and have < need:
        return False, (f"{listed}: driver {smi['driver']} is too old for torch built for CUDA {torch_cuda}, "
                       f"which needs driver >= {'.'.join(map(str, need))}; torch.cuda.is_available() is "
                       f"False. Upgrade the NVIDIA driver, or install a torch built for an older CUDA")
    return False, (f"{listed} although driver {smi['driver']} is recent enough for CUDA {torch_cuda}: "
                   f"check CUDA_VISIBLE_DEVICES, the /dev/nvidia* device permissions, and that the "
                   f"container was started with GPU access")


def dali_info() -> dict:
    """DALI's version and whether it runs GPU or CPU-only pipelines here (or why it does not import)."""
    try:
        import nvidia.dali as dali
    except Exception as e:
        return {"version": None, "gpu": False, "note": f"not installed ({type(e).__name__}); "
                                                         f"pip install 'fastdata[dali]' (nvidia-dali-cuda120)"}
    import torch

    gpu = torch.cuda.is_available()
    return {"version": dali.__version__, "gpu": gpu, "cuda_major": dali_cuda_major(),
            "note": "GPU pipelines (nvJPEG)" if gpu else "CPU-only pipelines (no CUDA device)"}


def dali_cuda_major() -> int | None:
    """The CUDA major version of the installed DALI wheel, read off its distribution name
    (``nvidia-dali-cuda120`` → 12): DALI bundles its own CUDA runtime, so its driver needs can
    differ from torch's."""
    from importlib import metadata

    for major in (13, 12, 11):
        try:
            metadata.version(f"nvidia-dali-cuda{major}0")
        except metadata.PackageNotFoundError:
            continue
        return major
    return None


def _region_status() -> str:
    """Whether photo crops decode only their window (torch/prefetch/memory's JPEG path), and if not,
    why and how to get it; the switch ``FASTDATA_REGION_DECODE=0`` is reported too."""
    from .images.photo import region_decode_enabled
    from .images.region import region_decoder_status

    status = region_decoder_status()
    if status.startswith("available") and not region_decode_enabled():
        return "off (FASTDATA_REGION_DECODE=0): " + status
    return status if status.startswith("available") else status + "; crops decode the whole JPEG (Image.draft)"


def report() -> dict:
    """Everything ``python -m fastdata doctor`` prints, as a dict (versions, devices, driver verdict, backends)."""
    import numpy
    import torch
    import torchvision

    from . import registry
    from .config import usable_cores

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    smi = nvidia_smi()
    gpu_ok, gpu_note = gpu_verdict(smi, torch.version.cuda, len(devices))
    return {
        "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        "nvidia_driver": smi["driver"] if smi else None, "nvidia_gpus": smi["gpus"] if smi else [],
        "gpu_ok": gpu_ok, "gpu_note": gpu_note,
        "cuda_devices": devices,
        # Native bf16 only: with emulation (the default) a pre-Ampere GPU says True and runs bf16
        # matmuls far slower than fp16.
        "bf16_supported": bool(devices) and torch.cuda.is_bf16_supported(including_emulation=False),
        "cpu": cpu_model(), "usable_cores": usable_cores(),
        "pil": pil_info(), "dali": dali_info(),
        "region_decode": _region_status(),
        "backends": registry.available_backends(),
        "backend_table": backend_table(),
    }


def backend_table() -> list[dict]:
    """The registry's rows as the doctor shows them: installed or not (with the install hint), and
    where ``auto`` may pick each."""
    from . import registry

    return [{"name": s.name, "available": s.available, "needs": s.needs, "install": s.install,
             "order": s.order, "devices": list(s.devices)} for s in registry.specs()]


def auto_order(table: list[dict], device_type: str) -> str:
    """``auto``'s preference on one device type, e.g. 'memory > dali > prefetch > torch'."""
    rows = sorted((r for r in table if device_type in r["devices"]), key=lambda r: r["order"])
    return " > ".join(r["name"] if r["available"] else f"({r['name']}: not installed)" for r in rows)


def _dali_build(dali: dict) -> str:
    major = dali.get("cuda_major")
    if major is None:
        return ""
    need = MIN_DRIVER.get(major)
    return f" (CUDA {major} build, needs driver >= {'.'.join(map(str, need))})" if need else f" (CUDA {major} build)"


def main(argv=None) -> int:
    """Print the report; exit status 1 when the machine has GPUs that torch cannot use."""
    r = report()
    pil = r["pil"]
    flavour = ("Pillow-SIMD" + (" (AVX2)" if pil["avx2"] else " (SSE4, no AVX2)" if pil["avx2"] is False else "")
               if pil["simd"] else "Pillow (not SIMD: ./install.sh swaps in Pillow-SIMD; installed with pip: "
                                   "pip uninstall -y pillow && pip install --no-deps pillow-simd, with CC='cc -mavx2' "
                                   "where the CPU has AVX2)")
    if pil.get("cannot_read"):
        # A source build (install.sh's Pillow-SIMD) links only the libraries whose headers it found.
        flavour += (f"; built without {', '.join(pil['cannot_read'])}: such files are refused by name "
                    "(install those packages, then run ./install.sh again in a fastdata checkout, or rebuild it: "
                    "pip install --force-reinstall --no-deps --no-cache-dir pillow-simd, with CC='cc -mavx2' where "
                    "the CPU has AVX2)")
    rows = [
        ("python", r["python"]),
        ("torch", f"{r['torch']} (built for CUDA {r['torch_cuda']})" if r["torch_cuda"]
         else f"{r['torch']} (CPU-only build)"),
        ("torchvision", r["torchvision"]),
        ("NVIDIA driver", f"{r['nvidia_driver']} ({len(r['nvidia_gpus'])} GPU(s): {', '.join(r['nvidia_gpus'])})"
         if r["nvidia_driver"] else "none (nvidia-smi not found or lists no GPU)"),
        ("CUDA devices", ", ".join(r["cuda_devices"]) or "none (loaders run on the CPU)"),
        ("GPU verdict", ("ok: " if r["gpu_ok"] else "PROBLEM: ") + r["gpu_note"]),
        ("bf16 on GPU", "yes (native)" if r["bf16_supported"] else "no" if r["cuda_devices"] else "-"),
        ("CPU", f"{r['cpu']}, {r['usable_cores']} usable cores"),
        ("PIL", f"{pil['version']}: {flavour}"),
        ("DALI", f"{r['dali']['version'] or '-'}{_dali_build(r['dali'])}: {r['dali']['note']}"),
        ("region decode", r["region_decode"]),
        ("backends", ", ".join(r["backends"])),
    ]
    rows += [(f"  {b['name']}", "ok" if b["available"] else f"not installed ({b['needs']} does not import): "
              f"{b['install'] or 'install its package'}") for b in r["backend_table"]]
    rows += [(f"auto on {t}", auto_order(r["backend_table"], t) + " (first that fits)") for t in ("cpu", "cuda")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if r["gpu_ok"] else 1
