"""One ``memory`` cache per node: the ranks of a node decode each photo once between them and share it.

The two-rank runs launch ``torch.distributed.run`` (gloo, CPU, one node) on a script written to
``tmp_path``. The script counts decodes by appending one line per decoded file to a log (the decoding
runs in DataLoader workers, other processes, so an in-memory counter would not see them), and reports
what each rank cached and read; the test compares that with single-process loaders built here.
"""
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata import distributed as fdist
from fastdata import make_loader
from fastdata.datasets import ImageFolder, make_image_folder
from fastdata.errors import DecodeError

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script_text, cwd, args=(), timeout=180):
    script = Path(cwd) / "script.py"
    script.write_text(textwrap.dedent(script_text))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           *args]
    # The timeout turns a hang (a rank waiting in a collective its peer never joins) into a failure.
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((Path(cwd) / f"rank{r}.json").read_text()) for r in (0, 1)]


def _folders(tmp_path):
    """21 small photos (blocks of 11 and 10 for two ranks), and a copy with one file broken in the
    first rank's block (so that the second rank's block moves when the gap is closed)."""
    good = make_image_folder(tmp_path / "good", classes=3, per_class=7, seed=3, size_range=((60, 90), (40, 70)))
    broken = make_image_folder(tmp_path / "broken", classes=3, per_class=7, seed=3,
                               size_range=((60, 90), (40, 70)))
    bad = broken / "class_001" / "img_00002.jpg"     # id 9: local rank 0 decodes ids 0..10
    bad.write_bytes(bad.read_bytes()[:200])           # a truncated JPEG
    return good, broken, bad


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()


NODE_SCRIPT = """
import functools, gc, hashlib, json, os, sys
import numpy as np
import torch
from fastdata import distributed as fdist, make_loader
from fastdata.datasets import ImageFolder
from fastdata.errors import DecodeError
import fastdata.images.whole as mem   # the whole-photo decoders
import fastdata.decode as dec
from fastdata.config import Augmentation

good, broken = sys.argv[1], sys.argv[2]
LOG = os.path.abspath("decodes.log")
PHASE = {"name": ""}

def counted(fn):
    def wrapper(data, path, *args, **kwargs):   # load_whole/load_photo(bytes, name, ...)
        # O_APPEND: whole short lines from every rank and every DataLoader worker.
        fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{PHASE['name']}\\t{os.environ['RANK']}\\t{path}\\n".encode())
        os.close(fd)
        return fn(data, path, *args, **kwargs)
    return wrapper

mem.load_whole = counted(mem.load_whole)     # the training recipe's decode of one photo
dec.load_photo = counted(dec.load_photo)     # the evaluation recipe's (BatchDecoder -> decode)

fdist.init_distributed("cpu")
rank = fdist.rank()
out = {"node": list(fdist.node_group("gloo")[1:]), "layout": fdist.node_layout()}
group = fdist.node_group("gloo")[0]

def digest(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()

def mapped(path):
    with open("/proc/self/maps") as f:
        return any(path in line for line in f)

def report(loader):
    return {"cache": digest(loader.cache), "shape": list(loader.cache.shape),
            "kept": loader.kept.tolist(), "skipped": loader.skipped_at_cache,
            "sizes": None if loader.photo_sizes is None else
                     np.concatenate(loader.photo_sizes, 1).tolist(),
            "shared_path": loader.shared_path,
            "file_left": loader.shared_path is not None and os.path.exists(loader.shared_path),
            "mapped": loader.shared_path is not None and mapped(loader.shared_path)}

# 1. training recipe: whole photos, decoding workers, one epoch's batches
PHASE["name"] = "train"
train = make_loader(ImageFolder(good), "memory", batch_size=4, device="cpu", cache_size=48,
                    augment=Augmentation.imagenet_train(size=32), seed=5, cache_workers=1)
out["train"] = report(train)
torch.save([b for b in train], f"batches{rank}.pt")
path = train.shared_path
train.close()
del train
gc.collect()
out["train"]["mapped_after_close"] = mapped(path)

# 2. evaluation recipe: the center crop cached applied (BatchDecoder)
PHASE["name"] = "eval"
ev = make_loader(ImageFolder(good), "memory", batch_size=4, device="cpu", train=False,
                 augment=Augmentation.imagenet_eval(size=32, resize=36), cache_workers=0)
out["eval"] = report(ev)
ev.close()

# 3. a broken file skipped: one shared cache, the gap closed by local rank 0
PHASE["name"] = "skip"
sk = make_loader(ImageFolder(broken), "memory", batch_size=4, device="cpu", cache_size=48,
                 on_error="skip", cache_workers=0, augment=Augmentation.imagenet_train(size=32))
out["skip"] = report(sk)
sk.close()

# 4. the same without /dev/shm room: a copy per rank, filled by the all-gather (CUDA's path, on the host)
PHASE["name"] = "private"
real = fdist.node_shared_tensor
# A folder that does not exist stands for a full or missing /dev/shm: local rank 0 cannot create the file.
fdist.node_shared_tensor = functools.partial(real, directory=os.path.abspath("no-such-dir"))
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pv = make_loader(ImageFolder(broken), "memory", batch_size=4, device="cpu", cache_size=48,
                     on_error="skip", cache_workers=0, augment=Augmentation.imagenet_train(size=32))
out["private"] = report(pv)
out["private"]["warning"] = [str(w.message) for w in caught if "no shared-memory cache" in str(w.message)]
fdist.node_shared_tensor = real
pv.close()

# 5. on_error="raise": local rank 0 meets the broken file; both ranks raise, naming it, nobody hangs
PHASE["name"] = "raise"
try:
    make_loader(ImageFolder(broken), "memory", batch_size=4, device="cpu", cache_size=48, cache_workers=0,
                augment=Augmentation.imagenet_train(size=32))
    out["raise"] = None
except DecodeError as e:
    out["raise"] = {"path": e.path, "message": str(e)}

# 6. gather_blocks, both ways, rows of unequal content and a chunk smaller than a block
rows = 5
t = torch.full((2 * rows, 3, 2), -1, dtype=torch.int32)
t[rank * rows:(rank + 1) * rows] = torch.arange(rows * 6, dtype=torch.int32).view(rows, 3, 2) + 1000 * rank
u = t.clone()
fdist.gather_blocks(t, rows, group, chunk_bytes=2 * 24)      # 2 rows a chunk: 3 rounds
fdist.gather_blocks(u, rows, group, in_place=True)
out["gathered"] = t.flatten().tolist()
out["gathered_in_place"] = u.flatten().tolist()

with open(f"rank{rank}.json", "w") as f:
    json.dump(out, f)
fdist.cleanup()
"""


