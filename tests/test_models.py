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
