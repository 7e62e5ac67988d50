"""Train fastdata's SmallCNN on MNIST digits with Lightning: the DataModule hands Lightning fastdata loaders.

    python examples/lightning_mnist.py --backend memory --epochs 3
    python examples/lightning_mnist.py --data synthetic --devices 2            # DDP on the CPU (gloo)
    python examples/lightning_mnist.py --ckpt-dir ck --ckpt-every 50 --max-steps 120   # stop mid-epoch ...
    python examples/lightning_mnist.py --ckpt-dir ck --resume ck/last.ckpt             # ... and resume there

Lightning needs nothing fastdata-specific. The loaders are built in ``DataModule.setup()``, where the
process group exists (each rank reads its own shard) and the device is known (the rank's GPU, or the
CPU). Lightning calls ``loader.sampler.set_epoch(epoch)`` before every epoch, saves the training
loader's position (``state_dict``) in every checkpoint with its loops, and restores it with
``fit(ckpt_path=...)``: a run stopped mid-epoch resumes with exactly the batches it had not trained on.

``--data auto`` (the default) uses MNIST from ``--data-root`` (downloaded by ``prepare_data``, which
Lightning runs once per node, unless ``--no-download``), else synthetic digits drawn on every rank
alike (``--train-size`` keeps that short). ``--batch-size`` is per process.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shlex
import zipfile

import torch

from fastdata import cli, make_loader
from fastdata import distributed as fdist
from fastdata.datasets import MNIST
from fastdata.models import SmallCNN


def _limit(text: str) -> int | float:
    """Lightning's ``limit_train_batches``: a count of batches (an integer >= 1) or a fraction in (0, 1]."""
    try:
        return cli.positive_int(text)
    except argparse.ArgumentTypeError:
        value = cli.positive_float(text)
        if value > 1:
            raise argparse.ArgumentTypeError(f"must be a whole number of batches or a fraction in (0, 1], "
                                             f"got {text!r}") from None
        return value


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The command line, as a parser other scripts and the tests reuse."""
    p = argparse.ArgumentParser(description="Train a small CNN on MNIST digits with Lightning and a fastdata "
                                            "backend", add_help=add_help,
                                formatter_class=cli.HelpFormatter)
    p.add_argument("--backend", default="auto", type=cli.backend, metavar=cli.backend_metavar(),
                   help="data-loading backend")
    p.add_argument("--epochs", type=cli.positive_int, default=3, help="passes over the training set (default 3)")
    p.add_argument("--batch-size", type=cli.positive_int, default=256, help="per process")
    p.add_argument("--lr", type=cli.positive_float, default=0.1, help="peak learning rate of the one-cycle schedule")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "gpu"),
                   help="Lightning's accelerator (auto: a GPU when there is one)")
    p.add_argument("--devices", type=cli.positive_int, default=1,
                   help="processes; more than 1 trains with DDP (gloo on the CPU, nccl on GPUs)")
    cli.add_digits_args(p)   # --data, --data-root, --download, --train-size, --test-size
    p.add_argument("--workers", type=cli.nonnegative_int, default=None,
                   help="loader workers per process (default: the usable cores / processes on the node)")
    p.add_argument("--seed", type=cli.seed, default=0, help="data order, augmentation and initial weights (default 0)")
    p.add_argument("--limit-train-batches", type=_limit, default=None, metavar="N|FRACTION",
                   help="train on the first N batches (or this fraction) of each epoch")
    p.add_argument("--max-steps", type=cli.positive_int, default=None,
                   help="stop after this many optimizer steps (a stand-in for a preemption)")
    p.add_argument("--ckpt-dir", default=None, metavar="DIR",
                   help="save here at every epoch's end (or every --ckpt-every steps): the newest checkpoint, "
                        "and last.ckpt linking to it")
    p.add_argument("--ckpt-every", type=cli.positive_int, default=None, metavar="STEPS",
                   help="save every STEPS steps instead: mid-epoch checkpoints")
    p.add_argument("--resume", default=None, metavar="CKPT", help="continue from this checkpoint (ckpt_path=)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """What the flags need together, refused before Lightning starts anything."""
    if args.ckpt_every and not args.ckpt_dir:
        parser.error("argument --ckpt-every: needs --ckpt-dir DIR, where the checkpoints go")
    cli.check_output(parser, "--ckpt-dir", args.ckpt_dir, folder=True)
    if args.resume is not None and not os.path.isfile(args.resume):
        parser.error(f"argument --resume: '{args.resume}' is not a file")
    # Lightning would find out inside trainer.fit, as a bare EOFError or UnpicklingError traceback. A
    # checkpoint is torch.save's archive: a zip holding a data.pkl (read from the directory, not unpickled).
    pickled = None if args.resume is None else _archive_pickle(args.resume)
    if args.resume is not None and pickled is None:
        parser.error(f"argument --resume: '{args.resume}' is not a checkpoint (not an archive torch.save wrote)")
    # A torch.save file of something else (train_mnist.py's --checkpoint, a bare state_dict) got as far as
    # trainer.fit, after the data and model were built, and died there on KeyError: 'pytorch-lightning_version'.
    if pickled is not None and b"pytorch-lightning_version" not in pickled:
        what = ("a checkpoint of fastdata's fit (train_mnist.py --checkpoint)" if b"fastdata-checkpoint" in pickled
                else "a file torch.save wrote")
        parser.error(f"argument --resume: '{args.resume}' is {what}, not a Lightning checkpoint; give one that "
                     f"--ckpt-dir holds (e.g. last.ckpt)")
    # Lightning's "gpu" is CUDA or Apple's MPS (one device).
    gpus = torch.cuda.device_count() or int(torch.backends.mps.is_available())
    if args.accelerator == "gpu" and args.devices > gpus:
        # Lightning's MisconfigurationException traceback otherwise, after the imports and the model.
        parser.error(f"argument --accelerator: gpu with --devices {args.devices}, but torch sees {gpus} GPU(s) "
                     f"here; use --accelerator cpu (or auto)")


def _archive_pickle(path) -> bytes | None:
    """The pickle of a torch.save archive (a zip holding a data.pkl; the tensors are stored beside it, so
    this is small), or None when ``path`` is not one. Its keys are plain strings in it, read without
    unpickling anything."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next((n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")), None)
            return None if name is None else zf.read(name)
    except (zipfile.BadZipFile, OSError):
        return None


