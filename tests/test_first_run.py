"""What a new user types first, as they type it: every example answers ``--help``, refuses a flag it does
not know, and ends a Ctrl-C or a bad ``--resume`` file with one line instead of a traceback.

The other first commands are covered where their code is: the flags' checks in ``test_examples.py`` and
``test_cli.py``, ``python -m fastdata`` in ``test_cli.py``, ``test_doctor.py`` and ``test_bench.py``.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import procs
from conftest import load_example

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


def test_the_examples_listed_are_the_ones_on_disk():
    """A new example joins the parametrized tests below by being in the folder."""
    assert {"train_mnist", "train_imagefolder", "custom_backend", "custom_source"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_prints_its_usage_for_help_and_does_nothing_else(name, tmp_path):
    """``custom_backend.py --help`` and ``custom_source.py --help`` ran their demo (photos drawn, zipped
    and read by every backend) and printed no usage; an unknown flag was ignored the same way."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: "), proc.stdout
    assert not list(tmp_path.iterdir()), "--help wrote files"


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_refuses_a_flag_it_does_not_know_naming_it(name, capsys):
    parser = load_example(name).get_args_parser()
    required = ["--data-root", "x"] if name == "train_imagefolder" else []
    with pytest.raises(SystemExit) as info:
        parser.parse_args([*required, "--no-such-flag"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err and "Traceback" not in err, err


@pytest.mark.parametrize("name", ["custom_backend", "custom_source"])
def test_the_demos_still_run_when_called_with_their_parsed_arguments(name, capsys, monkeypatch):
    from fastdata import registry

    # custom_backend's main registers its backend for the process, as a script should: here, for this
    # test only (left in the table, later tests' lists of backends held a "simple" row).
    monkeypatch.setattr(registry, "BACKENDS", dict(registry.BACKENDS))
    module = load_example(name)
    module.main(module.get_args_parser().parse_args([]))
    assert "batch" in capsys.readouterr().out


def _interrupted(module, monkeypatch, argv, saves=None):
    """``main`` with ``fit`` raising KeyboardInterrupt, as Ctrl-C does in the middle of an epoch (after
    writing ``saves``, a checkpoint of this run, when given)."""
    def ctrl_c(*args, **kwargs):
        if saves is not None:
            saves.write_bytes(b"this run's save")
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "fit", ctrl_c)
    try:
        module.main(module.get_args_parser().parse_args(argv))
    except SystemExit as e:
        return e.code
    except KeyboardInterrupt:   # caught here: escaping, it would end the whole test session
        pytest.fail("Ctrl-C left main as a KeyboardInterrupt traceback")
    pytest.fail("main returned after Ctrl-C")


def test_ctrl_c_in_training_ends_in_one_line_saying_how_to_resume(monkeypatch, tmp_path, capsys):
    """Ctrl-C printed a 25-line traceback through fit, the step and autograd, and did not say that the
    checkpoint on disk is where ``--resume`` goes on from. Exit status 130: the shell's for SIGINT."""
    module = load_example("train_mnist")
    common = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "64",
              "--test-size", "32", "--batch-size", "32", "--backend", "torch", "--device", "cpu",
              "--workers", "0", "--no-progress"]
    ck = tmp_path / "ck.pt"
    assert _interrupted(module, monkeypatch, [*common, "--checkpoint", str(ck)]) == 130
    err = capsys.readouterr().err   # stopped in the first epoch, before any save: nothing to resume
    assert err.strip().splitlines()[-1] == (f"interrupted before the first save to '{ck}': nothing to resume "
                                            f"from yet"), err
    ck.write_bytes(b"an earlier run's save")   # not this run's: overwritten at its first save
    os.utime(ck, (time.time() - 60, time.time() - 60))
    assert _interrupted(module, monkeypatch, [*common, "--checkpoint", str(ck)]) == 130
    assert "nothing to resume from yet" in capsys.readouterr().err
    assert _interrupted(module, monkeypatch, [*common, "--checkpoint", str(ck), "--checkpoint-every", "5"],
                        saves=ck) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"interrupted: the same command with --resume goes on from the last "
                                            f"save in '{ck}' (every epoch and every 5 batches)"), err
    assert "Traceback" not in err
    assert _interrupted(module, monkeypatch, [*common, "--checkpoint", str(ck), "--resume"]) == 130
    assert "--resume goes on from the last save" in capsys.readouterr().err   # resumed from it: still good
    assert _interrupted(module, monkeypatch, common) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted: nothing saved to resume from (no --checkpoint given)", err


