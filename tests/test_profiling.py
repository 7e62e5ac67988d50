"""StepProfiler: a trace file torch's/TensorBoard's reader opens, and a per-step table of data wait, copy,
forward/backward and optimizer that adds up to the step."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch

from fastdata import profiling
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


def _regions_in_step(events: list[dict], step: int) -> list[str]:
    """The labelled regions inside the host-side range of ``ProfilerStep#<step>``, in time order."""
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op")]
    (span,) = [e for e in host if e["name"] == f"ProfilerStep#{step}"]
    inside = [e for e in host if e["name"] in REGIONS and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
    return [e["name"] for e in sorted(inside, key=lambda e: e["ts"])]


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
    # Each recorded step's range in the trace holds each region once, in the loop's order.
    for step in (2, 3, 4):
        assert _regions_in_step(_trace_events(prof.trace_files[0]), step) == list(REGIONS), step

    out = capsys.readouterr().out
    assert "data_wait" in out and "forward_backward" in out and "mean" in out
    assert str(prof.trace_files[0]) in out


def _row(step, **ms):
    parts = {n: ms.get(n, 0.0) for n in (*REGIONS, "other")}
    total = sum(parts.values())
    return {"step": step, "step_ms": total, **{f"{n}_ms": v for n, v in parts.items()},
            **{f"{n}_share": v / total for n, v in parts.items()}}


def test_the_table_says_which_side_holds_the_step_back():
    # Which side is slower on this machine is a timing; the verdict from a given table is not.
    data_bound = [_row(2, data_wait=30.0, h2d=5.0, forward_backward=20.0, optimizer=4.0, other=1.0),
                  _row(3, data_wait=28.0, h2d=5.0, forward_backward=21.0, optimizer=4.0, other=1.0)]
    text = format_table(data_bound, device="cuda")
    assert "the data (loading + copy) takes most of the step: data 57%, model 41%" in text
    assert "GPU stream time (CUDA events)" in text and text.count("\n") == len(data_bound) + 3
    model_bound = [_row(2, data_wait=1.0, forward_backward=20.0, optimizer=4.0)]
    assert "the model (forward/backward + optimizer) takes most of the step" in format_table(model_bound)


def test_a_slow_loader_is_data_wait_in_the_table(tmp_path):
    with StepProfiler(tmp_path, wait=0, warmup=1, active=2, device="cpu", print_table=False) as prof:
        _train(prof, steps=4, sleep=0.05)   # each next(batch) sleeps 50 ms: at least that much is data wait
    assert [r["step"] for r in prof.rows] == [1, 2]
    assert all(r["data_wait_ms"] >= 50.0 for r in prof.rows)


def test_a_run_that_ends_inside_the_active_steps_still_gets_its_trace(tmp_path):
    with StepProfiler(tmp_path, wait=0, warmup=1, active=10, device="cpu", print_table=False) as prof:
        _train(prof, steps=4)
    assert len(prof.trace_files) == 1
    assert [r["step"] for r in prof.rows] == [1, 2, 3]


def test_each_rank_keeps_its_own_trace_when_ranks_share_the_folder(tmp_path, monkeypatch):
    """Under DDP every rank writes into the same folder: a file another rank writes meanwhile is not ours
    (its copies would be read into this rank's table)."""
    import torch.profiler

    real = torch.profiler.tensorboard_trace_handler

    def with_another_rank_writing(out_dir, **kwargs):
        handler = real(out_dir, **kwargs)

        def write(prof):
            (tmp_path / "otherhost_999.1795762231062908424.pt.trace.json").write_text('{"traceEvents": []}')
            handler(prof)
        return write

    monkeypatch.setattr(torch.profiler, "tensorboard_trace_handler", with_another_rank_writing)
    with StepProfiler(tmp_path, wait=0, warmup=1, active=1, device="cpu", print_table=False) as prof:
        _train(prof, steps=3)
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 2
    (ours,) = prof.trace_files
    assert ours.name.startswith(f"{socket.gethostname()}_{os.getpid()}.")


def test_a_run_shorter_than_the_schedule_warms_and_writes_nothing(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"took 2 step\(s\), fewer than wait \+ warmup \+ 1 = 4: no trace"):
        with StepProfiler(tmp_path, wait=1, warmup=2, active=2, device="cpu") as prof:
            _train(prof, steps=2)
    assert prof.rows == [] and not list(tmp_path.glob("*.pt.trace.json"))


@pytest.mark.parametrize("kwargs, match", [
    ({"wait": -1}, r"StepProfiler: wait \(steps\) must be an integer >= 0, got -1"),
    ({"warmup": 1.5}, r"StepProfiler: warmup \(steps\) must be an integer >= 0, got 1.5"),
    ({"active": 0}, r"StepProfiler: active \(steps\) must be an integer >= 1, got 0"),
    ({"active": True}, r"StepProfiler: active \(steps\) must be an integer >= 1, got True"),
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
        with pytest.raises(ValueError,
                           match=r"unknown StepProfiler region 'forward'; choose from \['data_wait', 'h2d'"):
            with prof.region("forward"):
                pass
        with pytest.raises(RuntimeError, match="inside region 'data_wait': regions do not nest"):
            with prof.region("data_wait"):
                with prof.region("h2d"):
                    pass


HOST, THREAD, WORKER = 4242, 4242, 4343   # the training process and thread, and another thread of it


def _op(cat, name, ts, dur, tid=THREAD, **args):
    """A host-side event as kineto's chrome trace writes it (ts and dur in microseconds)."""
    return {"ph": "X", "cat": cat, "name": name, "pid": HOST, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launch(name, ts, correlation, external, tid=THREAD):
    """A runtime call and its ``ac2g`` flow start: the link to the device work it queued."""
    return [_op("cuda_runtime", name, ts, 20.0, tid, cbid=41, correlation=correlation, **{"External id": external}),
            {"ph": "s", "id": correlation, "pid": HOST, "tid": tid, "ts": ts, "cat": "ac2g", "name": "ac2g"}]


def _on_gpu(cat, name, ts, dur, correlation=None, **args):
    """A device-side event (pid = the device, tid = the stream), on the device clock."""
    if correlation is not None:
        args = {"device": 0, "context": 1, "stream": 7, "correlation": correlation, **args}
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur, "args": args}


def _two_steps_of_a_cuda_trace() -> list[dict]:
    """Two profiled steps as kineto writes them on CUDA: host ranges, runtime calls, the GPU copies they
    queued (linked only by ``args.correlation``, never nested under a host range), and the GPU-side copies
    of the step and region ranges (``gpu_user_annotation``), which lag the host and overlap its next step."""
    return [
        _op("user_annotation", "ProfilerStep#4", 1000.0, 4000.0, **{"External id": 1}),
        _op("user_annotation", "data_wait", 1010.0, 990.0, **{"External id": 2}),
        _op("cpu_op", "aten::to", 1400.0, 300.0, **{"External id": 10}),
        _op("cpu_op", "aten::copy_", 1450.0, 200.0, **{"External id": 11}),
        *_launch("cudaMemcpyAsync", 1500.0, 101, 11),            # the loader's copy ...
        _on_gpu("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 1530.0, 250.0, 101, bytes=25088),
        *_launch("cudaLaunchKernel", 1800.0, 102, 12),           # ... its normalize: a kernel, not a copy
        _on_gpu("kernel", "elementwise_kernel", 1790.0, 40.0, 102),
        *_launch("cudaMemcpyAsync", 1900.0, 103, 13),            # a copy back to the host: not h2d
        _on_gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 1930.0, 30.0, 103, bytes=4),
        _op("user_annotation", "forward_backward", 2100.0, 1900.0, **{"External id": 20}),
        *_launch("cudaMemcpyAsync", 2200.0, 104, 21),            # a copy outside data_wait
        _on_gpu("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 2230.0, 99.0, 104, bytes=64),
        _on_gpu("gpu_user_annotation", "ProfilerStep#4", 1529.0, 4073.0, **{"External id": 1}),
        _on_gpu("gpu_user_annotation", "data_wait", 1529.0, 433.0, **{"External id": 2}),
        _op("user_annotation", "ProfilerStep#5", 5000.0, 4000.0, **{"External id": 30}),
        _op("user_annotation", "data_wait", 5010.0, 990.0, **{"External id": 31}),
        _op("cpu_op", "aten::copy_", 5050.0, 120.0, **{"External id": 32}),
        *_launch("cudaMemcpyAsync", 5100.0, 201, 32),            # pinned, runs after the host step ended
        _on_gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 9500.0, 100.0, 201, bytes=25088),
        *_launch("cudaMemcpyAsync", 5200.0, 202, 40, tid=WORKER),   # another thread, during the wait
        _on_gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5300.0, 40.0, 202, bytes=512),
        _on_gpu("gpu_user_annotation", "ProfilerStep#5", 5601.0, 4100.0, **{"External id": 30}),
        {"ph": "f", "id": 101, "pid": 0, "tid": 7, "ts": 1530.0, "cat": "ac2g", "name": "ac2g", "bp": "e"},
    ]


def test_copies_launched_inside_data_wait_are_read_from_the_trace_as_h2d():
    """On CUDA a loader copies inside its __next__: the trace's Memcpy HtoD whose launch the training thread
    made inside data_wait becomes that step's h2d, matched by correlation id and by the host-side ranges."""
    # 250 us in step 4; step 5's pinned copy ran on the GPU after its host step ended: it still belongs
    # to the step that launched it. Not counted: the normalize kernel, the DtoH copy, the copy launched in
    # forward_backward, and the one another thread launched while the training thread waited.
    assert profiling._htod_ms_per_step(_two_steps_of_a_cuda_trace()) == {4: 0.25, 5: 0.1}


def test_the_trace_file_is_read_as_kineto_writes_it(tmp_path):
    events = _two_steps_of_a_cuda_trace()
    path = tmp_path / "host_1.123.pt.trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "baseTimeNanoseconds": 1790857026000000000,
                                "traceEvents": events, "traceName": str(path)}))
    assert profiling._read_trace(path) == events


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
    events = _trace_events(prof.trace_files[0])
    copies = profiling._htod_ms_per_step(events)
    found = [(e.get("cat"), e.get("name"), e.get("pid"), e.get("tid"), e.get("args", {}).get("correlation"))
             for e in events if e.get("cat") in ("gpu_memcpy", "cuda_runtime") and "emcpy" in e.get("name", "")]
    assert sorted(copies) == [r["step"] for r in prof.rows], found   # every step's copies, launch by launch
    for row in prof.rows:
        assert row["h2d_ms"] > 0, row     # read from the trace's Memcpy HtoD events under data_wait
        assert sum(row[f"{n}_ms"] for n in (*REGIONS, "other")) == pytest.approx(row["step_ms"], rel=1e-3)
