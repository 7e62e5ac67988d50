"""Time to accuracy: how long each backend takes the MNIST example to reach a test accuracy (99%).

This is the figure a user feels: the README's first command (``examples/train_mnist.py``: SmallCNN,
SGD + one-cycle, evaluation after every epoch) is run once per backend, one after another in one
process, with the same seed, so the weights, the batches and the augmentation are the same for every
backend and only the data loading differs. Reported per backend: training seconds until the first
epoch whose test accuracy reaches the target (epoch time only, evaluation excluded), the accuracy
reached, training images/s and the data-wait and GPU-idle fractions of ``fit``'s records.

MNIST is read from ``--data-root`` (torchvision's layout); without it the example trains on the
synthetic digits and the report says so: the 99% target is then a figure for the synthetic set, not
MNIST's.

    python benchmarks/bench_accuracy.py                    # every available backend, 3 epochs
    python benchmarks/bench_accuracy.py --quick --out /tmp/bench
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
from pathlib import Path

try:
    from . import common
except ImportError:  # run as a script: python benchmarks/bench_accuracy.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

from fastdata import available_backends, cli
from fastdata.engine import AMP_CHOICES

ROOT = Path(__file__).resolve().parents[1]


def _example():
    """examples/train_mnist.py as a module: the benchmark runs exactly what a user runs."""
    spec = importlib.util.spec_from_file_location("train_mnist", ROOT / "examples" / "train_mnist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = common.PresetParser(description="Seconds of training until the MNIST example reaches a test "
                            "accuracy, per backend.", add_help=add_help,
                            quick_help="1 epoch on 6,000/1,000 digits: checks that it runs, not how fast")
    backends = [b for b in available_backends() if b != "auto"]
    p.add_argument("--backends", nargs="+", default=backends, type=cli.named_backend, metavar="BACKEND",
                   help=f"default: every available backend ({', '.join(backends)})")
    p.add_argument("--target", type=cli.fraction, default=0.99,
                   help="test accuracy to reach, a fraction (default 0.99)")
    p.add_preset("--epochs", type=cli.positive_int, full=3, quick=1, help="epochs per backend")
    p.add_argument("--batch-size", type=cli.positive_int, default=256, help="default 256")
    p.add_argument("--lr", type=cli.positive_float, default=0.1, help="peak learning rate (default 0.1)")
    p.add_argument("--device", default=None, type=cli.device, help="cpu, cuda or cuda:N (default: CUDA when available)")
    p.add_argument("--amp", default="auto", choices=AMP_CHOICES, help="auto: bf16 (or fp16) on CUDA, off on CPU")
    p.add_argument("--workers", type=cli.nonnegative_int, default=None,
                   help="loader workers (default: the usable cores)")
    p.add_argument("--data", default="auto", choices=("auto", "mnist", "synthetic"),
                   help="auto: MNIST from --data-root when it is there, else synthetic digits")
    p.add_argument("--data-root", default="./data", type=cli.folder_path,
                   help="folder holding MNIST/raw (default ./data)")
    p.add_preset("--train-size", type=cli.positive_int, full=None, quick=6000, help="training images (None: all)")
    p.add_preset("--test-size", type=cli.positive_int, full=None, quick=1000, help="test images (None: all)")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    return p


def time_to_target(history: list[dict], target: float) -> tuple[float | None, int | None]:
    """(training seconds up to and including the first epoch at or above ``target``, that epoch) or
    (None, None) when no epoch reached it."""
    seconds = 0.0
    for record in history:
        seconds += record["seconds"]
        acc = record.get("eval_accuracy")
        if acc is not None and acc >= target:
            return seconds, record["epoch"]
    return None, None


def main(args) -> dict:
    example = _example()
    machine = common.machine_info()
    rows, dataset = [], None
    for backend in args.backends:
        argv = ["--backend", backend, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                "--lr", str(args.lr), "--amp", args.amp, "--data", args.data, "--data-root", args.data_root,
                "--no-progress"]
        for flag, value in (("--device", args.device), ("--workers", args.workers),
                            ("--train-size", args.train_size), ("--test-size", args.test_size)):
            if value is not None:
                argv += [flag, str(value)]
        print(f"\n== {backend}", flush=True)
        try:
            result = example.main(example.get_args_parser().parse_args(argv))
        except Exception as e:  # one broken backend must not hide the others' figures
            traceback.print_exc()
            rows.append({"backend": backend, "status": f"failed: {type(e).__name__}: {e}"[:200]})
            continue
        dataset = result["dataset"]
        seconds, epoch = time_to_target(result["history"], args.target)
        rows.append({"backend": backend, "status": "ok", "dataset": dataset, "device": result["device"],
                     "amp": result["amp"], "seconds_to_target": seconds, "epoch_reached": epoch,
                     "final_accuracy": result["test_accuracy"], "train_seconds": result["train_seconds"],
                     "images_per_second": result["images_per_second"],
                     "data_wait_fraction": result["data_wait_fraction"],
                     "gpu_idle_fraction": result["gpu_idle_fraction"]})

    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append([r["backend"], r["status"], "-", "-", "-", "-", "-"])
            continue
        reached = (f"{r['seconds_to_target']:.1f} s (epoch {r['epoch_reached']})"
                   if r["seconds_to_target"] is not None else f"not in {args.epochs} epochs")
        lines.append([r["backend"], reached, f"{r['final_accuracy']:.2%}", common.fmt_num(r["images_per_second"]),
                      common.fmt_pct(r["data_wait_fraction"]), common.fmt_pct(r["gpu_idle_fraction"]),
                      f"{r['train_seconds']:.1f} s"])
    header = ["backend", f"time to {args.target:.0%}", "final test accuracy", "train images/s", "data wait",
              "GPU idle", "training time"]
    note = ("real MNIST" if dataset == "mnist" else
            "synthetic digits (no MNIST under --data-root): the target is a figure for the synthetic set")
    body = (f"examples/train_mnist.py per backend, {args.epochs} epoch(s), batch {args.batch_size}, "
            f"lr {args.lr}, amp={args.amp}; data: {note}. Time counts training epochs only.\n\n"
            + common.markdown_table(header, lines))
    print("\n" + body, flush=True)
    tag = args.tag or common.machine_tag(machine)
    payload = {"benchmark": "accuracy", "target": args.target, "epochs": args.epochs, "dataset": dataset,
               "quick": args.quick, "rows": rows}
    chart = {f"seconds to {args.target:.0%}": [(r["backend"], r["seconds_to_target"], "backend") for r in rows
                                               if r["status"] == "ok" and r["seconds_to_target"] is not None],
             "training images/s": [(r["backend"], r["images_per_second"], "backend") for r in rows
                                   if r["status"] == "ok"]}
    chart = {k: v for k, v in chart.items() if v}
    payload["paths"] = common.write_reports(
        args.out, f"accuracy-{tag}", title=f"Time to {args.target:.0%} test accuracy", machine=machine,
        command=common.command_line("bench_accuracy.py", args.argv),
        body_md=body, payload=payload, chart_groups=chart, chart_xlabel="value", chart_log=False)
    return payload


if __name__ == "__main__":
    main(get_args_parser().parse_args())
