"""``python -m fastdata bench``: the overlap model, the recommendation, and the prediction against ``fit``."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import require
from engine_helpers import Clock
from fastdata import fit, make_loader
from fastdata.bench import measure_loader, measure_step, predict
from fastdata.datasets import SyntheticDigits

ROOT = Path(__file__).resolve().parents[1]


def test_serial_work_adds_and_overlapped_work_hides_behind_the_step():
    # load 1 ms/image, step 3 ms/image
    wait, rate = predict(1000.0, 1000.0 / 3, overlapped=False)
    assert wait == pytest.approx(0.25) and rate == pytest.approx(250.0)
    wait, rate = predict(1000.0, 1000.0 / 3, overlapped=True)
    assert wait == 0.0 and rate == pytest.approx(1000.0 / 3)
    # a loader slower than the step: the model waits for the difference
    wait, rate = predict(100.0, 200.0, overlapped=True)
    assert wait == pytest.approx(0.5) and rate == pytest.approx(100.0)


def test_quick_run_on_digits_recommends_from_its_measurements_and_writes_the_reports(tmp_path):
    """Which backend wins is a timing (memory, usually: it decodes nothing per epoch, but a loaded CI
    machine can tie or reverse it); the recommendation must be the one its own rows give."""
    from fastdata.bench import Measurement, recommend

    proc = subprocess.run([sys.executable, "-m", "fastdata", "bench", "digits", "--quick", "--device", "cpu",
                           "--backends", "memory", "torch", "--workers", "1", "--batch-size", "128",
                           "--out", str(tmp_path), "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (report,) = tmp_path.glob("bench-*.json")
    payload = json.loads(report.read_text())
    rows = {r["backend"]: r for r in payload["rows"]}
    assert set(rows) == {"memory", "torch"}
    for r in rows.values():
        assert r["status"] == "ok" and r["images_per_second"] > 0 and 0 <= r["predicted_wait"] < 1
    measured = [Measurement(b, predicted_images_per_second=r["predicted_images_per_second"]) for b, r in rows.items()]
    assert payload["recommended"] == recommend(measured).backend
    assert f'Use `backend="{payload["recommended"]}"`' in proc.stdout
    assert payload["model_images_per_second"] > 0
    assert (tmp_path / report.name.replace(".json", ".md")).read_text().count("| memory") == 1


def test_an_unknown_source_or_model_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fastdata", "bench", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and "neither 'digits' nor a folder" in proc.stderr
    from fastdata.bench import make_model

    with pytest.raises(SystemExit, match="unknown model 'resnet9000'; choose from .*resnet18"):
        make_model("resnet9000", SyntheticDigits(10))


class Tiny(nn.Module):
    """Cheap enough that loading a digit batch costs a visible share of a step on the CPU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


class SlowDigits(torch.utils.data.Dataset):
    """Digits read in the calling thread at a fixed host cost per sample, charged to ``clock``."""

    def __init__(self, clock, n=640, seconds=0.0005):
        self.clock, self.n, self.seconds = clock, n, seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.clock.charge(self.seconds)
        return torch.full((1, 28, 28), i % 256, dtype=torch.uint8), i % 10


class SlowTiny(Tiny):
    """A step of fixed cost charged to ``clock`` in forward, about as long as reading a batch of SlowDigits."""

    def __init__(self, clock, seconds=0.02):
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def forward(self, x):
        self.clock.charge(self.seconds)
        return super().forward(x)


def test_the_serial_prediction_matches_the_data_wait_fit_measures_on_the_cpu(monkeypatch):
    """The prediction comes from two measurements taken apart (the loader alone, the model alone); fit
    measures the same work interleaved. The loader reads in the training thread (num_workers=0): the
    serial case. The costs (0.5 ms a sample, 20 ms a step) are charged to a clock that nothing else
    moves, so the check is of the cost model and of what fit counts as waiting, not of this machine's
    speed. The serial answer is 16/36 = 0.444 (an overlapped one would be 0)."""
    torch.manual_seed(0)
    clock = Clock(monkeypatch)
    loader = make_loader(SlowDigits(clock), "torch", batch_size=32, device="cpu", num_workers=0, seed=1,
                         mean=(0.5,), std=(0.25,))
    load_rate = measure_loader(loader, batches=100, warmup=2, progress=False)
    step_rate = measure_step(SlowTiny(clock), next(iter(loader)), steps=10, warmup=2, amp="off")
    assert step_rate == pytest.approx(32 / 0.02)
    predicted, _ = predict(load_rate, step_rate, overlapped=False)
    history = fit(SlowTiny(clock), loader, epochs=2, amp="off", progress=False)
    measured = history[-1]["data_wait_fraction"]
    assert measured == pytest.approx(16 / 36, abs=1e-6), history[-1]
    # Exact up to rounding: measure_loader times every batch it counts (the next test), so on this clock
    # the prediction is 16/36 too.
    assert predicted == pytest.approx(measured, abs=1e-6), (predicted, measured, load_rate, step_rate)


