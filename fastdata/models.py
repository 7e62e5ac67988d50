"""Models for training and benchmarks: a small CNN for digits (≥99% on MNIST in a few GPU epochs, quick enough
to train on two CPU cores), classifiers by name (``create_model``), and gradient checkpointing over a
model's sequential blocks (``checkpoint_blocks``)."""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .checks import check_integer


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
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels), ("width", width)):
            check_integer(f"SmallCNN: {name}", value, minimum=1)
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


# ------------------------------------------------------------------------ gradient checkpointing
_SUPPORTED = ("SmallCNN (its features), a torchvision ResNet/ResNeXt/Wide ResNet (layer1..layer4), an "
              "nn.Sequential (its children), or a timm model with set_grad_checkpointing()")


def checkpoint_blocks(model: nn.Module, *, segments: int | None = None) -> nn.Module:
    """Turn on gradient checkpointing over ``model``'s sequential blocks; returns ``model`` (changed in place).

    A checkpointed block keeps only its input for the backward pass and runs its forward again there:
    activation memory falls to about one block's worth plus the block boundaries, for roughly one
    extra forward of compute (~30% more step time). It is what lets a large batch or a large model
    fit on a small GPU when accumulation (``fit(accumulate=N)``) is not enough.

    What is split: ``SmallCNN``'s ``features``; a torchvision ResNet's ``layer1``..``layer4`` (each block
    of each layer); an ``nn.Sequential``'s children. A timm model is handed to its own
    ``set_grad_checkpointing(True)``. Uses ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
    which needs no input that requires grad and works with DDP, autocast and ``torch.compile``.

    The model's ``state_dict`` keys, ``deepcopy`` and pickling are unchanged: the Sequentials only change
    class (to a subclass whose forward checkpoints), no wrapper module is inserted. Under ``no_grad``
    (evaluation) the forward runs as before. BatchNorm running statistics are updated once per step,
    as without checkpointing, for every kind of model here, timm's included: the recomputation in
    backward updates throw-away copies (a plain checkpoint applies the momentum twice and drifts the
    statistics used in evaluation; see ``_count_statistics_once``).

    Args:
        model: the unwrapped model (before DDP or ``torch.compile``).
        segments: checkpointed chunks per Sequential (consecutive blocks grouped); None: one per block,
            the most memory saved. Fewer segments store fewer boundaries but recompute longer chunks.

    Raises:
        ValueError: a model of another kind (naming its type and the kinds supported), or a bad ``segments``.

    How ``fit(gradient_checkpointing=True)`` wires it: ``checkpoint_blocks(raw)`` on the unwrapped model
    in ``TrainStep.build``, before ``wrap`` (DDP, compile).
    """
    # segments: chunks per Sequential; None: one per block.
    check_integer("segments", segments, minimum=1, optional=True)
    switch = getattr(model, "set_grad_checkpointing", None)
    if switch is not None:
        # timm's own switch knows each architecture's stages (and its own segment layout).
        switch(True)
    else:
        _split_sequentials(model, segments)
    _count_statistics_once(model)
    return model


def _split_sequentials(model: nn.Module, segments: int | None) -> None:
    if isinstance(model, SmallCNN):
        targets = [model.features]
    elif all(isinstance(getattr(model, f"layer{i}", None), nn.Sequential) for i in range(1, 5)):
        targets = [getattr(model, f"layer{i}") for i in range(1, 5)]
    elif isinstance(model, nn.Sequential):
        targets = [model]
    else:
        raise ValueError(f"checkpoint_blocks cannot split a {type(model).__module__}.{type(model).__name__} into "
                         f"blocks; it supports {_SUPPORTED}. For another model, wrap its blocks' calls in "
                         f"torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) in its forward")
    for seq in targets:
        if not isinstance(seq, CheckpointedSequential):
            seq.__class__ = _checkpointed_class(type(seq))
        # The class swap is invisible to a type checker: seq is a CheckpointedSequential from here on.
        cast(CheckpointedSequential, seq).checkpoint_segments = segments


class CheckpointedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose forward checkpoints its blocks while gradients are recorded.

    Made by ``checkpoint_blocks`` (which swaps a Sequential's class to this one); not built directly.
    ``checkpoint_segments``: chunks of consecutive blocks, each one checkpoint (None: one per block).
    """

    checkpoint_segments: int | None = None

    def forward(self, x):
        """The blocks in order; each chunk under ``torch.utils.checkpoint`` when grad is enabled."""
        blocks = list(self)
        if not torch.is_grad_enabled() or not blocks:
            return super().forward(x)
        from torch.utils.checkpoint import checkpoint

        n = len(blocks) if self.checkpoint_segments is None else min(self.checkpoint_segments, len(blocks))
        bounds = [round(i * len(blocks) / n) for i in range(n + 1)]
        for start, end in zip(bounds, bounds[1:]):
            chunk = blocks[start:end]
            x = checkpoint(_run_chunk, chunk, x, use_reentrant=False)
        return x


def _run_chunk(chunk, x):
    for block in chunk:
        x = block(x)
    return x


# The buffers torch's normalization layers update in a training forward (BatchNorm, SyncBatchNorm,
# InstanceNorm with track_running_stats, and subclasses such as timm's BatchNormAct2d).
_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
_KEPT, _HOOKED = "_fastdata_kept_statistics", "_fastdata_statistics_once"


def _count_statistics_once(model: nn.Module) -> None:
    """Make every module of ``model`` that keeps running statistics update them once per training step
    under checkpointing, whoever calls the checkpoint (this module's Sequentials, or timm's own
    ``checkpoint_seq``, reentrant or not).

    A checkpoint runs each block's forward a second time in backward, with the module still in training
    mode, so BatchNorm would apply its momentum twice. A context around our own ``checkpoint`` call
    cannot reach timm's calls; a hook on each normalization module can. The recomputation is told apart
    by running inside the autograd engine (``torch._C._current_graph_task_id() != -1``, the id
    torch.utils.checkpoint itself keys its recomputations by): a model's real forward never does. There
    the module's statistics buffers are swapped for copies, which the recomputation updates and the
    hook afterwards drops. Swapping, instead of copying the old values back, leaves the real buffers
    untouched, so no version counter moves under a reentrant checkpoint's saved tensors. A training
    forward normalizes with the batch's statistics, not these buffers, so the recomputed activations
    and the gradients do not change. Under ``torch.compile`` the hooks do nothing: the compiled graph
    applies the buffer update once (its backward recomputes values, not mutations). Hooks are
    module-level functions, so ``deepcopy`` and pickling keep them.
    """
    for module in model.modules():
        if _statistics(module) and not module.__dict__.get(_HOOKED):   # once, if called again
            module.register_forward_pre_hook(_use_copies_in_backward)
            module.register_forward_hook(_put_statistics_back, always_call=True)
            module.__dict__[_HOOKED] = True   # our own mark, copied and pickled with the hooks


def _statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b for name, b in module.named_buffers(recurse=False) if name in _STATISTICS}


def _use_copies_in_backward(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling() or not module.training or torch._C._current_graph_task_id() == -1:
        return
    kept = _statistics(module)
    for name, buffer in kept.items():
        setattr(module, name, buffer.clone())   # a registered buffer's name: nn.Module swaps the buffer
    module.__dict__[_KEPT] = kept


def _put_statistics_back(module: nn.Module, args, output) -> None:
    # always_call: also when the recomputation stops early (torch.utils.checkpoint raises inside it once
    # it has what backward needs) or fails.
    if torch.compiler.is_compiling():
        return
    for name, buffer in module.__dict__.pop(_KEPT, {}).items():
        setattr(module, name, buffer)


_CLASSES: dict[type, type] = {}


def _checkpointed_class(base: type) -> type:
    """``CheckpointedSequential`` itself for a plain Sequential; for a Sequential subclass, a class deriving
    from both (its own methods kept, the checkpointing forward first)."""
    if base is nn.Sequential:
        return CheckpointedSequential
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Checkpointed{base.__name__}", (CheckpointedSequential, base), {})
    return _CLASSES[base]
