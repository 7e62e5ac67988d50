"""Batch transforms: augmentation on the normalized device batch, after the recipe, for every backend.

``make_loader(..., batch_transforms=[Cutout(8), MixUp(0.2)])`` runs each transform, in order, on every
batch a backend hands over: images normalized float (N, C, H, W) on the device, labels int64 (N,). Every
backend hands over that same batch, so one implementation serves all of them, on the CPU and on CUDA.

Two kinds of transform are accepted:

- a :class:`BatchTransform` (the ones shipped here, or your own subclass) is called as
  ``t(images, labels, generator)`` and returns ``(images, labels)``. ``generator`` is a
  ``torch.Generator`` on the batch's device, seeded from ``(seed, epoch, batch, rank)`` and the
  transform's position in the list: the same run gives the same draws, a resumed run continues with
  exactly the draws the uninterrupted one made, and adding a transform leaves the others' draws alone.
- any other callable (a torchvision v2 transform that works on batched tensors, a lambda) is called as
  ``t(images)``; labels pass through. It draws from torch's global RNG, so the pipeline runs it under
  ``torch.random.fork_rng`` with the CPU generator and the batch device's generator seeded from the same
  per-batch seed (Python's ``random`` and numpy's global RNG too, restored after): it is repeatable per
  batch, and the global RNGs (dropout, the model's init, the user's own) are left as they were. A
  torchvision transform given a batch treats it as one image: it draws once per batch (every image gets
  the same flip or erased box), unlike the per-sample transforms here.

Randomness is drawn on the batch's device (CPU and CUDA generators differ, so the same seed gives
different draws on a CPU and a GPU; on one device it is exact). Per-batch scalars (MixUp's and CutMix's
lambda and box, OneOf's choice) are drawn on the host from the generator's seed (``host_rng``): numbers
the host needs never come back from the GPU, so no transform here synchronizes the host with the device.

Images stay in their dtype (float32/bfloat16/float16) and memory format (contiguous or channels_last).
MixUp and CutMix turn the labels into soft float32 targets (N, num_classes); once one transform in a
pipeline does, every batch of that pipeline has soft labels, so the training loop sees one kind, with
one label smoothing (the mixing transforms' shared ``label_smoothing``, also on a OneOf's unmixed
batches). ``num_classes`` is the source's, or the one the mixing transforms were given where the source
does not know its own.
"""
from __future__ import annotations

# One job per module: base (the BatchTransform contract and the per-batch seeding), arguments (checks
# of constructor arguments), ops (tensor helpers), geometry (flips), erasing (Cutout, RandomErasing),
# color (ColorJitter, RandomGrayscale), mixing (MixUp, CutMix), choice (OneOf), validation (what a
# batch_transforms list may hold) and pipeline (BatchPipeline, which runs them on each batch).
from .base import BatchContext, BatchTransform, host_rng
from .choice import OneOf
from .color import ColorJitter, RandomGrayscale
from .erasing import Cutout, RandomErasing
from .geometry import RandomHorizontalFlip, RandomVerticalFlip
from .mixing import CutMix, MixUp
from .pipeline import BatchPipeline
from .validation import check_batch_transforms, composition_parts

__all__ = ["BatchTransform", "BatchContext", "BatchPipeline", "check_batch_transforms", "composition_parts", "host_rng",
           "RandomHorizontalFlip", "RandomVerticalFlip", "Cutout", "RandomErasing", "ColorJitter",
           "RandomGrayscale", "MixUp", "CutMix", "OneOf"]
