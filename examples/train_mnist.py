"""Train fastdata's SmallCNN on MNIST (or synthetic digits when MNIST is not there) with any backend.

    python examples/train_mnist.py --backend memory --epochs 3
    python examples/train_mnist.py --data synthetic                            # no MNIST, no network
    torchrun --nproc-per-node 2 examples/train_mnist.py --backend torch      # DDP, one shard per rank

Defaults (SGD with Nesterov momentum, a one-cycle schedule peaking at lr 0.1, batch 256, 3 epochs)
reach ≥99% test accuracy on MNIST. ``--batch-size`` is per process, as in torchvision's references.
``--data auto`` (the default) uses MNIST from ``--data-root``, downloading it unless ``--no-download``,
and falls back to synthetic digits when it cannot be had. Preparation runs once per node (local rank 0
of each node, the others wait): the MNIST download into that node's ``--data-root``, or drawing the
synthetic digits, which are kept in ``--data-root/synthetic`` so that the node's other ranks and later
runs load them instead of drawing them again (70,000 digits take over a minute on one core).

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29400 examples/train_mnist.py --backend memory   # and --node-rank 1 on node 2
``--json-out`` writes the result as one JSON object: the whole-run figures, ``history`` (each epoch's
record, with its ``lr``) and ``config`` (every flag as given, the workers, recipe, optimizer and
scheduler they resolved to).

What the loop records: ``--profile DIR`` writes a torch.profiler trace of a few steps (TensorBoard or
ui.perfetto.dev open it) and prints where each step's time went (data wait, copy, forward/backward,
optimizer); ``--log-dir DIR`` writes the run log (epochs.csv, steps.csv, TensorBoard scalars) and, at the
end, ``DIR/curves.png``. ``--compile reduce-overhead`` records the step into CUDA graphs (MNIST's small
CNN is launch-bound on a GPU); ``--gradient-checkpointing`` trades compute for activation memory.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import time
from pathlib import Path

import numpy as np
import torch

from fastdata import cli, make_loader
from fastdata import distributed as fdist
from fastdata.datasets import MNIST, ArraySource, SyntheticDigits
from fastdata.engine import AMP_CHOICES, fit, resolve_scheduler_interval
from fastdata.models import SmallCNN
from fastdata.report import report_run, run_result


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The command line, as a parser other scripts and the tests reuse."""
    p = argparse.ArgumentParser(description="Train a small CNN on MNIST digits with a fastdata backend",
                                add_help=add_help,
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--backend", default="auto", type=cli.backend, metavar=cli.backend_metavar(),
                   help="data-loading backend")
    p.add_argument("--epochs", type=cli.positive_int, default=3, help="passes over the training set (default 3)")
    p.add_argument("--batch-size", type=cli.positive_int, default=256, help="per process")
    p.add_argument("--lr", type=cli.positive_float, default=0.1, help="peak learning rate of the one-cycle schedule")
    p.add_argument("--device", default=None, type=cli.device, help="cpu, cuda or cuda:N (default: CUDA when available)")
    p.add_argument("--amp", default="auto", choices=AMP_CHOICES,
                   help="auto: bf16 (or fp16) on CUDA, off on CPU")
    cli.add_loop_args(p)   # --compile [MODE], --gradient-checkpointing, --profile DIR, --log-dir DIR
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=False,
                   help="channels-last model and batches")
    cli.add_digits_args(p)   # --data, --data-root, --download, --train-size, --test-size
    p.add_argument("--workers", type=cli.nonnegative_int, default=None,
                   help="loader workers (default: the usable cores)")
    p.add_argument("--seed", type=cli.seed, default=0, help="data order, augmentation and initial weights (default 0)")
    p.add_argument("--checkpoint", default=None, metavar="PATH", help="save here every epoch")
    p.add_argument("--checkpoint-every", type=cli.positive_int, default=None, metavar="BATCHES",
                   help="also save every BATCHES batches (under --accumulate, at the end of the optimizer step "
                        "the save falls in)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    cli.add_step_args(p)   # --accumulate, --clip-grad-norm, --ema
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json-out", default=None, metavar="PATH", help="write the results as one JSON object")
    return p


def prepare_digits(args) -> str:
    """What one rank per node does before any rank reads data (``fdist.prepare_per_node``): fetch MNIST
    into ``--data-root`` (``--data auto``/``mnist``), else draw the synthetic digits and keep them there.
    Returns what this node has: ``"mnist"`` or ``"synthetic"``."""
    if args.data in ("auto", "mnist"):
        try:
            # torchvision's download chatter would bury the one line that matters below.
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                MNIST(args.data_root, train=True, download=args.download)
                MNIST(args.data_root, train=False, download=args.download)
            return "mnist"
        except FileNotFoundError:
            if args.data == "mnist":
                raise
    for train, n in ((True, args.train_size or 60_000), (False, args.test_size or 10_000)):
        path = _synthetic_path(args, train, n)
        if not path.is_file():
            digits = SyntheticDigits(n, train=train, seed=args.seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written under a temporary name and renamed: a reader never sees half a file, and nodes
            # sharing a file system may both write it.
            tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
            np.savez(tmp, images=digits.images, labels=digits.labels)
            os.replace(tmp, path)
            node = os.environ.get("GROUP_RANK", "0")
            print(f"node {node}: drew {n:,} synthetic {'training' if train else 'test'} digits into '{path}'",
                  flush=True)
    return "synthetic"


def _synthetic_path(args, train: bool, n: int) -> Path:
    return Path(args.data_root) / "synthetic" / f"digits-{'train' if train else 'test'}-{n}-seed{args.seed}.npz"


def _synthetic(args, train: bool, n: int) -> ArraySource:
    """The synthetic digits the node prepared (drawn here when its file is missing: a node that fetched
    MNIST while another could not)."""
    path = _synthetic_path(args, train, n)
    if path.is_file():
        with np.load(path) as f:
            images, labels = f["images"], f["labels"]
    else:
        digits = SyntheticDigits(n, train=train, seed=args.seed)
        images, labels = digits.images, digits.labels
    # One kind of source whether drawn or read: the loader's saved position names the source's kind.
    return ArraySource(images, labels, name="synthetic", digits=True, num_classes=10)


def load_digits(args, device) -> tuple[object, object, str]:
    """(train, test, dataset name) as chosen by ``--data``, after the per-node preparation.

    The dataset is a decision every rank must share: MNIST only when every node has it."""
    try:
        have = fdist.prepare_per_node(prepare_digits, args, what=f"preparing the digits in '{args.data_root}'")
    except (FileNotFoundError, fdist.PreparationError) as e:   # --data mnist without MNIST on some node
        # A rank that only waited for another's failure (PreparationError) stays quiet when that one said it.
        raise cli.exit_with(f"error: --data mnist: {e}", relay=isinstance(e, fdist.PreparationError)) from None
    lacking = fdist.all_sum(torch.tensor([float(have != "mnist")], device=device)).item()
    if have == "mnist" and not lacking:
        train = MNIST(args.data_root, train=True, download=False)
        test = MNIST(args.data_root, train=False, download=False)
        return cli.first_digits(train, args.train_size), cli.first_digits(test, args.test_size), "mnist"
    if args.data == "auto" and fdist.is_main():
        how = "could not be downloaded" if args.download else "--no-download was given"
        where = f"on {int(lacking)} of {fdist.world_size()} ranks" if fdist.world_size() > 1 else ""
        print(f"MNIST is not in '{args.data_root}'{where and ' ' + where} and {how}: "
              f"training on synthetic digits instead ({args.train_size or 60_000:,} train / "
              f"{args.test_size or 10_000:,} test)", flush=True)
    train = _synthetic(args, True, args.train_size or 60_000)
    test = _synthetic(args, False, args.test_size or 10_000)
    return train, test, "synthetic"


def main(args) -> dict:
    """Train and evaluate as ``args`` says; return the run's result (``fastdata.report.run_result``)."""
    cli.check_training_args(get_args_parser(), args)   # --resume, output paths: before any work
    device = fdist.init_distributed(args.device)
    ok = False  # a failed rank must not wait at a barrier its peers may never reach
    try:
        torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        with cli.input_errors(f"--data-root '{args.data_root}'"):
            train_src, test_src, dataset = load_digits(args, device)
        common = dict(device=device, num_workers=args.workers, seed=args.seed, channels_last=args.channels_last)
        with cli.input_errors(f"--backend {args.backend} with --batch-size {args.batch_size}"):
            train_loader = make_loader(train_src, args.backend, batch_size=args.batch_size, train=True, **common)
            # like=: the test digits are normalized with the training set's statistics, not their own.
            test_loader = make_loader(test_src, args.backend, like=train_loader,
                                      batch_size=max(args.batch_size, 1024))
        model = SmallCNN(num_classes=10, in_channels=1)
        # Fused on CUDA: GradScaler hands a fused optimizer its inf check as a device tensor; any other
        # makes it read the check with .item(), one host sync per fp16 step. (fit moves the model to
        # the device before the first step, where torch checks that fused parameters are on CUDA.)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                    weight_decay=5e-4, fused=True if device.type == "cuda" else None)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=max(args.epochs, 1),
                                                        steps_per_epoch=-(-len(train_loader) // args.accumulate))
        start = time.perf_counter()
        # A --checkpoint that is not one, or one of another run, and Ctrl-C (saying how to resume, exit
        # 130): one line, no traceback.
        with cli.fit_errors(args):
            history = fit(model, train_loader, epochs=args.epochs, optimizer=optimizer, scheduler=scheduler,
                          eval_loader=test_loader, amp=args.amp, **cli.loop_kwargs(args),
                          channels_last=args.channels_last, checkpoint=args.checkpoint, resume=args.resume,
                          checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
                          accumulate=args.accumulate, clip_grad_norm=args.clip_grad_norm, ema=args.ema)
        # --json-out records what ran: every flag as given (the resolved device and amp are the result's
        # own keys), and what the defaults resolved to.
        config = {**vars(args), "num_workers": train_loader.config.num_workers,
                  "augment": train_loader.augment, "optimizer": "SGD(momentum=0.9, nesterov, weight_decay=5e-4)",
                  "scheduler": type(scheduler).__name__,
                  "scheduler_interval": resolve_scheduler_interval(scheduler)}
        result = run_result(history, train_loader=train_loader, backend=args.backend, device=device, amp=args.amp,
                            wall_seconds=time.perf_counter() - start, dataset=dataset, epochs=args.epochs,
                            batch_size=args.batch_size, config=config)
        report_run(result, accuracy_name=f"{dataset} test accuracy", json_out=args.json_out)
        cli.plot_run_log(args.log_dir)   # --log-dir: DIR/curves.png (one line without matplotlib)
        for loader in (train_loader, test_loader):
            loader.close()
        ok = True
        return result
    finally:
        fdist.cleanup(barrier=ok)



def run(argv=None) -> dict:
    """The command line: ``main`` on the parsed flags. Ctrl-C before training too (drawing the digits,
    building a loader's cache: the slow part of a first run) is one line, not a traceback."""
    args = get_args_parser().parse_args(argv)
    with cli.fit_errors(args):
        return main(args)


if __name__ == "__main__":
    run()
