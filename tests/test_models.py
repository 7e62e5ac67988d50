import pytest
import torch

from fastdata.models import SmallCNN


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


@pytest.mark.parametrize("kwargs", [{"num_classes": 0}, {"in_channels": 0}, {"width": 0}])
def test_invalid_sizes_raise(kwargs):
    with pytest.raises(ValueError, match="must be >= 1"):
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
    timm = pytest.importorskip("timm", reason="timm is the 'integrations' extra")
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