def _single(folder, **kw):
    """The loader a single process builds: the reference for the cache and, with rank/world_size, the
    batches of each shard."""
    from fastdata.config import Augmentation

    aug = Augmentation.imagenet_train(size=32) if kw.pop("train", True) else \
        Augmentation.imagenet_eval(size=32, resize=36)
    return make_loader(ImageFolder(folder), "memory", batch_size=4, device="cpu", cache_workers=0, augment=aug,
                       **kw)


def test_two_ranks_on_one_node_decode_each_photo_once_and_share_one_cache(tmp_path):
    good, broken, bad = _folders(tmp_path)
    ranks = _torchrun(NODE_SCRIPT, tmp_path, [str(good), str(broken)])
    log = [line.split("\t") for line in (tmp_path / "decodes.log").read_text().splitlines()]
    paths = ImageFolder(good).paths
    broken_paths = ImageFolder(broken).paths

    assert [r["node"] for r in ranks] == [[0, 2], [1, 2]]
    assert ranks[0]["layout"] == [[0, 1]]

    # Each photo decoded exactly once across the node, half by each rank (blocks of 11 and 10).
    for phase, folder in (("train", paths), ("eval", paths), ("skip", broken_paths), ("private", broken_paths)):
        decoded = [p for ph, _, p in log if ph == phase]
        assert Counter(decoded) == Counter(folder), phase
        by_rank = Counter(r for ph, r, _ in log if ph == phase)
        assert by_rank == {"0": 11, "1": 10}, (phase, by_rank)

    # Both ranks' caches are byte-identical to a single process's.
    ref_train = _single(good, cache_size=48)
    ref_eval = _single(good, train=False)
    for r in ranks:
        assert r["train"]["cache"] == _digest(ref_train.cache)
        assert r["train"]["sizes"] == np.concatenate(ref_train.photo_sizes, 1).tolist()
        assert r["eval"]["cache"] == _digest(ref_eval.cache)
        assert r["train"]["kept"] == list(range(21))
    # One shared file per loader, gone from /dev/shm once mapped; the mapping itself gone after close.
    for phase in ("train", "eval", "skip"):
        shared = {r[phase]["shared_path"] for r in ranks}
        assert len(shared) == 1 and shared.pop().startswith("/dev/shm/fastdata-memory-"), phase
        assert all(r[phase]["mapped"] and not r[phase]["file_left"] for r in ranks), phase
    assert ranks[0]["train"]["shared_path"] != ranks[0]["eval"]["shared_path"]
    assert not any(r["train"]["mapped_after_close"] for r in ranks)

    # The batches are the single-process loader's shards, rank by rank.
    for rank in (0, 1):
        got = torch.load(tmp_path / f"batches{rank}.pt")
        want = list(_single(good, cache_size=48, seed=5, rank=rank, world_size=2))
        assert len(got) == len(want) > 0
        for (gi, gl), (wi, wl) in zip(got, want):
            assert torch.equal(gi, wi) and torch.equal(gl, wl)

    # A broken file: skipped on both ranks (the one rank that met it told the other), the same kept
    # set, the cache closed up exactly like a single process's; shared or a copy per rank.
    ref_skip = _single(broken, cache_size=48, on_error="skip")
    bad_id = broken_paths.index(str(bad))
    assert bad_id == 9
    for phase in ("skip", "private"):
        for r in ranks:
            assert r[phase]["kept"] == [i for i in range(21) if i != bad_id], phase
            assert r[phase]["skipped"] == 1
            assert r[phase]["cache"] == _digest(ref_skip.cache), phase
            assert r[phase]["shape"] == [20, 48, 48, 3]
    assert all(r["private"]["shared_path"] is None for r in ranks)
    assert all(len(r["private"]["warning"]) == 1 and "no-such-dir" in r["private"]["warning"][0] for r in ranks)

    # on_error="raise": every rank raises the DecodeError, naming the file rank 0 found.
    for r in ranks:
        assert r["raise"] is not None and r["raise"]["path"] == str(bad)
    assert "found by local rank 0" in ranks[1]["raise"]["message"]

    # gather_blocks: rank 0's rows then rank 1's, on both, chunked or in place.
    rows = torch.arange(30, dtype=torch.int32).view(5, 3, 2)
    want = torch.cat([rows, rows + 1000]).flatten().tolist()
    for r in ranks:
        assert r["gathered"] == want and r["gathered_in_place"] == want


