"""QA pass on choosing a backend: ``auto`` (the choice, its reason, the options it passes on, ranks that
must agree), the ``prefetch`` stage's hand-over, and the benchmarks users run to choose."""
import logging
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch

from conftest import indexed_source
from fastdata import Augmentation, make_loader, registry
from fastdata.backends import auto


def config(device, rank=None, world_size=None, batch_size=256):
    return SimpleNamespace(device=torch.device(device), augment=Augmentation(crop="translate", pad=2),
                           train=True, rank=rank, world_size=world_size, dtype=torch.float32,
                           batch_size=batch_size)


# ------------------------------------------------------------------------------ auto across ranks
def _rank(rank, path, q):
    import torch.distributed as dist

    from fastdata import registry as r
    from fastdata.backends import memory as m

    if rank == 1:
        m.budgeting.free_bytes = lambda device: 1000   # rank 1's memory is nearly full: no cache fits there
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        src = indexed_source(1000)
        name, why = r.choose(src, config("cpu"))
        built = None
        try:   # what the rank then builds: the choice must be one the rank can build
            loader = r.backend_class(name)(src, r.LoaderConfig(
                batch_size=50, device="cpu", num_workers=0, augment=Augmentation(crop="translate", pad=2)))
            loader.close()
            built = "ok"
        except Exception as e:
            built = f"{type(e).__name__}: {e}"
        q.put((rank, name, why, built))
    except Exception as e:
        q.put((rank, None, f"{type(e).__name__}: {e}", None))
    finally:
        from fastdata import distributed as fdist

        fdist.cleanup(barrier=False)


