"""The benchmark scripts run end to end in --quick mode and write consistent reports.

Speed is not asserted (the machine is shared and the sizes are tiny); what is asserted is that every
contender the script should measure was measured with a positive rate, that the ratios in the reports
are the rates divided by the baseline's and the limit's, and that the three report files exist.
"""
from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the scripts live in benchmarks/, next to the package, not inside it
    sys.path.insert(0, str(ROOT))

import fastdata  # noqa: E402
from conftest import require


def load(name):
    return importlib.import_module(f"benchmarks.{name}")


def backend_module_exists(name: str) -> bool:
    """True when fastdata ships the backend's file (a backend still being written is allowed to be absent)."""
    if name == "auto":
        return (ROOT / "fastdata" / "backends" / "auto.py").exists()
    target = fastdata.registry.spec(name).target
    if not isinstance(target, str):
        return True
    module = target.split(":")[0]
    return (ROOT / (module.replace(".", "/") + ".py")).exists()


def expected_fastdata() -> set[str]:
    return {b for b in fastdata.available_backends() if backend_module_exists(b)}


def check_reports(payload, stem_prefix):
    paths = {k: Path(v) for k, v in payload["paths"].items()}
    assert set(paths) == {"md", "json", "png"}
    for p in paths.values():
        assert p.exists() and p.stat().st_size > 0, p
        assert p.name.startswith(stem_prefix)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads(paths["json"].read_text())
    for key in ("cpu", "cores", "pil", "torch", "torchvision", "numpy", "date"):
        assert on_disk["machine"].get(key) not in (None, ""), key
    return on_disk, paths["md"].read_text()


def check_rows(rows, workload, must_have):
    group = {r["name"]: r for r in rows if r["workload"] == workload}
    missing = must_have - set(group)
    assert not missing, f"{workload}: no row for {missing}"
    for name in must_have:
        r = group[name]
        assert r["status"] == "ok", f"{workload}/{name}: {r['status']}: {r['note']}"
        assert r["rate"] > 0 and all(p > 0 for p in r["passes"]), (workload, name, r)
    base, limit = group["baseline"]["rate"], group["limit"]["rate"]
    for r in group.values():
        if r["status"] != "ok":
            assert r["rate"] is None and r["note"], r  # a skip or an error always says why
            continue
        assert math.isclose(r["vs_baseline"], r["rate"] / base, rel_tol=1e-9)
        assert math.isclose(r["vs_limit"], r["rate"] / limit, rel_tol=1e-9)
    return group


def test_bench_loaders_quick(tmp_path):
    bench = load("bench_loaders")
    args = bench.get_args_parser().parse_args(
        ["--quick", "--out", str(tmp_path), "--digits", "3000", "--jpeg-images", "60", "--jpeg-batch", "16",
         "--budget", "3", "--cache", str(tmp_path / "cache"), "--tag", "test"])
    payload = bench.main(args)
    on_disk, md = check_reports(payload, "loaders-test")
    assert on_disk["rows"] == json.loads(json.dumps(payload["rows"]))
    must = {"baseline", "limit"} | expected_fastdata()
    for workload in ("digits", "jpeg"):
        group = check_rows(payload["rows"], workload, must)
        for name, r in group.items():
            if r["status"] == "ok":  # every measured contender appears in the Markdown table
                assert f"| {name} " in md
    # The targets are evaluated from the same numbers, and each is printed with its status.
    rows = {(r["workload"], r["name"]): r for r in payload["rows"]}
    for t in payload["targets"]:
        assert t["label"] in md
        if t["status"] != "n/a":
            ref = rows[(t["workload"], t["reference"])]["rate"]
            assert math.isclose(t["value"], rows[(t["workload"], t["name"])]["rate"] / ref, rel_tol=1e-9)
            # The median's ratio lies in the range the passes allow; the status reads the range.
            assert t["low"] <= t["value"] <= t["high"]
            assert t["status"] == ("met" if t["low"] >= t["at_least"] else
                                   "missed" if t["high"] < t["at_least"] else "within noise")
    assert {t["label"] for t in payload["targets"]} >= {"digits: memory >= 100x baseline",
                                                         "jpeg: torch >= 0.9x decode-only limit"}


def test_bench_training_quick(tmp_path):
    bench = load("bench_training")
    args = bench.get_args_parser().parse_args(
        ["--quick", "--out", str(tmp_path), "--steps", "4", "--tag", "test", "--cache", str(tmp_path / "c")])
    payload = bench.main(args)
    on_disk, md = check_reports(payload, "training-test")
    group = check_rows(payload["rows"], "digits", {"baseline", "limit"} | expected_fastdata())
    for r in group.values():
        if r["status"] == "ok":
            assert 0.0 <= r["extra"]["data_wait"] <= 1.0
            assert len(r["extra"]["epochs"]) == args.epochs
            assert r["rate"] == pytest.approx(r["extra"]["epochs"][-1]["images_per_second"])
            # Round 1 times its first steps apart as warm-up, shown on its own; the timed rounds are whole
            # epochs, as fit measures its epochs after the first (issue 29).
            first, *timed = r["extra"]["epochs"]
            assert first["warmup_seconds"] > 0 and r["extra"]["warmup_seconds"] == first["warmup_seconds"]
            assert all(e["warmup_seconds"] == 0.0 for e in timed), timed
    assert "data wait" in md and "| memory " in md and "warm-up s" in md


