"""How long the ``memory`` backend takes to build its photo cache (issue 13, item 3).

Each contender builds the training cache (every photo whole, longer side <= ``--side``) of the same
JPEG folder (``make_image_folder``: ImageNet-sized, 400-500 x 300-400 px, quality 90) in a fresh Python
process, so every build starts as a user's does (no decoder, worker or allocator left warm by another
contender) and none keeps the others' memory. Contenders:

- ``today``: the commit before ``cache_build`` existed (``--base``, checked out once into a ``git
  worktree`` under the cache folder and put first on PYTHONPATH): DataLoader worker processes, chunks
  sent through shared memory;
- ``processes``: that same process build in the current code (``cache_build="processes"``);
- ``threads``: threads decoding with PIL straight into the cache's rows (``cache_build="threads"``);
- ``nvimgcodec``: nvImageCodec in batches, its CPU backend here (its GPU decoder on a CUDA ``--device``),
  where it is installed (``cache_build="nvimgcodec"``).

Timing: the first round is a warm-up (the files enter the page cache) and is not counted; then each
round runs every contender once, in an order that rotates from round to round, so a burst of load from
another process falls on all of them. Ratios are paired round by round (one round's builds ran side by
side in time): the median of the per-round ratios, with the lowest and highest. A target is met when
every round's ratio meets it; a range that covers it is "within noise". CPU seconds (the process and its
children, user + system) are reported beside the wall clock: on a shared machine they move less. Imports
are done before the clock starts (they are the interpreter's, not the build's).
Pixels: each contender's first 64 cached photos against the baseline's, max and mean absolute difference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

try:
    from . import common
except ImportError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

from fastdata import cli

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("today", "processes", "threads", "nvimgcodec")
#: The last commit before ``cache_build``: the build issue 13 asks to make 2x faster.
BASE = "ecdc3f3"
COMPARE_ROWS = 64
TARGET = 2.0

# Run in a fresh interpreter per build: argv = [folder, side, workers, build, device, out.npz].
CHILD = r"""
import json, resource, sys, time
import numpy as np
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder

folder, side, workers, build, device, out = sys.argv[1:7]
src = ImageFolder(folder)
opts = {} if build == "today" else {"cache_build": build}
if workers != "default":
    opts["cache_workers"] = int(workers)

def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

# Imports are not the build: what make_loader would import lazily is imported before the clock starts.
import torch, PIL.Image, PIL.ImageOps, PIL.JpegImagePlugin, PIL.PngImagePlugin, fastdata.backends.memory
try:
    from nvidia import nvimgcodec
except Exception:
    pass
c0, t0 = cpu(), time.perf_counter()
loader = make_loader(src, "memory", batch_size=8, drop_last=False, device=device, cache_size=int(side),
                     augment=Augmentation.imagenet_train(size=min(224, int(side))), **opts)
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds, cpu_s = time.perf_counter() - t0, cpu() - c0
if out != "-":
    np.savez(out, rows=loader.cache[:%d].cpu().numpy(), sizes=loader.photo_sizes[1][:%d])
print("RESULT " + json.dumps({"seconds": seconds, "cpu": cpu_s, "photos": int(loader.cache.shape[0])}))
""" % (COMPARE_ROWS, COMPARE_ROWS)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = common.PresetParser(description="Build time of the memory backend's photo cache: today's worker "
                            "processes against threads and nvImageCodec.", add_help=add_help,
                            quick_help="few photos and rounds: checks that it runs, not how fast")
    p.add_preset("--photos", type=cli.positive_int, full=1500, quick=40,
                 help="photos in the folder (rounded up to 10 classes)")
    p.add_preset("--passes", type=cli.positive_int, full=3, quick=1,
                 help="timed rounds (after one warm-up), median reported")
    p.add_argument("--side", type=cli.positive_int, default=256,
                   help="cache_size: the cached photos' longest side (default 256)")
    p.add_argument("--workers", default="default",
                   help="cache_workers for every contender (default: each build's own default)")
    p.add_argument("--device", default="cpu", type=cli.device, help="where the cache lives (default cpu)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS,
                   help="cache builds to time (default: all)")
    p.add_argument("--base", default=BASE, help=f"the commit 'today' runs (default {BASE})")
    p.add_argument("--cache", default=str(common.CACHE_DIR), help="where the generated JPEGs are kept")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    return p


# ------------------------------------------------------------------------------------ set-up
def photo_folder(cache, count: int) -> Path:
    """The bench_loaders folder of ``count`` photos (``common.photo_folder``), written once and kept."""
    return common.photo_folder(cache, count)


def base_tree(cache, base: str) -> tuple[Path | None, str]:
    """(a checkout of ``base``, "") made once with ``git worktree add --detach``; (None, why) where
    that fails (no git, not a clone, unknown commit)."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{base}^{{commit}}"],
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"no checkout of {base}: {getattr(e, 'stderr', '') or e}".strip()
    tree = Path(cache) / f"base-{sha[:12]}"
    if not (tree / "fastdata" / "__init__.py").exists():   # any checkout: memory.py became a package
        got = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha],
                             capture_output=True, text=True)
        if got.returncode:
            return None, f"git worktree add {sha[:12]} failed: {got.stderr.strip()}"
    return tree, ""


