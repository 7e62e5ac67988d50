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


def shift_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) RGB in [0, 1], each image's hue turned by its ``shift`` (N,) (a fraction of the
    circle): torchvision's ``adjust_hue`` (v2, tensors), with a shift per image."""
    r, g, _ = x.unbind(1)
    minc, maxc = torch.aminmax(x, dim=1)
    # As torchvision: where max = min, S and H are erased (no division by zero, so no NaN).
    eqc = maxc == minc
    channels_range = maxc - minc
    ones = torch.ones_like(maxc)
    sat = channels_range / torch.where(eqc, ones, maxc)
    divisor = torch.where(eqc, ones, channels_range).unsqueeze_(1)
    rc, gc, bc = ((maxc.unsqueeze(1) - x) / divisor).unbind(1)
    neq_r, eq_g = maxc != r, maxc == g
    hg = rc.add(2.0).sub_(bc).mul_(eq_g & neq_r)
    hr = bc.sub_(gc).mul_(~neq_r)
    hb = gc.add_(4.0).sub_(rc).mul_(neq_r.logical_and_(eq_g.logical_not_()))
    h = hr.add_(hg).add_(hb).mul_(1.0 / 6.0).add_(1.0).fmod_(1.0)
    h = h.add_(shift.view(-1, 1, 1)).remainder_(1.0)
    # HSV -> RGB, as torchvision's _hsv_to_rgb.
    h6 = h.mul_(6)
    i = torch.floor(h6)
    frac = h6.sub_(i)
    i = i.to(dtype=torch.int64).remainder_(6)
    sxf = sat * frac
    one_minus_s = 1.0 - sat
    q = (1.0 - sxf).mul_(maxc).clamp_(0.0, 1.0)
    t = sxf.add_(one_minus_s).mul_(maxc).clamp_(0.0, 1.0)
    p = one_minus_s.mul_(maxc).clamp_(0.0, 1.0)
    vpqt = torch.stack((maxc, p, q, t), dim=1)
    return vpqt.gather(1, _hsv_select(x.device)[:, i].moveaxis(0, 1))


_HSV_SELECT: dict = {}


def _hsv_select(device) -> torch.Tensor:
    """torchvision's table of which of (v, p, q, t) each RGB channel takes in each sixth of the hue
    circle, on ``device``, made once per device by fill kernels (``torch.tensor(..., device="cuda")``
    would be a blocking copy from the host)."""
    table = _HSV_SELECT.get(device)
    if table is None:
        rows = ((0, 2, 1, 1, 3, 0), (3, 0, 0, 2, 1, 1), (1, 1, 3, 0, 0, 2))
        table = torch.stack([torch.full((), v, dtype=torch.int64, device=device) for row in rows for v in row])
        _HSV_SELECT[device] = table = table.view(3, 6)
    return table


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

