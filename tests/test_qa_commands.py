"""The command lines as a new user types them: the benchmark scripts, ``python -m fastdata ...`` and the
examples, with the bad values a user gives (zero, negative, not a number, a device that is not there, a
file where a folder goes). Each must end in one line naming the flag, with status 2, before any work."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the scripts live in benchmarks/, next to the package, not inside it
    sys.path.insert(0, str(ROOT))

BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))


def _bench(name):
    return importlib.import_module(f"benchmarks.{name}")


# ------------------------------------------------------------------------------ the benchmark scripts
# Each of these parsed with plain int/float and no device check: --passes 0 measured for minutes and then
# died on statistics.median([]), --device gpu was a torch traceback, --digits-batch 0 wrote a report of
# nothing, --target 99 (a percentage) could never be reached and titled the report "9900%".
BAD_BENCH_FLAGS = [
    ("bench_loaders", "--passes", "0", "must be an integer >= 1"),
    ("bench_loaders", "--device", "gpu", "'gpu' is not a device; use cpu, cuda or cuda:N"),
    ("bench_loaders", "--digits-batch", "0", "must be an integer >= 1"),
    ("bench_loaders", "--min-pass", "-1", "must be a finite number >= 0"),
    ("bench_loaders", "--workers", "0", "must be an integer >= 1"),
    ("bench_training", "--steps", "0", "must be an integer >= 1"),
    ("bench_training", "--epochs", "1", "must be an integer >= 2 (the first epoch is a warm-up)"),
    ("bench_training", "--device", "cuda:x", "is not a device"),
    ("bench_pillow", "--rounds", "0", "must be an integer >= 1"),
    ("bench_pillow", "--round-s", "nan", "must be a finite number > 0"),
    ("bench_decode", "--passes", "0", "must be an integer >= 1"),
    ("bench_decode", "--crops", "-2", "must be an integer >= 1"),
    ("bench_cache", "--photos", "0", "must be an integer >= 1"),
    ("bench_dali_cpu", "--batch", "0", "must be an integer >= 1"),
    ("bench_dali_cpu", "--threads", "x", "must be an integer, got 'x'"),
    ("bench_dali_gpu", "--hw-loads", "2", "must be a fraction in [0, 1]"),
    ("bench_dali_gpu", "--budget", "0", "must be a finite number > 0"),
    ("bench_shards", "--shard-size", "abc", "is not a size"),
    ("bench_shards", "--window", "0", "must be an integer >= 1"),
    ("bench_shards", "--delay", "-1", "must be a finite number >= 0"),
    ("bench_accuracy", "--target", "99", "must be a fraction in [0, 1] such as 0.99, got '99'"),
    ("bench_accuracy", "--amp", "fp8", "invalid choice: 'fp8'"),
    ("bench_accuracy", "--epochs", "0", "must be an integer >= 1"),
]


@pytest.mark.parametrize("name,flag,value,message", BAD_BENCH_FLAGS)
def test_a_benchmarks_bad_flag_is_its_own_one_line_error(name, flag, value, message, capsys):
    with pytest.raises(SystemExit) as info:
        _bench(name).get_args_parser().parse_args([flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and message in err and "Traceback" not in err, err
    # bench_accuracy checked its flags only through the example's parser: the usage shown was
    # train_mnist's (--checkpoint-every, --resume ...), flags bench_accuracy does not take.
    assert "--checkpoint-every" not in err, err


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_benchmarks_out_that_is_a_file_is_refused_before_any_work(name, tmp_path, capsys):
    """It failed only when the reports were written, after the whole measurement."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as info:
        _bench(name).get_args_parser().parse_args(["--out", str(tmp_path / "afile")])
    assert info.value.code == 2
    assert "argument --out: " in capsys.readouterr().err


def test_a_compare_interpreter_that_is_not_there_is_refused_before_measuring(tmp_path, capsys):
    """It was measured for nothing: the run went on, and the report left the interpreter out silently."""
    with pytest.raises(SystemExit) as info:
        _bench("bench_pillow").get_args_parser().parse_args(["--compare", str(tmp_path / "no-python")])
    assert info.value.code == 2
    assert "argument --compare: no interpreter" in capsys.readouterr().err


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_flag_says_what_it_does_in_help(name):
    """bench_training's --device, --data, --amp ... and bench_accuracy's --lr, --amp, --out were bare names."""
    parser = _bench(name).get_args_parser()
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not bare, f"{name}: flags without help: {bare}"


