import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import load_example
from fastdata import available_backends
from fastdata.datasets import make_image_folder

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
JSON_FIELDS = {"backend", "device", "dataset", "epochs", "test_accuracy", "train_seconds", "images_per_second",
               "data_wait_fraction", "gpu_idle_fraction", "history", "config"}
# What every example's --json-out config holds: the flags that shape a run, and what they resolved to.
CONFIG_KEYS = {"backend", "epochs", "batch_size", "lr", "seed", "workers", "num_workers", "amp", "device",
               "compile", "channels_last", "augment", "optimizer", "scheduler", "scheduler_interval",
               "checkpoint", "resume"}


def _load(name):
    return load_example(name)


@pytest.fixture(scope="module")
def mnist_example():
    return _load("train_mnist")


@pytest.fixture(scope="module")
def folder_example():
    return _load("train_imagefolder")


@pytest.mark.parametrize("name", ["train_mnist", "train_imagefolder"])
def test_parsers_take_choices_from_the_registry_and_no_type_bool(name):
    parser = _load(name).get_args_parser()
    actions = {a.dest: a for a in parser._actions}
    for backend in available_backends():
        assert parser.parse_args(["--data-root", "x", "--backend", backend]).backend == backend
    assert list(actions["amp"].choices) == ["auto", "bf16", "fp16", "off"]
    assert all(a.type is not bool for a in parser._actions)
    assert isinstance(actions["gradient_checkpointing"], argparse.BooleanOptionalAction)
    # --compile takes fit's modes (alone: the default mode); --no-compile still turns it off.
    parse = parser.parse_args
    assert [parse(["--data-root", "x", *flags]).compile for flags in
            ([], ["--compile"], ["--compile", "off"], ["--compile", "reduce-overhead"], ["--no-compile"])] == \
        [False, True, False, "reduce-overhead", False]
    with pytest.raises(SystemExit):
        parser.parse_args(["--data-root", "x", "--backend", "nope"])


def test_mnist_parser_defaults(mnist_example):
    args = mnist_example.get_args_parser().parse_args([])
    assert (args.epochs, args.data, args.data_root, args.backend, args.amp) == (3, "auto", "./data", "auto", "auto")
    assert args.download and not args.resume and not args.no_progress and args.json_out is None
    assert not mnist_example.get_args_parser().parse_args(["--no-download"]).download


@pytest.fixture
def no_network(monkeypatch):
    """torchvision's MNIST download fails the test if anything calls it: the tests below must pass the
    same with and without a network, so none of them may fetch MNIST."""
    import torchvision

    calls = []

    def refuse(*args, **kwargs):
        # fastdata.datasets.MNIST turns any download error into "files not found", so raising here
        # alone would go unnoticed: the call is recorded and the teardown fails the test.
        calls.append((args, kwargs))
        raise OSError("no network in this test")

    monkeypatch.setattr(torchvision.datasets, "MNIST", refuse)
    yield calls
    assert not calls, f"the test tried to download MNIST: {calls}"


@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "auto"])
def test_mnist_example_writes_its_result_as_json(mnist_example, tmp_path, backend, no_network):
    out = tmp_path / "result.json"
    args = mnist_example.get_args_parser().parse_args(
        ["--backend", backend, "--data", "synthetic", "--train-size", "1536", "--test-size", "256", "--epochs", "2",
         "--batch-size", "64", "--workers", "0", "--device", "cpu", "--no-progress",
         "--json-out", str(out), "--data-root", str(tmp_path / "data")])  # not the checkout's ./data
    mnist_example.main(args)
    result = json.loads(out.read_text())
    assert JSON_FIELDS <= set(result)
    assert result["backend"] == backend and result["device"] == "cpu" and result["dataset"] == "synthetic"
    assert result["epochs"] == 2 and len(result["history"]) == 2
    assert 0.3 < result["test_accuracy"] <= 1.0      # learned something: chance is 0.1
    assert result["gpu_idle_fraction"] is None        # CPU
    assert 0 <= result["data_wait_fraction"] <= 1 and result["images_per_second"] > 0
    assert result["train_seconds"] > 0
    config = result["config"]
    assert CONFIG_KEYS <= set(config)
    assert (config["lr"], config["seed"], config["workers"], config["batch_size"], config["epochs"]) == \
        (0.1, 0, 0, 64, 2)
    assert (config["backend"], config["amp"], config["device"], config["data"]) == (backend, "auto", "cpu", "synthetic")
    assert config["num_workers"] == 0 and (config["train_size"], config["test_size"]) == (1536, 256)
    assert (config["scheduler"], config["scheduler_interval"]) == ("OneCycleLR", "step")
    assert config["augment"]["crop"] == "translate" and config["augment"]["pad"] == 2   # the digits recipe
    # Each epoch's lr: the one-cycle schedule peaks in epoch 1 and has annealed to nearly 0 by the end.
    lrs = [r["lr"] for r in result["history"]]
    assert all(isinstance(lr, float) for lr in lrs) and lrs[1] < lrs[0] / 100 and lrs[0] <= 0.1