def test_ctrl_c_in_the_imagefolder_example_is_one_line_too(monkeypatch, tmp_path, capsys):
    from fastdata.datasets import make_image_folder

    module = load_example("train_imagefolder")
    root = make_image_folder(tmp_path / "photos", classes=2, per_class=2, seed=0)
    ck = tmp_path / "ck.pt"
    argv = ["--data-root", str(root), "--batch-size", "2", "--image-size", "32", "--backend", "torch",
            "--device", "cpu", "--workers", "0", "--no-progress", "--checkpoint", str(ck)]
    assert _interrupted(module, monkeypatch, argv, saves=ck) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"interrupted: the same command with --resume goes on from the last "
                                            f"save in '{ck}' (every epoch)"), err


def test_lightning_resume_from_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path, capsys):
    """``--resume notes.txt`` passed the is-a-file check and failed deep inside Lightning's torch.load with
    a bare ``EOFError`` (empty file) or an ``UnpicklingError`` traceback."""
    module = load_example("lightning_mnist")
    for content in (b"", b"not a checkpoint" * 10):
        bad = tmp_path / "notes.txt"
        bad.write_bytes(content)
        parser = module.get_args_parser()
        with pytest.raises(SystemExit) as info:
            module._check_args(parser, parser.parse_args(["--resume", str(bad)]))
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --resume: '{bad}' is not a checkpoint" in err and "Traceback" not in err, err


def test_lightning_resume_takes_a_file_torch_save_wrote(tmp_path):
    import torch

    module = load_example("lightning_mnist")
    good = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0"}, good)
    parser = module.get_args_parser()
    module._check_args(parser, parser.parse_args(["--resume", str(good)]))


def test_the_command_lines_help_is_plain_text():
    """``python -m fastdata --help`` showed its module docstring's ``markup`` as it is."""
    from fastdata.__main__ import get_args_parser

    text = get_args_parser().format_help()
    assert "``" not in text and "doctor" in text and "pack SOURCE OUT" in text, text


@pytest.mark.parametrize("module,argv,says", [
    ("fastdata.doctor", ["doctor"], "fastdata doctor: interrupted"),
    ("fastdata.bench", ["bench", "digits"], "fastdata bench: interrupted: nothing written (the reports are "
                                            "written once every backend is measured)"),
    ("fastdata.packing.command", ["pack", "digits", "OUT"], "fastdata pack: interrupted: the same command "
                                                            "finishes the pack, keeping the shards already written"),
])
def test_ctrl_c_in_a_command_is_one_line_and_status_130(module, argv, says, monkeypatch, capsys, tmp_path):
    """Ctrl-C in ``python -m fastdata pack`` printed a traceback ending in whatever numpy or torch call it
    landed in, although the docs promise that re-running an interrupted pack finishes it."""
    import importlib

    import fastdata.__main__ as entry

    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), "main", ctrl_c)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    try:
        code = entry.main(argv)
    except KeyboardInterrupt:   # caught here: escaping, it would end the whole test session
        pytest.fail("Ctrl-C left main as a KeyboardInterrupt traceback")
    err = capsys.readouterr().err
    assert code == 130 and err.strip() == says, err


def _profiled_fit(batches, out, capsys):
    """(trace files written, the warnings, what was printed) of a fit of ``batches`` batches profiled."""
    import warnings

    from fastdata import fit, make_loader
    from fastdata.datasets import SyntheticDigits
    from fastdata.models import SmallCNN

    train = make_loader(SyntheticDigits(8 * batches, seed=0), "memory", batch_size=8, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SmallCNN(width=4), train, epochs=1, progress=False, profile=out)
    said = [str(w.message) for w in caught if "StepProfiler" in str(w.message)]
    return list(out.glob("*.pt.trace.json")), said, capsys.readouterr().out


