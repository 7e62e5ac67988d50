"""fastdata loaders inside Ray Train, run for real: a local Ray, ``TorchTrainer`` with two CPU workers (gloo).

What docs/scaling.md ("Ray Train") promises, checked against the library: in ``train_loop_per_worker`` a
loader made with ``device=ray.train.torch.get_device()`` shards by the worker's rank with nothing
fastdata-specific, ``fastdata.fit`` trains there and resumes from its own checkpoint, and a loader
position put into the checkpoint given to ``ray.train.report`` resumes a later run (Ray Train's V2 API:
the same ``RunConfig(name, storage_path)`` hands the run's latest checkpoint to
``ray.train.get_checkpoint()``) on the same or another number of workers.

Samples carry their ids in their pixels (``conftest.indexed_source``); each worker writes the ids of
its batches to a JSON file, which the test then reads. On the shared 2-core machine Ray starts in ~6 s
and each ``TorchTrainer.fit`` spends ~15 s starting its worker group, so one Ray serves the module and
the sharding and resume tests share a run: five runs, under 2 minutes.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import decode_ids, indexed_source, label_of

# Without Ray each test skips (or fails in CI) on its own, naming the extra.
pytestmark = pytest.mark.requires("ray.train.torch")

TESTS = Path(__file__).resolve().parent
N, BATCH, WORKERS = 60, 8, 2     # 30 samples a worker: 4 batches, the last one short (6)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray with 2 CPUs for the module. Its workers import ``conftest`` (the test helpers) and
    this module (the training loops, pickled by reference) from tests/, so PYTHONPATH names it before
    Ray starts: the raylet and its worker processes inherit the driver's environment."""
    import ray

    base = tmp_path_factory.mktemp("ray")
    # Ray's sockets live under its temp dir, and a Unix socket path is limited to 107 bytes with Ray's
    # ~60 of session and socket names below it: under a long --basetemp, a short folder in /tmp.
    temp = base if len(str(base)) <= 40 else Path(tempfile.mkdtemp(prefix="fastdata-ray-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        # Ray Train's V2 API (the default in 2.60) is what the docs describe: an environment that turned
        # it off must not quietly test the old one.
        mp.setenv("RAY_TRAIN_V2_ENABLED", "1")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # The controller sees a finished worker group at its next poll (every 2 s by default): seven
        # short runs wait less at 0.5 s.
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
        # address="local": a new Ray of our own, even where RAY_ADDRESS names a running cluster.
        ray.init(address="local", num_cpus=WORKERS, include_dashboard=False, _temp_dir=str(temp),
                 configure_logging=False)
        try:
            yield base
        finally:
            ray.shutdown()
            if temp != base:
                shutil.rmtree(temp, ignore_errors=True)


def _trainer(loop, config: dict, *, workers: int, name: str, storage):
    import ray.train
    from ray.train.torch import TorchTrainer

    return TorchTrainer(loop, train_loop_config=config,
                        scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=False),
                        run_config=ray.train.RunConfig(name=name, storage_path=str(storage)))


def _write(out: str, record: dict) -> None:
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _read(out: Path, workers: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(workers)]


def _backends() -> list[str]:
    """Every built-in backend but ``auto`` (it picks one of the others), DALI where it is installed. Not
    every registered one: a backend another test registers in this process (test_contract's "simple")
    does not exist in Ray's worker processes."""
    from fastdata import available_backends

    return [b for b in available_backends() if b in ("torch", "memory", "prefetch", "dali")]


def fit_loop(config: dict) -> None:
    """``fastdata.fit`` inside the worker (DDP over Ray's process group) with its own checkpoint and
    ``resume=True``, each epoch's figures reported to Ray; the rank writes its weights and its records."""
    import ray.train
    import ray.train.torch
    import torch
    from torch import nn

    from fastdata import fit, make_loader
    from fastdata.datasets import SyntheticDigits

    torch.manual_seed(0)
    loader = make_loader(SyntheticDigits(256, seed=1), "memory", batch_size=32,
                         device=ray.train.torch.get_device())
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    history = fit(model, loader, epochs=config["epochs"], optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  checkpoint=config["checkpoint"], resume=True, progress=False)
    # A resumed fit returns the checkpoint's earlier records too: report this run's epochs. Ray Train
    # (V2) keeps in its Result only the metrics reported with a checkpoint: the last epoch's report
    # carries the weights (rank 0's; the ranks' are equal), as a real run's would.
    for rec in history[-config["epochs"] + config["start"]:-1]:
        ray.train.report({"epoch": rec["epoch"], "train_loss": rec["train_loss"]})
    with tempfile.TemporaryDirectory() as d:
        saved = None
        if ray.train.get_context().get_world_rank() == 0:
            torch.save(model.state_dict(), Path(d, "model.pt"))
            saved = ray.train.Checkpoint.from_directory(d)
        ray.train.report({"epoch": history[-1]["epoch"], "train_loss": history[-1]["train_loss"]}, checkpoint=saved)
    _write(config["out"], {"history": [[r["epoch"], r["train_loss"], r["seconds"]] for r in history],
                           "weights": [float(p.detach().sum()) for p in model.parameters()],
                           "ddp": isinstance(model, nn.parallel.DistributedDataParallel)})


def test_fit_trains_reports_and_resumes(ray_cluster, tmp_path):
    """``fit`` in ``train_loop_per_worker`` trains one model over both workers (equal weights on every
    rank) and its records reach ``ray.train.report`` (the Result's metrics are the last report's); a
    second run with more epochs resumes from ``fit``'s own checkpoint, written by rank 0, and trains
    only the new epoch, its loss below the first's."""
    checkpoint = str(tmp_path / "fit.pt")
    records, results = [], []
    for start, epochs in ((0, 1), (1, 2)):
        out = tmp_path / f"out{epochs}"
        out.mkdir()
        config = {"out": str(out), "start": start, "epochs": epochs, "checkpoint": checkpoint}
        results.append(_trainer(fit_loop, config, workers=WORKERS, name=f"fit{epochs}",
                                storage=tmp_path / "runs").fit())
        records.append(_read(out, WORKERS))
    for ranks, result in zip(records, results):
        assert ranks[0]["weights"] == ranks[1]["weights"], "the workers' weights differ: no DDP"
        # The loss is global (reduced over the ranks): both have the same records.
        assert ranks[0]["history"] == ranks[1]["history"]
        epoch, loss, _ = ranks[0]["history"][-1]
        assert result.error is None and result.metrics == {"epoch": epoch, "train_loss": loss}
        with result.checkpoint.as_directory() as d:
            weights = torch.load(Path(d, "model.pt"))
        assert [float(w.sum()) for w in weights.values()] == ranks[0]["weights"]
    (first,), (carried, second) = (ranks[0]["history"] for ranks in records)
    # The first epoch's record comes back from the checkpoint, its wall time and all: not trained again.
    assert carried == first and second[0] == 2
    assert np.isfinite(first[1]) and second[1] < first[1]
    assert records[0][0]["weights"] != records[1][0]["weights"]


def epoch_loop(config: dict) -> None:
    """Each backend's loader built the way the docs say (nothing but ``device=``), resumable.

    Without a checkpoint: two epochs of each, and each loader's position after ``config["save_at"]``
    batches of the first goes into the checkpoint reported at the end. Given one
    (``ray.train.get_checkpoint()``: the run's latest), each loader continues where it was saved, to the
    end of that epoch. The rank writes the ids of its batches, and what Ray set up for it."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from fastdata import make_loader

    checkpoint = ray.train.get_checkpoint()
    saved = None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = torch.load(Path(d, "loaders.pt"))
    positions = {}
    record = {"resumed": saved is not None, "world": dist.get_world_size(), "backends": {},
              "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                     "NODE_RANK")}}
    for backend in config["backends"]:
        loader = make_loader(indexed_source(N), backend, batch_size=BATCH, shuffle=True, drop_last=False,
                             seed=5, device=ray.train.torch.get_device())
        if saved is not None:
            loader.load_state_dict(saved[backend])
        epochs, devices = [], set()
        for epoch in range(1 if saved is not None else 2):
            batches = []
            for images, labels in loader:
                ids = decode_ids(images)
                assert (labels.cpu().numpy() == label_of(ids)).all(), backend
                devices.update({str(images.device), str(labels.device)})
                batches.append(ids.tolist())
                if saved is None and epoch == 0 and len(batches) == config["save_at"]:
                    positions[backend] = loader.state_dict()
            epochs.append(batches)
        record["backends"][backend] = {"epochs": epochs, "len": len(loader), "devices": sorted(devices)}
    if saved is None:
        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if ray.train.get_context().get_world_rank() == 0:   # one copy: a position is global
                torch.save(positions, Path(d, "loaders.pt"))
                ckpt = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"saved_at": config["save_at"]}, checkpoint=ckpt)
    _write(config["out"], record)


SAVE_AT = 2   # of the 4 batches a worker reads an epoch


@pytest.fixture(scope="module")
def first_run(ray_cluster, tmp_path_factory):
    """``epoch_loop`` run fresh on two workers: ``(storage, its records)``. Ray starts a worker group in
    ~15 s here, so the sharding test and the resume test share this run."""
    base = tmp_path_factory.mktemp("epochs")
    return base / "runs", _run_epochs(base, WORKERS)


def _run_epochs(base: Path, workers: int) -> list[dict]:
    out = Path(tempfile.mkdtemp(dir=base))
    _trainer(epoch_loop, {"backends": _backends(), "out": str(out), "save_at": SAVE_AT}, workers=workers,
             name="epochs", storage=base / "runs").fit()
    return _read(out, workers)


def test_loaders_shard_by_worker_rank(first_run):
    """Every backend shards by the Ray worker's rank: per epoch the two workers' samples are disjoint
    and cover the data, with as many batches each as ``len()`` says, on ``get_device()`` (the CPU)."""
    _, ranks = first_run
    # What the docs say Ray sets before the loop runs (the loaders read RANK/WORLD_SIZE from it).
    assert [rec["env"] for rec in ranks] == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                              "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0"} for r in range(WORKERS)]
    assert [rec["world"] for rec in ranks] == [WORKERS] * WORKERS
    for backend in _backends():
        runs = [rec["backends"][backend] for rec in ranks]
        for epoch in range(2):
            shards = [np.concatenate(run["epochs"][epoch]) for run in runs]
            assert set(shards[0]).isdisjoint(shards[1]), backend
            assert sorted(np.concatenate(shards).tolist()) == list(range(N)), backend
            # 30 samples a worker: 8, 8, 8, 6
            assert [len(run["epochs"][epoch]) for run in runs] == [run["len"] for run in runs] == [4, 4], backend
        assert runs[0]["epochs"][0] != runs[0]["epochs"][1], f"{backend}: the same order in both epochs"
        assert [run["devices"] for run in runs] == [["cpu"]] * WORKERS, backend


def test_resume_from_reported_checkpoint(first_run):
    """The first run reported each loader's position after 2 of the 4 batches a worker reads in the
    epoch; a second run of the same name (Ray hands it that checkpoint) reads exactly the batches the
    first read after that point, and a third, on one worker, reads each of the epoch's remaining samples
    once. The first run went on to the epoch's end: it is the uninterrupted run."""
    storage, whole = first_run
    again = _run_epochs(storage.parent, WORKERS)
    (alone,) = _run_epochs(storage.parent, 1)
    assert [rec["resumed"] for rec in (*whole, *again, alone)] == [False, False, True, True, True]
    for backend in _backends():
        first = [rec["backends"][backend]["epochs"][0] for rec in whole]
        assert [rec["backends"][backend]["epochs"] for rec in again] == [[batches[SAVE_AT:]] for batches in first], \
            backend
        rest = sorted(i for batches in first for batch in batches[SAVE_AT:] for i in batch)
        assert len(rest) == N - SAVE_AT * WORKERS * BATCH, backend
        (read,) = alone["backends"][backend]["epochs"]
        assert sorted(i for batch in read for i in batch) == rest, backend


def test_resume_from_checkpoint_is_refused(tmp_path):
    """What the docs tell Ray 2.60 users: ``resume_from_checkpoint=`` is refused (Train V2), so a run
    resumes through the same ``RunConfig(name, storage_path)`` and ``ray.train.get_checkpoint()``. If a
    Ray release accepts it again, docs/scaling.md's "Ray Train" needs rewording."""
    import ray.train
    from ray.train.torch import TorchTrainer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TRAIN_V2_ENABLED", "1")
        with pytest.raises(DeprecationWarning, match="resume_from_checkpoint"):
            TorchTrainer(epoch_loop, resume_from_checkpoint=ray.train.Checkpoint.from_directory(str(tmp_path)),
                         scaling_config=ray.train.ScalingConfig(num_workers=1))
