"""The version floors in pyproject.toml stay true (found by the dependency-matrix QA pass).

CI installs one set of versions (Python 3.11, torch 2.14.1, numpy 2.x, Pillow-SIMD 12), so nothing there
notices code that needs more than ``requires-python`` and the ``>=`` floors promise. Users install
fastdata into environments they already have. Two cheap guards keep the promise honest:

- every file parses as Python 3.10 syntax (``requires-python``);
- ``NEWER_APIS`` lists APIs that appeared after some version of Python, torch, torchvision, numpy or
  Pillow; every use of one in ``fastdata/`` and ``examples/`` needs a floor at least that high.

The table is checked against the installed libraries too: an API the table dates at or below the
installed version must exist, and one dated above it must not, so running this file in an old
environment (``tools/version_matrix.sh`` does) proves the dates. The full matrix run (real installs of
the floors, GBs of downloads) is documented in docs/install.md and kept out of CI.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "fastdata", ROOT / "examples"]          # what users run: held to the floors
PARSED = [*SHIPPED, ROOT / "tests", ROOT / "benchmarks", ROOT / "tools"]

# Dotted name (after the file's imports are resolved; ``name(kw=)`` for a keyword argument of a call,
# ``.attr`` for an attribute of any object) -> (distribution, the first version that has it).
# Dates checked against the libraries themselves (see test_the_table_dates_what_is_installed).
NEWER_APIS = {
    # Python (distribution "python")
    "tomllib": ("python", "3.11"),
    "datetime.UTC": ("python", "3.11"),
    "typing.Self": ("python", "3.11"),
    "typing.Never": ("python", "3.11"),
    "typing.LiteralString": ("python", "3.11"),
    "typing.assert_never": ("python", "3.11"),
    "typing.reveal_type": ("python", "3.11"),
    "typing.override": ("python", "3.12"),
    "typing.TypeAliasType": ("python", "3.12"),
    "enum.StrEnum": ("python", "3.11"),
    "enum.verify": ("python", "3.11"),
    "ExceptionGroup": ("python", "3.11"),
    "BaseExceptionGroup": ("python", "3.11"),
    "hashlib.file_digest": ("python", "3.11"),
    "contextlib.chdir": ("python", "3.11"),
    "asyncio.TaskGroup": ("python", "3.11"),
    "asyncio.timeout": ("python", "3.11"),
    "itertools.batched": ("python", "3.12"),
    "math.sumprod": ("python", "3.12"),
    "shutil.rmtree(onexc=)": ("python", "3.12"),
    "os.process_cpu_count": ("python", "3.13"),
    "copy.replace": ("python", "3.13"),
    "warnings.deprecated": ("python", "3.13"),
    # .add_note is 3.11; fastdata calls it only behind hasattr(e, "add_note") (see _unguarded).
    ".add_note": ("python", "3.11"),
    # torch
    "torch.serialization.add_safe_globals": ("torch", "2.4"),
    "torch.serialization.safe_globals": ("torch", "2.5"),
    "torch.serialization.get_unsafe_globals_in_checkpoint": ("torch", "2.6"),
    "torch.compiler.set_stance": ("torch", "2.6"),
    "torch.accelerator": ("torch", "2.6"),
    "torch.nn.utils.get_total_norm": ("torch", "2.6"),
    "torch.nn.utils.clip_grads_with_norm_": ("torch", "2.6"),
    "torch.nn.attention.flex_attention": ("torch", "2.5"),
    "torch.utils.data.DataLoader(in_order=)": ("torch", "2.6"),
    # torchvision
    "torchvision.io.decode_webp": ("torchvision", "0.20"),
    "torchvision.io.decode_avif": ("torchvision", "0.20"),
    "torchvision.io.decode_heic": ("torchvision", "0.20"),
    "torchvision.transforms.v2.JPEG": ("torchvision", "0.19"),
    # numpy
    ".seed_seq": ("numpy", "1.25"),            # BitGenerator.seed_seq (private _seed_seq before)
    "numpy.exceptions": ("numpy", "1.25"),
    "numpy.dtypes": ("numpy", "1.25"),
    "numpy.trapezoid": ("numpy", "2.0"),
    "numpy.concat": ("numpy", "2.0"),
    "numpy.isdtype": ("numpy", "2.0"),
    "numpy.long": ("numpy", "2.0"),            # removed in 1.24, back in 2.0 with another meaning
    "numpy.ulong": ("numpy", "2.0"),
    "numpy.permute_dims": ("numpy", "2.0"),
    "numpy.bitwise_count": ("numpy", "2.0"),
    "numpy.strings": ("numpy", "2.0"),
    "numpy.unstack": ("numpy", "2.1"),
    "numpy.cumulative_sum": ("numpy", "2.1"),
    "numpy.asarray(copy=)": ("numpy", "2.0"),
    # Pillow (the enums replaced Image.BILINEAR & co, which Pillow 10 removed)
    "PIL.Image.Resampling": ("pillow", "9.1"),
    "PIL.Image.Transpose": ("pillow", "9.1"),
    "PIL.Image.Dither": ("pillow", "9.1"),
    "PIL.Image.Palette": ("pillow", "9.1"),
    "PIL.Image.Quantize": ("pillow", "9.1"),
    "PIL.ImageOps.exif_transpose(in_place=)": ("pillow", "9.4"),
}

_MODULES = {"python": None, "torch": "torch", "torchvision": "torchvision", "numpy": "numpy", "pillow": "PIL"}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _floors() -> dict[str, tuple[int, ...]]:
    """pyproject.toml's floors: requires-python as "python", and each ``name>=X`` dependency."""
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    floors = {"python": _version(re.search(r'requires-python\s*=\s*">=([\d.]+)"', project).group(1))}
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", project, re.S | re.M).group(1)
    for name, version in re.findall(r'"([A-Za-z0-9_.-]+)\s*>=\s*([\d.]+)', deps):
        floors[name.lower()] = _version(version)
    return floors


