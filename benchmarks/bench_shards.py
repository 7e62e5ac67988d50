"""Tar shards against the folder they were packed from (issue 25): locally, over HTTP, and re-encoded.

The JPEG set is ``bench_loaders``'s (ImageNet-sized photos, ~450x350, RandomResizedCrop 224 + flip),
packed twice with ``fastdata.pack``: as is, and with ``--max-side 256``. For each backend asked
(``torch`` and ``dali`` by default) four contenders are built in one process and timed in rounds, as
``bench_loaders`` does (one warm-up pass each, then one timed pass each per round, the order rotating;
ratios are paired round by round):

- ``folder`` (the baseline): ``make_loader(ImageFolder(root), backend)``;
- ``shards``: ``make_loader(Shards(packed folder), backend)``, read in place;
- ``shards http``: ``Shards(url)`` from the tests' HTTP server (``tests/shard_servers.py``), started by
  the benchmark in a child process on 127.0.0.1 with ``--delay`` (20 ms) added to every request. The
  shard cache is emptied before every epoch, so each pass downloads every shard it reads (through the
  loader's read-ahead) and the download is timed; the server's files are in the OS page cache, as the
  folder's are;
- ``shards http small cache``: the same server, ``Shards(url, window=2)`` with the smallest cache it
  accepts (2 windows of the largest shard: 4 of the 9 shards), left to evict on its own: a data set
  larger than its cache, read epoch after epoch, where each pass fetches the window the next one starts
  with while it ends. The server's GETs per epoch are reported;
- ``shards max-side N``: the ``--max-side`` pack, read in place: what smaller photos save the loader.

Why ``--shard-size 16MB`` by default: the set is 130 MB, and the issue's 256 MB would make one shard,
whose download nothing overlaps. 16 MB shards hold ~180 photos, ~0.35 s of decoding on 2 cores: about
the ratio of one request's latency to one shard's work that ImageNet in 256 MB shards (~2,300 photos)
has on a GPU machine decoding ~5,000 images/s.

A ``decode`` workload measures the cost of one photo alone, on one core in this process: decode + crop
of the bytes the loader reads (``Shards.read``), originals against ``--max-side`` copies, both with
fastdata's path (``images.photo.load_photo``: ``Image.draft`` when the crop allows) and with PIL's full
decode + crop + resize; interleaved photo by photo (as ``bench_decode``), so the ratios are paired per
pass. The same RandomResizedCrop draw (same seed per photo) is used for both copies of a photo.

Goals (issue 25): shards locally >= 1.0x the folder; over HTTP with 20 ms a request >= 0.9x local;
``--max-side 256`` at least 1.5x faster to decode. A goal is ``met`` only where every round's ratio
clears it; a range across the threshold is ``within noise``.

    python benchmarks/bench_shards.py                    # full run -> benchmarks/results/
    python benchmarks/bench_shards.py --quick --out /tmp/bench
"""
from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    from . import bench_loaders, common
except ImportError:  # run as a script: python benchmarks/bench_shards.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_loaders, common

import fastdata
from fastdata import cli
from fastdata.config import usable_cores

BACKENDS = ("torch", "dali", "prefetch")
LOADER_CONTENDERS = ("folder", "shards", "shards http", "shards http small cache")   # + f"shards max-side {N}"
SMALL_WINDOW = 2   # the small-cache contender's window: its cache holds 2 windows, fewer shards than the set
DECODE_PATHS = ("load_photo", "PIL full decode")
TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"