def test_measure_loader_times_every_batch_it_counts(monkeypatch):
    from fastdata.bench import measure_loader_spread

    clock = Clock(monkeypatch)

    class OneSecondBatches:
        name, device = "fake", torch.device("cpu")

        def __iter__(self):
            for _ in range(20):
                clock.charge(1.0)
                yield torch.zeros(4, 1, 2, 2), torch.zeros(4)

    rate, pieces = measure_loader_spread(OneSecondBatches(), batches=10, warmup=2, progress=False)
    assert rate == pytest.approx(4.0) and pieces == pytest.approx([4.0] * 5)


def test_a_near_tie_goes_to_the_backend_that_costs_the_host_least():
    from fastdata.bench import Measurement, recommend

    def row(name, rate):
        return Measurement(name, predicted_images_per_second=rate)

    assert recommend([row("torch", 1000.0), row("memory", 980.0)]).backend == "memory"   # within 5%
    assert recommend([row("torch", 1000.0), row("memory", 900.0)]).backend == "torch"    # clearly faster
    assert recommend([row("prefetch", 500.0), row("dali", 499.0), row("torch", 501.0)]).backend == "dali"


def test_the_delivery_rate_comes_with_the_spread_of_its_stretches():
    from fastdata.bench import measure_loader_spread

    class Fake:
        """20 batches of 4 per epoch; every fifth batch of the run stalls (a noisy neighbour)."""

        name, device = "fake", torch.device("cpu")

        def __init__(self):
            self.calls = 0

        def __iter__(self):
            for _ in range(20):
                self.calls += 1
                if self.calls > 3 and self.calls % 5 == 0:
                    import time

                    time.sleep(0.002 * (self.calls % 3))
                yield torch.zeros(4, 1, 2, 2), torch.zeros(4)

    rate, pieces = measure_loader_spread(Fake(), batches=30, warmup=3, progress=False, pieces=5)
    assert len(pieces) == 5 and all(p > 0 for p in pieces)
    assert min(pieces) <= rate <= max(pieces)           # the whole run's rate lies inside its stretches'


