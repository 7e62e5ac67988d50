"""Past one machine: per-node preparation, decisions made once, elastic resume, two torchrun nodes.

The multi-node tests start two ``torchrun --nnodes 2`` agents on this machine against one rendezvous on
127.0.0.1 (gloo, CPU, one process each): torchrun's ``GROUP_RANK`` makes them two nodes, and each gets
its own data folder, as nodes with their own disks do. The quick tests fork ranks that meet through a
file store and play nodes by their ``LOCAL_RANK``.
"""
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import procs
from fastdata import distributed as fdist

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
EXAMPLE = ROOT / "examples" / "train_mnist.py"
# Variables a torchrun inside a torchrun (or a test run under one) would inherit and misread.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


# ------------------------------------------------------------------------------- forked ranks
def _rank_main(rank, world, local_ranks, store, queue, job):
    """One forked rank: torchrun's variables for ``local_ranks[rank]``, a gloo group, then ``job``."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_ranks[rank]))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        queue.put((rank, "ok", job(rank)))
    except Exception as e:  # reported, not raised: the parent asserts on it
        queue.put((rank, "raised", f"{type(e).__name__}: {e}"))
    finally:
        fdist.cleanup(barrier=False)   # gloo's threads finish before exit


def _forked(tmp_path, job, local_ranks, timeout=60):
    """{rank: (status, value)} of ``job`` run on len(local_ranks) forked ranks; fails on a hang."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    world = len(local_ranks)
    ranks = [ctx.Process(target=_rank_main, args=(r, world, local_ranks, tmp_path / "store", queue, job))
             for r in range(world)]
    for p in ranks:
        p.start()
    try:
        got = {}
        for _ in ranks:
            rank, status, value = queue.get(timeout=timeout)   # a rank left waiting fails here
            got[rank] = (status, value)
        return got
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _prepare_job(tmp_path, fail_on=None, once=False):
    def job(rank):
        def fetch(folder):
            if rank == fail_on:
                raise OSError(28, "No space left on device")
            with open(tmp_path / "calls", "a") as f:
                f.write(f"{rank}\n")
            return f"{folder} prepared by rank {rank}"

        prepare = fdist.prepare_once if once else fdist.prepare_per_node
        return prepare(fetch, "/data", what="fetching the data")
    return job


def _calls(tmp_path):
    path = tmp_path / "calls"
    return sorted(int(x) for x in path.read_text().split()) if path.exists() else []


def test_prepare_per_node_runs_once_on_each_node_and_shares_the_result(tmp_path):
    # Ranks 0, 1 on one node and 2, 3 on another: LOCAL_RANK 0, 1, 0, 1.
    got = _forked(tmp_path, _prepare_job(tmp_path), [0, 1, 0, 1])
    assert _calls(tmp_path) == [0, 2]
    assert got == {0: ("ok", "/data prepared by rank 0"), 1: ("ok", "/data prepared by rank 0"),
                   2: ("ok", "/data prepared by rank 2"), 3: ("ok", "/data prepared by rank 2")}


def test_prepare_once_runs_on_rank_0_only(tmp_path):
    got = _forked(tmp_path, _prepare_job(tmp_path, once=True), [0, 1, 0])
    assert _calls(tmp_path) == [0]
    assert {v for _, v in got.values()} == {"/data prepared by rank 0"}


def test_a_failed_preparation_raises_on_every_rank_naming_it_and_leaves_none_waiting(tmp_path):
    got = _forked(tmp_path, _prepare_job(tmp_path, fail_on=2), [0, 1, 0, 1])
    assert _calls(tmp_path) == [0]                       # node 1 prepared; node 2's rank 2 failed
    assert got[2] == ("raised", "OSError: [Errno 28] No space left on device")   # its own error
    for rank in (0, 1, 3):
        status, message = got[rank]
        assert status == "raised" and message.startswith("PreparationError: fetching the data failed on 1 rank(s)")
        assert f"which this rank ({rank}) waited for: rank 2 (" in message
        assert "LOCAL_RANK 0): OSError: [Errno 28] No space left on device" in message


def test_decide_on_main_gives_every_rank_rank_0s_answer(tmp_path):
    def job(rank):
        return fdist.decide_on_main(lambda: f"rank {fdist.rank()} decided", what="deciding")

    got = _forked(tmp_path, job, [0, 1, 2])
    assert {v for _, v in got.values()} == {"rank 0 decided"}


