"""The package ships ``py.typed``: a promise that users' type checkers may trust its annotations. mypy
checks that promise over ``fastdata/`` with the settings in pyproject.toml (``[tool.mypy]``), so that an
annotation that contradicts the code fails here, not in a user's CI (issue 32: 210 errors when it first
ran; the last 44, in the dali backend and engine/options.py, fixed since: any error now fails)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require

ROOT = Path(__file__).resolve().parents[1]

_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):(?P<line>\d+): error: (?P<message>.*)$")


def mypy_errors_in(output: str) -> list[str]:
    """mypy's ``path:line: error: message`` lines as ``path:line: message``, in mypy's order (notes and
    the summary left out)."""
    return [f"{m['path']}:{m['line']}: {m['message']}" for line in output.splitlines()
            if (m := _ERROR.match(line.strip()))]


@pytest.fixture(scope="module")
def mypy_errors() -> list[str]:
    """One mypy run over the package (about 30 s cold, a few with its cache): its errors."""
    require("mypy")
    # The settings (files, python_version, the libraries without stubs) come from pyproject.toml.
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--no-pretty"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if run.returncode not in (0, 1):   # 2: mypy itself failed (a bad config, a crash)
        raise AssertionError(f"mypy did not run (exit {run.returncode}):\n{run.stdout}\n{run.stderr}")
    found = mypy_errors_in(run.stdout)
    assert run.returncode == 0 or found, f"mypy failed without an error line:\n{run.stdout}\n{run.stderr}"
    return found


def test_mypy_finds_no_error_in_the_package(mypy_errors):
    assert not mypy_errors, f"mypy: {len(mypy_errors)} error(s) in the package (see [tool.mypy] in " \
        f"pyproject.toml):\n" + "\n".join(mypy_errors)


def test_errors_are_read_from_mypys_output():
    out = ("fastdata/a.py:3: error: Incompatible types  [assignment]\n"
           "fastdata/a.py:9: note: By default the bodies of untyped functions are not checked\n"
           "fastdata/b/c.py:12: error: \"None\" has no attribute \"get\"  [union-attr]\n"
           "Found 2 errors in 2 files (checked 3 source files)\n")
    assert mypy_errors_in(out) == ["fastdata/a.py:3: Incompatible types  [assignment]",
                                   "fastdata/b/c.py:12: \"None\" has no attribute \"get\"  [union-attr]"]
    assert mypy_errors_in("Success: no issues found in 3 source files\n") == []


def test_mypy_is_the_pinned_release():
    """constraints.txt pins mypy (CI installs with it): a new release finds new errors in unchanged code,
    so the release that checks the package changes only on purpose. This checkout must run that one."""
    require("mypy")
    from importlib.metadata import version

    pins = re.findall(r"^mypy==(\S+)\s*$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pins == [version("mypy")], f"constraints.txt pins mypy {pins}; installed: {version('mypy')}"
