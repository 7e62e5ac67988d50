"""What fastdata's command lines share (``python -m fastdata bench``, the scripts in examples/): a bad
flag is argparse's one-line error naming the flag, raised before anything is loaded or trained, never a
traceback from deep inside a run, and never an error found only after a whole run (an output path).

The ``type=`` functions below raise ``argparse.ArgumentTypeError``: argparse prints
``error: argument --batch-size: must be an integer >= 1, got '0'`` with the usage line and exits with
status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import re
import sys
import time

#: The seeds every fastdata source and numpy accept.
SEED_MAX = 2**32 - 1


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that gives each flag's default where its text does not already (``--batch-size``
    said "per process" and not 256, ``--data-root`` not ./data). None, a plain switch's False and a text
    that names its default itself are left as written; a ``--x/--no-x`` pair shows the one in force."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or default is None or default is argparse.SUPPRESS
                or (isinstance(default, bool) and not isinstance(action, argparse.BooleanOptionalAction))):
            return text
        if isinstance(action, argparse.BooleanOptionalAction):
            shown = action.option_strings[0 if default else 1]
        elif isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default))
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (batch sizes, epochs, counts)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (worker counts: 0 loads in the main process)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """A seed in [0, 2**32 - 1], the range numpy and every fastdata source accept."""
    value = _int(text)
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {SEED_MAX}], got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates: a NaN or a negative one trains to nothing)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (seconds a pass lasts at least, an added delay: 0 means none)."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1] (a share: a hardware decoder's load, an accuracy). ``0.99``, not ``99``."""
    value = _number(text)
    if not 0 <= value <= 1:   # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1] such as 0.99, got {text!r}")
    return value


def ema_decay(text: str) -> float:
    """A weight-average decay in (0, 1) (0.999: about the last 1,000 steps; 1 would never move)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value < 1):
        raise argparse.ArgumentTypeError(f"must be a decay in (0, 1) such as 0.999, got {text!r}")
    return value


def add_digits_args(parser: argparse.ArgumentParser) -> None:
    """The digits examples' data flags (train_mnist, lightning_mnist, accelerate_mnist): ``--data``,
    ``--data-root``, ``--download``, ``--train-size``, ``--test-size``."""
    parser.add_argument("--data", default="auto", choices=("auto", "mnist", "synthetic"),
                        help="auto: MNIST from --data-root (downloaded unless --no-download), else synthetic digits")
    parser.add_argument("--data-root", default="./data", type=folder_path,
                        help="folder holding MNIST/raw (and the synthetic digits drawn, kept for the next run)")
    parser.add_argument("--download", action=argparse.BooleanOptionalAction, default=True,
                        help="fetch MNIST through torchvision when it is not in --data-root "
                             "(--no-download: never touch the network, e.g. in tests)")
    parser.add_argument("--train-size", type=positive_int, default=None, help="use the first N training images")
    parser.add_argument("--test-size", type=positive_int, default=None, help="use the first N test images")


def folder_path(text: str) -> str:
    """``--data-root``: a folder, or a path where one can be made. A file there was found only after the
    digits were drawn (over a minute for the default 70,000), when they could not be kept under it."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"'{text}' is a file, not a folder")
    return text


def first_digits(source, n: int | None):
    """The first ``n`` samples of a digits array source (``--train-size``/``--test-size``); all of it
    when ``n`` is None or not smaller. Keeps the source's statistics and name."""
    if n is None or n >= len(source):
        return source
    from .datasets import ArraySource

    return ArraySource(source.images[:n], source.labels[:n], mean=source.mean, std=source.std,
                       name=source.name, digits=True)


def digits_source(args: argparse.Namespace, train: bool, use_mnist: bool):
    """The training or test digits ``add_digits_args``' flags ask for: MNIST from ``--data-root``
    (already there: nothing is downloaded here), else the synthetic digits, cut to the sizes given."""
    from .datasets import MNIST, SyntheticDigits

    n = args.train_size if train else args.test_size
    if use_mnist:
        return first_digits(MNIST(args.data_root, train=train, download=False), n)
    return SyntheticDigits(n or (60_000 if train else 10_000), train=train, seed=args.seed)


