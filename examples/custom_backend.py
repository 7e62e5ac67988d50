"""Writing a backend: a single-threaded loader that reads any source, in one file.

    python examples/custom_backend.py

A backend subclasses ``fastdata.backends.base.Loader`` and implements ``_epoch``: the base class holds
the contract (order and augmentation from the seed, resume, ``len``, superseded iterators, the skip
warning). ``fastdata.decode.decode`` turns sample ids into uint8 images with the shared recipe, so the
batches are the torch backend's, pixel for pixel. ``registry.register`` makes the name known to
``make_loader``, ``available_backends()`` and ``auto``.
"""
from __future__ import annotations

import argparse

import torch

from fastdata import cli, make_loader, registry
from fastdata.backends.base import Loader
from fastdata.datasets import SourceKind, SyntheticDigits
from fastdata.decode import decode


class SimpleLoader(Loader):
    """Decodes each batch on the calling thread when it is asked for: no workers, nothing ahead."""

    name = "simple"
    reads = frozenset({SourceKind.ARRAY, SourceKind.FILES, SourceKind.DATASET})

    def _epoch(self, epoch, batches, start):
        keep_ids = self.ids_keeper()   # which samples each batch holds (loader.batch_ids), this pass's
        for k, ids in enumerate(batches):
            rng = self.batch_rng(epoch, start + k)   # the batch's augmentation seed, from (seed, epoch)
            d = decode(self.source, ids, self.augment, rng, self.config.on_error)
            self.skipped += len(ids) - len(d.kept)   # the one counter; the base class warns
            keep_ids(d.kept)   # on_error="skip" may have dropped some: the rows are these samples
            # uint8 until the device (a quarter of float's bytes), normalized there.
            images = torch.from_numpy(d.images).to(self.device)
            yield self.normalize(images), torch.from_numpy(d.labels).to(self.device)


def register() -> None:
    """Make ``backend="simple"`` known (after every built-in backend in ``auto``'s preference)."""
    registry.register("simple", SimpleLoader)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """No options: the parser answers ``--help`` and refuses a flag it does not know, instead of running
    the demo."""
    return argparse.ArgumentParser(description="Register a one-file backend ('simple') and read an epoch "
                                               "of synthetic digits with it", add_help=add_help)


def main(args: argparse.Namespace | None = None) -> None:
    """Register the backend and read an epoch of synthetic digits with it."""
    register()
    loader = make_loader(SyntheticDigits(2000), "simple", batch_size=250, device="cpu")
    batches = [(images.shape, labels[:8].tolist()) for images, labels in loader]
    print(f"{len(batches)} batches per epoch, shapes {batches[0][0]} ... {batches[-1][0]}; "
          f"first labels {batches[0][1]}")


if __name__ == "__main__":
    with cli.on_ctrl_c():   # Ctrl-C: one line, "interrupted", and exit status 130, not a traceback
        main(get_args_parser().parse_args())