def test_with_a_process_group_the_choice_is_the_first_row_that_fits_on_every_rank(tmp_path):
    """Rank 0 deciding alone picked `memory` for a job whose rank 1 had no room for the cache: rank 1
    then failed building it (CacheDoesNotFit) while rank 0 trained on."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, tmp_path / "pg", q)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (name, why, built) for r, name, why, built in (q.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    assert results[0][0] == results[1][0] == "torch", results
    for rank in (0, 1):
        name, why, built = results[rank]
        assert built == "ok", (rank, built)
        assert "not memory on rank 1: the cache" in why and "does not fit" in why, why
        assert "fits on all 2 ranks" in why, why


def test_ranks_verdicts_combine_to_the_first_row_every_rank_can_use():
    rows0 = [("memory", True, "fits here"), ("torch", True, "torch reads it")]
    rows1 = [("memory", False, "the cache does not fit"), ("torch", True, "torch reads it")]
    name, why = auto.combine([rows0, rows1], "cpu")
    assert name == "torch" and why.startswith("torch reads it") and "not memory on rank 1: the cache" in why
    with pytest.raises(ValueError, match=r"no backend fits on every rank.*not memory on rank 1.*"
                                         r"not torch on rank 0: x"):
        auto.combine([[("memory", True, ""), ("torch", False, "x")], [("memory", False, "y"), ("torch", True, "")]],
                     "cpu")
    # A rank whose fits() raised: every rank raises, naming it (no rank is left waiting in a collective).
    with pytest.raises(RuntimeError, match="rank 1 could not decide: OSError: gone"):
        auto.combine([rows0, "OSError: gone"], "cpu")


# ------------------------------------------------------------------------------ auto and the options
def test_an_option_the_picked_backend_does_not_take_is_named_in_the_reason(caplog):
    """auto passes each backend only its own options: `depth=4` or `prefetch_factor=4` with `memory`
    picked vanished without a word, and the user believed they were in effect."""
    src = indexed_source(300)
    with caplog.at_level(logging.WARNING, logger="fastdata"):
        loader = make_loader(src, "auto", batch_size=50, device="cpu", num_workers=0, depth=4,
                             prefetch_factor=4, cache_size=64)
    try:
        assert loader.name == "memory"
    finally:
        loader.close()
    line = next(r.getMessage() for r in caplog.records if "picked" in r.getMessage())
    assert "not passed to memory, which does not take them: depth=4 (prefetch's), " \
           "prefetch_factor=4 (prefetch's, torch's)" in line, line
    assert "cache_size" not in line.split("not passed")[1]
    name, why = registry.choose(src, config("cpu"), {"cache_size": 64})
    assert name == "memory" and "not passed" not in why


# ------------------------------------------------------------------------------ the benchmark scripts
def _script(name):
    import importlib
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:   # the scripts live in benchmarks/, next to the package
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{name}")


@pytest.mark.parametrize("script", ["bench_loaders", "bench_training"])
def test_a_data_folder_given_must_hold_mnist_and_is_checked_before_any_work(script, tmp_path, monkeypatch, capsys):
    """`--data /typo` measured synthetic digits and labelled the report so in a line few read: a user
    quoting "MNIST" figures never measured them. The default (./data) still falls back."""
    mod, loaders = _script(script), _script("bench_loaders")
    with pytest.raises(SystemExit):
        mod.get_args_parser().parse_args(["--data", str(tmp_path / "typo")])
    assert f"'{tmp_path / 'typo'}' is not a folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    args = mod.get_args_parser().parse_args(["--quick", "--workloads", "digits", "--data", str(empty),
                                             "--out", str(tmp_path / "out")])
    monkeypatch.setattr(mod, "run_workload", lambda *a, **k: pytest.fail("measured before the data was checked"))
    with pytest.raises(SystemExit, match=f"--data {empty}: no MNIST there.*MNIST files not found"):
        mod.main(args)
    assert not (tmp_path / "out").exists()
    monkeypatch.chdir(tmp_path)           # no ./data here: the default falls back to synthetic digits
    src, desc = loaders.digits_source(100, None)
    assert len(src) == 100 and desc.startswith("SyntheticDigits") and "no MNIST under ./data" in desc


def test_a_backend_not_installed_is_skipped_with_its_install_hint(monkeypatch):
    loaders = _script("bench_loaders")
    monkeypatch.setitem(registry.BACKENDS, "dali", registry.BackendSpec(
        "dali", "x.y:Z", needs="no_dali_here", install="pip install nvidia-dali-cuda120", order=20,
        devices=("cuda",)))
    registry.clear_import_cache()
    try:
        rows = []
        args = loaders.get_args_parser().parse_args(["--quick", "--workloads", "digits", "--backends", "dali",
                                                     "--no-baseline", "--no-limit"])
        loaders.run_workload("digits", args, torch.device("cpu"), rows, {})
    finally:
        registry.clear_import_cache()
    (row,) = rows
    assert row.status == "skipped" and "needs no_dali_here" in row.note and "pip install nvidia-dali" in row.note


def test_the_auto_rows_note_names_the_pick_once():
    """The note read "auto picked 'memory': fastdata: backend 'auto' picked 'memory': its cache ...
    (make_loader(..., quiet=True) hides this)": the whole log line pasted after its own summary."""
    loaders = _script("bench_loaders")
    rows = []
    args = loaders.get_args_parser().parse_args(["--quick", "--workloads", "digits", "--backends", "auto",
                                                 "--no-baseline", "--no-limit", "--digits", "600",
                                                 "--workers", "1"])
    loaders.run_workload("digits", args, torch.device("cpu"), rows, {})
    (row,) = rows
    assert row.status == "ok", row.note
    assert row.note.startswith("auto picked 'memory': its ") and row.note.count("picked") == 1, row.note
    assert "quiet=True" not in row.note


def test_fastdata_bench_lists_only_the_backends_it_measures(capsys):
    """`--backends dali_nope` answered "choose from ['auto', 'torch', ...]", and `--backends auto` is
    refused: the list offered a choice the command does not take."""
    from fastdata import bench

    with pytest.raises(SystemExit):
        bench.get_args_parser().parse_args(["digits", "--backends", "dali_nope"])
    err = capsys.readouterr().err
    # The table's rows, not auto (another test may have registered a backend of its own in this process).
    assert f"unknown backend 'dali_nope'; choose from {list(registry.BACKENDS)}" in err, err
    assert "'auto'" not in err.split("choose from")[-1], err