def test_mnist_example_accumulates_clips_and_averages_weights(mnist_example, tmp_path, no_network):
    """--accumulate 3 over 8 batches: 3 optimizer steps an epoch, and the one-cycle schedule built for them
    (built for 8 it would end mid-anneal); --clip-grad-norm puts grad_norm in each record; --ema
    evaluates the average."""
    out = tmp_path / "result.json"
    args = mnist_example.get_args_parser().parse_args(
        ["--backend", "memory", "--data", "synthetic", "--train-size", "512", "--test-size", "128", "--epochs", "2",
         "--batch-size", "64", "--workers", "0", "--device", "cpu", "--no-progress", "--accumulate", "3",
         "--clip-grad-norm", "5", "--ema", "0.5", "--json-out", str(out), "--data-root", str(tmp_path / "data")])
    mnist_example.main(args)
    result = json.loads(out.read_text())
    assert (result["config"]["accumulate"], result["config"]["clip_grad_norm"], result["config"]["ema"]) == (3, 5, 0.5)
    history = result["history"]
    assert all(r["grad_norm"] > 0 and r["eval_ema"] is True for r in history)
    assert history[1]["lr"] < 0.1 / 100   # annealed at the end: 6 optimizer steps of a 6-step schedule


def test_mnist_example_profiles_and_logs_the_run_and_draws_its_curves(mnist_example, tmp_path, capsys, no_network):
    """--profile DIR: a trace of a few steps and the table; --log-dir DIR: the CSVs and DIR/curves.png."""
    import csv

    prof, log = tmp_path / "prof", tmp_path / "log"
    args = mnist_example.get_args_parser().parse_args(
        ["--backend", "memory", "--data", "synthetic", "--train-size", "512", "--test-size", "128", "--epochs", "2",
         "--batch-size", "64", "--workers", "0", "--device", "cpu", "--no-progress", "--gradient-checkpointing",
         "--profile", str(prof), "--log-dir", str(log), "--data-root", str(tmp_path / "data")])
    result = mnist_example.main(args)
    traces = list(prof.glob("*.pt.trace.json"))
    assert len(traces) == 1 and "forward_backward" in traces[0].read_text()
    out = capsys.readouterr().out
    assert "profile: where each step's time went" in out and f"curves: {log / 'curves.png'}" in out
    with open(log / "epochs.csv", newline="") as f:
        epochs = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in epochs] == [1, 2]
    assert float(epochs[1]["eval_accuracy"]) == pytest.approx(result["history"][1]["eval_accuracy"])
    assert (log / "steps.csv").read_text().startswith("step,loss,lr,")
    assert (log / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["config"]["gradient_checkpointing"] is True and result["config"]["compile"] is False


def test_mnist_auto_without_mnist_trains_on_synthetic_digits_and_says_so_once(mnist_example, tmp_path, capsys,
                                                                              no_network):
    args = mnist_example.get_args_parser().parse_args(
        ["--data-root", str(tmp_path / "empty"), "--no-download", "--train-size", "256", "--test-size", "128",
         "--epochs", "1", "--batch-size", "64", "--workers", "0", "--device", "cpu", "--backend", "memory",
         "--no-progress"])
    result = mnist_example.main(args)
    assert result["dataset"] == "synthetic"
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "synthetic digits instead" in line]
    assert len(lines) == 1 and "--no-download was given" in lines[0]
    assert "synthetic test accuracy" in out


