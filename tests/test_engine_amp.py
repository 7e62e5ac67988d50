"""Tests of the precision and speed switches (fastdata/engine/amp.py): AMP modes, torch.compile, cuDNN/TF32 for
the run only."""
import math

import pytest
import torch
from torch import nn

from engine_helpers import ListLoader, _batches, _plain_net
from fastdata import Augmentation, make_loader
from fastdata.datasets import ArraySource, SyntheticDigits
from fastdata.engine import (
    EpochMeter,
    TrainStep,
    choose_amp,
    cuda_switches,
    evaluate,
    fit,
    resolve_amp,
    train_one_epoch,
)
from fastdata.models import SmallCNN
from fastdata.report import run_result


@pytest.mark.parametrize("amp, device, bf16, expected", [
    ("auto", "cpu", False, "off"),
    ("auto", "cpu", True, "off"),        # bf16 autocast is slower than fp32 on CPUs without AMX
    ("auto", "cuda", True, "bf16"),
    ("auto", "cuda", False, "fp16"),     # pre-Ampere GPUs: fp16 with loss scaling
    ("bf16", "cuda", False, "bf16"),     # forced choices are honoured
    ("fp16", "cuda", True, "fp16"),
    ("off", "cuda", True, "off"),
    ("bf16", "cpu", False, "bf16"),
])
def test_choose_amp(amp, device, bf16, expected):
    assert choose_amp(amp, device, bf16) == expected


def test_invalid_amp_lists_choices():
    with pytest.raises(ValueError, match=r"unknown amp 'fp8'; choose from \['auto', 'bf16', 'fp16', 'off'\]"):
        choose_amp("fp8", "cuda", True)
    assert resolve_amp("auto", torch.device("cpu")) == "off"


def test_fp16_on_the_cpu_is_honoured_with_a_warning_and_nothing_else_warns(monkeypatch):
    """fp16 autocast on the CPU measured ~50x slower than fp32: a run that silently crawls looks hung."""
    import warnings

    import fastdata.engine.amp as engine

    monkeypatch.setattr(engine, "_WARNED_FP16_ON_CPU", False)
    with pytest.warns(RuntimeWarning, match="amp='fp16' on the CPU.*50x slower"):
        assert resolve_amp("fp16", torch.device("cpu")) == "fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for amp in ("auto", "off", "bf16"):
            resolve_amp(amp, torch.device("cpu"))


def test_fit_warns_about_fp16_on_the_cpu_once_at_its_callers_line(monkeypatch):
    """It warned three times (fit, its evaluation, run_result after the run), at fastdata's own lines."""
    import warnings

    import fastdata.engine.amp as engine

    monkeypatch.setattr(engine, "_WARNED_FP16_ON_CPU", False)
    loader = ListLoader(_batches(1, size=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(SmallCNN(width=4), loader, eval_loader=loader, epochs=1, amp="fp16", progress=False)
        run_result(history, train_loader=loader, backend="list", device=torch.device("cpu"), amp="fp16",
                   wall_seconds=1.0, dataset="x", epochs=1, batch_size=4)
    fp16 = [w for w in caught if "amp='fp16' on the CPU" in str(w.message)]
    assert len(fp16) == 1 and fp16[0].filename == __file__, [(w.filename, w.lineno) for w in fp16]
    monkeypatch.setattr(engine, "_WARNED_FP16_ON_CPU", False)
    with warnings.catch_warnings(record=True) as caught:   # evaluate alone (torch.no_grad wraps it)
        warnings.simplefilter("always")
        evaluate(SmallCNN(width=4), loader, amp="fp16")
    fp16 = [w for w in caught if "amp='fp16' on the CPU" in str(w.message)]
    assert len(fp16) == 1 and fp16[0].filename == __file__, [(w.filename, w.lineno) for w in fp16]


class AutocastProbe(nn.Module):
    """Records whether autocast was on, and with which dtype, when forward ran."""

    def __init__(self):
        super().__init__()
        self.net = SmallCNN(width=4)
        self.seen = set()

    def forward(self, x):
        on = torch.is_autocast_enabled("cpu")
        self.seen.add((on, torch.get_autocast_dtype("cpu") if on else None))
        return self.net(x).float()


@pytest.mark.parametrize("amp, expected", [("auto", (False, None)), ("off", (False, None)),
                                           ("bf16", (True, torch.bfloat16)), ("fp16", (True, torch.float16))])
def test_fit_applies_the_amp_choice(amp, expected):
    src = SyntheticDigits(128, train=True, seed=2)
    model = AutocastProbe()
    hist = fit(model, make_loader(src, "torch", batch_size=64, num_workers=0, device="cpu"), epochs=1,
               amp=amp, progress=False)
    assert model.seen == {expected}
    assert math.isfinite(hist[0]["train_loss"])


def test_resolve_amp_asks_the_loaders_gpu_not_the_current_one(monkeypatch):
    """is_bf16_supported() looks at the current device; resolve_amp must make the loader's GPU current."""
    current = [0]

    class FakeDeviceScope:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "device", FakeDeviceScope)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: current[0] == 1)
    assert resolve_amp("auto", torch.device("cuda", 1)) == "bf16"   # only GPU 1 has bf16 here
    assert resolve_amp("auto", torch.device("cuda", 0)) == "fp16"
    assert current == [0]