def test_share_from_main_sends_only_to_the_ranks_that_need_it(tmp_path):
    def job(rank):
        return fdist.share_from_main(f"rank {rank}'s", need=rank == 2)

    got = _forked(tmp_path, job, [0, 1, 2])
    assert got == {0: ("ok", "rank 0's"), 1: ("ok", "rank 1's"), 2: ("ok", "rank 0's")}


def test_without_a_process_group_preparation_just_runs(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert fdist.prepare_per_node(lambda x: x + 1, 1) == 2
    assert fdist.prepare_once(lambda: "once") == "once"
    assert fdist.decide_on_main(lambda: "decided") == "decided"
    assert fdist.share_from_main("mine", need=True) == "mine"
    with pytest.raises(KeyError):        # the error itself, not wrapped: nobody else was waiting
        fdist.prepare_per_node(lambda: {}["missing"])


def test_preparation_under_torchrun_without_a_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"fetch: WORLD_SIZE=2 but no process group is running.*"
                                           r"init_distributed\(\) first"):
        fdist.prepare_per_node(lambda: None, what="fetch")


# --------------------------------------------------------------------------- torchrun processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(TESTS), os.environ.get("PYTHONPATH")]))}
    for name in TORCHRUN_VARS:
        env.pop(name, None)
    return env


def _run_all(commands, cwd, timeout):
    """Run ``commands`` (each a torchrun) at the same time, each in its own session; return their
    (returncode, output). Whatever happens (a hang, a failure, the test interrupted), every process they
    started is killed and reaped before this returns, and none is left behind (checked)."""
    started, seen = [], set()
    try:
        for i, cmd in enumerate(commands):
            log = open(Path(cwd) / f"agent{i}.log", "w+")
            started.append((subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True), log))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in started):
            for p, _ in started:   # the workers, while they run: checked for leftovers below
                seen.update(procs.family(p.pid))
            time.sleep(0.2)
        hung = [i for i, (p, _) in enumerate(started) if p.poll() is None]
        results = []
        for p, log in started:
            log.seek(0)
            results.append((p.poll(), log.read()))
        assert not hung, f"agents {hung} still running after {timeout} s:\n" + \
            "\n".join(out[-3000:] for _, out in results)
        return results
    finally:
        for p, log in started:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)   # the agent and its workers: one session each
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)
            log.close()
        left = [pid for pid in seen if procs.state(pid) not in (None, "Z", "X")]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert procs.wait_until(lambda: all(procs.state(pid) in (None, "Z", "X") for pid in seen), 30), \
            f"processes left behind: {[pid for pid in seen if procs.state(pid) not in (None, 'Z', 'X')]}"