def _least_profiled_batches() -> int:
    import re

    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    return int(re.search(r"a run of fewer than (\d+) batches records no step", text).group(1))


def test_training_md_says_truly_how_many_batches_a_profiled_run_needs(tmp_path, capsys):
    """docs/training.md said a fit of fewer than 8 batches writes no trace: 4 (wait + warmup + 1 with the
    defaults 1, 2, 5) record a step, print its table and write the trace."""
    least = _least_profiled_batches()
    traces, said, out = _profiled_fit(least, tmp_path / "enough", capsys)
    assert traces and not said and "profile: where each step's time went" in out, (least, said, out)
    traces, said, out = _profiled_fit(2, tmp_path / "two", capsys)
    assert not traces and "profile: where" not in out and any("no trace was written" in s for s in said), said


def test_a_profiled_run_one_batch_short_says_that_no_step_was_recorded(tmp_path, capsys):
    """A run of exactly wait + warmup steps ends inside the first recorded step: torch writes that
    unfinished step's trace, and the run said nothing (no table, no warning)."""
    traces, said, out = _profiled_fit(_least_profiled_batches() - 1, tmp_path / "short", capsys)
    assert "profile: " not in out
    assert len(said) == 1 and "ended inside the first recorded one" in said[0] and "no step was recorded" in said[0]


def test_bench_help_says_where_its_reports_go_by_default():
    """``bench --help`` said "folder for bench-<tag>.{md,json,png}" and not that, without --out, the
    reports land in ./fastdata-bench."""
    from fastdata.bench import get_args_parser

    text = " ".join(get_args_parser().format_help().split())
    assert "(default: fastdata-bench, in the current folder)" in text, text


@pytest.mark.parametrize("name", [*EXAMPLES, "fastdata bench"])
def test_every_flag_says_what_it_does_in_help(name):
    """``--epochs`` and ``--seed`` of every training example (and ``--batch-size`` of
    custom_augmentation, ``--amp`` and ``--no-progress`` of bench) showed in --help with no word."""
    if name == "fastdata bench":
        from fastdata.bench import get_args_parser
    else:
        get_args_parser = load_example(name).get_args_parser
    bare = [a.option_strings[0] for a in get_args_parser()._actions if a.option_strings and not a.help]
    assert not bare, bare


@pytest.mark.parametrize("name,slow_part", [("train_mnist", "load_digits"), ("train_imagefolder", "ImageFolder")])
def test_ctrl_c_before_training_is_one_line_too(name, slow_part, monkeypatch, tmp_path, capsys):
    """A first run spends its first minute drawing 70,000 digits (or decoding photos into a cache): a
    Ctrl-C there was a traceback through numpy or PIL."""
    module = load_example(name)

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, slow_part, ctrl_c)
    try:
        module.run(["--data-root", str(tmp_path / "d"), "--device", "cpu", "--no-progress"])
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:   # caught here: escaping, it would end the whole test session
        pytest.fail("Ctrl-C left the command as a KeyboardInterrupt traceback")
    err = capsys.readouterr().err
    assert code == 130 and err.strip() == "interrupted: nothing saved to resume from (no --checkpoint given)", err