# ------------------------------------------------------------------------------ prefetch
def _drain_in_thread(it, seconds=15):
    """(batches taken, the exception that ended it, or "hung") for the rest of ``it``."""
    import threading

    out = {"n": 0, "end": "hung"}

    def drain():
        try:
            for _ in it:
                out["n"] += 1
            out["end"] = None
        except Exception as e:
            out["end"] = e

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    t.join(seconds)
    return out["n"], out["end"]


@pytest.mark.parametrize("device, workers", [("cpu", 0), ("cpu", 2), pytest.param("cuda", 2, marks=pytest.mark.cuda)])
def test_a_prefetch_pass_after_close_says_so_instead_of_waiting_forever(device, workers):
    """close() stops the producer thread; the pass's next() then waited on the empty queue forever (the
    torch backend raises, saying the loader was closed)."""
    import time

    loader = make_loader(indexed_source(500), "prefetch", batch_size=50, device=device, num_workers=workers)
    it = iter(loader)
    for _ in range(2):
        next(it)
    time.sleep(0.2)          # the producer fills its queue
    loader.close()
    taken, end = _drain_in_thread(it)
    assert isinstance(end, RuntimeError) and "closed while this pass ran" in str(end), (taken, end)
    assert taken <= 3        # at most what was queued before the close


def test_the_stage_closed_mid_pass_ends_the_pass_with_an_error():
    from fastdata.prefetch import PrefetchStage

    def endless():
        k = 0
        while True:
            yield torch.full((1, 2, 2, 1), k % 256, dtype=torch.uint8), torch.tensor([k])
            k += 1

    stage = PrefetchStage(torch.device("cpu"), depth=1)
    it = stage(endless(), lambda x: x.float())
    next(it)
    stage.close()
    taken, end = _drain_in_thread(it)
    assert isinstance(end, RuntimeError) and "closed while this pass ran" in str(end), (taken, end)


# ------------------------------------------------------------------------------ quoted figures
def _results(name):
    import json
    from pathlib import Path

    return json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / name).read_text())


def _doc(name):
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / name).read_text()


def _sig3(x):
    """A ratio as the docs quote it: three significant digits (80.2, 6.30, 117), rounded from the
    report's two decimals (66.649 is 66.65x there, quoted 66.7)."""
    return f"{round(x, 2):#.3g}".rstrip(".")


LABELS = {"baseline": "baseline (torchvision)", "torch": "`torch`", "memory": "`memory`", "prefetch": "`prefetch`",
          "dali": "`dali` (CPU)", "auto": "`auto` (picked `memory`)", "limit": "limit"}


def test_the_loader_figures_quoted_in_the_docs_are_the_results_files():
    _script("common")   # puts the repository on the path
    from benchmarks.common import fmt_num

    run = _results("loaders-cpu-2c.json")
    doc, readme = _doc("docs/benchmarks.md"), _doc("README.md")
    assert f"full run of {run['machine']['date']} (`benchmarks/results/loaders-cpu-2c.md`)" in doc
    assert f"run of {run['machine']['date']} (`benchmarks/results/loaders-cpu-2c.md`)" in readme
    lines = {name: next(line for line in doc.splitlines() if line.startswith(f"| {label} |"))
             for name, label in LABELS.items()}
    for row in run["rows"]:
        line = lines[row["name"]]
        assert fmt_num(row["rate"]) in line, (row["workload"], row["name"], line)
        if row["name"] != "limit":
            lo, hi = min(row["passes"]), max(row["passes"])
            assert f"{fmt_num(row['rate'])} ({fmt_num(lo)}–{fmt_num(hi)})" in line, (row["name"], line)
        if row["name"] not in ("baseline", "limit"):
            lo, hi = row["vs_baseline_range"]
            quoted = f"{_sig3(row['vs_baseline'])} ({_sig3(lo)}–{_sig3(hi)})"
            assert quoted in line, (row["workload"], row["name"], quoted, line)
            readme_line = next(x for x in readme.splitlines() if x.startswith(f"| `{row['name']}` |"))
            assert _sig3(row["vs_baseline"]) + "×" in readme_line, (row["name"], readme_line)


