"""fastdata as a user gets it: the wheel and the sdist built from this tree, installed away from the
checkout and run from another folder (nothing read beside the repository, no ``benchmarks``/``examples``
import), with the console script pyproject.toml declares."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source_tree(tmp: Path) -> Path:
    """A copy of what a build of the checkout reads. Not the checkout itself: setuptools' ``build/lib``
    there keeps modules an earlier build copied (a module since removed would ship), and a build in
    place leaves ``build/`` and ``*.egg-info`` behind."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "fastdata", src / "fastdata", ignore=junk)
    shutil.copytree(ROOT / "tests", src / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "data"))
    return src


def _build(kind: str, src: Path, out: Path, log: list | None = None) -> Path:
    """``build_wheel`` or ``build_sdist`` of pyproject.toml's backend (setuptools), as pip calls it;
    what the build printed is appended to ``log``."""
    code = f"import sys; from setuptools import build_meta; print(build_meta.build_{kind}(sys.argv[1]))"
    run = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    if log is not None:
        log.append(run.stdout + run.stderr)
    return out / run.stdout.strip().splitlines()[-1]


def _package_files(src: Path) -> set[str]:
    return {p.relative_to(src).as_posix() for p in (src / "fastdata").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    src = _source_tree(tmp)
    dist = tmp / "dist"
    dist.mkdir()
    log: list[str] = []
    return {"tmp": tmp, "src": src, "wheel": _build("wheel", src, dist, log), "sdist": _build("sdist", src, dist, log),
            "log": "\n".join(log)}


def test_the_build_uses_no_deprecated_configuration(built):
    """pyproject.toml's ``license = { text = ... }`` table: setuptools warned that builds with it stop
    being supported from 2027-02-18 (a user's ``pip install`` then fails)."""
    assert "DeprecationWarning" not in built["log"], built["log"][:3000]


def test_the_wheels_version_is_fastdata_version(built, tmp_path):
    """One version: pyproject.toml said 0.1.0 beside ``fastdata.__version__``, two numbers to bump together
    (a release bumping one shipped a wheel whose metadata and ``fastdata.__version__`` disagree)."""
    import fastdata

    assert built["wheel"].name.startswith(f"fastdata-{fastdata.__version__}-")
    src = tmp_path / "src"
    shutil.copytree(built["src"], src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    init = src / "fastdata" / "__init__.py"
    text = init.read_text()
    assert f'__version__ = "{fastdata.__version__}"' in text
    init.write_text(text.replace(f'__version__ = "{fastdata.__version__}"', '__version__ = "9.8.7"'))
    assert _build("wheel", src, tmp_path).name.startswith("fastdata-9.8.7-")


def test_the_wheel_holds_the_package_and_nothing_else(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        entry_points = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    package = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert package == _package_files(built["src"])      # every module, py.typed; no tests, benchmarks, caches
    assert "fastdata/py.typed" in package
    assert "fastdata = fastdata.__main__:main" in entry_points
    # The license pyproject.toml declares travels with the package (setuptools >= 77 ships LICENSE*).
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_the_sdist_has_no_test_suite_that_cannot_run(built):
    """setuptools put tests/test_*.py in the sdist, without conftest.py and the helpers they import."""
    with tarfile.open(built["sdist"]) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    assert not [n for n in names if n.startswith("tests")]
    assert {"pyproject.toml", "README.md", "LICENSE", "fastdata/__init__.py", "fastdata/py.typed"} <= set(names)


def test_the_sdist_builds_the_same_wheel(built, tmp_path):
    with tarfile.open(built["sdist"]) as sdist:
        sdist.extractall(tmp_path, filter="data")
    (unpacked,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    again = _build("wheel", unpacked, tmp_path)
    with zipfile.ZipFile(built["wheel"]) as a, zipfile.ZipFile(again) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
        for name in a.namelist():
            assert a.read(name) == b.read(name), name


SMOKE = textwrap.dedent("""
    import os, sys
    import numpy as np
    from PIL import Image
    import fastdata
    from fastdata import SmallCNN, available_backends, fit, make_loader, pack
    from fastdata.datasets import ImageFolder, Shards, SyntheticDigits
    assert fastdata.__file__.startswith(sys.argv[1]), fastdata.__file__   # the wheel's, not the checkout's
    for i in range(16):
        os.makedirs(f"photos/{i % 2}", exist_ok=True)
        Image.fromarray(np.full((20, 24, 3), i * 9, np.uint8)).save(f"photos/{i % 2}/{i}.jpg")
    for backend in available_backends():   # dali too where it is installed
        for source in (SyntheticDigits(64), ImageFolder("photos")):
            loader = make_loader(source, backend=backend, batch_size=8, device="cpu", quiet=True,
                                 **({"cache_size": 24} if backend == "memory" else {}))
            assert sum(len(y) for _, y in loader) == len(source), (backend, source)
            loader.close()
    history = fit(SmallCNN(), make_loader(SyntheticDigits(64), backend="memory", batch_size=32, device="cpu"),
                  epochs=1, checkpoint="c.pt", log_dir="log", progress=False)
    assert len(history) == 1 and os.path.isfile("c.pt") and os.path.isfile("log/epochs.csv")
    pack(SyntheticDigits(20), "packed", progress=False)
    assert sorted(int(y) for y in Shards("packed").labels) == sorted(int(y) for y in SyntheticDigits(20).labels)
    print("wheel ok")
""")


def test_the_installed_wheel_runs_away_from_the_checkout(built, tmp_path):
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                          str(site), str(built["wheel"])], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    smoke = subprocess.run([sys.executable, "-c", SMOKE, str(site)], cwd=work, env=env, capture_output=True,
                           text=True, timeout=300)
    assert smoke.returncode == 0 and "wheel ok" in smoke.stdout, smoke.stderr[-3000:]
    script = subprocess.run([str(site / "bin" / "fastdata"), "pack", "--help"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=120)
    assert script.returncode == 0, script.stderr[-3000:]
    # The console script is what a pip user has: its usage says so (it said "python -m fastdata").
    assert script.stdout.startswith("usage: fastdata pack"), script.stdout[:200]
    doctor = subprocess.run([sys.executable, "-m", "fastdata", "doctor"], cwd=work, env=env, capture_output=True,
                            text=True, timeout=120)
    assert "backends" in doctor.stdout, doctor.stdout + doctor.stderr[-2000:]


def test_the_doctors_pillow_rebuild_hint_serves_a_pip_install(monkeypatch, capsys):
    """The Pillow-SIMD built without an image library said only 'run ./install.sh again', which someone
    who installed the wheel has not."""
    from fastdata import doctor

    monkeypatch.setattr(doctor, "pil_info", lambda: {"version": "9.5.0.post2", "simd": True, "avx2": True,
                                                     "cannot_read": ["WebP (libwebp-dev)"]})
    doctor.main()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("PIL"))
    assert "pip install --force-reinstall --no-deps --no-cache-dir pillow-simd, with CC='cc -mavx2'" in line