# What each example says when Ctrl-C comes while it builds its loaders (before anything is saved), and
# the flags that make it quick. A new example must join: Ctrl-C in it is one line too.
ON_CTRL_C = {
    "accelerate_mnist": (["--data", "synthetic", "--train-size", "64", "--test-size", "32", "--cpu"],
                         "interrupted: nothing saved to resume from (no --ckpt-dir given)"),
    "lightning_mnist": (["--data", "synthetic", "--train-size", "64", "--test-size", "32", "--accelerator", "cpu",
                         "--no-progress"], "interrupted: nothing saved to resume from (no --ckpt-dir given)"),
    "train_mnist": (["--data", "synthetic", "--data-root", "d", "--train-size", "64", "--test-size", "32",
                     "--device", "cpu", "--no-progress"],
                    "interrupted: nothing saved to resume from (no --checkpoint given)"),
    "train_imagefolder": (["--data-root", "photos", "--device", "cpu", "--no-progress"],
                          "interrupted: nothing saved to resume from (no --checkpoint given)"),
    "custom_augmentation": (["--limit", "64", "--device", "cpu", "--no-progress"], "interrupted"),
    "custom_backend": ([], "interrupted"),
    "custom_source": ([], "interrupted"),
}
NEEDS = {"accelerate_mnist": "accelerate", "lightning_mnist": "lightning"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.requires(NEEDS[n])) if n in NEEDS else n
                                  for n in EXAMPLES])
def test_ctrl_c_in_every_example_run_as_a_script_is_one_line_and_status_130(name, monkeypatch, capfd, tmp_path):
    """accelerate_mnist and the custom_* examples printed a traceback (exit -2); lightning_mnist Lightning's
    "Detected KeyboardInterrupt" and exit status 1. The example runs as ``python examples/NAME.py`` does
    (its ``__main__`` block), with ``make_loader`` taking Ctrl-C as a slow loader build would."""
    import runpy

    import fastdata
    from fastdata.datasets import make_image_folder

    argv, says = ON_CTRL_C[name]
    make_image_folder(tmp_path / "photos", classes=2, per_class=2, seed=0)
    monkeypatch.chdir(tmp_path)
    # custom_backend registers its backend before Ctrl-C comes: for this test only.
    monkeypatch.setattr(fastdata.registry, "BACKENDS", dict(fastdata.registry.BACKENDS))

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fastdata, "make_loader", ctrl_c)   # the examples import it when they run
    path = str(ROOT / "examples" / f"{name}.py")
    monkeypatch.setattr(sys, "argv", [path, *argv])
    handler = signal.getsignal(signal.SIGINT)   # Lightning ignores SIGINT once it has handled a Ctrl-C
    try:
        runpy.run_path(path, run_name="__main__")
        pytest.fail("the script went on after Ctrl-C")
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:   # caught here: escaping, it would end the whole test session
        pytest.fail("Ctrl-C left the script as a KeyboardInterrupt traceback")
    finally:
        signal.signal(signal.SIGINT, handler)
        if name == "accelerate_mnist":   # accelerate keeps its state in process-wide singletons
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    err = capfd.readouterr().err
    assert code == 130 and err.strip().splitlines()[-1] == says and "Traceback" not in err, (code, err)


def _ctrl_c_in_training(name: str, argv: list[str], cwd: Path, saved: str) -> tuple[int, str]:
    """``python examples/NAME.py ARGV`` in a process group of its own, as a terminal runs it; once the
    file ``saved`` is there (training is under way and has saved) and the loader's worker processes are
    up, Ctrl-C to the whole group, as a terminal sends it (the workers get it too). Returns (exit status,
    stderr), after checking that every worker ended with the run."""
    err = cwd / "stderr.txt"
    with open(err, "w") as stderr:   # a file: a full pipe would stall the run
        # SIGINT back to its default in the child, as under a terminal (a background CI job inherits it
        # ignored).
        proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / f"{name}.py"), *argv], cwd=cwd,
                                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        started = procs.wait_until(lambda: proc.poll() is not None or ((cwd / saved).exists()
                                                                      and procs.children(proc.pid)), timeout=300)
        assert proc.poll() is None, f"ended before training began:\n{err.read_text()[-3000:]}"
        assert started, f"no save to '{saved}' in 300 s:\n{err.read_text()[-3000:]}"
        workers = procs.children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)   # a hang's limit, not the test's measure
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert procs.wait_until(lambda: all(procs.state(p) in (None, "Z", "X") for p in workers), timeout=10), \
        f"worker processes {sorted(workers)} outlived the interrupted run"
    return code, err.read_text()


