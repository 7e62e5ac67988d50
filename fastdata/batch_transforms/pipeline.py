"""BatchPipeline: runs a loader's batch transforms on each batch, each with its own seeded generator, and
checks what each returns."""
from __future__ import annotations

import torch

from ..checks import check_integer
from .arguments import agreed_smoothing, given_classes, mean_std
from .base import BatchContext, ImageCallable, as_transform, draws_globally, global_rngs_seeded, step_generator
from .ops import soft_targets
from .validation import PER_SAMPLE, check_batch_transforms, describe


class BatchPipeline:
    """Runs a loader's batch transforms on each batch, with per-batch, per-transform generators.

    ``pipeline(images, labels, seed)`` → ``(images, labels)``. Transform ``i`` of batch ``seed`` draws
    from a generator on the batch's device seeded with ``seed_for(seed, i)``: the same seed gives the
    same output, and inserting a transform changes only the draws of those after it in position.
    Each transform's output is checked (N, C, dtype, device; labels int64 (N,) or float
    (N, num_classes)), and an error names the transform. The images' memory format is restored.

    Args:
        transforms: as ``LoaderConfig.batch_transforms`` (checked by ``check_batch_transforms``).
        num_classes: classes of the source: the width of soft labels.
        device: the device the batches are on.
        mean, std: the batches' per-channel normalization, [0, 1] units (ColorJitter and
            RandomGrayscale need them); None if unknown.
    """

    def __init__(self, transforms, *, num_classes: int, device, mean=None, std=None):
        self.transforms = check_batch_transforms(transforms)
        num_classes = check_integer("num_classes", num_classes, minimum=0) or given_classes(self.transforms)
        mean, std = mean_std("BatchPipeline", mean, std)
        self.context = BatchContext(int(num_classes), torch.device(device), mean, std)
        self.steps = tuple(as_transform(t).bind(self.context) for t in self.transforms)
        for i, step in enumerate(self.steps):
            self._check_devices(i, step)
        # A user's BatchTransform is run under the seeded global generators too (what ImageCallable does
        # for a plain callable): one drawing from torch.rand() without the generator repeated nothing
        # by seed, and a resumed run drew other numbers than the uninterrupted one.
        self._seeded = tuple(draws_globally(s) and not isinstance(s, ImageCallable) for s in self.steps)
        #: the smoothing every batch's soft targets get (the mixing transforms' shared label_smoothing).
        self.label_smoothing = agreed_smoothing("batch_transforms", self.steps)
        #: whether every batch's labels come out soft (float32 (N, num_classes)).
        self.soft_labels = any(s.soft_labels for s in self.steps)
        if self.soft_labels and self.context.num_classes < 1:
            raise ValueError(f"batch_transforms {[describe(t, 40) for t in self.transforms]} make soft labels "
                             f"but the source's number of classes is unknown ({num_classes})")

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self):
        return f"BatchPipeline({list(self.transforms)!r})"

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformed batch.

        Args:
            images: normalized float (N, C, H, W) on the device.
            labels: int64 (N,) or float (N, num_classes).
            seed: the batch's seed (an int >= 0, up to 64 bits).
        """
        check_integer("seed", seed, minimum=0, maximum=2 ** 64 - 1)
        if images.ndim != 4:
            raise ValueError(f"batch transforms take images (N, C, H, W), got shape {tuple(images.shape)}")
        layout = _layout(images)
        n, c, dtype, device = images.shape[0], images.shape[1], images.dtype, images.device
        for i, step in enumerate(self.steps):
            generator = step_generator(seed, i, device)
            try:
                if self._seeded[i]:
                    with global_rngs_seeded(device, generator.initial_seed()):
                        out = step(images, labels, generator)
                else:
                    out = step(images, labels, generator)
            except Exception as e:
                if isinstance(step, ImageCallable):
                    raise RuntimeError(f"{self._where(i)} failed on a batch of {tuple(images.shape)} "
                                       f"{dtype} images on {device}: {type(e).__name__}: {e}. "
                                       f"{PER_SAMPLE[0].upper()}{PER_SAMPLE[1:]}") from e
                if hasattr(e, "add_note"):   # Python 3.11+: the error stays the transform's own, and says where
                    e.add_note(f"raised by {self._where(i)} on a batch of {tuple(images.shape)} {dtype} "
                               f"images on {device}")
                raise
            images, labels = self._check(i, out, n, c, dtype, device)
        if self.soft_labels and labels.ndim == 1:
            labels = soft_targets(labels, self.context.num_classes, self.label_smoothing)
        if layout is not None and not images.is_contiguous(memory_format=layout):
            images = images.contiguous(memory_format=layout)
        return images, labels

    def _check_devices(self, i: int, step) -> None:
        """Refuse a transform holding a tensor on an accelerator other than the batches' device (a CUDA
        tensor in the transform of a CPU loader, or of another GPU's): it failed at the first batch with
        torch's words, naming no transform. A CPU tensor is left alone: a transform may move it itself."""
        held = dict(vars(step)) if hasattr(step, "__dict__") else {}
        if isinstance(step, torch.nn.Module):
            held.update(step.named_parameters())
            held.update(step.named_buffers())
        device = self.context.device
        for name, value in held.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu" and value.device != device and not (
                    value.device.type == device.type and device.index is None):
                raise ValueError(f"{self._where(i)} holds a tensor on {value.device} (its {name}) but the "
                                 f"batches are on {device}: make it on the batches' device in "
                                 f"bind(context) (context.device), or build the transform for that device")

    def _where(self, i: int) -> str:
        return f"batch_transforms[{i}] ({describe(self.transforms[i])})"

    def _check(self, i, out, n, c, dtype, device):
        where = self._where(i)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"{where} returned {type(out).__name__}; a BatchTransform returns (images, labels)")
        images, labels = out
        if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
            raise TypeError(f"{where} returned ({type(images).__name__}, {type(labels).__name__}); "
                            f"expected two tensors (images, labels)")
        if images.ndim != 4 or images.shape[0] != n or images.shape[1] != c:
            raise ValueError(f"{where} returned images of shape {tuple(images.shape)}; expected ({n}, {c}, H, W): "
                             f"a batch transform keeps the batch size and the channels")
        if images.dtype != dtype:
            raise TypeError(f"{where} returned {images.dtype} images from {dtype} ones; a batch transform "
                            f"keeps the dtype (the loader's dtype=)")
        if images.device != device or labels.device != device:
            raise ValueError(f"{where} returned images on {images.device} and labels on {labels.device}; "
                             f"the batch is on {device} and stays there")
        hard = labels.dtype == torch.int64 and labels.shape == (n,)
        soft = labels.is_floating_point() and labels.shape == (n, self.context.num_classes)
        if not (hard or soft):
            raise ValueError(f"{where} returned labels {labels.dtype} of shape {tuple(labels.shape)}; expected "
                             f"int64 ({n},) or soft float ({n}, {self.context.num_classes})")
        return images, labels


def _layout(images: torch.Tensor):
    """The memory format to hand back: contiguous NCHW, channels_last, or None (neither: left alone).

    An empty tensor is contiguous in every format, so its strides decide: channels_last ones have the
    channel stride 1 (a channels_last run's empty batch, a rank's share of a short last step, stays one).
    """
    if images.is_contiguous(memory_format=torch.channels_last) and (
            not images.is_contiguous() or (images.numel() == 0 and images.stride(1) == 1 < images.shape[1])):
        return torch.channels_last
    if images.is_contiguous():
        return torch.contiguous_format
    return None