def test_a_bad_benchmark_flag_from_the_shell_is_one_line_and_status_2():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_loaders.py"), "--quick", "--passes", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == \
        "bench_loaders.py: error: argument --passes: must be an integer >= 1, got '0'"
    assert "Traceback" not in out.stderr and not out.stdout


# ------------------------------------------------------------------------------ the examples
def _example(name):
    from conftest import load_example

    return load_example(name)


def test_lightning_resume_from_a_checkpoint_of_fit_is_one_line_naming_it(tmp_path, capsys):
    """train_mnist.py's --checkpoint (a torch.save archive) passed the archive check and died inside
    trainer.fit, after the data and the model were built: KeyError: 'pytorch-lightning_version'."""
    import torch

    module = _example("lightning_mnist")
    for content, says in (({"format": "fastdata-checkpoint-2", "model": {}}, "a checkpoint of fastdata's fit"),
                          ({"weight": torch.zeros(2)}, "a file torch.save wrote")):
        ck = tmp_path / "ck.pt"
        torch.save(content, ck)
        parser = module.get_args_parser()
        with pytest.raises(SystemExit) as info:
            module._check_args(parser, parser.parse_args(["--resume", str(ck)]))
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --resume: '{ck}' is {says}" in err and "not a Lightning checkpoint" in err, err


def test_lightning_accelerator_gpu_without_one_is_one_line_before_lightning_starts(monkeypatch, capsys):
    """It was Lightning's MisconfigurationException traceback ("No supported gpu backend found!")."""
    import torch

    module = _example("lightning_mnist")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    parser = module.get_args_parser()
    with pytest.raises(SystemExit) as info:
        module._check_args(parser, parser.parse_args(["--accelerator", "gpu"]))
    assert info.value.code == 2
    assert "argument --accelerator: gpu with --devices 1, but torch sees 0 GPU(s) here" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)   # two GPUs: --devices 2 is fine, 3 is not
    module._check_args(parser, parser.parse_args(["--accelerator", "gpu", "--devices", "2"]))
    with pytest.raises(SystemExit):
        module._check_args(parser, parser.parse_args(["--accelerator", "gpu", "--devices", "3"]))


def test_accelerate_resume_from_a_folder_without_a_saved_state_is_one_line(tmp_path, capsys):
    """An empty --ckpt-dir (or any folder) passed the is-a-folder check and ended in accelerate's
    load_state as a FileNotFoundError traceback for pytorch_model.bin, after the data and model were built."""
    module = _example("accelerate_mnist")
    parser = module.get_args_parser()
    with pytest.raises(SystemExit) as info:
        module._check_args(parser, parser.parse_args(["--ckpt-dir", str(tmp_path), "--resume"]))
    assert info.value.code == 2
    assert f"argument --resume: '{tmp_path}' holds no saved state" in capsys.readouterr().err


def test_accelerate_a_save_cut_short_leaves_the_previous_one_whole(tmp_path, monkeypatch, capsys):
    """save_state wrote its files into --ckpt-dir one by one: Ctrl-C in the middle of the second save left
    a truncated model file where the first save's was, and --resume failed on it."""
    from accelerate import Accelerator

    module = _example("accelerate_mnist")
    ck = tmp_path / "ck"
    argv = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
            "--backend", "memory", "--workers", "0", "--epochs", "1", "--batch-size", "64", "--cpu",
            "--ckpt-dir", str(ck), "--ckpt-every", "2"]
    real, calls = Accelerator.save_state, []

    def cut_short(self, output_dir=None, **kw):
        calls.append(output_dir)
        if len(calls) == 2:   # the step-4 save: the model file half written, then Ctrl-C
            os.makedirs(output_dir, exist_ok=True)
            (Path(output_dir) / "model.safetensors").write_bytes(b"half a file")
            raise KeyboardInterrupt
        return real(self, output_dir, **kw)

    monkeypatch.setattr(Accelerator, "save_state", cut_short)
    with pytest.raises(SystemExit) as info:
        module.run(argv)
    assert info.value.code == 130
    monkeypatch.setattr(Accelerator, "save_state", real)
    capsys.readouterr()
    result = module.run([*argv, "--resume"])
    assert f"resumed from '{ck}': epoch 0, batch 2/4" in capsys.readouterr().out
    assert result["global_step"] == 4 and result["epoch"] == 1


