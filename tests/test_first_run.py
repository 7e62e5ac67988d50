"""What a new user types first, as they type it: every example answers ``--help``, refuses a flag it does
not know, and ends a Ctrl-C or a bad ``--resume`` file with one line instead of a traceback.

The other first commands are covered where their code is: the flags' checks in ``test_examples.py`` and
``test_cli.py``, ``python -m fastdata`` in ``test_cli.py``, ``test_doctor.py`` and ``test_bench.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
def test_the_demos_still_run_when_called_with_their_parsed_arguments(name, capsys):
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
                                            f"save in '{ck}' (every epoch and every 5 steps)"), err
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
    torch.save({"state_dict": {}}, good)
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
