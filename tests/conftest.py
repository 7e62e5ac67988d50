"""Shared test data: every test makes its own, nothing is downloaded.

CUDA tests carry ``@pytest.mark.cuda`` (``@pytest.mark.cuda(devices=2)`` for more than one GPU). Without
a usable GPU they skip, saying why. ``FASTDATA_REQUIRE_CUDA=N`` (N >= 1: the GPUs the run must have)
turns those skips into failures: the first run on a GPU machine then cannot pass by skipping, and a
machine whose ``nvidia-smi`` lists GPUs that torch cannot use (a driver older than torch's CUDA build
needs) fails instead of quietly testing the CPU paths. Tests that need more GPUs than N still skip.
It also fails, instead of skipping, a test whose GPU-path package (DALI, nvImageCodec) does not import
(``skip_missing``; ``backend_params`` marks no backend skipped): a broken install there is a failure.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from fastdata import available_backends, registry
from fastdata.datasets import ArraySource, make_image_folder

BACKENDS = [b for b in available_backends()]
CONCRETE = [b for b in BACKENDS if b != "auto"]


def backend_params(*, auto: bool = False) -> list:
    """Every backend in the registry's table, for ``parametrize``: one whose package does not import here
    shows as skipped with its install hint, instead of silently dropping out of the run."""
    params = [pytest.param("auto", id="auto")] if auto else []
    for spec in registry.specs():
        # Under FASTDATA_REQUIRE_CUDA no skip mark: the test runs and fails on the missing package.
        marks = [] if spec.available or REQUIRED_GPUS else [pytest.mark.skip(reason=spec.unavailable_reason)]
        params.append(pytest.param(spec.name, marks=marks, id=spec.name))
    return params
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

MEAN, STD = (0.5,), (0.25,)


def _required_gpus() -> int:
    raw = os.environ.get("FASTDATA_REQUIRE_CUDA", "").strip()
    if raw in ("", "0"):
        return 0
    try:
        return max(1, int(raw))
    except ValueError:
        raise pytest.UsageError(f"FASTDATA_REQUIRE_CUDA={raw!r}: expected the number of GPUs the run "
                                f"must have (1, 2, ...) or 0") from None


REQUIRED_GPUS = _required_gpus()
CUDA_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvidia_smi_gpus() -> list[str]:
    """GPU names ``nvidia-smi -L`` lists (empty without the tool or a driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.splitlines() if line.startswith("GPU ")]


def cuda_unavailable_reason(devices: int = 1) -> str | None:
    """Why a test needing ``devices`` GPUs cannot run here, or None when it can."""
    if CUDA_GPUS >= devices:
        return None
    if CUDA_GPUS == 0:
        listed = nvidia_smi_gpus()
        if listed:
            return (f"nvidia-smi lists {len(listed)} GPU(s) but torch {torch.__version__} (built for CUDA "
                    f"{torch.version.cuda}) cannot use them: torch.cuda.is_available() is False; the "
                    f"driver is probably older than this CUDA build needs (see `python -m fastdata doctor`)")
        return "needs a CUDA GPU; this machine has none"
    return f"needs {devices} CUDA GPUs; this machine has {CUDA_GPUS}"


_NOT_RUN: list[str] = []


def skip_missing(reason: str, *, allow_module_level: bool = False):
    """Skip a test whose GPU-path package (DALI, nvImageCodec) is missing here, saying why; under
    ``FASTDATA_REQUIRE_CUDA`` fail instead: the GPU run must exercise those paths, and a broken install
    there (a DALI whose CUDA libraries do not load) must not pass by skipping."""
    if REQUIRED_GPUS:
        where = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] or "(collecting a module)"
        _NOT_RUN.append(f"{where}: {reason}")
        pytest.fail(f"FASTDATA_REQUIRE_CUDA={REQUIRED_GPUS}: cannot run: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=allow_module_level)


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("cuda")
    if marker is None:
        return
    devices = int(marker.kwargs.get("devices", 1))
    why = cuda_unavailable_reason(devices)
    if why is None:
        return
    if REQUIRED_GPUS >= devices:
        _NOT_RUN.append(item.nodeid)
        pytest.fail(f"FASTDATA_REQUIRE_CUDA={REQUIRED_GPUS}: this CUDA test cannot run: {why}", pytrace=False)
    pytest.skip(why)


def pytest_terminal_summary(terminalreporter):
    if _NOT_RUN:
        terminalreporter.section(f"FASTDATA_REQUIRE_CUDA={REQUIRED_GPUS}: tests that could not run")
        for line in _NOT_RUN:
            terminalreporter.write_line(line)
        terminalreporter.write_line(cuda_unavailable_reason(1) or "")


def label_of(ids):
    """The label written for sample id i: any fixed function works; this one is not the identity."""
    return (np.asarray(ids) * 7 + 3) % 10


def indexed_source(n: int = 1000, size: int = 8, channels: int = 1) -> ArraySource:
    """Samples whose pixels encode their id: pixel (0,0) = id % 256, (0,1) = id // 256, then a
    gradient that is the same for all. Labels are label_of(id)."""
    assert n < 65536
    ids = np.arange(n)
    images = np.tile(np.linspace(40, 200, size * size, dtype=np.uint8).reshape(size, size, 1),
                     (n, 1, 1, channels))
    images[:, 0, 0, :] = (ids % 256)[:, None]
    images[:, 0, 1, :] = (ids // 256)[:, None]
    return ArraySource(images, label_of(ids), mean=MEAN * channels, std=STD * channels, name="indexed")


def load_example(name: str):
    """examples/<name>.py as a module (registered in sys.modules first: dataclasses and pickle look a
    class's module up by name)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def file_bytes(path) -> tuple[bytes, str]:
    """(a file's bytes, its path): the arguments ``transforms.load_photo`` takes (sources own their bytes)."""
    with open(path, "rb") as f:
        return f.read(), str(path)


def decode_ids(images: torch.Tensor, mean=MEAN[0], std=STD[0]) -> np.ndarray:
    """Invert the normalization of indexed_source batches and read the ids back."""
    x = images.float().cpu()[:, 0, 0, :2] * std + mean
    px = torch.round(x * 255).long().numpy()
    return px[:, 0] + 256 * px[:, 1]


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory):
    """A small ImageNet-like JPEG folder: 3 classes x 6 photos of ~450x350 px."""
    return make_image_folder(tmp_path_factory.mktemp("photos"), classes=3, per_class=6, seed=1)


@pytest.fixture
def gpu_16g(monkeypatch):
    """torch.cuda's memory queries answering for a 16 GiB GPU; a test sets ``state["free"]`` (15 GiB at
    first), which differs between the ranks of a real job."""
    from types import SimpleNamespace

    state = {"free": 15 * 2**30}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=16 * 2**30))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (state["free"], 16 * 2**30))
    return state
