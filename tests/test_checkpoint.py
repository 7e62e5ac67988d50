import enum
import fractions
import os
import random

import numpy as np
import pytest
import torch

from conftest import require, run_as_nobody
from fastdata import checkpoint as ckpt


def _state(value: float) -> dict:
    return {"w": torch.full((3,), value), "step": int(value), "name": "x", "nested": {"t": (1, 2.5, None)}}


def test_roundtrip_loads_with_weights_only(tmp_path):
    path = ckpt.save({**_state(1.0), "rng": ckpt.rng_state()}, tmp_path / "c.pt")
    # ckpt.load uses weights_only=True; plain torch.load with it must work too.
    for loaded in (ckpt.load(path), torch.load(path, weights_only=True)):
        assert torch.equal(loaded["w"], torch.ones(3))
        assert loaded["nested"]["t"] == (1, 2.5, None)
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_a_checkpoint_gets_the_mode_the_umask_gives(tmp_path):
    """Not mkstemp's 0600: other users of a shared run folder can read it, as a torch.save file."""
    before = os.umask(0o027)
    try:
        path = ckpt.save(_state(1.0), tmp_path / "c.pt")
        (tmp_path / "plain").write_bytes(b"x")
    finally:
        os.umask(before)
    assert path.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == 0o640


def test_rng_state_restores_every_generator():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = ckpt.rng_state()
    first = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    ckpt.set_rng_state(state)
    again = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    assert first[:3] == again[:3]
    assert torch.equal(first[3], again[3])