def test_mnist_required_but_missing_fails_naming_the_files(mnist_example, tmp_path, no_network):
    args = mnist_example.get_args_parser().parse_args(["--data", "mnist", "--data-root", str(tmp_path),
                                                       "--no-download", "--device", "cpu"])
    with pytest.raises(SystemExit, match="^error: --data mnist: MNIST files not found"):
        mnist_example.main(args)


def test_imagefolder_example_trains_validates_checkpoints_and_writes_json(folder_example, tmp_path):
    make_image_folder(tmp_path / "train", classes=2, per_class=6, seed=0)
    make_image_folder(tmp_path / "val", classes=2, per_class=2, seed=1)
    out = tmp_path / "r.json"
    args = folder_example.get_args_parser().parse_args(
        ["--data-root", str(tmp_path / "train"), "--val-root", str(tmp_path / "val"), "--backend", "torch",
         "--epochs", "1", "--batch-size", "4", "--image-size", "64", "--workers", "0", "--device", "cpu",
         "--no-progress", "--json-out", str(out), "--checkpoint", str(tmp_path / "ck.pt")])
    folder_example.main(args)
    result = json.loads(out.read_text())
    assert JSON_FIELDS <= set(result)
    assert result["classes"] == 2 and len(result["history"]) == 1
    assert 0.0 <= result["test_accuracy"] <= 1.0
    assert result["image_size"] == 64 and result["backend_requested"] == "torch"
    config = result["config"]
    assert CONFIG_KEYS <= set(config)
    assert (config["lr"], config["peak_lr"], config["batch_size"], config["workers"], config["seed"]) == \
        (0.2, 0.2 * 4 / 256, 4, 0, 0)
    assert config["augment"]["crop"] == "random_resized" and config["augment"]["size"] == 64
    assert config["eval_augment"]["crop"] == "center" and config["checkpoint"] == str(tmp_path / "ck.pt")
    # Two parameter groups (decay and no decay) at one lr: recorded as one float.
    assert isinstance(result["history"][0]["lr"], float)
    assert (tmp_path / "ck.pt").exists()


# --------------------------------------------------------------------------------- torchrun / DDP
SHARD_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, torch
    from fastdata import Augmentation, make_loader
    from fastdata import distributed as fdist
    from fastdata.datasets import ArraySource
    from fastdata.engine import fit
    from fastdata.models import SmallCNN

    device = fdist.init_distributed("cpu")
    # Image i carries its id in its first two pixels; mean 0 / std 1 lets us read it back exactly.
    n = 96
    images = np.zeros((n, 12, 12), np.uint8)
    images[:, 0, 0], images[:, 0, 1] = np.arange(n) // 256, np.arange(n) % 256
    images[:, 4:8, 4:8] = (np.arange(n) % 10 * 25)[:, None, None]
    src = ArraySource(images, np.arange(n) % 10, mean=(0.0,), std=(1.0,))
    # device="cpu" explicitly: on a GPU machine the default is CUDA, and this test is about gloo.
    loader = make_loader(src, sys.argv[1], batch_size=8, num_workers=0, augment=Augmentation.none(), seed=1,
                         device=device)

    class Ids:
        def __init__(self, inner):
            self.inner, self.device, self.ids = inner, inner.device, []
        def __len__(self): return len(self.inner)
        def set_epoch(self, e): self.inner.set_epoch(e)
        def state_dict(self): return self.inner.state_dict()
        def load_state_dict(self, s): self.inner.load_state_dict(s)
        def __iter__(self):
            for x, y in self.inner:
                px = torch.round(x[:, 0, 0, :2] * 255).long()
                self.ids += (px[:, 0] * 256 + px[:, 1]).tolist()
                yield x, y

    torch.manual_seed(fdist.rank())  # different initial weights: DDP must broadcast rank 0's
    model = SmallCNN(width=4)
    ids = Ids(loader)
    hist = fit(model, ids, epochs=1, eval_loader=make_loader(src, sys.argv[1], batch_size=16, train=False,
               num_workers=0, device=device), progress=False)
    weights = float(sum(p.detach().double().sum() for p in model.parameters()))
    with open(os.path.join(sys.argv[2], f"rank{fdist.rank()}.json"), "w") as f:
        json.dump({"ids": ids.ids, "world": fdist.world_size(), "weights": weights, "history": hist}, f)
    fdist.cleanup()