def _read(owner, name):
    try:
        return getattr(owner, name)
    except RuntimeError:   # torch's legacy TF32 getters raise when the two APIs disagree
        return "raises"


# torch 2.9+: the fp32_precision strings beside the legacy booleans (the declared floor, 2.4, has none)
HAS_FP32_PRECISION = hasattr(torch.backends.cudnn, "rnn") and hasattr(torch.backends.cudnn.rnn, "fp32_precision")


def _tf32_state():
    """cudnn.benchmark, the legacy TF32 booleans and (torch 2.9+) the fp32_precision strings."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    strings = (cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision, matmul.fp32_precision) \
        if HAS_FP32_PRECISION else ()
    return (cudnn.benchmark, _read(cudnn, "allow_tf32"), _read(matmul, "allow_tf32"), *strings)


TF32_ON = (True, True, True, "tf32", "tf32", "tf32")


@pytest.fixture
def switches_restored():
    """The process-wide switches as they were before the test, put back after it whatever happens."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    benchmark = cudnn.benchmark
    strings = [(o, "fp32_precision", o.fp32_precision) for o in (cudnn.conv, cudnn.rnn, matmul, cudnn)] \
        if HAS_FP32_PRECISION else []
    yield
    cudnn.benchmark = benchmark
    cudnn.allow_tf32, matmul.allow_tf32 = True, False     # torch's defaults, then the exact strings
    for owner, name, value in strings:
        setattr(owner, name, value)


def test_cuda_switches_are_on_for_the_block_only(switches_restored):
    """The flags are process-wide: fit turns them on for its run and gives the caller's values back.
    (Setting them needs no GPU, so this runs anywhere.)"""
    torch.backends.cudnn.benchmark = False
    before = _tf32_state()
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=True, tf32=True):
        inside = _tf32_state()
    assert inside == TF32_ON[:len(inside)]
    assert _tf32_state() == before


@pytest.mark.parametrize("callers_way", ["legacy", pytest.param("new", marks=pytest.mark.skipif(
    not HAS_FP32_PRECISION, reason="torch < 2.9 has no fp32_precision API"))])
def test_tf32_reads_back_through_both_apis_inside_and_the_callers_flags_return(switches_restored, callers_way):
    """torch raises on a legacy TF32 read when the legacy and fp32_precision settings disagree, and
    torch.compile reads both: inside the block both must read back, whichever API the caller used."""
    if callers_way == "legacy":
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    before = _tf32_state()
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=False, tf32=True):
        inside = _tf32_state()
    assert inside[1:] == TF32_ON[1:len(inside)]
    assert _tf32_state() == before


def test_cuda_switches_told_not_to_touch_leave_the_callers_values(switches_restored):
    torch.backends.cudnn.benchmark = True                   # the caller's own choice
    before = _tf32_state()
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=False, tf32=False):
        assert _tf32_state() == before
    torch.backends.cudnn.benchmark = False
    with cuda_switches(torch.device("cuda", 0), cudnn_benchmark=False, tf32=True):
        assert torch.backends.cudnn.benchmark is False      # not switched on when told not to
    with cuda_switches(torch.device("cpu"), cudnn_benchmark=True, tf32=True):
        assert torch.backends.cudnn.benchmark is False      # the CPU touches nothing
    assert _tf32_state()[0] is False


class SwitchProbe(nn.Module):
    """Records the process-wide switches each time forward runs."""

    def __init__(self):
        super().__init__()
        self.net = SmallCNN(width=4)
        self.seen = set()

    def forward(self, x):
        self.seen.add(_tf32_state())
        return self.net(x)


def test_fit_on_the_cpu_leaves_the_process_wide_switches_alone(switches_restored):
    torch.backends.cudnn.benchmark = False
    before = _tf32_state()
    model = SwitchProbe()
    fit(model, ListLoader(_batches(2)), epochs=1, progress=False)
    assert model.seen == {before} and _tf32_state() == before


@pytest.mark.cuda
def test_fit_on_cuda_switches_cudnn_benchmark_and_tf32_for_the_run_only(switches_restored):
    torch.backends.cudnn.benchmark = False
    before = _tf32_state()
    model = SwitchProbe()
    fit(model, ListLoader(_batches(2, device="cuda"), device="cuda"), epochs=1, progress=False)
    (inside,) = model.seen
    assert inside == TF32_ON[:len(inside)]
    assert _tf32_state() == before
    model = SwitchProbe()
    fit(model, ListLoader(_batches(2, device="cuda"), device="cuda"), epochs=1, progress=False,
        cudnn_benchmark=False, tf32=False)
    assert model.seen == {before} and _tf32_state() == before