def _shard_size(text: str) -> str:
    """``--shard-size``: a size ``fastdata pack`` takes (256MB, 1GB, 512MiB), checked before the photos
    are made, and kept as written (it names the pack's folder in the cache)."""
    from fastdata.packing.writer import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def get_args_parser(add_help: bool = True):
    p = common.PresetParser(description="Tar shards against the folder: read locally, over HTTP with added "
                            "latency, and packed with --max-side; loader images/s and decode cost per photo.",
                            add_help=add_help,
                            quick_help="small sizes, one timed pass: checks that it runs, not how fast")
    p.add_argument("--backends", nargs="+", default=["torch", "dali"], choices=BACKENDS,
                   help="backends to measure (one table each; a missing one is listed as skipped)")
    p.add_argument("--no-decode", dest="decode", action="store_false", help="skip the per-photo decode workload")
    p.add_argument("--device", default=None, type=cli.device, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--workers", type=cli.nonnegative_int, default=usable_cores(),
                   help="worker processes/threads (default: usable cores)")
    p.add_preset("--passes", type=cli.positive_int, full=5, quick=1,
                 help="timed rounds (each contender one pass per round); one warm-up pass each precedes them")
    p.add_preset("--min-pass", type=cli.nonnegative_float, full=2.0, quick=0.0,
                 help="seconds a timed pass lasts at least: a pass repeats whole epochs until then")
    p.add_preset("--jpeg-images", type=cli.positive_int, full=1500, quick=96, help="photos in the JPEG folder")
    p.add_preset("--jpeg-batch", type=cli.positive_int, full=64, quick=32)
    p.add_preset("--shard-size", type=_shard_size, full="16MB", quick="1MB",
                 help="target bytes per shard for both packs (see the module docstring for why not 256MB)")
    p.add_argument("--max-side", type=cli.positive_int, default=256,
                   help="the re-encoded pack's longer side (default 256)")
    p.add_argument("--window", type=cli.positive_int, default=4, help="Shards(window=...): shards shuffled together")
    p.add_argument("--delay", type=cli.nonnegative_float, default=0.02,
                   help="seconds the HTTP server adds to every request")
    p.add_preset("--decode-photos", type=cli.positive_int, full=200, quick=8,
                 help="photos in the per-photo decode workload")
    p.add_preset("--decode-passes", type=cli.positive_int, full=7, quick=2, help="timed passes of the decode workload")
    p.add_argument("--cache", default=str(common.CACHE_DIR),
                   help="where the generated JPEG folder and its packs are kept between runs")
    p.add_preset("--budget", type=cli.positive_float, full=60.0, quick=8.0,
                 help="seconds of timed passes per contender before stopping early")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="directory for the .md/.json/.png reports")
    p.add_argument("--tag", default=None, help="file-name tag (default: cpu-<cores>c or cuda-<gpu>)")
    return p


def small_name(args) -> str:
    return f"shards max-side {args.max_side}"


# ------------------------------------------------------------------------------------ data
def packed(root: Path, args, max_side: int | None) -> tuple[Path, str]:
    """Pack the folder ``root`` under ``args.cache`` (kept between runs: ``pack`` skips finished shards).
    Returns the packed folder and a description."""
    from fastdata.packing import pack

    out = (Path(args.cache) / f"shards-{root.name}-{args.shard_size}"
           / ("original" if max_side is None else f"max-side-{max_side}"))
    t0 = time.perf_counter()
    report = pack(str(root), out, shard_size=args.shard_size, max_side=max_side, progress=False)
    took = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in out.glob("*.tar"))
    what = "originals" if max_side is None else f"--max-side {max_side}"
    desc = (f"{what}: {report.samples:,} samples in {report.shards} shards, {size / 1e6:.1f} MB "
            f"({report.written} written, {report.skipped} kept, {took:.1f}s)")
    print(f"  packed {desc} -> {out}", flush=True)
    return out, desc


