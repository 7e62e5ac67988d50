"""Train fastdata's SmallCNN on MNIST digits with Hugging Face accelerate and fastdata loaders.

    python examples/accelerate_mnist.py --backend memory --epochs 3
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_mnist.py --data synthetic --cpu
    torchrun --nproc-per-node 2 examples/accelerate_mnist.py --data synthetic --cpu
    python examples/accelerate_mnist.py --ckpt-dir ck --ckpt-every 50 --max-steps 120   # stop mid-epoch ...
    python examples/accelerate_mnist.py --ckpt-dir ck --resume                          # ... and go on there

What fastdata needs from accelerate, and no more:

- The loaders are built after ``Accelerator()`` (the process group exists: each rank reads its own shard)
  on ``accelerator.device``. ``prepare()`` takes them with the model and optimizer and hands them back
  unchanged: accelerate wraps only torch DataLoaders, and a fastdata loader already shards, moves and
  normalizes.
- ``accelerator.register_for_checkpointing(train_loader)``: ``save_state()`` saves only what it
  prepared or was told about, so without this line a resume starts the epoch over, silently.
- The evaluation loader has ``even_batches=True``: every rank's last batch has the same size (the last
  step is padded, as DistributedSampler pads), which ``gather_for_metrics`` needs (uneven shapes abort
  in gloo), and the loader tells accelerate how many gathered samples are real, so the metric counts
  every test image exactly once.

``--data auto`` (the default) uses MNIST from ``--data-root`` (downloaded by each node's local main
process unless ``--no-download``), else synthetic digits drawn alike on every rank. ``--batch-size``
is per process.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil

import torch

from fastdata import cli, make_loader
from fastdata import distributed as fdist
from fastdata.datasets import MNIST
from fastdata.models import SmallCNN


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The command line, as a parser other scripts and the tests reuse."""
    p = argparse.ArgumentParser(description="Train a small CNN on MNIST digits with accelerate and a fastdata "
                                            "backend", add_help=add_help,
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--backend", default="auto", type=cli.backend, metavar=cli.backend_metavar(),
                   help="data-loading backend")
    p.add_argument("--epochs", type=cli.positive_int, default=3, help="passes over the training set (default 3)")
    p.add_argument("--batch-size", type=cli.positive_int, default=256, help="per process")
    p.add_argument("--lr", type=cli.positive_float, default=0.1, help="peak learning rate of the one-cycle schedule")
    p.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=False,
                   help="train on the CPU even where there is a GPU (Accelerator(cpu=True))")
    cli.add_digits_args(p)   # --data, --data-root, --download, --train-size, --test-size
    p.add_argument("--workers", type=cli.nonnegative_int, default=None,
                   help="loader workers per process (default: the usable cores / processes on the node)")
    p.add_argument("--seed", type=cli.seed, default=0, help="data order, augmentation and initial weights (default 0)")
    p.add_argument("--max-steps", type=cli.positive_int, default=None,
                   help="stop after this many optimizer steps (a stand-in for a preemption)")
    p.add_argument("--ckpt-dir", default=None, metavar="DIR",
                   help="accelerator.save_state() here at every epoch's end (and every --ckpt-every steps)")
    p.add_argument("--ckpt-every", type=cli.positive_int, default=None, metavar="STEPS",
                   help="also save every STEPS steps: a mid-epoch checkpoint")
    p.add_argument("--resume", action="store_true", help="accelerator.load_state() from --ckpt-dir first")
    p.add_argument("--json-out", default=None, metavar="PATH", help="write the result as one JSON object (rank 0)")
    return p


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """What the flags need together, refused before anything starts."""
    for flag in ("--ckpt-every", "--resume"):
        if getattr(args, flag[2:].replace("-", "_")) and not args.ckpt_dir:
            parser.error(f"argument {flag}: needs --ckpt-dir DIR")
    cli.check_output(parser, "--ckpt-dir", args.ckpt_dir, folder=True)
    cli.check_output(parser, "--json-out", args.json_out)
    if args.resume:
        _recover(args.ckpt_dir)
        # Else accelerate's load_state: a FileNotFoundError traceback for its model file, after the data
        # and the model were built.
        if not any(os.path.isfile(os.path.join(args.ckpt_dir, name)) for name in MODEL_FILES):
            parser.error(f"argument --resume: '{args.ckpt_dir}' holds no saved state (no {' or '.join(MODEL_FILES)}: "
                         f"not a folder accelerator.save_state wrote)")


#: The model file accelerator.save_state writes (safetensors by default, else torch.save's).
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