def test_training_contenders_take_turns_one_epoch_a_round():
    import types

    bench = load("bench_training")
    order = []

    class Fake:
        def __init__(self, name):
            self.name, self.error = name, None

        def epoch(self, args):
            order.append(self.name)

    bench.train_in_rounds([Fake("a"), Fake("b"), Fake("c")], types.SimpleNamespace(epochs=3))
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]   # every round, each once, rotating


def test_training_rounds_read_the_loaders_successive_epochs():
    """Each round's fit(epochs=1) trains the loader's next pass, as one fit(epochs=N) would: fit sees no
    set_epoch (bench_training.NextPass), so it does not set epoch 0 again every round. With it, dali built
    a new pipeline each round (its stream reads ahead into the next epoch) and the H200 run measured that
    restart: 767 JPEGs/s at 86% data wait."""
    from fastdata.engine import fit
    from fastdata.models import SmallCNN

    bench = load("bench_training")
    loader = fastdata.make_loader(fastdata.datasets.SyntheticDigits(64, seed=1), "memory", batch_size=32, device="cpu")
    model = SmallCNN(num_classes=10, in_channels=1)
    for round_ in range(3):
        fit(model, bench.NextPass(loader), epochs=1, progress=False)
        assert loader.epoch == round_ + 1
    assert not hasattr(bench.NextPass(loader), "set_epoch") and len(bench.NextPass(loader)) == len(loader)


def test_bench_pillow_quick(tmp_path):
    bench = load("bench_pillow")
    args = bench.get_args_parser().parse_args(
        ["--quick", "--out", str(tmp_path), "--images", "4", "--rounds", "2", "--round-s", "0.05",
         "--tag", "test", "--cache", str(tmp_path / "c")])
    payload = bench.main(args)
    on_disk, md = check_reports(payload, "pillow-test")
    (result,) = payload["results"]
    import PIL

    assert result["pil"]["version"] == PIL.__version__
    assert result["pil"]["simd"] == (".post" in PIL.__version__)  # Pillow-SIMD's version marker
    assert result["pil"]["flavour"] in md
    for op in bench.OPS:
        assert result["ops"][op]["us"] > 0 and op in md


def test_pillow_compare_runs_the_same_job_elsewhere(tmp_path):
    """--compare re-runs the measurement under another interpreter; here the same one stands in. One
    that fails (here: exits 3) is listed as failed (a missing one is refused when parsing)."""
    bench = load("bench_pillow")
    (tmp_path / "nope").write_text("#!/bin/sh\nexit 3\n")
    (tmp_path / "nope").chmod(0o755)
    args = bench.get_args_parser().parse_args(
        ["--quick", "--out", str(tmp_path), "--images", "2", "--rounds", "1", "--round-s", "0.02",
         "--tag", "cmp", "--cache", str(tmp_path / "c"), "--compare", sys.executable, str(tmp_path / "nope")])
    payload = bench.main(args)
    ok = [r for r in payload["results"] if r["ops"]]
    failed = [r for r in payload["results"] if not r["ops"]]
    assert len(ok) == 2 and len(failed) == 1 and "nope" in failed[0]["error"]
    md = Path(payload["paths"]["md"]).read_text()
    assert "speed-up of" in md and f"{tmp_path / 'nope'} failed (exit 3)" in md


def test_targets_and_ratios():
    from benchmarks import common

    rows = [common.Row("w", "baseline", "baseline", rate=100.0), common.Row("w", "fast", "fastdata", rate=550.0),
            common.Row("w", "limit", "limit", rate=1000.0),
            common.Row("w", "gone", "fastdata", status="skipped", note="not installed")]
    common.add_ratios(rows)
    assert rows[1].vs_baseline == pytest.approx(5.5) and rows[1].vs_limit == pytest.approx(0.55)
    assert rows[3].vs_baseline is None
    met = common.Target("w", "fast", "baseline", 5).evaluate(rows)
    missed = common.Target("w", "fast", "limit", 0.9).evaluate(rows)
    na = common.Target("w", "gone", "baseline", 1).evaluate(rows)
    assert (met.status, missed.status, na.status) == ("met", "missed", "n/a")
    rows[1].extra["data_wait"] = 0.03
    assert common.Target("w", "fast", column="data_wait", at_most=0.02).evaluate(rows).status == "missed"
    md = common.targets_markdown([met, missed, na])
    assert "**missed**" in md and "| met" in md.replace("  ", " ")


