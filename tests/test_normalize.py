"""normalize: uint8 NHWC batches → normalized NCHW floats, the same on every path."""
from __future__ import annotations

import pytest
import torch

from fastdata.normalize import Normalizer

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def _reference(images: torch.Tensor) -> torch.Tensor:
    x = images.permute(0, 3, 1, 2).double() / 255
    return ((x - torch.tensor(MEAN).double().view(1, 3, 1, 1)) / torch.tensor(STD).double().view(1, 3, 1, 1))


@pytest.mark.parametrize("shape", [(4, 8, 8, 3),            # below the grain: one whole-batch op
                                   (200, 16, 16, 3),        # digits-sized: groups of whole images
                                   (2, 200, 100, 3)])       # photo-sized: bands of rows
@pytest.mark.parametrize("channels_last", [False, True])
def test_every_cpu_path_computes_the_same_normalization(shape, channels_last):
    images = torch.randint(0, 256, shape, dtype=torch.uint8)
    out = Normalizer(MEAN, STD, torch.device("cpu"), channels_last=channels_last)(images)
    assert out.shape == (shape[0], 3, shape[1], shape[2]) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    torch.testing.assert_close(out.double(), _reference(images), atol=1e-5, rtol=1e-5)


def test_the_chunked_path_equals_the_whole_batch_op_bit_for_bit():
    images = torch.randint(0, 256, (3, 120, 90, 3), dtype=torch.uint8)
    norm = Normalizer(MEAN, STD, torch.device("cpu"))
    whole = norm.floats(images.permute(0, 3, 1, 2).contiguous())
    assert torch.equal(norm(images), whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_output_dtype_is_the_configured_one(dtype):
    images = torch.randint(0, 256, (64, 28, 28, 3), dtype=torch.uint8)
    out = Normalizer(MEAN, STD, torch.device("cpu"), dtype=dtype)(images)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), _reference(images), atol=3e-2, rtol=1e-2)


def test_an_empty_batch_keeps_its_shape():
    out = Normalizer(MEAN, STD, torch.device("cpu"))(torch.empty((0, 5, 5, 3), dtype=torch.uint8))
    assert out.shape == (0, 3, 5, 5) and out.dtype == torch.float32


@pytest.mark.cuda
def test_the_gpu_path_equals_the_cpu_path():
    images = torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8)
    cpu = Normalizer(MEAN, STD, torch.device("cpu"))(images)
    gpu = Normalizer(MEAN, STD, torch.device("cuda"))(images.cuda())
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-6, rtol=1e-6)