def test_bad_flags_and_an_unfit_model_are_refused_before_measuring(tmp_path, monkeypatch, capsys):
    """Each of these once measured every backend first, then failed (or measured nothing)."""
    from fastdata import bench
    from fastdata.__main__ import main

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured before refusing")

    monkeypatch.setattr(bench, "run", must_not_measure)
    (tmp_path / "afile").write_text("x")
    for argv, message in [
        (["digits", "--batches", "0"], "argument --batches: must be an integer >= 1"),
        (["digits", "--backends", "auto"], "argument --backends: 'auto' picks one of the others"),
        (["digits", "--backends", "nope"], "argument --backends: unknown backend 'nope'"),
        (["digits", "--device", "gpu"], "argument --device: 'gpu' is not a device"),
        (["digits", "--quick", "--out", str(tmp_path / "afile")], "argument --out: '"),
        (["digits", "--quick", "--out", str(tmp_path / "afile" / "sub")], "which is a file, not a folder"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["bench", *argv])
        assert info.value.code == 2 and message in capsys.readouterr().err, argv
    for argv, message in [
        (["digits", "--quick", "--model", "resnet18"], "--model resnet18 cannot take this source's 1x28x28 "
                                                       "images \\(it takes 3-channel images"),
        ([str(tmp_path)], "SOURCE '.*': image folder '.*' has no class sub-folders"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(["bench", *argv])


def test_batches_overrides_quick():
    from fastdata import bench

    parser = bench.get_args_parser()
    assert parser.parse_args(["digits", "--quick"]).batches is None   # main: 30 with --quick, else 200
    assert parser.parse_args(["digits", "--quick", "--batches", "100"]).batches == 100


def test_a_folder_with_an_undecodable_file_names_it_and_on_error_skip_measures_past_it(tmp_path):
    """ImageNet's training set holds a PNG named .JPEG: bench could not run on it at all (no --on-error),
    and the torch rows cut the worker's error to "Caught DecodeError in DataLoader worker process 0.",
    without the file."""
    from fastdata.bench import run
    from fastdata.datasets import ImageFolder, make_image_folder

    root = make_image_folder(tmp_path / "photos", classes=2, per_class=3, seed=0, size_range=((40, 50), (30, 40)))
    bad = root / "class_000" / "img_00000_png.jpg"
    bad.write_bytes((root / "class_000").joinpath(sorted(p.name for p in (root / "class_000").iterdir())[1])
                    .read_bytes()[:50])   # a truncated JPEG
    common = dict(batch_size=4, device="cpu", batches=4, warmup=0, num_workers=1, progress=False,
                  backends=["torch", "memory"])   # 4 batches: every file is read
    with pytest.raises(SystemExit) as info:
        run(ImageFolder(root), **common)
    message = str(info.value)
    assert "every backend: DecodeError: cannot decode image" in message, message   # one line for both
    assert message.count("img_00000_png.jpg") == 1 and "Caught" not in message, message
    assert "--on-error skip" in message
    payload = run(ImageFolder(root), on_error="skip", **common)
    assert {r["backend"]: r["status"] for r in payload["rows"]} == {"torch": "ok", "memory": "ok"}


def _photos(root, classes=2, per_class=3, broken=0):
    """A small image folder written here: ``per_class`` 48x40 JPEGs per class, and ``broken`` files per
    class that are .jpg only by name (random bytes)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"{i}.jpg")
        for i in range(broken):
            (folder / f"broken_{i}.jpg").write_bytes(rng.integers(0, 256, 2000, dtype=np.uint8).tobytes())
    return root


def _bench(*argv, out):
    """``python -m fastdata bench`` in this process, quick and on the CPU; returns the JSON report."""
    from fastdata.__main__ import main

    assert main(["bench", *map(str, argv), "--quick", "--batches", "2", "--device", "cpu", "--workers", "0",
                 "--out", str(out), "--no-progress"]) == 0
    (report,) = out.glob("bench-*.json")
    return json.loads(report.read_text())


@pytest.mark.parametrize("broken, flags", [(0, []), (1, ["--on-error", "skip"])])
def test_a_folder_smaller_than_the_batch_is_measured_in_one_batch_of_it_and_says_so(tmp_path, capsys, broken,
                                                                                    flags):
    """Issue 22.7: 160 photos and the default batch of 256 was "no backend could read the source". With a
    file skipped, the one batch is short: memory refused a cache of fewer files than one batch."""
    payload = _bench(_photos(tmp_path / "photos", broken=broken), "--backends", "memory", "torch", *flags,
                     out=tmp_path / "out")
    n = 6 + 2 * broken
    assert payload["batch_size"] == n
    assert {r["backend"]: r["status"] for r in payload["rows"]} == {"memory": "ok", "torch": "ok"}
    err = [line for line in capsys.readouterr().err.splitlines() if "batch size" in line]
    assert err == [f"fastdata bench: batch size {n}, not 256: the source has only {n} images, fewer than one batch"]


def test_model_takes_a_timm_name_after_torchvision_names(tmp_path):
    require("timm")
    payload = _bench(_photos(tmp_path / "photos"), "--model", "test_vit", "--backends", "memory",
                     out=tmp_path / "out")
    assert payload["model"] == "test_vit" and payload["model_images_per_second"] > 0


def test_every_file_skipped_is_one_line_and_a_nonzero_exit_not_a_traceback(tmp_path):
    """Issue 23.A5: every batch emptied by --on-error skip measured 0 images/s, and predict divided by it."""
    root = _photos(tmp_path / "broken", per_class=0, broken=3)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "fastdata", "bench", str(root), "--quick",
                           "--batches", "2", "--device", "cpu", "--workers", "0", "--on-error", "skip",
                           "--backends", "torch", "--out", str(tmp_path / "out"), "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "no backend could read the source:\n  every backend: delivered no images: every file it read was " \
           "undecodable and skipped" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("model, message", [
    # Its builder's default weights_backbone would download a ResNet-50; its call takes other arguments.
    ("fasterrcnn_resnet50_fpn", r"--model fasterrcnn_resnet50_fpn: 'fasterrcnn_resnet50_fpn' is a torchvision "
                                r"detection model, not an image classifier"),
    ("resnet9000", r"--model resnet9000: unknown model 'resnet9000'; choose from smallcnn, torchvision's "
                   r"classification models \[.*'resnet18'.*\], or timm's"),
    # timm's test_maxvit is built for 160x160: its attention fails on the recipe's 224x224 crops.
    ("test_maxvit", r"--model test_maxvit cannot take this source's 3x224x224 images: \w+Error: "),
])
def test_a_model_that_cannot_be_built_or_trained_here_is_one_line_and_downloads_nothing(tmp_path, monkeypatch,
                                                                                       model, message):
    require("timm")
    from fastdata import bench

    def no_download(*args, **kwargs):
        raise AssertionError("a download was attempted")

    import torchvision.models._api as torchvision_weights  # what torchvision's Weights.get_state_dict calls

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    monkeypatch.setattr(torchvision_weights, "load_state_dict_from_url", no_download)
    monkeypatch.setattr(bench, "run", no_download)   # refused before any measuring
    with pytest.raises(SystemExit) as info:
        _bench(_photos(tmp_path / "photos"), "--model", model, out=tmp_path / "out")
    text = str(info.value.code)
    assert "\n" not in text and re.match(r"fastdata bench: " + message, text), text


def test_a_model_whose_builder_fails_is_one_line_naming_the_call(tmp_path, monkeypatch):
    """A builder that needs other arguments raised its TypeError as a traceback."""
    import torchvision

    def builder(**kwargs):
        raise TypeError("__init__() missing 1 required positional argument: 'depth'")

    monkeypatch.setattr(torchvision.models, "list_models", lambda module=None: ["needsdepth"])
    monkeypatch.setattr(torchvision.models, "get_model_builder", lambda name: builder)
    with pytest.raises(SystemExit) as info:
        _bench(_photos(tmp_path / "photos"), "--model", "needsdepth", out=tmp_path / "out")
    assert str(info.value.code) == (
        "fastdata bench: --model needsdepth: torchvision.models.get_model_builder('needsdepth')(weights=None, "
        "num_classes=2) failed: TypeError: __init__() missing 1 required positional argument: 'depth'")


def test_a_training_step_that_fails_while_measuring_is_one_line(tmp_path, monkeypatch):
    from fastdata import bench

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(bench, "measure_step", out_of_memory)
    with pytest.raises(SystemExit) as info:
        _bench(_photos(tmp_path / "photos"), "--backends", "memory", out=tmp_path / "out")
    assert str(info.value.code) == ("fastdata bench: --model smallcnn: its training step failed on a batch of "
                                    "(6, 3, 224, 224) on cpu (amp=auto): OutOfMemoryError: CUDA out of memory. "
                                    "Tried to allocate 2.00 GiB")


def test_the_step_of_a_model_with_auxiliary_outputs_is_measured_on_its_logits(monkeypatch):
    """torchvision's googlenet returns (logits, aux_logits, aux_logits) in training: cross-entropy of the
    named tuple was a TypeError. The loss is taken of the main logits (the tensor the model returned
    as ``logits``), so the step trains the main head and leaves the auxiliary heads without gradients."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, num_classes=3, init_weights=False)
    outputs, losses = [], []
    model.register_forward_hook(lambda module, args, out: outputs.append(out))
    real = nn.CrossEntropyLoss.forward
    monkeypatch.setattr(nn.CrossEntropyLoss, "forward", lambda self, x, y: losses.append(x) or real(self, x, y))
    batch = torch.zeros(2, 3, 64, 64), torch.zeros(2, dtype=torch.long)
    assert measure_step(model, batch, steps=1, warmup=0, amp="off") > 0
    assert len(outputs) == len(losses) == 1 and losses[0] is outputs[0].logits
    assert model.fc.weight.grad is not None
    assert all(p.grad is None for p in [*model.aux1.parameters(), *model.aux2.parameters()])
