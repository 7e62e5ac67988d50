"""The shared argument checks (fastdata/checks.py): each names the argument, shows the value and says
what is valid."""
import numpy as np
import pytest

from fastdata import checks, config


@pytest.mark.parametrize("bad", [True, 1.0, "3", None])
def test_check_integer_refuses_a_non_integer_bool_included(bad):
    with pytest.raises(TypeError, match=r"^depth must be an integer, got"):
        checks.check_integer("depth", bad)
    # The range is said even for a value of the wrong type; and it is a ValueError too, as the
    # private copies this replaced raised.
    with pytest.raises(ValueError, match=rf"^depth must be an integer >= 1, got {bad!r}"):
        checks.check_integer("depth", bad, minimum=1)


def test_check_integer_says_the_range():
    assert checks.check_integer("depth", np.int64(3), minimum=1) == 3
    assert type(checks.check_integer("depth", np.int64(3))) is int
    with pytest.raises(ValueError, match=r"depth must be an integer >= 1, got 0"):
        checks.check_integer("depth", 0, minimum=1)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 9\], got 10"):
        checks.check_integer("seed", 10, minimum=0, maximum=9)
    with pytest.raises(ValueError, match=r"n must be an integer <= 9, got 10"):
        checks.check_integer("n", 10, maximum=9)


def test_check_number():
    assert checks.check_number("p", 1) == 1.0
    with pytest.raises(TypeError, match="p must be a number, got True"):
        checks.check_number("p", True)
    with pytest.raises(ValueError, match="p must be a finite number, got nan"):
        checks.check_number("p", float("nan"))
    with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\], got 2.0"):
        checks.check_number("p", 2, minimum=0, maximum=1)
    with pytest.raises(ValueError, match="p must be a number > 0, got 0.0"):
        checks.check_number("p", 0, above=0)
    with pytest.raises(ValueError, match=r"p must be a number > 0 and <= 1, got 2.0"):
        checks.check_number("p", 2, above=0, maximum=1)


@pytest.mark.parametrize("bad, error", [("high", TypeError), (True, TypeError), (float("inf"), ValueError)])
def test_check_number_says_the_range_whatever_is_wrong(bad, error):
    """A value of the wrong type or an infinity is told the valid range as well, as check_integer does:
    the private copies these replaced said it (hw_decoder_load, clip_grad_norm)."""
    with pytest.raises(error, match=r"^load must be a (finite )?number in \[0, 1\], got"):
        checks.check_number("load", bad, minimum=0, maximum=1)
    with pytest.raises(error, match=r"^clip must be a (finite )?number > 0 or None, got"):
        checks.check_number("clip", bad, above=0, optional=True)


def test_optional_integer_and_number_take_none_and_say_so():
    assert checks.check_integer("workers", None, minimum=0, optional=True) is None
    assert checks.check_number("clip", None, above=0, optional=True) is None
    with pytest.raises(TypeError, match="workers must be an integer >= 0"):
        checks.check_integer("workers", None, minimum=0)
    with pytest.raises(ValueError, match=r"^workers must be an integer >= 0 or None, got -1"):
        checks.check_integer("workers", -1, minimum=0, optional=True)


def test_check_flag_and_choice():
    assert checks.check_flag("tf32", np.bool_(True)) is True
    assert checks.check_flag("shuffle", None, optional=True) is None
    with pytest.raises(TypeError, match="tf32 must be True or False, got 1"):
        checks.check_flag("tf32", 1)
    assert checks.check_choice("amp", "off", ("auto", "off")) == "off"
    with pytest.raises(ValueError, match=r"unknown amp 'on'; choose from \['auto', 'off'\]"):
        checks.check_choice("amp", "on", ("auto", "off"))
    # Only a choice's own kind matches: a numpy string array equals a name elementwise, and the private
    # checks check_choice replaced refused it (LoaderConfig(on_error=np.array('skip')) was stored as
    # an ndarray; make_loader(src, np.array('torch')) failed later, unhashable).
    for bad in (np.array("skip"), np.array(["skip"])):
        with pytest.raises(ValueError, match=r"unknown on_error array\("):
            checks.check_choice("on_error", bad, ("raise", "skip"))
    assert checks.check_choice("split", None, (None, "train")) is None
    assert checks.check_choice("on_error", np.str_("skip"), ("raise", "skip")) == "skip"   # a str
    with pytest.raises(ValueError, match="unknown on_error"):
        config.LoaderConfig(device="cpu", on_error=np.array("skip"))


def test_config_keeps_the_names_it_always_exported():
    """config sits above checks; code (and users) that imported the checks from config still find the
    same functions, not copies."""
    assert config.check_integer is checks.check_integer and config.check_flag is checks.check_flag


