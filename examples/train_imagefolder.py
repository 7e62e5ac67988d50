"""Train torchvision's ResNet-18 on a JPEG folder in ImageFolder layout (root/<class>/<image>.jpg).

    python examples/train_imagefolder.py --data-root /data/imagenet/train --val-root /data/imagenet/val
    torchrun --nproc-per-node 8 examples/train_imagefolder.py --data-root ... --backend dali

Training uses RandomResizedCrop + flip at ``--image-size``; evaluation resizes the shorter side to
``image-size * 256/224`` and center-crops. SGD with Nesterov momentum and a one-cycle schedule;
``--lr`` is the peak for ``--batch-size`` 256 per process (scaled linearly for other sizes).
``--json-out`` writes the result as one JSON object: the whole-run figures, ``history`` (each epoch's
record, with its ``lr``) and ``config`` (every flag as given, the workers, recipe, optimizer and
scheduler they resolved to).
"""
from __future__ import annotations

import argparse
import time

import torch

from fastdata import Augmentation, cli, make_loader
from fastdata import distributed as fdist
from fastdata.config import ON_ERROR
from fastdata.datasets import ImageFolder
from fastdata.engine import AMP_CHOICES, fit, resolve_scheduler_interval
from fastdata.report import report_run, run_result

# What sets the peak rate, for the refusal of a resume under another (fit's PeakLrChanged).
LR_FLAGS = "--lr (scaled by --batch-size x --accumulate x processes / 256)"


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The command line, as a parser other scripts and the tests reuse."""
    p = argparse.ArgumentParser(description="Train ResNet-18 on an ImageFolder of JPEGs with a fastdata backend",
                                add_help=add_help,
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--data-root", required=True, help="training folder: one sub-folder per class")
    p.add_argument("--val-root", default=None, help="validation folder with the same classes (optional)")
    p.add_argument("--backend", default="auto", type=cli.backend, metavar=cli.backend_metavar(),
                   help="data-loading backend")
    p.add_argument("--epochs", type=cli.positive_int, default=10, help="passes over the training set (default 10)")
    p.add_argument("--batch-size", type=cli.positive_int, default=128, help="per process")
    p.add_argument("--lr", type=cli.positive_float, default=0.2, help="peak learning rate at batch size 256")
    p.add_argument("--image-size", type=cli.positive_int, default=224, help="training / evaluation crop size")
    p.add_argument("--device", default=None, type=cli.device, help="cpu, cuda or cuda:N (default: CUDA when available)")
    p.add_argument("--amp", default="auto", choices=AMP_CHOICES, help="auto: bf16 (or fp16) on CUDA, off on CPU")
    cli.add_loop_args(p)   # --compile [MODE], --gradient-checkpointing, --profile DIR, --log-dir DIR
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                   help="channels-last model and batches (faster convolutions on tensor cores)")
    p.add_argument("--workers", type=cli.nonnegative_int, default=None,
                   help="loader workers (default: the usable cores)")
    p.add_argument("--seed", type=cli.seed, default=0, help="data order, augmentation and initial weights (default 0)")
    p.add_argument("--checkpoint", default=None, metavar="PATH", help="save here every epoch")
    p.add_argument("--checkpoint-every", type=cli.positive_int, default=None, metavar="BATCHES",
                   help="also save every BATCHES batches (under --accumulate, at the end of the optimizer step "
                        "the save falls in)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    cli.add_step_args(p)   # --accumulate, --clip-grad-norm, --ema
    p.add_argument("--on-error", default="raise", choices=ON_ERROR,
                   help="an undecodable image: stop with an error naming it (raise), or leave it out, count "
                        "it and warn (skip; ImageNet's training set holds a few PNG files named .JPEG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json-out", default=None, metavar="PATH", help="write the results as one JSON object")
    return p


def make_optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum; weight decay on weights only, fused on CUDA."""
    # No weight decay on BatchNorm parameters and biases: decaying them only hurts (Goyal et al. 2017).
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": 5e-5}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=lr, momentum=0.9, nesterov=True,
                           # fused on CUDA: no host sync per fp16 step (see train_mnist.py)
                           fused=True if device.type == "cuda" else None)


def make_schedule(optimizer, lr: float, epochs: int, steps: int):
    """The one-cycle schedule over ``epochs`` of ``steps`` optimizer steps (``--accumulate`` batches each)."""
    # A quarter of the steps warm up; OneCycleLR divides by the warm-up's last step index
    # (pct_start * total - 1), so a run of exactly 4 steps warms up over 2 instead.
    pct = 0.25 if epochs * steps != 4 else 0.5
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=epochs, steps_per_epoch=steps,
                                               pct_start=pct)


