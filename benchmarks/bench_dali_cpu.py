"""Issue 30 on the CPU: the dali backend decoding in DALI (``decode="dali"``) against DALI's own file
reader running the same work, on small JPEGs.

Contenders, one epoch each per round, interleaved round by round (so a slow moment of the shared machine
slows both) after one warm-up epoch each:

- ``DALI readers.file``: DALI alone, nothing of fastdata: ``fn.readers.file`` (shuffled) →
  ``fn.decoders.image_random_crop`` (a RandomResizedCrop box, region-decoded by libjpeg-turbo) →
  ``fn.resize`` (antialiased linear, to ``--size``) → ``fn.crop_mirror_normalize`` (random flip,
  float CHW), through ``DALIGenericIterator``: the ceiling;
- ``fastdata dali``: ``make_loader(ImageFolder, "dali", decode="dali")``: file names →
  ``fn.io.file.read`` → ``fn.decoders.image_slice`` (a window around the box fastdata drew) →
  ``fn.resize`` (the box as ROI) → ``fn.crop_mirror_normalize``; fastdata decides the order, the boxes,
  the flips and the skips in Python, DALI reads and decodes in C++.

Same batch size, DALI threads, prefetch depth and output (float32 NCHW on the CPU). The figure is
images/s per epoch; each round's ratio pairs the two epochs of that round, reported as the median with
the lowest and highest round. The target (issue 30's "Done when") is a ratio of at least 0.95.

``measure_pair(root, ...)`` runs the comparison for any folder and device, for another script to import.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import common
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

TARGET = 0.95
READER, FASTDATA = "DALI readers.file", "fastdata dali"


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = common.PresetParser(description="dali backend (decode='dali') vs DALI's own readers.file pipeline "
                            "with the same graph, on small JPEGs, on the CPU.", add_help=add_help,
                            quick_help="few images and rounds: checks that it runs, not how fast")
    p.add_preset("--images", type=int, full=512, quick=64, help="JPEGs generated (64-128 px a side)")
    p.add_preset("--rounds", type=int, full=9, quick=2, help="timed epochs per contender, interleaved")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--size", type=int, default=64, help="output side (default 64)")
    p.add_argument("--threads", type=int, default=None, help="DALI threads (default: the usable cores)")
    p.add_argument("--depth", type=int, default=2, help="prefetch_queue_depth of both (default 2)")
    p.add_argument("--folder", default=None, help="an existing JPEG folder instead of generated ones")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    return p


def small_jpegs(root: Path, count: int, seed: int = 0) -> Path:
    """``count`` JPEGs of 64-128 px a side in 4 class folders: smooth colour fields with noise (so they
    compress like photos, not like flat colour), quality 90, 4:2:0."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k in range(count):
        h, w = (int(v) for v in rng.integers(64, 129, 2))
        yy, xx = np.mgrid[0:h, 0:w]
        base = rng.integers(0, 256, 3)
        img = (base + 60 * np.sin(xx[..., None] / rng.uniform(4, 20) + rng.uniform(0, 6, 3))
               + 40 * np.cos(yy[..., None] / rng.uniform(4, 20)) + rng.normal(0, 12, (h, w, 3)))
        folder = root / f"class_{k % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(folder / f"img_{k:05d}.jpg", quality=90)
    return root


