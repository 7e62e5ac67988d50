"""What the benchmark scripts share: timing, the machine description, targets and the report files.

Timing rules (every script): the first pass is a warm-up and is not counted (worker start-up, caches,
lazy imports, allocator growth); the figure reported is the median of the remaining passes, which a
single slow pass on a shared machine does not move; on CUDA the clock stops only after
``torch.cuda.synchronize()``, because kernels are queued asynchronously and would otherwise be left out.
All contenders of one workload run in the same process one after another, so their ratios hold on a
noisy machine even when absolute numbers drift between runs.

Noise: every rate is shown with the spread of its passes (min-max), and every ratio with the range
the passes allow (slowest over fastest to fastest over slowest). A comparison whose range covers the
threshold (1.0 between two contenders, a target's figure) is "within noise": on a shared 2-core machine
one loader measured 1,526 and 1,895 images/s in the same run, so a 1.13x lead can be noise.
Contenders timed round by round are compared by the ratio of each round; the median's range is then its
95% distribution-free interval (``median_interval``), which is the lowest to the highest round up to 8
rounds and narrows with more, where min-max would only widen: one slow round in 41 says nothing about
the median.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastdata.report import (  # noqa: F401  (the scripts use them as common.*)
    PresetParser,
    bar_chart,
    fmt_num,
    fmt_pct,
    fmt_ratio,
    machine_info,
    machine_markdown,
    machine_tag,
    markdown_table,
    pil_info,
    write_json,
    write_reports,
    write_text,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CACHE_DIR = Path(__file__).resolve().parent / ".cache"
PHOTO_CHUNK = 5   # photos of each class one job writes (see photo_folder)


# ------------------------------------------------------------------------------------------ data
def photo_folder(cache, count: int, *, workers: int | None = None) -> Path:
    """The benchmarks' folder of ``count`` ImageNet-sized JPEGs (rounded up to 10 classes):
    ``<cache>/jpeg-10x<per class>``, written once (its ``.complete`` marks a finished one) and reused.

    Written by a process pool (``workers``, default the usable cores): one process took 83 s for 1,500
    photos on a 16-core GPU machine whose calls last minutes. Each job is ``make_image_folder`` (the
    public generator: its sizes, quality and class tints) writing ``PHOTO_CHUNK`` photos of every class
    under the job's own seed into a scratch folder, then moved into place as the next numbers of each
    class: the folder is the same whatever the number of workers.
    """
    import multiprocessing
    import shutil
    import sys
    from concurrent.futures import ProcessPoolExecutor

    from fastdata.config import usable_cores
    from fastdata.datasets import make_image_folder

    classes = 10
    per_class = max(1, -(-count // classes))
    root = Path(cache) / f"jpeg-{classes}x{per_class}"
    if (root / ".complete").exists():
        return root
    t0 = time.perf_counter()
    chunks = [min(PHOTO_CHUNK, per_class - k) for k in range(0, per_class, PHOTO_CHUNK)]
    scratch = root.with_name(root.name + ".parts")
    shutil.rmtree(scratch, ignore_errors=True)
    # fork is cheap and safe before CUDA starts; after it, a forked child cannot use the parent's context
    torch = sys.modules.get("torch")
    method = "spawn" if torch is not None and torch.cuda.is_initialized() else "fork"
    with ProcessPoolExecutor(max(1, min(workers or usable_cores(), len(chunks))),
                             mp_context=multiprocessing.get_context(method)) as pool:
        jobs = [pool.submit(make_image_folder, scratch / str(j), classes=classes, per_class=n, seed=j)
                for j, n in enumerate(chunks)]
        for job in jobs:
            job.result()
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
        for j, n in enumerate(chunks):
            for i in range(n):
                name = f"class_{c:03d}/img_{j * PHOTO_CHUNK + i:05d}.jpg"
                (scratch / str(j) / f"class_{c:03d}" / f"img_{i:05d}.jpg").replace(root / name)
    shutil.rmtree(scratch, ignore_errors=True)
    (root / ".complete").write_text("ok\n")
    print(f"  wrote {classes * per_class} JPEGs to {root} in {time.perf_counter() - t0:.1f}s "
          f"({len(chunks)} jobs)", flush=True)
    return root


def existing_folder(text: str) -> str:
    """An argparse type: a folder that is there (``--data``: a mistyped one measured other data)."""
    import argparse

    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"'{text}' is not a folder")
    return text


def unavailable(name: str) -> str:
    """Why backend ``name`` is skipped here: what does not import and how to install it."""
    from fastdata import registry

    return f"not available here: {registry.spec(name).unavailable_reason or 'not in available_backends()'}"


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
    return statistics.median(n / s for n, s in zip(items, seconds, strict=True) if s > 0)


# ------------------------------------------------------------------------------------ noise
NOISE = "within noise"


def spread(passes) -> tuple[float, float] | None:
    """(slowest, fastest) pass; None without passes. Min-max, not an IQR: runs have 1 to 5 passes."""
    return (min(passes), max(passes)) if passes else None


def ratio_range(num, den) -> tuple[float, float] | None:
    """The range of ``num / den`` that the two spreads allow: (num's slowest / den's fastest, num's fastest
    / den's slowest). None when either has no spread or a zero."""
    if num is None or den is None or den[0] <= 0 or den[1] <= 0:
        return None
    return num[0] / den[1], num[1] / den[0]


def median_interval(values, confidence: float = 0.95) -> tuple[float, float]:
    """The distribution-free confidence interval of the median of ``values``: the k-th lowest and k-th
    highest value, k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2 (each value is
    below the true median with probability 1/2, whatever the distribution; no normality assumed). Up to
    8 values at 95% there is no such k >= 2 and the interval is (min, max)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median_interval needs at least one value")
    n, tail = len(ordered), (1.0 - confidence) / 2
    k, below = 1, 0.0      # below: P(Binomial(n, 1/2) <= k - 1)
    while k < (n + 1) // 2:
        below += math.comb(n, k - 1) / 2 ** n
        if below + math.comb(n, k) / 2 ** n > tail:
            break
        k += 1
    return ordered[k - 1], ordered[n - k]


def paired_ratios(num, den) -> tuple[float, tuple[float, float]] | None:
    """``num[k] / den[k]`` for passes run side by side (pass k of each in the same round, so whatever
    slowed the machine in a round slowed both): the median ratio and its range, ``median_interval``
    (lowest and highest round up to 8 rounds). None without passes, with a zero, or when the counts
    differ."""
    if not num or not den or len(num) != len(den) or min(den) <= 0:
        return None
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(ratios), median_interval(ratios)


def row_ratio(row, ref) -> tuple[float, tuple[float, float] | None]:
    """``row``'s rate over ``ref``'s, and the range the passes allow: paired round by round where both
    ran interleaved (``Row.paired``), else the median rates' ratio with the cross range of the two
    spreads (``ratio_range``), which is wider: drift between the two runs counts against it."""
    if row.paired and ref.paired:
        got = paired_ratios(row.passes, ref.passes)
        if got is not None:
            return got
    return row.rate / ref.rate, ratio_range(spread(row.passes), spread(ref.passes))


def compare(low, high, threshold: float, *, at_least: bool = True) -> str:
    """"met" / "missed" against ``threshold`` (``value >= threshold``, or ``<=`` with at_least=False),
    or "within noise" when the range [low, high] holds values on both sides of it."""
    if at_least:
        return "met" if low >= threshold else "missed" if high < threshold else NOISE
    return "met" if high <= threshold else "missed" if low > threshold else NOISE


def fmt_spread(rng, fmt=fmt_num) -> str:
    """'1,526-1,895' (one value when every pass agreed; '-' without passes)."""
    if rng is None:
        return "-"
    lo, hi = fmt(rng[0]), fmt(rng[1])
    return lo if lo == hi else f"{lo}–{hi}"


def fmt_rate(row) -> str:
    """A row's median rate with its passes' spread: '1,700 (1,526–1,895)'; the status if not measured."""
    if row.status != "ok":
        return row.status
    rng = spread(row.passes)
    return fmt_num(row.rate) + (f" ({fmt_spread(rng)})" if rng and rng[0] != rng[1] else "")


def fmt_vs(ratio, rng) -> str:
    """A ratio with its range, marked "within noise" when the range covers 1 (no clear winner)."""
    if ratio is None:
        return "-"
    text = fmt_ratio(ratio)
    if rng is None or rng[0] == rng[1]:
        return text
    text += f" ({fmt_spread(rng, fmt_ratio)})"
    return text + f" {NOISE}" if rng[0] <= 1.0 <= rng[1] else text


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
    vs_baseline_range: tuple | None = None       # what the passes' spreads allow (see ratio_range)
    vs_limit_range: tuple | None = None
    paired: bool = False            # its passes ran interleaved, round by round, with the workload's others


def add_ratios(rows: list[Row]) -> None:
    """Fill vs_baseline / vs_limit (and their ranges) from the ``baseline`` and ``limit`` rows of the
    same workload."""
    for workload in {r.workload for r in rows}:
        group = [r for r in rows if r.workload == workload]
        base = next((r for r in group if r.role == "baseline" and r.status == "ok" and r.rate), None)
        limit = next((r for r in group if r.role == "limit" and r.status == "ok" and r.rate), None)
        for r in group:
            if r.status != "ok" or r.rate is None:
                continue
            if base is not None:
                r.vs_baseline, r.vs_baseline_range = row_ratio(r, base)
            if limit is not None:
                r.vs_limit, r.vs_limit_range = row_ratio(r, limit)


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
    low: float | None = None        # the range the passes allow (see ratio_range); None: one pass
    high: float | None = None
    status: str = "n/a"             # "met", "missed", "within noise" or "n/a" (a contender was not measured)

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
            self.value, rng = row_ratio(row, ref)
            threshold, at_least = self.at_least, True
        else:
            value = None if row is None else row.extra.get(self.column)
            if value is None:
                self.status = "n/a"
                return self
            self.value = float(value)
            rng = spread(row.extra.get(f"{self.column}_passes"))  # per-pass values, where a script keeps them
            threshold, at_least = self.at_most, False
        self.low, self.high = rng if rng is not None else (self.value, self.value)
        # The median decides only where the passes agree; a range across the threshold is noise.
        self.low, self.high = min(self.low, self.value), max(self.high, self.value)
        self.status = compare(self.low, self.high, threshold, at_least=at_least)
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
        fmt = fmt_pct if t.column != "rate" else value_fmt
        value = fmt(t.value) if t.value is not None else "-"
        rng = fmt_spread((t.low, t.high), fmt) if t.low is not None and t.low != t.high else "-"
        mark = {"met": "met", "missed": "**missed**", NOISE: NOISE, "n/a": "n/a (not measured)"}[t.status]
        lines.append([t.describe(), value, rng, mark])
    return markdown_table(["target", "measured", "range over passes", "status"], lines)


def command_line(script: str, argv: list[str] | None) -> str:
    import shlex

    return " ".join(["python", f"benchmarks/{script}"] + [shlex.quote(a) for a in (argv or [])])