def test_the_cpu_training_figures_quoted_in_the_docs_are_the_results_file():
    run = _results("training-cpu-2c.json")
    doc = _doc("docs/benchmarks.md")
    start = doc.index("Training (`bench_training.py`")
    paragraph = " ".join(doc[start:doc.index("\n\n", start)].split())
    assert f"run {run['machine']['date']}:" in paragraph, paragraph[:80]
    said = {"baseline": "baseline {}", "limit": "ready tensors) {}", "auto": "`auto` (`memory`) {}"}
    for row in run["rows"]:
        quoted = said.get(row["name"], f"`{row['name']}` {{}}").format(round(row["rate"]))
        assert quoted in paragraph, (quoted, paragraph)


def test_the_h200_training_figures_quoted_in_the_docs_are_the_results_file():
    _script("common")
    from benchmarks.common import fmt_num

    run = _results("training-cuda-h200.json")
    line = next(x for x in _doc("docs/benchmarks.md").splitlines() if x.startswith("| training a SmallCNN on digits"))
    third = line.split(" | ")[-1]
    readme = _doc("README.md")
    for row in run["rows"]:
        if row["workload"] != "digits" or row["name"] == "baseline":
            continue
        assert fmt_num(row["rate"]) in third, (row["name"], third)
        if row["name"] in ("memory", "torch", "prefetch", "auto"):
            readme_line = next(x for x in readme.splitlines() if x.startswith(f"| `{row['name']}` |"))
            assert fmt_num(row["rate"]) in readme_line, (row["name"], readme_line)


def test_bench_dali_cpus_folder_is_checked_by_the_parser(tmp_path, capsys):
    """`--folder /typo` was a FileNotFoundError traceback from inside the run."""
    mod = _script("bench_dali_cpu")
    with pytest.raises(SystemExit):
        mod.get_args_parser().parse_args(["--folder", str(tmp_path / "typo")])
    assert f"argument --folder: '{tmp_path / 'typo'}' is not a folder" in capsys.readouterr().err


def test_bench_accuracy_says_a_backend_is_not_installed_and_how_to_install_it(monkeypatch, capsys):
    """`--backends dali` where DALI does not import answered "invalid choice: 'dali' (choose from
    'torch', 'memory', 'prefetch')": as if there were no such backend."""
    mod = _script("bench_accuracy")
    monkeypatch.setitem(registry.BACKENDS, "dali", registry.BackendSpec(
        "dali", "x.y:Z", needs="no_dali_here", install="pip install nvidia-dali-cuda120", order=20,
        devices=("cuda",)))
    registry.clear_import_cache()
    try:
        for bad, said in (("dali", "needs no_dali_here, which does not import here; install: pip install nvidia-dali"),
                          ("auto", "'auto' picks one of the others: name that one"),
                          ("nope", f"unknown backend 'nope'; choose from {list(registry.BACKENDS)}")):
            with pytest.raises(SystemExit):
                mod.get_args_parser().parse_args(["--backends", bad])
            err = capsys.readouterr().err
            assert said in err, (bad, err)
        assert mod.get_args_parser().parse_args([]).backends == ["torch", "memory", "prefetch"]
    finally:
        registry.clear_import_cache()


def test_fastdata_bench_reports_each_backends_setup_apart(monkeypatch):
    """The delivery rate starts after make_loader: memory's cache build (minutes on a large photo
    folder) was in no figure, and its row read as if it cost nothing to start."""
    from fastdata import bench
    from fastdata.backends.memory import MemoryLoader

    build = MemoryLoader._build

    def slow_build(self, *a, **k):
        import time

        time.sleep(0.5)
        return build(self, *a, **k)

    monkeypatch.setattr(MemoryLoader, "_build", slow_build)
    payload = bench.run(indexed_source(600), backends=["memory", "torch"], batches=3, warmup=1, progress=False,
                        device="cpu", num_workers=0, batch_size=64)
    rows = {r["backend"]: r for r in payload["rows"]}
    assert rows["memory"]["setup_seconds"] >= 0.5 > rows["torch"]["setup_seconds"] >= 0
    text = bench.report_markdown(payload)
    assert "setup s" in text and "the loader was built" in text
    line = next(x for x in text.splitlines() if x.startswith("| memory"))
    assert f"{rows['memory']['setup_seconds']:.2f}" in line
