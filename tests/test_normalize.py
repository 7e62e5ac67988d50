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


@pytest.mark.parametrize("dtype, channels_last", [(torch.float32, False), (torch.bfloat16, True)])
def test_an_empty_batch_that_lost_its_shape_gets_the_loaders(dtype, channels_last):
    """A decode of no samples stacks nothing into (0, 0, 0, C): it came out (0, C, 0, 0), unlike every other
    batch of the loader, and a batch transform (Cutout) or a gather of every rank's batch then failed."""
    lost = torch.empty((0, 0, 0, 3), dtype=torch.uint8)
    norm = Normalizer(MEAN, STD, torch.device("cpu"), dtype=dtype, channels_last=channels_last)
    assert norm(lost).shape == (0, 3, 0, 0)            # nothing known yet: as it came
    norm.size = (6, 4)                                  # the loader's, known before any batch
    out = norm(lost)
    assert out.shape == (0, 3, 6, 4) and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    norm(torch.zeros((2, 9, 7, 3), dtype=torch.uint8))  # a batch seen: its size is the one kept
    assert norm(lost).shape == (0, 3, 9, 7)
    assert norm(torch.empty((0, 0, 0, 1), dtype=torch.uint8)).shape == (0, 3, 9, 7)   # C is the loader's too


@pytest.mark.cuda
def test_the_gpu_path_equals_the_cpu_path():
    images = torch.randint(0, 256, (16, 32, 32, 3), dtype=torch.uint8)
    cpu = Normalizer(MEAN, STD, torch.device("cpu"))(images)
    gpu = Normalizer(MEAN, STD, torch.device("cuda"))(images.cuda())
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ recycled CPU output buffers
def _batches(n=4):
    """``n`` different photo-sized batches (above the grain, so the pooled path runs)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (2, 128, 96, 3), dtype=torch.uint8, generator=g) for _ in range(n)]


def test_a_released_batch_s_memory_is_reused_for_the_next_one(monkeypatch):
    import fastdata.normalize as normalize

    made = []
    real = normalize.new_buffer
    monkeypatch.setattr(normalize, "new_buffer", lambda *a: made.append(a) or real(*a))
    norm = Normalizer(MEAN, STD, torch.device("cpu"))
    a, b = _batches(2)
    first = norm(a)
    ptr = first.data_ptr()
    del first
    second = norm(b)
    assert len(made) == 1 and second.data_ptr() == ptr   # no fresh mmap: its page faults are what the pool saves
    torch.testing.assert_close(second.double(), _reference(b), atol=1e-5, rtol=1e-5)
    assert second._base is None            # its own tensor, not a view of the pool's buffer


def test_a_batch_still_referenced_is_never_overwritten():
    """Whatever holds the batch (the tensor, a view, a numpy array, autograd saving it for backward),
    later batches go elsewhere, however many pass through the pool meanwhile."""
    norm = Normalizer(MEAN, STD, torch.device("cpu"))
    batches = _batches(6)
    held = [norm(b) for b in batches[:4]]
    expected = [t.clone() for t in held]
    w = torch.ones(1, 3, 1, 1, requires_grad=True)
    kept = {"tensor": held[0], "view": held[1][1:], "numpy": held[2].numpy(), "loss": (held[3] * w).sum()}
    del held
    for _ in range(3):
        for b in batches[4:]:
            norm(b)                  # released at once: these recycle among themselves
    assert torch.equal(kept["tensor"], expected[0])
    assert torch.equal(kept["view"], expected[1][1:])
    assert torch.equal(torch.from_numpy(kept["numpy"]), expected[2])
    kept["loss"].backward()          # the saved input must still be the batch it was
    torch.testing.assert_close(w.grad.view(3), expected[3].sum(dim=(0, 2, 3)))


def test_batches_kept_in_a_list_are_all_distinct_and_intact():
    norm = Normalizer(MEAN, STD, torch.device("cpu"))
    batches = _batches(6)
    outs = [norm(b) for b in batches]
    assert len({t.data_ptr() for t in outs}) == len(outs)
    for b, t in zip(batches, outs):
        torch.testing.assert_close(t.double(), _reference(b), atol=1e-5, rtol=1e-5)


def test_a_buffer_made_under_inference_mode_serves_training_batches_after_it():
    """Evaluation often runs under torch.inference_mode(): a pooled buffer made there must give a
    normal tensor later, one autograd can save for backward."""
    norm = Normalizer(MEAN, STD, torch.device("cpu"))
    a, b = _batches(2)
    with torch.inference_mode():
        evaluated = norm(a)
        assert evaluated.is_inference()
    del evaluated
    trained = norm(b)
    assert not trained.is_inference()
    w = torch.ones(1, 3, 1, 1, requires_grad=True)
    (trained * w).sum().backward()
    torch.testing.assert_close(w.grad.view(3), _reference(b).float().sum(dim=(0, 2, 3)), rtol=1e-4, atol=1e-2)


def test_a_prefetch_stage_s_batches_in_flight_are_recycled_not_reallocated(monkeypatch):
    """With a queue of 2 batches ahead of the consumer (prefetch's default depth) plus the consumer's
    own, steady state allocates nothing: the pool is larger than the batches out at once."""
    import collections

    import fastdata.normalize as normalize

    made = []
    real = normalize.new_buffer
    monkeypatch.setattr(normalize, "new_buffer", lambda *a: made.append(a) or real(*a))
    norm = Normalizer(MEAN, STD, torch.device("cpu"))
    b = _batches(1)[0]
    queue = collections.deque()
    held = None
    for _ in range(20):
        queue.append(norm(b))       # the producer fills the queue
        if len(queue) > 2:
            held = queue.popleft()  # the consumer takes the oldest (dropping the one it held)
    assert len(made) <= 4 and held is not None
