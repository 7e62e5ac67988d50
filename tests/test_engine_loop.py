"""Tests of the loop (fastdata/engine/loop.py): fit, evaluate, train_one_epoch, empty batches, devices, fit's
arguments."""
import math

import pytest
import torch
from torch import nn

from engine_helpers import BACKENDS, CountingStep, Crash, ListLoader, Recording, _batches, _params
from fastdata import make_loader
from fastdata.datasets import ArraySource, SyntheticDigits
from fastdata.engine import (
    EpochMeter,
    evaluate,
    fit,
    resolve_amp,
    train_one_epoch,
)
from fastdata.models import SmallCNN

RECORD_KEYS = {"epoch", "train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "lr", "images_per_second",
               "data_wait_fraction", "gpu_idle_fraction", "peak_memory_mb", "seconds", "warmup_seconds", "images"}


@pytest.fixture(scope="module")
def digits():
    return SyntheticDigits(4096, train=True, seed=1), SyntheticDigits(512, train=False, seed=1)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_fit_learns_synthetic_digits(backend, digits):
    train, test = digits
    torch.manual_seed(0)
    loader = make_loader(train, backend, batch_size=64, num_workers=0, device="cpu")
    eval_loader = make_loader(test, backend, batch_size=256, train=False, num_workers=0, device="cpu")
    model = SmallCNN(width=16)
    history = fit(model, loader, epochs=3, eval_loader=eval_loader, progress=False,
                  optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    assert [r["epoch"] for r in history] == [1, 2, 3]
    for r in history:
        assert set(r) == RECORD_KEYS
        assert 0.0 <= r["data_wait_fraction"] <= 1.0
        assert r["gpu_idle_fraction"] is None  # CPU
        assert r["images_per_second"] > 0 and r["seconds"] > 0 and r["peak_memory_mb"] > 0
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["eval_accuracy"] > 0.5, history  # chance is 0.1


def test_evaluate_is_exact_and_restores_mode():
    labels = torch.arange(50) % 10                     # five of each digit
    src = ArraySource(torch.zeros(50, 8, 8, dtype=torch.uint8), labels, mean=(0.0,), std=(1.0,))

    class AlwaysZero(nn.Module):
        def forward(self, x):
            logits = torch.zeros(x.shape[0], 10)
            logits[:, 0] = 1.0
            return logits

    model = AlwaysZero().train()
    loader = make_loader(src, "torch", batch_size=16, train=False, num_workers=0, device="cpu")
    result = evaluate(model, loader)
    assert result["samples"] == 50
    assert result["accuracy"] == pytest.approx(0.1)
    right, wrong = -math.log(math.e / (math.e + 9)), -math.log(1 / (math.e + 9))
    assert result["loss"] == pytest.approx(0.1 * right + 0.9 * wrong)
    assert model.training


def test_no_host_sync_per_step(digits, monkeypatch):
    """Reading a device value (.item(), .tolist()) inside the step would stall a GPU every step: the
    number of reads must not grow with the number of steps."""
    counts = []
    for n in (256, 768):
        calls = [0]
        for name in ("item", "tolist"):
            real = getattr(torch.Tensor, name)

            def counted(self, *a, _real=real, _calls=calls, **k):
                _calls[0] += 1
                return _real(self, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
        model = SmallCNN(width=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loader = make_loader(SyntheticDigits(n, seed=3), "torch", batch_size=64, num_workers=0, device="cpu")
        fit(model, loader, epochs=1, optimizer=opt, progress=False)
        monkeypatch.undo()
        counts.append(calls[0])
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("kwargs, match", [({"epochs": -1}, "epochs"), ({"epochs": 1, "resume": True}, "checkpoint"),
                                           ({"epochs": 1, "amp": "fp32"}, "choose from"),
                                           ({"epochs": 1, "checkpoint_every": 0}, "checkpoint_every")])
def test_fit_rejects_bad_arguments(kwargs, match):
    loader = make_loader(SyntheticDigits(64, seed=4), "torch", batch_size=32, num_workers=0, device="cpu")
    with pytest.raises(ValueError, match=match):
        fit(SmallCNN(width=4), loader, progress=False, **kwargs)


@pytest.mark.cuda
def test_fit_on_cuda_reports_gpu_idle_and_uses_amp(digits):
    train, test = digits
    loader = make_loader(train, "torch", batch_size=128, num_workers=2, device="cuda")
    history = fit(SmallCNN(), loader, epochs=2, eval_loader=make_loader(test, "torch", batch_size=512, train=False,
                                                                        num_workers=0, device="cuda"),
                  progress=False)
    for r in history:
        assert 0.0 <= r["gpu_idle_fraction"] <= 1.0
        assert r["peak_memory_mb"] > 0
    assert history[-1]["eval_accuracy"] > 0.5
    assert resolve_amp("auto", torch.device("cuda")) in ("bf16", "fp16")


def test_an_empty_batch_is_left_out_of_the_figures_and_moves_nothing():
    """on_error='skip' can empty a batch: cross-entropy over zero rows is NaN and used to poison the
    epoch's loss. An empty batch must count nowhere and step nothing (AdamW would still move the
    weights on a zero gradient)."""
    full = _batches(2)
    empty = (full[0][0][:0], full[0][1][:0])
    torch.manual_seed(0)
    ref = SmallCNN(width=4)
    ref_hist = fit(ref, ListLoader(full), epochs=2, progress=False)
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    hist = fit(model, ListLoader([full[0], empty, full[1], empty]), epochs=2, progress=False)
    for got, want in zip(hist, ref_hist):
        assert math.isfinite(got["train_loss"])
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
        assert got["train_accuracy"] == want["train_accuracy"]
    assert torch.equal(_params(model), _params(ref))
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    ref_bn = next(m for m in ref.modules() if isinstance(m, nn.BatchNorm2d))
    assert torch.equal(bn.running_mean, ref_bn.running_mean)


def test_a_loader_of_only_empty_batches_reports_nan_not_an_error():
    empty = [(torch.zeros(0, 1, 16, 16), torch.zeros(0, dtype=torch.long))] * 2
    model = SmallCNN(width=4)
    before = _params(model)
    hist = fit(model, ListLoader(empty), epochs=1, progress=False)
    assert math.isnan(hist[0]["train_loss"]) and torch.equal(_params(model), before)


def test_a_model_on_another_device_than_the_loader_is_refused():
    model = nn.Sequential(nn.Flatten(), nn.Linear(256, 10, device="meta"))
    with pytest.raises(ValueError, match=r"the model is on meta but train_loader yields batches on cpu"):
        fit(model, ListLoader(_batches(1)), epochs=1, progress=False)


def test_eval_loader_on_another_device_is_refused():
    with pytest.raises(ValueError, match=r"eval_loader is on cuda:1 but train_loader is on cpu"):
        fit(SmallCNN(width=4), ListLoader(_batches(1)), eval_loader=ListLoader([], device="cuda:1"), epochs=1,
            progress=False)


def test_train_one_epoch_steps_real_batches_and_fills_the_meter():
    batches = _batches(4, size=8)
    batches[2] = (batches[2][0][:0], batches[2][1][:0])     # an emptied batch takes no step
    step, meter, after = CountingStep(), EpochMeter(torch.device("cpu"), [10.0, 2.0, 10.0]), []
    train_one_epoch(step, ListLoader(batches), meter, first_batch=0, after_batch=after.append)
    assert step.sizes == [8, 8, 8] and step.net.training      # the step's module trains in train mode
    assert step.steps == 3
    assert after == [1, 2, 3, 4]                              # batches done in the epoch, empty one included
    assert meter.images == 24 and meter.wait >= 0.0
    record = meter.record(3)
    assert set(record) == RECORD_KEYS and record["epoch"] == 3
    # The carried sums of a resumed half epoch count: (10 + 3 * 8) / (10 + 24).
    assert record["train_loss"] == pytest.approx(34 / 34) and record["train_accuracy"] == pytest.approx(5 / 34)
    assert record["gpu_idle_fraction"] is None and record["images_per_second"] > 0


def test_fit_sets_each_epoch_on_the_loader_except_a_resumed_half_epoch(tmp_path):
    """set_epoch reshuffles (a DistributedSampler-style loader depends on it); a resumed half epoch
    must keep the order that load_state_dict restored."""
    class EpochLog(ListLoader):
        def __init__(self, batches):
            super().__init__(batches)
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)
            super().set_epoch(epoch)

    loader = EpochLog(_batches(4))
    fit(SmallCNN(width=4), loader, epochs=2, progress=False)
    assert loader.epochs == [0, 1]
    path = tmp_path / "c.pt"
    with pytest.raises(Crash):
        fit(SmallCNN(width=4), Recording(EpochLog(_batches(4)), crash_after=3), epochs=2, checkpoint=path,
            checkpoint_every=2, progress=False)
    loader = EpochLog(_batches(4))
    fit(SmallCNN(width=4), loader, epochs=3, checkpoint=path, resume=True, progress=False)
    assert loader.epochs == [1, 2] and loader.iters == 3   # epoch 0 resumed at batch 2, not re-set


def test_fit_evaluates_with_the_eval_loss_fn_given_and_not_the_training_loss():
    labels_seen = {"train": [], "eval": []}

    def logged(kind, value):
        def loss(logits, labels):
            labels_seen[kind].append(labels.dtype)
            return nn.functional.cross_entropy(logits, labels) * 0 + value if kind == "eval" else \
                nn.functional.cross_entropy(logits, labels)
        return loss

    torch.manual_seed(0)
    hist = fit(SmallCNN(width=4), ListLoader(_batches(3)), epochs=2, eval_loader=ListLoader(_batches(2, seed=1)),
               loss_fn=logged("train", None), eval_loss_fn=logged("eval", 7.25), progress=False)
    assert [r["eval_loss"] for r in hist] == [7.25, 7.25]
    assert labels_seen == {"train": [torch.int64] * 6, "eval": [torch.int64] * 4}


def test_evaluate_refuses_a_loss_that_is_not_callable():
    with pytest.raises(TypeError, match=r"loss_fn must be callable .* got 'ce' \(str\)"):
        evaluate(SmallCNN(width=4), ListLoader(_batches(1)), loss_fn="ce")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"epochs": True}, TypeError, r"epochs must be an integer >= 0, got True"),
    ({"epochs": 1.5}, TypeError, r"epochs must be an integer >= 0, got 1.5"),
    ({"epochs": -1}, ValueError, r"epochs must be an integer >= 0, got -1"),
    ({"checkpoint_every": True}, TypeError, r"checkpoint_every must be an integer >= 1, got True"),
    ({"compile": "yes"}, ValueError, r"compile must be True, False or 'reduce-overhead', got 'yes'"),
    ({"compile": 1}, TypeError, r"compile must be True, False or 'reduce-overhead', got 1 \(int\)"),
    ({"progress": "no"}, TypeError, r"progress must be True or False, got 'no'"),
    ({"channels_last": 1}, TypeError, r"channels_last must be True or False, got 1"),
    ({"cudnn_benchmark": "x"}, TypeError, r"cudnn_benchmark must be True or False"),
    ({"tf32": None}, TypeError, r"tf32 must be True or False, got None"),
    ({"resume": "yes"}, TypeError, r"resume must be True or False, got 'yes'"),
    ({"scheduler": "cos"}, TypeError, r"scheduler must be a torch.optim.lr_scheduler scheduler .* got 'cos' \(str\)"),
    ({"optimizer": "sgd"}, TypeError, r"optimizer must be a torch.optim.Optimizer .* got 'sgd' \(str\)"),
    ({"eval_loader": [1, 2]}, TypeError, r"eval_loader must be a fastdata loader .* got list without device"),
    ({"loss_fn": "ce"}, TypeError, r"loss_fn must be callable .* got 'ce' \(str\)"),
    ({"eval_loss_fn": 0.1}, TypeError, r"eval_loss_fn must be callable .* got 0.1 \(float\)"),
    ({"eval_loader": "x"}, TypeError, r"eval_loader must be a fastdata loader .* got str without device"),
    ({"accumulate": 0}, ValueError, r"accumulate must be an integer >= 1, got 0"),
    ({"accumulate": 2.0}, TypeError, r"accumulate must be an integer >= 1, got 2.0"),
    ({"clip_grad_norm": 0}, ValueError, r"clip_grad_norm must be a number > 0 or None, got 0.0"),
    ({"clip_grad_norm": math.inf}, ValueError, r"clip_grad_norm must be a finite number > 0 or None, got inf"),
    ({"clip_grad_norm": "1"}, TypeError, r"clip_grad_norm must be a number > 0 or None, got '1' \(str\)"),
    ({"ema": 1.0}, ValueError, r"ema must be a decay in \(0, 1\) such as 0.999, got 1.0"),
    ({"ema": True}, TypeError, r"ema must be a decay .* got True \(bool\)"),
    ({"ema": nn.Linear(1, 1)}, TypeError, r"ema must be a decay .*update\(model\) and a .module"),
])
def test_fit_refuses_an_argument_of_the_wrong_kind_before_training(kwargs, error, match):
    """Before: a string scheduler failed after a whole epoch, "no" showed the bar, True trained an epoch."""
    loader = ListLoader(_batches(2))
    args = {"epochs": 1, "progress": False, **kwargs}
    with pytest.raises(error, match=match):
        fit(SmallCNN(width=4), loader, **args)
    assert loader.iters == 0