# ------------------------------------------------------------------------------ single process
def test_compact_blocks_closes_gaps_in_order_even_when_a_block_overlaps_its_target():
    t = torch.arange(20).view(10, 2)
    before = t.clone()
    # Blocks at rows 0, 4 and 7 with 3, 2 and 3 rows kept: rows 4-5 move to 3-4 (an overlap of one
    # row), rows 7-9 to 5-7.
    assert fdist.compact_blocks(t, [0, 4, 7], [3, 2, 3]) == 8
    assert torch.equal(t[:8], torch.cat([before[0:3], before[4:6], before[7:10]]))
    with pytest.raises(ValueError, match="starts before"):
        fdist.compact_blocks(t, [0, 2], [3, 1])


def test_node_functions_are_no_ops_in_a_single_process():
    assert fdist.node_group() == (None, 0, 1)
    assert fdist.node_layout() == [[0]]
    assert fdist.gather_objects({"a": 1}) == [{"a": 1}]


def test_node_shared_tensor_in_a_one_rank_group(tmp_path):
    """The file is gone as soon as it is mapped, the memory stays; a folder it cannot be made in is a
    reason, not an exception (the caller keeps a copy per rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        t, path, why = fdist.node_shared_tensor(4096, None, tag="t", directory=str(tmp_path))
        assert why is None and t.shape == (4096,) and path.startswith(str(tmp_path / "fastdata-t-"))
        assert not os.path.exists(path)
        t[:] = 7
        assert int(t.sum()) == 7 * 4096
        with open("/proc/self/maps") as f:
            assert any(path in line for line in f)
        none, _, why = fdist.node_shared_tensor(4096, None, directory=str(tmp_path / "missing"))
        assert none is None and "cannot create 4096 bytes in" in why
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("where", ["fallocate", "gather"])
def test_an_interrupt_while_the_shared_file_is_set_up_leaves_nothing_in_dev_shm(tmp_path, monkeypatch, where):
    """Ctrl-C while fallocate zeroed a large cache's pages, or a peer dying in the gathers, left the file
    (1.2 GB in /dev/shm) for good: only OSError was cleaned up, and only before the gathers."""
    import torch.distributed as dist

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        monkeypatch.setattr(os if where == "fallocate" else fdist, "posix_fallocate" if where == "fallocate"
                            else "gather_objects", interrupt)
        with pytest.raises(KeyboardInterrupt):
            fdist.node_shared_tensor(4096, None, tag="t", directory=str(tmp_path))
        assert not list(tmp_path.glob("fastdata-*"))
    finally:
        dist.destroy_process_group()


SIGTERM_SCRIPT = """
import os, signal, sys, time
import torch.distributed as dist
from fastdata import distributed as fdist

