"""Report files shared by ``python -m fastdata bench`` and the scripts in ``benchmarks/``: the machine a
result was measured on, Markdown tables, and one ``.md``/``.json``/``.png`` triple per report.

Every report starts with the machine (CPU, cores, GPU, PIL flavour, versions), because a figure means
nothing without it. Files are written to a temporary name and renamed, so a reader never sees half of
one. matplotlib is needed only for the chart, and imported only there.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import socket
import sys
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

from .doctor import cpu_model


# ------------------------------------------------------------------------------------ command lines
class PresetParser(argparse.ArgumentParser):
    """An ArgumentParser whose ``--quick`` presets live in the parser, next to the options they set.

    ``add_preset("--steps", full=30, quick=6, type=int)`` adds an option that defaults to 30, or to 6
    under ``--quick``; an explicit value always wins. The parsed namespace also records ``argv`` (the
    arguments parsed), so a report can print the command that made it. Its ``--out`` and ``--cache``,
    where a script has them, are folders checked before any work (``cli.output_problem``): a file there
    failed only when the reports were written, after the whole measurement.
    """

    def __init__(self, *args, quick_help: str = "small sizes: checks that it runs, not how fast", **kwargs):
        from .cli import HelpFormatter

        kwargs.setdefault("formatter_class", HelpFormatter)   # --help gives every default
        super().__init__(*args, **kwargs)
        self.presets: dict[str, tuple] = {}  # dest → (full, quick)
        self.add_argument("--quick", action="store_true", help=quick_help)

    def add_preset(self, *flags, full, quick, help: str = "", **kwargs) -> argparse.Action:
        """Add an option whose default is ``full``, or ``quick`` under ``--quick``."""
        text = f"{help} (default {full}, --quick {quick})" if help else f"default {full}, --quick {quick}"
        action = self.add_argument(*flags, default=None, help=text, **kwargs)
        self.presets[action.dest] = (full, quick)
        return action

    def parse_known_args(self, args=None, namespace=None):
        """Parse, then fill every preset option left unset with its full or ``--quick`` default."""
        ns, rest = super().parse_known_args(args, namespace)
        values = vars(ns)
        for dest, (full, quick) in self.presets.items():
            if values.get(dest) is None:
                values[dest] = quick if ns.quick else full
        ns.argv = list(sys.argv[1:] if args is None else args)
        from .cli import check_output

        for dest in ("out", "cache"):
            if isinstance(values.get(dest), str):
                check_output(self, f"--{dest}", values[dest], folder=True)
        return ns, rest


# ------------------------------------------------------------------------------------ machine info
@lru_cache(maxsize=None)  # the doctor's AVX2 check disassembles PIL's binary: once is enough
def _pil_info() -> dict:
    """Which PIL is installed (Pillow or Pillow-SIMD, built with AVX2 or not): the doctor's answer, so
    the reports and ``python -m fastdata doctor`` agree, plus whether libjpeg-turbo decodes."""
    from .doctor import pil_info as doctor_pil_info

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
    """The installed PIL: version, and whether it is Pillow-SIMD and built with AVX2."""
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

    from .config import usable_cores

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


# ------------------------------------------------------------------------------------ formatting
def fmt_num(x, digits: int = 3) -> str:
    """A number for a table: ``-`` for None, thousands separators from 100 up, else ``digits`` significant digits."""
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
    """A ratio for a table, as ``1.23x``."""
    return "-" if x is None else (f"{x:,.0f}x" if x >= 100 else f"{x:.2f}x")


def fmt_pct(x) -> str:
    """A fraction in [0, 1] for a table, as a percentage."""
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    """A markdown table with padded columns (readable as plain text too)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    out = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    return "\n".join(out)


def machine_markdown(info: dict) -> str:
    """The machine description (``machine_info``) as a markdown list."""
    keys = ["date", "cpu", "cores", "memory_gib", "gpu", "pil", "python", "torch", "torchvision", "dali",
            "numpy", "fastdata", "host"]
    return "\n".join(f"- **{k}**: {info.get(k) if info.get(k) is not None else 'none'}" for k in keys)