def build(args):
    """(model, datamodule) for ``args``: the classes are defined in functions so that importing this file
    does not need Lightning (the tests load it to read its parser)."""
    import lightning as L

    return _classifier(L, args), _digits(L, args)


def _mnist_here(args) -> bool:
    """Whether this process finds MNIST under ``--data-root`` (never for ``--data synthetic``); an error
    for ``--data mnist`` without it."""
    if args.data == "synthetic":
        return False
    try:
        for train in (True, False):
            MNIST(args.data_root, train=train, download=False)
    except FileNotFoundError as e:
        if args.data == "mnist":
            raise cli.exit_with(f"error: --data mnist: {e}") from None   # said once for the ranks that lack it
        return False
    return True


def _digits(L, args):
    """The run's LightningDataModule, built for ``args``."""

    class Digits(L.LightningDataModule):
        """MNIST (or synthetic digits) as fastdata loaders, built once the process group exists."""

        def __init__(self):
            super().__init__()
            self.train_loader = self.val_loader = None
            self.dataset = None

        def prepare_data(self):
            # Lightning runs this on local rank 0 of each node before setup(): the place for a download.
            if args.data in ("auto", "mnist") and args.download:
                with contextlib.suppress(FileNotFoundError), contextlib.redirect_stdout(io.StringIO()), \
                        contextlib.redirect_stderr(io.StringIO()):
                    for train in (True, False):
                        MNIST(args.data_root, train=train, download=True)

        def setup(self, stage):
            if self.train_loader is not None:   # fit() then validate() call setup again
                return
            have = _mnist_here(args)
            # Every rank must train on the same dataset: MNIST only when every node has it.
            lacking = self.trainer.strategy.reduce(
                torch.tensor(float(not have), device=self.trainer.strategy.root_device), reduce_op="sum")
            use_mnist = args.data != "synthetic" and float(lacking) == 0
            self.dataset = "mnist" if use_mnist else "synthetic"
            if args.data == "auto" and not use_mnist and self.trainer.is_global_zero:
                print(f"MNIST is not in '{args.data_root}': training on synthetic digits instead", flush=True)
            device = self.trainer.strategy.root_device
            with cli.input_errors(f"--backend {args.backend} with --batch-size {args.batch_size}"):
                self.train_loader = make_loader(cli.digits_source(args, True, use_mnist), args.backend, device=device,
                                                batch_size=args.batch_size, train=True, seed=args.seed,
                                                num_workers=args.workers)
                # like=: the test digits are normalized with the training set's statistics. Uneven shards
                # are fine here: validation sums correct answers over the ranks (no gather of predictions).
                self.val_loader = make_loader(cli.digits_source(args, False, use_mnist), args.backend,
                                              like=self.train_loader, batch_size=max(args.batch_size, 512))

        def train_dataloader(self):
            return self.train_loader

        def val_dataloader(self):
            return self.val_loader

        def teardown(self, stage):
            if stage == "fit":
                for loader in (self.train_loader, self.val_loader):
                    if loader is not None:
                        loader.close()

        def on_exception(self, exception):
            # Ctrl-C included: Lightning stops without calling teardown, and the workers must not outlive it.
            self.teardown("fit")

    return Digits()


