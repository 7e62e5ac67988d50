"""Pillow vs Pillow-SIMD: the per-sample CPU cost of the photo path, with the installed PIL.

Operations, each on one core in this process (per-sample costs; a loader multiplies by its workers):

- ``decode``: open + full decode + RGB of an ImageNet-sized JPEG (~450x350, ~90 KB);
- ``decode+rrc``: the tutorial's RandomResizedCrop: full decode, then crop and bilinear-resize to 224²;
- ``decode+rrc (draft)``: the same crop as fastdata's torch backend does it: ``Image.draft`` decodes
  at 1/2, 1/4 or 1/8 scale when the crop is shrunk anyway, then the resize;
- ``resize 1024²→224²``: bilinear resize of a decoded RGB image (what Pillow-SIMD accelerates most).

Pillow-SIMD replaces the resize and colour-conversion kernels with SSE4/AVX2 code; it does not change
the JPEG decoder (libjpeg-turbo in both), so expect the resize rows to move and the decode rows not to.
To compare both in one table, point ``--compare`` at interpreters that have the other PIL installed
(only Pillow is needed there; the measuring code imports nothing else):

    python -m venv /tmp/vanilla && /tmp/vanilla/bin/pip install pillow
    python benchmarks/bench_pillow.py --compare /tmp/vanilla/bin/python
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from . import common
except ImportError:  # run as a script (also how --compare runs it under another interpreter)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

from fastdata import cli

OPS = ("decode", "decode+rrc", "decode+rrc (draft)", "resize 1024²→224²")
SIZE = 224


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = common.PresetParser(description="Per-sample cost of JPEG decode + RandomResizedCrop and of a "
                            "1024²→224² resize with the installed PIL (Pillow or Pillow-SIMD).", add_help=add_help,
                            quick_help="short rounds: checks that it runs, not how fast")
    p.add_argument("--images", type=cli.positive_int, default=16, help="distinct JPEGs cycled through (default 16)")
    p.add_preset("--rounds", type=cli.positive_int, full=7, quick=3, help="timed rounds per operation, median reported")
    p.add_preset("--round-s", type=cli.positive_float, full=0.5, quick=0.1, help="seconds per round")
    p.add_argument("--compare", nargs="*", default=[], metavar="PYTHON", type=_interpreter,
                   help="other interpreters (with another PIL) to run the same measurement under")
    p.add_argument("--cache", default=str(common.CACHE_DIR), help="where the generated JPEGs are kept")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON job: measure and print JSON
    return p


# ----------------------------------------------------------------- measuring (PIL and stdlib only)
def _rrc_box(rng, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop box (top, left, h, w); stdlib only, so any interpreter runs it."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side, side


def measure(job: dict) -> dict:
    """Time each operation on ``job['paths']``; returns {op: µs per sample (median of rounds)} + PIL info."""
    import random

    from PIL import Image

    paths, rounds, round_s = job["paths"], job["rounds"], job["round_s"]
    rng = random.Random(0)
    sizes = []
    for p in paths:
        with Image.open(p) as im:
            sizes.append(im.size)
    boxes = [_rrc_box(rng, h, w) for (w, h) in sizes for _ in range(8)]  # 8 crops per image, fixed
    with Image.open(paths[0]) as im:
        big = im.convert("RGB").resize((1024, 1024), Image.BILINEAR)

    def decode(k):
        with Image.open(paths[k % len(paths)]) as im:
            im.convert("RGB")

    def decode_rrc(k):
        i = k % len(paths)
        top, left, h, w = boxes[i * 8 + (k // len(paths)) % 8]  # the k-th visit of image i: its next crop
        with Image.open(paths[i]) as im:
            im.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))

    def decode_rrc_draft(k):
        # fastdata.images.photo.load_photo's draft step: the smallest DCT scale that keeps the crop at
        # least SIZE pixels on each side.
        i = k % len(paths)
        top, left, h, w = boxes[i * 8 + (k // len(paths)) % 8]
        with Image.open(paths[i]) as im:
            width, height = im.size
            want = (max(1, math.ceil(width * SIZE / w)), max(1, math.ceil(height * SIZE / h)))
            if want[0] < width and want[1] < height:
                im.draft("RGB", want)
            img = im.convert("RGB")
            fx, fy = img.width / width, img.height / height
            img.resize((SIZE, SIZE), Image.BILINEAR, box=(left * fx, top * fy, (left + w) * fx, (top + h) * fy))

    def resize(k):
        big.resize((SIZE, SIZE), Image.BILINEAR)

    # draft only helps when the crop is at least 2x the output on each side (libjpeg scales by 1/2,
    # 1/4, 1/8): count how often that happens with these photos and RandomResizedCrop's boxes.
    fires = sum(1 for i, (w, h) in enumerate(sizes) for (_, _, bh, bw) in boxes[i * 8:(i + 1) * 8]
                if bw >= 2 * SIZE and bh >= 2 * SIZE)
    fns = dict(zip(OPS, (decode, decode_rrc, decode_rrc_draft, resize)))
    result = {}
    for op, fn in fns.items():
        for k in range(len(paths)):  # warm-up: file cache, allocator, lazy plugin imports
            fn(k)
        per_round = []
        for _ in range(rounds):
            n, t0 = 0, time.perf_counter()
            while True:
                fn(n)
                n += 1
                elapsed = time.perf_counter() - t0
                if elapsed >= round_s and n >= len(paths):
                    break
            per_round.append(elapsed / n * 1e6)
        result[op] = {"us": statistics.median(per_round), "rounds_us": per_round}
    return {"pil": common.pil_info(), "python": sys.executable, "ops": result,
            "draft_fraction": fires / len(boxes)}


# ----------------------------------------------------------------- driving
def photos(args) -> list[str]:
    from fastdata.datasets import make_image_folder

    root = Path(args.cache) / f"pillow-{args.images}"
    done = root / ".complete"
    if not done.exists():
        make_image_folder(root, classes=1, per_class=args.images, seed=1)
        done.write_text("ok\n")
    return sorted(str(p) for p in root.rglob("*.jpg"))[: args.images]


def run_elsewhere(python: str, job: dict) -> dict:
    # --out: a worker writes no report, but its parser checks the folder (the default may not be writable).
    cmd = [python, str(Path(__file__).resolve()), "--worker", json.dumps(job), "--out", tempfile.gettempdir()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{python} failed (exit {out.returncode}): {out.stderr.strip()[-600:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _interpreter(text: str) -> str:
    """``--compare``'s PYTHON: an executable found as given or on PATH. Checked before the measuring,
    where a missing one used to cost the whole run and leave only a line on screen (the report has no
    column for it)."""
    import shutil

    if shutil.which(text) is None:
        raise argparse.ArgumentTypeError(f"no interpreter {text!r}: not an executable file, nor a command on PATH")
    return text


def measure_elsewhere(python: str, job: dict) -> dict:
    """``run_elsewhere``'s result, or one without ops that says why it failed (the report names it)."""
    try:
        res = run_elsewhere(python, job)
    except Exception as e:
        print(f"  {python}: {e}", flush=True)
        return {"pil": {"flavour": f"{python} (failed)"}, "python": python, "ops": {}, "error": str(e)}
    print(f"  {python}: {label(res)}", flush=True)
    return res


