"""The documentation as a user follows it: what the pages and the public docstrings promise, held to
what the code does (the prose; tests/test_docs.py runs the pages' code blocks).
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import fsspec
import pytest

import fastdata
from fastdata import LoaderConfig
from fastdata.backends.dali import DaliLoader  # the module imports DALI only to build a pipeline
from fastdata.config import usable_cores
from fastdata.datasets import Shards, make_image_folder

ROOT = Path(__file__).resolve().parents[1]


def _arg_doc(obj, name: str) -> str:
    """The ``Args:`` entry of ``name`` in ``obj``'s docstring, its continuation lines joined."""
    doc = inspect.getdoc(obj) or ""
    m = re.search(rf"^\s*{re.escape(name)}: (.*(?:\n\s{{8,}}.*)*)", doc, re.M)
    assert m, f"{obj.__qualname__}'s docstring documents no {name!r}"
    return " ".join(m.group(1).split())


def test_the_worker_default_the_docstrings_state_is_the_share_torchrun_gives(monkeypatch):
    # contract.md: the default num_workers is the usable cores / LOCAL_WORLD_SIZE. LoaderConfig's and
    # pack's docstrings said "the usable cores": 8 ranks on 16 cores reading it expect 16 each, get 2.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert LoaderConfig(device="cpu").num_workers == max(1, usable_cores() // 2)
    for obj, name in ((LoaderConfig, "num_workers"), (fastdata.pack, "workers")):
        assert "LOCAL_WORLD_SIZE" in _arg_doc(obj, name), (obj, _arg_doc(obj, name))
    assert "share of the usable cores" in _arg_doc(DaliLoader, "num_threads"), _arg_doc(DaliLoader, "num_threads")


def test_a_cache_limit_too_small_is_refused_in_the_words_shards_was_given(tmp_path):
    # shards.md: a cache_limit under 2 x window of the largest shards is refused when Shards is created,
    # saying how much is needed. It said "ShardCache: limit_bytes=... (window=5)": neither the argument
    # the user gave (cache_limit) nor the window they chose (4).
    photos = make_image_folder(tmp_path / "photos", classes=2, per_class=4)
    fastdata.pack(photos, tmp_path / "shards", shard_size="200KB", progress=False)
    fs = fsspec.filesystem("memory")
    where = f"/qa-docs-{tmp_path.name}"
    for path in (tmp_path / "shards").iterdir():
        fs.pipe(f"{where}/{path.name}", path.read_bytes())
    try:
        with pytest.raises(ValueError) as e:
            Shards(f"memory://{where}", cache_dir=tmp_path / "cache", cache_limit=1000)
        message = str(e.value)
        assert "cache_limit" in message and "window" in message and "needs at least" in message, message
        assert "limit_bytes" not in message and "window=5" not in message, message
    finally:
        fs.rm(where, recursive=True)


def _figures(text: str) -> list[str]:
    """Every ratio with its range, written ``1.02× (0.90–1.09)`` in ``text``, as the results files write
    it: ``1.02x (0.90x–1.09x)``."""
    found = re.findall(r"(\d\.\d\d)[×x] \((\d\.\d\d)[×x]?–(\d\.\d\d)[×x]?\)", text)
    return [f"{v}x ({lo}x–{hi}x)" for v, lo, hi in found]


def test_the_shard_figures_in_the_docs_are_those_of_the_results_file():
    # docs/benchmarks.md and the README quoted an earlier bench_shards run (0.98x (0.92x-0.98x), 0.89x,
    # 2.01x) that benchmarks/results/shards-cpu-2c.md no longer holds: a reader checking found others.
    results = (ROOT / "benchmarks/results/shards-cpu-2c.md").read_text()
    bench = (ROOT / "docs/benchmarks.md").read_text()
    shards = (ROOT / "docs/shards.md").read_text()
    figures = _figures(bench[bench.index("## Shards"):bench.index("## Which backend")])
    figures += _figures(shards[shards.index("## Speed"):])
    assert len(figures) >= 10, figures
    missing = [f for f in figures if f not in results]
    assert not missing, f"ratios quoted that benchmarks/results/shards-cpu-2c.md does not hold: {missing}"
    readme = (ROOT / "README.md").read_text()
    line = " ".join(readme[readme.index("Packed shards"):readme.index("(docs/shards.md)")].split())
    local = re.search(r"folder's speed locally \((\d\.\d\d)× with `torch`, (\d\.\d\d)× with `dali`", line)
    assert local, line
    for backend, ratio in zip(("torch", "dali"), local.groups()):
        section = results[results.index(f"## {backend}"):]
        row = next(r for r in section.splitlines() if r.startswith("| shards "))
        assert f"| {ratio}x (" in row, (backend, ratio, row)


def test_the_options_table_names_each_backends_options_with_their_defaults():
    # docs/backends.md lists every backend's own options with their defaults: a user reads the default
    # there, not in the class. An option added, renamed or given another default must change the page.
    import ast

    from fastdata import registry

    page = (ROOT / "docs/backends.md").read_text()
    start = page.index("| backend | option and default |")
    table = page[start:page.index("\n\n", start)]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", table, re.M)}
    assert {"torch", "prefetch", "memory", "dali"} <= set(rows), rows
    for name, row in rows.items():
        options = registry.spec(name).option_names()
        if name == "prefetch":
            row += " " + rows["torch"].replace("`", "")   # "torch's, and ..."
        named = {w for w in re.findall(r"`?(\w+)(?:=|`)", row) if w in options}
        assert named == set(options), (name, sorted(set(options) - named), sorted(named - set(options)))
        defaults = registry.backend_class(name).options
        for option, text in re.findall(r"`(\w+)=([^`]+)`", row):
            assert option in defaults, (name, option)
            assert ast.literal_eval(text) == defaults[option], (name, option, text, defaults[option])


def test_the_contract_lists_every_loader_config_field():
    # docs/contract.md names LoaderConfig's fields, the options every backend shares: a field added
    # without the page is an option users never hear of.
    import dataclasses

    page = " ".join((ROOT / "docs/contract.md").read_text().split())
    start = page.index("Options shared by all backends")
    listed = page[start:page.index(").", start)]   # the parenthesised list of field names
    named = set(re.findall(r"`(\w+)`", listed))
    fields = {f.name for f in dataclasses.fields(LoaderConfig)}
    assert fields <= named, sorted(fields - named)


@pytest.mark.requires("accelerate")
def test_loader_remainder_is_set_only_where_accelerate_is_imported_as_the_docstring_says():
    # LoaderConfig's docstring promised ``loader.remainder`` to everyone; a pass sets it only for
    # accelerate (backends/base.py), so a user reading it without accelerate got an AttributeError.
    import subprocess
    import sys

    script = """
import sys
from fastdata import make_loader
from fastdata.datasets import SyntheticDigits
if sys.argv[1] == "accelerate":
    import accelerate  # noqa: F401
loader = make_loader(SyntheticDigits(n=9), "torch", device="cpu", batch_size=4, train=False, rank=1, world_size=2,
                     num_workers=0, even_batches=True)
print([len(labels) for _, labels in loader], getattr(loader, "remainder", None))
"""
    runs = {}
    for mode in ("plain", "accelerate"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs[mode] = out.stdout.split("\n")[-2]
    assert runs == {"plain": "[4, 1] None", "accelerate": "[4, 1] 1"}, runs
    doc = _arg_doc(LoaderConfig, "even_batches")
    assert "Where accelerate is imported" in doc and "nothing sets it" in doc, doc
