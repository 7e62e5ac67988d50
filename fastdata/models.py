"""A small CNN for digits: ≥99% on MNIST in a few GPU epochs, and quick enough to train on two CPU cores."""
from __future__ import annotations

from torch import nn


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    """A 3x3 convolution (same size), BatchNorm and ReLU."""
    # No conv bias: the BatchNorm right after it has its own shift, so a bias would be dead weight.
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """conv-bn-relu blocks with max-pooling, then global average pooling and one linear layer.

    Average (not max) pooling at the end keeps the logits at the scale BatchNorm gives the features;
    with global max-pooling the loss spiked to >10 at lr 0.05 in the first steps.

    Cost is kept low where the images are large: one ``width``-channel conv at full resolution, two
    at half, one at quarter, so a 28x28 image costs ~15 M multiply-adds (~131k parameters with the
    default ``width=32``). Pooling to 1x1 makes the network accept any input size.

    Args:
        num_classes: outputs of the final linear layer.
        in_channels: 1 for grey digits, 3 for colour images.
        width: channels of the first block; later blocks use 2x and 4x.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32):
        super().__init__()
        if num_classes < 1 or in_channels < 1 or width < 1:
            raise ValueError(f"num_classes, in_channels and width must be >= 1, got "
                             f"{num_classes}, {in_channels}, {width}")
        w = width
        self.features = nn.Sequential(
            conv_bn(in_channels, w),
            nn.MaxPool2d(2),                 # 28 → 14
            conv_bn(w, 2 * w),
            conv_bn(2 * w, 2 * w),
            nn.MaxPool2d(2),                 # 14 → 7
            conv_bn(2 * w, 4 * w),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(4 * w, num_classes)

    def forward(self, x):
        """Logits ``(N, num_classes)`` for images ``(N, in_channels, H, W)``; N may be 0 (DDP's empty ranks)."""
        return self.classifier(self.features(x).flatten(1))


def create_model(name: str, *, num_classes: int, in_channels: int = 3) -> nn.Module:
    """An untrained image classifier by name: ``smallcnn`` (``SmallCNN``), a torchvision classification
    model (``resnet18``, ``vit_b_16``, ...; looked up first), or a timm model (``timm.create_model``)
    when timm is installed.

    Never downloads anything: torchvision's builders get ``weights=None`` and timm's
    ``pretrained=False`` (a hub name such as ``hf-hub:...`` is not a model name here: timm would fetch
    its config). torchvision's detection, segmentation, video and optical-flow models are refused:
    their builders take other arguments and download a pretrained backbone by default.

    Args:
        name: the model's name (case-insensitive for smallcnn and torchvision, as torchvision does).
        num_classes: outputs of the classifier.
        in_channels: image channels; torchvision's models take 3 whatever this says (a model that cannot
            take the images fails on its first forward), timm's get ``in_chans``.

    Raises:
        ValueError: an unknown name (saying where it looked), or a model that cannot be built with
            these arguments (naming the call and the library's error).
    """
    if name.lower() == "smallcnn":
        return SmallCNN(num_classes=num_classes, in_channels=in_channels)
    import torchvision

    classifiers = torchvision.models.list_models(torchvision.models)
    if name.lower() in classifiers:
        call = f"torchvision.models.get_model_builder({name!r})(weights=None, num_classes={num_classes})"
        return _built(call, lambda: torchvision.models.get_model_builder(name)(weights=None, num_classes=num_classes))
    timm = _timm()
    if timm is not None and timm.is_model(name):
        # in_chans only when it differs from timm's default: not every model's constructor takes it.
        extra = {"in_chans": in_channels} if in_channels != 3 else {}
        call = (f"timm.create_model({name!r}, pretrained=False, num_classes={num_classes}"
                + "".join(f", {k}={v}" for k, v in extra.items()) + ")")
        return _built(call, lambda: timm.create_model(name, pretrained=False, num_classes=num_classes, **extra))
    try:
        kind = torchvision.models.get_model_builder(name).__module__.split(".")[2]   # torchvision.models.<kind>.x
    except ValueError:
        kind = None
    if kind is not None:
        raise ValueError(f"{name!r} is a torchvision {kind} model, not an image classifier; choose a classifier "
                         f"(torchvision.models.list_models(torchvision.models): {', '.join(classifiers[:6])}, ...)")
    where = (f"timm's {len(timm.list_models())} models (timm.list_models())" if timm is not None
             else "timm's models: timm is not installed (pip install timm)")
    raise ValueError(f"unknown model {name!r}; choose from smallcnn, torchvision's classification models "
                     f"{classifiers}, or {where}")


def _timm():
    try:
        import timm
    except ImportError:   # optional: only timm's names need it
        return None
    return timm


def _built(call: str, build) -> nn.Module:
    """``build()``, with any error raised as a ValueError that names ``call`` (the library's own errors
    for a model that needs other arguments are a TypeError deep in its constructor)."""
    try:
        return build()
    except Exception as e:
        lines = str(e).strip().splitlines()
        raise ValueError(f"{call} failed: {type(e).__name__}" + (f": {lines[0]}" if lines else "")) from e