def test_fit_takes_a_scheduler_optimizer_and_eval_loader_by_what_it_uses():
    """The checks refused what trained before: a hand-written scheduler with step() alone (state_dict
    is needed only for checkpoints), and an eval_loader without len() (evaluate never asks)."""
    model = SmallCNN(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Warmup:
        def __init__(self):
            self.steps = 0

        def step(self):
            self.steps += 1

    class NoLen:
        device = torch.device("cpu")

        def __iter__(self):
            return iter(_batches(1))

    warmup = Warmup()
    hist = fit(model, ListLoader(_batches(2)), epochs=1, optimizer=opt, scheduler=warmup, eval_loader=NoLen(),
               progress=False)
    assert warmup.steps == 1 and hist[0]["eval_accuracy"] is not None


def test_fit_names_a_plain_dataloader_and_a_model_that_is_not_a_module():
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1, 8, 8),
                                                                      torch.zeros(4, dtype=torch.long)))
    with pytest.raises(TypeError, match=r"train_loader must be a fastdata loader .* got DataLoader without device: "
                                        r"a torch DataLoader .* fastdata.make_loader\(source, 'torch', ...\)"):
        fit(SmallCNN(width=4), data, epochs=1, progress=False)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got 'cnn' \(str\)"):
        fit("cnn", ListLoader(_batches(2)), epochs=1, progress=False)