directory, mode = sys.argv[1], sys.argv[2]
if mode == "user":
    def users(signum, frame):   # a training script's own handler: a marker, then its own exit
        open(os.path.join(directory, "user-handler-ran"), "w").close()
        sys.exit(7)
    signal.signal(signal.SIGTERM, users)

def slow_fallocate(fd, offset, length):   # a large cache's pages being zeroed: the parent signals now
    open(os.path.join(directory, "ready"), "w").close()
    time.sleep(60)

os.posix_fallocate = slow_fallocate
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, "store"), 1), rank=0, world_size=1)
fdist.node_shared_tensor(4096, None, tag="t", directory=directory)
"""


@pytest.mark.parametrize("mode", ["default", "user"])
def test_sigterm_while_the_shared_file_is_set_up_leaves_nothing_in_dev_shm(tmp_path, mode):
    """SIGTERM is how torchrun, SLURM and Docker stop a job, and Python's default action for it kills
    without running the cleanup: the file stayed in /dev/shm. A handler of the user's runs as before."""
    import signal
    import time

    script = tmp_path / "script.py"
    script.write_text(SIGTERM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(script), str(tmp_path), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the set-up never reached fallocate"
            time.sleep(0.05)
        assert list(tmp_path.glob("fastdata-t-*"))    # the file exists while it is set up
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:   # still running: its stacks (faulthandler) say where it hangs
            proc.send_signal(signal.SIGABRT)
            raise AssertionError(f"still running 60 s after SIGTERM:\n{proc.communicate()[1][-3000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(tmp_path.glob("fastdata-*")), err
    if mode == "default":
        assert proc.returncode == 128 + signal.SIGTERM, err     # as a SIGTERM'd process reports itself
    else:
        assert proc.returncode == 7 and (tmp_path / "user-handler-ran").exists(), err


def test_sigterm_handlers_are_restored_after_the_shared_file_is_set_up(tmp_path):
    """The SIGTERM handler installed for the set-up is gone afterwards (the default action, a user's
    handler), and a set-up outside the main thread (no handler can be installed there) still works."""
    import signal
    import threading

    import torch.distributed as dist

    def users(signum, frame):
        pass

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    before = signal.getsignal(signal.SIGTERM)
    try:
        for handler in (signal.SIG_DFL, users):
            signal.signal(signal.SIGTERM, handler)
            t, _, why = fdist.node_shared_tensor(4096, None, tag="t", directory=str(tmp_path))
            assert why is None and t.shape == (4096,)
            assert signal.getsignal(signal.SIGTERM) is handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            out=fdist.node_shared_tensor(4096, None, tag="t", directory=str(tmp_path))))
        thread.start()
        thread.join(30)
        assert result["out"][2] is None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert not list(tmp_path.glob("fastdata-*"))
    finally:
        signal.signal(signal.SIGTERM, before)
        dist.destroy_process_group()