def _compiled_fit(device: str, compile: bool, amp: str = "off"):
    """Two epochs of 44 samples in batches of 16 (the last one 12: a second shape) with evaluation."""
    import numpy as np

    images = np.random.default_rng(0).integers(0, 256, (44, 8, 8), dtype=np.uint8)
    src = ArraySource(images, np.arange(44) % 4)
    train = make_loader(src, "memory", batch_size=16, drop_last=False, device=device, augment=Augmentation.none())
    evaluation = make_loader(src, "memory", batch_size=16, drop_last=False, device=device, train=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(1), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))
    return fit(model, train, epochs=2, eval_loader=evaluation, compile=compile, amp=amp, progress=False)


def _check_compiled_fit(monkeypatch, device: str, amp: str = "off"):
    compiled = []
    real = torch.compile

    def counting(model, *args, **kwargs):
        compiled.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    eager = _compiled_fit(device, compile=False, amp=amp)
    assert compiled == []
    history = _compiled_fit(device, compile=True, amp=amp)
    assert compiled == ["Sequential"]
    # Autocast's reduced precision lets fused kernels round differently: a loose bound there (one sample
    # of 44 may flip its prediction), a tight one in fp32.
    loss_tol, acc_tol = (2e-2, 0.05) if amp != "off" else (1e-4, 1e-6)
    for a, b in zip(history, eager, strict=True):
        for key in ("train_loss", "eval_loss"):
            assert math.isclose(a[key], b[key], rel_tol=loss_tol), (key, a, b)
        for key in ("train_accuracy", "eval_accuracy"):
            assert abs(a[key] - b[key]) <= acc_tol, (key, a, b)


def test_fit_compiles_the_model_and_trains_as_eager_does(monkeypatch):
    """compile=True runs the model through torch.compile (inductor's C++ backend on the CPU): a short
    last batch (a second shape) and evaluation under no_grad both run, and the figures are eager's."""
    _check_compiled_fit(monkeypatch, "cpu")


@pytest.mark.cuda
def test_fit_compiles_the_model_on_a_gpu(monkeypatch):
    _check_compiled_fit(monkeypatch, "cuda", amp="auto")   # bf16 where the GPU has it, else fp16


def test_compile_reduce_overhead_on_the_cpu_falls_back_to_compile_with_one_warning(monkeypatch):
    modes = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: modes.append(mode) or model)
    loader = ListLoader(_batches(2, size=4))
    with pytest.warns(RuntimeWarning, match=r"compile='reduce-overhead' \(CUDA graphs\) needs a CUDA device; on "
                                            r"cpu fit compiles with compile=True instead") as caught:
        fit(_plain_net(), loader, epochs=1, compile="reduce-overhead", progress=False)
    assert modes == [None] and len([w for w in caught if "reduce-overhead" in str(w.message)]) == 1
    fit(_plain_net(), loader, epochs=1, compile=True, progress=False)
    assert modes == [None, None]


def test_under_cuda_graphs_only_batches_of_the_first_size_run_the_compiled_module():
    """A CUDA graph is recorded per shape: the last short batch, an empty one and evaluation go eager,
    so none records a graph used once (checked here with the graphs flag set by hand on the CPU)."""
    class Seen(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.sizes = inner, []

        def forward(self, x):
            self.sizes.append(x.shape[0])
            return self.inner(x)

    model = _plain_net()
    compiled = Seen(model)
    step = TrainStep(compiled, model, torch.optim.SGD(model.parameters(), lr=0.1),
                     torch.amp.GradScaler("cpu", enabled=False), None, nn.CrossEntropyLoss(), torch.device("cpu"),
                     "off", ddp=False)
    step.graphs, step.eager = True, model
    batches = _batches(3, size=8) + [(b[0][:5], b[1][:5]) for b in _batches(1, size=8, seed=3)]
    meter = EpochMeter(torch.device("cpu"))
    train_one_epoch(step, ListLoader(batches), meter)
    assert compiled.sizes == [8, 8, 8] and meter.sums[2].item() == 29
    assert step.eval_net is model


@pytest.mark.cuda
def test_compile_reduce_overhead_on_a_gpu_trains_with_a_short_last_batch_and_evaluates():
    eager = _compiled_fit("cuda", compile=False)
    graphs = _compiled_fit("cuda", compile="reduce-overhead")
    for a, b in zip(graphs, eager, strict=True):
        assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=1e-2)
        assert math.isfinite(a["eval_loss"])
