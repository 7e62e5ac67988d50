import copy

import pytest
import torch

from conftest import require
from fastdata.models import CheckpointedSequential, SmallCNN, checkpoint_blocks


def test_output_shape_for_digits_and_other_sizes():
    torch.manual_seed(0)
    m = SmallCNN().eval()
    assert m(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    assert m(torch.randn(2, 1, 32, 40)).shape == (2, 10)  # global pooling: any input size
    rgb = SmallCNN(num_classes=7, in_channels=3).eval()
    assert rgb(torch.randn(3, 3, 32, 32)).shape == (3, 7)


def test_parameter_count_is_small_cnn_sized():
    n = sum(p.numel() for p in SmallCNN().parameters())
    assert 100_000 <= n <= 400_000, n


def test_channels_last_gives_the_same_outputs():
    torch.manual_seed(0)
    m = SmallCNN().eval()
    x = torch.randn(4, 1, 28, 28)
    ref = m(x)
    m_cl = m.to(memory_format=torch.channels_last)
    out = m_cl(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs", [{"num_classes": 0}, {"in_channels": 0}, {"width": 0}, {"width": 32.0},
                                    {"num_classes": True}])
def test_invalid_sizes_raise(kwargs):
    (name, bad), = kwargs.items()
    with pytest.raises(ValueError, match=rf"SmallCNN: {name} must be an integer >= 1, got {bad}"):
        SmallCNN(**kwargs)


def test_overfits_one_batch():
    # A model that cannot fit 64 fixed samples in 40 steps has a broken forward or backward.
    torch.manual_seed(0)
    m = SmallCNN()
    x, y = torch.randn(64, 1, 28, 28), torch.arange(64) % 10
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    first = None
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first


def test_create_model_looks_in_fastdata_then_torchvision_then_timm():
    import torchvision

    from fastdata.models import create_model

    assert isinstance(create_model("SmallCNN", num_classes=3, in_channels=1), SmallCNN)
    # torchvision's resnet18 before timm's of the same name.
    assert type(create_model("resnet18", num_classes=3)) is torchvision.models.ResNet
    timm = require("timm")
    torch.manual_seed(0)
    grey = create_model("test_vit", num_classes=3, in_channels=1).eval()   # timm's in_chans
    assert type(grey).__module__.startswith("timm.") and grey(torch.zeros(2, 1, 160, 160)).shape == (2, 3)
    assert timm.is_model("test_vit") and not torchvision.models.list_models(include="test_vit")


def test_create_model_never_downloads_and_refuses_what_is_not_a_classifier(monkeypatch):
    import torchvision.models._api as torchvision_weights

    from fastdata.models import create_model

    def no_download(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    monkeypatch.setattr(torchvision_weights, "load_state_dict_from_url", no_download)
    # Its builder takes num_classes too, and would fetch a pretrained ResNet-50 backbone by default.
    with pytest.raises(ValueError, match=r"'fasterrcnn_resnet50_fpn' is a torchvision detection model, not an "
                                         r"image classifier"):
        create_model("fasterrcnn_resnet50_fpn", num_classes=3)
    with pytest.raises(ValueError, match=r"unknown model 'hf-hub:timm/resnet18.a1_in1k'"):
        create_model("hf-hub:timm/resnet18.a1_in1k", num_classes=3)   # timm would fetch its config


def test_an_unknown_model_says_where_it_looked(monkeypatch):
    from fastdata import models

    with pytest.raises(ValueError, match=r"unknown model 'resnet9000'; choose from smallcnn, torchvision's "
                                         r"classification models \[.*'resnet18'.*\], or timm's \d+ models"):
        models.create_model("resnet9000", num_classes=3)
    monkeypatch.setattr(models, "_timm", lambda: None)
    with pytest.raises(ValueError, match=r"or timm's models: timm is not installed \(pip install timm\)$"):
        models.create_model("resnet9000", num_classes=3)


def test_a_model_that_cannot_be_built_names_the_call(monkeypatch):
    import torchvision

    from fastdata.models import create_model

    def builder(**kwargs):
        raise TypeError(f"got an unexpected keyword argument {sorted(kwargs)[0]!r}")

    monkeypatch.setattr(torchvision.models, "get_model_builder", lambda name: builder)
    with pytest.raises(ValueError, match=r"^torchvision.models.get_model_builder\('resnet18'\)\(weights=None, "
                                         r"num_classes=3\) failed: TypeError: got an unexpected keyword argument "
                                         r"'num_classes'$"):
        create_model("resnet18", num_classes=3)


# ------------------------------------------------------------------------ gradient checkpointing
def _grads(model, x, labels):
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _same_training_step(build, x, labels, **kwargs):
    torch.manual_seed(0)
    plain = build().train()
    ckpt = copy.deepcopy(plain)
    assert checkpoint_blocks(ckpt, **kwargs) is ckpt
    loss, grads = _grads(plain, x, labels)
    loss_c, grads_c = _grads(ckpt, x, labels)
    torch.testing.assert_close(loss_c, loss, rtol=0, atol=1e-6)
    assert grads.keys() == grads_c.keys()
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=0, atol=1e-6, msg=name)
    # BatchNorm's running statistics moved once, as without checkpointing (not again in the recompute).
    for (name, b), (_, b_c) in zip(plain.named_buffers(), ckpt.named_buffers()):
        torch.testing.assert_close(b_c, b, rtol=0, atol=1e-6, msg=name)
    return plain, ckpt


