"""Tensor helpers the transforms share: draws, per-channel constants, grey levels, soft targets, blends and
un-normalizing. None of them synchronizes the host with the device."""
from __future__ import annotations

import torch

# torchvision's luminance weights (rgb_to_grayscale), so grayscale and saturation match it.
_LUMA = (0.2989, 0.587, 0.114)


def rand(n: int, generator: torch.Generator, device, *shape: int) -> torch.Tensor:
    """Uniform [0, 1) draws of shape ``(n, *shape)`` from ``generator`` on ``device``."""
    return torch.rand((n, *shape), generator=generator, device=device)


def constant(values, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Per-channel constants (1, C, 1, 1) on ``like``'s device, made by fill kernels: torch.tensor(...,
    device="cuda") would be a blocking host-to-device copy (a sync) on every batch."""
    return torch.stack([like.new_full((), float(v), dtype=dtype) for v in values]).view(1, -1, 1, 1)


def gray(x: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) RGB in [0, 1] → (N, 1, H, W) luminance, as torchvision's rgb_to_grayscale."""
    r, g, b = x.unbind(1)
    return r.mul(_LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(1)


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """int64 (N,) → float32 (N, num_classes) targets, label-smoothed; soft labels pass through as float32.

    scatter_ instead of F.one_hot: one_hot checks the label range with .item() on the CPU path, and
    neither needs the range from the device. On the CPU the range is checked here (two reductions of N
    labels), so a label past the class count is named; on CUDA that check would be a host sync per batch,
    and a label out of range trips scatter_'s device-side assert, as it would trip cross_entropy's. (A
    source that knows its class count has checked its labels already; one that does not, given
    ``MixUp(num_classes=N)``, relies on this.)
    """
    if labels.ndim == 2:
        return labels.float()
    if labels.device.type == "cpu" and labels.numel():
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= num_classes:
            raise ValueError(f"label {low if low < 0 else high} is outside [0, {num_classes}): soft labels are "
                             f"(N, num_classes={num_classes}); give the mixing transform (or the source) the "
                             f"true class count")
    out = torch.full((labels.shape[0], num_classes), smoothing / num_classes, dtype=torch.float32,
                     device=labels.device)
    return out.scatter_(1, labels.view(-1, 1), 1.0 - smoothing + smoothing / num_classes)


def mix(a: torch.Tensor, b: torch.Tensor, lam: float) -> torch.Tensor:
    """``lam * a + (1 - lam) * b``, written into a new tensor."""
    return a.mul(lam).add_(b, alpha=1.0 - lam)


def unnormalize(t, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixels in [0, 1] as float32, mean, std) for a transform holding mean/std."""
    c = images.shape[1]
    mean, std = t.mean, t.std
    if len(mean) == 1:
        mean, std = mean * c, std * c
    if len(mean) != c or len(std) != c:
        raise ValueError(f"{type(t).__name__}: mean/std have {len(mean)}/{len(std)} values but the batch "
                         f"has {c} channel(s)")
    m, s = constant(mean, images), constant(std, images)
    return images.float().mul(s).add_(m), m, s

