"""Write your own augmentation as a batch transform and train with it, next to fastdata's, on any backend.

    python examples/custom_augmentation.py --backend memory --epochs 3
    python examples/custom_augmentation.py --backend torch --device cpu --limit 6000

A batch transform runs on the normalized batch on the device (images float (N, C, H, W), labels int64
(N,)) after the backend's own crop and flip, so the one below works unchanged with every backend, on the
CPU and on CUDA. It subclasses ``BatchTransform`` to get the batch's labels and a ``torch.Generator``
seeded for this batch: the same seed gives the same batches, and a resumed run the same remaining ones.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from fastdata import cli, make_loader
from fastdata.batch_transforms import BatchTransform, Cutout
from fastdata.datasets import SyntheticDigits
from fastdata.engine import fit
from fastdata.models import SmallCNN
from fastdata.report import report_run, run_result


@dataclass(frozen=True)  # frozen: one object serves every batch (and every DataLoader worker)
class RandomGainAndNoise(BatchTransform):
    """Scale each image's contrast by a random gain and add Gaussian noise.

    In normalized units 0 is the dataset's mean, so multiplying by a gain stretches or flattens each
    image around the mean, and noise of ``noise`` is that fraction of the data's standard deviation.

    Args:
        gain: the gain is drawn per image from [1 - gain, 1 + gain].
        noise: standard deviation of the added noise, in normalized units.
    """

    gain: float = 0.2
    noise: float = 0.1

    def __call__(self, images, labels, generator):
        n, dev = images.shape[0], images.device
        # Every draw from ``generator`` (never the global RNG), on the batch's device: no host sync.
        gain = 1 + (torch.rand(n, generator=generator, device=dev) * 2 - 1) * self.gain
        noise = torch.randn(images.shape, generator=generator, device=dev, dtype=images.dtype)
        # Out of place (the batch may share memory with a backend's cache), and in the batch's dtype:
        # a float32 gain times bf16 images would promote them to float32.
        return images * gain.to(images.dtype).view(-1, 1, 1, 1) + noise * self.noise, labels


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The command line, as a parser other scripts and the tests reuse."""
    p = argparse.ArgumentParser(description="Train a small CNN on synthetic digits with a custom batch "
                                            "transform and Cutout", add_help=add_help,
                                formatter_class=cli.HelpFormatter)
    # fastdata.cli's types: a bad value is argparse's one-line error naming the flag (exit 2), before any work.
    p.add_argument("--backend", default="auto", type=cli.backend, metavar=cli.backend_metavar(),
                   help="data-loading backend")
    p.add_argument("--epochs", type=cli.positive_int, default=3, help="passes over the training set (default 3)")
    p.add_argument("--batch-size", type=cli.positive_int, default=256, help="default 256")
    p.add_argument("--device", default=None, type=cli.device, help="cpu, cuda or cuda:N (default: CUDA when available)")
    p.add_argument("--limit", type=cli.positive_int, default=20_000,
                   help="training images (default 20,000; the test set is a fifth)")
    p.add_argument("--seed", type=cli.seed, default=0, help="data order, augmentation and initial weights (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(args) -> dict:
    """Train and evaluate as ``args`` says; return the run's result (``fastdata.report.run_result``)."""
    torch.manual_seed(args.seed)
    train_src = SyntheticDigits(args.limit, train=True, seed=args.seed)
    test_src = SyntheticDigits(max(args.limit // 5, 1), train=False, seed=args.seed)
    with cli.input_errors(f"--backend {args.backend} with --batch-size {args.batch_size}"):
        train = make_loader(train_src, args.backend, batch_size=args.batch_size, device=args.device,
                            seed=args.seed,
                            # after the digits' own ±2 px translation: ours, then a 10x10 hole
                            batch_transforms=[RandomGainAndNoise(gain=0.2, noise=0.1), Cutout(10)])
        # Evaluation sees the plain images: no batch transforms, the training set's statistics.
        test = make_loader(test_src, args.backend, like=train, batch_size=max(args.batch_size, 512))
    start = time.perf_counter()
    with train, test:   # closed however the run ends, Ctrl-C too: no worker outlives it
        history = fit(SmallCNN(num_classes=10, in_channels=1), train, epochs=args.epochs, eval_loader=test,
                      progress=not args.no_progress)
    result = run_result(history, train_loader=train, backend=args.backend, device=train.device, amp="auto",
                        wall_seconds=time.perf_counter() - start, dataset="synthetic", epochs=args.epochs,
                        batch_size=args.batch_size)
    report_run(result, accuracy_name="synthetic digits test accuracy")
    return result


if __name__ == "__main__":
    with cli.on_ctrl_c():   # Ctrl-C: one line, "interrupted", and exit status 130, not a traceback
        main(get_args_parser().parse_args())