def save_state(accelerator, ckpt_dir: str) -> None:
    """``accelerator.save_state`` that never leaves half a save in ``ckpt_dir``: it writes its files one
    by one, so a save cut short (Ctrl-C, a crash, a full disk) in place left the new model beside the old
    optimizer, or a truncated file, where the previous save was good. Saved into ``ckpt_dir.partial``
    first, then swapped in: the old folder moves to ``ckpt_dir.old`` for the moment between the two
    renames (``_recover`` puts it back if the run dies just then), and is removed after."""
    partial, old = f"{ckpt_dir}.partial", f"{ckpt_dir}.old"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)   # a save cut short earlier
    accelerator.wait_for_everyone()
    accelerator.save_state(partial)   # every rank: each writes its own random states
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(ckpt_dir):
            os.replace(ckpt_dir, old)
        os.replace(partial, ckpt_dir)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _recover(ckpt_dir: str) -> None:
    """A run that died between ``save_state``'s two renames left the last good save in ``ckpt_dir.old``."""
    old = f"{ckpt_dir}.old"
    if not os.path.isdir(ckpt_dir) and os.path.isdir(old):
        os.replace(old, ckpt_dir)
        print(f"'{ckpt_dir}': restored the last complete save from '{old}' (the run stopped while saving)",
              flush=True)


def _has_mnist(args) -> bool:
    if args.data == "synthetic":
        return False
    try:
        # torchvision's download chatter would bury the one line that matters.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for train in (True, False):
                MNIST(args.data_root, train=train, download=args.download)
        return True
    except FileNotFoundError as e:
        if args.data == "mnist":
            raise cli.exit_with(f"error: --data mnist: {e}") from None   # said once for the ranks that lack it
        return False


def evaluate(accelerator, model, loader) -> tuple[float, int]:
    """(accuracy, samples counted) over every rank's shard: each test image exactly once."""
    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for images, labels in loader:
            # gather_for_metrics drops the padding of the last step (the loader told accelerate how many
            # gathered samples are real); plain gather() would count the padded ones twice.
            preds, labels = accelerator.gather_for_metrics((model(images).argmax(1), labels))
            correct += int((preds == labels).sum())
            seen += len(labels)
    model.train()
    return correct / max(seen, 1), seen


def _use_mnist(accelerator, args) -> bool:
    """Whether every rank trains on MNIST: only when every node has it (else all take synthetic digits)."""
    # One download per node, the node's other processes waiting; then one decision for every rank.
    with accelerator.local_main_process_first():
        have = _has_mnist(args)
    lacking = accelerator.reduce(torch.tensor([float(not have)], device=accelerator.device), reduction="sum")
    use_mnist = have and float(lacking) == 0
    if args.data == "auto" and not use_mnist:
        accelerator.print(f"MNIST is not in '{args.data_root}': training on synthetic digits instead")
    return use_mnist


def _starting_step(accelerator, args, train_loader, steps_per_epoch: int) -> int:
    """The optimizer step the run starts from: 0, or where the state in ``--ckpt-dir`` left off (with
    ``--resume``; the loader's position comes back with it, as it was registered for checkpointing)."""
    if args.resume:
        accelerator.load_state(args.ckpt_dir)
        at = train_loader.state_dict()
        accelerator.print(f"resumed from '{args.ckpt_dir}': epoch {at['epoch']}, batch {at['batch']}/"
                          f"{steps_per_epoch}")
    at = train_loader.state_dict()
    return at["epoch"] * steps_per_epoch + at["batch"]


def _check_schedule(accelerator, args, scheduler, steps_per_epoch: int) -> None:
    """Refuse, before any training, a resume with another --lr than the saved run's (ignored otherwise), or
    one that would step the restored one-cycle schedule past its end.
    ``load_state`` puts the saved run's OneCycleLR (its total_steps) over the one built for this run's
    --epochs, so a larger --epochs was torch's "Tried to step N times" traceback when the old end came."""
    peak = scheduler.optimizer.param_groups[0].get("max_lr")   # load_state restored the saved run's
    if peak is not None and not math.isclose(peak, args.lr, rel_tol=1e-6):
        raise cli.exit_with(f"error: --lr {args.lr:g}: '{args.ckpt_dir}' was saved by a run whose schedule peaks at "
                            f"lr {peak:g}, and resuming restores it: this run's rate would be ignored. Resume with "
                            f"--lr {peak:g}, or start a new run without --resume")
    total = scheduler.total_steps
    needed = args.epochs * steps_per_epoch
    if args.max_steps:
        needed = min(needed, args.max_steps)
    if needed <= total:
        return
    most = total // steps_per_epoch
    advice = (f"resume with --epochs {most} or fewer" if most else
              "resume with the saved run's --batch-size and --train-size")
    # Every rank refuses it (the same restored schedule): one line for the run (cli.exit_with).
    raise cli.exit_with(f"error: --epochs {args.epochs}: '{args.ckpt_dir}' was saved by a run whose one-cycle "
                        f"learning-rate schedule (restored with it) ends after {total} steps; at {steps_per_epoch} "
                        f"steps an epoch this run would step it {needed} times, and a one-cycle schedule cannot be "
                        f"stretched once it has started: {advice}, or start a new run without --resume")


