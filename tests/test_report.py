"""Result files: JSON that strict parsers read."""
import json
import math

from fastdata.report import null_for_nonfinite, write_json


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
    from fastdata.engine import write_json as write_result

    path = write_result({"final_train_loss": math.nan, "history": [{"eval_loss": math.nan}]}, tmp_path / "a" / "r.json")
    assert strict_load(path) == {"final_train_loss": None, "history": [{"eval_loss": None}]}