def build_once(name, folder, args, tree, save=None) -> dict:
    """One cache build in a fresh interpreter: {"seconds", "cpu", "photos"}; raises on failure."""
    env = dict(os.environ)
    root = tree if name == "today" else REPO
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [sys.executable, "-c", CHILD, str(folder), str(args.side), str(args.workers), name, args.device,
            str(save) if save else "-"]
    got = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(root))
    line = next((x for x in got.stdout.splitlines() if x.startswith("RESULT ")), None)
    if got.returncode or line is None:
        raise RuntimeError(f"{name} failed (exit {got.returncode}): {got.stderr.strip()[-600:]}")
    return json.loads(line[len("RESULT "):])


def available(name, tree, why_tree, args) -> str:
    """"" where ``name`` can run here, else why not."""
    if name == "today" and tree is None:
        return why_tree
    if name == "nvimgcodec":
        from fastdata.images.whole import nvimgcodec

        if nvimgcodec() is None:
            return "nvImageCodec is not installed"
    return ""


# ------------------------------------------------------------------------------------ measuring
def measure(names, folder, args, tree, tmp) -> dict:
    """{name: {"seconds": [...], "cpu": [...], "photos": n, "pixels": (max, mean) vs the baseline}}."""
    got = {n: {"seconds": [], "cpu": []} for n in names}
    saved = {}
    for n in names:   # warm-up round: the page cache, and the rows each contender cached
        saved[n] = Path(tmp) / f"{n}.npz"
        r = build_once(n, folder, args, tree, save=saved[n])
        got[n]["photos"] = r["photos"]
        print(f"[cache] warm-up {n}: {r['seconds']:.2f}s ({r['cpu']:.2f} CPU s)", flush=True)
    for k in range(args.passes):
        for j in range(len(names)):
            n = names[(j + k) % len(names)]
            r = build_once(n, folder, args, tree)
            got[n]["seconds"].append(r["seconds"])
            got[n]["cpu"].append(r["cpu"])
            print(f"[cache] round {k + 1} {n}: {r['seconds']:.2f}s ({r['cpu']:.2f} CPU s)", flush=True)
    ref = np.load(saved[names[0]])
    for n in names:
        mine = np.load(saved[n])
        if not np.array_equal(mine["sizes"], ref["sizes"]):
            got[n]["pixels"] = None
            continue
        d = np.abs(mine["rows"].astype(np.int16) - ref["rows"].astype(np.int16))
        got[n]["pixels"] = (int(d.max()), float(d.mean()))
    return got


