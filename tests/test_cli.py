"""fastdata.cli: the argument checks every command line shares."""
import argparse
import sys

import pytest

from fastdata import cli, registry


@pytest.mark.parametrize("fn,good,bad", [
    (cli.positive_int, [("1", 1), ("256", 256)], ["0", "-3", "2.5", "x"]),
    (cli.nonnegative_int, [("0", 0), ("4", 4)], ["-1", "x"]),
    (cli.seed, [("0", 0), (str(2**32 - 1), 2**32 - 1)], ["-1", str(2**32)]),
    (cli.positive_float, [("0.1", 0.1), ("1e-3", 1e-3)], ["0", "-1", "nan", "inf", "x"]),
])
def test_number_types_take_good_values_and_refuse_bad_ones_quoting_them(fn, good, bad):
    for text, value in good:
        assert fn(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace("[", r"\[").replace(".", r"\.")):
            fn(text)


def test_devices_are_checked_against_this_machine(monkeypatch):
    assert cli.device("cpu") == "cpu"
    with pytest.raises(argparse.ArgumentTypeError, match="'gpu' is not a device; use cpu, cuda or cuda:N"):
        cli.device("gpu")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(argparse.ArgumentTypeError, match="CUDA is not available here"):
        cli.device("cuda")


def test_a_backend_whose_package_is_missing_says_how_to_install_it(monkeypatch):
    """argparse's ``choices`` would say only "invalid choice: 'dali'"; the README's first command is
    ``--backend dali``."""
    monkeypatch.setitem(sys.modules, "nvidia.dali.plugin.pytorch", None)   # import now fails
    registry.clear_import_cache()
    try:
        with pytest.raises(argparse.ArgumentTypeError, match="backend 'dali' needs .*install: pip install nvidia-dali"):
            cli.backend("dali")
    finally:
        monkeypatch.undo()
        registry.clear_import_cache()
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown backend 'nope'; choose from \['auto', 'torch'"):
        cli.backend("nope")
    assert cli.backend("auto") == "auto" and cli.backend("torch") == "torch"


def test_output_paths_are_refused_when_they_could_not_be_written(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="x")
    (tmp_path / "f").write_text("x")
    for path, message in [(tmp_path, "is a folder"), (tmp_path / "f" / "a" / "b.json", "which is a file")]:
        with pytest.raises(SystemExit):
            cli.check_output(parser, "--out", path)
        err = capsys.readouterr().err
        assert f"argument --out: '{path}'" in err and message in err, err
    cli.check_output(parser, "--out", tmp_path / "new" / "deeper" / "r.json")   # created later: fine
    cli.check_output(parser, "--out", None)
    with pytest.raises(SystemExit):
        cli.check_output(parser, "--out", tmp_path / "f", folder=True)
    cli.check_output(parser, "--out", tmp_path, folder=True)


def test_input_errors_become_one_line_and_others_keep_their_traceback():
    with pytest.raises(SystemExit, match=r"^error: --data-root: the last line$"):
        with cli.input_errors("--data-root"):
            raise FileNotFoundError("a first line\nthe last line")
    with pytest.raises(KeyError):   # not a bad input: a bug, whose traceback matters
        with cli.input_errors("--data-root"):
            raise KeyError("x")


def test_a_root_that_does_not_exist_ends_the_walk_up(monkeypatch):
    """``dirname`` of a Windows drive or share root is itself: the walk up to an existing folder must
    stop there (it looped forever on a missing drive)."""
    import ntpath

    monkeypatch.setattr(cli.os, "path", ntpath)
    monkeypatch.setattr(ntpath, "exists", lambda p: False)
    monkeypatch.setattr(ntpath, "isdir", lambda p: False)
    assert cli.output_problem(r"Z:\runs\r.json") == r"'Z:\' does not exist"


def test_compile_modes_are_fits_values_and_an_unknown_one_lists_them():
    assert [cli.compile_mode(m) for m in ("off", "default", "reduce-overhead")] == [False, True, "reduce-overhead"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown mode 'max'; choose from \['off', 'default'"):
        cli.compile_mode("max")


def test_plot_run_log_draws_the_curves_or_says_in_one_line_that_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    import fastdata.runlog as runlog

    assert cli.plot_run_log(None) is None
    with runlog.RunLog(tmp_path, tensorboard=False) as log:
        log.epoch({"epoch": 1, "train_loss": 1.0})
    assert cli.plot_run_log(str(tmp_path)) == str(tmp_path / "curves.png") and (tmp_path / "curves.png").exists()

    def missing(*args, **kwargs):
        raise ImportError("plot_curves needs matplotlib: pip install matplotlib")

    monkeypatch.setattr(runlog, "plot_curves", missing)
    capsys.readouterr()
    assert cli.plot_run_log(str(tmp_path)) is None
    assert capsys.readouterr().out.strip().splitlines() == [
        f"--log-dir: no curves.png: matplotlib is not installed (pip install matplotlib); the CSVs are in {tmp_path}"]

    # A full disk at the very end: the run is done, and only the picture is lost (it was a traceback
    # and exit status 1 after a finished run).
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runlog, "plot_curves", full)
    assert cli.plot_run_log(str(tmp_path)) is None
    assert capsys.readouterr().out.strip().splitlines() == [
        f"--log-dir: no curves.png (OSError: [Errno 28] No space left on device); the CSVs are in {tmp_path}"]


def test_every_command_takes_source_names_through_one_parser(tmp_path, monkeypatch):
    """Issue 32: bench and pack each parsed SOURCE (``bench.open_source``, ``pack._open_spec``); one
    parser now names the same source for both, with one help text."""
    from fastdata import bench
    from fastdata.__main__ import get_args_parser
    from fastdata.datasets import spec
    from fastdata.packing import writer

    sub = next(a for a in get_args_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {name: next(a.help for a in sub.choices[name]._actions if a.dest == "source") for name in ("bench", "pack")}
    assert helps == {"bench": spec.SOURCE_HELP, "pack": spec.SOURCE_HELP}
    assert bench.open_source is spec.open_source           # bench's is the shared one, not a copy
    seen = []
    monkeypatch.setattr(spec, "open_source", lambda name, **kw: seen.append((name, kw)) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        writer.pack("digits", tmp_path / "out", split="test", progress=False)
    assert seen == [("digits", {"split": "test"})]


class _Writes:
    """A stderr that keeps each write call apart."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text):
        self.calls.append(text)
        return len(text)

    def flush(self):
        pass


@pytest.mark.parametrize("say", [
    lambda: cli.say_line("error: the loss went nan on rank 1"),
    # exit_with's exchange, through a real (in-process) c10d store: the line the first rank to claim it prints
    lambda: cli._say_once(__import__("torch").distributed.HashStore(), "t", "error: the loss went nan on rank 1",
                          False, 0, 1),
])
def test_an_error_line_is_one_write_so_ranks_printing_at_once_keep_their_lines_whole(monkeypatch, say):
    """Under torchrun the ranks share one stderr; print() writes the text and its newline apart, each
    a system call of its own under PYTHONUNBUFFERED=1, and two ranks failing at once printed
    "error: ...rank 1error: ...rank 0" on one line."""
    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    say()
    assert err.calls == ["error: the loss went nan on rank 1\n"]


def test_a_rank_without_a_process_group_says_its_error_line_in_one_write(monkeypatch):
    """``torchrun -m fastdata pack`` starts no process group: exit_with returned SystemExit(line), which
    Python prints as two writes (the text, then the newline), and two ranks refusing their files at once
    printed "error: ...rank 0's fileserror: ...rank 1's files" on one line. Said in one write, status 1;
    a single process still gets its line in the SystemExit."""
    err = _Writes()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    exit = cli.exit_with("error: fastdata pack: 3 files of rank 1")
    assert err.calls == ["error: fastdata pack: 3 files of rank 1\n"] and exit.code == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert cli.exit_with("error: alone").code == "error: alone" and len(err.calls) == 1