def _callers():
    import torch

    from fastdata.backends.memory.cache import read_ahead
    from fastdata.batch_transforms import BatchPipeline, Cutout
    from fastdata.config import LoaderConfig
    from fastdata.decode.dali_options import DaliOptions
    from fastdata.engine import FitConfig
    from fastdata.models import SmallCNN
    from fastdata.packing import pack
    from fastdata.prefetch import PrefetchStage
    from fastdata.profiling import StepProfiler
    from fastdata.runlog import RunLog
    from fastdata.sampling import EpochPlan
    from fastdata.shards.order import epoch_order
    from fastdata.shards.storage import Storage

    return {
        "prefetch depth": lambda: PrefetchStage(torch.device("cpu"), depth=True),
        "memory read-ahead": lambda: next(read_ahead(range(3), lambda k: k, ahead=True)),
        "shard order window": lambda: epoch_order([2, 2], seed=0, epoch=0, window=True),
        "Cutout size": lambda: Cutout(True),
        "batch pipeline classes": lambda: BatchPipeline([], num_classes=True, device="cpu"),
        "loader workers": lambda: LoaderConfig(num_workers=True, device="cpu"),
        "fit epochs": lambda: FitConfig(epochs=True),
        "dali threads": lambda: DaliOptions(num_threads=True),
        "pack workers": lambda: pack("digits", "never-written", workers=True),
        "loader batch size": lambda: LoaderConfig(batch_size=True, device="cpu"),
        "storage retries": lambda: Storage("never-read", retries=True),
        "epoch plan samples": lambda: EpochPlan(True, 1, False, False, 0),
        "profiler steps": lambda: StepProfiler("never-written", wait=True, device="cpu"),
        "run log steps": lambda: RunLog("never-written", every_steps=True),
        "SmallCNN width": lambda: SmallCNN(width=True),
    }


@pytest.mark.parametrize("where", sorted(_callers()))
def test_the_rooms_share_the_integer_check(where):
    """A bool where an integer belongs is refused by the one shared check everywhere (its error type
    says so), not by a private copy."""
    with pytest.raises(checks.ArgumentTypeError, match="must be an integer"):
        _callers()[where]()


def test_choices_come_from_the_shared_constants():
    """The amp and on_error choices are spelled once (engine.AMP_CHOICES, config.ON_ERROR); a command
    line that copies them drifts the day a choice is added."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    owners = {"fastdata/engine/amp.py", "fastdata/config.py"}
    copies = [str(p.relative_to(root)) for folder in ("fastdata", "examples", "benchmarks")
              for p in sorted((root / folder).rglob("*.py"))
              # not under benchmarks/.cache (bench_cache keeps a worktree of an older revision there)
              if not any(part.startswith(".") for part in p.relative_to(root).parts)
              and str(p.relative_to(root)) not in owners
              and ('("auto", "bf16", "fp16", "off")' in p.read_text() or '("raise", "skip")' in p.read_text())]
    assert not copies, f"choices spelled out instead of AMP_CHOICES / ON_ERROR in {copies}"


# ------------------------------------------------------------------ environment variables
def test_env_integer_reads_the_variable_and_names_it_its_value_and_range_when_bad(monkeypatch):
    monkeypatch.delenv("FD_TEST_N", raising=False)
    assert checks.env_integer("FD_TEST_N", 7, minimum=1) == 7
    assert checks.env_integer("FD_TEST_N", None, minimum=0) is None
    monkeypatch.setenv("FD_TEST_N", " 3 ")
    assert checks.env_integer("FD_TEST_N", 7, minimum=1) == 3
    monkeypatch.setenv("FD_TEST_N", "0")
    assert checks.env_integer("FD_TEST_N", 7, minimum=0) == 0
    with pytest.raises(ValueError, match=r"^the FD_TEST_N environment variable must be an integer >= 1, got '0'$"):
        checks.env_integer("FD_TEST_N", 7, minimum=1)
    for bad in ("abc", "1.5", "-1"):
        monkeypatch.setenv("FD_TEST_N", bad)
        with pytest.raises(ValueError, match=rf"^the FD_TEST_N environment variable must be an integer >= 0, "
                                             rf"got '{bad}'$"):
            checks.env_integer("FD_TEST_N", 7, minimum=0)


@pytest.mark.parametrize("blank", ["", "  "])
def test_env_integer_takes_an_empty_variable_as_unset(monkeypatch, blank):
    """A launcher that forwards a variable it does not have exports it empty: that is "not given"."""
    monkeypatch.setenv("FD_TEST_N", blank)
    assert checks.env_integer("FD_TEST_N", 7, minimum=1) == 7
    assert checks.env_integer("FD_TEST_N", None, minimum=1) is None
