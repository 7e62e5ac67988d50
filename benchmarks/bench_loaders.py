"""Loader throughput: which backend delivers the most images/s on this machine.

Every contender delivers the contract form — a normalized float (N, C, H, W) batch on the device with
the training augmentation on. All of a workload's contenders are built in the same process, then
timed in rounds (each runs one pass per round), so the ratios are paired round by round and hold on
a machine whose speed drifts. Contenders per workload:

- ``baseline``: what the usual tutorials write: a torchvision dataset returning PIL images,
  ``transforms`` (augmentation, ``ToTensor``, ``Normalize``), ``DataLoader(shuffle=True,
  num_workers=<cores>, pin_memory=<cuda>)`` and ``.to(device)``.
- each fastdata backend that is available here, through ``fastdata.make_loader`` with the same batch
  size; a backend that is missing (not installed, not written yet, cannot read the source) is listed
  as skipped with the reason.
- ``limit``: what no loader of this data can beat on this machine. Photos: decoding the same files and
  nothing else (PIL open + load + convert RGB, full resolution) with the same number of workers. Digits
  in memory: a random gather of ready normalized float batches from one prebuilt tensor.

Note that a loader can beat the photo "limit": the torch backend decodes JPEGs at reduced scale
(``Image.draft``) when the crop is shrunk anyway, which skips most of the IDCT; the limit is the honest
full decode the issue defines, and the report shows the ratio as measured.

    python benchmarks/bench_loaders.py                   # full run → benchmarks/results/
    python benchmarks/bench_loaders.py --quick --out /tmp/bench
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

try:
    from . import common
except ImportError:  # run as a script: python benchmarks/bench_loaders.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

import fastdata
from fastdata import cli, registry
from fastdata.config import usable_cores

WORKLOADS = ("digits", "jpeg")


def backend_names() -> list[str]:
    """The registry's backends in its table order, then ``auto`` (what it picks, measured the same way)."""
    return [s.name for s in registry.specs()] + ["auto"]


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = common.PresetParser(description="Loader throughput (images/s) of the tutorial pipeline, every "
                            "available fastdata backend and the machine's limit.", add_help=add_help,
                            quick_help="small sizes, one timed pass: checks that it runs (under 2 minutes "
                                       "on 2 cores), not how fast")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                   help="digits (28x28 arrays) and/or jpeg (a folder of photos) (default: both)")
    p.add_argument("--backends", nargs="+", default=backend_names(), choices=backend_names(),
                   help="fastdata backends to try (default: all; unavailable ones are skipped)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the tutorial pipeline")
    p.add_argument("--no-limit", dest="limit", action="store_false", help="skip the limit measurement")
    p.add_argument("--device", default=None, type=cli.device, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--workers", type=cli.positive_int, default=usable_cores(),
                   help="worker processes/threads (default: usable cores)")
    p.add_preset("--passes", type=cli.positive_int, full=5, quick=1,
                 help="timed rounds (each contender one pass per round; medians reported); one warm-up "
                      "pass each precedes them")
    p.add_preset("--digits", type=cli.positive_int, full=60_000, quick=6000, help="digit images")
    p.add_argument("--digits-batch", type=cli.positive_int, default=256, help="default 256")
    p.add_preset("--min-pass", type=cli.nonnegative_float, full=2.0, quick=0.0,
                 help="seconds a timed pass lasts at least: a pass repeats whole epochs until then")
    p.add_preset("--jpeg-images", type=cli.positive_int, full=1500, quick=96, help="photos in the JPEG folder")
    p.add_preset("--jpeg-batch", type=cli.positive_int, full=64, quick=32)
    p.add_argument("--data", default=None, type=common.existing_folder,
                   help="folder holding MNIST/raw (default: ./data when it holds MNIST, else synthetic digits; "
                        "a folder given must hold it)")
    p.add_argument("--cache", default=str(common.CACHE_DIR), help="where the generated JPEG folder is kept")
    p.add_preset("--budget", type=cli.positive_float, full=60.0, quick=8.0,
                 help="seconds of timed passes per contender before stopping early")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    return p


