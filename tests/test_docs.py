"""The README and docs/ pages stay true: every ```python block runs, and every relative link resolves.

Each ```python block is run as it is, in a fresh interpreter, in an empty temporary folder, on the CPU
(``CUDA_VISIBLE_DEVICES=""``), under a time limit: a page whose code no longer runs fails here, not in a
reader's hands. Fragments and commands are fenced ```text or ```bash, which are not run. A block that
cannot run here (it needs a GPU or a server) is marked on the line before its fence with
``<!-- docs-test: skip (the reason) -->``; it shows as skipped with that reason, and their number is
held to ``MAX_SKIPS``. Links: a relative link must name a file that exists, and its ``#anchor``, when it
has one, a heading of that page (GitHub's anchors).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Each skip is a block no reader can check by running it: keep them few, each with its reason.
MAX_SKIPS = 3
TIMEOUT_S = 240   # per block; the blocks are tiny CPU runs, this only catches a hang

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]*\S[^)]*)\)\s*-->")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+).*?\1")


def code_blocks(text: str):
    """(first line number, language, code, skip reason or None) of each fenced block in ``text``."""
    lines = text.splitlines()
    blocks, k = [], 0
    while k < len(lines):
        m = _FENCE.match(lines[k])
        if not m:
            k += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), k + 1
        end = start
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if end == len(lines):
            raise ValueError(f"line {k + 1}: a {fence} fence that is never closed")
        before = lines[k - 1] if k else ""
        skip = _SKIP.search(before)
        blocks.append((k + 1, lang, "\n".join(lines[start:end]) + "\n", skip.group("reason") if skip else None))
        k = end + 1
    return blocks


def prose(text: str, *, inline_code: bool = False) -> str:
    """``text`` with fenced blocks blanked, and inline code unless ``inline_code`` (line numbers kept):
    links are read here only, and headings (whose code counts in their anchor) with inline code kept."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line if inline_code else _INLINE_CODE.sub("", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to
    hyphens; inline code and link syntax count by their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page (a repeated heading's get -1, -2 ..., as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(text, inline_code=True).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    for m in re.finditer(r"<a\s+(?:name|id)=\"([^\"]+)\"", text):
        out.add(m.group(1))
    return out


def broken_links(page: Path, text: str) -> list[str]:
    """Each relative link of ``page`` whose file does not exist, or whose anchor is no heading there."""
    bad = []
    for n, line in enumerate(prose(text).splitlines(), 1):
        for m in _LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # https:, mailto: ...: not checked here
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}:{n}: {target} (no file {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{page.name}:{n}: {target} (no heading '#{anchor}' in {dest.name})")
    return bad


def _python_blocks():
    params, skips = [], []
    for page in PAGES:
        for line, lang, code, reason in code_blocks(page.read_text(encoding="utf-8")):
            if lang not in ("python", "py"):
                continue
            where = f"{page.relative_to(ROOT)}:{line}"
            marks = [pytest.mark.skip(reason=f"{where}: {reason}")] if reason else []
            if reason:
                skips.append(where)
            params.append(pytest.param(code, id=where, marks=marks))
    return params, skips


PYTHON_BLOCKS, SKIPPED = _python_blocks()


def run_block(code: str, cwd, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in ``cwd``, on the CPU, with the repository importable."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("code", PYTHON_BLOCKS)
def test_every_python_block_runs(code, tmp_path):
    done = run_block(code, tmp_path)
    assert done.returncode == 0, f"the block failed (exit {done.returncode}):\n{code}\n{done.stderr[-4000:]}"


def test_the_pages_have_python_blocks_and_few_skips():
    # A page set with no runnable block, or a fence the parser misses, would pass the test above vacuously.
    assert len(PYTHON_BLOCKS) >= 10, [p.id for p in PYTHON_BLOCKS]
    assert len(SKIPPED) <= MAX_SKIPS, f"{len(SKIPPED)} blocks skipped (at most {MAX_SKIPS}): {SKIPPED}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page, page.read_text(encoding="utf-8")) == []


def test_the_readme_links_every_docs_page_and_stays_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {m.group(1).partition("#")[0] for m in _LINK.finditer(prose(readme))}
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in linked]
    assert missing == [], f"docs pages the README does not link: {missing}"
    assert len(readme.splitlines()) <= 300, "README.md is over 300 lines: move reference text to docs/"


# ------------------------------------------------------------------ the checks themselves can fail


def test_the_checks_catch_a_broken_link_a_failing_block_and_honour_a_skip(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Sources (`fastdata.datasets`)\n\nSee [b](other.md), [c](#nowhere), "
                    "[d](#sources-fastdatadatasets), [e](https://example.com/x.md) and `[f](g.md)`.\n")
    assert [b.split(": ")[1].split(" ")[0] for b in broken_links(page, page.read_text())] == ["other.md",
                                                                                            "#nowhere"]
    text = ("```python\nraise SystemExit(3)\n```\n<!-- docs-test: skip (needs a GPU) -->\n```python\n"
            "import torch; torch.cuda.init()\n```\n```bash\nrm -rf /\n```\n")
    blocks = code_blocks(text)
    assert [(lang, reason) for _, lang, _, reason in blocks] == [("python", None), ("python", "needs a GPU"),
                                                                 ("bash", None)]
    assert run_block(blocks[0][2], tmp_path).returncode == 3
    assert run_block("import os; print(os.getcwd(), os.environ['CUDA_VISIBLE_DEVICES'] == '')",
                     tmp_path).stdout.split() == [str(tmp_path), "True"]