def test_resuming_with_another_lr_is_refused_not_ignored(tmp_path):
    """Resuming restores the optimizer and its one-cycle schedule: --lr 0.01 on a run saved at 0.1 trained
    at 0.1 without a word, and --json-out's config said 0.01."""
    module = _example("train_mnist")
    ck = tmp_path / "ck.pt"
    common = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
              "--backend", "memory", "--device", "cpu", "--workers", "0", "--no-progress", "--batch-size", "128",
              "--epochs", "1", "--checkpoint", str(ck)]
    module.main(module.get_args_parser().parse_args(common))
    saved = ck.read_bytes()
    with pytest.raises(SystemExit, match=rf"error: --lr: '{ck}' was saved by a run whose schedule peaks at lr 0.1, "
                                         r"and resuming restores it: this run's 0.01 would be ignored"):
        module.main(module.get_args_parser().parse_args([*common, "--resume", "--lr", "0.01"]))
    assert ck.read_bytes() == saved
    module.main(module.get_args_parser().parse_args([*common, "--resume", "--lr", "0.1"]))   # the same: fine


# ------------------------------------------------------------------------------ python -m fastdata
def test_pack_names_out_when_out_cannot_be_made(tmp_path):
    """A name too long for the file system passes cli.output_problem (its parent is writable) and fails at
    mkdir: the one line said ``SOURCE '<folder>': [Errno 36] File name too long: '<OUT>'``."""
    from fastdata.datasets import make_image_folder

    source = make_image_folder(tmp_path / "photos", classes=2, per_class=2, seed=0)
    out = tmp_path / ("x" * 300)
    done = subprocess.run([sys.executable, "-m", "fastdata", "pack", str(source), str(out), "--no-progress",
                           "--workers", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "OUT" in last and "SOURCE" not in last, last


def test_bench_measures_a_backend_named_twice_once_and_says_the_precision_it_ran(capsys):
    """``--backends memory memory`` measured memory twice, both rows "(recommended)"; and the report did not
    say at which precision the model's step was timed (``--amp auto`` resolves per device)."""
    from fastdata import bench
    from fastdata.datasets import SyntheticDigits

    payload = bench.run(SyntheticDigits(256, seed=0), batch_size=64, device="cpu", batches=2, warmup=1,
                        num_workers=0, progress=False, backends=["memory", "memory"])
    assert [r["backend"] for r in payload["rows"]] == ["memory"]
    assert payload["amp"] == "off"   # auto on the CPU
    assert "(smallcnn, amp off)" in bench.report_markdown(payload)


def test_resuming_a_checkpoint_of_another_model_names_the_model_not_the_lr(tmp_path):
    """The --lr check reads the checkpoint before fit: one of another model is fit's to name."""
    import torch

    module = _example("train_mnist")
    ck = tmp_path / "other.pt"
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.5)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)
    from fastdata import checkpoint

    checkpoint.save({"format": "fastdata-checkpoint-2", "model": other.state_dict(), "optimizer": opt.state_dict(),
                     "optimizer_class": "SGD"}, ck)
    argv = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
            "--backend", "memory", "--device", "cpu", "--workers", "0", "--no-progress", "--batch-size", "128",
            "--epochs", "1", "--checkpoint", str(ck), "--resume"]
    with pytest.raises(SystemExit, match="^error: --checkpoint: ") as info:   # fit's verdict, not "--lr: ..."
        module.main(module.get_args_parser().parse_args(argv))
    assert "lr" not in str(info.value.code), info.value.code


