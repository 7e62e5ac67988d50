"""StepProfiler: a trace file torch's/TensorBoard's reader opens, and a per-step table of data wait, copy,
forward/backward and optimizer that adds up to the step."""
from __future__ import annotations

import json
import time

import pytest
import torch

from fastdata.models import SmallCNN
from fastdata.profiling import REGIONS, StepProfiler, format_table


def _train(prof: StepProfiler, steps: int, device="cpu", *, sleep: float = 0.0, h2d: bool = True,
           copy_in_wait: bool = False):
    """A small model's loop with every region, as fit wires it; ``sleep`` makes the data wait measurable;
    ``copy_in_wait`` copies to the device inside data_wait, as a fastdata loader's __next__ does."""
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))) for _ in range(steps)]
    it = iter(batches)
    while True:
        with prof.region("data_wait"):
            batch = next(it, None)
            time.sleep(sleep)
            if batch is not None and copy_in_wait:
                batch = tuple(t.to(device) for t in batch)
        if batch is None:
            break
        images, labels = batch
        if h2d:
            with prof.region("h2d"):
                images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        else:
            images, labels = images.to(device), labels.to(device)
        with prof.region("forward_backward"):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with prof.region("optimizer"):
            opt.step()
        prof.step()


def _trace_events(path) -> list[dict]:
    with open(path) as f:
        trace = json.load(f)   # what TensorBoard's profiler plugin and Perfetto load
    return trace["traceEvents"]


