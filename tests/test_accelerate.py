"""fastdata loaders with Hugging Face accelerate, run for real (CPU; two processes over gloo in subprocesses).

Samples carry their ids in their pixels (``conftest.indexed_source``): the tests read which samples a
step trained on, or which a metric counted, and compare with what must be.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import backend_params, decode_ids, indexed_source, label_of, load_example
from fastdata import Augmentation, available_backends, make_loader

# Without accelerate each test skips (or fails in CI) on its own, naming the extra.
pytestmark = pytest.mark.requires("accelerate")

ROOT = Path(__file__).resolve().parents[1]
N, BATCH, EPOCHS = 40, 8, 2   # 5 steps an epoch
STEPS = N // BATCH


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps its state in process-wide singletons: each test starts and leaves them clean."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _loader(backend: str, **kw):
    return make_loader(indexed_source(N), backend, batch_size=BATCH, num_workers=0, device="cpu",
                       augment=Augmentation.none(), seed=3, quiet=True, **kw)


def _train(backend: str, ckpt, *, stop: int | None = None, resume: bool = False) -> dict[int, tuple[int, list]]:
    """Steps {global step: (epoch, sample ids)} of a run; ``stop``: save_state after that step and end
    there (a preemption); ``resume``: load_state first and go on from where the loader was."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(64, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = _loader(backend)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader   # accelerate wraps DataLoaders only: a fastdata loader passes through
    accelerator.register_for_checkpointing(loader)
    if resume:
        accelerator.load_state(str(ckpt))
    at = loader.state_dict()
    step = at["epoch"] * STEPS + at["batch"]
    steps = {}
    try:
        for epoch in range(loader.epoch, EPOCHS):
            for images, labels in loader:
                ids = decode_ids(images)
                np.testing.assert_array_equal(labels.numpy(), label_of(ids))
                steps[step] = (epoch, ids.tolist())
                loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
                optimizer.zero_grad()
                accelerator.backward(loss)
                optimizer.step()
                step += 1
                if step == stop:
                    accelerator.save_state(str(ckpt))
                    return steps
        return steps
    finally:
        loader.close()


@pytest.mark.parametrize("stop", [3, STEPS, STEPS + 2], ids=["mid-epoch-0", "epoch-boundary", "mid-epoch-1"])
@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_save_state_and_load_state_resume_the_registered_loader_where_it_stood(backend, stop, tmp_path):
    """register_for_checkpointing(loader) puts the loader's position into save_state(); load_state()
    restores it: the resumed run trains on exactly the batches the uninterrupted run did after ``stop``."""
    full = _train(backend, tmp_path / "unused")
    assert sorted(full) == list(range(EPOCHS * STEPS))
    assert [sorted(sum((ids for e, ids in full.values() if e == epoch), [])) for epoch in range(EPOCHS)] == \
        [list(range(N))] * EPOCHS
    _train(backend, tmp_path / "ck", stop=stop)
    assert (tmp_path / "ck" / "custom_checkpoint_0.pkl").is_file()   # the loader's state, saved with the rest
    resumed = _train(backend, tmp_path / "ck", resume=True)
    assert sorted(resumed) == list(range(stop, EPOCHS * STEPS))
    for step, record in resumed.items():
        assert record == full[step], f"step {step} trained on other samples after load_state"