class ServedFolder:
    """``tests/shard_servers.http_server`` over ``root``, in a child process on 127.0.0.1.

    Why a child process: the loader's own process runs DALI's reader threads and the torch backend's
    batch hand-off; a server in it would take their interpreter lock. On this machine it still shares
    the cores, as any server on the same host would. ``requests()`` asks it how many GETs it served.
    """

    _PROGRAM = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from shard_servers import Faults, http_server\n"
        "with http_server(sys.argv[2], Faults(delay=float(sys.argv[3]))) as server:\n"
        "    print(server.url, flush=True)\n"
        "    for line in sys.stdin:\n"          # one command a line until the benchmark closes stdin
        "        print(server.count(method='GET'), flush=True)\n"
    )

    def __init__(self, root: Path, delay: float):
        self.root = root
        self.proc = subprocess.Popen([sys.executable, "-c", self._PROGRAM, str(TESTS_DIR), str(root), str(delay)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            self.close()
            raise RuntimeError(f"the HTTP server for {root} did not start (it printed {self.url!r}; exit "
                               f"status {self.proc.poll()})")

    def requests(self) -> int:
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def empty_cache(cache_dir: Path, names) -> int:
    """Evict every cached shard that no process holds, as the cache's own eviction does (the shard's
    lock under ``.locks/`` taken exclusively without waiting, then the file deleted), so the next epoch
    downloads it again. Returns how many shards stayed because a process holds them.

    Why not simply delete the files: a shard some process holds (a reader between its get and its
    release) would then be downloaded again under a lock that process still holds shared."""
    held = 0
    for name in names:
        shard = cache_dir.joinpath(*name.split("/"))
        if not shard.exists():
            continue
        lock = os.open(os.path.join(cache_dir, ".locks", *name.split("/")) + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held += 1
                continue
            shard.unlink(missing_ok=True)
        finally:
            os.close(lock)   # closing releases the lock
    return held


# ------------------------------------------------------------------------------------ loaders
def run_backend(backend, args, device, data, rows, sources, http_stats) -> None:
    """Build the four contenders for ``backend``, time them in rounds, append their Rows."""
    from fastdata.datasets import ImageFolder, Shards

    print(f"\n[{backend}] batch {args.jpeg_batch}, {args.workers} workers, device {device}", flush=True)
    sources[backend] = (f"{data['desc']}; batch {args.jpeg_batch}, {args.workers} workers, device `{device}`, "
                        f"Shards(window={args.window})")
    if backend not in fastdata.available_backends():
        rows.extend(_skipped_rows(backend, args))
        print(f"  {backend} skipped: {common.unavailable(backend)}", flush=True)
        return

    def loader_of(source):
        return fastdata.make_loader(source, backend, batch_size=args.jpeg_batch, device=device,
                                    num_workers=args.workers, train=True)

    built = []
    served = None
    cache_dir = Path(tempfile.mkdtemp(prefix="bench-shards-cache-"))
    try:
        c = bench_loaders.build(rows, backend, "folder", "baseline",
                                lambda: (loader_of(ImageFolder(data["folder"])), "ImageFolder, make_loader"),
                                device, min_pass=args.min_pass)
        built += [c] if c else []
        c = bench_loaders.build(rows, backend, "shards", "fastdata",
                                lambda: (loader_of(Shards(data["original"], window=args.window)),
                                         "Shards(folder), read in place"), device, min_pass=args.min_pass)
        built += [c] if c else []

        names: list[str] = []

        def make_http():
            nonlocal served
            served = ServedFolder(data["original"], args.delay)
            shards = Shards(served.url, cache_dir=cache_dir, window=args.window)
            # The cache's file names (they carry each shard's digest), relative to cache_dir.
            names.extend(os.path.relpath(shards.cached_path(s.name), cache_dir) for s in shards.index.shards)
            return loader_of(shards), (f"Shards(http://127.0.0.1), +{args.delay * 1000:.0f} ms a request, "
                                       f"cached shards evicted before every epoch")

        c = bench_loaders.build(rows, backend, "shards http", "fastdata", make_http, device, min_pass=args.min_pass)
        counts = http_stats.setdefault(backend, {"shards": len(names), "requests": [], "held": [],
                                                 "small_cache_requests": []})
        if c is not None:
            c.run = _counting(c.loader, served, device, args.min_pass, counts["requests"],
                              before=lambda: counts["held"].append(empty_cache(cache_dir, names)))
            built.append(c)
        if served is not None:
            c = bench_loaders.build(rows, backend, "shards http small cache", "fastdata",
                                    lambda: _small_cache_contender(served, args, loader_of, cache_dir / "small"),
                                    device, min_pass=args.min_pass)
            if c is not None:
                c.run = _counting(c.loader, served, device, args.min_pass, counts["small_cache_requests"])
                built.append(c)
        c = bench_loaders.build(rows, backend, small_name(args), "fastdata",
                                lambda: (loader_of(Shards(data["small"], window=args.window)),
                                         f"Shards(folder) packed with --max-side {args.max_side}, read in place"),
                                device, min_pass=args.min_pass)
        built += [c] if c else []
        bench_loaders.time_rounds(built, args.passes, device, args.budget)
    finally:
        for c in built:
            c.close()
        if served is not None:
            served.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
    bench_loaders.add_rows(rows, built)


def _skipped_rows(backend, args) -> list:
    """A skipped Row for each contender of a backend this machine does not have."""
    return [common.Row(backend, name, "baseline" if name == "folder" else "fastdata", status="skipped",
                       note=common.unavailable(backend))
            for name in (*LOADER_CONTENDERS, small_name(args))]


def _small_cache_contender(served, args, loader_of, cache_dir: Path):
    from fastdata.datasets import Shards
    from fastdata.shards.index import read_index

    window = min(SMALL_WINDOW, args.window)
    index = read_index(Path(served.root) / "index.json")
    limit = 2 * window * max(s.size for s in index.shards)
    shards = Shards(served.url, cache_dir=cache_dir, window=window, cache_limit=limit)
    return loader_of(shards), (f"Shards(http://127.0.0.1, window={window}, cache_limit={limit / 1e6:.0f} MB: "
                               f"{limit / max(1, sum(s.size for s in index.shards)):.0%} of the shards), +"
                               f"{args.delay * 1000:.0f} ms a request, evicting on its own")


def _counting(loader, served, device, min_pass: float, counts: list, before=None):
    """A timed pass of ``loader`` that records the GETs the server answered during each epoch;
    ``before()`` runs ahead of each epoch, inside the timing (the cold contender empties the cache)."""
    def epoch():
        if before is not None:
            before()
        start = served.requests()
        n = bench_loaders.consume(loader, device)
        counts.append(served.requests() - start)
        return n

    return bench_loaders.repeated(epoch, min_pass)


# ------------------------------------------------------------------------------------ decode
def _pil_full(data: bytes, name: str, aug, rng):
    """PIL's full decode, then the RandomResizedCrop box (drawn as the loader draws it) and the flip."""
    from PIL import Image

    from fastdata.augment import sample_box

    with Image.open(io.BytesIO(data)) as im:
        img = im.convert("RGB")
    (top, left, h, w), flip = sample_box(aug, rng, img.height, img.width)
    out = img.resize((aug.size, aug.size), Image.BILINEAR, box=(left, top, left + w, top + h))
    return np.asarray(out.transpose(Image.FLIP_LEFT_RIGHT) if flip else out)


def _load_photo(data: bytes, name: str, aug, rng):
    from fastdata.images.photo import load_photo

    return load_photo(data, name, aug, rng)


DECODERS = {"load_photo": _load_photo, "PIL full decode": _pil_full}


def measure_decode(items, passes: int) -> dict:
    """{(copy, path): per-pass µs per photo}: every contender handles photo i before any handles photo
    i+1, in an order rotating from photo to photo, so a burst of load from another session lands on all
    of them and one pass's ratios are paired. The first pass is a warm-up."""
    from fastdata import Augmentation

    aug = Augmentation.imagenet_train()
    keys = [(copy, path) for path in DECODE_PATHS for copy in ("original", "small")]
    clock = time.perf_counter
    per_pass = {k: [] for k in keys}
    for k in range(passes + 1):
        total = dict.fromkeys(keys, 0.0)
        for i, (photo, name) in enumerate(items):
            for j in range(len(keys)):
                key = keys[(i + j + k) % len(keys)]
                rng = np.random.default_rng([7, i])   # the same draw for both copies of photo i
                t0 = clock()
                DECODERS[key[1]](photo[key[0]], name, aug, rng)
                total[key] += clock() - t0
        if k:   # pass 0 warms up imports, the allocator and the file cache of the photos' bytes
            for key in keys:
                per_pass[key].append(total[key] / len(items) * 1e6)
    return per_pass


def run_decode(args, data, rows, sources) -> None:
    from fastdata.datasets import Shards

    original, small = Shards(data["original"]), Shards(data["small"])
    n = min(args.decode_photos, len(original))
    ids = np.linspace(0, len(original) - 1, n).astype(int)
    items = []
    for i in ids:
        a, b = original.read(int(i)), small.read(int(i))
        items.append(({"original": a, "small": b}, original.sample_name(int(i))))
    original.close()
    small.close()
    kb = (statistics.mean(len(p["original"]) for p, _ in items) / 1024,
          statistics.mean(len(p["small"]) for p, _ in items) / 1024)
    sources["decode"] = (f"{n} photos of the packs (originals ~{kb[0]:.0f} KB, --max-side {args.max_side} copies "
                         f"~{kb[1]:.0f} KB), RandomResizedCrop 224 + flip, the same draw for both copies; one core, "
                         f"in this process, bytes in memory")
    print(f"\n[decode] {sources['decode']}", flush=True)
    per_pass = measure_decode(items, args.decode_passes)
    for (copy, path), us in per_pass.items():
        rates = [1e6 / u for u in us]
        what = "originals" if copy == "original" else f"max-side {args.max_side}"
        rows.append(common.Row("decode", f"{what}, {path}", "baseline" if copy == "original" else "fastdata",
                               rate=statistics.median(rates), passes=rates, paired=True,
                               note="fastdata.images.photo.load_photo (Image.draft when the crop allows)"
                               if path == "load_photo" else "PIL open + convert RGB + crop/resize",
                               extra={"us": statistics.median(us), "us_passes": us, "path": path, "copy": copy}))


# ------------------------------------------------------------------------------------ report
def targets_for(args, backends, decode: bool) -> list[common.Target]:
    """Issue 25's goals, per backend; the decode goal per decode path."""
    out = []
    small = small_name(args)
    for b in backends:
        out += [common.Target(b, "shards", "folder", 1.0, label=f"{b}: shards read locally >= 1.0x the folder"),
                common.Target(b, "shards http", "shards", 0.9,
                              label=f"{b}: shards over HTTP (+{args.delay * 1000:.0f} ms a request, cold cache) "
                                    f">= 0.9x local shards"),
                common.Target(b, small, "shards", 1.5,
                              label=f"{b}: loader images/s, --max-side {args.max_side} >= 1.5x originals")]
    if decode:
        for path in DECODE_PATHS:
            out.append(common.Target("decode", f"max-side {args.max_side}, {path}", f"originals, {path}", 1.5,
                                     label=f"decode+crop per photo ({path}): --max-side {args.max_side} >= 1.5x "
                                           f"originals"))
    return out


def results_markdown(rows, sources, targets, args, http_stats, packs) -> str:
    parts = [f"Packs of the JPEG folder, `--shard-size {args.shard_size}`: " + "; ".join(packs) + "."]
    for backend in [b for b in args.backends if b in sources]:
        group = [r for r in rows if r.workload == backend]
        local = next((r for r in group if r.name == "shards" and r.status == "ok"), None)
        lines = []
        for r in group:
            vs_local = "-"
            if local is not None and r.status == "ok" and r is not local:
                vs_local = common.fmt_vs(*common.row_ratio(r, local))
            lines.append([r.name, common.fmt_rate(r),
                          common.fmt_vs(r.vs_baseline, r.vs_baseline_range if r.role != "baseline" else None),
                          vs_local,
                          f"{r.extra['setup_s']:.2f}" if "setup_s" in r.extra else "-",
                          f"{r.extra['warmup_s']:.2f}" if "warmup_s" in r.extra else "-",
                          r.note.replace("|", "/")[:160]])
        stats = http_stats.get(backend)
        http = ""
        if stats and stats["requests"]:
            req, held = stats["requests"], stats["held"]
            http = (f" `shards http`: the server answered {common.fmt_spread((min(req), max(req)), str)} GET "
                    f"requests per epoch for {stats['shards']} shards; before each epoch every cached shard was "
                    f"evicted except {common.fmt_spread((min(held), max(held)), str)} that a process still held, "
                    f"so those were read from the cache.")
            small = stats.get("small_cache_requests")
            if small:
                http += (f" `shards http small cache`: {common.fmt_spread((min(small), max(small)), str)} GET "
                         f"requests per epoch for the same {stats['shards']} shards.")
        parts.append(f"## {backend}\n\n{sources[backend]}. Every contender is built first, then each runs one "
                     f"warm-up pass, then {args.passes} round(s) in which each runs one timed pass (the order "
                     f"rotating); rates are the median pass (slowest–fastest in brackets), ratios the median of the "
                     f"per-round ratios (lowest–highest round in brackets; a ratio whose range covers 1 is "
                     f"{common.NOISE}).{http}\n\n"
                     + common.markdown_table(["contender", "images/s", "vs folder", "vs local shards", "setup s",
                                              "warm-up pass s", "note"], lines))
    if "decode" in sources:
        group = [r for r in rows if r.workload == "decode"]
        lines = []
        for r in group:
            ref = next((x for x in group if x.extra.get("path") == r.extra.get("path") and x.role == "baseline"), None)
            vs = common.fmt_vs(*common.paired_ratios(r.passes, ref.passes)) if ref is not None and ref is not r else "-"
            us = common.fmt_spread(common.spread(r.extra["us_passes"]), lambda x: f"{x:,.0f}")
            lines.append([r.name, f"{r.extra['us']:,.0f} ({us})", common.fmt_rate(r), vs, r.note])
        parts.append(f"## decode\n\n{sources['decode']}. Median of {args.decode_passes} timed passes after one "
                     f"warm-up (fastest–slowest pass in brackets); contenders interleaved photo by photo, so the "
                     f"ratios are paired pass by pass (lowest–highest pass in brackets).\n\n"
                     + common.markdown_table(["contender", "µs/photo", "photos/s/core", "vs originals (same path)",
                                              "note"], lines))
    if targets:
        parts.append("## Targets\n\nA target is met when every round's (pass's) ratio clears it, missed when none "
                     "does, within noise otherwise.\n\n" + common.targets_markdown(targets))
    return "\n\n".join(parts)


def main(args) -> dict:
    """Run the benchmark; returns the JSON payload (also written under ``args.out``)."""
    import torch

    device = fastdata.config.resolve_device(args.device)
    torch.manual_seed(0)
    machine = common.machine_info()
    source, desc = bench_loaders.jpeg_source(args.jpeg_images, args.cache)
    root = Path(source.root)
    print(f"[shards] {desc}", flush=True)
    original, pack_desc = packed(root, args, None)
    small, small_desc = packed(root, args, args.max_side)
    data = {"folder": root, "original": original, "small": small, "desc": desc}

    rows: list[common.Row] = []
    sources: dict[str, str] = {}
    http_stats: dict = {}
    for backend in args.backends:
        run_backend(backend, args, device, data, rows, sources, http_stats)
    if args.decode:
        run_decode(args, data, rows, sources)
    common.add_ratios(rows)
    targets = [t.evaluate(rows) for t in targets_for(args, [b for b in args.backends if b in sources],
                                                     "decode" in sources)]

    body = results_markdown(rows, sources, targets, args, http_stats, [pack_desc, small_desc])
    print("\n" + body, flush=True)
    tag = args.tag or common.machine_tag(machine)
    payload = {"benchmark": "shards", "device": str(device), "workers": args.workers, "passes": args.passes,
               "quick": args.quick, "shard_size": args.shard_size, "max_side": args.max_side,
               "delay_s": args.delay, "window": args.window, "packs": [pack_desc, small_desc],
               "sources": sources, "http": http_stats, "unit": "images/s (decode: photos/s on one core)",
               "rows": [vars(r) for r in rows], "targets": [vars(t) | {"label": t.describe()} for t in targets]}
    chart = {(f"{w}, batch {args.jpeg_batch}" if w != "decode" else "decode+crop per photo, one core"):
             [(r.name, r.rate, r.role, common.spread(r.passes)) for r in rows if r.workload == w and r.status == "ok"]
             for w in sources}
    payload["paths"] = common.write_reports(
        args.out, f"shards-{tag}", title="Shards: folder vs tar shards, local and over HTTP", machine=machine,
        command=common.command_line("bench_shards.py", args.argv), body_md=body, payload=payload,
        chart_groups=chart, chart_xlabel="images/s (log scale)")
    json.dumps(payload, default=str)   # fail here, not in a reader, if something is not serializable
    return payload


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(get_args_parser().parse_args())
