"""The one table a GPU run ends with: each stage of ``benchmarks/gpu.sh``, whether it passed, its time and
its headline figures, read from the stage's log and report.

gpu.sh calls it at the end of every call; the stages of earlier calls are kept (in ``--keep``, under
/var/tmp on the lent machine), so the table after the third call covers the whole run.

    python benchmarks/gpu_summary.py --keep /var/tmp/fastdata-gpu-run --tag cuda-h200 --out "$OUT"
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

try:
    from . import common
except ImportError:  # run as a script: python benchmarks/gpu_summary.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

from fastdata import cli

#: The report each benchmark stage writes under ``<keep>/reports``: its file name without ``.json``.
REPORTS = {"training": "training-{tag}", "loaders": "loaders-{tag}", "cache": "cache-{tag}",
           "dali-train": "training-{tag}-dali", "dali-gpu": "dali-gpu-{tag}"}
_PYTEST_TAIL = re.compile(r"\b\d+ (passed|failed|error|errors|skipped|deselected|selected)\b.* in [\d.]+s")


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="The summary table of a benchmarks/gpu.sh run.", add_help=add_help)
    p.add_argument("--keep", required=True, type=_run_folder, help="gpu.sh's folder: stages.tsv, logs/, reports/")
    p.add_argument("--tag", required=True, help="the run's file-name tag (cuda-<gpu>, or dry)")
    p.add_argument("--out", required=True, type=_out_folder,
                   help="where summary-<tag>.md is written (created if missing)")
    return p


def _run_folder(text: str) -> str:
    """``--keep``: a folder that is there. A mistyped one summed up as "0 of 0 stages passed"."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"'{text}' is not a folder (gpu.sh's --keep: stages.tsv, logs/, reports/)")
    return text


def _out_folder(text: str) -> str:
    """``--out``: a folder that can be written (made when missing; it was a FileNotFoundError traceback)."""
    problem = cli.output_problem(text, folder=True)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def read_stages(keep: Path) -> list[dict]:
    """The stages run so far, in order: stages.tsv lines ``call, stage, status, seconds, limit``."""
    path = keep / "stages.tsv"
    if not path.exists():
        return []
    keys = ("call", "stage", "status", "seconds", "limit")
    return [dict(zip(keys, line.split("\t"), strict=True)) for line in path.read_text().splitlines() if line]


def log_headline(stage: str, log: str) -> str:
    """What a stage without a report said: pytest's last summary line, the doctor's verdicts, the folders."""
    lines = log.splitlines()
    if stage == "doctor":
        keep = ("GPU verdict", "DALI", "torch ", "PIL ")
        return "; ".join(" ".join(line.split()) for line in lines if line.startswith(keep))
    if stage == "jpegs":
        return "; ".join(line.strip() for line in lines if "JPEGs" in line)
    tail = [line.strip("= ") for line in lines if _PYTEST_TAIL.search(line)]
    return tail[-1] if tail else ""


def rows_headline(payload: dict) -> str:
    """Per workload, each measured row's images/s, with its data wait or CPU cores where the report has
    them; then, for the dali experiment, the fastest value of each setting it varied."""
    parts = []
    for workload in dict.fromkeys(r["workload"] for r in payload.get("rows", [])):
        cells = []
        for r in payload["rows"]:
            if r["workload"] != workload:
                continue
            if r["status"] != "ok":
                cells.append(f"{r['name']} {r['status']}")
                continue
            extra = r.get("extra") or {}
            more = [f"wait {common.fmt_pct(extra['data_wait'])}" if extra.get("data_wait") is not None else "",
                    f"{extra['cores']:.1f} cores" if extra.get("cores") is not None else ""]
            more = ", ".join(m for m in more if m)
            cells.append(f"{r['name']} {common.fmt_num(r['rate'])}" + (f" ({more})" if more else ""))
        parts.append(f"{workload}: " + ", ".join(cells) + f" {payload.get('unit', 'images/s')}")
    best = [f"{c['factor']}={c['best']}" for c in payload.get("choices", []) if c.get("best") is not None]
    if best:
        parts.append("fastest: " + ", ".join(best))
    return "; ".join(parts)


def headline(keep: Path, tag: str, stage: str) -> str:
    report = keep / "reports" / f"{REPORTS[stage].format(tag=tag)}.json" if stage in REPORTS else None
    if report is not None and report.exists():
        return rows_headline(json.loads(report.read_text()))
    log = keep / "logs" / f"{stage}.log"
    return log_headline(stage, log.read_text(errors="replace")) if log.exists() else ""


def failures(keep: Path, stages: list[dict]) -> list[str]:
    """The FAILED/ERROR lines of the test stages (pytest's -rfE summary)."""
    out = []
    for s in stages:
        log = keep / "logs" / f"{s['stage']}.log"
        if s["stage"].endswith("tests") and log.exists():
            out += [f"{s['stage']}: {line.strip()}" for line in log.read_text(errors="replace").splitlines()
                    if line.startswith(("FAILED ", "ERROR "))]
    return out


def summary_markdown(keep: Path, tag: str) -> str:
    stages = read_stages(keep)
    lines = [[s["call"], s["stage"], s["status"] if s["status"] == "pass" else f"**{s['status']}**",
              f"{s['seconds']} ({s['limit']})", headline(keep, tag, s["stage"]).replace("|", "/")] for s in stages]
    failed = [s["stage"] for s in stages if s["status"] != "pass"]
    text = (f"# GPU run `{tag}`: {len(stages) - len(failed)} of {len(stages)} stages passed"
            + (f" (not: {', '.join(failed)})" if failed else "") + "\n\n"
            + common.markdown_table(["call", "stage", "result", "seconds (limit)", "headline"], lines))
    failing = failures(keep, stages)
    if failing:
        text += "\n\nFailing tests:\n\n" + "\n".join(f"- {line}" for line in failing)
    return text + "\n\nReports, logs and this table: `gpu-reports-" + tag + ".tar.gz` (benchmarks/README.md).\n"


def main(args) -> Path:
    keep, out = Path(args.keep), Path(args.out)
    machine = common.machine_info()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"summary-{args.tag}.md"
    body = summary_markdown(keep, args.tag)
    title, rest = body.split("\n\n", 1)
    common.write_text(path, f"{title}\n\n{common.machine_markdown(machine)}\n\n{rest}")
    print(body, flush=True)
    return path


if __name__ == "__main__":
    main(get_args_parser().parse_args())