def _compare(names, base, got, rows) -> tuple[list, list]:
    """(table rows, targets) from what ``measure`` got: appends each contender's Row to ``rows`` and
    pairs its rounds with the baseline's; the contenders skipped earlier get a table row too."""
    table, tgts = [], []
    for n in names:
        g = got[n]
        rates = [g["photos"] / s for s in g["seconds"]]
        row = common.Row("cache build", n, "baseline" if n == base else "fastdata", rate=statistics.median(rates),
                         passes=rates, extra={"seconds": statistics.median(g["seconds"]),
                                              "seconds_passes": g["seconds"], "cpu": statistics.median(g["cpu"]),
                                              "cpu_passes": g["cpu"], "pixels": g["pixels"]})
        rows.append(row)
        # b's time over a's, round by round: a's speed-up over b
        wall = common.paired_ratios(got[base]["seconds"], g["seconds"]) if n != base else None
        cpu = common.paired_ratios(got[base]["cpu"], g["cpu"]) if n != base else None
        px = g["pixels"]
        secs = common.fmt_spread(common.spread(g["seconds"]), lambda x: f"{x:.2f}")
        table.append([n, f"{row.extra['seconds']:.2f} ({secs})",
                      common.fmt_rate(row), f"{row.extra['cpu']:.2f}",
                      common.fmt_vs(*wall) if wall else "-", common.fmt_vs(*cpu) if cpu else "-",
                      "-" if n == base else ("sizes differ" if px is None else f"{px[0]} / {px[1]:.3f}")])
        if n != base and n != "processes" and wall:
            t = common.Target("cache build", n, base, TARGET, label=f"{n} build >= {TARGET:g}x faster than {base}")
            t.value, (t.low, t.high) = wall
            t.status = common.compare(t.low, t.high, TARGET)
            tgts.append(t)
    for r in rows:
        if r.status != "ok":
            table.append([r.name, r.status, "-", "-", "-", "-", r.note[:160].replace("|", "/")])
    return table, tgts


def main(args) -> dict:
    machine = common.machine_info()
    folder = photo_folder(args.cache, args.photos)
    tree, why_tree = base_tree(args.cache, args.base) if "today" in args.contenders else (None, "")
    names, rows = [], []
    for n in CONTENDERS:
        if n not in args.contenders:
            continue
        why = available(n, tree, why_tree, args)
        if why:
            rows.append(common.Row("cache build", n, "baseline" if n == "today" else "fastdata", status="skipped",
                                   note=why))
        else:
            names.append(n)
    if not names:
        raise SystemExit("no contender can run here: " + "; ".join(r.note for r in rows))
    base = names[0]   # "today" where it runs, else the in-tree process build
    print(f"[cache] {folder} at side {args.side} on {args.device}: contenders {names}, baseline {base}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        got = measure(names, folder, args, tree, tmp)
    n_photos = got[base]["photos"]
    table, tgts = _compare(names, base, got, rows)
    common.add_ratios(rows)
    what = (f"{n_photos:,} JPEGs of {folder.name} (ImageNet-sized: 400-500 x 300-400 px, quality 90), cached "
            f"whole at a longest side of {args.side} on `{args.device}`; cache_workers {args.workers}")
    body = (f"{what}. Each build in a fresh process; median of {args.passes} timed rounds after a warm-up "
            f"(slowest–fastest in brackets); contenders interleaved round by round, ratios paired per round "
            f"(median, lowest–highest; a range that covers 1 is {common.NOISE}). Baseline `{base}`"
            + (f" = commit {args.base}" if base == "today" else "") + ".\n\n"
            + common.markdown_table(["build", "seconds", "photos/s", "CPU s", "speed-up (wall)", "speed-up (CPU s)",
                                     f"pixels vs {base}, first {COMPARE_ROWS} (max / mean)"], table))
    if tgts:
        body += "\n\n## Targets\n\n" + common.targets_markdown(tgts)
    print("\n" + body, flush=True)
    tag = args.tag or common.machine_tag(machine)
    payload = {"benchmark": "cache", "unit": "photos/s", "passes": args.passes, "quick": args.quick, "base": args.base,
               "source": what, "rows": [vars(r) for r in rows],
               "targets": [vars(t) | {"label": t.describe()} for t in tgts]}
    chart = {"cache build": [(r.name, r.rate, r.role, common.spread(r.passes)) for r in rows if r.status == "ok"]}
    payload["paths"] = common.write_reports(
        args.out, f"cache-{tag}", title="memory backend: photo cache build", machine=machine,
        command=common.command_line("bench_cache.py", args.argv), body_md=body, payload=payload,
        chart_groups=chart, chart_xlabel="photos/s (log scale)")
    return payload


if __name__ == "__main__":
    main(get_args_parser().parse_args())
