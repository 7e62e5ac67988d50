"""The GPU run's gate (conftest): with ``FASTDATA_REQUIRE_CUDA`` set, a CUDA test that cannot run, or a
test whose GPU-path package (DALI, nvImageCodec) is missing, fails instead of skipping; without it both
skip, saying why. Checked in a child pytest that loads this suite's conftest as a plugin."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROBE = '''
import pytest
from conftest import skip_missing

@pytest.mark.cuda(devices=64)
def test_needs_many_gpus():
    pass

def test_needs_a_package():
    skip_missing("somepackage is not installed")
'''


def run_probe(tmp_path, required: str | None) -> str:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "FASTDATA_REQUIRE_CUDA"}
    if required is not None:
        env["FASTDATA_REQUIRE_CUDA"] = required
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_probe.py")], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    return proc.stdout + proc.stderr


def test_without_the_gate_both_skip_saying_why(tmp_path):
    out = run_probe(tmp_path, None)
    assert "2 skipped" in out, out
    assert "somepackage is not installed" in out and "CUDA GPU" in out, out


@pytest.mark.parametrize("gpus", ["64", "1"])
def test_with_the_gate_a_missing_package_fails(tmp_path, gpus):
    """A missing package fails whatever N; a CUDA test needing more GPUs than N still skips."""
    out = run_probe(tmp_path, gpus)
    assert "FASTDATA_REQUIRE_CUDA" in out and "somepackage is not installed" in out, out
    if gpus == "64":   # the CUDA test fails in its setup: pytest counts an error
        assert "1 failed" in out and "1 error" in out, out
    else:
        assert "1 failed, 1 skipped" in out, out
    assert "tests that could not run" in out and "test_probe.py::test_needs_a_package" in out, out