@pytest.mark.parametrize("segments", [None, 2])
def test_checkpointed_smallcnn_gives_the_same_gradients_and_batchnorm_statistics(segments):
    x, labels = torch.randn(8, 1, 28, 28), torch.arange(8) % 10
    plain, ckpt = _same_training_step(SmallCNN, x, labels, segments=segments)
    assert isinstance(ckpt.features, CheckpointedSequential)
    assert ckpt.state_dict().keys() == plain.state_dict().keys()   # checkpoints stay loadable both ways


def test_checkpointed_resnet18_gives_the_same_gradients():
    import torchvision

    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    _, ckpt = _same_training_step(lambda: torchvision.models.resnet18(weights=None, num_classes=5), x, labels)
    assert all(isinstance(getattr(ckpt, f"layer{i}"), CheckpointedSequential) for i in range(1, 5))


def test_checkpointing_actually_recomputes_the_blocks():
    # Without checkpointing the forward runs once per step; with it, each block's forward runs again in backward.
    torch.manual_seed(0)
    model = SmallCNN().train()
    calls = []
    model.features[0][0].register_forward_hook(lambda *a: calls.append(1))   # the first conv
    _grads(model, torch.randn(2, 1, 28, 28), torch.tensor([0, 1]))
    assert len(calls) == 1
    checkpoint_blocks(model)
    calls.clear()
    _grads(model, torch.randn(2, 1, 28, 28), torch.tensor([0, 1]))
    assert len(calls) == 2
    calls.clear()
    with torch.no_grad():   # evaluation: no recomputation, same outputs
        model.eval()(torch.randn(2, 1, 28, 28))
    assert len(calls) == 1


def test_checkpointed_model_survives_deepcopy_and_pickling(tmp_path):
    torch.manual_seed(0)
    model = checkpoint_blocks(SmallCNN()).eval()
    x = torch.randn(2, 1, 28, 28)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    for other in (copy.deepcopy(model), loaded):
        assert isinstance(other.features, CheckpointedSequential)
        torch.testing.assert_close(other(x), model(x))


def test_checkpoint_blocks_uses_timms_own_switch():
    timm = require("timm")
    model = timm.create_model("resnet10t", pretrained=False, num_classes=3)
    checkpoint_blocks(model)
    assert model.grad_checkpointing is True


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0"])   # BatchNorm2d; timm's BatchNormAct2d
def test_checkpointed_timm_models_move_batchnorm_statistics_once(name):
    timm = require("timm")
    x, labels = torch.randn(2, 3, 64, 64), torch.tensor([1, 2])
    plain, ckpt = _same_training_step(lambda: timm.create_model(name, pretrained=False, num_classes=3), x, labels)
    assert ckpt.grad_checkpointing is True
    moved = [n for n, b in plain.named_buffers() if n.endswith("running_mean")]
    assert len(moved) > 15   # every BatchNorm of the blocks was checked, not only the stem's


