"""Which settings make the dali backend fastest on a GPU: one experiment, sized for one call (issue 30).

On one JPEG folder (``common.photo_folder``: 1,500 ImageNet-sized photos, ~88 KB each) and one recipe
(RandomResizedCrop 224 + flip, normalized float batches on the device, batch 64), rows in this order:

- ``ceiling``: DALI's own pipeline with nothing of fastdata in it: ``fn.readers.file`` →
  ``fn.decoders.image`` (``mixed``: nvJPEG) → ``fn.random_resized_crop`` → ``fn.crop_mirror_normalize``,
  through ``DALIGenericIterator``; at DALI's default ``hw_decoder_load`` and at each ``--hw-loads`` value.
  What the dali backend could reach here: the gap is fastdata's own cost (sampler, reader threads,
  validation, the crop boxes).
- ``dali``: fastdata's dali backend at the installed defaults, then one setting changed at a time:
  ``hw_decoder_load`` (the share of JPEGs sent to the GPU's hardware decoder), ``fancy_upsampling``,
  ``preallocate``, ``prefetch_queue_depth``, the batch size, ``num_workers`` (DALI's threads), ``affine`` and
  ``handover`` (the consumer's CUDA stream waiting for each batch, or the host waiting for it as DALI's
  own iterator does), ``driver`` (DALI's iteration in the consumer's ``next()`` or in a thread of its
  own). A row that sets only what the ``dali`` row ran with (an installed default, the first batch
  size, ``--workers``), or a ceiling row at DALI's default 0.65, shows that reference row's figures
  instead of spending the call's time on them again. A
  setting the installed fastdata refuses (an unknown option) is listed as "not supported by this
  fastdata", not an error.
- ``torch``: the torch backend (worker processes, region decode) and ``limit``: PIL decoding the same
  files at full resolution and nothing else on ``--workers`` processes (bench_loaders' limit).

Each row is built, warmed up by one pass (worker start-up, DALI's allocations, fastdata's one-time file
check), timed over ``--passes`` passes (each repeats whole epochs until it lasted ``--min-pass`` s), and
closed before the next row is built. Why one after another and not in rounds as bench_loaders times:
a built DALI pipeline keeps its threads and the torch backend its workers, and what they do between
passes would count in the other rows' CPU. Each row reports images/s (median pass, slowest–fastest in
brackets) and the CPU cores it kept busy: CPU seconds of this process and all its descendants (live
workers read from /proc, exited ones from ``getrusage(RUSAGE_CHILDREN)``) over the pass's wall seconds.
Ratios between rows are not paired: their range is the one the two spreads allow.

On a machine without a GPU (``--device cpu``, what ``--quick --device cpu`` checks in the tests) the
GPU-only settings (``hw_decoder_load``, ``fancy_upsampling``, ``preallocate``, ``handover``) are listed
as skipped, and the dali rows decode inside the pipeline (``decode="dali"``) as they do on a GPU.

    python benchmarks/bench_dali_gpu.py                       # rows start within --budget (170 s): one call
    python benchmarks/bench_dali_gpu.py --quick --device cpu --out /tmp/bench   # does it run
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:
    from . import bench_loaders as loaders
    from . import common
except ImportError:  # run as a script: python benchmarks/bench_dali_gpu.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_loaders as loaders
    from benchmarks import common

import fastdata
from fastdata import cli
from fastdata.config import usable_cores

WORKLOAD = "jpeg"
# nvJPEG's settings (the CPU decoder has none) and the stream hand-over (no stream on the CPU)
GPU_ONLY = ("hw_decoder_load", "fancy_upsampling", "preallocate", "handover")
UNSUPPORTED = "not supported"
DALI_HW_DEFAULT = 0.65   # fn.decoders.image's hw_decoder_load when none is given (DALI 2.4's documentation)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = common.PresetParser(description="The dali backend's settings on a GPU against DALI's own pipeline, the "
                            "torch backend and PIL's decode-only limit: images/s and CPU cores used.",
                            add_help=add_help, quick_help="tiny sizes, two short passes: checks that it runs "
                                                          "(with --device cpu: on any machine), not how fast")
    p.add_argument("--device", default=None, type=cli.device, help="cuda[:N] or cpu (default: cuda when available)")
    p.add_argument("--workers", type=cli.positive_int, default=usable_cores(),
                   help="num_workers of every row that does not vary it, and the limit's processes "
                        "(default: usable cores)")
    p.add_preset("--jpeg-images", type=cli.positive_int, full=1500, quick=40, help="photos in the JPEG folder")
    p.add_preset("--batches", type=cli.positive_int, nargs="+", full=[64, 256], quick=[8, 16],
                 help="batch sizes to try; the first is every other row's")
    p.add_preset("--thread-counts", type=cli.positive_int, nargs="+", full=[4, 16], quick=[1, 2],
                 help="num_workers values to try on the dali backend")
    p.add_argument("--hw-loads", type=cli.fraction, nargs="+", default=[0.0, 0.65, 1.0],
                   help="hw_decoder_load values (the ceiling's and the dali backend's)")
    p.add_argument("--depths", type=cli.positive_int, nargs="+", default=[2, 4], help="prefetch_queue_depth values")
    p.add_preset("--passes", type=cli.positive_int, full=3, quick=2,
                 help="timed passes per row, after one warm-up pass")
    p.add_preset("--min-pass", type=cli.nonnegative_float, full=1.0, quick=0.0,
                 help="seconds a pass lasts at least: whole epochs repeated until then")
    p.add_preset("--row-budget", type=cli.positive_float, full=15.0, quick=5.0,
                 help="seconds of timed passes per row before it stops early")
    p.add_preset("--budget", type=cli.positive_float, full=170.0, quick=120.0,
                 help="seconds for the whole experiment: rows not started by then are listed as not run")
    p.add_argument("--cache", default=str(common.CACHE_DIR), help="where the generated JPEG folder is kept")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    return p


# ------------------------------------------------------------------------------------ CPU used
def descendants_cpu(root: int) -> float:
    """CPU seconds (user + system, and their reaped children's) of every live descendant of ``root``,
    read from /proc; 0 where there is no /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, spent = {}, {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()   # after "(comm)", which may hold spaces
        except OSError:  # gone since the listing
            continue
        parent[pid] = int(rest[1])
        spent[pid] = sum(int(x) for x in rest[11:15]) / tick   # utime, stime, cutime, cstime
    total, todo = 0.0, [root]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while todo:
        for child in children.get(todo.pop(), []):
            total += spent[child]
            todo.append(child)
    return total


def cpu_seconds() -> float:
    """CPU seconds of this process (its threads: DALI's, pinning), its live descendants (workers) and the
    children it has reaped. A live worker's time is only in /proc: RUSAGE_CHILDREN counts it once reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    gone = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + gone.ru_utime + gone.ru_stime + descendants_cpu(os.getpid())


# ------------------------------------------------------------------------------------ DALI's own
class DaliCeiling:
    """DALI's own ImageNet-style training pipeline on a class-per-folder tree: no fastdata involved."""

    def __init__(self, source, batch: int, threads: int, device, hw_decoder_load: float | None = None):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        gpu = device.type == "cuda"
        index = (device.index if device.index is not None else torch.cuda.current_device()) if gpu else None
        mean = [255 * m for m in source.mean]
        std = [255 * s for s in source.std]
        decoder = {"device": "mixed"} if gpu else {"device": "cpu"}
        if hw_decoder_load is not None:
            decoder["hw_decoder_load"] = hw_decoder_load

        @pipeline_def(batch_size=batch, num_threads=threads, device_id=index, prefetch_queue_depth=2, seed=0)
        def pipeline():
            jpegs, labels = fn.readers.file(file_root=str(source.root), random_shuffle=True, name="Reader")
            images = fn.decoders.image(jpegs, output_type=types.RGB, **decoder)
            images = fn.random_resized_crop(images, size=(224, 224))
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                                              mirror=fn.random.coin_flip())
            return images, labels.gpu() if gpu else labels

        self.iterator = DALIGenericIterator(pipeline(), ["images", "labels"], reader_name="Reader",
                                            last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
        self.batches = len(source) // batch

    def __len__(self):
        return self.batches

    def __iter__(self):
        for (out,) in self.iterator:
            yield out["images"], out["labels"].view(-1).long()

    def close(self):
        self.iterator = None   # the pipeline goes with its iterator: its threads and device buffers


# ------------------------------------------------------------------------------------ the rows
@dataclass
class Setting:
    """One row to measure: which contender, the factor it varies (with its value), and its options."""

    name: str
    role: str                    # "ceiling", "fastdata" or "limit"
    factor: str = ""             # the setting this row varies; "" for a reference row
    value: object = None
    options: dict = field(default_factory=dict)   # extra make_loader options (dali/torch rows)
    batch: int | None = None     # None: the experiment's first batch size
    workers: int | None = None   # None: --workers


def settings(args) -> list[Setting]:
    """Every row, the references first (so a run cut short by its budget still has them)."""
    rows = [Setting("ceiling", "ceiling"), Setting("dali", "fastdata"), Setting("torch", "fastdata"),
            Setting("limit", "limit")]
    # First of the settings: the one change since the last GPU run, measured even where --budget cuts.
    rows += [Setting(f"dali handover={v}", "fastdata", "handover", v, {"handover": v}) for v in ("stream", "host")]
    # DALI's iteration in the training thread or in a thread of its own (the first command's data wait).
    rows += [Setting(f"dali driver={v}", "fastdata", "driver", v, {"driver": v}) for v in ("caller", "thread")]
    rows += [Setting(f"dali hw_decoder_load={v:g}", "fastdata", "hw_decoder_load", v, {"hw_decoder_load": v})
             for v in args.hw_loads]
    rows += [Setting(f"ceiling hw_decoder_load={v:g}", "ceiling", "ceiling hw_decoder_load", v) for v in args.hw_loads]
    rows += [Setting(f"dali {k}={v}", "fastdata", k, v, {k: v}) for k in ("fancy_upsampling", "preallocate")
             for v in (True, False)]
    rows += [Setting(f"dali prefetch_queue_depth={v}", "fastdata", "prefetch_queue_depth", v,
                     {"prefetch_queue_depth": v}) for v in args.depths]
    rows += [Setting(f"dali batch {v}", "fastdata", "batch", v, batch=v) for v in args.batches]
    rows += [Setting(f"dali num_workers={v}", "fastdata", "num_workers", v, workers=v) for v in args.thread_counts]
    rows += [Setting(f"dali affine={v}", "fastdata", "affine", v, {"affine": v}) for v in (True, False)]
    return rows


def same_as(setting: Setting, args, defaults: dict) -> str | None:
    """The reference row that already ran this setting, or None: a dali row that sets only what the ``dali``
    row ran with (the installed defaults, the first batch size, ``--workers``), or a ceiling row at DALI's
    own default hardware-decoder share. Measuring it again would only spend the call's time."""
    if setting.factor == "ceiling hw_decoder_load":
        return "ceiling" if setting.value == DALI_HW_DEFAULT else None
    if setting.role != "fastdata" or not setting.factor or not setting.name.startswith("dali "):
        return None
    if setting.batch not in (None, args.batches[0]) or setting.workers not in (None, args.workers):
        return None
    return "dali" if all(k in defaults and defaults[k] == v for k, v in setting.options.items()) else None


def gpu_only(setting: Setting) -> bool:
    return setting.factor == "ceiling hw_decoder_load" or any(k in setting.options for k in GPU_ONLY)


def maker(setting: Setting, source, batch: int, workers: int, device):
    """``make()`` for bench_loaders.build: the row's loader and its note."""
    def make():
        if setting.role == "ceiling":
            hw = setting.value if setting.factor else None
            return (DaliCeiling(source, batch, workers, device, hw),
                    "DALI alone: readers.file, decoders.image " + ("cpu" if device.type == "cpu" else "mixed, "
                    + (f"hw_decoder_load={hw:g}" if hw is not None else "its default hw_decoder_load"))
                    + ", random_resized_crop, crop_mirror_normalize")
        backend = setting.name.split()[0]
        options = dict(setting.options)
        if backend == "dali" and device.type == "cpu":
            options.setdefault("decode", "dali")   # in the pipeline, as on a GPU (its CPU default decodes on the host)
        loader = fastdata.make_loader(source, backend, batch_size=batch, device=device, num_workers=workers,
                                      train=True, **options)
        return loader, f"make_loader({backend!r}, batch_size={batch}, num_workers={workers}" + "".join(
            f", {k}={v!r}" for k, v in options.items()) + ")"
    return make


def mark_unsupported(row: common.Row) -> None:
    """A row whose build was refused for an unknown option: the installed fastdata lacks that setting."""
    if row.status != "ok" and "unknown option" in row.note:
        row.status, row.note = UNSUPPORTED, f"not supported by this fastdata ({row.note})"


def measure(setting: Setting, rows: list, source, args, device) -> None:
    """Build, warm up, time and close one row; its Row (with CPU cores used) is appended to ``rows``."""
    batch = setting.batch or args.batches[0]
    workers = setting.workers or args.workers
    make, run = maker(setting, source, batch, workers, device), None
    if setting.role == "limit":   # timed by its count of decoded files, not through the loader contract
        limit = loaders.DecodeLimit(source, batch, workers)
        make, run = (lambda: (limit, f"PIL full decode + RGB only, {workers} processes")), limit.count
    c = loaders.build(rows, WORKLOAD, setting.name, setting.role, make, device, run=run, min_pass=args.min_pass)
    if c is None:
        mark_unsupported(rows[-1])
        return
    cores, inner = [], c.run

    def counted():
        t0, c0 = time.perf_counter(), cpu_seconds()
        n = inner()
        common.sync(device)
        cores.append((cpu_seconds() - c0) / (time.perf_counter() - t0))
        return n

    c.run = counted
    try:
        loaders.time_rounds([c], args.passes, device, args.row_budget)
    finally:
        c.close()
    loaders.add_rows(rows, [c])
    row = rows[-1]
    row.paired = False   # timed alone: its passes are not side by side with another row's
    timed = cores[len(cores) - len(c.seconds):] if c.seconds else []
    row.extra.update(batch_size=batch, num_workers=workers, cores_passes=timed,
                     cores=statistics.median(timed) if timed else None)


def run_all(args, source, device, rows: list) -> None:
    """Every setting in order, until the experiment's budget is spent; the rest listed as not run."""
    t0 = time.perf_counter()
    defaults = dict(fastdata.registry.backend_class("dali").options)   # what the `dali` row runs with
    for setting in settings(args):
        twin = same_as(setting, args, defaults)
        base = find(rows, twin) if twin else None
        if device.type != "cuda" and gpu_only(setting):
            rows.append(common.Row(WORKLOAD, setting.name, setting.role, status="skipped",
                                   note=f"a GPU-only setting (nvJPEG's): not measured on {device}"))
        elif base is not None:
            rows.append(dataclasses.replace(base, name=setting.name, role=setting.role, extra=dict(base.extra),
                                            note=f"the defaults: the `{twin}` row's figures ({base.note})"))
        elif time.perf_counter() - t0 > args.budget:
            rows.append(common.Row(WORKLOAD, setting.name, setting.role, status="not run",
                                   note=f"the experiment's --budget of {args.budget:g} s was spent"))
        else:
            print(f"\n[{setting.name}]", flush=True)
            measure(setting, rows, source, args, device)
        rows[-1].extra.update(factor=setting.factor, value=setting.value)   # skipped rows too: the choices list them


# ------------------------------------------------------------------------------------ report
def find(rows, name):
    return next((r for r in rows if r.name == name and r.status == "ok" and r.rate), None)


def vs(row, ref) -> str:
    if ref is None or row.status != "ok" or row is ref:
        return "-"
    return common.fmt_vs(*common.row_ratio(row, ref))


def fmt_cores(row) -> str:
    cores = row.extra.get("cores")
    if cores is None:
        return "-"
    rng = common.spread(row.extra.get("cores_passes"))
    return f"{cores:.1f}" + (f" ({rng[0]:.1f}–{rng[1]:.1f})" if rng and f"{rng[0]:.1f}" != f"{rng[1]:.1f}" else "")


def rows_table(rows) -> str:
    ceiling, torch_row = find(rows, "ceiling"), find(rows, "torch")
    lines = []
    for r in rows:
        cores = r.extra.get("cores")
        per_core = common.fmt_num(r.rate / cores) if r.status == "ok" and cores else "-"
        lines.append([r.name, r.role, common.fmt_rate(r), vs(r, ceiling), vs(r, torch_row), fmt_cores(r), per_core,
                      f"{r.extra['setup_s']:.2f}" if "setup_s" in r.extra else "-",
                      f"{r.extra['warmup_s']:.2f}" if "warmup_s" in r.extra else "-",
                      r.note.replace("|", "/")[:160]])
    return common.markdown_table(["row", "role", "images/s", "× ceiling", "× torch", "CPU cores used",
                                  "images/s per core", "setup s", "warm-up pass s", "note"], lines)


def factor_choices(rows) -> list[dict]:
    """Per setting varied: its measured values, the fastest, and the fastest over each other value."""
    out = []
    for factor in dict.fromkeys(r.extra.get("factor") for r in rows if r.extra.get("factor")):
        group = [r for r in rows if r.extra.get("factor") == factor]
        ok = [r for r in group if r.status == "ok" and r.rate]
        best = max(ok, key=lambda r: r.rate) if ok else None
        out.append({"factor": factor, "best": None if best is None else best.extra["value"],
                    "values": [{"value": r.extra.get("value"), "status": r.status, "rate": r.rate,
                                "cores": r.extra.get("cores"),
                                "best_over_this": None if best is None or r.status != "ok" or r is best
                                else common.row_ratio(best, r)} for r in group]})
    return out


def choices_markdown(choices) -> str:
    lines = []
    for c in choices:
        parts = []
        for v in c["values"]:
            ratio = v["best_over_this"]
            text = (f"{common.fmt_num(v['rate'])} img/s" if v["status"] == "ok" else v["status"])
            if ratio is not None:
                text += f", best is {common.fmt_vs(*ratio)} this"
            parts.append(f"{v['value']}: {text}")
        lines.append([c["factor"], "-" if c["best"] is None else str(c["best"]), "; ".join(parts)])
    return common.markdown_table(["setting", "fastest value", "each value (the fastest over it; a range "
                                  f"covering 1 is {common.NOISE})"], lines)


def main(args) -> dict:
    """Run the experiment; returns the JSON payload (also written under ``args.out``)."""
    device = fastdata.config.resolve_device(args.device)
    torch.manual_seed(0)
    machine = common.machine_info()
    source, desc = loaders.jpeg_source(args.jpeg_images, args.cache)
    print(f"{desc}; device {device}, {args.workers} workers", flush=True)
    rows: list[common.Row] = []
    run_all(args, source, device, rows)
    choices = factor_choices(rows)
    body = (f"{desc}. Batch {args.batches[0]} and {args.workers} workers unless the row varies them; device "
            f"`{device}`. Each row is built, warmed up by one pass, timed over {args.passes} pass(es) of at least "
            f"{args.min_pass:g} s, and closed before the next. Rates: the median pass (slowest–fastest); CPU cores "
            f"used: CPU seconds of the process and its workers over wall seconds, per pass; ratios: the range "
            f"the two spreads allow (not paired).\n\n" + rows_table(rows)
            + "\n\n## Choosing the defaults\n\n" + choices_markdown(choices))
    print("\n" + body, flush=True)
    tag = args.tag or common.machine_tag(machine)
    payload = {"benchmark": "dali-gpu", "device": str(device), "workers": args.workers, "passes": args.passes,
               "quick": args.quick, "sources": {WORKLOAD: desc}, "unit": "images/s",
               "rows": [vars(r) for r in rows], "choices": choices}
    chart = {f"{WORKLOAD}, batch {args.batches[0]} unless named": [
        (r.name, r.rate, r.role, common.spread(r.passes)) for r in rows if r.status == "ok"]}
    payload["paths"] = common.write_reports(
        args.out, f"dali-gpu-{tag}", title="The dali backend's settings on a GPU", machine=machine,
        command=common.command_line("bench_dali_gpu.py", args.argv), body_md=body, payload=payload,
        chart_groups=chart, chart_xlabel="images/s (log scale)")
    return payload


if __name__ == "__main__":
    main(get_args_parser().parse_args())