def test_a_ratio_whose_passes_straddle_the_target_is_within_noise():
    from benchmarks import common

    # The same loader measured 1,526 and 1,895 images/s in one run: a 1.13x lead over a steady
    # 1,500 images/s contender is not a measured win.
    rows = [common.Row("w", "memory", "fastdata", rate=1700.0, passes=[1526.0, 1700.0, 1895.0]),
            common.Row("w", "dali", "fastdata", rate=1500.0, passes=[1490.0, 1500.0, 1510.0]),
            common.Row("w", "slow", "baseline", rate=500.0, passes=[480.0, 500.0, 520.0])]
    common.add_ratios(rows)
    lo, hi = rows[0].vs_baseline_range
    assert lo == pytest.approx(1526 / 520) and hi == pytest.approx(1895 / 480)
    noisy = common.Target("w", "memory", "dali", 1.13).evaluate(rows)
    assert noisy.status == "within noise" and noisy.low < 1.13 < noisy.high
    assert noisy.value == pytest.approx(1700 / 1500)
    assert common.Target("w", "memory", "slow", 2.5).evaluate(rows).status == "met"      # 2.93x at worst
    assert common.Target("w", "memory", "slow", 4.0).evaluate(rows).status == "missed"   # 3.95x at best
    md = common.targets_markdown([noisy])
    assert "| within noise" in md and "1.01x–1.27x" in md
    # In the tables: every rate with its spread, a ratio covering 1 marked.
    assert common.fmt_rate(rows[0]) == "1,700 (1,526–1,895)"
    assert common.fmt_vs(1.13, common.ratio_range(common.spread(rows[0].passes), common.spread(rows[1].passes))) \
        == "1.13x (1.01x–1.27x)"
    assert common.fmt_vs(1.05, (0.95, 1.2)).endswith("within noise")
    assert common.fmt_vs(2.0, None) == "2.00x"


def test_contenders_timed_in_rounds_are_compared_round_by_round():
    from benchmarks import common

    # The machine slowed down in round 2 for both: paired, the 1.2x lead holds in every round; the
    # cross range of the two spreads would call it noise.
    a = [1200.0, 600.0, 1260.0]
    b = [1000.0, 500.0, 1050.0]
    rows = [common.Row("w", "fast", "fastdata", rate=1200.0, passes=a, paired=True),
            common.Row("w", "ref", "baseline", rate=1000.0, passes=b, paired=True)]
    common.add_ratios(rows)
    assert rows[0].vs_baseline == pytest.approx(1.2) and rows[0].vs_baseline_range == pytest.approx((1.2, 1.2))
    assert common.Target("w", "fast", "ref", 1.1).evaluate(rows).status == "met"
    for r in rows:
        r.paired = False      # timed one after the other: drift between them counts against the ratio
    common.add_ratios(rows)
    assert rows[0].vs_baseline_range == pytest.approx((600 / 1050, 1260 / 500))
    assert common.Target("w", "fast", "ref", 1.1).evaluate(rows).status == "within noise"
    assert common.paired_ratios([1.0, 2.0], [1.0]) is None       # counts differ: not paired


def test_the_median_of_many_rounds_is_judged_by_its_interval_not_by_its_slowest_round():
    from benchmarks import common

    # Up to 8 rounds the 95% interval of the median is the lowest to the highest round (no k >= 2 has
    # P(Binomial(n, 1/2) < k) <= 2.5%), so few-pass verdicts are what they were.
    for n in range(1, 9):
        assert common.median_interval(list(range(n))) == (0, n - 1)
    # 9 rounds: P(X <= 1) = 10/512 <= 2.5% < P(X <= 2) = 46/512, so the 2nd lowest and 2nd highest.
    assert common.median_interval(list(range(9))) == (1, 7)
    # 41 rounds: k = 14 (P(X <= 13) = 1.2% <= 2.5% < P(X <= 14) = 2.8%).
    assert common.median_interval(list(range(41))[::-1]) == (13, 27)
    with pytest.raises(ValueError, match="at least one"):
        common.median_interval([])
    # 41 paired rounds at 1.0x with two slow moments at 0.5x: the rounds' range straddles 0.95, the
    # median's interval does not.
    ours = [1.0] * 39 + [0.5, 0.55]
    ref = [1.0] * 41
    ratio, (lo, hi) = common.paired_ratios(ours, ref)
    assert ratio == 1.0 and (lo, hi) == (1.0, 1.0)
    assert common.compare(lo, hi, 0.95) == "met" and common.compare(min(ours), max(ours), 0.95) == "within noise"
    # Half the rounds below the target is not met, however many rounds there are.
    mixed = [0.9, 1.0] * 20 + [1.0]
    _, (lo, hi) = common.paired_ratios(mixed, ref)
    assert common.compare(lo, hi, 0.95) == "within noise"


