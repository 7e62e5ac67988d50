"""Result files: JSON that strict parsers read; a training run's result (the examples' shared tail)."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from fastdata import Augmentation
from fastdata.report import null_for_nonfinite, report_run, run_result, summarize, write_json, write_result


def strict_load(path):
    """JavaScript's JSON.parse, serde and jq --strict refuse NaN/Infinity: so does this."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_non_finite_figures_are_written_as_null(tmp_path):
    payload = {"loss": math.nan, "rows": [{"rate": math.inf, "ok": 1.5}], "pair": (-math.inf, 2), "name": "x"}
    write_json(tmp_path / "r.json", payload)
    assert strict_load(tmp_path / "r.json") == {"loss": None, "rows": [{"rate": None, "ok": 1.5}],
                                                "pair": [None, 2], "name": "x"}
    assert null_for_nonfinite([1.0, [math.nan]]) == [1.0, [None]]


def test_the_training_result_of_a_diverged_run_is_standard_json(tmp_path):
    path = write_result({"final_train_loss": math.nan, "history": [{"eval_loss": math.nan}]}, tmp_path / "a" / "r.json")
    assert strict_load(path) == {"final_train_loss": None, "history": [{"eval_loss": None}]}


def _record(seconds, warmup, rate, wait, idle=None, **more):
    return {"seconds": seconds, "warmup_seconds": warmup, "images_per_second": rate, "data_wait_fraction": wait,
            "gpu_idle_fraction": idle, "peak_memory_mb": 10.0, "train_loss": 1.0, "eval_accuracy": 0.5, **more}


def test_summarize_takes_the_steady_state_not_the_warm_up():
    """Issue 29: train_mnist --backend dali on an H200, epoch 1 with 1.5 s of warm-up, epochs 2-3 at 0.2 s
    each, printed 12,398 images/s while the steady state ran at 39-40k. Each record's figures are its
    steady state's (after its warm-up); the summary adds them up over the steady seconds."""
    h = [_record(1.7, 1.5, 40000.0, 0.02, 0.05), _record(0.2, 0.0, 39000.0, 0.01, 0.02),
         _record(0.2, 0.0, 40000.0, 0.01, 0.02, eval_accuracy=0.9)]
    s = summarize(h)
    assert s["train_seconds"] == pytest.approx(2.1) and s["warmup_seconds"] == pytest.approx(1.5)
    # 0.2 s at 40k, 0.2 s at 39k, 0.2 s at 40k: the steady images over the steady seconds
    assert s["images_per_second"] == pytest.approx((8000 + 7800 + 8000) / 0.6)
    assert s["data_wait_fraction"] == pytest.approx((0.004 + 0.002 + 0.002) / 0.6)
    assert s["gpu_idle_fraction"] == pytest.approx((0.01 + 0.004 + 0.004) / 0.6)
    assert s["peak_memory_mb"] == 10.0 and s["test_accuracy"] == 0.9


def test_summarize_reads_records_from_before_the_warm_up_and_an_empty_epoch():
    old = [_record(1.0, None, 100.0, 0.5), _record(3.0, None, 200.0, 0.1)]
    for r in old:
        del r["warmup_seconds"]                      # a checkpoint written before warmup_seconds existed
    s = summarize(old)
    assert s["train_seconds"] == 4.0 and s["warmup_seconds"] == 0.0
    assert s["images_per_second"] == pytest.approx(175.0) and s["data_wait_fraction"] == pytest.approx(0.2)
    assert s["gpu_idle_fraction"] is None
    # An epoch of no time (nothing left to train after a resume) has a NaN rate: it weighs nothing.
    s = summarize([_record(2.0, 0.0, 100.0, 0.25), _record(0.0, 0.0, math.nan, 0.0)])
    assert s["images_per_second"] == pytest.approx(100.0) and s["data_wait_fraction"] == pytest.approx(0.25)
    assert summarize([])["images_per_second"] is None


def test_run_result_and_report_run_are_the_examples_shared_tail(tmp_path, capsys):
    history = [{"seconds": 2.0, "warmup_seconds": 0.5, "images_per_second": 100.0, "data_wait_fraction": 0.25,
                "gpu_idle_fraction": None, "peak_memory_mb": 5.0, "train_loss": 0.5, "eval_accuracy": 0.75}]
    loader = SimpleNamespace(name="memory")
    config = {"lr": 0.1, "seed": 0, "workers": None, "augment": Augmentation.digits_train(),
              "dtype": torch.bfloat16, "sizes": (1, 2)}
    result = run_result(history, train_loader=loader, backend="auto", device="cpu", amp="auto", wall_seconds=3.0,
                        dataset="synthetic", epochs=1, config=config)
    assert list(result)[:8] == ["backend", "backend_requested", "device", "world_size", "dataset", "epochs",
                                "config", "amp"]
    # The configuration as plain JSON types: a recipe as its fields, enums as their values.
    augment = result["config"].pop("augment")
    assert result["config"] == {"lr": 0.1, "seed": 0, "workers": None, "dtype": "torch.bfloat16", "sizes": [1, 2]}
    assert (augment["crop"], augment["pad"], augment["padding"], augment["scale"]) == \
        ("translate", 2, "constant", [0.08, 1.0])
    assert type(augment["crop"]) is str and json.loads(json.dumps(augment)) == augment
    result["config"]["augment"] = augment
    assert "config" not in run_result(history, train_loader=loader, backend="auto", device="cpu", amp="auto",
                                      wall_seconds=3.0)
    assert (result["backend"], result["backend_requested"], result["device"]) == ("memory", "auto", "cpu")
    assert result["amp"] == "off" and result["test_accuracy"] == 0.75 and result["history"] == history
    assert (result["train_seconds"], result["warmup_seconds"]) == (2.0, 0.5)   # the warm-up, in its own figure
    out = tmp_path / "new" / "r.json"
    report_run(result, accuracy_name="synthetic test accuracy", json_out=out)
    assert capsys.readouterr().out.strip() == "synthetic test accuracy 75.00% | 2.0 s training, backend memory"
    assert json.loads(out.read_text()) == result
    report_run({**result, "test_accuracy": None}, accuracy_name="validation accuracy")
    assert "validation accuracy: none" in capsys.readouterr().out


def test_the_engine_imports_nothing_of_the_report():
    """Issue 24: the examples' tail lives here, above the engine (run_result asks it how amp resolved); an
    engine importing this module back would put the training loop under the report machinery again."""
    import ast
    from pathlib import Path

    import fastdata.engine

    # The engine is a package: every one of its modules (fit's loop, the step, the state, ...).
    files = sorted(Path(fastdata.engine.__file__).parent.glob("*.py"))
    assert len(files) > 1, files
    imported = set()
    for tree in (ast.parse(f.read_text()) for f in files):
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not {"report", "fastdata.report"} & imported, imported
    assert not any(hasattr(fastdata.engine, name) for name in ("run_result", "report_run", "summarize", "jsonable"))