def _classifier(L, args):
    """The LightningModule: SmallCNN, its optimizer and one-cycle schedule, validation summed over ranks."""

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = SmallCNN(num_classes=10, in_channels=1)
            self.val_sums = torch.zeros(3)   # correct, summed loss, samples

        def training_step(self, batch, batch_idx):
            images, labels = batch
            loss = torch.nn.functional.cross_entropy(self.model(images), labels)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def on_validation_epoch_start(self):
            self.val_sums = torch.zeros(3, device=self.device)

        def validation_step(self, batch, batch_idx):
            images, labels = batch
            logits = self.model(images)
            # Sums, not per-batch means: a rank's last batch may be smaller (or empty), and a mean of means
            # would weigh it wrongly.
            self.val_sums += torch.stack([(logits.argmax(1) == labels).sum().float(),
                                          torch.nn.functional.cross_entropy(logits, labels, reduction="sum"),
                                          torch.tensor(float(len(labels)), device=self.device)])

        def on_validation_epoch_end(self):
            correct, loss, n = self.trainer.strategy.reduce(self.val_sums, reduce_op="sum").tolist()
            # Already summed over the ranks, so every rank holds the same value; sync_dist only tells
            # Lightning so (its mean of equal values changes nothing).
            self.log("val_acc", correct / max(n, 1), sync_dist=True)
            self.log("val_loss", loss / max(n, 1), sync_dist=True)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                        weight_decay=5e-4)
            # Not shortened by --max-steps: a run stopped early must resume the same schedule, not one whose
            # end it would step past.
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=args.lr, total_steps=_steps_per_epoch(self.trainer) * self.trainer.max_epochs)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_save_checkpoint(self, checkpoint):
            checkpoint["lightning_mnist"] = {"epochs": self.trainer.max_epochs}   # named by _check_schedule

        def on_load_checkpoint(self, checkpoint):
            _check_lr(args, checkpoint)
            _check_schedule(args, checkpoint, self.trainer)

    return Classifier()


def _steps_per_epoch(trainer) -> int:
    """The optimizer steps of a training epoch, under ``--limit-train-batches``. From the loader, not
    trainer.estimated_stepping_batches: reading that in configure_optimizers made Lightning skip
    restoring the loader's position on resume (Lightning issue #20550)."""
    steps = len(trainer.datamodule.train_loader)
    limit = trainer.limit_train_batches
    return min(steps, limit) if isinstance(limit, int) else max(1, int(steps * limit))


def _check_lr(args, checkpoint) -> None:
    """Refuse a --lr other than the saved run's: Lightning restores the optimizer and its one-cycle
    schedule, so the new rate was ignored without a word."""
    from fastdata.checkpoint import ResumeError

    groups = [g for state in checkpoint.get("optimizer_states") or [] for g in state.get("param_groups", [])]
    saved = groups[0].get("max_lr") if groups else None
    if saved is not None and not math.isclose(saved, args.lr, rel_tol=1e-6):
        raise ResumeError(f"--lr {args.lr:g}: '{args.resume}' was saved by a run whose schedule peaks at lr "
                          f"{saved:g}, and resuming restores it: this run's rate would be ignored. Resume with "
                          f"--lr {saved:g}, or start a new run without --resume")


