"""Shared test data: every test makes its own, nothing is downloaded.

CUDA tests carry ``@pytest.mark.cuda`` (``@pytest.mark.cuda(devices=2)`` for more than one GPU). Without
a usable GPU they skip, saying why. ``FASTDATA_REQUIRE_CUDA=N`` (N >= 1: the GPUs the run must have)
turns those skips into failures: the first run on a GPU machine then cannot pass by skipping, and a
machine whose ``nvidia-smi`` lists GPUs that torch cannot use (a driver older than torch's CUDA build
needs) fails instead of quietly testing the CPU paths. Tests that need more GPUs than N still skip.
It also fails, instead of skipping, a test whose GPU-path package (DALI, nvImageCodec) does not import
(``skip_missing``; ``backend_params`` marks no backend skipped): a broken install there is a failure.

Optional libraries (an extra of pyproject.toml: Lightning, accelerate, timm, TensorBoard, webdataset,
moto, fsspec, s3fs...) go through ``require(module)`` (or ``@pytest.mark.requires(module)`` for a whole
module): missing, a test skips with a reason that names the extra to install. In CI (``CI=true``, which
``.ci/run`` gets) or under ``FASTDATA_REQUIRE_EXTRAS=1`` it fails instead: a broken install must not pass
CI by skipping (``FASTDATA_REQUIRE_EXTRAS=0`` lets a CI job without the extras skip them). A test that
imports such a library directly, or through ``pytest.importorskip``, is held to the same rule.
"""
from __future__ import annotations

import contextlib
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


#: The optional libraries the tests use, each with the extra (pyproject.toml) that installs it.
EXTRAS = {"lightning": "integrations", "accelerate": "integrations", "timm": "integrations",
          "tensorboard": "integrations", "ray": "integrations",
          "webdataset": "dev", "moto": "dev", "matplotlib": "dev", "mypy": "dev",
          "fsspec": "shards", "aiohttp": "shards", "s3fs": "shards"}


def _extras_required() -> bool:
    raw = os.environ.get("FASTDATA_REQUIRE_EXTRAS", "").strip().lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("0", "false", "no"):
        return False
    if raw:
        raise pytest.UsageError(f"FASTDATA_REQUIRE_EXTRAS={raw!r}: expected 1 (a missing optional library "
                                f"fails its tests) or 0 (it skips them)")
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


REQUIRE_EXTRAS = _extras_required()


def missing_extra(module: str, error: BaseException | str):
    """A test cannot run without the optional ``module``: skip, naming the extra that installs it; in CI or
    under FASTDATA_REQUIRE_EXTRAS=1 fail (the extras are installed there: missing, the install is broken)."""
    extra = EXTRAS.get(module.split(".")[0])
    how = f"pip install -e '.[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
    reason = f"needs {module} ({error}): {how}" + (f" (the '{extra}' extra)" if extra else "")
    if REQUIRE_EXTRAS:
        where = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] or "(collecting a module)"
        _MISSING.append(f"{where}: {reason}")
        pytest.fail(f"a missing optional library fails in CI (FASTDATA_REQUIRE_EXTRAS=0 to skip): {reason}",
                    pytrace=False)
    pytest.skip(reason)


def require(module: str):
    """``module`` imported (``require("timm.loss")``), or the test skips or fails as ``missing_extra``
    says. An installed library that raises ImportError at import (a dependency of its own missing) is
    missing too; any other error at import is raised. Inside a test or fixture only: a whole module says
    ``pytestmark = pytest.mark.requires(...)`` (a failure while collecting would stop the whole run)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing_extra(module, e)


def optional(module: str):
    """``module`` imported, or a stand-in whose attributes are empty classes, so that a test module can
    define its subclasses (``class M(L.LightningModule)``) without the library and mark its tests
    ``requires``: each then skips or fails on its own, instead of the module turning into one skip line."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        class StandIn:
            def __getattr__(self, name):
                return type(name, (), {"__module__": f"{module} (not installed)"})

        return StandIn()


_MISSING: list[str] = []


