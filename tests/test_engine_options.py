"""FitConfig (fastdata/engine/options.py): fit's options as one frozen, checked object."""
import dataclasses

import pytest
import torch

from fastdata import FitConfig, fit, make_loader
from fastdata.datasets import SyntheticDigits
from fastdata.engine import ModelEma, TrainStep
from fastdata.models import SmallCNN


@pytest.fixture(scope="module")
def loader():
    return make_loader(SyntheticDigits(256, seed=3), backend="memory", batch_size=64, device="cpu", seed=0)


def _losses(model_seed, loader, **kwargs):
    torch.manual_seed(model_seed)
    return [r["train_loss"] for r in fit(SmallCNN(), loader, **kwargs)]


def test_a_config_trains_as_the_same_keywords_do(loader):
    options = dict(epochs=2, amp="off", progress=False, optimizer=None, timing_warmup=0)
    by_keywords = _losses(0, loader, **options)
    by_config = _losses(0, loader, config=FitConfig(**options))
    assert by_keywords == by_config and len(by_config) == 2


def test_keywords_override_the_config_which_stays_as_it_was(loader):
    base = FitConfig(epochs=1, amp="off", progress=False)
    history = fit(SmallCNN(), loader, config=base, epochs=3, timing_warmup=0)
    assert len(history) == 3 and base.epochs == 1 and base.timing_warmup == 5
    assert FitConfig.of(base, {"epochs": 3}) == dataclasses.replace(base, epochs=3)
    assert FitConfig.of(base, {}) is base


def test_an_unknown_or_missing_option_is_named(loader):
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['epoch'\].*'epochs', 'optimizer'"):
        fit(SmallCNN(), loader, epoch=1)
    with pytest.raises(TypeError, match="needs epochs="):
        fit(SmallCNN(), loader, amp="off")
    with pytest.raises(TypeError, match="config must be a fastdata.FitConfig"):
        fit(SmallCNN(), loader, config={"epochs": 1})
    with pytest.raises(TypeError, match="unexpected option"):
        fit(SmallCNN(), loader, config=FitConfig(epochs=1), epoch=2)


@pytest.mark.parametrize("fields, error, message", [
    ({"epochs": True}, TypeError, "epochs must be an integer >= 0, got True"),
    ({"epochs": -1}, ValueError, "epochs must be an integer >= 0"),
    ({"amp": "half"}, ValueError, r"unknown amp 'half'; choose from \['auto', 'bf16', 'fp16', 'off'\]"),
    ({"accumulate": 0}, ValueError, "accumulate must be an integer >= 1"),
    ({"log_every": 0}, ValueError, "log_every must be an integer >= 1"),
    ({"timing_warmup": 1.5}, TypeError, "timing_warmup must be an integer"),
    ({"progress": "no"}, TypeError, "progress must be True or False"),
    ({"resume": True}, ValueError, "resume and checkpoint_every need a checkpoint path"),
    ({"clip_grad_norm": 0}, ValueError, "clip_grad_norm must be a number > 0 or None, got 0.0"),
    ({"ema": 1.5}, ValueError, r"ema must be a decay in \(0, 1\)"),
    ({"compile": "max"}, ValueError, "compile must be True, False or 'reduce-overhead'"),
    ({"scheduler_interval": "batch"}, ValueError, "unknown scheduler_interval 'batch'"),
    ({"scheduler": "cosine"}, TypeError, "scheduler must be a torch.optim.lr_scheduler scheduler"),
    ({"loss_fn": "ce"}, TypeError, "loss_fn must be callable"),
])
def test_a_bad_field_is_refused_when_the_config_is_built(fields, error, message):
    with pytest.raises(error, match=message):
        FitConfig(**{"epochs": 1, **fields})
    base = FitConfig(epochs=1)
    with pytest.raises(error, match=message):   # replace runs the same checks
        dataclasses.replace(base, **fields)


def test_the_step_is_built_from_the_config():
    model = SmallCNN()
    config = FitConfig(epochs=1, accumulate=3, clip_grad_norm=1.0, ema=0.9)
    step = TrainStep.build(model, config, torch.device("cpu"))
    assert (step.accumulate, step.clip_grad_norm) == (3, 1.0)
    assert step.mode == "off" and not step.scaler.is_enabled()   # amp "auto" on the CPU
    assert isinstance(step.ema, ModelEma) and step.ema.decay == 0.9
    assert isinstance(step.optimizer, torch.optim.AdamW) and step.scheduler is None


@pytest.mark.parametrize("amp, scaled", [("bf16", False), ("fp16", True), ("off", False)])
def test_the_step_resolves_its_precision_from_the_config(amp, scaled, monkeypatch):
    """The mode, its autocast and its GradScaler come from one place, the config the step is built
    from: a mode passed beside it could disagree with it."""
    import fastdata.engine.amp as engine_amp

    monkeypatch.setattr(engine_amp, "_WARNED_FP16_ON_CPU", True)   # fp16 on the CPU: said elsewhere
    step = TrainStep.build(SmallCNN(), FitConfig(epochs=1, amp=amp), torch.device("cpu"))
    assert step.mode == amp and step.scaler.is_enabled() == scaled
