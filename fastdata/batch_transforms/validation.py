"""What a batch_transforms list may hold: refusals, each saying what to do instead, of what cannot work on
fastdata's normalized device batches, found inside compositions too."""
from __future__ import annotations

import inspect

import torch

from .base import BatchTransform


def describe(t, limit: int = 80) -> str:
    """``t`` named for an error message: a function by its name, anything else by its repr, cut at ``limit``."""
    if inspect.isfunction(t) or inspect.ismethod(t):
        return f"function {t.__name__}"   # its repr's address and qualname say less
    text = repr(t).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


PER_SAMPLE = ("batch transforms get the whole normalized float (N, C, H, W) batch on the device; "
               "per-sample PIL transforms belong on the source, ImageFolder(root, transform=...) or a "
               "torch Dataset, read by the torch/prefetch backends")


#: torchvision transforms that assume pixels in [0, 1] (or uint8): they clamp to that range, threshold
#: in it, or mix channels by luma weights, none of which holds for a normalized batch (measured: v2's
#: ColorJitter(brightness=0.01) changed 69-96% of the pixels). GaussianNoise is refused too unless built
#: with clip=False (it clamps to [0, 1] by default). Geometric transforms and blurs are exact on
#: normalized values (per-channel affine maps commute with them) and pass.
_PIXEL_RANGE = ("ColorJitter", "RandomPhotometricDistort", "RandomAutocontrast", "RandomAdjustSharpness",
                "RandomEqualize", "RandomPosterize", "RandomSolarize", "RandomInvert", "Grayscale",
                "RandomGrayscale", "AutoAugment", "RandAugment", "TrivialAugmentWide", "AugMix")


def _check_torchvision(where: str, t) -> None:
    """Refuse the torchvision transforms that cannot work on fastdata's batches, saying what to do."""
    import torchvision.transforms as v1  # noqa: PLC0415  (only when a torchvision object is given)
    from torchvision.transforms import v2  # noqa: PLC0415

    def classes(*names):
        return tuple(getattr(m, n) for m in (v1, v2) for n in names if hasattr(m, n))

    name = type(t).__name__
    if isinstance(t, classes("Normalize", "ToDtype", "ConvertImageDtype")):
        raise TypeError(f"{where} is torchvision's {name}: fastdata already hands over normalized float "
                        f"batches; drop it and pass mean=/std= (and dtype=) to make_loader")
    if isinstance(t, classes("ToTensor", "PILToTensor", "ToImage", "ToPILImage")):
        raise TypeError(f"{where} is torchvision's {name}, a conversion of PIL images: {PER_SAMPLE}")
    if isinstance(t, classes(*_PIXEL_RANGE)) or (isinstance(t, classes("GaussianNoise"))
                                                 and getattr(t, "clip", True)):
        fastdata_one = {"ColorJitter": "ColorJitter", "Grayscale": "RandomGrayscale(p=1.0)",
                        "RandomGrayscale": "RandomGrayscale"}.get(name)
        instead = (f"use fastdata.batch_transforms.{fastdata_one}, which un-normalizes with the loader's "
                   f"mean/std, applies torchvision's operation and normalizes again" if fastdata_one else
                   "run it per sample on the source (ImageFolder(root, transform=...) or a torch Dataset, "
                   "read by the torch/prefetch backends)")
        raise TypeError(f"{where} is torchvision's {name}, which takes images in [0, 1] (or uint8): fastdata's "
                        f"batches are already normalized (about mean 0, std 1 per channel), so its clamping, "
                        f"thresholds and channel mixing would silently change most pixels; {instead}")
    if isinstance(t, classes("MixUp", "CutMix")):
        raise TypeError(f"{where} is torchvision's {name}, which needs the labels: use "
                        f"fastdata.batch_transforms.{'MixUp' if name == 'MixUp' else 'CutMix'} (same "
                        f"semantics, soft labels, draws from the batch's seed)")


def composition_parts(t) -> list[tuple[str, object]]:
    """The transforms ``t`` composes, each with its place (``.transforms[1]``, ``[0]``): a ``.transforms``
    list or ModuleList (torchvision's Compose, RandomApply, RandomChoice, RandomOrder, v1 and v2), else
    an ``nn.Module``'s children (``nn.Sequential``, torchvision's composition for scripted transforms,
    and any module wrapping one). Empty for a leaf.

    Args:
        t: a transform.
    """
    children = getattr(t, "transforms", None)
    if isinstance(children, (list, tuple, torch.nn.ModuleList)):
        return [(f".transforms[{i}]", child) for i, child in enumerate(children)]
    if isinstance(t, torch.nn.Module):
        return [(f"[{n}]" if n.isdigit() else f".{n}", child) for n, child in t.named_children()]
    return []