def main(args) -> dict:
    """Train (and evaluate each epoch) as ``args`` says; return what the run reached."""
    _check_args(get_args_parser(), args)
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=args.cpu)
    ok = False   # after a failure or Ctrl-C, no barrier at the end: a peer may never reach it
    try:
        set_seed(args.seed)   # same initial weights on every rank
        use_mnist = _use_mnist(accelerator, args)
        dataset = "mnist" if use_mnist else "synthetic"

        with cli.input_errors(f"--backend {args.backend} with --batch-size {args.batch_size}"):
            train_loader = make_loader(cli.digits_source(args, True, use_mnist), args.backend,
                                       device=accelerator.device, batch_size=args.batch_size, train=True,
                                       seed=args.seed, num_workers=args.workers)
            eval_loader = make_loader(cli.digits_source(args, False, use_mnist), args.backend, like=train_loader,
                                      batch_size=max(args.batch_size, 512), even_batches=True)
        model = SmallCNN(num_classes=10, in_channels=1)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
        steps_per_epoch = len(train_loader)   # before any resume: a resumed pass's len() is what is left of it
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                        steps_per_epoch=steps_per_epoch)
        # The loaders come back as they went in. The scheduler is not prepared: accelerate's wrapper steps it
        # once per process at every step (it expects a schedule counted in whole-dataset batches, as for a
        # DataLoader it split), and this one counts this rank's batches: under 2 processes it would end halfway.
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader,
                                                                          eval_loader)
        accelerator.register_for_checkpointing(train_loader, scheduler)

        step = _starting_step(accelerator, args, train_loader, steps_per_epoch)
        if args.resume:
            _check_schedule(accelerator, args, scheduler, steps_per_epoch)
        accuracy = seen = None
        stopped = False
        # The loaders close however the run ends, Ctrl-C too: no worker process or thread outlives it.
        with train_loader, eval_loader:
            for epoch in range(train_loader.epoch, args.epochs):
                for images, labels in train_loader:
                    loss = torch.nn.functional.cross_entropy(model(images), labels)
                    optimizer.zero_grad(set_to_none=True)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    step += 1
                    if args.ckpt_every and step % args.ckpt_every == 0:
                        save_state(accelerator, args.ckpt_dir)
                    if args.max_steps and step >= args.max_steps:
                        stopped = True
                        break
                if stopped:
                    break
                accuracy, seen = evaluate(accelerator, model, eval_loader)
                accelerator.print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}, {dataset} test "
                                  f"accuracy {accuracy:.4f} ({seen} images)")
                if args.ckpt_dir:
                    # After the last batch the loader's position is the next epoch's start.
                    save_state(accelerator, args.ckpt_dir)
        result = {"backend": args.backend, "dataset": dataset, "world_size": accelerator.num_processes,
                  "global_step": step, "epoch": train_loader.epoch, "test_accuracy": accuracy, "test_samples": seen}
        if args.json_out and accelerator.is_main_process:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
        ok = True
        return result
    finally:
        # Leave together, and let gloo's threads finish before the interpreter shuts down: without it a rank
        # aborted now and then on a loaded machine after its work was done (exit -6; see fdist.cleanup).
        # end_training then finds the process group gone and only stops the trackers.
        fdist.cleanup(barrier=ok)
        accelerator.end_training()


def run(argv=None) -> dict:
    """The command line: ``main`` on the parsed flags. Ctrl-C is one line saying what ``--resume`` goes on
    from (the last ``save_state`` in ``--ckpt-dir``) and exit status 130, not a traceback."""
    args = get_args_parser().parse_args(argv)
    with cli.fit_errors(args, flags=("--ckpt-dir", "--ckpt-every"), unit="steps"):
        return main(args)


if __name__ == "__main__":
    run()