def test_gpu_summary_refuses_a_keep_that_is_not_there_and_makes_its_out(tmp_path, capsys):
    """A mistyped --keep summed up as "0 of 0 stages passed", and a missing --out was a
    FileNotFoundError traceback for summary-<tag>.md.tmp."""
    summary = _bench("gpu_summary")
    with pytest.raises(SystemExit) as info:
        summary.get_args_parser().parse_args(["--keep", str(tmp_path / "nope"), "--tag", "t", "--out", str(tmp_path)])
    assert info.value.code == 2 and "argument --keep: " in capsys.readouterr().err
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "stages.tsv").write_text("1\tdoctor\tpass\t3\t60\n")
    args = summary.get_args_parser().parse_args(["--keep", str(tmp_path / "keep"), "--tag", "t",
                                                 "--out", str(tmp_path / "new" / "out")])
    assert summary.main(args).read_text().startswith("# GPU run `t`: 1 of 1 stages passed")


def _parsers():
    from conftest import load_example
    from fastdata.__main__ import get_args_parser as fastdata_parser

    subs = fastdata_parser()._subparsers._group_actions[0].choices
    yield "fastdata bench", subs["bench"]
    yield "fastdata pack", subs["pack"]
    for name in ("train_mnist", "train_imagefolder", "lightning_mnist", "accelerate_mnist", "custom_augmentation"):
        yield name, load_example(name).get_args_parser()
    for name in BENCHMARKS:
        yield name, _bench(name).get_args_parser()


def test_every_flag_with_a_default_gives_it_in_help():
    """--batch-size said "per process" and not 256, --data-root not ./data, --lr not 0.1, bench_accuracy's
    --amp nothing at all: a new user had to read the source for what a plain run does."""
    import argparse

    silent = []
    for name, parser in _parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if (not action.option_strings or action.help == argparse.SUPPRESS or action.default is None
                    or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                           argparse._HelpAction))):
                continue
            if "default" not in (formatter._get_help_string(action) or ""):
                silent.append(f"{name} {action.option_strings[0]} (default {action.default!r})")
    assert not silent, "\n".join(silent)


@pytest.mark.parametrize("name", ["train_mnist", "lightning_mnist", "accelerate_mnist"])
def test_a_data_root_that_is_a_file_is_refused_before_the_digits_are_drawn(name, tmp_path, capsys):
    """train_mnist drew the digits (over a minute for the default sizes) and then failed to keep them
    under the file: ``[Errno 20] Not a directory``; the other two said "MNIST is not in '<file>'"."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as info:
        _example(name).get_args_parser().parse_args(["--data-root", str(tmp_path / "afile")])
    assert info.value.code == 2
    assert f"argument --data-root: '{tmp_path / 'afile'}' is a file, not a folder" in capsys.readouterr().err


def test_accelerate_resume_with_more_epochs_than_its_schedule_is_one_line(tmp_path):
    """load_state restores the saved run's OneCycleLR over the one built for --epochs 2: training went on
    until torch's "Tried to step 5 times. The specified number of total steps is 4" traceback."""
    module = _example("accelerate_mnist")
    ck = tmp_path / "ck"
    argv = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
            "--backend", "memory", "--workers", "0", "--batch-size", "64", "--cpu", "--ckpt-dir", str(ck)]
    module.run([*argv, "--epochs", "1"])
    with pytest.raises(SystemExit, match=rf"error: --epochs 2: '{ck}' was saved by a run whose one-cycle .* ends "
                                         r"after 4 steps; .* resume with --epochs 1 or fewer"):
        module.run([*argv, "--epochs", "2", "--resume"])


@pytest.mark.parametrize("name", ["accelerate_mnist", "lightning_mnist"])
def test_resuming_with_another_lr_is_refused_in_accelerate_and_lightning_too(name, tmp_path):
    """load_state and Lightning's ckpt_path restore the optimizer and its one-cycle schedule: --lr 0.05
    on a run saved at 0.1 trained on at 0.1 without a word."""
    module = _example(name)
    ck = tmp_path / "ck"
    argv = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
            "--backend", "memory", "--workers", "0", "--batch-size", "64", "--ckpt-dir", str(ck), "--epochs", "1",
            *(["--cpu"] if name == "accelerate_mnist" else ["--accelerator", "cpu", "--no-progress"])]
    module.run(argv)
    resume = ["--resume"] if name == "accelerate_mnist" else ["--resume", str(ck / "last.ckpt")]
    with pytest.raises(SystemExit, match=r"error: --lr 0.05: .* was saved by a run whose schedule peaks at lr 0.1"):
        module.run([*argv, *resume, "--lr", "0.05"])
