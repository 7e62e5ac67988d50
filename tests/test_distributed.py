"""Distributed set-up: each rank on its own device, DDP on the loader's GPU, ranks kept in step.

CPU tests stub torchrun's environment (and ``torch.cuda`` where needed); the two-rank tests launch
``torch.distributed.run`` on a script written to ``tmp_path``.
"""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine_helpers import ListLoader
from fastdata import distributed as fdist
from fastdata.engine import fit
from fastdata.models import SmallCNN

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script_text, args, cwd, timeout=120):
    script = Path(cwd) / "script.py"
    script.write_text(textwrap.dedent(script_text))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           *args]
    # The timeout turns a hang (a rank waiting in a collective its peer never joins) into a failure.
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((Path(cwd) / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture
def torchrun_env(monkeypatch):
    """This process looks like rank 1 of 2 under torchrun on a node whose 2 GPUs it sees (no process
    group is started; torch.cuda.device_count stubbed)."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


# -------------------------------------------------------------------------------------- CPU checks
def test_ddp_device_ids_are_the_loaders_gpu():
    assert fdist.ddp_device_ids(torch.device("cuda", 1)) == [1]
    assert fdist.ddp_device_ids(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="explicit CUDA device index"):
        fdist.ddp_device_ids(torch.device("cuda"))


def test_check_device_wants_cuda_local_rank_under_torchrun(torchrun_env):
    fdist.check_device(torch.device("cuda", 1))
    fdist.check_device(torch.device("cpu"))   # gloo on CPU: any rank may use the CPU
    with pytest.raises(RuntimeError, match=r"rank 1 \(LOCAL_RANK=1\) must train on cuda:1, but its "
                                           r"train_loader is on cuda:0"):
        fdist.check_device(torch.device("cuda", 0))


def test_a_rank_that_sees_only_its_own_gpu_trains_on_cuda_0(torchrun_env, monkeypatch):
    """CUDA_VISIBLE_DEVICES set per rank (SLURM's --gpus-per-task): rank 1 sees one GPU, index 0.
    The device check and the process group both take cuda:0 (torch.cuda stubbed, no group started)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    fdist.check_device(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"must train on cuda:0, but its train_loader is on cuda:1"):
        fdist.check_device(torch.device("cuda", 1))
    made_current, group = [], {}
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(fdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(fdist.dist, "init_process_group", lambda **kw: group.update(kw))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"uuid": "GPU-b"})())
    monkeypatch.setattr(fdist, "gather_objects", lambda me: [("node", "GPU-a", 0, "0"), me])
    assert fdist.init_distributed("cuda") == torch.device("cuda", 0)
    assert made_current == [0]
    assert group == {"backend": "nccl", "device_id": torch.device("cuda", 0)}
    # A job-wide CUDA_VISIBLE_DEVICES (every rank sees the same one GPU) is refused once the group exists.
    monkeypatch.setattr(fdist, "gather_objects", lambda me: [("node", "GPU-b", 0, "1"), me])
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node")
    with pytest.raises(RuntimeError, match=r"ranks 0 and 1 \(LOCAL_RANK 0 and 1\) on node would both train on "
                                           r"GPU GPU-b \(CUDA_VISIBLE_DEVICES='1' and '1'\)"):
        fdist.init_distributed("cuda")
    assert fdist.duplicate_gpus([("a", "GPU-1", 0, ""), ("b", "GPU-1", 0, "")]) is None   # two hosts
    # Without a per-rank CUDA_VISIBLE_DEVICES, one GPU for two ranks is refused before NCCL sees it.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 .* sees 1 CUDA device"):
        fdist.init_distributed("cuda")


def test_check_device_is_a_no_op_in_a_single_process(monkeypatch):
    """One process (no torchrun, or torchrun with one): any GPU is this process's to train on, even one
    that a rank 0 of a job on this 4-GPU node (torch.cuda stubbed) would be refused."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    assert fdist.check_device(torch.device("cuda", 3)) is None
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)          # torchrun --nproc-per-node 1
    assert fdist.check_device(torch.device("cuda", 3)) is None
    monkeypatch.setenv("WORLD_SIZE", "2")        # the same process as rank 0 of two: refused
    with pytest.raises(RuntimeError, match=r"rank 0 \(LOCAL_RANK=0\) must train on cuda:0"):
        fdist.check_device(torch.device("cuda", 3))


class OnDevice:
    """A loader on ``device`` whose iteration must never start."""

    def __init__(self, device):
        self.device = torch.device(device)

    def __len__(self):
        return 1

    def __iter__(self):
        raise AssertionError("fit started an epoch")


def test_fit_refuses_a_loader_on_another_gpu_than_local_rank_before_starting(torchrun_env, monkeypatch):
    """Every rank defaulting to cuda:0 was the multi-GPU crash: caught before the process group starts."""
    monkeypatch.setattr(fdist, "init_distributed", lambda *a: pytest.fail("process group started"))
    with pytest.raises(RuntimeError, match=r"must train on cuda:1.*is on cuda:0.*device=None or 'cuda'"):
        fit(SmallCNN(width=4), OnDevice("cuda:0"), epochs=1, progress=False)


def test_wrap_ddp_builds_ddp_on_the_loaders_gpu(monkeypatch):
    built = {}

    class FakeDDP:
        def __init__(self, module, device_ids=None):
            built.update(module=module, device_ids=device_ids)

    monkeypatch.setattr(fdist, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)
    model = torch.nn.Linear(2, 2)
    assert isinstance(fdist.wrap_ddp(model, torch.device("cuda", 1)), FakeDDP)
    assert built == {"module": model, "device_ids": [1]}
    fdist.wrap_ddp(model, torch.device("cpu"))
    assert built["device_ids"] is None


# ------------------------------------------------------------------------------ two ranks (gloo)
EMPTY_BATCH_SCRIPT = """
import json, os, sys
import torch
from fastdata import distributed as fdist
from fastdata.engine import fit
from fastdata.models import SmallCNN

fdist.init_distributed("cpu")
rank = fdist.rank()

class Batches:
    def __init__(self, batches):
        self.batches, self.device, self.next = batches, torch.device("cpu"), 0
    def __len__(self): return len(self.batches)
    def set_epoch(self, e): pass
    def state_dict(self): return {"epoch": 0, "batch": 0}
    def load_state_dict(self, s): pass
    def __iter__(self): return iter(self.batches)

g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(8, 1, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
if rank == 1:
    # One batch emptied mid-epoch (on_error="skip") and the last one empty (drop_last=False's share).
    batches[1] = (batches[1][0][:0], batches[1][1][:0])
    batches[2] = (batches[2][0][:0], batches[2][1][:0])
torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
model = SmallCNN(width=4)   # BatchNorm inside
hist = fit(model, Batches(batches), epochs=2, progress=False)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
with open(f"rank{rank}.json", "w") as f:
    json.dump({"params": params.tolist(), "history": hist}, f)
fdist.cleanup()
"""


def test_ddp_rank_with_empty_batches_stays_in_step(tmp_path):
    """Rank 1's last batch (and one in the middle) is empty: it must still join every gradient
    all-reduce (no hang), step like rank 0 (equal weights), and count no samples (finite loss)."""
    r0, r1 = _torchrun(EMPTY_BATCH_SCRIPT, [], tmp_path)
    assert r0["params"] == r1["params"]
    assert r0["history"] == r1["history"]
    for record in r0["history"]:
        assert math.isfinite(record["train_loss"])
        assert 0.0 <= record["train_accuracy"] <= 1.0
    assert all(math.isfinite(v) for v in r0["params"])


OWN_GROUP_SCRIPT = """
import json
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from fastdata import distributed as fdist
from fastdata.engine import fit

fdist.init_distributed("cpu")
rank = fdist.rank()
own = [torch.distributed.new_group([r]) for r in (0, 1)][rank]   # every rank creates every group

class Batches:
    \"\"\"6 batches announced, 4 yielded (as when files are skipped): the second group of 3 is cut short.\"\"\"
    def __init__(self, batches):
        self.batches, self.device = batches, torch.device("cpu")
    def __len__(self): return len(self.batches) + 2
    def set_epoch(self, e): pass
    def state_dict(self): return {"epoch": 0, "batch": 0}
    def load_state_dict(self, s): pass
    def __iter__(self): return iter(self.batches)

g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
torch.manual_seed(0)
model = nn.Linear(16, 10)
fit(DistributedDataParallel(model, process_group=own), Batches(batches), epochs=1, accumulate=3, progress=False)
with open(f"rank{rank}.json", "w") as f:
    json.dump([p.detach().flatten().tolist() for p in model.parameters()], f)
fdist.cleanup()
"""


class EndsEarly(ListLoader):
    """Announces 2 batches more than it yields, as a loader whose files were skipped does."""

    def __len__(self):
        return len(self.batches) + 2


def test_a_users_ddp_on_its_own_group_steps_a_group_cut_short_on_that_group(tmp_path):
    """A model the user wrapped in DDP over a group of its own (here one rank each: two independent
    runs) is trained through that wrapper. Before, fit rewrapped it in a DDP over the default group,
    which averaged the two runs' gradients. The loader ends 2 batches before its len(), so the second
    group of 3 is cut short: fit averages that group's gradients by hand, also over DDP's own group."""
    ranks = _torchrun(OWN_GROUP_SCRIPT, [], tmp_path)
    for rank, params in enumerate(ranks):
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(4)]
        torch.manual_seed(0)
        alone = torch.nn.Linear(16, 10)
        fit(alone, EndsEarly(batches), epochs=1, accumulate=3, progress=False)
        for got, want in zip(params, alone.parameters()):
            torch.testing.assert_close(torch.tensor(got), want.detach().flatten())


# ------------------------------------------------------------------------------ resume: each rank's RNG
RNG_RESUME_SCRIPT = """
import json, sys
import numpy as np
import torch
from torch import nn
from fastdata import Augmentation, make_loader
from fastdata import distributed as fdist
from fastdata.datasets import ArraySource
from fastdata.engine import fit

phase, path = sys.argv[1], sys.argv[2]
device = fdist.init_distributed("cpu")
rank = fdist.rank()
images = np.random.default_rng(0).integers(0, 256, (64, 8, 8), dtype=np.uint8)
loader = make_loader(ArraySource(images, np.arange(64) % 10), "torch", batch_size=8, num_workers=0, seed=3,
                     augment=Augmentation.none(), device=device)

class Crash(Exception):
    pass

class Draws:
    \"\"\"Each batch draws from the global generator, as dropout does; phase "crash" stops in epoch 2.\"\"\"
    def __init__(self, inner):
        self.inner, self.device, self.draws, self.epoch = inner, inner.device, [], 0
    def __len__(self): return len(self.inner)
    def set_epoch(self, e): self.epoch = e; self.inner.set_epoch(e)
    def state_dict(self): return self.inner.state_dict()
    def load_state_dict(self, s): self.inner.load_state_dict(s); self.epoch = s["epoch"]
    def __iter__(self):
        for k, batch in enumerate(self.inner):
            if phase == "crash" and self.epoch == 1 and k == 2:
                raise Crash
            self.draws.append(torch.rand(1).item())
            yield batch

torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(1), nn.Dropout(0.5), nn.Linear(64, 10))
torch.manual_seed(1000 + rank)   # each rank's own stream of dropout masks
data = Draws(loader)
try:
    fit(model, data, epochs=2, checkpoint=path, resume=phase == "resume", progress=False)
except Crash:
    pass
params = torch.cat([p.detach().flatten() for p in model.parameters()])
with open(f"rank{rank}.json", "w") as f:
    json.dump({"draws": data.draws, "params": params.tolist()}, f)
fdist.cleanup()
"""


@pytest.mark.slow
def test_a_resumed_ddp_run_gives_each_rank_its_own_rng_back(tmp_path):
    """Each rank draws its own dropout masks (its own global generator). Crashed in epoch 2 and resumed
    from epoch 1's checkpoint on 2 ranks, every rank draws what the uninterrupted run drew, and the
    weights end equal. Before checkpoints held every rank's RNG, rank 1 resumed with rank 0's."""
    runs = {}
    for phase in ("full", "crash", "resume"):
        cwd = tmp_path / phase
        cwd.mkdir()
        checkpoint = tmp_path / ("full.pt" if phase == "full" else "c.pt")
        runs[phase] = _torchrun(RNG_RESUME_SCRIPT, [phase, str(checkpoint)], cwd)
    per_epoch = len(runs["full"][0]["draws"]) // 2
    for rank in (0, 1):
        full, crash, resume = (runs[p][rank] for p in ("full", "crash", "resume"))
        assert crash["draws"][:per_epoch] == full["draws"][:per_epoch]
        assert resume["draws"] == full["draws"][per_epoch:], f"rank {rank}"
        assert resume["params"] == full["params"], f"rank {rank}"
    assert runs["full"][0]["draws"] != runs["full"][1]["draws"]


# ------------------------------------------------------------------------------------- two GPUs
TWO_GPU_SCRIPT = """
import json, os
import torch
from fastdata import make_loader
from fastdata import distributed as fdist
from fastdata.datasets import SyntheticDigits
from fastdata.engine import fit
from fastdata.models import SmallCNN

src = SyntheticDigits(1024, seed=1)
before = make_loader(src, "memory", batch_size=64)   # built before any process group exists
torch.manual_seed(fdist.rank())
first = SmallCNN(width=8)
fit(first, before, epochs=1, progress=False)          # fit starts the process group (nccl)
after = make_loader(src, "torch", batch_size=64, num_workers=0)   # built after it
second = SmallCNN(width=8)
fit(second, after, epochs=1, progress=False)

def flat(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu().tolist()

with open(f"rank{fdist.rank()}.json", "w") as f:
    json.dump({"local_rank": int(os.environ["LOCAL_RANK"]), "before": str(before.device),
               "after": str(after.device), "current": torch.cuda.current_device(),
               "first_on": sorted({str(p.device) for p in first.parameters()}),
               "second_on": sorted({str(p.device) for p in second.parameters()}),
               "first": flat(first), "second": flat(second)}, f)
fdist.cleanup()
"""


@pytest.mark.cuda(devices=2)
def test_two_gpus_under_torchrun_each_rank_on_its_own_gpu(tmp_path):
    ranks = _torchrun(TWO_GPU_SCRIPT, [], tmp_path, timeout=300)
    for r in ranks:
        mine = f"cuda:{r['local_rank']}"
        assert r["before"] == r["after"] == mine
        assert r["first_on"] == r["second_on"] == [mine]
        assert r["current"] == r["local_rank"]
    assert {r["local_rank"] for r in ranks} == {0, 1}
    assert ranks[0]["first"] == ranks[1]["first"]
    assert ranks[0]["second"] == ranks[1]["second"]


def test_rank_reads_lightnings_variables_as_the_loaders_do(monkeypatch):
    """Lightning's DDP children have LOCAL_RANK/NODE_RANK/WORLD_SIZE and no RANK: rank 1 must not print
    and write as if it were rank 0."""
    from fastdata import distributed

    for name in ("RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.rank() == 1 and not distributed.is_main()
    monkeypatch.setenv("NODE_RANK", "1")   # unknown without LOCAL_WORLD_SIZE: printing falls back to 0
    assert distributed.rank() == 0



@pytest.mark.parametrize("name, bad, valid", [("WORLD_SIZE", "abc", ">= 1"), ("WORLD_SIZE", "0", ">= 1"),
                                              ("LOCAL_RANK", "-1", ">= 0"), ("LOCAL_RANK", "one", ">= 0")])
def test_a_bad_torchrun_variable_is_named_before_the_process_group_starts(monkeypatch, name, bad, valid):
    """``int(os.environ[...])`` said only "invalid literal for int()", and took LOCAL_RANK=-1 as a rank
    (cuda:-1); the error names the variable, its value and its range, as the loaders' own reading does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("group started"))
    for var, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", name: bad}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"^the {name} environment variable must be an integer {valid}, got '{bad}'"):
        fdist.init_distributed("cuda")


def test_empty_torchrun_variables_are_unset(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(name, "")
    assert fdist.env_world_size() == 1 and fdist.local_rank() == 0
    assert fdist.init_distributed("cpu") == torch.device("cpu")   # one process: no group


GROUPS_FREED_SCRIPT = """
import gc, json, os, sys, weakref
from datetime import timedelta
import torch.distributed as dist
from fastdata import distributed as fdist

fdist.init_distributed("cpu")
groups = [dist.group.WORLD, fdist.node_group("gloo")[0], fdist._cpu_group(timedelta(seconds=60))]
fdist.node_layout()
refs = [weakref.ref(g) for g in groups]
del groups
if sys.argv[1] == "destroy":   # the user's own teardown, not fastdata's
    dist.barrier()
    dist.destroy_process_group()
else:
    fdist.cleanup()
gc.collect()
with open(f"rank{os.environ['RANK']}.json", "w") as f:
    json.dump([r() is None for r in refs], f)
"""


@pytest.mark.parametrize("teardown", ["destroy", "cleanup"])
def test_fastdatas_groups_go_with_the_default_group(tmp_path, teardown):
    """After ``destroy_process_group`` (the user's) or ``fdist.cleanup``, nothing of fastdata keeps a
    gloo group alive: one freed at interpreter shutdown can abort a rank that finished its work. (One
    torchrun each: a second process group in the same run can read the first one's stale addresses.)"""
    for result in _torchrun(GROUPS_FREED_SCRIPT, [teardown], tmp_path):
        assert result == [True] * 3


def test_cleanup_leaves_gloos_threads_the_gil_before_the_interpreter_exits(tmp_path, monkeypatch):
    """cleanup sleeps (the GIL free) after destroying the group: a gloo worker thread that
    frees a finished collective's tensors during interpreter shutdown aborts the rank (see
    fdist._let_gloo_threads_finish)."""
    import time

    import torch.distributed as dist

    slept = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(0)))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    dist.all_reduce(torch.ones(3))
    fdist.cleanup()
    assert not dist.is_initialized() and slept == [fdist.GLOO_EXIT_GRACE_S]
    fdist.cleanup()   # a second call, with no group left, neither fails nor waits
    assert slept == [fdist.GLOO_EXIT_GRACE_S]
