"""Precision and speed switches of a run: which AMP mode (``choose_amp``, ``resolve_amp``), the autocast
context (``autocast``), ``torch.compile``'s mode (``resolve_compile``), cuDNN autotuning and TF32 for the run
only (``cuda_switches``), and the loader's GPU made current (``device_scope``)."""
from __future__ import annotations

import contextlib
import warnings

import torch

from ..checks import check_choice
from ..errors import user_stacklevel  # noqa: F401 (re-exported: engine.state warns with it)

AMP_CHOICES = ("auto", "bf16", "fp16", "off")


_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def choose_amp(amp: str, device_type: str, bf16_supported: bool = False) -> str:
    """The precision a run uses: ``"bf16"``, ``"fp16"`` or ``"off"``. A pure function of its arguments.

    ``"auto"``: on CUDA bf16 when the GPU supports it (Ampere and newer), else fp16 with loss scaling;
    on CPU off, because bf16 autocast made a small CNN 5.5x slower than fp32 on a CPU without AMX.
    ``"bf16"``, ``"fp16"``, ``"off"`` are honoured as given.
    """
    check_choice("amp", amp, AMP_CHOICES)
    if amp != "auto":
        return amp
    if device_type == "cuda":
        return "bf16" if bf16_supported else "fp16"
    return "off"


_WARNED_FP16_ON_CPU = False


def resolve_amp(amp: str, device: torch.device, *, warn: bool = True) -> str:
    """``choose_amp`` with this machine's capabilities filled in. ``warn``: say once per process that
    fp16 on the CPU is slow, at the user's line (``user_stacklevel``); ``report.run_result`` only records
    the mode."""
    device = torch.device(device)
    bf16 = False
    if device.type == "cuda":
        # is_bf16_supported() asks the *current* device (cuda:0 unless set), not necessarily ``device``.
        # Without emulation: pre-Ampere GPUs "support" bf16 only through slow emulated kernels.
        with torch.cuda.device(device):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    mode = choose_amp(amp, device.type, bf16)
    global _WARNED_FP16_ON_CPU
    if mode == "fp16" and device.type == "cpu" and warn and not _WARNED_FP16_ON_CPU:
        # Asked for, so honoured; but a run that silently takes 50x longer looks like a hang. Once: fit
        # evaluates every epoch with the same mode, and the warning said the same thing each time.
        _WARNED_FP16_ON_CPU = True
        warnings.warn("amp='fp16' on the CPU: torch's CPU kernels have few fp16 paths, and a SmallCNN step "
                      "measured about 50x slower than fp32 here (bf16 2x slower); use amp='off' (or 'bf16' on "
                      "a CPU with AMX)", RuntimeWarning, stacklevel=user_stacklevel())
    return mode


def autocast(device: torch.device, mode: str):
    """torch's autocast for ``mode`` (a ``resolve_amp`` result) on ``device``; disabled when ``mode`` is off."""
    # One code path for every precision: autocast disabled is a no-op context.
    return torch.autocast(device.type, dtype=_AMP_DTYPES.get(mode, torch.bfloat16), enabled=mode != "off")


#: ``fit(compile=...)``: off, ``torch.compile``'s default mode, or its CUDA-graph mode.
COMPILE_CHOICES = (False, True, "reduce-overhead")


def resolve_compile(compile, device) -> str | None:
    """``torch.compile``'s mode for ``fit(compile=...)`` on ``device``: None (not compiled), ``"default"``
    or ``"reduce-overhead"``.

    ``"reduce-overhead"`` records the step into CUDA graphs: for a small CNN a GPU step is a few hundred
    tiny kernels, and launching them from Python costs more than running them. CUDA graphs exist only on
    CUDA, so on the CPU it falls back to ``compile=True``, saying so in one line.
    """
    if not isinstance(compile, (bool, str)):   # 1 or "yes" taken as truthy would hide a typo
        raise TypeError(f"compile must be True, False or 'reduce-overhead', got {compile!r} "
                        f"({type(compile).__name__})")
    if isinstance(compile, str) and compile not in COMPILE_CHOICES:
        raise ValueError(f"compile must be True, False or 'reduce-overhead', got {compile!r}")
    if compile is False:
        return None
    if compile == "reduce-overhead" and torch.device(device).type != "cuda":
        warnings.warn(f"compile='reduce-overhead' (CUDA graphs) needs a CUDA device; on {torch.device(device)} "
                      f"fit compiles with compile=True instead", RuntimeWarning, stacklevel=user_stacklevel())
        return "default"
    return "default" if compile is True else "reduce-overhead"


@contextlib.contextmanager
def cuda_switches(device: torch.device, *, cudnn_benchmark: bool, tf32: bool):
    """Turn cuDNN autotuning and TF32 on for the block when ``device`` is CUDA; restore them after.

    These flags are process-wide: a library call that flipped them for good would change the numerics
    and the speed of everything else the process runs. A switch passed as False is not touched, so a
    caller who set it keeps their value; on the CPU nothing is touched.
    """
    if torch.device(device).type != "cuda" or not (cudnn_benchmark or tf32):
        yield
        return
    cudnn = torch.backends.cudnn
    saved_benchmark = cudnn.benchmark
    restore_tf32 = _enable_tf32() if tf32 else None
    if cudnn_benchmark:
        cudnn.benchmark = True
    try:
        yield
    finally:
        cudnn.benchmark = saved_benchmark
        if restore_tf32 is not None:
            restore_tf32()


def _enable_tf32():
    """Allow TF32 for fp32 matmuls and cuDNN; return a function that puts the caller's flags back.

    torch 2.9+ has two APIs for this: the legacy ``allow_tf32`` booleans and the ``fp32_precision``
    strings. Its legacy getters raise ("mix of the legacy and new APIs") when the two disagree, and
    torch reads both inside a run (inductor's conv template reads ``cudnn.allow_tf32``, its matmul
    code ``matmul.fp32_precision``). So TF32 is turned on through the legacy setters, which keep the
    two in agreement (cuDNN's covers conv and RNN alike), and the restore writes the legacy booleans
    first (where the caller's state let them be read) and then the exact ``fp32_precision`` strings:
    a legacy write alone would leave ``"ieee"`` where the caller had ``"none"`` (inherit).
    """
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    legacy = [(cudnn, "allow_tf32"), (matmul, "allow_tf32")]
    strings = [(cudnn.conv, "fp32_precision"), (cudnn.rnn, "fp32_precision"), (matmul, "fp32_precision")] \
        if hasattr(cudnn, "rnn") and hasattr(cudnn.rnn, "fp32_precision") else []  # torch < 2.9: none
    saved_legacy = [(owner, name, _read_flag(owner, name)) for owner, name in legacy]
    saved_strings = [(owner, name, getattr(owner, name)) for owner, name in strings]
    for owner, name in legacy:
        setattr(owner, name, True)

    def restore():
        for owner, name, value in saved_legacy:
            if value is not None:
                setattr(owner, name, value)
        for owner, name, value in saved_strings:
            setattr(owner, name, value)

    return restore


def _read_flag(owner, name):
    # A legacy TF32 getter raises when the caller mixed the two APIs: there is no boolean to restore.
    try:
        return getattr(owner, name)
    except RuntimeError:
        return None


def device_scope(device: torch.device):
    """``device`` made the current CUDA device for the block (a no-op context on the CPU)."""
    # The loader's GPU becomes the current device while fit runs: current_stream(),
    # is_bf16_supported() and a model's own torch.zeros(..., device="cuda") all mean the current
    # device, which is cuda:0 until something sets it. Restored on the way out.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