def test_rounds_rotate_the_order_and_drop_a_contender_that_fails():
    bench = load("bench_loaders")
    order = []

    def contender(name, fail_at=None):
        calls = []

        def run():
            calls.append(1)
            order.append(name)
            if fail_at is not None and len(calls) == fail_at:
                raise RuntimeError("worker died")
            return 10
        return bench.Contender("w", name, "fastdata", None, "", 0.0, run, "")

    cs = [contender("a"), contender("b"), contender("c", fail_at=3)]
    bench.time_rounds(cs, 3, "cpu", budget_s=1e9)
    assert order[:3] == ["a", "b", "c"]                  # warm-ups in order
    assert order[3:6] == ["a", "b", "c"]                 # round 1
    assert order[6:9] == ["b", "c", "a"]                 # round 2 starts one later; c fails in it
    assert order[9:] == ["a", "b"]                       # round 3 without c
    rows = []
    bench.add_rows(rows, cs)
    got = {r.name: r for r in rows}
    assert got["c"].status == "error" and "worker died" in got["c"].note
    assert len(got["a"].passes) == len(got["b"].passes) == 3 and got["a"].paired


def test_a_short_epoch_is_repeated_until_a_pass_lasts_its_minimum():
    import time

    bench = load("bench_loaders")
    epochs = []

    def epoch():
        epochs.append(1)
        time.sleep(0.02)
        return 100

    t0 = time.perf_counter()
    assert bench.repeated(epoch, 0.1)() == 100 * len(epochs)
    assert len(epochs) >= 5 and time.perf_counter() - t0 >= 0.1     # whole epochs, until 0.1 s passed
    epochs.clear()
    assert bench.repeated(epoch, 0.0)() == 100 and len(epochs) == 1  # --quick: one epoch a pass


def test_an_at_most_target_reads_the_per_pass_values_when_a_script_keeps_them():
    from benchmarks import common

    row = common.Row("w", "torch", "fastdata", rate=1.0, extra={"data_wait": 0.015, "data_wait_passes": [0.01, 0.03]})
    target = common.Target("w", "torch", column="data_wait", at_most=0.02)
    assert target.evaluate([row]).status == "within noise"
    row.extra["data_wait_passes"] = [0.01, 0.019]
    assert target.evaluate([row]).status == "met"


def test_quick_presets_live_in_the_parser_and_an_explicit_value_wins():
    bench = load("bench_training")
    full = bench.get_args_parser().parse_args([])
    quick = bench.get_args_parser().parse_args(["--quick"])
    mine = bench.get_args_parser().parse_args(["--quick", "--steps", "9"])
    assert (full.steps, full.epochs, full.digits_batch) == (30, 3, 256)
    assert (quick.steps, quick.epochs, quick.digits_batch) == (6, 2, 64)
    assert mine.steps == 9 and mine.epochs == 2 and mine.argv == ["--quick", "--steps", "9"]
    loaders = load("bench_loaders")
    q = loaders.get_args_parser().parse_args(["--quick"])
    assert (q.passes, q.digits, q.jpeg_images, q.jpeg_batch, q.budget) == (1, 6000, 96, 32, 8.0)
    assert "--quick 1" in loaders.get_args_parser().format_help()       # the help says both defaults


def test_the_benchmarks_backends_come_from_the_registry():
    from fastdata import registry

    loaders = load("bench_loaders")
    assert loaders.backend_names() == [s.name for s in registry.specs()] + ["auto"]
    registry.register("mine", "mine_pkg:MineLoader", needs="mine_pkg")
    try:
        args = loaders.get_args_parser().parse_args([])
        assert "mine" in args.backends                 # a new row is measured (or listed as skipped) too
    finally:
        registry.unregister("mine")


def test_time_to_target_counts_training_seconds_up_to_the_first_epoch_that_reaches_it():
    bench = load("bench_accuracy")
    history = [{"epoch": 1, "seconds": 10.0, "eval_accuracy": 0.97},
               {"epoch": 2, "seconds": 12.0, "eval_accuracy": 0.991},
               {"epoch": 3, "seconds": 11.0, "eval_accuracy": 0.995}]
    assert bench.time_to_target(history, 0.99) == (22.0, 2)
    assert bench.time_to_target(history, 0.999) == (None, None)
    assert bench.time_to_target([{"epoch": 1, "seconds": 3.0, "eval_accuracy": None}], 0.5) == (None, None)


def test_bench_accuracy_quick_runs_the_example_per_backend(tmp_path):
    bench = load("bench_accuracy")
    args = bench.get_args_parser().parse_args(
        ["--quick", "--backends", "memory", "--train-size", "1024", "--test-size", "512", "--batch-size", "128",
         "--device", "cpu", "--data-root", str(tmp_path / "no-mnist"), "--out", str(tmp_path), "--tag", "test"])
    payload = bench.main(args)
    on_disk, md = check_reports(payload, "accuracy-test")
    (row,) = payload["rows"]
    assert row["status"] == "ok", row
    assert row["dataset"] == "synthetic" and "synthetic digits" in md  # says what it trained on
    assert 0.0 <= row["final_accuracy"] <= 1.0 and row["images_per_second"] > 0
    assert "| memory " in md