class ReaderPipeline:
    """DALI's own file reader with the graph the dali backend runs (see the module docstring)."""

    def __init__(self, root, batch: int, size: int, threads: int, depth: int, device, mean, std):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        gpu = device.type == "cuda"

        @pipeline_def(batch_size=batch, num_threads=threads, device_id=device.index if gpu else None,
                      prefetch_queue_depth=depth, seed=1)
        def pipeline():
            jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="Reader")
            images = fn.decoders.image_random_crop(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
            images = fn.resize(images, size=[size, size], interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.crop_mirror_normalize(images, mirror=fn.random.coin_flip(), dtype=types.FLOAT,
                                              mean=[255 * m for m in mean], std=[255 * s for s in std],
                                              output_layout="CHW")
            return images, (labels.gpu() if gpu else labels)

        self.pipe = pipeline()
        self.pipe.build()
        self.iter = DALIGenericIterator(self.pipe, ["images", "labels"], reader_name="Reader",
                                        last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def __iter__(self):
        for out in self.iter:
            yield out[0]["images"], out[0]["labels"]

    def close(self):
        self.iter = self.pipe = None


def _epoch(loader, device) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process: every thread, DALI's included, images) of one epoch."""
    import torch

    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for images, _ in loader:
        n += len(images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0, n


def measure_pair(root, *, batch: int = 64, size: int = 64, threads: int = 2, depth: int = 2, rounds: int = 9,
                 device: str = "cpu", **dali_options) -> dict:
    """Epochs of both contenders on ``root`` (an image folder), interleaved: per contender the images/s
    of each round, and the paired ratio fastdata / reader per round. ``dali_options`` go to make_loader."""
    import torch

    from fastdata import make_loader
    from fastdata.config import Augmentation
    from fastdata.datasets import ImageFolder

    dev = torch.device(device)
    src = ImageFolder(root)
    ours = make_loader(src, "dali", batch_size=batch, device=device, num_workers=threads, train=True,
                       drop_last=False, augment=Augmentation.imagenet_train(size=size),
                       **{"decode": "dali", "prefetch_queue_depth": depth, **dali_options})
    reader = ReaderPipeline(root, batch, size, threads, depth, dev, ours.mean, ours.std)
    contenders = {READER: reader, FASTDATA: ours}
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    cpu_ms: dict[str, list[float]] = {name: [] for name in contenders}   # CPU ms per image
    try:
        for loader in contenders.values():   # warm-up: pipelines, first reads, fastdata's headers
            _epoch(loader, dev)
        for r in range(rounds):
            order = list(contenders.items())
            for name, loader in order if r % 2 == 0 else order[::-1]:   # who goes first alternates
                seconds, cpu, n = _epoch(loader, dev)
                rates[name].append(n / seconds)
                cpu_ms[name].append(1000 * cpu / n)
    finally:
        ours.close()
        reader.close()
    ratios = [a / b for a, b in zip(rates[FASTDATA], rates[READER], strict=True)]
    # The same comparison in CPU time (reader's CPU per image / ours): what the images/s ratio is on a
    # machine whose cores these pipelines have to themselves, where both are CPU-bound.
    cpu_ratios = [b / a for a, b in zip(cpu_ms[FASTDATA], cpu_ms[READER], strict=True)]
    return {"images": len(src), "rates": rates, "ratios": ratios, "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)], "cpu_ms_per_image": cpu_ms, "cpu_ratios": cpu_ratios,
            "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratio_range": [min(cpu_ratios), max(cpu_ratios)]}


def main(args) -> dict:
    from fastdata.config import usable_cores

    threads = args.threads or usable_cores()
    machine = common.machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.folder) if args.folder else small_jpegs(Path(tmp) / "jpegs", args.images)
        print(f"[dali-cpu] {args.images} JPEGs, batch {args.batch}, {threads} threads, depth {args.depth}, "
              f"{args.rounds} rounds", flush=True)
        res = measure_pair(root, batch=args.batch, size=args.size, threads=threads, depth=args.depth,
                           rounds=args.rounds)
    rows = []
    for name in (READER, FASTDATA):
        passes, cpu = res["rates"][name], res["cpu_ms_per_image"][name]
        rows.append([name, common.fmt_num(statistics.median(passes)), common.fmt_spread(common.spread(passes)),
                     f"{1000 * statistics.median(cpu):.0f}", common.fmt_spread(common.spread(cpu),
                                                                        lambda x: f"{1000 * x:.0f}")])
    lo, hi = res["ratio_range"]
    status = common.compare(lo, hi, TARGET)
    clo, chi = res["cpu_ratio_range"]
    cpu_status = common.compare(clo, chi, TARGET)
    body = (f"{res['images']} JPEGs of 64-128 px, RandomResizedCrop to {args.size} px + flip, batch {args.batch}, "
            f"{threads} DALI threads, prefetch depth {args.depth}, float32 NCHW on the CPU. {args.rounds} epochs "
            f"per contender after a warm-up epoch, interleaved (who goes first alternates).\n\n"
            + common.markdown_table(["contender", "images/s (median)", "slowest–fastest epoch",
                                     "CPU µs per image (median)", "lowest–highest epoch"], rows)
            + f"\n\nfastdata / readers.file in images/s, paired round by round: **{res['ratio']:.3f}** "
              f"(lowest {lo:.3f}, highest {hi:.3f}); target ≥ {TARGET}: **{status}**.\n\n"
              f"The same in CPU time (readers.file's CPU per image / fastdata's, every thread of the process, "
              f"DALI's included; what the images/s ratio becomes where both are CPU-bound on cores of their "
              f"own, and steadier than images/s on a shared machine): **{res['cpu_ratio']:.3f}** "
              f"(lowest {clo:.3f}, highest {chi:.3f}); target ≥ {TARGET}: **{cpu_status}**.")
    print("\n" + body, flush=True)
    payload = {"benchmark": "dali-cpu", "unit": "images/s", "batch": args.batch, "size": args.size,
               "threads": threads, "depth": args.depth, "rounds": args.rounds, "target": TARGET,
               "status": status, "cpu_status": cpu_status, **res}
    chart = {"images/s": [(name, statistics.median(res["rates"][name]), "fastdata" if name == FASTDATA else "dali",
                           common.spread(res["rates"][name])) for name in (READER, FASTDATA)]}
    tag = args.tag or common.machine_tag(machine)
    payload["paths"] = common.write_reports(
        args.out, f"dali-{tag}", title="dali backend vs DALI's readers.file", machine=machine,
        command=common.command_line("bench_dali_cpu.py", args.argv), body_md=body, payload=payload,
        chart_groups=chart, chart_xlabel="images/s", chart_log=False)
    return payload


if __name__ == "__main__":
    main(get_args_parser().parse_args())
