"""Training throughput per backend: how much of the step time the data costs.

``fastdata.engine.fit`` trains the package CNN (``fastdata.models.SmallCNN``) for a fixed number of
steps per epoch (the dataset holds exactly ``steps x batch`` images) with each loader. The first epoch
is a warm-up (worker start-up, caches, allocator, cuDNN's autotuning) and is not counted; the figures are
medians over the remaining epochs of fit's own records, each a whole epoch, as fit measures every epoch
after a run's first (``fit(timing_warmup=0)`` from the second round on: the process is warm by then, and
a cost every epoch pays, such as a loader's restart, belongs in the figures):

- ``images_per_second``: training throughput;
- ``data_wait_fraction``: host time blocked waiting for the next batch ÷ epoch time;
- ``gpu_idle_fraction`` (CUDA only): gaps between steps on the GPU timeline ÷ the epoch's GPU time;
- ``warmup_seconds``: the first round's warm-up (its first steps, as ``fit`` times them apart), reported
  on its own, so a slow start stays visible without bending the rates.

Contenders: the tutorial pipeline (``baseline``, as in bench_loaders.py), every available fastdata
backend, and ``limit``: ready float batches gathered from memory, i.e. the model's own speed with free
data. On a CPU-only machine the loader shares the cores with the model, so a loader that waits little
can still slow training by taking CPU from it: compare images/s with the limit as well.

    python benchmarks/bench_training.py
    python benchmarks/bench_training.py --quick --out /tmp/bench
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

try:
    from . import bench_loaders as loaders
    from . import common
except ImportError:  # run as a script: python benchmarks/bench_training.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_loaders as loaders
    from benchmarks import common

import fastdata
from fastdata import cli
from fastdata.config import usable_cores
from fastdata.engine import AMP_CHOICES

WORKLOADS = ("digits", "jpeg")


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = common.PresetParser(description="Training images/s, data-wait and GPU-idle fractions of "
                            "fastdata.engine.fit with each loader.", add_help=add_help,
                            quick_help="few small steps: checks that it runs, not how fast")
    p.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                   help="default: digits on CPU (a CNN on 224² photos trains at a few dozen images/s on "
                        "a CPU), digits and jpeg on CUDA")
    p.add_argument("--backends", nargs="+", default=loaders.backend_names(), choices=loaders.backend_names(),
                   help="fastdata backends to train with (default: all; unavailable ones are skipped)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the tutorial pipeline")
    p.add_argument("--no-limit", dest="limit", action="store_false",
                   help="skip the limit (ready batches gathered from memory: the model's own speed)")
    p.add_argument("--device", default=None, type=cli.device, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--workers", type=cli.nonnegative_int, default=usable_cores(),
                   help="loader worker processes (default: usable cores)")
    p.add_preset("--steps", type=cli.positive_int, full=30, quick=6, help="optimizer steps per epoch")
    # Round 1 is a warm-up that is not counted: one epoch alone would leave no figures at all.
    p.add_preset("--epochs", type=_rounds, full=3, quick=2, help="epochs per contender, the first one a warm-up")
    p.add_preset("--digits-batch", type=cli.positive_int, full=256, quick=64, help="batch size of the digits")
    p.add_preset("--jpeg-batch", type=cli.positive_int, full=64, quick=16, help="batch size of the photos")
    p.add_argument("--amp", default="auto", choices=AMP_CHOICES,
                   help="the step's precision (default auto: bf16 or fp16 on CUDA, off on the CPU)")
    p.add_argument("--data", default=None, type=common.existing_folder,
                   help="folder holding MNIST/raw (default: ./data when it holds MNIST, else synthetic digits; "
                        "a folder given must hold it)")
    p.add_argument("--cache", default=str(common.CACHE_DIR), help="where the generated JPEG folder is kept")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    return p


def _rounds(text: str) -> int:
    """``--epochs``: at least 2, the warm-up and one counted."""
    value = cli.positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2 (the first epoch is a warm-up), got {text!r}")
    return value


def default_workloads(device) -> list[str]:
    """Digits on a CPU (a CNN on 224² photos trains at a few dozen images/s there), both on CUDA."""
    return ["digits"] if device.type == "cpu" else list(WORKLOADS)


class Adapter:
    """Gives a plain iterable (the tutorial DataLoader, the gather limit) the loader contract fit uses."""

    def __init__(self, inner, device):
        self.inner, self.device = inner, device

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        return iter(self.inner)

    def set_epoch(self, epoch):  # the tutorial shuffles with the global RNG; nothing to set
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def close(self):
        pass


class NextPass:
    """The loader as fit sees it in each round: no ``set_epoch``, so each ``fit(epochs=1)`` trains the
    loader's next pass (fit lets a loader without ``set_epoch`` start its own next pass at ``iter()``),
    as one ``fit(epochs=N)`` trains epochs 0..N-1. With ``set_epoch``, every round's fit would set epoch 0
    again: a loader that reads ahead into the next epoch (dali's one pipeline, fed across epochs) would
    drop that and start over each round, a cost a real run never pays (on the H200, 2.4 s a round:
    767 images/s for dali on JPEGs at 86% data wait, 2026-11-28)."""

    def __init__(self, loader):
        self.loader, self.device = loader, loader.device

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


class Trainee:
    """One contender: its loader, its own SmallCNN and optimizer (the same initial weights for all),
    and the records of the epochs it has trained."""

    def __init__(self, name, role, loader, source):
        from fastdata.engine import default_optimizer
        from fastdata.models import SmallCNN

        self.name, self.role, self.loader = name, role, loader
        torch.manual_seed(0)
        device = torch.device(loader.device)
        self.model = SmallCNN(num_classes=source.num_classes, in_channels=source.channels).to(device)
        self.optimizer = default_optimizer(self.model.parameters(), device)   # fit's own default
        self.history: list[dict] = []
        self.error: str | None = None
        self.t0 = time.perf_counter()

    def epoch(self, args) -> None:
        """Train one more epoch (``fit`` for one epoch, the optimizer kept between calls). Only the first
        round's call times a warm-up apart: later ones are epochs of a warm run, measured whole as fit
        measures its own epochs after the first."""
        from fastdata.engine import fit

        try:
            self.history += fit(self.model, NextPass(self.loader), epochs=1, optimizer=self.optimizer, amp=args.amp,
                                progress=False, timing_warmup=5 if not self.history else 0)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            print(f"  {self.name:<10} error: {self.error}", flush=True)
            traceback.print_exc()

    def result(self) -> dict:
        timed = self.history[1:] if len(self.history) > 1 else self.history  # the first epoch: warm-up

        def med(key):
            values = [r[key] for r in timed if r.get(key) is not None]
            return statistics.median(values) if values else None

        warmup = self.history[0].get("warmup_seconds") if self.history else None
        return {"rate": med("images_per_second"), "data_wait": med("data_wait_fraction"),
                "gpu_idle": med("gpu_idle_fraction"), "warmup_seconds": warmup, "epochs": self.history,
                "passes": [r["images_per_second"] for r in timed],
                "data_wait_passes": [r["data_wait_fraction"] for r in timed
                                     if r.get("data_wait_fraction") is not None]}


def train_in_rounds(trainees: list[Trainee], args) -> None:
    """``args.epochs`` rounds, each contender training one epoch per round (the first round is the
    warm-up), the order rotating by one each round: pass k of every contender runs within the same
    minutes, so the ratios are paired round by round (see bench_loaders.time_rounds)."""
    for k in range(args.epochs):
        live = [t for t in trainees if t.error is None]
        shift = k % len(live) if live else 0
        for t in live[shift:] + live[:shift]:
            t.epoch(args)


def run_workload(workload, args, device, rows, sources):
    batch = args.digits_batch if workload == "digits" else args.jpeg_batch
    n = args.steps * batch
    if workload == "digits":
        source, desc = loaders.digits_source(n, args.data)
    else:
        source, desc = loaders.jpeg_source(n, args.cache)
    sources[workload] = f"{desc}; {args.steps} steps of {batch} per epoch"
    print(f"\n[{workload}] {sources[workload]}, {args.workers} workers, device {device}", flush=True)
    available = set(fastdata.available_backends())

    contenders = []
    if args.baseline:
        contenders.append(("baseline", "baseline", lambda: Adapter(loaders.baseline_loader(
            workload, source, batch, args.workers, device), device)))
    for name in args.backends:
        if name not in available:
            rows.append(common.Row(workload, name, "fastdata", status="skipped", note=common.unavailable(name)))
            continue
        contenders.append((name, "fastdata", lambda name=name: fastdata.make_loader(
            source, name, batch_size=batch, device=device, num_workers=args.workers, train=True)))
    if args.limit and workload == "digits":
        contenders.append(("limit", "limit", lambda: Adapter(loaders.DigitsGather(source, batch, device), device)))

    trainees = []
    for name, role, build in contenders:
        t = loaders.try_make(rows, workload, name, role, lambda n=name, r=role, b=build: Trainee(n, r, b(), source))
        if t is not None:
            trainees.append(t)
    try:
        train_in_rounds(trainees, args)
    finally:
        for t in trainees:
            t.loader.close()
    rounds = min((len(t.history) for t in trainees if t.error is None), default=0)
    for t in trainees:
        if t.error is not None:
            rows.append(common.Row(workload, t.name, t.role, status="error", note=t.error))
            continue
        t.history = t.history[:rounds]
        res = t.result()
        note = getattr(t.loader, "name", "") if t.name == "auto" else ""
        row = common.Row(workload, t.name, t.role, rate=res["rate"], passes=res["passes"], paired=True,
                         note=f"auto picked {note!r}" if note else "",
                         extra={"data_wait": res["data_wait"], "data_wait_passes": res["data_wait_passes"],
                                "gpu_idle": res["gpu_idle"], "warmup_seconds": res["warmup_seconds"],
                                "epochs": res["epochs"], "wall_s": time.perf_counter() - t.t0})
        rows.append(row)
        idle = f"  gpu idle {common.fmt_pct(res['gpu_idle'])}" if res["gpu_idle"] is not None else ""
        print(f"  {t.name:<10} {common.fmt_num(res['rate']):>8} images/s  data wait "
              f"{common.fmt_pct(res['data_wait'])}{idle}  warm-up {common.fmt_num(res['warmup_seconds'])} s",
              flush=True)


def _fmt_wait(row) -> str:
    """The median data wait with its epochs' spread: '0.4% (0.2%–0.9%)'."""
    rng = common.spread(row.extra.get("data_wait_passes"))
    text = common.fmt_pct(row.extra.get("data_wait"))
    return text + (f" ({common.fmt_spread(rng, common.fmt_pct)})" if rng and rng[0] != rng[1] else "")


def targets_for(device) -> list[common.Target]:
    if device.type != "cpu":
        return []  # the training targets are for the CPU machine
    return [common.Target("digits", name, column="data_wait", at_most=0.02,
                          label=f"training on CPU: {name} data_wait_fraction <= 2%")
            for name in ("memory", "prefetch", "torch")]


def main(args) -> dict:
    device = fastdata.config.resolve_device(args.device)
    workloads = args.workloads or default_workloads(device)
    loaders.check_data(args, workloads)
    machine = common.machine_info()
    rows: list[common.Row] = []
    sources: dict[str, str] = {}
    for workload in workloads:
        run_workload(workload, args, device, rows, sources)
    common.add_ratios(rows)
    targets = [t.evaluate(rows) for t in targets_for(device) if t.workload in sources]

    parts = []
    cuda = device.type == "cuda"
    for workload in [w for w in WORKLOADS if w in sources]:
        lines = []
        for r in [r for r in rows if r.workload == workload]:
            ok = r.status == "ok"
            line = [r.name, common.fmt_rate(r),
                    common.fmt_vs(r.vs_baseline, r.vs_baseline_range if r.role != "baseline" else None),
                    common.fmt_vs(r.vs_limit, r.vs_limit_range if r.role != "limit" else None),
                    _fmt_wait(r) if ok else "-"]
            if cuda:
                line.append(common.fmt_pct(r.extra.get("gpu_idle")) if ok else "-")
            line.append(common.fmt_num(r.extra.get("warmup_seconds")) if ok else "-")
            lines.append(line + [r.note.replace("|", "/")[:160]])
        header = ["contender", "train images/s", "vs baseline", "vs limit", "data wait"] + \
                 (["GPU idle"] if cuda else []) + ["warm-up s", "note"]
        parts.append(f"## {workload}\n\n{sources[workload]}; SmallCNN, amp={args.amp}, {args.workers} workers, "
                     f"device `{device}`; trained in rounds, each contender one epoch per round, the order "
                     f"rotating; median of rounds 2-{args.epochs}, whole epochs (round 1 is a warm-up; "
                     f"slowest–fastest epoch in brackets; ratios paired round by round, a ratio whose range "
                     f"covers 1 is {common.NOISE}). Warm-up s: round 1's first steps, which fit times apart "
                     f"(CUDA and cuDNN start-up, the first workers), in seconds.\n\n"
                     + common.markdown_table(header, lines))
    if not cuda:
        parts.append("GPU idle is measured with CUDA events and is not available on a CPU-only machine.")
    if targets:
        parts.append("## Targets\n\n" + common.targets_markdown(targets))
    body = "\n\n".join(parts)
    print("\n" + body, flush=True)
    tag = args.tag or common.machine_tag(machine)
    payload = {"benchmark": "training", "device": str(device), "workers": args.workers, "steps": args.steps,
               "epochs": args.epochs, "amp": args.amp, "quick": args.quick, "sources": sources,
               "unit": "training images/s", "rows": [vars(r) for r in rows],
               "targets": [vars(t) | {"label": t.describe()} for t in targets]}
    chart = {f"{w}: training images/s": [(r.name, r.rate, r.role, common.spread(r.passes))
                                          for r in rows if r.workload == w and r.status == "ok"]
             for w in sources}
    payload["paths"] = common.write_reports(
        args.out, f"training-{tag}", title="Training throughput", machine=machine,
        command=common.command_line("bench_training.py", args.argv),
        body_md=body, payload=payload, chart_groups=chart,
        chart_xlabel="training images/s", chart_log=False)
    return payload


if __name__ == "__main__":
    main(get_args_parser().parse_args())
