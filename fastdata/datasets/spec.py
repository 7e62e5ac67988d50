"""A source named on a command line (``python -m fastdata bench SOURCE``, ``python -m fastdata pack SOURCE
OUT``): one parser for every command, so a name means the same source to each."""
from __future__ import annotations

from pathlib import Path

from ..checks import check_choice
from ..shards.index import INDEX_NAME

#: The splits a source named by path has (MNIST, digits); None means train.
SPLITS = ("train", "test")

#: The help text of a SOURCE argument (the forms ``open_source`` takes).
SOURCE_HELP = ("'digits' (synthetic), an MNIST root (a folder holding MNIST/raw), an image folder "
               "(one sub-folder per class), or a pack of shards (a folder or an http(s)://, s3://, gs:// "
               "... URL holding index.json)")


def open_source(spec, *, split: str | None = None, digits: int | None = None):
    """The source ``spec`` names: ``digits`` (synthetic digits), an MNIST root (a folder holding
    ``MNIST/raw``), an image folder (one sub-folder per class), or shards written by ``pack`` (a folder
    holding ``index.json``, or a URL: ``Shards`` reads it, so a pack is resized, resharded or
    benchmarked from the command line as from Python).

    Args:
        spec: the name or path, as the command line gives it (a ``str`` or a path).
        split: ``"train"`` or ``"test"`` (MNIST and digits; None: train). An image folder has no split:
            name its ``train/`` or ``val/`` folder instead, and asking for one is an error.
        digits: how many synthetic digits (None: 60,000 for train, 10,000 for test).

    Raises ``FileNotFoundError`` for a name that is neither ``digits`` nor a folder nor a URL,
    ``ValueError`` for a split that does not apply.
    """
    from . import MNIST, ImageFolder, Shards, SyntheticDigits

    check_choice("split", split, (None, *SPLITS))
    train = split != "test"
    if str(spec) == "digits":
        return SyntheticDigits(digits or (60_000 if train else 10_000), train=train)
    is_url = "://" in str(spec)
    root = Path(spec)
    if not is_url and not root.is_dir():
        raise FileNotFoundError(f"'{spec}' is neither 'digits' nor a folder nor a URL of shards")
    if not is_url and (root / "MNIST" / "raw").is_dir():
        return MNIST(root, train=train, download=False)
    kind = "a pack of shards" if is_url or (root / INDEX_NAME).is_file() else "an image folder"
    if split is not None:
        raise ValueError(f"--split {split} applies to MNIST and digits; '{spec}' is {kind} (name its "
                         f"train/ or val/ folder instead)")
    return ImageFolder(root) if kind == "an image folder" else Shards(str(spec))