# ------------------------------------------------------------------------------------ consuming
def consume(loader, device) -> int:
    """Iterate one pass; touch every batch so nothing can be skipped lazily. Returns images seen."""
    n = 0
    check = torch.zeros((), device=device)
    for images, labels in loader:
        # One strided read per batch: forces the batch to exist (DALI outputs, lazy views) at the cost
        # of N elements, not the whole tensor.
        check += images[:, 0, 0, 0].sum()
        n += labels.shape[0]
    float(check)  # one host sync per pass, not one per batch
    return n


def check_contract(loader, device, name) -> str:
    """First batch: normalized float (N, C, H, W) on the device. Returns a description for the report."""
    images, labels = next(iter(loader))
    problems = []
    if images.device.type != torch.device(device).type:
        problems.append(f"images on {images.device}, not {device}")
    if not images.is_floating_point() or images.dim() != 4:
        problems.append(f"images {images.dtype} {tuple(images.shape)}, not float (N, C, H, W)")
    if labels.dtype != torch.int64:
        problems.append(f"labels {labels.dtype}, not int64")
    if problems:
        raise AssertionError(f"{name} breaks the contract: " + "; ".join(problems))
    return f"{tuple(images.shape[1:])} {str(images.dtype).replace('torch.', '')}"


# ------------------------------------------------------------------------------------ baseline
class TutorialDigits(torch.utils.data.Dataset):
    """What ``torchvision.datasets.MNIST`` does: uint8 arrays in memory, one PIL image per sample."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform):
        self.images = images  # (N, 28, 28) uint8
        self.labels = labels
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        from PIL import Image

        img = Image.fromarray(self.images[i], mode="L")
        return self.transform(img), int(self.labels[i])


def baseline_loader(workload, source, batch, workers, device):
    from torchvision import datasets, transforms

    if workload == "digits":
        tf = transforms.Compose([transforms.RandomCrop(28, padding=2), transforms.ToTensor(),
                                 transforms.Normalize(source.mean, source.std)])
        ds = TutorialDigits(source.images[..., 0], source.labels, tf)
    else:
        tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor(), transforms.Normalize(source.mean, source.std)])
        ds = datasets.ImageFolder(str(source.root), transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                     pin_memory=device.type == "cuda")

    class ToDevice:  # the tutorial's training loop: `images, labels = images.to(device), labels.to(device)`
        def __len__(self):
            return len(dl)

        def __iter__(self):
            for images, labels in dl:
                yield images.to(device), labels.to(device)

    return ToDevice()


# ------------------------------------------------------------------------------------ limits
class DigitsGather:
    """Ready normalized float batches: a permutation and an index per batch, nothing else."""

    def __init__(self, source, batch, device):
        x = torch.from_numpy(source.images).to(device).permute(0, 3, 1, 2).float().div_(255)
        mean = torch.tensor(source.mean, device=device).view(1, -1, 1, 1)
        std = torch.tensor(source.std, device=device).view(1, -1, 1, 1)
        self.images = ((x - mean) / std).contiguous()
        self.labels = torch.from_numpy(source.labels).to(device)
        self.batch, self.device = batch, device

    def __len__(self):
        return len(self.labels) // self.batch

    def __iter__(self):
        perm = torch.randperm(len(self.labels), device=self.device)
        for k in range(len(self)):
            ids = perm[k * self.batch:(k + 1) * self.batch]
            yield self.images[ids], self.labels[ids]


class DecodeOnly(torch.utils.data.Dataset):
    """Job → decode every file of one batch at full resolution; return only the count.

    Returning a count (not pixels) keeps inter-process traffic out of the measurement: this is the
    decode cost alone, the part every photo loader has to pay (unless it decodes at reduced scale).
    """

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, ids):
        from PIL import Image

        for i in ids:
            with Image.open(self.paths[i]) as img:
                img.load()
                img.convert("RGB")
        return len(ids)


class DecodeLimit:
    def __init__(self, source, batch, workers):
        self.paths = source.paths
        self.batch = batch
        jobs = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(len(self.paths))),
          batch, drop_last=True)
        self.dl = torch.utils.data.DataLoader(DecodeOnly(self.paths), batch_size=None, sampler=jobs,
           num_workers=workers, persistent_workers=workers > 0,
           prefetch_factor=4 if workers else None)

    def __len__(self):
        return len(self.dl)

    def count(self) -> int:
        return sum(self.dl)

    def close(self) -> None:
        """Let the persistent workers go (they exit with the DataLoader's iterator), not at interpreter exit:
        bench_dali_gpu times rows after this one, and counts the CPU of every live worker."""
        self.dl = None


# ------------------------------------------------------------------------------------ sources
def digits_source(count: int, data: str | None):
    """(source, description): the first ``count`` MNIST images under ``data``. ``data`` None: under
    ./data, else synthetic digits (saying so); a folder given without MNIST ends the run naming it: a
    report of synthetic digits taken for MNIST's would mislead."""
    from fastdata.datasets import MNIST, SyntheticDigits

    given, data = data is not None, data if data is not None else "./data"
    try:
        src = MNIST(data, train=True, download=False)
        if count < len(src):  # --quick or --digits: a prefix of MNIST
            from fastdata.datasets import ArraySource

            src = ArraySource(src.images[:count], src.labels[:count], mean=src.mean, std=src.std,
                              name="mnist", digits=True)
        return src, f"MNIST from {data} ({len(src):,} x 28x28)"
    except FileNotFoundError as e:
        if given:
            raise SystemExit(f"--data {data}: no MNIST there ({e}); leave --data out to measure synthetic "
                             f"digits") from None
        src = SyntheticDigits(count)
        return src, f"SyntheticDigits ({len(src):,} x 28x28; no MNIST under {data})"


def jpeg_source(count: int, cache: str):
    """(source, description): a generated folder of ``count`` photos (rounded up to 10 classes), kept
    under ``cache`` between runs."""
    from fastdata.datasets import ImageFolder

    root = common.photo_folder(cache, count)
    src = ImageFolder(root)
    kb = sum(Path(p).stat().st_size for p in src.paths) / len(src) / 1024
    return src, f"ImageFolder {root} ({len(src):,} JPEGs, ~{kb:.0f} KB each), RandomResizedCrop 224 + flip"


# ------------------------------------------------------------------------------------ measuring
class Contender:
    """One built contender of a workload: its loader and how one pass of it is run and counted."""

    def __init__(self, workload, name, role, loader, note, setup, run, shape):
        self.workload, self.name, self.role, self.loader, self.note = workload, name, role, loader, note
        self.setup, self.run, self.shape = setup, run, shape
        self.seconds: list[float] = []
        self.items: list[int] = []
        self.warm = 0.0
        self.error: str | None = None

    def close(self):
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


def repeated(run_epoch, min_seconds: float):
    """A pass of at least ``min_seconds``: whole epochs of ``run_epoch`` (which returns the images it
    handled) until then; returns the images handled. Why: a pass of 60,000 digits from memory takes
    0.1 s, where a scheduler hiccup moves the rate by a third."""
    def run():
        t0, n = time.perf_counter(), 0
        while True:
            n += run_epoch()
            if time.perf_counter() - t0 >= min_seconds:
                return n
    return run


def try_make(rows, workload, name, role, make):
    """``make()``'s result, or None after appending a skipped Row (not installed, or a backend that
    cannot read this source: its error says so) or an error Row (with the traceback printed)."""
    try:
        return make()
    except (ImportError, fastdata.MissingDependency) as e:
        rows.append(common.Row(workload, name, role, status="skipped", note=f"not available: {e}"))
        print(f"  {name:<10} skipped: {e}", flush=True)
    except Exception as e:
        status = "skipped" if isinstance(e, (TypeError, fastdata.CacheDoesNotFit)) else "error"
        rows.append(common.Row(workload, name, role, status=status, note=f"{type(e).__name__}: {e}"))
        print(f"  {name:<10} {status}: {type(e).__name__}: {e}", flush=True)
        if status == "error":
            traceback.print_exc()
    return None


def build(rows, workload, name, role, make, device, run=None, min_pass: float = 0.0) -> Contender | None:
    """Build a contender and check its first batch; None (with a skipped or error Row) when it cannot.
    Each of its passes repeats whole epochs until it lasted ``min_pass`` seconds."""
    t0 = time.perf_counter()
    made = try_make(rows, workload, name, role, make)
    if made is None:
        return None
    loader, note = made
    setup = time.perf_counter() - t0
    try:
        if run is None:
            shape = check_contract(loader, device, name)
            run = lambda: consume(loader, device)  # noqa: E731
        else:
            shape = "decode only"
    except Exception as e:
        rows.append(common.Row(workload, name, role, status="error", note=f"{type(e).__name__}: {e}"))
        print(f"  {name:<10} error: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        return None
    print(f"  {name:<10} built in {setup:.2f}s: {note}", flush=True)
    return Contender(workload, name, role, loader, note, setup, repeated(run, min_pass), shape)


def _one_pass(c: Contender, device) -> float | None:
    """Run one pass of ``c``; its seconds, or None after recording the error (``c`` then drops out)."""
    try:
        common.sync(device)
        t0 = time.perf_counter()
        n = c.run()
        common.sync(device)
        c.items.append(int(n))
        return time.perf_counter() - t0
    except Exception as e:
        c.error = f"{type(e).__name__}: {e}"
        print(f"  {c.name:<10} error: {c.error}", flush=True)
        traceback.print_exc()
        return None


def time_rounds(contenders: list[Contender], passes: int, device, budget_s: float) -> None:
    """One warm-up pass each, then ``passes`` rounds in which every contender runs one timed pass.

    Why rounds: this shared machine's speed drifts by tens of percent within minutes. Timed one after
    another, a contender measured in a slow minute loses to one measured in a fast one; in rounds,
    pass k of every contender runs within the same minute, so the ratios are paired round by round
    (``common.row_ratio``). Each round starts one contender later than the previous, so none always
    runs first, right after the others' work. Stops early once a contender's timed passes took
    ``budget_s`` in all (after at least one round)."""
    for c in contenders:
        t0 = time.perf_counter()
        if _one_pass(c, device) is not None:
            c.items.clear()
            c.warm = time.perf_counter() - t0
    for k in range(passes):
        live = [c for c in contenders if c.error is None]
        if not live:
            break
        shift = k % len(live)
        for c in live[shift:] + live[:shift]:
            sec = _one_pass(c, device)
            if sec is not None:
                c.seconds.append(sec)
        print(f"  round {k + 1}/{passes}: " + ", ".join(
            f"{c.name} {common.fmt_num(c.items[-1] / c.seconds[-1])}" for c in live if c.error is None and c.seconds),
              flush=True)
        if any(sum(c.seconds) > budget_s for c in live):
            break


def add_rows(rows, contenders: list[Contender]) -> None:
    """A Row per timed contender (paired: they ran in rounds); an error Row for one that failed."""
    rounds = min((len(c.seconds) for c in contenders if c.error is None), default=0)
    for c in contenders:
        if c.error is not None:
            rows.append(common.Row(c.workload, c.name, c.role, status="error", note=c.error))
            continue
        seconds, items = c.seconds[:rounds], c.items[:rounds]
        rates = [n / s for n, s in zip(items, seconds, strict=True)]
        rows.append(common.Row(c.workload, c.name, c.role, rate=common.median_rate(seconds, items), passes=rates,
                               note=c.note, paired=True,
                               extra={"setup_s": c.setup, "warmup_s": c.warm, "batch": c.shape,
                                      "images_per_pass": items[0] if items else 0}))


def check_data(args, workloads) -> None:
    """Before any work: a ``--data`` folder given must hold MNIST when digits are measured."""
    if args.data is not None and "digits" in workloads:
        digits_source(1, args.data)


def run_workload(workload, args, device, rows, sources):
    source, desc = (digits_source(args.digits, args.data) if workload == "digits"
                    else jpeg_source(args.jpeg_images, args.cache))
    sources[workload] = desc
    batch = args.digits_batch if workload == "digits" else args.jpeg_batch
    print(f"\n[{workload}] {desc}; batch {batch}, {args.workers} workers, device {device}", flush=True)

    built: list[Contender] = []

    def add(c):
        if c is not None:
            built.append(c)

    if args.baseline:
        add(build(rows, workload, "baseline", "baseline",
                  lambda: (baseline_loader(workload, source, batch, args.workers, device),
                           "torchvision transforms + DataLoader"), device, min_pass=args.min_pass))

    available = set(fastdata.available_backends())
    for name in args.backends:
        if name not in available:
            note = common.unavailable(name)
            rows.append(common.Row(workload, name, "fastdata", status="skipped", note=note))
            print(f"  {name:<10} skipped: {note}", flush=True)
            continue

        def make(name=name):
            picked = []
            handler = _Capture(picked)
            logging.getLogger("fastdata").addHandler(handler)
            try:
                loader = fastdata.make_loader(source, name, batch_size=batch, device=device,
                                              num_workers=args.workers, train=True)
            finally:
                logging.getLogger("fastdata").removeHandler(handler)
            note = f"make_loader(backend={name!r})"
            if name == "auto":
                chosen = getattr(loader, "name", type(loader).__name__)
                note = f"auto picked {chosen!r}" + (f": {picked[0]}" if picked else "")
            return loader, note

        add(build(rows, workload, name, "fastdata", make, device, min_pass=args.min_pass))

    if args.limit:
        if workload == "digits":
            add(build(rows, workload, "limit", "limit",
                      lambda: (DigitsGather(source, batch, device), "gather of ready float batches"), device,
                      min_pass=args.min_pass))
        else:
            lim = DecodeLimit(source, batch, args.workers)
            add(build(rows, workload, "limit", "limit",
                      lambda: (lim, f"PIL full decode + RGB only, {args.workers} workers"), device, run=lim.count,
                      min_pass=args.min_pass))
    try:
        time_rounds(built, args.passes, device, args.budget)
    finally:
        for c in built:
            c.close()
    add_rows(rows, built)


class _Capture(logging.Handler):
    """Collects the reason ``auto`` logs for its choice: the record's (backend, reason) arguments, not
    the whole line, which repeats the pick and adds make_loader's hint about ``quiet``."""

    def __init__(self, out):
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record):
        args = record.args if isinstance(record.args, tuple) else ()
        if "picked" in str(record.msg) and len(args) == 2:
            self.out.append(str(args[1]))


# ------------------------------------------------------------------------------------ report
def targets_for(device) -> list[common.Target]:
    """The project's goals (issue 5, and issue 13's for photos). DALI's figure is its CPU pipeline on a
    CPU-only machine."""
    dali = "dali (CPU)" if device.type == "cpu" else "dali"
    return [
        common.Target("digits", "memory", "baseline", 100, label="digits: memory >= 100x baseline"),
        common.Target("digits", "torch", "baseline", 5, label="digits: torch >= 5x baseline"),
        common.Target("digits", "dali", "baseline", 3, label=f"digits: {dali} >= 3x baseline"),
        common.Target("jpeg", "torch", "limit", 0.9, label="jpeg: torch >= 0.9x decode-only limit"),
        common.Target("jpeg", "torch", "dali", 1.0, label=f"jpeg: torch faster than {dali}"),
        # Issue 13 (decode less): region decoding must beat the full decode it no longer does.
        common.Target("jpeg", "torch", "limit", 1.0, label="jpeg: torch >= 1.0x the full-decode limit (issue 13)"),
        common.Target("jpeg", "dali", "limit", 1.0, label=f"jpeg: {dali} >= 1.0x the full-decode limit (issue 13)"),
    ]


def results_markdown(rows, sources, targets, args, device) -> str:
    parts = []
    for workload in [w for w in WORKLOADS if w in sources]:
        lines = []
        for r in [r for r in rows if r.workload == workload]:
            lines.append([r.name, r.role, common.fmt_rate(r),
                          common.fmt_vs(r.vs_baseline, r.vs_baseline_range if r.role != "baseline" else None),
                          common.fmt_vs(r.vs_limit, r.vs_limit_range if r.role != "limit" else None),
                          f"{r.extra['setup_s']:.2f}" if "setup_s" in r.extra else "-",
                          f"{r.extra['warmup_s']:.2f}" if "warmup_s" in r.extra else "-",
                          r.note.replace("|", "/")[:160]])
        batch = args.digits_batch if workload == "digits" else args.jpeg_batch
        parts.append(f"## {workload}\n\n{sources[workload]}. Batch {batch}, {args.workers} workers, device "
                     f"`{device}`. Every contender is built first, then each runs one warm-up pass, then "
                     f"{args.passes} round(s) in which each runs one timed pass; rates are the median pass "
                     f"(slowest–fastest in brackets), ratios the median of the per-round ratios (lowest–highest "
                     f"round in brackets; a ratio whose range covers 1 is {common.NOISE}).\n\n"
                     + common.markdown_table(["contender", "role", "images/s", "vs baseline", "vs limit",
                                              "setup s", "warm-up pass s", "note"], lines))
    if targets:
        parts.append("## Targets\n\n" + common.targets_markdown(targets))
    return "\n\n".join(parts)


def main(args) -> dict:
    """Run the benchmark; returns the JSON payload (also written under ``args.out``)."""
    device = fastdata.config.resolve_device(args.device)
    check_data(args, args.workloads)
    torch.manual_seed(0)

    machine = common.machine_info()
    rows: list[common.Row] = []
    sources: dict[str, str] = {}
    for workload in args.workloads:
        run_workload(workload, args, device, rows, sources)
    common.add_ratios(rows)
    targets = [t.evaluate(rows) for t in targets_for(device) if t.workload in sources]

    body = results_markdown(rows, sources, targets, args, device)
    print("\n" + body, flush=True)
    tag = args.tag or common.machine_tag(machine)
    payload = {"benchmark": "loaders", "device": str(device), "workers": args.workers, "passes": args.passes,
               "quick": args.quick, "sources": sources, "unit": "images/s",
               "rows": [vars(r) for r in rows], "targets": [vars(t) | {"label": t.describe()} for t in targets]}
    batch = {"digits": args.digits_batch, "jpeg": args.jpeg_batch}
    chart = {f"{w} ({sources[w].split()[0]}), batch {batch[w]}":
             [(r.name, r.rate, r.role, common.spread(r.passes)) for r in rows if r.workload == w and r.status == "ok"]
             for w in sources}
    payload["paths"] = common.write_reports(
        args.out, f"loaders-{tag}", title="Loader throughput", machine=machine,
        command=common.command_line("bench_loaders.py", args.argv), body_md=body,
        payload=payload, chart_groups=chart, chart_xlabel="images/s (log scale)")
    return payload


if __name__ == "__main__":
    main(get_args_parser().parse_args())