def add_step_args(parser: argparse.ArgumentParser) -> None:
    """The training scripts' flags for ``fit``'s step: ``--accumulate``, ``--clip-grad-norm``, ``--ema``
    (each checked by its type, so a bad value is argparse's one-line error)."""
    parser.add_argument("--accumulate", type=positive_int, default=1, metavar="N",
                        help="batches per optimizer step (gradient accumulation: N x --batch-size per step)")
    parser.add_argument("--clip-grad-norm", type=positive_float, default=None, metavar="MAX",
                        help="clip the gradients' total norm to MAX before each step (the record gets grad_norm)")
    parser.add_argument("--ema", type=ema_decay, default=None, metavar="DECAY",
                        help="evaluate an exponential moving average of the weights (e.g. 0.999)")


#: ``--compile``'s modes and the ``fit(compile=...)`` value of each.
COMPILE_MODES = {"off": False, "default": True, "reduce-overhead": "reduce-overhead"}


def compile_mode(text: str):
    """A ``--compile`` mode (``COMPILE_MODES``) as ``fit``'s ``compile`` value: False, True or ``"reduce-overhead"``."""
    if text not in COMPILE_MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}; choose from {list(COMPILE_MODES)}")
    return COMPILE_MODES[text]


def add_loop_args(parser: argparse.ArgumentParser) -> None:
    """The training scripts' flags for how ``fit`` runs and what it records: ``--compile [MODE]``,
    ``--gradient-checkpointing``, ``--profile DIR``, ``--log-dir DIR`` (``loop_kwargs`` hands them to fit;
    ``check_training_args`` checks the folders before any work)."""
    parser.add_argument("--compile", nargs="?", const="default", default="off", type=compile_mode,
                        metavar="{" + ",".join(COMPILE_MODES) + "}",
                        help="torch.compile the model (default off; --compile alone: mode default); "
                             "reduce-overhead records CUDA "
                             "graphs, for small models whose GPU step is launch-bound (on the CPU: default)")
    # The flag was a boolean before the modes: --no-compile keeps working.
    parser.add_argument("--no-compile", dest="compile", action="store_const", const=False, help=argparse.SUPPRESS)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                        help="recompute each block's activations in backward: less memory, ~30%% more compute")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write a torch.profiler trace of a few steps to DIR and print where a step's time goes")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="write the run log to DIR (epochs.csv, steps.csv, TensorBoard scalars) and its "
                             "curves to DIR/curves.png at the end")


def loop_kwargs(args: argparse.Namespace) -> dict:
    """``fit``'s keyword arguments for the flags of ``add_loop_args``."""
    return {"compile": args.compile, "gradient_checkpointing": args.gradient_checkpointing,
            "profile": args.profile, "log_dir": args.log_dir}