def test_crash_between_write_and_replace_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    ckpt.save(_state(1.0), path)

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save(_state(2.0), path)
    monkeypatch.undo()
    assert torch.equal(ckpt.load(path)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # the temporary was removed


def test_failure_mid_write_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    ckpt.save(_state(1.0), path)
    real_save = torch.save

    def disk_full(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        ckpt.save(_state(2.0), path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.equal(ckpt.load(path)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_unwritable_folder_raises_and_keeps_previous():
    """Root can write anywhere, so the second save runs as uid nobody (``run_as_nobody``) against a
    root-owned read-only folder: the same situation as a user's unwritable folder."""
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="fastdata-ro-")  # under /tmp, traversable by others (unlike tmp_path)
    try:
        os.chmod(base, 0o755)
        folder = os.path.join(base, "ro")
        os.mkdir(folder)
        path = os.path.join(folder, "c.pt")
        ckpt.save(_state(1.0), path)
        os.chmod(folder, 0o555)
        with pytest.raises(PermissionError) as raised:
            run_as_nobody(ckpt.save, _state(2.0), path)
        assert raised.type is PermissionError
        assert torch.equal(ckpt.load(path)["w"], torch.ones(3))
        assert sorted(os.listdir(folder)) == ["c.pt"]
    finally:
        os.chmod(os.path.join(base, "ro"), 0o755)
        shutil.rmtree(base)


def test_folder_that_is_a_file_raises(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.save(_state(1.0), blocker / "c.pt")
    assert blocker.read_text() == "x"


def test_clean_stale_removes_only_this_checkpoints_temporaries(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save(_state(1.0), path)
    stale = [tmp_path / "c.pt.tmp.abc123", tmp_path / "c.pt.tmp.zz"]
    keep = [tmp_path / "other.pt.tmp.abc", tmp_path / "c.pt.bak"]
    for p in stale + keep:
        p.write_bytes(b"junk")
    removed = ckpt.clean_stale(path)
    assert sorted(removed) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.pt"] + [p.name for p in keep])
    assert ckpt.clean_stale(tmp_path / "missing" / "c.pt") == []


def test_load_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        ckpt.load(tmp_path / "nope.pt")


def test_keyboard_interrupt_during_a_save_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    ckpt.save(_state(1.0), path)
    real_save = torch.save

    def interrupted(obj, f):
        f.write(b"the first bytes of a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(_state(2.0), path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def _die_before_replace(path):
    """A hard crash (no cleanup runs: power loss, SIGKILL) between writing the temporary and the rename."""
    os.replace = lambda src, dst: os._exit(3)
    ckpt.save(_state(2.0), path)


def test_hard_crash_leaves_a_temporary_that_the_next_start_removes(tmp_path):
    import multiprocessing as mp

    from fastdata import SmallCNN, fit, make_loader
    from fastdata.datasets import SyntheticDigits

    path = tmp_path / "c.pt"
    ckpt.save(_state(1.0), path)
    child = mp.get_context("fork").Process(target=_die_before_replace, args=(path,))
    child.start()
    child.join(60)
    assert child.exitcode == 3
    stale = [p.name for p in tmp_path.iterdir() if p.name != "c.pt"]
    assert len(stale) == 1 and stale[0].startswith("c.pt.tmp."), stale  # the crash left it behind
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))  # previous one intact
    # The next training start with that checkpoint path removes the stale temporary.
    loader = make_loader(SyntheticDigits(64, seed=1), "torch", batch_size=32, num_workers=0, device="cpu")
    fit(SmallCNN(width=4), loader, epochs=1, checkpoint=tmp_path / "c.pt", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


@pytest.mark.parametrize("content, match", [
    (b"", r"checkpoint '.*c.pt' is empty \(0 bytes\)"),
    ("half", r"checkpoint '.*c.pt' \([\d,]+ bytes\) is truncated or corrupt"),
    (b"not a checkpoint at all" * 10, r"checkpoint '.*c.pt' \([\d,]+ bytes\) is (truncated or corrupt|not a fastdata)"),
])
def test_load_of_a_damaged_file_names_it_and_says_what_is_wrong(tmp_path, content, match):
    """torch.load gives EOFError, RuntimeError or OSError [Errno 22] without the file's name."""
    path = tmp_path / "c.pt"
    ckpt.save({"w": torch.zeros(10_000)}, path)
    if content == "half":
        content = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path)


def test_load_of_a_pickle_that_is_not_a_checkpoint_is_refused(tmp_path):
    import pickle

    path = tmp_path / "c.pt"
    with open(path, "wb") as f:
        pickle.dump({"opaque": object}, f, protocol=2)  # a class: weights_only refuses it
    with pytest.raises(ckpt.CheckpointError, match=r"c.pt' .* is (not a fastdata checkpoint|truncated)"):
        ckpt.load(path)


def test_load_of_a_directory_says_so(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        ckpt.load(tmp_path)


def test_prepare_checks_the_path_before_any_save(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        ckpt.prepare(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"cannot create the folder '.*file'"):
        ckpt.prepare(tmp_path / "file" / "c.pt")
    stale = tmp_path / "sub" / "c.pt.tmp.left"
    ckpt.prepare(tmp_path / "sub" / "c.pt")         # creates the folder
    assert (tmp_path / "sub").is_dir() and list((tmp_path / "sub").iterdir()) == []
    stale.write_bytes(b"x")
    ckpt.prepare(tmp_path / "sub" / "c.pt")         # and removes stale temporaries
    assert not stale.exists()


def test_prepare_refuses_an_unwritable_folder():
    """As in test_unwritable_folder_raises_and_keeps_previous: root writes anywhere, so prepare runs as
    uid nobody (``run_as_nobody``) against a root-owned read-only folder."""
    import shutil
    import tempfile

    base = tempfile.mkdtemp(prefix="fastdata-ro-")
    try:
        os.chmod(base, 0o755)
        folder = os.path.join(base, "ro")
        os.mkdir(folder, 0o555)
        os.chmod(folder, 0o555)
        with pytest.raises(PermissionError, match=r"c\.pt.*is not writable") as raised:
            run_as_nobody(ckpt.prepare, os.path.join(folder, "c.pt"))
        assert raised.type is PermissionError
        assert os.listdir(folder) == []
    finally:
        os.chmod(os.path.join(base, "ro"), 0o755)
        shutil.rmtree(base)


# ----------------------------------------------------------------------------------- the storage hook
class DictStorage:
    """A plain hook object (no base class): checkpoints in a dict, every call logged."""

    def __init__(self):
        self.files, self.calls = {}, []

    def exists(self, path):
        self.calls.append(("exists", path))
        return path in self.files

    def read_bytes(self, path):
        self.calls.append(("read", path))
        return self.files[path]

    def write_bytes(self, path, data):
        self.calls.append(("write", path))
        self.files[path] = bytes(data)


def test_a_custom_storage_object_takes_every_read_and_write():
    store = DictStorage()
    ckpt.prepare("runs/c.pt", store)                     # no prepare(): nothing to check
    ckpt.save(_state(3.0), "runs/c.pt", storage=store)
    assert list(store.files) == ["runs/c.pt"] and not os.path.exists("runs/c.pt")
    assert ckpt.exists("runs/c.pt", store) and not ckpt.exists("runs/other.pt", store)
    assert torch.equal(ckpt.load("runs/c.pt", storage=store)["w"], torch.full((3,), 3.0))
    assert ("write", "runs/c.pt") in store.calls and ("read", "runs/c.pt") in store.calls
    with pytest.raises(FileNotFoundError, match="checkpoint 'runs/none.pt' does not exist"):
        ckpt.load("runs/none.pt", storage=store)
    store.files["runs/bad.pt"] = b"garbage"
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint 'runs/bad.pt' \(7 bytes\) is"):
        ckpt.load("runs/bad.pt", storage=store)


def test_a_storage_missing_a_method_is_refused_naming_what_it_needs():
    class ReadOnly:
        def exists(self, path):
            return False

        def read_bytes(self, path):
            return b""

    with pytest.raises(TypeError, match=r"has no \['write_bytes'\] method.*exists\(path\), read_bytes\(path\) "
                                        r"and write_bytes\(path, data\)"):
        ckpt.save(_state(1.0), "c.pt", storage=ReadOnly())


def test_urls_go_through_fsspec_and_file_urls_to_the_local_file_system(tmp_path):
    require("fsspec")
    url = f"memory://fastdata-test-{os.getpid()}/run/c.pt"
    ckpt.prepare(url)
    assert not ckpt.exists(url)
    ckpt.save(_state(2.0), url)
    assert ckpt.exists(url) and isinstance(ckpt.storage_for(url), ckpt.FsspecStorage)
    assert torch.equal(ckpt.load(url)["w"], torch.full((3,), 2.0))
    with pytest.raises(IsADirectoryError, match="is a directory"):
        ckpt.prepare(f"memory://fastdata-test-{os.getpid()}/run")
    # file:// is the local file system, with its atomic save.
    assert ckpt.storage_for(f"file://{tmp_path}/c.pt") is ckpt.LOCAL
    ckpt.save(_state(4.0), f"file://{tmp_path}/c.pt")
    assert torch.equal(torch.load(tmp_path / "c.pt", weights_only=True)["w"], torch.full((3,), 4.0))
    assert ckpt.url_scheme("s3://bucket/c.pt") == "s3" and ckpt.url_scheme(tmp_path / "c.pt") is None
    assert ckpt.url_scheme("C:/runs/c.pt") is None


def test_a_url_without_fsspec_names_the_package_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fsspec", None)     # import fsspec now raises ImportError
    with pytest.raises(ImportError, match=r"checkpoint 's3://bucket/c.pt' is a s3:// URL.*pip install fsspec.*s3fs"):
        ckpt.save(_state(1.0), "s3://bucket/c.pt")
    assert ckpt.storage_for("/plain/path.pt") is ckpt.LOCAL   # plain paths never need it


def test_fit_checkpoints_to_a_url_and_a_custom_storage_and_resumes_from_them(tmp_path):
    require("fsspec")
    from fastdata import SmallCNN, fit, make_loader
    from fastdata.datasets import SyntheticDigits

    src = SyntheticDigits(128, seed=2)

    def run(epochs, **kw):
        torch.manual_seed(0)
        model = SmallCNN(width=4)
        loader = make_loader(src, "torch", batch_size=32, num_workers=0, device="cpu", seed=1)
        return model, fit(model, loader, epochs=epochs, progress=False, **kw)

    ref, _ = run(2)
    store = DictStorage()
    for where in ({"checkpoint": f"memory://fastdata-fit-{os.getpid()}/c.pt"},
                  {"checkpoint": "runs/c.pt", "checkpoint_storage": store}):
        run(1, **where)
        model, history = run(2, resume=True, **where)
        assert [r["epoch"] for r in history] == [1, 2]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert list(store.files) == ["runs/c.pt"] and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------- one file, every rank
def _shared_rank(rank, store, paths, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=len(paths))
    try:
        state = ckpt.load_shared(paths[rank])
        queue.put((rank, None if state is None else float(state["w"][0])))
    except Exception as e:  # reported, not raised: the parent asserts on it
        queue.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        from fastdata import distributed as fdist

        # The answer leaves before the teardown: on torch 2.4 destroy_process_group can block, holding
        # the GIL, once a peer has gone, and the queue's feeder thread would never send it.
        queue.close()
        queue.join_thread()
        fdist.cleanup(barrier=False)   # gloo's threads finish before exit


def _load_on_three_ranks(tmp_path, paths):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    import uuid

    store = tmp_path / f"store-{uuid.uuid4().hex}"   # a fresh rendezvous file for each group
    ranks = [ctx.Process(target=_shared_rank, args=(r, store, paths, q)) for r in range(3)]
    for p in ranks:
        p.start()
    try:
        return dict(q.get(timeout=60) for _ in ranks)
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_rank_0_decides_and_a_rank_that_cannot_read_its_file_gets_rank_0s(tmp_path):
    """Each rank has its own "disk": rank 0's holds the checkpoint, rank 1's nothing, rank 2's an older
    checkpoint at the same path. Every rank resumes from rank 0's."""
    disks = [tmp_path / f"disk{r}" for r in range(3)]
    for d in disks:
        d.mkdir()
    ckpt.save(_state(7.0), disks[0] / "c.pt")
    ckpt.save(_state(1.0), disks[2] / "c.pt")
    got = _load_on_three_ranks(tmp_path, [str(d / "c.pt") for d in disks])
    assert got == {0: 7.0, 1: 7.0, 2: 7.0}
    # Rank 0 has none: no rank resumes, though rank 2 has a file.
    (disks[0] / "c.pt").unlink()
    assert _load_on_three_ranks(tmp_path, [str(d / "c.pt") for d in disks]) == {0: None, 1: None, 2: None}
    # A damaged one on rank 0 fails on every rank, naming it.
    (disks[0] / "c.pt").write_bytes(b"half")
    got = _load_on_three_ranks(tmp_path, [str(d / "c.pt") for d in disks])
    assert got[0].startswith("CheckpointError: checkpoint '") and "is truncated or corrupt" in got[0]
    for rank in (1, 2):
        assert got[rank].startswith("PreparationError: reading checkpoint") and "rank 0" in got[rank]
        assert "CheckpointError" in got[rank]


# ------------------------------------------------------------------------- what load can read back
class NumpyCosine(torch.optim.lr_scheduler.LRScheduler):
    """A user's schedule computed with numpy: its rates are np.float64 (in its own state and in the
    optimizer's param_groups, so both state_dicts hold them), its step count an np.int64."""

    def __init__(self, optimizer, total: int):
        self.total, self.steps = np.int64(total), np.int64(0)
        super().__init__(optimizer)

    def get_lr(self):
        return [base * 0.5 * (1 + np.cos(np.pi * self.steps / self.total)) for base in self.base_lrs]

    def step(self):
        self.steps += 1   # LRScheduler.__init__ steps once too
        super().step()


def test_a_numpy_scheduler_checkpoint_resumes_as_the_uninterrupted_run(tmp_path):
    """Issue 23.A6: fit saved this scheduler's state, and the resume refused the file as "not a fastdata
    checkpoint or is corrupt" (weights_only refuses numpy's globals)."""
    from fastdata import SmallCNN, fit, make_loader
    from fastdata.datasets import SyntheticDigits

    src = SyntheticDigits(128, seed=2)

    def run(epochs, **kw):
        torch.manual_seed(0)
        model = SmallCNN(width=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = NumpyCosine(opt, total=8)
        loader = make_loader(src, "torch", batch_size=32, num_workers=0, device="cpu", seed=1)
        history = fit(model, loader, epochs=epochs, optimizer=opt, scheduler=sched, scheduler_interval="step",
                      progress=False, **kw)
        return model, sched, history

    ref, ref_sched, ref_history = run(2)
    path = tmp_path / "c.pt"
    run(1, checkpoint=path)
    state = torch.load(path, weights_only=True)
    assert state["scheduler"]["steps"] == 1 + 4 and type(state["scheduler"]["steps"]) is int
    assert type(state["optimizer"]["param_groups"][0]["lr"]) is float
    model, sched, history = run(2, checkpoint=path, resume=True)
    assert [r["epoch"] for r in history] == [1, 2] and history[-1]["lr"] == ref_history[-1]["lr"]
    assert sched.steps == ref_sched.steps == 1 + 8 and sched.get_last_lr() == ref_sched.get_last_lr()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_numpy_values_are_saved_as_python_numbers_and_tensors(tmp_path):
    state = {"f": np.float64(0.5), "i": np.int64(3), "b": np.bool_(True), "s": np.str_("x"),
             "a": np.arange(4, dtype=np.float32).reshape(2, 2)[:, ::-1], "words": np.array(["a", "b"]),
             "nested": [(np.float32(1.5), {np.int64(7): np.uint8(2)})], "w": torch.ones(2)}
    loaded = ckpt.load(ckpt.save(state, tmp_path / "c.pt"))
    assert loaded["f"] == 0.5 and type(loaded["f"]) is float
    assert loaded["i"] == 3 and type(loaded["i"]) is int and loaded["b"] is True and type(loaded["s"]) is str
    assert torch.equal(loaded["a"], torch.tensor([[1.0, 0.0], [3.0, 2.0]])) and loaded["words"] == ["a", "b"]
    assert loaded["nested"] == [(1.5, {7: 2})] and type(next(iter(loaded["nested"][0][1]))) is int
    assert torch.equal(loaded["w"], torch.ones(2))
    assert type(state["f"]) is np.float64   # the caller's objects are left as they were


@pytest.mark.parametrize("value, kind", [(fractions.Fraction(1, 3), "fractions.Fraction"),
                                         (enum.IntEnum("Phase", "WARMUP")(1), "Phase")])
def test_a_value_load_could_not_read_back_is_refused_at_save_naming_its_key(tmp_path, value, kind):
    path = tmp_path / "c.pt"
    ckpt.save(_state(1.0), path)
    with pytest.raises(TypeError, match=rf"checkpoint '{path}': \['scheduler'\]\['phases'\]\[1\] is a "
                                        rf"\S*{kind} .*cannot read back.*add_safe_globals"):
        ckpt.save({**_state(2.0), "scheduler": {"phases": [0.1, value]}}, path)
    assert torch.equal(ckpt.load(path)["w"], torch.ones(3))   # the previous checkpoint stays


def test_fit_refuses_a_scheduler_state_a_checkpoint_cannot_hold_before_training(tmp_path):
    from fastdata import SmallCNN, fit, make_loader
    from fastdata.datasets import SyntheticDigits

    class Ratio(torch.optim.lr_scheduler.StepLR):
        def __init__(self, optimizer):
            self.ratio = fractions.Fraction(1, 2)   # in state_dict(): it is the scheduler's __dict__
            super().__init__(optimizer, step_size=1)

    model = SmallCNN(width=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = make_loader(SyntheticDigits(64, seed=2), "torch", batch_size=32, num_workers=0, device="cpu")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"\['scheduler'\]\['ratio'\] is a fractions.Fraction"):
        fit(model, loader, epochs=1, optimizer=opt, scheduler=Ratio(opt), checkpoint=tmp_path / "c.pt",
            progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # nothing trained
    assert not (tmp_path / "c.pt").exists()