def _check_composed(where: str, t, seen: set) -> None:
    """``t`` and, recursively, every transform it composes: a refused torchvision transform inside an
    ``nn.Sequential`` or a RandomApply is refused as it is on its own, named by its place."""
    if type(t).__module__.startswith("torchvision"):
        _check_torchvision(where, t)
    seen.add(id(t))
    for place, child in composition_parts(t):
        if id(child) in seen:   # a module reachable twice (shared, or a cycle) is checked once
            continue
        if isinstance(child, BatchTransform):
            raise TypeError(f"{where} holds fastdata's {type(child).__name__} at {place.lstrip('.')}: fastdata "
                            f"batch transforms go directly in the batch_transforms list (OneOf chooses "
                            f"between them), not inside a torchvision container or module")
        _check_composed(f"{where}{place}", child, seen)


def check_one(where: str, t) -> None:
    """Refuse ``t`` (named ``where`` in errors) if it cannot work as a batch transform (check_batch_transforms)."""
    if isinstance(t, type):
        raise TypeError(f"{where} is the class {t.__name__}, not a transform: pass an instance, "
                        f"e.g. {t.__name__}(...)")
    if not callable(t):
        raise TypeError(f"{where} is not callable: {describe(t)} ({type(t).__name__}); a batch transform is a "
                        f"fastdata.batch_transforms.BatchTransform or a callable taking the batch of images")
    if isinstance(t, BatchTransform):
        _check_signature(where, t)
        return
    _check_composed(f"{where} ({describe(t)})", t, set())
    if type(t).__module__.startswith("torchvision"):
        return
    if type(t).__module__.startswith("timm") and type(t).__name__ in ("Mixup", "FastCollateMixup"):
        raise TypeError(f"{where} is timm's {type(t).__name__}, which takes (images, targets) and mixes them in "
                        f"place: use fastdata's, which know the class count and draw from the batch's seed. "
                        f"timm's Mixup(mixup_alpha=a, cutmix_alpha=c, prob=p, switch_prob=s, label_smoothing=e) is "
                        f"OneOf([MixUp(a, label_smoothing=e), CutMix(c, label_smoothing=e), lambda x: x], "
                        f"weights=(p * (1 - s), p * s, 1 - p)) (drop a branch whose alpha is 0, and the identity "
                        f"when p is 1)")
    try:
        signature = inspect.signature(t)
    except (TypeError, ValueError):  # builtins and C callables may have none: they are tried at the first batch
        return
    try:
        signature.bind(object())
    except TypeError:
        raise TypeError(f"{where} ({describe(t)}) cannot be called with one argument, the images: its signature "
                        f"is {signature}. A plain callable gets only the images; a transform that takes the "
                        f"labels too subclasses fastdata.batch_transforms.BatchTransform and implements "
                        f"__call__(images, labels, generator)") from None


def _check_signature(where: str, t: BatchTransform) -> None:
    """Refuse a BatchTransform whose ``__call__`` cannot take (images, labels, generator): a subclass
    that forgot the generator failed at the first batch, with Python's words about a missing argument."""
    try:
        signature = inspect.signature(t)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object(), object(), object())
    except TypeError:
        raise TypeError(f"{where} ({describe(t)}) cannot be called as __call__(images, labels, generator): "
                        f"its signature is {signature}. A BatchTransform gets the batch's generator too "
                        f"(draw every random number from it); a callable of the images alone needs no "
                        f"BatchTransform") from None


def check_batch_transforms(value) -> tuple:
    """``LoaderConfig.batch_transforms`` as a tuple of transforms; what cannot work is refused here.

    Refused, each with what to do instead: non-callables, classes instead of instances, callables that
    cannot take the images as their one argument, torchvision's Normalize/ToDtype/ConvertImageDtype
    (fastdata already normalizes: pass ``mean=``/``std=``), its transforms that assume pixels in [0, 1]
    (``_PIXEL_RANGE``: colour jitter, grey, autocontrast, equalize, AutoAugment...), its PIL conversions
    (ToTensor, PILToTensor, ToImage, ToPILImage: a per-sample pipeline that belongs on the source), its
    MixUp/CutMix and timm's Mixup (use fastdata's), and fastdata transforms nested inside a torchvision
    container.
    Compositions are walked recursively (``composition_parts``: ``nn.Sequential``, Compose, RandomApply,
    RandomChoice, RandomOrder, a module's children), so a refused transform is refused wherever it sits.

    Args:
        value: None, one callable, or a list/tuple of callables.
    """
    if value is None:
        return ()
    if callable(value) and not isinstance(value, (tuple, list)):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"batch_transforms must be a list of callables, got {type(value).__name__}")
    for i, t in enumerate(value):
        check_one(f"batch_transforms[{i}]", t)
    return tuple(value)