def plot_run_log(log_dir) -> str | None:
    """At the end of a run with ``--log-dir``: its curves as ``log_dir/curves.png`` (rank 0), said in one
    line; without matplotlib, one line saying so. Returns the PNG's path, or None when none was drawn."""
    from . import distributed as fdist

    if log_dir is None or not fdist.is_main():
        return None
    from .runlog import plot_curves

    out = os.path.join(log_dir, "curves.png")
    try:
        plot_curves(log_dir, out)
    except ImportError:
        print(f"--log-dir: no curves.png: matplotlib is not installed (pip install matplotlib); the CSVs are in "
              f"{log_dir}", flush=True)
        return None
    except (OSError, ValueError) as e:
        # The run has ended and its checkpoint and result are written: a full disk, or a CSV another
        # process damaged, costs the picture only, not the exit status of a finished run.
        print(f"--log-dir: no curves.png ({type(e).__name__}: {e}); the CSVs are in {log_dir}", flush=True)
        return None
    print(f"curves: {out}", flush=True)
    return out


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, checked against this machine (a GPU that is not there is an
    error, not a fallback). Returned as given: under torchrun ``cuda`` means the rank's own GPU."""
    import torch

    from .config import resolve_device

    try:
        torch.device(text)
    except (RuntimeError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N") from None
    try:
        resolve_device(text)
    except (ValueError, RuntimeError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def backend(text: str) -> str:
    """A backend name ``make_loader`` knows, whose package imports here. A known backend whose package
    is missing is refused with its install command (argparse's ``choices`` would only say that the name
    is not a choice)."""
    from .registry import BACKENDS, choices

    if text not in choices():
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose from {choices()}")
    if text != "auto" and not BACKENDS[text].available:
        raise argparse.ArgumentTypeError(BACKENDS[text].unavailable_reason)
    return text


def named_backend(text: str) -> str:
    """``--backends`` of a command that runs each backend it is given (``fastdata bench``,
    ``bench_accuracy``): a row of the table, not ``auto``, which picks one of them (it would be one of the
    others again); neither error offers ``auto`` as a choice. Installed here, as ``backend`` checks."""
    from .registry import BACKENDS

    if text == "auto":
        raise argparse.ArgumentTypeError(f"'auto' picks one of the others: name that one; choose from "
                                         f"{list(BACKENDS)}")
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose from {list(BACKENDS)}")
    return backend(text)


def backend_metavar() -> str:
    """``{auto,torch,...}`` for the help text, as ``choices`` would show it."""
    from .registry import choices

    return "{" + ",".join(choices()) + "}"


def output_problem(path, *, folder: bool = False) -> str | None:
    """Why ``path`` could not be written at the end of a run (a file, or a folder when ``folder``), or
    None: it is a folder where a file is wanted (or the other way round), it lies below a file, its
    drive or share does not exist, or its nearest existing folder is not writable. Folders still to
    be made are fine: they are created."""
    path = os.fspath(path)
    if folder and os.path.exists(path) and not os.path.isdir(path):
        return f"'{path}' is a file, not a folder"
    if not folder and os.path.isdir(path):
        return f"'{path}' is a folder; give a file path"
    if folder and os.path.isdir(path):
        parent = path
    else:
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            up = os.path.dirname(parent)
            if up == parent:   # a root that is not there (a Windows drive, an unreachable share)
                return f"'{parent}' does not exist"
            parent = up
    if not os.path.isdir(parent):
        return f"'{path}' lies below '{parent}', which is a file, not a folder"
    if not os.access(parent, os.W_OK):
        return f"cannot write into '{parent}' (permission denied)"
    return None


def check_output(parser: argparse.ArgumentParser, flag: str, path, *, folder: bool = False) -> None:
    """Refuse, before any work, an output file (a folder the reports go into when ``folder``) that could
    not be written at the end of the run (``output_problem``), as argparse's error naming ``flag``."""
    problem = output_problem(path, folder=folder) if path is not None else None
    if problem:
        parser.error(f"argument {flag}: {problem}")


#: The training scripts' flag for ``on_error="skip"`` (``--on-error``), as their error lines advise it.
SKIP_FLAG = "--on-error skip"


def decode_error_line(error: Exception, skip_flag: str | None = None) -> str:
    """The one line a command ends with for a ``DecodeError``: the error's own last line (a DataLoader
    worker's copy carries the worker's traceback above it), with its advice in the command's words where
    it has an ``--on-error`` flag (``skip_flag``) instead of the ``on_error='skip'`` of the Python API."""
    line = str(error).strip().splitlines()[-1]
    # The worker's traceback ends in "fastdata.errors.DecodeError: <message>".
    line = re.sub(r"^[\w.]*DecodeError: ", "", line)
    if skip_flag:
        line = line.replace("on_error='skip' skips", f"{skip_flag} skips")
    return f"error: {line}"


#: How long a rank waits on the others' lines at its end: a relay (``PreparationError``) for the line of
#: the rank that failed on its own, a rank whose line another rank prints for that rank to have printed
#: it. A rank with a line of its own never waits before printing it: torchrun stops every rank as soon
#: as one exits, and a line held back for a wait was lost with it.
EXIT_WAIT_S = 5.0
_EXITS = itertools.count()   # one namespace in the store per error line a process ends with


def exit_with(line: str, *, relay: bool = False) -> SystemExit:
    """The ``SystemExit`` that ends a command with ``line`` (``error: ...``), said once per job: under a
    process group every failing rank posts its line in the group's store, and the first rank to post a
    line prints it at once, so ranks that fail the same way print it once and a rank whose error differs
    prints its own. ``relay``: this rank only waited for another rank's failure (a ``PreparationError``):
    quiet when a rank that failed on its own posts its line (within ``EXIT_WAIT_S``).
    Without a group, or when its store cannot be reached, every rank says its line itself (``_exit_alone``)."""
    from . import distributed

    if not distributed.is_distributed():
        return _exit_alone(line)
    import torch.distributed as dist

    try:
        # The default group's store (torchrun's, or the one init_process_group made): keys, no collective,
        # so a rank that fails alone never waits on peers that are busy training.
        store = dist.distributed_c10d._get_default_store()
        _say_once(store, f"fastdata/exit/{next(_EXITS)}", line, relay, dist.get_rank(), dist.get_world_size())
    except Exception:   # no store (a private API moved, its host gone) before the decision: never lose the line
        return _exit_alone(line)
    return SystemExit(1)   # said (or another rank says it); the exit status stays 1


def _exit_alone(line: str) -> SystemExit:
    """The ``SystemExit`` of a process that says ``line`` itself. Python prints a ``SystemExit(line)``
    as two writes (the text, then the newline), so under a launcher without a group (``torchrun -m
    fastdata pack`` starts none; a store out of reach) ranks failing at once ran their lines together as
    ``say_line`` fixed for the group's path: there the line is said here, in one write, and the exit
    status is 1. A single process keeps ``SystemExit(line)`` (its caller may catch it and read it)."""
    from . import distributed

    try:
        ranks = distributed.world_size() if distributed.is_distributed() else distributed.env_world_size()
    except Exception:   # a malformed WORLD_SIZE: never lose the line over it
        ranks = 1
    if ranks == 1:
        return SystemExit(line)
    say_line(line)
    return SystemExit(1)


def _say_once(store, prefix: str, line: str, relay: bool, me: int, world: int) -> None:
    """``exit_with``'s exchange: post this rank's line; claim it (the store's atomic counter: the first
    rank to claim a line prints it, before anything else); a rank whose line another claimed waits
    (at most ``EXIT_WAIT_S``) for it to be printed, since torchrun stops the printer once this rank exits.
    A relay first waits for every rank's line: quiet if a rank that failed on its own posted one."""
    import hashlib

    store.set(f"{prefix}/line/{me}", ("relay " if relay else "error ") + line)
    if relay:
        posted = _posted(store, f"{prefix}/line", range(world))
        if any(v.startswith(b"error ") for r, v in posted.items() if r != me):
            return
    said = f"{prefix}/said/{hashlib.sha256(line.encode('utf-8', 'surrogatepass')).hexdigest()}"
    if store.add(said, 1) == 1:
        say_line(line)
        with contextlib.suppress(Exception):   # the line is out: a store gone now costs the others a wait
            store.set(f"{said}/printed", "1")
        return
    with contextlib.suppress(Exception):
        _posted(store, said, ["printed"])


def say_line(line: str) -> None:
    """``line`` and its newline on stderr in one write: ranks that print at the same moment into
    torchrun's shared stderr then keep their lines whole. ``print`` writes the text and the newline
    separately, and under ``PYTHONUNBUFFERED=1`` (common under torchrun and in containers) each is its
    own system call, so two ranks' lines interleaved into one (``...rank 1error: ...rank 0``)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _posted(store, prefix: str, ranks) -> dict:
    """``{rank: value}`` of ``prefix/<rank>`` for each rank that posts it within ``EXIT_WAIT_S``."""
    deadline = time.monotonic() + EXIT_WAIT_S
    keys = {r: f"{prefix}/{r}" for r in ranks}
    while not store.check(list(keys.values())) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {r: store.get(k) for r, k in keys.items() if store.check([k])}


@contextlib.contextmanager
def input_errors(what: str, *, skip_flag: str | None = None):
    """Around reading what the flags name (a data folder, a checkpoint) and building loaders from them:
    a bad input (a missing or empty folder, a batch larger than the data, a checkpoint that is not one,
    a backend that cannot take the source) ends the program with one line naming ``what``, not a
    traceback. Only around construction: an error in the middle of training keeps its traceback, but
    a broken image there (``fit_errors``) is one line too. ``skip_flag``: see ``decode_error_line``."""
    from .errors import CacheDoesNotFit, DecodeError, MissingDependency

    try:
        yield
    except DecodeError as e:   # a broken image (the memory backend decodes while it is built): the file's
        raise exit_with(decode_error_line(e, skip_flag)) from None
    # Not TypeError: with every flag checked by its type, one here is a bug, whose traceback matters.
    except (ValueError, OSError, CacheDoesNotFit, MissingDependency) as e:
        message = str(e).strip().splitlines()
        raise exit_with(f"error: {what}: {message[-1] if message else type(e).__name__}") from None


def check_training_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The checks the training scripts' flags need together, made right after parsing: ``--resume``
    and ``--checkpoint-every`` need ``--checkpoint``; ``--checkpoint`` and ``--json-out`` must be
    writable files (a folder there would fail only when the first checkpoint, or the result at the very
    end, is written); ``--profile`` and ``--log-dir`` writable folders."""
    if getattr(args, "resume", False) and not getattr(args, "checkpoint", None):
        parser.error("argument --resume: needs --checkpoint PATH, the file to continue from")
    # Else fit's own check refuses it with a ValueError traceback, after the data and loaders are built.
    if getattr(args, "checkpoint_every", None) and not getattr(args, "checkpoint", None):
        parser.error("argument --checkpoint-every: needs --checkpoint PATH, the file to save to")
    for flag in ("--checkpoint", "--json-out"):
        check_output(parser, flag, getattr(args, flag[2:].replace("-", "_"), None))
    for flag in ("--profile", "--log-dir"):   # folders: a file there would fail only when the run starts
        check_output(parser, flag, getattr(args, flag[2:].replace("-", "_"), None), folder=True)
    return args


@contextlib.contextmanager
def on_ctrl_c(say="interrupted"):
    """Ctrl-C inside ends the program with one line on stderr, ``say`` (or what ``say()`` returns then:
    what is on disk by that time), and exit status 130 (128 + SIGINT, what a shell reports for it), where
    it was a traceback from wherever it landed (the step, autograd, a decoder). Under torchrun every rank
    exits so; rank 0 alone says it."""
    from . import distributed

    try:
        yield
    except KeyboardInterrupt:
        if distributed.is_main():
            say_line(say() if callable(say) else say)
        raise SystemExit(130) from None


@contextlib.contextmanager
def fit_errors(args: argparse.Namespace, *, flags: tuple[str, str] = ("--checkpoint", "--checkpoint-every"),
               unit: str = "batches", lr_flags: str = "--lr"):
    """Around a training script's ``fit``, what ends it early as one line instead of a traceback:

    - a ``--checkpoint`` that is not one, or one of another run (``CheckpointError``; under torchrun the
      other ranks get rank 0's verdict as a ``PreparationError``), or in use by another live run:
      ``error: --checkpoint: ...``; a ``--log-dir`` another live run logs into: ``error: --log-dir: ...``;
    - Ctrl-C (``on_ctrl_c``): what the same command with ``--resume`` goes on from, where it was a
      traceback through the loop, the step and autograd that said nothing about resuming;
    - a run whose weights went NaN or inf (fit's ``FloatingPointError``: where the loss went
      non-finite, and that the checkpoint keeps the last good save): ``error: ...``;
    - a broken image met in training (``DecodeError``; the torch and dali backends read a file first
      when its batch is due): the file, why, and ``--on-error skip`` where the script has that flag.
      The same file ended the memory backend's build with that one line; here it was a traceback
      through the loop, the backend and a DataLoader worker.

    - a resume under another peak learning rate than the checkpoint's (fit's ``PeakLrChanged``: resuming
      restores the saved schedule, so the new rate was ignored without a word): ``error: --lr: ...``,
      ``lr_flags`` naming what set the rate (train_imagefolder scales ``--lr`` by the batch size).

    ``flags``: the script's flags for where it saves (a file, or a folder as accelerate's ``save_state``
    writes) and how many ``unit`` apart, when they are not ``--checkpoint`` and ``--checkpoint-every``
    (fit's ``checkpoint_every`` counts batches; a loop that saves every N optimizer steps says "steps")."""
    from . import distributed
    from .checkpoint import CheckpointError
    from .engine.schedule import PeakLrChanged
    from .errors import DecodeError
    from .runlog import LogDirInUse

    saves, every = (getattr(args, flag[2:].replace("-", "_"), None) for flag in flags)
    started = time.time()

    def say() -> str:
        if not saves:
            return f"interrupted: nothing saved to resume from (no {flags[0]} given)"
        # A URL is not looked up here: the next run's --resume finds out.
        if "://" not in str(saves) and not _saved_by_this_run(saves, args, started):
            return f"interrupted before the first save to '{saves}': nothing to resume from yet"
        when = f"every epoch and every {every} {unit}" if every else "every epoch"
        return f"interrupted: the same command with --resume goes on from the last save in '{saves}' ({when})"

    try:
        with on_ctrl_c(say):
            yield
    except PeakLrChanged as e:
        raise exit_with(f"error: {lr_flags}: '{e.path}' was saved by a run whose schedule peaks at lr {e.was:g}, "
                         f"and resuming restores it: this run's {e.now:g} would be ignored. Resume with the saved "
                         f"run's {lr_flags}, or start a new run without --resume") from None
    except (CheckpointError, distributed.PreparationError) as e:
        # fit's refusals offer "a new run (resume=False)": the Python API's words for this command's.
        new_run = f"(without --resume, or with another {flags[0]})"
        raise exit_with(f"error: {flags[0]}: {str(e).replace('(resume=False)', new_run)}",
                        relay=isinstance(e, distributed.PreparationError)) from None
    except LogDirInUse as e:   # another run logs into --log-dir: refused before any training
        raise exit_with(f"error: --log-dir: {e}") from None
    except FloatingPointError as e:   # fit: the weights went NaN; its message says where and what was kept
        raise exit_with(f"error: {e}") from None
    except DecodeError as e:
        raise exit_with(decode_error_line(e, SKIP_FLAG if hasattr(args, "on_error") else None)) from None


def _saved_by_this_run(checkpoint, args: argparse.Namespace, started: float) -> bool:
    """Whether ``--resume`` would go on from this run: the file is there and this run wrote it or resumed
    from it (a file of an earlier run, overwritten at this run's first save, is not this run's). A folder
    counts by its newest file: a save that overwrites the files in it leaves the folder's own time as it was."""
    try:
        if getattr(args, "resume", False):
            return True
        if os.path.isdir(checkpoint):
            newest = max((entry.stat().st_mtime for entry in os.scandir(checkpoint)), default=-math.inf)
        else:
            newest = os.path.getmtime(checkpoint)
        # A second's slack: file times come from the kernel's coarse clock, which may lag time.time().
        return newest >= started - 1.0
    except OSError:   # not there (yet)
        return False
