"""What the benchmark scripts share: timing, the machine description, targets and the report files.

Timing rules (every script): the first pass is a warm-up and is not counted (worker start-up, caches,
lazy imports, allocator growth); the figure reported is the median of the remaining passes, which a
single slow pass on a shared machine does not move; on CUDA the clock stops only after
``torch.cuda.synchronize()``, because kernels are queued asynchronously and would otherwise be left out.
All contenders of one workload run in the same process one after another, so their ratios hold on a
noisy machine even when absolute numbers drift between runs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastdata.report import (  # noqa: F401  (the scripts use them as common.*)
    bar_chart, fmt_num, fmt_pct, fmt_ratio, machine_info, machine_markdown, machine_tag, markdown_table,
    pil_info, write_json, write_reports, write_text)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CACHE_DIR = Path(__file__).resolve().parent / ".cache"


# ------------------------------------------------------------------------------------------ timing
def sync(device) -> None:
    """Wait for queued CUDA work on ``device`` (no-op on CPU), so a clock measures the work itself."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_passes(run_pass, passes: int, *, warmup: int = 1, device="cpu", budget_s: float | None = None):
    """Call ``run_pass()`` (which returns the number of items it handled) ``warmup + passes`` times.

    Returns ``(seconds, items, warmup_seconds)``: lists for the timed passes, and the warm-up's total
    (reported apart: it holds one-time costs such as starting workers or filling a cache).
    ``budget_s`` stops early (after at least one timed pass) once the timed passes took that long, so a
    slow contender cannot stall a run.
    """
    t0 = time.perf_counter()
    for _ in range(warmup):
        run_pass()
        sync(device)
    warmup_seconds = time.perf_counter() - t0
    seconds, items = [], []
    for _ in range(passes):
        sync(device)
        t0 = time.perf_counter()
        n = run_pass()
        sync(device)
        seconds.append(time.perf_counter() - t0)
        items.append(int(n))
        if budget_s is not None and sum(seconds) > budget_s:
            break
    return seconds, items, warmup_seconds


def median_rate(seconds, items) -> float:
    """Median of the per-pass rates (items/s)."""
    return statistics.median(n / s for n, s in zip(items, seconds) if s > 0)


# ------------------------------------------------------------------------------------ results
@dataclass
class Row:
    """One contender's result in one workload."""

    workload: str
    name: str
    role: str                       # "baseline", "fastdata" or "limit" (or anything a script uses)
    rate: float | None = None       # items/s, median of the timed passes
    status: str = "ok"              # "ok", "skipped" or "error"
    note: str = ""
    passes: list = field(default_factory=list)   # items/s of each timed pass
    extra: dict = field(default_factory=dict)    # script-specific columns
    vs_baseline: float | None = None
    vs_limit: float | None = None


def add_ratios(rows: list[Row]) -> None:
    """Fill vs_baseline / vs_limit from the ``baseline`` and ``limit`` rows of the same workload."""
    for workload in {r.workload for r in rows}:
        group = [r for r in rows if r.workload == workload]
        base = next((r.rate for r in group if r.role == "baseline" and r.status == "ok"), None)
        limit = next((r.rate for r in group if r.role == "limit" and r.status == "ok"), None)
        for r in group:
            if r.status != "ok" or r.rate is None:
                continue
            r.vs_baseline = r.rate / base if base else None
            r.vs_limit = r.rate / limit if limit else None


@dataclass
class Target:
    """A ratio goal: ``rate(name) / rate(reference) >= at_least`` within one workload.

    ``column`` other than "rate" compares a value in ``Row.extra`` against ``at_most`` instead.
    """

    workload: str
    name: str
    reference: str | None = None
    at_least: float | None = None
    column: str = "rate"
    at_most: float | None = None
    label: str = ""
    value: float | None = None
    status: str = "n/a"             # "met", "missed" or "n/a" (a contender was not measured)

    def evaluate(self, rows: list[Row]) -> "Target":
        def find(name):
            return next((r for r in rows if r.workload == self.workload and r.name == name and r.status == "ok"),
                        None)

        row = find(self.name)
        if self.column == "rate":
            ref = find(self.reference)
            if row is None or ref is None or not ref.rate:
                self.status = "n/a"
                return self
            self.value = row.rate / ref.rate
            self.status = "met" if self.value >= self.at_least else "missed"
        else:
            value = None if row is None else row.extra.get(self.column)
            if value is None:
                self.status = "n/a"
                return self
            self.value = float(value)
            self.status = "met" if self.value <= self.at_most else "missed"
        return self

    def describe(self) -> str:
        if self.label:
            return self.label
        if self.column == "rate":
            return f"{self.workload}: {self.name} >= {self.at_least:g}x {self.reference}"
        return f"{self.workload}: {self.name} {self.column} <= {self.at_most:g}"


def targets_markdown(targets: list[Target], value_fmt=fmt_ratio) -> str:
    if not targets:
        return ""
    lines = []
    for t in targets:
        value = fmt_pct(t.value) if t.column != "rate" and t.value is not None else value_fmt(t.value)
        mark = {"met": "met", "missed": "**missed**", "n/a": "n/a (not measured)"}[t.status]
        lines.append([t.describe(), value, mark])
    return markdown_table(["target", "measured", "status"], lines)


def command_line(script: str, argv: list[str] | None) -> str:
    import shlex

    return " ".join(["python", f"benchmarks/{script}"] + [shlex.quote(a) for a in (argv or [])])