def _torchrun(nnodes, node_rank, nproc, rendezvous, port, script, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    if rendezvous == "c10d":   # node ranks come from the rendezvous (torchrun ignores --node-rank here)
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fastdata-test"]
    else:                      # static: --node-rank says which node this is; node 0 hosts the store
        cmd += ["--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [*cmd, str(script), *map(str, args)]


# The example, with each rank's training sample ids and final weights recorded: the backend's pass over
# the ids it reads (Loader._count), and the model fit returns.
MNIST_DRIVER = textwrap.dedent("""
    import hashlib, importlib.util, json, os, sys
    from fastdata.backends import base

    out, example, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    seen = {}
    real_count = base.Loader._count

    def recording(self, epoch, offset, batches):
        inner = real_count(self, epoch, offset, batches)
        try:
            for k, batch in enumerate(inner):
                if self.config.train:
                    seen.setdefault(epoch, []).extend(int(i) for i in batches[k])
                yield batch
        finally:
            inner.close()

    base.Loader._count = recording
    spec = importlib.util.spec_from_file_location("train_mnist", example)
    mnist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mnist)
    real_fit, weights = mnist.fit, {}

    def fit(model, *a, **k):
        history = real_fit(model, *a, **k)
        # The parameters: BatchNorm's running statistics are per rank after the last step (DDP
        # broadcasts rank 0's buffers at the start of each forward, not after it).
        blob = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        weights["sha256"] = hashlib.sha256(blob).hexdigest()
        return history

    mnist.fit = fit
    result = mnist.main(mnist.get_args_parser().parse_args(args))
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"group_rank": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
                   "world": result["world_size"], "ids": seen, "weights": weights["sha256"]}, f)
""")


@pytest.mark.slow
@pytest.mark.parametrize("backend, rendezvous", [("memory", "c10d"), ("torch", "static")])
def test_two_nodes_on_one_machine_train_the_mnist_example(tmp_path, backend, rendezvous):
    """Two torchrun agents, one process each, meet at 127.0.0.1 as two nodes: each node prepares its
    own data folder once, the two shards of every epoch are disjoint and cover the data, and both ranks
    end with the same weights."""
    driver = tmp_path / "driver.py"
    driver.write_text(MNIST_DRIVER)
    port, n, epochs = _free_port(), 1024, 2
    commands = [_torchrun(2, node, 1, rendezvous, port, driver, tmp_path, EXAMPLE, "--data", "synthetic",
                          "--data-root", tmp_path / f"node{node}", "--train-size", n, "--test-size", 256,
                          "--epochs", epochs, "--batch-size", 64, "--workers", 0, "--backend", backend,
                          "--device", "cpu", "--no-progress", "--json-out", tmp_path / "result.json")
                for node in (0, 1)]
    results = _run_all(commands, tmp_path, timeout=150)
    for code, out in results:
        assert code == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["group_rank"] for r in ranks) == [0, 1]          # two nodes...
    assert [r["local_rank"] for r in ranks] == [0, 0]                # ...of one process each
    assert [r["world"] for r in ranks] == [2, 2]
    for epoch in map(str, range(epochs)):
        a, b = (r["ids"][epoch] for r in ranks)
        assert len(a) == len(b) == n // 2 and not set(a) & set(b)
        assert sorted(a + b) == list(range(n))
    assert ranks[0]["ids"]["0"] != ranks[0]["ids"]["1"]             # a new order each epoch
    assert ranks[0]["weights"] == ranks[1]["weights"]
    # Each node prepared its own folder, once: the node whose ranks are not rank 0 too.
    for node in (0, 1):
        files = sorted(p.name for p in (tmp_path / f"node{node}" / "synthetic").iterdir())
        assert files == ["digits-test-256-seed0.npz", f"digits-train-{n}-seed0.npz"]
    drew = [out.count("synthetic training digits into") for _, out in results]
    assert drew == [1, 1], [out[-2000:] for _, out in results]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["dataset"] == "synthetic" and result["backend"] == backend


# ------------------------------------------------------------------------------ elastic resume
ELASTIC_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    from torch import nn
    from conftest import decode_ids, indexed_source
    from fastdata import Augmentation, make_loader
    from fastdata import distributed as fdist
    from fastdata.engine import fit

    phase, base, backend, crash_after = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    device = fdist.init_distributed("cpu")
    rank = fdist.rank()
    # Each rank's checkpoint path is on its own "disk": only rank 0's holds the checkpoint.
    path = base / f"disk{rank}" / "c.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if phase == "resume" and rank == 2:
        path.write_bytes(b"an older, different checkpoint left on this node's disk")
    loader = make_loader(indexed_source(200), backend, batch_size=8, drop_last=False, augment=Augmentation.none(),
                         num_workers=0, seed=3, device=device)

    class Crash(Exception):
        pass

    class Ids:
        def __init__(self, inner):
            self.inner, self.device, self.ids = inner, inner.device, []
        def __len__(self): return len(self.inner)
        def set_epoch(self, e): self.inner.set_epoch(e)
        def state_dict(self): return self.inner.state_dict()
        def load_state_dict(self, s): self.inner.load_state_dict(s)
        def __iter__(self):
            for k, (x, y) in enumerate(self.inner):
                if k == crash_after:
                    raise Crash   # after the checkpoint of the batches before it
                self.ids.append(decode_ids(x).tolist())
                yield x, y

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(1), nn.Linear(64, 10))
    ids = Ids(loader)
    crashed = False
    try:
        history = fit(model, ids, epochs=1, checkpoint=path, resume=phase == "resume", checkpoint_every=3,
                      progress=False)
    except Crash:
        crashed, history = True, []
    with open(base / f"{phase}-{fdist.world_size()}-rank{rank}.json", "w") as f:
        json.dump({"ids": ids.ids, "crashed": crashed, "history": history, "len": len(loader)}, f)
    fdist.cleanup()