def test_gpu_script_refuses_a_machine_without_a_usable_gpu(tmp_path):
    if torch_cuda_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    proc = gpu_sh("call1", tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "torch sees no CUDA device" in proc.stderr and "CUDA devices" in proc.stderr
    assert not (tmp_path / "keep" / "stages.tsv").exists()          # no stage ran


GPU_SH = ROOT / "benchmarks" / "gpu.sh"
STAGES = [("call1", "doctor"), ("call1", "tests"), ("call2", "jpegs"), ("call2", "training"), ("call2", "loaders"),
          ("call2", "cache"), ("call3", "dali-tests"), ("call3", "dali-train"), ("call3", "dali-gpu")]


def gpu_sh(mode, tmp_path, *, timeout, **env):
    """Run benchmarks/gpu.sh MODE with its folders under tmp_path (OUT: what the device tool would return)."""
    import os
    import subprocess

    (tmp_path / "out").mkdir(exist_ok=True)
    env = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "out"),
           "FASTDATA_GPU_KEEP": str(tmp_path / "keep"), **env}
    return subprocess.run(["bash", str(GPU_SH), mode], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def stages_run(tmp_path):
    lines = (tmp_path / "keep" / "stages.tsv").read_text().splitlines()
    return [tuple(line.split("\t")) for line in lines]


def test_gpu_script_parses():
    import subprocess

    proc = subprocess.run(["bash", "-n", str(GPU_SH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_gpu_script_dry_run_runs_every_stage_on_the_cpu(tmp_path):
    """`gpu.sh dry` is the three calls' stages with tiny sizes on the CPU: each must run and pass, and what
    comes back fits the device tool's 8 files: a summary naming every stage, a tarball with every report."""
    import tarfile

    proc = gpu_sh("dry", tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    got = stages_run(tmp_path)
    assert [(c, s) for c, s, *_ in got] == STAGES
    assert all(status == "pass" for _, _, status, *_ in got), got
    out = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(out) <= 8 and "summary-dry.md" in out and "gpu-reports-dry.tar.gz" in out, out
    summary = (tmp_path / "out" / "summary-dry.md").read_text()
    assert "9 of 9 stages passed" in summary
    for call, stage in STAGES:
        assert f"| {call}" in summary and f" {stage} " in summary
    assert "tests collected" in summary and "ceiling" in summary and "memory" in summary   # the headlines
    with tarfile.open(tmp_path / "out" / "gpu-reports-dry.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"reports/dali-gpu-dry.json", "reports/training-dry.json", "reports/training-dry-dali.json",
            "reports/loaders-dry.json", "reports/cache-dry.json", "reports/tests-dry.txt", "reports/summary-dry.md",
            "stages.tsv"} <= names, names


@pytest.mark.slow
def test_a_stuck_stage_is_stopped_and_the_next_ones_still_run(tmp_path):
    # Every limit at 1% (1-2 s): each stage is stopped by its timeout, recorded, and the next one starts.
    proc = gpu_sh("dry", tmp_path, timeout=600, GPU_SH_LIMIT_PCT="1")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = stages_run(tmp_path)
    assert [(c, s) for c, s, *_ in got] == STAGES
    assert all(status.startswith("timeout after") for _, _, status, *_ in got), got
    assert "0 of 9 stages passed" in (tmp_path / "out" / "summary-dry.md").read_text()


@pytest.mark.slow
def test_gpu_stages_chosen_for_a_short_budget_run_in_their_order(tmp_path):
    """GPU_SH_STAGES runs the stages it names, in its order, as one call (what is left of a device budget);
    a name that is no stage, or a spec without its limit, is refused before anything runs."""
    proc = gpu_sh("dry", tmp_path, timeout=300, GPU_SH_STAGES="loaders:60 jpegs:45")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(c, s, status) for c, s, status, *_ in stages_run(tmp_path)] == [("dry", "loaders", "pass"),
                                                                           ("dry", "jpegs", "pass")]
    for k, bad in enumerate(("jpegs:45 bogus:3", "jpegs")):
        (tmp_path / str(k)).mkdir()
        proc = gpu_sh("dry", tmp_path / str(k), timeout=60, GPU_SH_STAGES=bad)
        assert proc.returncode == 2 and "is not NAME:SECONDS" in proc.stderr and "dali-gpu" in proc.stderr


def carried(text):
    """The carry lists of a page's call lines, in order."""
    import re

    return [json.loads(m) for m in re.findall(r'carry `?(\[[^\]]*\])', text)]


def test_the_documented_gpu_calls_are_the_shared_sequence():
    """gpu.sh's header and benchmarks/README.md give the same three calls, carrying what
    ../shared/gpu/README.md says each call carries (where that folder is beside the checkout)."""
    import re

    pages = [GPU_SH.read_text(), (ROOT / "benchmarks" / "README.md").read_text()]
    for text in pages:
        carry = carried(text)
        assert carry == carried(pages[0]) and len(carry) == 3, carry
        for k, files in enumerate(carry):
            assert ".gpu/setup.sh" in files and f".gpu/dali.part{k}" in files
        calls = re.findall(r"carry `?\[[^\]]*\]`?: `?(source \.gpu/setup\.sh && [^`\n]*)", text)
        assert calls == [f"source .gpu/setup.sh && bash benchmarks/gpu.sh call{k}" for k in (1, 2, 3)], calls
    shared = ROOT.parent / "shared" / "gpu" / "README.md"
    if shared.exists():
        assert carried(shared.read_text()) == carried(pages[0])


def test_the_gpu_summary_names_failures_and_each_stages_headline(tmp_path):
    gpu_summary = load("gpu_summary")
    keep = tmp_path / "keep"
    (keep / "logs").mkdir(parents=True)
    (keep / "reports").mkdir()
    (keep / "stages.tsv").write_text("call1\ttests\tFAIL (exit 1)\t95\t180\ncall2\tloaders\tpass\t30\t60\n")
    (keep / "logs" / "tests.log").write_text(
        "....F\nFAILED tests/test_x.py::test_y - AssertionError: gpu_idle 0.10\n"
        "=========== 1 failed, 129 passed, 5 skipped in 95.31s (0:01:35) ===========\n")
    rows = [vars(common_row("digits", "memory", 1.2e6, data_wait=0.03)), vars(common_row("digits", "dali", None))]
    (keep / "reports" / "loaders-t.json").write_text(json.dumps({"rows": rows}))
    text = gpu_summary.summary_markdown(keep, "t")
    assert "1 of 2 stages passed (not: tests)" in text and "**FAIL (exit 1)**" in text
    assert "1 failed, 129 passed, 5 skipped in 95.31s" in text
    assert "tests: FAILED tests/test_x.py::test_y" in text
    assert "memory 1,200,000 (wait 3.0%)" in text and "images/s" in text and "dali skipped" in text


def common_row(workload, name, rate, **extra):
    from benchmarks import common

    if rate is None:
        return common.Row(workload, name, "fastdata", status="skipped", note="not installed")
    return common.Row(workload, name, "fastdata", rate=rate, passes=[rate], extra=extra)


def test_the_photo_folder_is_written_in_parallel_and_the_same_whatever_the_workers(tmp_path):
    from benchmarks import common

    one = common.photo_folder(tmp_path / "a", 70, workers=1)     # 7 a class: jobs of 5 and 2 photos
    two = common.photo_folder(tmp_path / "b", 70, workers=2)
    files = sorted(p.relative_to(one) for p in one.rglob("*.jpg"))
    assert len(files) == 70 and files == sorted(p.relative_to(two) for p in two.rglob("*.jpg"))
    assert files[6] == Path("class_000/img_00006.jpg")
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files)
    assert len({(one / f).read_bytes() for f in files}) == 70                 # every photo its own
    assert (one / ".complete").exists() and not (tmp_path / "a" / "jpeg-10x7.parts").exists()
    (one / "class_000" / "img_00000.jpg").unlink()
    assert common.photo_folder(tmp_path / "a", 70) == one                    # kept: not written again
    assert not (one / "class_000" / "img_00000.jpg").exists()


def test_cpu_seconds_count_workers_that_are_still_running():
    """getrusage(RUSAGE_CHILDREN) counts a worker only once it has exited and been reaped; DataLoader workers
    live through a pass, so their CPU must come from /proc."""
    import multiprocessing
    import time

    bench = load("bench_dali_gpu")
    ctx = multiprocessing.get_context("fork")
    go, done = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=_spin, args=(go, done))
    worker.start()
    try:
        before = bench.cpu_seconds()
        go.set()
        assert done.wait(60)
        time.sleep(0.05)
        assert bench.cpu_seconds() - before >= 0.3     # the worker's 0.5 s of CPU, while it is still alive
        assert worker.is_alive()
    finally:
        worker.kill()
        worker.join()


def _spin(go, done):
    import time

    go.wait()
    t0 = time.process_time()
    while time.process_time() - t0 < 0.5:
        pass
    done.set()
    time.sleep(60)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_the_chart_draws_each_contenders_spread(tmp_path, monkeypatch):
    import matplotlib.axes

    from fastdata.report import bar_chart

    drawn = []
    real = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", lambda self, x, y, **kw: drawn.append((x, y, kw["xerr"]))
                        or real(self, x, y, **kw))
    path = tmp_path / "c.png"
    bar_chart(path, {"w": [("memory", 1700.0, "fastdata", (1526.0, 1895.0)), ("torch", 1360.0, "fastdata", None)]},
              xlabel="images/s", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (x, y, xerr), = drawn                                   # one whisker: the row without a spread has none
    assert list(x) == [1700.0] and list(y) == [0]
    assert xerr == [[pytest.approx(174.0)], [pytest.approx(195.0)]]


def test_bench_decode_quick(tmp_path):
    from fastdata.images import region

    bench = load("bench_decode")
    args = bench.get_args_parser().parse_args(
        ["--quick", "--out", str(tmp_path), "--images", "2", "--large-images", "1", "--crops", "2",
         "--passes", "1", "--tag", "test", "--cache", str(tmp_path / "c")])
    payload = bench.main(args)
    on_disk, md = check_reports(payload, "decode-test")
    for w in bench.WORKLOADS:
        group = {r["name"]: r for r in payload["rows"] if r["workload"] == w}
        assert set(group) == set(bench.CONTENDERS)
        for name, r in group.items():
            if r["status"] != "ok":  # only the nvImageCodec rows may be skipped, saying why
                assert not region.region_available() and r["note"] == region.region_decoder_status()
                continue
            assert r["rate"] > 0 and len(r["passes"]) == 1 and f"| {name} " in md
            if name in ("region window", "nvImageCodec full decode"):
                assert r["extra"]["max_diff"] <= 1  # the full decode's pixels (tests/test_region.py)
    assert {t["label"] for t in payload["targets"]} == {t["label"] for t in on_disk["targets"]}
    for t in payload["targets"]:
        assert t["label"] in md


def test_bench_shards_quick(tmp_path):
    """Folder, local shards, shards over the HTTP server (cold cache each epoch, and a small cache left to
    evict) and --max-side shards each measured on the torch backend; the decode workload pairs originals
    with their small copies."""
    require("aiohttp")   # Shards over HTTP read through fsspec's aiohttp file system
    bench = load("bench_shards")
    args = bench.get_args_parser().parse_args(
        ["--quick", "--backends", "torch", "--jpeg-images", "20", "--jpeg-batch", "10", "--shard-size", "300KB",
         "--window", "2", "--decode-photos", "4", "--decode-passes", "1", "--out", str(tmp_path), "--tag", "test",
         "--cache", str(tmp_path / "c")])
    payload = bench.main(args)
    on_disk, md = check_reports(payload, "shards-test")
    group = {r["name"]: r for r in payload["rows"] if r["workload"] == "torch"}
    assert set(group) == {"folder", "shards", "shards http", "shards http small cache", "shards max-side 256"}
    for name, r in group.items():
        assert r["status"] == "ok" and r["rate"] > 0 and len(r["passes"]) == 1 and r["paired"], r
        assert f"| {name} " in md
    http = payload["http"]["torch"]
    assert http["shards"] >= 3
    # The warm-up epoch and the timed one each downloaded what the eviction before it removed.
    assert len(http["requests"]) == 2
    for got, held in zip(http["requests"], http["held"], strict=True):
        assert got >= http["shards"] - held > 0
    # The small cache (2 windows of 2 of the largest shard) cannot hold every shard: each epoch downloads
    # some, the first (warm-up) epoch every one it reads but those of the first window, which the loader
    # may have fetched ahead already while it was built (its contract check reads the first batch, and the
    # read-ahead starts with it): a loaded machine's full run saw 5 of 7.
    small = http["small_cache_requests"]
    window = min(bench.SMALL_WINDOW, 2)
    assert len(small) == 2 and small[0] >= http["shards"] - window and all(n > 0 for n in small)
    assert "small cache`:" in md
    decode = {r["name"]: r for r in payload["rows"] if r["workload"] == "decode"}
    assert set(decode) == {f"{copy}, {path}" for copy in ("originals", "max-side 256") for path in bench.DECODE_PATHS}
    assert all(r["rate"] > 0 for r in decode.values())
    rows = {(r["workload"], r["name"]): r for r in payload["rows"]}
    for t in payload["targets"]:
        assert t["label"] in md
        ref, row = rows[(t["workload"], t["reference"])], rows[(t["workload"], t["name"])]
        assert math.isclose(t["value"], row["passes"][0] / ref["passes"][0], rel_tol=1e-9)  # one round: paired
    assert len(payload["targets"]) == 5


def test_bench_shards_evicts_only_the_shards_no_process_holds(tmp_path):
    """Deleting a shard that a process holds would leave its readers waiting forever for a download
    under a lock that is never released: the benchmark's eviction takes each lock as the cache does."""
    import fcntl
    import os

    bench = load("bench_shards")
    (tmp_path / ".locks" / "sub").mkdir(parents=True)
    (tmp_path / "sub").mkdir()
    names = ["a.tar", "sub/b.tar", "c.tar", "never-fetched.tar"]
    for name in names[:3]:
        (tmp_path / name).write_bytes(b"x" * 512)
    held = os.open(tmp_path / ".locks" / "sub" / "b.tar.lock", os.O_RDWR | os.O_CREAT)
    other = os.fork()
    if other == 0:   # the hold must be another process's: flock locks of one process do not conflict
        fcntl.flock(held, fcntl.LOCK_SH)
        os.close(os.open(tmp_path / "ready", os.O_CREAT))
        import time

        time.sleep(30)
        os._exit(0)
    try:
        import time

        deadline = time.monotonic() + 20
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bench.empty_cache(tmp_path, names) == 1
        assert [name for name in names if (tmp_path / name).exists()] == ["sub/b.tar"]
    finally:
        os.kill(other, 9)
        os.waitpid(other, 0)
        os.close(held)


def test_bench_dali_gpu_quick_on_the_cpu(tmp_path):
    """The dry form of the GPU experiment: DALI's own pipeline, the dali backend (decoding in its pipeline, as
    on a GPU), torch and the limit measured with CPU cores used; nvJPEG's settings listed as skipped."""
    bench = load("bench_dali_gpu")
    args = bench.get_args_parser().parse_args(
        ["--quick", "--device", "cpu", "--workers", "2", "--jpeg-images", "20", "--batches", "4", "8",
         "--depths", "2", "--thread-counts", "1", "--out", str(tmp_path), "--tag", "test",
         "--cache", str(tmp_path / "c")])
    payload = bench.main(args)
    on_disk, md = check_reports(payload, "dali-gpu-test")
    rows = {r["name"]: r for r in on_disk["rows"]}
    measured = ["ceiling", "dali", "torch", "limit", "dali prefetch_queue_depth=2", "dali batch 4", "dali batch 8",
                "dali num_workers=1"]
    for name in measured:
        r = rows[name]
        assert r["status"] == "ok", (name, r)
        assert r["rate"] > 0 and len(r["passes"]) == 2 and not r["paired"]
        assert len(r["extra"]["cores_passes"]) == 2 and r["extra"]["cores"] > 0
        assert f"| {name} " in md
    assert "decode='dali'" in rows["dali"]["note"] and rows["dali batch 8"]["extra"]["batch_size"] == 8
    # The first batch size and the installed defaults are what the `dali` row ran: its figures, not a rerun.
    bench_args = bench.get_args_parser().parse_args(["--batches", "64", "256", "--workers", "16"])
    same = {s.name: bench.same_as(s, bench_args, {"hw_decoder_load": 0.65, "affine": False})
            for s in bench.settings(bench_args)}
    assert same["ceiling hw_decoder_load=0.65"] == "ceiling" and same["ceiling hw_decoder_load=1"] is None
    assert same["dali hw_decoder_load=0.65"] == same["dali batch 64"] == same["dali num_workers=16"] == "dali"
    assert same["dali hw_decoder_load=1"] is same["dali batch 256"] is same["dali fancy_upsampling=False"] is None
    assert bench.settings(bench_args)[4].name == "dali handover=stream"   # first of the settings: never cut
    for name in ("dali batch 4", "dali affine=False"):
        assert rows[name]["passes"] == rows["dali"]["passes"]
        assert rows[name]["note"].startswith("the defaults: the `dali` row's figures")
    assert rows["dali affine=True"]["passes"] != rows["dali"]["passes"]
    assert rows["dali num_workers=1"]["extra"]["num_workers"] == 1
    for name in ("dali hw_decoder_load=0", "ceiling hw_decoder_load=1", "dali fancy_upsampling=False",
                 "dali preallocate=True", "dali handover=host"):
        assert rows[name]["status"] == "skipped" and "GPU-only" in rows[name]["note"]
    choices = {c["factor"]: c for c in on_disk["choices"]}
    assert set(choices) == {"hw_decoder_load", "ceiling hw_decoder_load", "fancy_upsampling", "preallocate",
                            "prefetch_queue_depth", "batch", "num_workers", "affine", "handover", "driver"}
    best = max((rows["dali batch 4"], rows["dali batch 8"]), key=lambda r: r["rate"])
    assert choices["batch"]["best"] == best["extra"]["value"] and choices["hw_decoder_load"]["best"] is None
    assert "## Choosing the defaults" in md


def test_a_setting_the_installed_fastdata_refuses_is_listed_not_fatal(tmp_path):
    bench = load("bench_dali_gpu")
    import torch

    args = bench.get_args_parser().parse_args(["--quick", "--device", "cpu", "--workers", "1"])
    source, _ = load("bench_loaders").jpeg_source(10, tmp_path)
    rows = []
    setting = bench.Setting("dali warp_speed=9", "fastdata", "warp_speed", 9, {"warp_speed": 9})
    bench.measure(setting, rows, source, args, torch.device("cpu"))
    (row,) = rows
    assert row.status == "not supported" and row.note.startswith("not supported by this fastdata")
    assert "warp_speed" in row.note