# ------------------------------------------------------------------------------------ files
def null_for_nonfinite(value):
    """``value`` with every NaN or infinite float (in dicts, lists and tuples) replaced by None. JSON has
    no NaN: ``json.dumps`` writes the bare token ``NaN``, which strict parsers (JavaScript's JSON.parse,
    serde, jq --strict) refuse, so one diverged figure would make the whole file unreadable."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: null_for_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [null_for_nonfinite(v) for v in value]
    return value


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` as JSON atomically (dataclasses as dicts, non-finite floats as null)."""
    def default(o):
        if hasattr(o, "__dataclass_fields__"):
            return null_for_nonfinite(asdict(o))
        return str(o)

    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(null_for_nonfinite(payload), indent=2, default=default, allow_nan=False)
    tmp.write_text(text + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def write_text(path: Path, text: str) -> None:
    """Write ``text`` atomically: a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def bar_chart(path: Path, groups: dict[str, list[tuple]], *, xlabel: str, title: str,
              log: bool = True) -> None:
    """One horizontal bar panel per group: ``{group: [(label, value, role[, (low, high)]), ...]}`` → PNG.

    The optional ``(low, high)`` (slowest and fastest pass) is drawn as an error bar, so two bars whose
    whiskers overlap read as what they are: not told apart by this run. Log scale by default:
    contenders differ by two orders of magnitude on the digits workload.
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
        spreads = [b[3] if len(b) > 3 and b[3] else (b[1], b[1]) for b in bars]
        ranged = [i for i, (lo, hi) in enumerate(spreads) if lo != hi]
        if ranged:
            err = [[max(0.0, values[i] - spreads[i][0]) for i in ranged],
                   [max(0.0, spreads[i][1] - values[i]) for i in ranged]]
            ax.errorbar([values[i] for i in ranged], ranged, xerr=err, fmt="none", ecolor="black", capsize=3,
                        linewidth=1)
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels(labels)
        ax.invert_yaxis()
        if log and values:
            ax.set_xscale("log")
        for i, v in enumerate(values):
            ax.text(max(v, spreads[i][1]), i, f" {fmt_num(v)}", va="center", fontsize=8)  # past the whisker
        if values:
            low = min(values + [lo for lo, _ in spreads if lo > 0])
            high = max(values + [hi for _, hi in spreads])
            if log:  # whole decades, so that bar lengths are not cut off at an arbitrary left edge
                ax.set_xlim(10 ** math.floor(math.log10(low / 2)), high * 4)
            else:
                ax.set_xlim(0, high * 1.25)
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
    try:
        bar_chart(paths["png"], chart_groups, xlabel=chart_xlabel, title=f"{title} — {machine['cpu']}, "
                  f"{machine['cores']} cores{', ' + machine['gpu'] if machine.get('gpu') else ''}", log=chart_log)
    except ImportError:  # matplotlib is an extra (fastdata[bench]); the figures are in the .md and .json
        print("no chart: matplotlib is not installed (pip install 'fastdata[bench]')", flush=True)
        del paths["png"]
    print("\nwrote " + ", ".join(str(p) for p in paths.values()), flush=True)
    return {k: str(v) for k, v in paths.items()}


# ------------------------------------------------------------------------- a training run's result
# The examples' shared tail (issue 24): it sits above the engine (``run_result`` asks it which precision
# ``amp`` resolved to), and the engine imports nothing of this module, so a training loop never pulls in
# the report machinery. ``format_record``, the one-line form of an epoch record, stays in the engine:
# ``fit`` prints it every epoch.
def summarize(history: list[dict]) -> dict:
    """Whole-run figures from ``fit``'s records: the steady state's rates, the warm-up apart, the final eval
    accuracy.

    ``images_per_second``, ``data_wait_fraction`` and ``gpu_idle_fraction`` are each epoch's (already
    its steady state's, see ``fastdata.engine.EpochMeter``) weighted by its steady seconds (``seconds -
    warmup_seconds``): images/s is then the steady images ÷ the steady seconds, and a 1.5 s warm-up in a
    run of 0.2 s epochs no longer bends them (issue 29: 12,398 images/s reported for a run at 40k).
    ``train_seconds`` is every epoch's wall time, warm-up included; ``warmup_seconds`` the warm-up's part.
    Records from before ``warmup_seconds`` existed count as having none; an epoch of no time weighs nothing.
    """
    seconds = sum(r["seconds"] for r in history)
    warmup = sum(r.get("warmup_seconds") or 0.0 for r in history)
    steady = [(r, r["seconds"] - (r.get("warmup_seconds") or 0.0)) for r in history]
    steady = [(r, s) for r, s in steady if s > 0]
    total = sum(s for _, s in steady)

    def weighted(key):
        if not steady or any(r[key] is None for r in history):
            return None
        return sum(r[key] * s for r, s in steady) / total

    return {
        "train_seconds": seconds,
        "warmup_seconds": warmup,
        "images_per_second": weighted("images_per_second"),
        "data_wait_fraction": weighted("data_wait_fraction"),
        "gpu_idle_fraction": weighted("gpu_idle_fraction"),
        "peak_memory_mb": max((r["peak_memory_mb"] for r in history), default=None),
        "final_train_loss": history[-1]["train_loss"] if history else None,
        "test_accuracy": history[-1]["eval_accuracy"] if history else None,
    }


def run_result(history: list[dict], *, train_loader, backend: str, device, amp: str, wall_seconds: float,
               config: dict | None = None, **details) -> dict:
    """A training script's result as one JSON-ready dict: what ran, the whole-run figures, the epochs.

    Keys: ``backend`` (the one that ran: ``auto`` names its choice), ``backend_requested``,
    ``device``, ``world_size``, then ``details`` in the caller's order (dataset, epochs, batch size,
    ...), ``config`` when given (the run's configuration as the script was told it: its flags and the
    values they resolved to, made JSON-ready by ``jsonable``), ``amp`` (the precision used),
    ``summarize(history)``'s figures (the steady state's rates, ``warmup_seconds`` apart),
    ``wall_seconds`` and ``history`` (``fit``'s records, each with its ``lr`` and ``warmup_seconds``).
    """
    # Imported here: torch and the engine are needed only by a training run's report, not by the
    # benchmarks' tables and charts that import this module.
    import torch

    from . import distributed as fdist
    from .engine import resolve_amp

    device = torch.device(device)
    return {
        # A contract object that is not a fastdata loader may have no name: the requested one stands.
        "backend": getattr(train_loader, "name", backend),
        "backend_requested": backend,
        "device": str(device),
        "world_size": fdist.world_size(),
        **details,
        **({"config": jsonable(config)} if config is not None else {}),
        "amp": resolve_amp(amp, device, warn=False),
        **summarize(history),
        "wall_seconds": wall_seconds,
        "history": history,
    }


def jsonable(value):
    """``value`` as plain JSON types: a dataclass (an ``Augmentation``) becomes a dict of its fields, an
    enum its value, a tuple a list, a ``torch.dtype``/``torch.device``/path its string; anything else
    that JSON cannot hold its ``repr``."""
    import dataclasses
    import enum

    import torch

    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (torch.dtype, torch.device, os.PathLike)):
        return str(value)
    return repr(value)


def write_result(result: dict, path) -> Path:
    """Write a run's ``result`` to ``path`` as indented JSON, creating its folder; returns the path.
    Standard JSON: a figure that is NaN (a diverged loss, nothing evaluated) is written as null. (It was
    ``fastdata.engine.write_json(result, path)``; this module's ``write_json`` takes the path first.)"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return path


def report_run(result: dict, *, accuracy_name: str, json_out=None) -> None:
    """Rank 0 prints the run's one line (final accuracy, training time, backend) and writes
    ``json_out`` when given; the other ranks stay silent, so a torchrun log holds one copy."""
    from . import distributed as fdist

    if not fdist.is_main():
        return
    acc = result["test_accuracy"]
    print(f"{accuracy_name} {acc:.2%}" if acc is not None else f"{accuracy_name}: none (nothing was evaluated)",
          f"| {result['train_seconds']:.1f} s training, backend {result['backend']}", flush=True)
    if json_out:
        write_result(result, json_out)