def test_batchnorm_statistics_move_once_with_reentrant_checkpointing_too(monkeypatch):
    # timm's TIMM_REENTRANT_CKPT=1 (set_reentrant_ckpt) recomputes through the reentrant checkpoint instead.
    timm = require("timm")
    import timm.layers.config as timm_config

    monkeypatch.setattr(timm_config, "_USE_REENTRANT_CKPT", True)
    x, labels = torch.randn(2, 3, 64, 64), torch.tensor([1, 2])
    _same_training_step(lambda: timm.create_model("resnet18", pretrained=False, num_classes=3), x, labels)


def test_a_compiled_checkpointed_model_moves_statistics_once_without_graph_breaks():
    import torch._dynamo

    x, labels = torch.randn(4, 1, 28, 28), torch.arange(4) % 10
    torch.manual_seed(0)
    plain = SmallCNN().train()
    ckpt = checkpoint_blocks(copy.deepcopy(plain))
    # The statistics hooks trace away (explain runs a forward: on a copy, whose statistics it moves).
    assert torch._dynamo.explain(copy.deepcopy(ckpt))(x).graph_break_count == 0
    torch._dynamo.reset()
    _grads(plain, x, labels)
    _grads(torch.compile(ckpt, backend="aot_eager"), x, labels)
    for (name, b), (_, b_c) in zip(plain.named_buffers(), ckpt.named_buffers()):
        torch.testing.assert_close(b_c, b, rtol=0, atol=1e-6, msg=name)


def test_a_checkpointed_model_still_updates_statistics_every_step_and_not_in_evaluation():
    torch.manual_seed(0)
    model = checkpoint_blocks(checkpoint_blocks(SmallCNN())).train()   # a second call adds no second hook
    bn = model.features[0][1]
    assert len(bn._forward_pre_hooks) == 1 and len(bn._forward_hooks) == 1
    for step in range(1, 4):
        _grads(model, torch.randn(4, 1, 28, 28), torch.arange(4) % 10)
        assert bn.num_batches_tracked.item() == step
    before = bn.running_mean.clone()
    with torch.no_grad():
        model.eval()(torch.randn(4, 1, 28, 28))
    torch.testing.assert_close(bn.running_mean, before, rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == 3


def test_checkpoint_blocks_refuses_what_it_cannot_split():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"cannot split a .*Net into blocks; it supports SmallCNN.*ResNet"):
        checkpoint_blocks(Net())
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=rf"segments must be an integer >= 1 or None, got {bad}"):
            checkpoint_blocks(SmallCNN(), segments=bad)


@pytest.mark.cuda
def test_on_a_gpu_checkpointed_timm_and_torchvision_models_move_batchnorm_statistics_once():
    # On CUDA the backward, and with it the recomputation, runs on the autograd engine's device thread.
    timm = require("timm")
    import torchvision

    for build in (lambda: timm.create_model("resnet18", pretrained=False, num_classes=3),
                  lambda: torchvision.models.resnet18(weights=None, num_classes=3)):
        torch.manual_seed(0)
        plain = build().cuda().train()
        ckpt = checkpoint_blocks(copy.deepcopy(plain))
        x, labels = torch.randn(4, 3, 64, 64, device="cuda"), torch.tensor([0, 1, 2, 0], device="cuda")
        for model in (plain, ckpt):
            torch.nn.functional.cross_entropy(model(x), labels).backward()
        # A second update would move a running mean by ~0.1; kernels' summation order by far less.
        for (name, b), (_, b_c) in zip(plain.named_buffers(), ckpt.named_buffers()):
            torch.testing.assert_close(b_c, b, rtol=0, atol=1e-4, msg=name)


@pytest.mark.cuda
def test_checkpointing_lowers_peak_memory_of_a_resnet_at_batch_64():
    import torchvision

    def peak(checkpointed: bool) -> int:
        torch.manual_seed(0)
        model = torchvision.models.resnet18(weights=None, num_classes=10).cuda().train()
        if checkpointed:
            checkpoint_blocks(model)
        x = torch.randn(64, 3, 160, 160, device="cuda")
        labels = torch.randint(0, 10, (64,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain, ckpt = peak(False), peak(True)
    # The checkpointed run keeps the stem's activations and the blocks' inputs, not every block's
    # intermediates: an estimate of resnet18's saved tensors at 160 px puts it near 0.6 of the plain
    # peak; without checkpointing the two peaks are equal.
    assert ckpt < 0.85 * plain, f"plain {plain / 2**20:.0f} MiB, checkpointed {ckpt / 2**20:.0f} MiB"