def _files(roots):
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*.py") if ".cache" not in p.parts)


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted name, from every import in the file (nested ones too)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node, names: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([names.get(node.id, node.id), *reversed(parts)])
    return None


def _unguarded(node, parents: dict) -> bool:
    """Whether ``node`` runs without an ``if`` (or ``and``) around it that asks for the feature first
    (``hasattr(x, "add_note")``, ``sys.version_info >= ...``)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.If, ast.IfExp, ast.BoolOp)):
            test = ast.unparse(node.test if not isinstance(node, ast.BoolOp) else node)
            if "hasattr" in test or "version_info" in test:
                return False
    return True


def uses(path: Path) -> list[tuple[int, str]]:
    """(line, NEWER_APIS key) of each use in the file."""
    tree = ast.parse(path.read_text(), str(path))
    names = _aliases(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and not isinstance(parents.get(node), ast.Attribute):
            found += [(node.lineno, k) for k in _named(_dotted(node, names) or "")]
        if isinstance(node, ast.Attribute) and f".{node.attr}" in NEWER_APIS and _unguarded(node, parents):
            found.append((node.lineno, f".{node.attr}"))
        if isinstance(node, ast.Call):
            callee = _dotted(node.func, names) or ""
            found += [(node.lineno, f"{callee}({kw.arg}=)") for kw in node.keywords
                      if f"{callee}({kw.arg}=)" in NEWER_APIS]
    for node in ast.walk(tree):   # `import tomllib` / `from datetime import UTC` name the API in the import
        if isinstance(node, ast.Import):
            found += [(node.lineno, k) for a in node.names for k in _named(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, k) for a in node.names for k in _named(f"{node.module}.{a.name}")]
    return sorted(set(found))


def _named(dotted: str) -> list[str]:
    """The NEWER_APIS keys ``dotted`` is, or is inside (torch.accelerator.current_accelerator uses
    torch.accelerator)."""
    return [k for k in NEWER_APIS if dotted == k or dotted.startswith(k + ".")]


def test_every_file_parses_as_the_oldest_python_allowed():
    """ast.parse with feature_version refuses syntax newer than requires-python (except*, PEP 695
    generics, ...) even when CI's interpreter is newer."""
    floor = _floors()["python"]
    bad = []
    for path in _files(PARSED):
        try:
            ast.parse(path.read_text(), str(path), feature_version=floor[:2])
        except SyntaxError as e:
            bad.append(f"{path.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert not bad, f"syntax newer than requires-python >= {'.'.join(map(str, floor))}:\n" + "\n".join(bad)


def test_shipped_code_uses_no_api_newer_than_its_floor():
    floors = _floors()
    bad = []
    for path in _files(SHIPPED):
        for line, api in uses(path):
            dist, since = NEWER_APIS[api]
            if _version(since) > floors[dist]:
                floor = ".".join(map(str, floors[dist]))
                bad.append(f"{path.relative_to(ROOT)}:{line}: {api} needs {dist} >= {since}, but the floor is "
                           f"{floor}: raise it in pyproject.toml (with the reason) or avoid the API")
    assert not bad, "\n".join(bad)


def test_the_finder_sees_each_kind_of_use(tmp_path):
    """The checker itself: an import alias, a from-import, a keyword, an attribute of any object, and a
    guarded call that is left alone."""
    src = tmp_path / "m.py"
    src.write_text("import numpy as xp\nfrom PIL import Image\nimport torch.utils.data as tud\n"
                   "import tomllib\nfrom numpy.exceptions import AxisError\n"
                   "a = xp.exceptions.AxisError\nb = Image.Resampling.BILINEAR\n"
                   "c = tud.DataLoader([], in_order=False)\nd = rng.bit_generator.seed_seq\n"
                   "try:\n    pass\nexcept Exception as e:\n    if hasattr(e, 'add_note'):\n        e.add_note('x')\n"
                   "    e.add_note('y')\n")
    assert uses(src) == [(4, "tomllib"), (5, "numpy.exceptions"), (6, "numpy.exceptions"),
                         (7, "PIL.Image.Resampling"), (8, "torch.utils.data.DataLoader(in_order=)"),
                         (9, ".seed_seq"), (15, ".add_note")]


def test_floors_agree_with_the_tools_that_read_them():
    """ruff's target-version and mypy's python_version are requires-python: a tool checking for a
    newer Python accepts code the oldest allowed one cannot run."""
    text = (ROOT / "pyproject.toml").read_text()
    major, minor = _floors()["python"][:2]
    assert re.search(rf'^target-version\s*=\s*"py{major}{minor}"', text, re.M), "ruff target-version"
    assert re.search(rf'^python_version\s*=\s*"{major}\.{minor}"', text, re.M), "mypy python_version"


def test_the_install_page_states_the_floors_pyproject_has():
    """docs/install.md's table of floors is what users read before pip tells them: it moves with pyproject."""
    text = (ROOT / "docs" / "install.md").read_text()
    table = text.split("## The versions fastdata supports", 1)[1].split("\n## ", 1)[0]
    stated = {name.lower(): _version(v) for name, v in re.findall(r"^\| (\w+) \| ([\d.]+) \|", table, re.M)}
    assert stated == _floors(), f"docs/install.md states {stated}, pyproject.toml has {_floors()}"


def _installed(dist: str) -> tuple[int, ...] | None:
    if dist == "python":
        return sys.version_info[:3]
    try:
        return _version(metadata.version(dist))
    except metadata.PackageNotFoundError:   # pillow-simd installs as another distribution, same PIL
        module = importlib.import_module(_MODULES[dist])
        return _version(module.__version__)


def _exists(api: str) -> bool | None:
    """Whether the running Python and libraries have ``api`` (None: cannot be told at run time)."""
    if api == ".add_note":
        return hasattr(Exception(), "add_note")
    if api == ".seed_seq":
        return hasattr(np.random.default_rng(0).bit_generator, "seed_seq")
    keyword = re.fullmatch(r"(.+)\((\w+)=\)", api)
    dotted = keyword.group(1) if keyword else api
    parts = dotted.split(".")
    obj = None
    for i in range(len(parts), 0, -1):           # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        break
    else:
        import builtins
        obj, rest = builtins, parts
    for name in rest:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    if keyword:
        try:
            return keyword.group(2) in inspect.signature(obj).parameters
        except (TypeError, ValueError):      # a C function without a signature
            return None
    return True


@pytest.mark.parametrize("api", sorted(NEWER_APIS))
def test_the_table_dates_what_is_installed(api):
    """An API dated at or below the installed version exists; one dated above it does not. In CI (new
    versions) this checks the names; in an old environment (tools/version_matrix.sh) it checks the dates."""
    dist, since = NEWER_APIS[api]
    installed = _installed(dist)
    exists = _exists(api)
    if exists is None:
        pytest.skip(f"{api}: cannot be inspected at run time here")
    if installed >= _version(since):
        assert exists, f"{api} is dated {dist} {since} but is missing from {dist} {installed}: the table is wrong"
    else:
        assert not exists, f"{api} is dated {dist} {since} but {dist} {installed} has it: date it earlier"


def test_seed_for_shifts_a_python_int_not_a_numpy_scalar(monkeypatch):
    """numpy 1.x promotes ``np.uint64 >> 1`` (a Python int) to float64 and raises TypeError: every loader
    failed in its first batch with numpy 1.24-1.26. The stand-in scalar shifts like numpy 1.x's."""
    from fastdata import sampling

    want = sampling.seed_for(3, 7)

    class Numpy1Scalar:                      # numpy 1.x's uint64 scalar, as far as seed_for sees it
        def __init__(self, value):
            self.value = int(value)

        def __int__(self):
            return self.value

        def __rshift__(self, other):
            raise TypeError("ufunc 'right_shift' not supported for the input types")

    real = np.random.SeedSequence

    class Sequence:
        def __init__(self, entropy):
            self.inner = real(entropy)

        def generate_state(self, n, dtype):
            return [Numpy1Scalar(w) for w in self.inner.generate_state(n, dtype)]

    monkeypatch.setattr(sampling.np.random, "SeedSequence", Sequence)
    got = sampling.seed_for(3, 7)
    assert type(got) is int and got == want and 0 <= got < 2 ** 63


# ------------------------------------------------------------------ installed without extras
# fsspec comes with torch, so without the shards extra the first import to fail is aiohttp's or s3fs's.

def test_an_http_shard_location_without_aiohttp_names_the_extra(monkeypatch):
    """Without the shards extra, Shards('https://...') ended in a bare "No module named 'aiohttp'"."""
    from fastdata.shards.storage import Storage

    monkeypatch.setitem(sys.modules, "aiohttp", None)   # import aiohttp raises ImportError
    with pytest.raises(ImportError, match=r"https://example\.invalid/s/.*aiohttp is not installed: pip install "
                                          r"fastdata\[shards\]"):
        Storage("https://example.invalid/s/")


def test_an_s3_checkpoint_without_s3fs_names_the_extra(monkeypatch):
    from fastdata import checkpoint

    def no_s3fs(protocol, **options):
        raise ImportError("Install s3fs to access S3")   # fsspec's own words

    monkeypatch.setattr(checkpoint, "FsspecStorage", no_s3fs)
    with pytest.raises(ImportError, match=r"s3fs for s3://: pip install fastdata\[shards\]"):
        checkpoint.storage_for("s3://bucket/run/last.pt")