@pytest.mark.parametrize("name,argv,saved,says", [
    # save_state writes the objects registered for checkpointing last (the scheduler is the second).
    pytest.param("accelerate_mnist", ["--cpu", "--ckpt-dir", "ck"], "ck/custom_checkpoint_1.pkl",
                 "interrupted: the same command with --resume goes on from the last save in 'ck' (every epoch)",
                 marks=pytest.mark.requires("accelerate"), id="accelerate_mnist"),
    pytest.param("lightning_mnist", ["--accelerator", "cpu", "--ckpt-dir", "ck", "--no-progress"], "ck/last.ckpt",
                 "interrupted: the same command with --resume ck/last.ckpt goes on from the last save (every epoch)",
                 marks=pytest.mark.requires("lightning"), id="lightning_mnist"),
    pytest.param("train_mnist", ["--device", "cpu", "--checkpoint", "ck.pt", "--no-progress"], "ck.pt",
                 "interrupted: the same command with --resume goes on from the last save in 'ck.pt' (every epoch)",
                 id="train_mnist"),
])
def test_ctrl_c_in_training_ends_the_run_in_one_line_leaving_no_worker(name, argv, saved, says, tmp_path):
    """A real Ctrl-C after the first epoch's save, with the torch backend's worker processes running: one
    line saying where the last save is and what resumes from it, exit status 130, and no worker left
    behind. accelerate_mnist printed a traceback through autograd (exit -2); lightning_mnist "Detected
    KeyboardInterrupt" and exit status 1, and saved last.ckpt only when training ended."""
    common = ["--data", "synthetic", "--data-root", "d", "--train-size", "1024", "--test-size", "64",
              "--epochs", "1000", "--batch-size", "32", "--backend", "torch", "--workers", "2"]
    code, err = _ctrl_c_in_training(name, [*common, *argv], tmp_path, saved)
    assert code == 130 and err.strip().splitlines()[-1] == says and "Traceback" not in err, (code, err[-3000:])


def test_ctrl_c_names_a_save_state_folder_once_this_run_has_saved_into_it(tmp_path, capsys):
    """accelerate_mnist's --ckpt-dir is a folder that ``save_state`` fills, overwriting an earlier run's
    files in place: the folder's own time stays as it was, so it counts by its newest file."""
    from fastdata import cli

    ck = tmp_path / "ck"
    ck.mkdir()
    earlier = time.time() - 60
    (ck / "model.safetensors").write_bytes(b"an earlier run's save")
    for path in (ck / "model.safetensors", ck):
        os.utime(path, (earlier, earlier))
    args = argparse.Namespace(ckpt_dir=str(ck), ckpt_every=5, resume=False)

    def interrupted(save: bool) -> str:
        saving = cli.fit_errors(args, flags=("--ckpt-dir", "--ckpt-every"), unit="steps")
        with pytest.raises(SystemExit) as info, saving:
            if save:   # this run's save_state, in place
                (ck / "model.safetensors").write_bytes(b"this run's save")
                os.utime(ck, (earlier, earlier))
            raise KeyboardInterrupt
        assert info.value.code == 130
        return capsys.readouterr().err.strip()

    assert interrupted(False) == f"interrupted before the first save to '{ck}': nothing to resume from yet"
    assert interrupted(True) == (f"interrupted: the same command with --resume goes on from the last save in '{ck}' "
                                 f"(every epoch and every 5 steps)")


def test_lightning_ctrl_c_before_the_first_save_of_a_resumed_run_names_the_checkpoint_it_resumed_from():
    module = load_example("lightning_mnist")
    args = module.get_args_parser().parse_args(["--ckpt-dir", "my ck", "--resume", "my ck/last.ckpt"])
    assert module._interrupted(args) == ("interrupted: the same command with --resume 'my ck/last.ckpt' goes on "
                                         "from the last save (every epoch)")
    args = module.get_args_parser().parse_args(["--ckpt-dir", "ck", "--ckpt-every", "50"])
    assert module._interrupted(args) == "interrupted before the first save to 'ck': nothing to resume from yet"