def main(args) -> dict:
    """Train (and validate) as ``args`` says; return the run's result (``fastdata.report.run_result``)."""
    import torchvision

    cli.check_training_args(get_args_parser(), args)   # --resume, output paths: before any work
    device = fdist.init_distributed(args.device)
    ok = False  # a failed rank must not wait at a barrier its peers may never reach
    try:
        torch.manual_seed(args.seed)
        with cli.input_errors("--data-root"):
            train_src = ImageFolder(args.data_root)
        if train_src.num_classes < 2:
            raise cli.exit_with(f"error: --data-root '{args.data_root}' has one class folder "
                                f"({train_src.classes[0]!r}): a classifier needs at least 2")
        with cli.input_errors("--val-root"):
            val_src = ImageFolder(args.val_root) if args.val_root else None
        if val_src is not None and val_src.classes != train_src.classes:
            raise cli.exit_with(f"error: --val-root has classes {val_src.classes[:5]}... but --data-root has "
                                f"{train_src.classes[:5]}...: they must be the same folders")
        size = args.image_size
        common = dict(device=device, num_workers=args.workers, seed=args.seed, channels_last=args.channels_last)
        with cli.input_errors(f"--backend {args.backend} with --batch-size {args.batch_size}", skip_flag=cli.SKIP_FLAG):
            train_loader = make_loader(train_src, args.backend, batch_size=args.batch_size, train=True,
                                       augment=Augmentation.imagenet_train(size=size), on_error=args.on_error,
                                       **common)
            val_loader = None
            if val_src is not None:
                # like=: the training loader's statistics, device and layout, and its class folders checked.
                val_loader = make_loader(val_src, args.backend, like=train_loader,
                                         augment=Augmentation.imagenet_eval(size=size,
                                                                            resize=round(size * 256 / 224)))
        model = torchvision.models.resnet18(num_classes=train_src.num_classes)
        # The linear scaling rule on the samples of one optimizer step (--accumulate batches of each rank).
        lr = args.lr * args.batch_size * args.accumulate * fdist.world_size() / 256
        optimizer = make_optimizer(model, lr, device)
        scheduler = make_schedule(optimizer, lr, args.epochs, -(-len(train_loader) // args.accumulate))
        start = time.perf_counter()
        # A --checkpoint that is not one, or one of another run, and Ctrl-C (saying how to resume, exit
        # 130): one line, no traceback.
        with cli.fit_errors(args, lr_flags=LR_FLAGS):
            history = fit(model, train_loader, epochs=args.epochs, optimizer=optimizer, scheduler=scheduler,
                          eval_loader=val_loader, amp=args.amp, **cli.loop_kwargs(args),
                          channels_last=args.channels_last, checkpoint=args.checkpoint, resume=args.resume,
                          checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
                          accumulate=args.accumulate, clip_grad_norm=args.clip_grad_norm, ema=args.ema)
        # --json-out records what ran: every flag as given (the resolved device and amp are the result's
        # own keys) and what the defaults resolved to. ``lr`` is the flag, meant for batch 256; ``peak_lr``
        # the one-cycle peak this run's batch size scaled it to.
        config = {**vars(args), "num_workers": train_loader.config.num_workers,
                  "peak_lr": lr, "augment": train_loader.augment,
                  "eval_augment": val_loader.augment if val_loader is not None else None,
                  "optimizer": "SGD(momentum=0.9, nesterov, weight_decay=5e-5 on weights only)",
                  "scheduler": type(scheduler).__name__,
                  "scheduler_interval": resolve_scheduler_interval(scheduler)}
        result = run_result(history, train_loader=train_loader, backend=args.backend, device=device, amp=args.amp,
                            wall_seconds=time.perf_counter() - start, dataset=str(args.data_root),
                            classes=train_src.num_classes, epochs=args.epochs, batch_size=args.batch_size,
                            image_size=size, config=config)
        report_run(result, accuracy_name="validation accuracy", json_out=args.json_out)
        cli.plot_run_log(args.log_dir)   # --log-dir: DIR/curves.png (one line without matplotlib)
        for loader in (train_loader, val_loader):
            if loader is not None:
                loader.close()
        ok = True
        return result
    finally:
        fdist.cleanup(barrier=ok)



def run(argv=None) -> dict:
    """The command line: ``main`` on the parsed flags. Ctrl-C before training too (drawing the digits,
    building a loader's cache: the slow part of a first run) is one line, not a traceback."""
    args = get_args_parser().parse_args(argv)
    with cli.fit_errors(args, lr_flags=LR_FLAGS):
        return main(args)


if __name__ == "__main__":
    run()