""")


def _standalone(nproc, script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(script), *map(str, args)]


def _layout(nodes, world, script, *args):
    """torchrun commands for ``world`` ranks: one standalone agent, or one agent per node on 127.0.0.1
    (static rendezvous; the first node gets one rank, the others the rest): rank 0's agent first."""
    if nodes == 1:
        return [_standalone(world, script, *args)]
    port = _free_port()
    per_node = [1] + [world - 1] if world > 1 else [1]
    return [_torchrun(len(per_node), node, nproc, "static", port, script, *args)
            for node, nproc in enumerate(per_node)]


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2], ids=["one_node", "two_nodes"])
def test_an_epoch_saved_on_2_ranks_resumes_on_1_and_on_3_reading_every_sample_once(tmp_path, nodes,
                                                                                   backend="memory"):
    """2 ranks save mid-epoch (every 3 batches) and stop after 3; the rest of the epoch resumes on 1
    rank and, separately, on 3, whose ranks 1 and 2 cannot read rank 0's checkpoint (no file, and an
    unrelated one): over the epoch every sample is read exactly once. ``two_nodes``: the 2 ranks are two
    nodes of one rank each, and the 3 resume across two nodes (1 + 2 ranks). (The loader-level re-split
    is held for every backend by test_contract; this is fit's side of it, across processes.)"""
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC_SCRIPT)
    results = _run_all(_layout(nodes, 2, script, "save", tmp_path, backend, 3), tmp_path, timeout=120)
    assert all(code == 0 for code, _ in results), "\n".join(out[-3000:] for _, out in results)
    saved = [json.loads((tmp_path / f"save-2-rank{r}.json").read_text()) for r in (0, 1)]
    assert all(s["crashed"] and len(s["ids"]) == 3 for s in saved)
    before = [i for s in saved for batch in s["ids"] for i in batch]
    assert len(before) == 48 and len(set(before)) == 48
    state = torch.load(tmp_path / "disk0" / "c.pt", weights_only=True)
    assert (state["world_size"], state["loader"]["samples"], state["loader"]["world_size"]) == (2, 48, 2)
    mid_epoch = (tmp_path / "disk0" / "c.pt").read_bytes()
    for world in (1, 3):
        (tmp_path / "disk0" / "c.pt").write_bytes(mid_epoch)   # each resume starts from the same save
        results = _run_all(_layout(nodes if world > 1 else 1, world, script, "resume", tmp_path, backend, -1),
                           tmp_path, timeout=120)
        assert all(code == 0 for code, _ in results), "\n".join(out[-3000:] for _, out in results)
        out = results[0][1]   # rank 0's agent
        assert "(saved by 2 rank(s) x batch 8: the rest of the epoch is re-split over " \
               f"{world} x 8)" in out
        resumed = [json.loads((tmp_path / f"resume-{world}-rank{r}.json").read_text()) for r in range(world)]
        after = [i for r in resumed for batch in r["ids"] for i in batch]
        assert sorted(before + after) == list(range(200)), f"world {world}"
        # Equal batch counts on every rank, ending where a whole epoch of this layout ends.
        counts = {len(r["ids"]) for r in resumed}
        assert counts == {-(-(200 - 48) // (8 * world))}
        history = resumed[0]["history"]
        assert [h["epoch"] for h in history] == [1] and all(r["history"] == history for r in resumed)



# ------------------------------------------------------------------ elastic resume in one process
@pytest.mark.parametrize("position, batches, expected", [
    ({"epoch": 0, "batch": 3}, 10, 3),                                   # a loader without sample keys
    (dict(samples=48, num_samples=200, batch_size=8, world_size=2, drop_last=False, batch=3, epoch=0), 13, 3),
    (dict(samples=48, num_samples=200, batch_size=8, world_size=3, drop_last=False, batch=2, epoch=0), 9, 2),
    # 96 samples, saved after 10 of them, resumed in steps of 24: ceil(10/24) = 1 batch "done", but 4 of
    # 4 full steps are left: the count starts at 0, not 1, so it ends at len(loader).
    (dict(samples=10, num_samples=96, batch_size=24, world_size=1, drop_last=False, batch=1, epoch=0), 4, 0),
    (dict(samples=4, num_samples=100, batch_size=24, world_size=1, drop_last=True, batch=1, epoch=0), 4, 0),
])
def test_resumed_batch_counts_so_that_the_epoch_ends_at_len_loader(position, batches, expected):
    from fastdata.engine import resumed_batch

    assert resumed_batch(position, batches) == expected


def test_a_position_whose_rest_is_a_whole_epoch_of_batches_is_still_resumed_not_restarted(tmp_path):
    """Saved after one batch of 4 and resumed with batches of 24 (drop_last): the 96 samples left fill
    as many batches as a whole epoch, so only the sample offset tells fit the epoch is half done; a
    set_epoch there would read the first 4 samples again."""
    from conftest import decode_ids, indexed_source
    from fastdata import Augmentation, make_loader
    from fastdata.engine import fit

    class Crash(Exception):
        pass

    def run(batch_size, crash_after=None, resume=False):
        loader = make_loader(indexed_source(100), "memory", batch_size=batch_size, device="cpu", seed=4,
                             augment=Augmentation.none(), num_workers=0)
        seen = []

        class Ids:
            device = loader.device

            def __len__(self):
                return len(loader)

            def set_epoch(self, e):
                loader.set_epoch(e)

            def state_dict(self):
                return loader.state_dict()

            def load_state_dict(self, s):
                loader.load_state_dict(s)

            def __iter__(self):
                for k, (x, y) in enumerate(loader):
                    if k == crash_after:
                        raise Crash
                    seen.extend(decode_ids(x).tolist())
                    yield x, y

        torch.manual_seed(0)
        try:
            fit(torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(64, 10)), Ids(), epochs=1,
                checkpoint=tmp_path / "c.pt", checkpoint_every=1, resume=resume, progress=False)
        except Crash:
            pass
        return seen

    first = run(4, crash_after=1)
    assert len(first) == 4
    rest = run(24, resume=True)
    assert len(rest) == 96 and sorted(first + rest) == list(range(100))


# ------------------------------------------------------------------ accumulation under DDP
ACCUMULATE_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    import torch
    from torch import nn
    from fastdata import Augmentation, make_loader
    from fastdata import distributed as fdist
    from fastdata.datasets import ArraySource
    from fastdata.engine import ModelEma, fit

    base = Path(sys.argv[1])
    device = fdist.init_distributed("cpu")
    rng = np.random.default_rng(0)
    src = ArraySource(rng.integers(0, 256, (320, 8, 8), dtype=np.uint8), rng.integers(0, 10, 320))
    out = {}
    for name, batch, accumulate in (("acc", 16, 4), ("big", 64, 1)):
        loader = make_loader(src, "memory", batch_size=batch, drop_last=False, augment=Augmentation.none(),
                             num_workers=0, seed=3, device=device)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(1), nn.Linear(64, 10))
        ema = ModelEma(model, 0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        fit(model, loader, epochs=2, optimizer=opt, accumulate=accumulate, clip_grad_norm=1.0, ema=ema,
            progress=False)
        out[name] = {"len": len(loader),
                     "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
                     "ema": torch.cat([p.flatten() for p in ema.module.parameters()]).tolist()}
    (base / f"rank{fdist.rank()}.json").write_text(json.dumps(out))
    fdist.cleanup()
""")


@pytest.mark.slow
def test_accumulating_4_batches_of_16_on_2_ranks_gives_the_weights_of_batches_of_64(tmp_path):
    """2 gloo ranks, 320 samples: 10 batches of 16 per rank in steps of 4, 4 and 2 (the first 3 of a step in
    no_sync) reach the weights of 3 batches of 64 per rank (128, 128, 64 samples a step: each step reads
    the same slice of the epoch's one permutation), with clipping and the weight average: atol 1e-5."""
    script = tmp_path / "accumulate.py"
    script.write_text(ACCUMULATE_SCRIPT)
    results = _run_all([_standalone(2, script, tmp_path)], tmp_path, timeout=240)
    assert all(code == 0 for code, _ in results), "\n".join(out[-3000:] for _, out in results)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert (ranks[0]["acc"]["len"], ranks[0]["big"]["len"]) == (10, 3)
    for key in ("weights", "ema"):
        assert ranks[0]["acc"][key] == ranks[1]["acc"][key]              # the replicas agree
        torch.testing.assert_close(torch.tensor(ranks[0]["acc"][key]), torch.tensor(ranks[0]["big"][key]),
                                   atol=1e-5, rtol=0)