def test_stale_shared_files_of_dead_processes_are_removed(tmp_path):
    """A SIGKILL between creating the file and unlinking it leaves it: the next shared cache removes
    files whose process is gone and that are older than STALE_SHARED_SECONDS, and nothing else."""
    import subprocess
    import sys
    import time

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    old = time.time() - fdist.STALE_SHARED_SECONDS - 60
    files = {name: tmp_path / name for name in (f"fastdata-memory-abc-{dead}-0a1b", f"fastdata-memory-abc-{dead}-fresh",
                                                f"fastdata-memory-abc-{os.getpid()}-live", "fastdata-other",
                                                f"someone-else-{dead}-0a1b")}
    for name, path in files.items():
        path.write_bytes(b"x")
        if name != f"fastdata-memory-abc-{dead}-fresh":
            os.utime(path, (old, old))
    # Another container's job setting its file up: its pid means nothing here, but it holds the lock.
    import fcntl

    locked = tmp_path / f"fastdata-memory-abc-{dead}-0c0d"   # a dead pid here, but locked
    locked.write_bytes(b"x")
    os.utime(locked, (old, old))
    fd = os.open(locked, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert fdist.remove_stale_shared_files(str(tmp_path)) == [str(files[f"fastdata-memory-abc-{dead}-0a1b"])]
    finally:
        os.close(fd)
    kept = set(files) - {f"fastdata-memory-abc-{dead}-0a1b"} | {locked.name}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert fdist.remove_stale_shared_files(str(tmp_path / "missing")) == []


def test_node_key_keeps_torchrun_agents_on_one_machine_apart(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "0")
    first = fdist.node_key()
    monkeypatch.setenv("GROUP_RANK", "1")
    assert fdist.node_key() != first


def test_node_cache_must_be_a_bool(photo_folder):
    with pytest.raises(TypeError, match="node_cache must be True or False, got 'yes'"):
        make_loader(ImageFolder(photo_folder), "memory", batch_size=6, device="cpu", node_cache="yes")


def test_the_budget_counts_every_private_copy_of_a_node(photo_folder, monkeypatch):
    """k ranks that cannot share /dev/shm hold k caches in one RAM: each checks its 1/k share."""
    from fastdata.backends import memory
    from fastdata.config import LoaderConfig
    from fastdata.errors import CacheDoesNotFit

    src = ImageFolder(photo_folder)
    cfg = LoaderConfig(batch_size=6, device="cpu")
    need = memory.cache_bytes(src, cfg, cache_size=64)
    # 2.5 caches after the reserve
    monkeypatch.setattr(memory.budgeting, "available_ram", lambda: int(need * 2.5 / 0.8))
    monkeypatch.setattr(memory.budgeting, "live_cache_bytes", lambda *a: 0)   # other tests' loaders still alive
    memory.check_fits(src, cfg, copies=2, cache_size=64)
    with pytest.raises(CacheDoesNotFit, match=r"\(3 copies, one per rank of this node\)"):
        memory.check_fits(src, cfg, copies=3, cache_size=64)


def test_a_decode_error_names_the_file_in_a_single_process_as_before(tmp_path):
    _, broken, bad = _folders(tmp_path)
    with pytest.raises(DecodeError) as e:
        _single(broken, cache_size=48)
    assert e.value.path == str(bad)


# ------------------------------------------------------------------------------------- two GPUs
CUDA_SCRIPT = """
import hashlib, json, os, sys
import torch
from fastdata import distributed as fdist, make_loader
from fastdata.config import Augmentation
from fastdata.datasets import ImageFolder
import fastdata.images.whole as mem   # the whole-photo decoders

LOG = os.path.abspath("decodes.log")
def counted(fn):
    def wrapper(data, path, *args, **kwargs):   # load_whole/load_photo(bytes, name, ...)
        fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{os.environ['RANK']}\\t{path}\\n".encode())
        os.close(fd)
        return fn(data, path, *args, **kwargs)
    return wrapper
mem.load_whole = counted(mem.load_whole)

device = fdist.init_distributed("cuda")       # nccl, cuda:LOCAL_RANK
# cache_build="threads": PIL decodes every photo (counted above) with the single-process cache's exact
# pixels; the CUDA default (nvImageCodec on the GPU) is within a tolerance, tested in test_memory.py.
loader = make_loader(ImageFolder(sys.argv[1]), "memory", batch_size=4, cache_size=48, cache_workers=0,
                     on_error="skip", augment=Augmentation.imagenet_train(size=32), cache_build="threads")
with open(f"rank{fdist.rank()}.json", "w") as f:
    json.dump({"device": str(loader.cache.device), "kept": loader.kept.tolist(),
               "cache": hashlib.sha256(loader.cache.cpu().numpy().tobytes()).hexdigest()}, f)
fdist.cleanup()
"""


@pytest.mark.cuda(devices=2)
def test_two_gpus_decode_each_photo_once_and_all_gather_the_cache(tmp_path):
    _, broken, bad = _folders(tmp_path)
    ranks = _torchrun(CUDA_SCRIPT, tmp_path, [str(broken)], timeout=300)
    decoded = [line.split("\t")[1] for line in (tmp_path / "decodes.log").read_text().splitlines()]
    assert Counter(decoded) == Counter(ImageFolder(broken).paths)
    ref = _single(broken, cache_size=48, on_error="skip")
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    for r in ranks:
        assert r["cache"] == _digest(ref.cache)
        assert r["kept"] == ref.kept.tolist()