def _optional_module_of(error: BaseException) -> str | None:
    """The optional library a test failed to import: a ModuleNotFoundError of one of EXTRAS that is not
    installed, or a skip raised by ``pytest.importorskip`` (its frame holds the module's name). An
    installed one is a real error: a test that hides it (``sys.modules[name] = None``) to check that
    fastdata does without it must fail when fastdata imports it after all."""
    from importlib.machinery import PathFinder

    if isinstance(error, ModuleNotFoundError) and error.name and error.name.split(".")[0] in EXTRAS:
        return None if PathFinder.find_spec(error.name.split(".")[0]) is not None else error.name
    if isinstance(error, pytest.skip.Exception):
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and tb.tb_frame.f_code.co_name == "importorskip":
            return str(tb.tb_frame.f_locals.get("modname", "?"))
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The same rule for a test that imports an optional library without ``require``."""
    try:
        return (yield)
    except (ModuleNotFoundError, pytest.skip.Exception) as e:
        module = _optional_module_of(e)
        if module is None or (isinstance(e, pytest.skip.Exception) and not REQUIRE_EXTRAS):
            raise
        missing_extra(module, e)


def pytest_runtest_setup(item):
    for marker in item.iter_markers("requires"):
        for module in marker.args:
            require(module)
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
    if _MISSING:
        terminalreporter.section("optional libraries missing (CI or FASTDATA_REQUIRE_EXTRAS=1: failures)")
        for line in _MISSING:
            terminalreporter.write_line(line)
    if _NOT_RUN:
        terminalreporter.section(f"FASTDATA_REQUIRE_CUDA={REQUIRED_GPUS}: tests that could not run")
        for line in _NOT_RUN:
            terminalreporter.write_line(line)
        terminalreporter.write_line(cuda_unavailable_reason(1) or "")


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (a few bytes of data): a decompression bomb's header."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def pairs(a, b):
    """The batches of two loaders (or any two iterables), read whole, paired one to one: both must hold
    the same number, and at least one. A bare ``zip`` stops at the shorter, so a loader that yielded no
    batch, or only its first, would pass a comparison with one that yielded them all."""
    a, b = list(a), list(b)
    assert a and len(a) == len(b), f"{len(a)} batches against {len(b)}"
    return list(zip(a, b, strict=True))


NOBODY = 65534   # uid and gid of "nobody"


class ChildTraceback(Exception):
    """The traceback of an error raised in ``run_as_nobody``'s child, shown as the cause of that error."""


def _nobody_child(writer, fn, args) -> None:
    import pickle
    import traceback

    try:
        # Root's supplementary groups go too; the gid before the uid (as nobody, setgid is refused).
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        outcome = ("returned", fn(*args))
    except BaseException as e:  # sent, not raised: the parent raises it
        outcome = ("raised", e, traceback.format_exc())
    try:
        pickle.loads(pickle.dumps(outcome))   # what the parent will unpickle: fail here, with a message
    except Exception as e:
        outcome = ("unsendable", f"{outcome[0]} {type(outcome[1]).__name__}: {outcome[1]!r} ({e})",
                   outcome[-1] if outcome[0] == "raised" else "")
    writer.send(outcome)
    writer.close()


def run_as_nobody(fn, *args, timeout: float = 60):
    """``fn(*args)`` in a forked child that first gives up root for uid and gid nobody (when this process
    is root, as in CI; otherwise it runs as this user): what it returned, or the exception it raised,
    raised here with the child's traceback as its cause. Root writes anywhere, so a test of what a user's
    read-only folder does runs its code through this, against a root-owned folder. Forked: ``fn`` and
    ``args`` need not pickle, but what comes back must (a result or error that does not is reported as
    such); modules ``fn`` imports on the way should be imported before, as nobody may not read them."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    # A pipe, read before the join: through a queue, the child's exit waits for its feeder thread, which
    # blocks on a large item until the parent reads it. The child holds the only write end once the
    # parent closes its own, so a child that dies without a word reads as end-of-file, not a hang.
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_nobody_child, args=(writer, fn, args))
    child.start()
    writer.close()
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        if not reader.poll(timeout):
            child.kill()
            raise AssertionError(f"{name} as uid {NOBODY} did not finish in {timeout} s")
        outcome = reader.recv()
    except EOFError:
        child.join(timeout)
        raise AssertionError(f"{name} as uid {NOBODY}: the child exited (code {child.exitcode}) "
                             f"without reporting a result") from None
    finally:
        reader.close()
        child.join(timeout)
    if outcome[0] == "returned":
        return outcome[1]
    if outcome[0] == "unsendable":
        raise AssertionError(f"{name} as uid {NOBODY}: cannot send back {outcome[1]}\n{outcome[2]}")
    raise outcome[1] from ChildTraceback(f"in the child, as uid {NOBODY}:\n{outcome[2]}")


@contextlib.contextmanager
def sync_debug_error():
    """torch's sync debug mode "error" inside (any host sync in any thread: .item(), a pageable copy,
    nonzero, a stream or device synchronize raises), the mode from before restored after."""
    import torch

    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def batches_without_host_sync(loader) -> int:
    """One warm epoch (workers, pinned and device pools, draws made ahead), then one under
    ``sync_debug_error``: returns that epoch's batch count, which must be ``len(loader)``."""
    import torch

    for _ in loader:
        pass
    torch.cuda.synchronize()
    with sync_debug_error():
        return sum(1 for _ in loader)


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
    """(a file's bytes, its path): the arguments ``images.photo.load_photo`` takes (sources own their bytes)."""
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