""")


def _torchrun(args, cwd, timeout=90):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_ddp_two_ranks_read_disjoint_shards_and_agree(tmp_path):
    script = tmp_path / "shards.py"
    script.write_text(SHARD_SCRIPT)
    _torchrun([str(script), "torch", str(tmp_path)], cwd=tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert len(r0["ids"]) == len(r1["ids"]) == 48
    assert not set(r0["ids"]) & set(r1["ids"])
    assert sorted(r0["ids"] + r1["ids"]) == list(range(96))
    assert r0["weights"] == r1["weights"]       # DDP kept the replicas identical
    assert r0["history"] == r1["history"]       # figures were reduced over both ranks


def test_mnist_example_under_torchrun(tmp_path):
    out = tmp_path / "ddp.json"
    # --data auto with no MNIST (and no download, so the test is the same with a network): rank 0
    # looks first, the other rank waits at the barrier, both fall back.
    proc = _torchrun([str(EXAMPLES / "train_mnist.py"), "--data-root", str(tmp_path / "none"), "--no-download",
                      "--train-size", "1024",
                      "--test-size", "256", "--epochs", "1", "--batch-size", "64", "--workers", "0",
                      "--backend", "memory", "--device", "cpu", "--no-progress", "--json-out", str(out)],
                     cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["device"] == "cpu"
    assert proc.stdout.count("epoch 1/1") == 1          # rank 0 prints, rank 1 does not
    assert proc.stdout.count("synthetic digits instead") == 1 and result["dataset"] == "synthetic"
    assert JSON_FIELDS <= set(result)


def test_mnist_example_keeps_the_synthetic_digits_it_drew_and_reads_them_next_time(mnist_example, tmp_path, capsys,
                                                                                   no_network):
    """The per-node preparation draws the synthetic digits once into --data-root/synthetic; a later run
    (or the node's other ranks) reads them instead of drawing them again, and trains on the same data."""
    flags = ["--data", "synthetic", "--data-root", str(tmp_path), "--train-size", "256", "--test-size", "128",
             "--epochs", "1", "--batch-size", "64", "--workers", "0", "--device", "cpu", "--backend", "memory",
             "--no-progress"]
    first = mnist_example.main(mnist_example.get_args_parser().parse_args(flags))
    out = capsys.readouterr().out
    assert out.count("synthetic training digits into") == 1 and out.count("synthetic test digits into") == 1
    assert sorted(p.name for p in (tmp_path / "synthetic").iterdir()) == \
        ["digits-test-128-seed0.npz", "digits-train-256-seed0.npz"]
    again = mnist_example.main(mnist_example.get_args_parser().parse_args(flags))
    assert "digits into" not in capsys.readouterr().out
    # The same digits, order and initial weights: the same run.
    assert again["final_train_loss"] == first["final_train_loss"]
    assert again["test_accuracy"] == first["test_accuracy"]


# ------------------------------------------------------------------------ bad flags, as a user types them
BAD_FLAGS = [
    ("--batch-size", "0", "must be an integer >= 1"),
    ("--batch-size", "-5", "must be an integer >= 1"),
    ("--epochs", "-1", "must be an integer >= 1"),
    ("--workers", "-1", "must be an integer >= 0"),
    ("--checkpoint-every", "0", "must be an integer >= 1"),
    ("--lr", "-1", "finite number > 0"),
    ("--lr", "nan", "finite number > 0"),
    ("--seed", "-1", "[0, 4294967295]"),
    ("--accumulate", "0", "must be an integer >= 1"),
    ("--clip-grad-norm", "0", "finite number > 0"),
    ("--ema", "1", "must be a decay in (0, 1) such as 0.999, got '1'"),
    ("--ema", "x", "must be a number, got 'x'"),
    ("--device", "gpu", "'gpu' is not a device; use cpu, cuda or cuda:N"),
    ("--compile", "max", "unknown mode 'max'; choose from ['off', 'default', 'reduce-overhead']"),
    ("--backend", "nope", "unknown backend 'nope'; choose from"),
]


@pytest.mark.parametrize("name", ["train_mnist", "train_imagefolder"])
@pytest.mark.parametrize("flag,value,message", BAD_FLAGS)
def test_a_bad_flag_is_one_line_naming_it_before_anything_runs(name, flag, value, message, capsys):
    parser = _load(name).get_args_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--data-root", "x", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag,value,message", [
    *[case for case in BAD_FLAGS if case[0] in ("--batch-size", "--epochs", "--seed", "--device", "--backend")],
    ("--limit", "0", "must be an integer >= 1"),
])
def test_custom_augmentation_example_checks_its_flags_too(flag, value, message, capsys):
    """It parsed with plain int: --seed -1 was a numpy traceback, --device foo a torch one."""
    with pytest.raises(SystemExit) as info:
        _load("custom_augmentation").get_args_parser().parse_args([flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and message in err and "Traceback" not in err, err


def test_sizes_of_zero_are_refused_not_read_as_the_default(mnist_example, capsys):
    """``--train-size 0`` once meant the full 60,000 (``args.train_size or 60_000``)."""
    for flag in ("--train-size", "--test-size"):
        with pytest.raises(SystemExit):
            mnist_example.get_args_parser().parse_args([flag, "0"])
        assert f"argument {flag}: must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["train_mnist", "train_imagefolder"])
def test_output_paths_and_resume_are_checked_before_training(name, tmp_path, capsys):
    module = _load(name)
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--resume"], "argument --resume: needs --checkpoint"),
        (["--checkpoint-every", "5"], "argument --checkpoint-every: needs --checkpoint"),
        (["--checkpoint", str(tmp_path)], "argument --checkpoint: "),
        (["--json-out", str(tmp_path)], "is a folder"),
        (["--json-out", str(tmp_path / "afile" / "r.json")], "which is a file, not a folder"),
        (["--profile", str(tmp_path / "afile")], "argument --profile: "),
        (["--log-dir", str(tmp_path / "afile")], "argument --log-dir: "),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as info:   # main checks them first, however it is called
            # A data root in tmp_path: were a check to regress, main would go on and write data there,
            # not into the checkout.
            module.main(module.get_args_parser().parse_args(["--data-root", str(tmp_path / "data"), *extra]))
        assert info.value.code == 2
        assert message in capsys.readouterr().err, extra
    parser = module.get_args_parser()   # a file in a folder still to be made is fine
    module.cli.check_training_args(parser, parser.parse_args(["--data-root", str(tmp_path / "data"), "--json-out",
                                                              str(tmp_path / "new" / "r.json")]))


def test_bad_inputs_end_in_one_line_naming_the_flag(mnist_example, folder_example, tmp_path):
    (tmp_path / "afile").write_text("x")
    make_image_folder(tmp_path / "one", classes=1, per_class=4, seed=0)
    base = ["--epochs", "1", "--image-size", "32", "--workers", "0", "--device", "cpu", "--no-progress"]
    for root, message in [(tmp_path / "nope", "error: --data-root: image folder '.*' does not exist"),
                          (tmp_path / "afile", "error: --data-root: image folder '.*' is not a directory"),
                          (tmp_path / "one", "has one class folder \\('class_000'\\): a classifier needs at least 2")]:
        args = folder_example.get_args_parser().parse_args(["--data-root", str(root), *base])
        with pytest.raises(SystemExit, match=message):
            folder_example.main(args)
    args = mnist_example.get_args_parser().parse_args(
        ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "100", "--test-size", "50",
         "--batch-size", "500", "--backend", "torch", "--device", "cpu", "--workers", "0", "--no-progress"])
    with pytest.raises(SystemExit, match="error: --backend torch with --batch-size 500: .* fewer than one batch"):
        mnist_example.main(args)


def test_resuming_from_a_file_that_is_not_a_checkpoint_is_one_line(mnist_example, tmp_path):
    bad = tmp_path / "ck.pt"
    bad.write_bytes(b"not a checkpoint at all" * 10)
    args = mnist_example.get_args_parser().parse_args(
        ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
         "--epochs", "1", "--backend", "torch", "--device", "cpu", "--workers", "0", "--no-progress",
         "--checkpoint", str(bad), "--resume"])
    with pytest.raises(SystemExit, match=f"error: --checkpoint: checkpoint '{bad}'"):
        mnist_example.main(args)