def test_a_few_steps_give_a_trace_and_a_table_that_adds_up(tmp_path, capsys):
    with StepProfiler(tmp_path / "prof", wait=1, warmup=1, active=3, device="cpu") as prof:
        _train(prof, steps=8, sleep=0.01)
    assert len(prof.trace_files) == 1 and prof.trace_files[0].name.endswith(".pt.trace.json")
    assert prof.trace_files[0].parent == tmp_path / "prof"
    names = {e.get("name") for e in _trace_events(prof.trace_files[0])}
    # The labelled regions and the profiled steps are in the trace, next to the model's ops.
    assert set(REGIONS) <= names
    assert {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"} <= names
    assert "aten::convolution" in names

    assert [r["step"] for r in prof.rows] == [2, 3, 4]          # after wait=1 and warmup=1
    for row in prof.rows:
        parts = [row[f"{n}_ms"] for n in (*REGIONS, "other")]
        assert all(p >= 0 for p in parts), row
        assert sum(parts) == pytest.approx(row["step_ms"], rel=1e-6, abs=1e-6)
        assert sum(row[f"{n}_share"] for n in (*REGIONS, "other")) == pytest.approx(1.0, abs=1e-6)
        assert row["data_wait_ms"] >= 10.0                       # the sleep is data wait
        assert row["forward_backward_ms"] > 0 and row["optimizer_ms"] > 0
        assert row["other_ms"] < 0.5 * row["step_ms"]            # the regions cover most of the step

    out = capsys.readouterr().out
    assert "data_wait" in out and "forward_backward" in out and "mean" in out
    assert str(prof.trace_files[0]) in out


def test_the_table_says_which_side_holds_the_step_back(tmp_path):
    with StepProfiler(tmp_path, wait=0, warmup=1, active=2, device="cpu", print_table=False) as prof:
        _train(prof, steps=4, sleep=0.3)   # a loader far slower than the small model
    assert all(r["data_wait_share"] > 0.5 for r in prof.rows)
    assert "the data (loading + copy) takes most of the step" in prof.table()


def test_a_run_that_ends_inside_the_active_steps_still_gets_its_trace(tmp_path):
    with StepProfiler(tmp_path, wait=0, warmup=1, active=10, device="cpu", print_table=False) as prof:
        _train(prof, steps=4)
    assert len(prof.trace_files) == 1
    assert [r["step"] for r in prof.rows] == [1, 2, 3]


def test_a_run_shorter_than_the_schedule_warms_and_writes_nothing(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"took 2 step\(s\), fewer than wait \+ warmup \+ 1 = 4: no trace"):
        with StepProfiler(tmp_path, wait=1, warmup=2, active=2, device="cpu") as prof:
            _train(prof, steps=2)
    assert prof.rows == [] and not list(tmp_path.glob("*.pt.trace.json"))


@pytest.mark.parametrize("kwargs, match", [
    ({"wait": -1}, "wait must be an int >= 0"),
    ({"warmup": 1.5}, "warmup must be an int >= 0"),
    ({"active": 0}, "active must be an int >= 1"),
    ({"active": True}, "active must be an int >= 1"),
    ({"device": "gpu7"}, "device must be a torch.device"),
])
def test_bad_arguments_are_refused_naming_them(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepProfiler(tmp_path, **{"device": "cpu", **kwargs})


@pytest.mark.filterwarnings("ignore:StepProfiler. the run took 0 step")
def test_misuse_is_refused_naming_the_problem(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="out_dir .* is a file"):
        StepProfiler(tmp_path / "f", device="cpu")
    prof = StepProfiler(tmp_path, device="cpu")
    with pytest.raises(RuntimeError, match="outside the profiler"):
        prof.step()
    with prof:
        with pytest.raises(ValueError, match=r"unknown region 'forward'; choose from \['data_wait', 'h2d'"):
            with prof.region("forward"):
                pass
        with pytest.raises(RuntimeError, match="inside region 'data_wait': regions do not nest"):
            with prof.region("data_wait"):
                with prof.region("h2d"):
                    pass


def test_copies_inside_data_wait_are_read_from_the_trace_as_h2d():
    """On CUDA a loader copies inside its __next__: the trace's Memcpy HtoD under data_wait becomes h2d."""
    from torch.autograd.profiler_util import FunctionEvent

    from fastdata import profiling

    step = FunctionEvent(0, "ProfilerStep#4", thread=0, start_us=1000, end_us=5000)
    other_step = FunctionEvent(1, "ProfilerStep#5", thread=0, start_us=5000, end_us=9000)
    wait = FunctionEvent(2, "data_wait", thread=0, start_us=1010, end_us=2000)
    copy = FunctionEvent(3, "aten::copy_", thread=0, start_us=1500, end_us=1600)
    copy.append_kernel("Memcpy HtoD (Pinned -> Device)", 0, 250.0)
    copy.append_kernel("elementwise_kernel", 0, 40.0)     # the normalize: not a copy
    wait.append_cpu_child(copy)
    forward = FunctionEvent(4, "forward_backward", thread=0, start_us=5100, end_us=6000)
    forward.append_kernel("Memcpy HtoD (Pageable -> Device)", 0, 99.0)   # not inside data_wait
    assert profiling._htod_ms_per_step([step, other_step, wait, copy, forward]) == {4: 0.25}


def test_format_table_of_nothing_says_so():
    assert format_table([]) == "profile: no step was recorded"


@pytest.mark.cuda
def test_cuda_kernels_are_in_the_trace_and_the_parts_are_gpu_time(tmp_path):
    with StepProfiler(tmp_path, wait=1, warmup=1, active=3, device="cuda", print_table=False) as prof:
        _train(prof, steps=6, device="cuda", h2d=False)   # copies in plain code, outside any region
    events = _trace_events(prof.trace_files[0])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the trace"
    assert any(e.get("cat") == "gpu_memcpy" for e in events)
    assert "GPU stream time (CUDA events)" in prof.table()
    for row in prof.rows:
        parts = [row[f"{n}_ms"] for n in (*REGIONS, "other")]
        assert all(p >= 0 for p in parts)
        assert sum(parts) == pytest.approx(row["step_ms"], rel=1e-3, abs=1e-3)
        assert row["forward_backward_ms"] > 0


@pytest.mark.cuda
def test_a_loaders_copies_inside_data_wait_are_h2d_on_a_gpu(tmp_path):
    with StepProfiler(tmp_path, wait=1, warmup=1, active=3, device="cuda", print_table=False) as prof:
        _train(prof, steps=6, device="cuda", h2d=False, copy_in_wait=True)
    assert len(prof.rows) == 3
    for row in prof.rows:
        assert row["h2d_ms"] > 0, row     # read from the trace's Memcpy HtoD events under data_wait
        assert sum(row[f"{n}_ms"] for n in (*REGIONS, "other")) == pytest.approx(row["step_ms"], rel=1e-3)
