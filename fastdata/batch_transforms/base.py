"""The BatchTransform contract and the seeding every transform draws from: one generator per batch and
transform (``step_generator``), host-side numbers from its seed (``host_rng``), child streams for OneOf."""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch

from ..sampling import seed_for

# Tags mixed into derived seeds, so that the device stream, the host stream, OneOf's child streams and
# the global Python/numpy streams a plain callable draws from never coincide.
_STEP, _HOST, _CHILD, _PY, _NP = 0xBA7C, 0x4057, 0xC41D, 0x9E7, 0x4E9


def _words(seed: int) -> tuple[int, int]:
    # seed_for mixes 32-bit words; a 63-bit seed is split so that no bit of it is lost.
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def host_rng(generator: torch.Generator) -> np.random.Generator:
    """A numpy generator on the host, seeded from ``generator``'s seed (not from its state).

    For per-batch numbers the host needs as Python values (a mixing coefficient, a box, a choice):
    drawing them on a CUDA generator and reading them back would make the host wait for the GPU. The
    seed is host state, so this never synchronizes. It is a stream separate from ``generator``'s own.

    Args:
        generator: the generator a BatchTransform was called with.
    """
    return np.random.default_rng(seed_for(*_words(generator.initial_seed()), _HOST))


def child_generator(generator: torch.Generator, k: int) -> torch.Generator:
    """A new generator on ``generator``'s device, seeded from its seed and ``k``."""
    g = torch.Generator(device=generator.device)
    g.manual_seed(seed_for(*_words(generator.initial_seed()), k, _CHILD))
    return g


def step_generator(seed: int, i: int, device) -> torch.Generator:
    """The generator transform ``i`` of the batch with seed ``seed`` draws from, on ``device``.

    Args:
        seed: the batch's seed (an int >= 0, up to 64 bits).
        i: the transform's position in the pipeline.
        device: the batch's device.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed_for(*_words(int(seed)), i, _STEP))
    return generator


@dataclass(frozen=True)
class BatchContext:
    """What the loader knows and some transforms need: given to :meth:`BatchTransform.bind` once.

    Args:
        num_classes: classes of the source (soft labels are (N, num_classes)).
        device: where the batches are.
        mean, std: the per-channel normalization of the batches in [0, 1] units; None if unknown.
    """

    num_classes: int
    device: torch.device
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


class BatchTransform:
    """Base class of the transforms that get the labels and a generator.

    A subclass implements ``__call__(images, labels, generator) -> (images, labels)``:

    - ``images``: normalized float (N, C, H, W) on the device; return the same shape's N and C, dtype
      and device (the pipeline restores the memory format). Don't modify it in place: the batch may
      share memory with a backend's cache.
    - ``labels``: int64 (N,), or float (N, num_classes) soft targets once a mixing transform ran.
    - ``generator``: a ``torch.Generator`` on the device, seeded for this batch and this transform.
      Draw every random number from it (``torch.rand(n, generator=generator, device=images.device)``)
      or from ``host_rng(generator)`` for host-side scalars; never from the global RNG.

    Keep the object stateless (a frozen dataclass is the easy way): one object serves every batch, is
    shared with DataLoader workers and may be saved with a config. Avoid host syncs (``.item()``,
    ``.tolist()``, boolean-mask indexing, ``nonzero``) on CUDA: they stall the training loop.

    Set the class attribute ``soft_labels = True`` when the transform outputs soft labels.
    """

    soft_labels: ClassVar[bool] = False

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must implement "
                                  f"__call__(images, labels, generator) -> (images, labels)")

    def bind(self, context: BatchContext) -> "BatchTransform":
        """This transform completed with what only the loader knows (statistics, class count).

        The default returns ``self``. Overrides return a new object and leave ``self`` unchanged.

        Args:
            context: the loader's BatchContext.
        """
        return self



@contextlib.contextmanager
def _host_rngs_seeded(seed: int):
    """Python's ``random`` and numpy's legacy global RNG seeded from ``seed`` inside, restored after.

    Callables from other libraries draw from these too: timm's RandomErasing (made for normalized
    device batches, as timm's PrefetchLoader runs it) picks its boxes with ``random.random()``. Left
    alone, those draws would follow whatever the process drew before: another batch for the same seed,
    and a resumed run off the uninterrupted one's. Restoring them after matters as much: the user's own
    draws after a batch must not repeat from a per-batch seed. Cost: about 0.1 ms a call on a CPU core,
    two thirds of it numpy's state (2.5 KB) copied out and back; only plain callables pay it.
    """
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        # Python's seed takes any int (all its bits): the tag above the batch seed's 64 bits keeps this
        # stream apart from torch's, seeded with the batch seed itself, at no hashing cost.
        random.seed(seed ^ (_PY << 64))
        np.random.seed(seed_for(*_words(seed), _NP) & 0xFFFFFFFF)   # legacy seeding takes 32 bits
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


@contextlib.contextmanager
def global_rngs_seeded(device: torch.device, seed: int):
    """Every global generator a callable of another library (or a user's) may draw from, seeded from
    ``seed`` inside and restored after: torch's CPU generator and ``device``'s under ``fork_rng``, Python's
    ``random`` and numpy's (``_host_rngs_seeded``). Such a callable then repeats by the batch's seed and
    resumes exactly, and the caller's own draws are left where they were.

    Args:
        device: the batch's device.
        seed: the seed of the generator the transform was called with.
    """
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    # Only this device's generator is forked and seeded: torch.manual_seed would also reseed every
    # other GPU's, outside the fork.
    with torch.random.fork_rng(devices=cuda, device_type="cuda"), _host_rngs_seeded(seed):
        torch.default_generator.manual_seed(seed)
        for i in cuda:
            torch.cuda.default_generators[i].manual_seed(seed)
        yield


def draws_globally(t) -> bool:
    """Whether ``t`` runs under ``global_rngs_seeded``: a plain callable (``ImageCallable`` seeds for it)
    or a BatchTransform written outside fastdata, which may draw from the global generators against
    the docs' rule; fastdata's own draw from the generator they are given, and pay nothing."""
    return not type(t).__module__.startswith("fastdata.")


@dataclass(frozen=True)
class ImageCallable(BatchTransform):
    """A callable that takes only the images (a torchvision v2 transform, timm's RandomErasing, a lambda),
    run repeatably: under ``global_rngs_seeded`` from the batch's seed."""

    fn: Callable

    def __call__(self, images, labels, generator):
        with global_rngs_seeded(images.device, generator.initial_seed()):
            out = self.fn(images)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"returned {type(out).__name__}, not the images tensor; a transform that also "
                            f"takes or returns labels subclasses fastdata.batch_transforms.BatchTransform")
        # torchvision may hand back a tv_tensors.Image: the batch stays a plain tensor.
        return (out if type(out) is torch.Tensor else out.as_subclass(torch.Tensor)), labels


def as_transform(t) -> BatchTransform:
    """``t`` itself if it is a BatchTransform, else ``t`` wrapped to be called with the images only.

    Args:
        t: a BatchTransform or a callable taking the images.
    """
    return t if isinstance(t, BatchTransform) else ImageCallable(t)