def test_resuming_a_run_with_more_epochs_than_its_schedule_is_one_line(mnist_example, tmp_path):
    """The checkpoint's OneCycleLR was built for 1 epoch: --epochs 2 --resume cannot continue it (a
    ResumeError, printed as one line where it was a traceback)."""
    common = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
              "--backend", "memory", "--device", "cpu", "--workers", "0", "--no-progress", "--batch-size", "128",
              "--checkpoint", str(tmp_path / "ck.pt")]
    mnist_example.main(mnist_example.get_args_parser().parse_args([*common, "--epochs", "1"]))
    args = mnist_example.get_args_parser().parse_args([*common, "--epochs", "2", "--resume"])
    with pytest.raises(SystemExit, match=r"error: --checkpoint: resuming: the checkpoint's OneCycleLR .* Resume "
                                         r"with epochs <= 1"):
        mnist_example.main(args)


def test_resuming_under_another_seed_says_what_to_do_in_the_commands_words(mnist_example, tmp_path):
    """The loader refuses a position taken under another --seed. The line said "restart the epoch with
    set_epoch() instead", the Python API's words, which nobody at a command line can act on."""
    common = ["--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "64",
              "--backend", "memory", "--device", "cpu", "--workers", "0", "--no-progress", "--batch-size", "128",
              "--checkpoint", str(tmp_path / "ck.pt"), "--epochs", "1"]
    mnist_example.main(mnist_example.get_args_parser().parse_args(common))
    args = mnist_example.get_args_parser().parse_args([*common, "--resume", "--seed", "5"])
    with pytest.raises(SystemExit, match=r"^error: --checkpoint: '.*ck\.pt' cannot resume this run: seed was 0 "
                                         r"and is now 5") as info:
        mnist_example.main(args)
    assert "set_epoch" not in str(info.value) and "resume=False" not in str(info.value)
    assert str(info.value).endswith("start a new run (without --resume, or with another --checkpoint)")