def _check_schedule(args, checkpoint, trainer) -> None:
    """Refuse, before any training, to resume a run that would step the checkpoint's one-cycle schedule
    past its end. Lightning restores the saved OneCycleLR over the one configure_optimizers built for
    this run's --epochs, so a larger --epochs failed steps later with torch's "Tried to step N times"
    traceback (the same refusal as train_mnist's, through fastdata's fit)."""
    from fastdata.checkpoint import ResumeError

    total = (checkpoint.get("lr_schedulers") or [{}])[0].get("total_steps")
    steps = _steps_per_epoch(trainer)
    needed = steps * trainer.max_epochs
    if trainer.max_steps > 0:
        needed = min(needed, trainer.max_steps)
    if total is None or needed <= total:
        return
    # Checkpoints of an earlier version of this example do not record their --epochs.
    saved = checkpoint.get("lightning_mnist", {}).get("epochs", -(-total // steps))
    most = total // steps
    advice = f"resume with --epochs {most} or fewer" if most else \
        "resume with the saved run's --batch-size, --train-size and --limit-train-batches"
    raise ResumeError(f"--epochs {args.epochs}: '{args.resume}' was saved by a run of --epochs {saved}, whose "
                      f"one-cycle learning-rate schedule (restored with it) ends after {total} steps; at {steps} "
                      f"steps an epoch this run would step it {needed} times, and a one-cycle schedule cannot be "
                      f"stretched once it has started: {advice}, or start a new run without --resume")


#: ModelCheckpoint's private methods the --max-steps save calls, and the arguments it passes them.
_MODELCHECKPOINT_PRIVATE = {"_should_skip_saving_checkpoint": ("trainer",), "_monitor_candidates": ("trainer",),
                            "_save_topk_checkpoint": ("trainer", "candidates"),
                            "_save_last_checkpoint": ("trainer", "candidates")}


def _changed_private_methods(base) -> list[str]:
    """What of ``_MODELCHECKPOINT_PRIVATE`` this Lightning's ``base`` lacks, or takes other arguments in
    (the example's positional arguments do not bind to its signature), each said."""
    import inspect

    changed = []
    for name, passed in _MODELCHECKPOINT_PRIVATE.items():
        method = getattr(base, name, None)
        if not callable(method):
            changed.append(f"no {name}")
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):   # none to read (a C callable): what it takes is unknown
            changed.append(f"a {name} whose arguments cannot be read")
            continue
        try:
            signature.bind(None, *passed)   # self, then what the example passes
        except TypeError:
            changed.append(f"{name}({', '.join(signature.parameters)}), not {name}(self, {', '.join(passed)})")
    return changed


def _checkpoints(L):
    """ModelCheckpoint that also saves on the batch where ``--max-steps`` stops the run.

    Lightning ends a max_steps run mid-epoch by closing the epoch's books: its fit loop counts the cut
    epoch as processed and completed, and only then does ModelCheckpoint save (``on_train_epoch_end``,
    or ``save_last`` in ``on_train_end``). Such a checkpoint resumes at the next epoch: the loader's
    saved position (mid-epoch, rightly) is not even loaded, and the batches left in the cut epoch are
    never trained on. Saved at the step's batch end instead, as ``every_n_train_steps`` saves, the
    checkpoint is a mid-epoch one that Lightning resumes where it stopped; the later hooks then see this
    step already saved and write nothing over it."""

    base = L.pytorch.callbacks.ModelCheckpoint
    # Its own save path, private in Lightning (no public call saves "as at this step" and updates
    # last_model_path and the step last saved, which keep its later hooks from saving over it). Were a
    # Lightning release to rename one or change its arguments (a TypeError at the stop's batch, mid-
    # training, otherwise), the example still trains: the stop saves as Lightning does, and says what
    # that means for --resume.
    changed = _changed_private_methods(base)
    if changed:
        import warnings

        warnings.warn(f"this Lightning's ModelCheckpoint has {'; '.join(changed)}: a run that --max-steps "
                      f"stops mid-epoch is saved as Lightning saves it, and its --resume starts the next epoch",
                      RuntimeWarning, stacklevel=2)
        return base

    class Checkpoints(base):
        def on_train_batch_end(self, trainer, pl_module, *rest):
            super().on_train_batch_end(trainer, pl_module, *rest)
            if 0 < trainer.max_steps <= trainer.global_step and not self._should_skip_saving_checkpoint(trainer):
                candidates = self._monitor_candidates(trainer)
                self._save_topk_checkpoint(trainer, candidates)
                self._save_last_checkpoint(trainer, candidates)

    return Checkpoints


def _interrupted(args, checkpoints=None) -> str:
    """The line Ctrl-C ends with: which ``--resume`` goes on from where (``ModelCheckpoint`` knows its
    last save: last.ckpt, or last-v1.ckpt beside an earlier run's), or that nothing is saved yet."""
    if not args.ckpt_dir:
        return "interrupted: nothing saved to resume from (no --ckpt-dir given)"
    saved = checkpoints.last_model_path if checkpoints is not None else ""
    # Before this run's first save, the checkpoint it resumed from (if any) is still where to go on from.
    last = os.path.join(args.ckpt_dir, os.path.basename(saved)) if saved else args.resume
    if not last:
        return f"interrupted before the first save to '{args.ckpt_dir}': nothing to resume from yet"
    when = f"every {args.ckpt_every} steps" if args.ckpt_every else "every epoch"
    return f"interrupted: the same command with --resume {shlex.quote(last)} goes on from the last save ({when})"


def main(args) -> dict:
    """Train (and validate each epoch) as ``args`` says; return what the run reached."""
    _check_args(get_args_parser(), args)
    import lightning as L

    from fastdata.checkpoint import ResumeError

    L.seed_everything(args.seed, verbose=False)   # same initial weights on every rank
    model, data = build(args)
    checkpoints = None
    if args.ckpt_dir:
        # The newest checkpoint (save_top_k=1 without a monitor) and last.ckpt linking to it. With
        # save_top_k=0, Lightning 2.6 writes last.ckpt only when training ends, not at each epoch's end.
        checkpoints = _checkpoints(L)(dirpath=args.ckpt_dir, save_last="link", every_n_train_steps=args.ckpt_every)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto", max_epochs=args.epochs,
                        max_steps=args.max_steps or -1, limit_train_batches=args.limit_train_batches,
                        callbacks=[checkpoints] if checkpoints else [], enable_checkpointing=bool(checkpoints),
                        logger=False, enable_progress_bar=not args.no_progress, enable_model_summary=False,
                        num_sanity_val_steps=0)
    with cli.on_ctrl_c(lambda: _interrupted(args, checkpoints)):
        try:
            trainer.fit(model, data, ckpt_path=args.resume)
        except ResumeError as e:   # _check_schedule's refusal: one line, as train_mnist's
            raise cli.exit_with(f"error: {e}") from None   # every rank refuses it: said once
        except SystemExit as e:
            # Lightning's own end for Ctrl-C: "Detected KeyboardInterrupt", then exit status 1, saying
            # nothing of what resumes. Ours says it, with 130.
            if isinstance(e.__context__, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result = {"backend": args.backend, "dataset": data.dataset, "world_size": trainer.world_size,
              "current_epoch": trainer.current_epoch, "global_step": trainer.global_step,
              "val_accuracy": metrics.get("val_acc"), "val_loss": metrics.get("val_loss")}
    if trainer.is_global_zero:
        acc = "n/a" if result["val_accuracy"] is None else f"{result['val_accuracy']:.4f}"
        print(f"{result['dataset']} validation accuracy {acc} after {result['global_step']} steps "
              f"({result['world_size']} process(es), backend {args.backend})",
              flush=True)
    # Leave together, and let gloo's threads finish before the interpreter shuts down: without it a rank
    # aborted now and then on a loaded machine after its work was done (exit -6; see fdist.cleanup).
    fdist.cleanup()
    return result


def run(argv=None) -> dict:
    """The command line: ``main`` on the parsed flags. Ctrl-C, in training or before it (importing
    Lightning takes seconds), is one line saying what ``--resume`` goes on from and exit status 130."""
    args = get_args_parser().parse_args(argv)
    with cli.on_ctrl_c(lambda: _interrupted(args)):
        return main(args)


if __name__ == "__main__":
    run()