def test_without_register_for_checkpointing_save_state_leaves_the_loader_out(tmp_path):
    """Why the examples and the README insist on the line: save_state() saves what accelerate prepared
    (a fastdata loader passes through prepare untouched) and what it was told about, nothing else."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = _loader("memory")
    accelerator.prepare(torch.nn.Linear(64, 10), loader)
    accelerator.save_state(str(tmp_path / "ck"))
    assert not list((tmp_path / "ck").glob("custom_checkpoint_*"))
    accelerator.register_for_checkpointing(loader)
    accelerator.save_state(str(tmp_path / "ck2"))
    assert (tmp_path / "ck2" / "custom_checkpoint_0.pkl").is_file()
    loader.close()


# ------------------------------------------------------------------------- two processes, gloo
GATHER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np, torch
    from accelerate import Accelerator
    from fastdata import Augmentation, make_loader
    from fastdata import distributed as fdist
    from fastdata.datasets import ArraySource

    backends, out = sys.argv[1].split(","), sys.argv[2]
    accelerator = Accelerator(cpu=True)
    N = 37   # 2 ranks x batch 4: 4 full steps and 5 left over, uneven on purpose
    images = np.zeros((N, 8, 8), np.uint8)
    images[:, 0, 0], images[:, 0, 1] = np.arange(N) // 256, np.arange(N) % 256
    # mean 0 / std 1: pixel values read back exactly as ids.
    src = ArraySource(images, np.arange(N) % 10, mean=(0.0,), std=(1.0,))
    model = accelerator.prepare(torch.nn.Linear(64, 10))
    record = {}
    for backend in backends:
        loader = make_loader(src, backend, batch_size=4, train=False, even_batches=True, num_workers=0,
                             device=accelerator.device, augment=Augmentation.none(), quiet=True)
        assert accelerator.prepare(loader) is loader
        gathered, sizes = [], []
        with torch.no_grad():
            for x, y in loader:
                px = torch.round(x[:, 0, 0, :2] * 255).long()
                ids = px[:, 0] * 256 + px[:, 1]
                sizes.append(len(ids))
                # Predictions and ids together, as a metric gathers them.
                preds, ids = accelerator.gather_for_metrics((model(x.flatten(1)).argmax(1), ids))
                assert len(preds) == len(ids)
                gathered += ids.tolist()
        record[backend] = {"gathered": gathered, "sizes": sizes, "rank": loader.sampler.rank,
                           "world": loader.sampler.num_replicas}
        loader.close()
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    fdist.cleanup()   # leave together; gloo's threads finish before exit (a rank aborted without it)
    accelerator.end_training()
""")


def _torchrun(args, cwd, timeout=180):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """One 2-process torchrun for every installed backend (a process group costs seconds to start)."""
    tmp = tmp_path_factory.mktemp("gather")
    script = tmp / "gather.py"
    script.write_text(GATHER_SCRIPT)
    _torchrun([str(script), ",".join(available_backends()), str(tmp)], cwd=tmp)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_gather_for_metrics_over_an_even_batches_loader_counts_every_sample_once(backend, gathered):
    """37 samples on 2 ranks in batches of 4: the last step holds 5, padded to 3 + 3 so that gloo's
    all-gather gets equal shapes; gather_for_metrics drops the padded one, so the metric sees every
    sample exactly once, on both ranks."""
    r0, r1 = gathered[0][backend], gathered[1][backend]
    assert (r0["rank"], r0["world"], r1["rank"], r1["world"]) == (0, 2, 1, 2)
    assert r0["sizes"] == r1["sizes"] == [4, 4, 4, 4, 3]
    assert r0["gathered"] == r1["gathered"]
    assert sorted(r0["gathered"]) == list(range(37))


# ------------------------------------------------------------------------------------- the example
def _example():
    return load_example("accelerate_mnist")


@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_the_accelerate_example_trains_saves_and_resumes(backend, tmp_path):
    example = _example()
    common = ["--backend", backend, "--cpu", "--data", "synthetic", "--data-root", str(tmp_path / "d"),
              "--train-size", "256", "--test-size", "75", "--batch-size", "32", "--workers", "0", "--epochs", "2",
              "--ckpt-dir", str(tmp_path / "ck")]
    # 8 steps an epoch; the first run stops at step 11, mid-epoch 1, with its state saved there.
    first = example.main(example.get_args_parser().parse_args([*common, "--max-steps", "11", "--ckpt-every", "11"]))
    assert first["global_step"] == 11 and first["test_samples"] == 75
    again = example.main(example.get_args_parser().parse_args([*common, "--resume"]))
    assert (again["global_step"], again["epoch"]) == (16, 2)   # the 5 steps left, not epoch 1 again
    assert again["test_samples"] == 75 and 0.0 <= again["test_accuracy"] <= 1.0


def test_the_accelerate_example_under_torchrun_counts_each_test_image_once(tmp_path):
    out = tmp_path / "r.json"
    _torchrun([str(ROOT / "examples" / "accelerate_mnist.py"), "--backend", "memory", "--cpu", "--data", "synthetic",
               "--data-root", str(tmp_path / "d"), "--train-size", "256", "--test-size", "75", "--batch-size", "32",
               "--workers", "0", "--epochs", "1", "--json-out", str(out)], cwd=tmp_path)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["test_samples"] == 75
    assert result["global_step"] == 4   # 256 / (2 ranks x 32)


def test_the_accelerate_example_takes_its_backends_from_the_registry_and_checks_its_flags(capsys):
    parser = _example().get_args_parser()
    for backend in available_backends():
        assert parser.parse_args(["--backend", backend]).backend == backend
    assert all(a.type is not bool for a in parser._actions)
    with pytest.raises(SystemExit):
        _example().main(parser.parse_args(["--resume"]))
    assert "argument --resume: needs --ckpt-dir DIR" in capsys.readouterr().err