@pytest.mark.parametrize("backend", [b for b in ("torch", "memory", "dali") if b in available_backends()])
def test_imagefolder_example_ends_with_one_line_naming_a_broken_file(folder_example, tmp_path, backend):
    """A truncated JPEG in the training folder: the memory backend (which decodes while it is built)
    ended with one line naming the file; torch and dali, which read it when its batch is due, ended
    with a traceback through the loop, the backend and a DataLoader worker, whose last line said
    ``on_error='skip'``, the Python API's words. Each now ends with the file, why, and the flag."""
    root = make_image_folder(tmp_path / "train", classes=2, per_class=8, seed=0)
    good = Path(root) / "class_000" / sorted(os.listdir(Path(root) / "class_000"))[0]
    broken = Path(root) / "class_001" / "truncated.jpg"
    broken.write_bytes(good.read_bytes()[:400])
    argv = ["--data-root", str(root), "--backend", backend, "--epochs", "1", "--batch-size", "4",
            "--image-size", "32", "--workers", "1", "--device", "cpu", "--no-progress"]
    with pytest.raises(SystemExit) as caught:
        folder_example.run(argv)
    assert str(caught.value.code) == (f"error: cannot decode image '{broken}': not a readable image (OSError: "
                                      f"Truncated File Read); --on-error skip skips and counts such files")


def test_imagefolder_example_skips_a_broken_file_with_on_error_and_trains_four_steps(folder_example, tmp_path):
    """ImageNet's training set holds a PNG named .JPEG: ``--on-error skip`` trains past it. 4 steps in all
    is the run OneCycleLR(pct_start=0.25) divided by zero on."""
    import io

    import numpy as np
    from PIL import Image

    root = make_image_folder(tmp_path / "train", classes=2, per_class=8, seed=0)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(buf, "PNG")
    (Path(root) / "class_001" / "png_inside.jpg").write_bytes(buf.getvalue())   # 17 files: 4 batches of 4
    args = folder_example.get_args_parser().parse_args(
        ["--data-root", str(root), "--backend", "torch", "--epochs", "1", "--batch-size", "4", "--image-size",
         "32", "--workers", "0", "--device", "cpu", "--no-progress", "--on-error", "skip"])
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        result = folder_example.main(args)
    record = result["history"][0]
    # 17 files, 4 full batches (drop_last): 16 images, less the PNG when one of them drew it
    assert record["images"] in (15, 16)
    assert record["train_loss"] == record["train_loss"], "a finite loss, not NaN"
