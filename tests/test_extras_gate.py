"""The optional libraries' gate (conftest): a test that needs a library of an extra skips without it,
naming the extra to install; in CI (``CI=true``) or under ``FASTDATA_REQUIRE_EXTRAS=1`` it fails, so a
broken install cannot pass CI by skipping. Every way a test asks for the library is held to the same
rule. Checked in a child pytest that loads this suite's conftest as a plugin."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PROBE = '''
import sys

import pytest

import conftest
from conftest import optional, require

conftest.EXTRAS["fastdata_absent_lib"] = "dev"     # a library of the 'dev' extra, not installed here
lib = optional("fastdata_absent_lib")


class Writer(lib.ShardWriter):        # a module defining subclasses still imports
    pass


@pytest.mark.requires("fastdata_absent_lib")
def test_marked():
    pass


def test_required():
    require("fastdata_absent_lib")


def test_imported_directly():
    import fastdata_absent_lib  # noqa: F401


def test_importorskip():
    pytest.importorskip("fastdata_absent_lib")


def test_a_missing_module_of_no_extra_is_an_error_as_ever():
    import fastdata_no_such_module  # noqa: F401


def test_an_installed_library_that_a_test_hid_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "webdataset", None)    # as a test that checks fastdata does without it
    import webdataset  # noqa: F401
'''


def run_probe(tmp_path, **env_vars) -> str:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FASTDATA_REQUIRE_EXTRAS")}
    env.update(env_vars)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_probe.py")], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    return proc.stdout + proc.stderr


def test_without_ci_each_test_skips_naming_the_extra(tmp_path):
    out = run_probe(tmp_path)
    assert "2 failed, 4 skipped" in out, out
    # importorskip keeps its own words; the other three name the extra
    assert "SKIPPED [3]" in out and "needs fastdata_absent_lib" in out, out
    assert "pip install -e '.[dev]' (the 'dev' extra)" in out, out
    assert "FAILED test_probe.py::test_a_missing_module_of_no_extra_is_an_error_as_ever" in out, out
    assert "FAILED test_probe.py::test_an_installed_library_that_a_test_hid_is_an_error" in out, out


@pytest.mark.parametrize("env", [{"CI": "true"}, {"FASTDATA_REQUIRE_EXTRAS": "1"}], ids=["CI", "REQUIRE_EXTRAS"])
def test_in_ci_each_test_fails_and_the_summary_lists_them(tmp_path, env):
    out = run_probe(tmp_path, **env)
    # the marked test fails in its setup, before its fixtures, which pytest counts as an error (as a cuda one)
    assert "5 failed" in out and "1 error" in out and "skipped" not in out, out
    assert out.count("a missing optional library fails in CI") >= 4, out
    assert "optional libraries missing" in out and "test_probe.py::test_importorskip" in out, out


def test_a_ci_job_without_the_extras_can_say_so(tmp_path):
    out = run_probe(tmp_path, CI="true", FASTDATA_REQUIRE_EXTRAS="0")
    assert "2 failed, 4 skipped" in out, out
    out = run_probe(tmp_path, FASTDATA_REQUIRE_EXTRAS="maybe")
    assert "FASTDATA_REQUIRE_EXTRAS='maybe': expected 1" in out and "passed" not in out, out