def label(res: dict) -> str:
    pil = res["pil"]
    avx2 = {True: ", AVX2", False: ", no AVX2", None: ""}[pil.get("avx2")] if pil.get("simd") else ""
    return f"{pil['flavour']}{avx2}"


def main(args) -> dict:
    if args.worker is not None:
        print(json.dumps(measure(json.loads(args.worker))))
        return {}
    job = {"paths": photos(args), "rounds": args.rounds, "round_s": args.round_s}
    machine = common.machine_info()
    print(f"[pillow] {len(job['paths'])} JPEGs, {args.rounds} rounds of {args.round_s}s per operation, one core",
          flush=True)
    results = [measure(job)]
    print(f"  this interpreter: {label(results[0])}", flush=True)
    results += [measure_elsewhere(python, job) for python in args.compare]

    ok = [r for r in results if r["ops"]]
    header = ["operation"] + [f"{label(r)}: µs/sample" for r in ok] + [f"{label(r)}: samples/s/core" for r in ok]
    if len(ok) > 1:
        header += [f"speed-up of {label(ok[0])} over {label(r)}" for r in ok[1:]]
    lines = []
    for op in OPS:
        us = [r["ops"][op]["us"] for r in ok]
        rounds = [common.spread(r["ops"][op]["rounds_us"]) for r in ok]   # (fastest, slowest) round
        line = [op] + [f"{u:,.0f}" + (f" ({common.fmt_spread(rng, lambda x: f'{x:,.0f}')})" if rng else "")
                       for u, rng in zip(us, rounds, strict=True)]
        line += [common.fmt_num(1e6 / u) for u in us]
        # Speed-up of the first PIL over another: their µs ratio, with the range the rounds allow.
        line += [common.fmt_vs(u / us[0], common.ratio_range(rng, rounds[0])) for u, rng in zip(us[1:], rounds[1:],
                                                                                                  strict=True)]
        lines.append(line)
    draft = ok[0]["ops"]["decode+rrc"]["us"] / ok[0]["ops"]["decode+rrc (draft)"]["us"]
    body = (f"Per-sample cost on one core, median of {args.rounds} rounds of {args.round_s}s (fastest–slowest "
            f"round in brackets; a speed-up whose range covers 1 is {common.NOISE}); "
            f"{len(job['paths'])} ImageNet-sized JPEGs (~450x350, RandomResizedCrop boxes fixed by seed).\n\n"
            + common.markdown_table(header, lines)
            + f"\n\nReduced-scale decoding (`Image.draft`, used by the torch backend): decode+RRC "
              f"{ok[0]['ops']['decode+rrc']['us']:,.0f} µs without, "
              f"{ok[0]['ops']['decode+rrc (draft)']['us']:,.0f} µs with ({draft:.2f}x) with {label(ok[0])}; "
              f"libjpeg can only shrink by 1/2, 1/4 or 1/8, so it applies to the "
              f"{100 * ok[0]['draft_fraction']:.0f}% of these crops that are at least {2 * SIZE} px on "
              f"each side.")
    for r in results:
        if not r["ops"]:   # a --compare interpreter that failed: said in the report, not only on screen
            body += f"\n\nNot measured: {r['error'].splitlines()[0]}"
    if not ok[0]["pil"].get("simd"):
        body += ("\n\nThis PIL is not Pillow-SIMD: `pip uninstall -y pillow && CC='cc -mavx2' pip install "
                 "--no-binary :all: pillow-simd` (or the project's install.sh) swaps it in.")
    print("\n" + body, flush=True)
    payload = {"benchmark": "pillow", "unit": "µs per sample", "images": job["paths"], "rounds": args.rounds,
               "round_s": args.round_s, "results": results, "draft_speedup": draft}
    chart = {f"samples/s on one core — {label(r)}": [(op, 1e6 / r["ops"][op]["us"], "fastdata") for op in OPS]
             for r in ok}
    tag = args.tag or common.machine_tag(machine)
    payload["paths"] = common.write_reports(
        args.out, f"pillow-{tag}", title="Pillow per-sample cost", machine=machine,
        command=common.command_line("bench_pillow.py", args.argv),
        body_md=body, payload=payload, chart_groups=chart,
        chart_xlabel="samples/s on one core (log scale)")
    return payload


if __name__ == "__main__":
    main(get_args_parser().parse_args())
