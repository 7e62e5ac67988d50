"""What the benchmark scripts share: timing, the machine description, targets and the report files.

Timing rules (every script): the first pass is a warm-up and is not counted (worker start-up, caches,
lazy imports, allocator growth); the figure reported is the median of the remaining passes, which a
single slow pass on a shared machine does not move; on CUDA the clock stops only after
``torch.cuda.synchronize()``, because kernels are queued asynchronously and would otherwise be left out.
All contenders of one workload run in the same process one after another, so their ratios hold on a
noisy machine even when absolute numbers drift between runs.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import socket
import statistics
import time
from functools import lru_cache
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastdata.doctor import cpu_model

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


# ------------------------------------------------------------------------------------ machine info
@lru_cache(maxsize=None)  # the doctor's AVX2 check disassembles PIL's binary: once is enough
def _pil_info() -> dict:
    """Which PIL is installed (Pillow or Pillow-SIMD, built with AVX2 or not): the doctor's answer, so
    the reports and ``python -m fastdata doctor`` agree, plus whether libjpeg-turbo decodes."""
    from fastdata.doctor import pil_info as doctor_pil_info

    info = dict(doctor_pil_info())
    info.setdefault("source", "fastdata.doctor.pil_info")
    try:
        from PIL import features

        info.setdefault("libjpeg_turbo", bool(features.check_feature("libjpeg_turbo")))
    except Exception:
        pass
    info["flavour"] = f"{'Pillow-SIMD' if info.get('simd') else 'Pillow'} {info.get('version')}"
    return info


def pil_info() -> dict:
    return dict(_pil_info())


def _version(module: str) -> str | None:
    try:
        mod = __import__(module, fromlist=["__version__"])
        return str(getattr(mod, "__version__", "?"))
    except Exception:
        return None


def machine_info() -> dict:
    """The facts a reader needs to compare a result with their machine."""
    import torch

    from fastdata.config import usable_cores

    gpu = None
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": socket.gethostname(),
        "cpu": cpu_model(),  # the doctor's reading, so reports and `fastdata doctor` agree
        "cores": usable_cores(),
        "memory_gib": mem_gib,
        "gpu": gpu,
        "pil": pil_info()["flavour"],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "dali": _version("nvidia.dali"),
        "numpy": _version("numpy"),
        "fastdata": _version("fastdata"),
    }


def machine_tag(info: dict) -> str:
    """A short file-name tag: ``cuda-<gpu>`` or ``cpu-<cores>c`` (hostnames of containers mean nothing)."""
    if info.get("gpu"):
        name = re.sub(r"[^a-z0-9]+", "-", info["gpu"].split(" (x")[0].lower()).strip("-")
        return f"cuda-{name.replace('nvidia-', '')}"
    return f"cpu-{info['cores']}c"


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


# ------------------------------------------------------------------------------------ formatting
def fmt_num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def fmt_ratio(x) -> str:
    return "-" if x is None else (f"{x:,.0f}x" if x >= 100 else f"{x:.2f}x")


def fmt_pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    out = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    return "\n".join(out)


def machine_markdown(info: dict) -> str:
    keys = ["date", "cpu", "cores", "memory_gib", "gpu", "pil", "python", "torch", "torchvision", "dali",
            "numpy", "fastdata", "host"]
    return "\n".join(f"- **{k}**: {info.get(k) if info.get(k) is not None else 'none'}" for k in keys)


def targets_markdown(targets: list[Target], value_fmt=fmt_ratio) -> str:
    if not targets:
        return ""
    lines = []
    for t in targets:
        value = fmt_pct(t.value) if t.column != "rate" and t.value is not None else value_fmt(t.value)
        mark = {"met": "met", "missed": "**missed**", "n/a": "n/a (not measured)"}[t.status]
        lines.append([t.describe(), value, mark])
    return markdown_table(["target", "measured", "status"], lines)


# ------------------------------------------------------------------------------------ files
def write_json(path: Path, payload: dict) -> None:
    def default(o):
        if hasattr(o, "__dataclass_fields__"):
            return asdict(o)
        if isinstance(o, float) and not math.isfinite(o):
            return None
        return str(o)

    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=default) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def bar_chart(path: Path, groups: dict[str, list[tuple[str, float, str]]], *, xlabel: str, title: str,
              log: bool = True) -> None:
    """One horizontal bar panel per group: ``{group: [(label, value, role), ...]}`` → PNG.

    Log scale by default: contenders differ by two orders of magnitude on the digits workload.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    groups = {g: [b for b in bars if b[1] and b[1] > 0] for g, bars in groups.items()}
    groups = {g: bars for g, bars in groups.items() if bars}
    if not groups:
        groups = {"(nothing measured)": []}
    colors = {"baseline": "#999999", "limit": "#d62728", "fastdata": "#1f77b4"}
    height = sum(max(len(b), 1) for b in groups.values()) * 0.42 + 1.2 * len(groups) + 0.6
    fig, axes = plt.subplots(len(groups), 1, figsize=(8.5, height), squeeze=False)
    for ax, (group, bars) in zip(axes[:, 0], groups.items()):
        labels = [b[0] for b in bars]
        values = [b[1] for b in bars]
        ax.barh(range(len(bars)), values, color=[colors.get(b[2], "#2ca02c") for b in bars])
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels(labels)
        ax.invert_yaxis()
        if log and values:
            ax.set_xscale("log")
        for i, v in enumerate(values):
            ax.text(v, i, f" {fmt_num(v)}", va="center", fontsize=8)
        if values and log:  # whole decades, so that bar lengths are not cut off at an arbitrary left edge
            ax.set_xlim(10 ** math.floor(math.log10(min(values) / 2)), max(values) * 4)
        elif values:
            ax.set_xlim(0, max(values) * 1.25)
        ax.set_title(group, fontsize=10, loc="left")
        ax.set_xlabel(xlabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_reports(out_dir, stem: str, *, title: str, machine: dict, command: str, body_md: str,
                  payload: dict, chart_groups: dict, chart_xlabel: str, chart_log: bool = True) -> dict:
    """Write ``<stem>.md``, ``<stem>.json`` and ``<stem>.png`` under ``out_dir``, say so, and return
    their paths as strings (for the payload a script returns)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("md", "json", "png")}
    md = (f"# {title}\n\n{machine_markdown(machine)}\n\nCommand: `{command}`\n\n{body_md}\n\n"
          f"![{title}]({paths['png'].name})\n")
    write_text(paths["md"], md)
    write_json(paths["json"], {"title": title, "machine": machine, "command": command, **payload})
    bar_chart(paths["png"], chart_groups, xlabel=chart_xlabel, title=f"{title} — {machine['cpu']}, "
              f"{machine['cores']} cores{', ' + machine['gpu'] if machine.get('gpu') else ''}", log=chart_log)
    print("\nwrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    return {k: str(v) for k, v in paths.items()}


def command_line(script: str, argv: list[str] | None) -> str:
    import shlex

    return " ".join(["python", f"benchmarks/{script}"] + [shlex.quote(a) for a in (argv or [])])
