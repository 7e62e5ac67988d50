"""Review of the day's fixes: behaviour that worked before them, or advice a user can act on."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as v2
from PIL import Image

from fastdata import make_loader
from fastdata.config import Augmentation
from fastdata.datasets import ArraySource

CPU = {"device": "cpu", "num_workers": 0}


class _Pictures(torch.utils.data.Dataset):
    """A torchvision-style dataset of 32 px PIL images (CIFAR's shape), with an optional transform."""

    def __init__(self, images, labels, transform=None):
        self.images, self.targets, self.transform = images, list(labels), transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        image = Image.fromarray(self.images[i])
        return (self.transform(image) if self.transform is not None else image), int(self.targets[i])


def test_like_keeps_cifar_at_its_own_scale_after_a_padded_random_crop():
    """CIFAR trained through torchvision's RandomCrop(32, padding=4): a crop at the images' own size,
    nothing rescaled. like= read its 32 as an ImageNet-style training size and evaluated the 32 px test
    set resized to 37 and center-cropped back to 32: zoomed, its borders cut, unlike what was trained."""
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8), np.arange(16) % 4
    train = make_loader(_Pictures(images, labels, v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(),
                                                              v2.PILToTensor()])), "torch", batch_size=4, **CPU)
    for test in (ArraySource(images, labels), _Pictures(images, labels)):
        val = make_loader(test, "torch", like=train)
        assert val.augment == Augmentation.none(), type(test).__name__
        assert next(iter(val))[0].shape == (4, 3, 32, 32)


def test_a_path_held_by_this_very_process_says_so_and_how_to_free_it(tmp_path):
    """A notebook re-running ``log = RunLog(d)`` (its loop raised before close()) makes the new RunLog
    while the old one still holds the folder: refused with "stop the other run first", the other run
    being the notebook itself. The refusal says it is this process, and how to let go."""
    from fastdata.runlog import LogDirInUse, RunLog

    first = RunLog(tmp_path, tensorboard=False)
    with pytest.raises(LogDirInUse, match=f"pid {os.getpid()}.*this process itself") as refused:
        RunLog(tmp_path, tensorboard=False)
    assert "close()" in str(refused.value)
    first.close()
    RunLog(tmp_path, tensorboard=False).close()


def test_auto_across_ranks_passes_over_a_later_row_that_fails_to_judge_as_one_rank_never_reached_it():
    """Under a process group every row is judged (another rank may need a later one). A row after the
    first that fits, whose package fails to import or whose fits() raises (a broken DALI install), failed
    the whole job's choice ("rank 0 could not decide"); one process alone stops at the first that fits
    and never reached it. It is now that row's refusal; a row before the first fit still raises."""
    from conftest import indexed_source
    from fastdata import registry
    from fastdata.backends import auto
    from fastdata.backends.base import Loader

    class Broken(Loader):
        @classmethod
        def fits(cls, source, config, options=None, *, stable=False):
            raise ImportError("libnvjpeg.so.12: cannot open shared object file")

    config = type("C", (), {"device": torch.device("cpu"), "augment": Augmentation.none(), "train": True,
                            "rank": None, "world_size": None, "dtype": torch.float32, "batch_size": 8})()
    registry.register("review_broken", Broken, devices=("cpu",))
    try:
        rows = list(auto.verdicts(indexed_source(32), config, None, registry.by_preference()))
        assert [r[:2] for r in rows if r[0] == "review_broken"] == [("review_broken", False)]
        assert "libnvjpeg" in dict((n, w) for n, _, w in rows)["review_broken"]
        assert auto.combine([rows, rows], "cpu")[0] == rows[0][0]
        registry.register("review_broken", Broken, devices=("cpu",), order=0, replace=True)
        with pytest.raises(ImportError, match="libnvjpeg"):
            list(auto.verdicts(indexed_source(32), config, None, registry.by_preference()))
    finally:
        registry.unregister("review_broken")


def test_where_nothing_can_be_locked_no_lock_file_is_left_behind(tmp_path, monkeypatch):
    """On Windows or a file system without flock nothing is held, but the lock file that hold() created
    to try stayed: a c.pt.lock beside every checkpoint and a runlog.lock in every log folder, for good."""
    from fastdata import checkpoint as ckpt
    from fastdata import pathlock
    from fastdata.runlog import RunLog

    monkeypatch.setattr(pathlock, "try_lock", lambda fd, blocking=False: None)
    assert ckpt.claim(tmp_path / "c.pt") is None
    RunLog(tmp_path / "log", tensorboard=False).close()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["log"]


class _Shared(ArraySource):
    """An array source with a spawn context's Lock, as a source shared with its workers keeps one."""

    def __init__(self, *args):
        super().__init__(*args)
        import multiprocessing

        self.lock = multiprocessing.get_context("spawn").Lock()


class _Reduced(ArraySource):
    """An array source holding an open file it leaves out by ``__reduce__`` (made again on arrival)."""

    def __init__(self, images, labels, path):
        super().__init__(images, labels)
        self.args, self.log = (images, labels, path), open(path, "a")

    def __reduce__(self):
        return type(self), self.args


@pytest.mark.parametrize("kind", ["lock", "reduce"])
def test_a_source_that_spawned_workers_receive_is_not_refused_as_unpicklable(tmp_path, kind):
    """check_picklable (workers started by spawn get the source pickled) pickled each attribute of the
    default __getstate__ with plain pickle: a source that pickles itself by __reduce__, leaving its open
    file out, and a spawn context's Lock (which plain pickle refuses and a spawning worker is sent) were
    refused as "cannot be sent to the DataLoader workers"."""
    import pickle

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (8, 8, 8, 3), dtype=np.uint8), np.arange(8) % 2
    source = _Shared(images, labels) if kind == "lock" else _Reduced(images, labels, tmp_path / "log.txt")
    if kind == "reduce":
        assert isinstance(pickle.loads(pickle.dumps(source)), _Reduced)
    make_loader(source, "torch", batch_size=4, device="cpu", num_workers=1, multiprocessing_context="spawn")


def test_a_path_held_from_another_host_says_how_to_free_it_if_that_host_is_gone(tmp_path):
    """On a shared file system the holder may be a run on a node that went down (a preempted job): its
    lock can outlive it there, and "stop the other run first" named a run no one can stop. The refusal
    says which file to remove if that run is gone."""
    import fcntl

    from fastdata import checkpoint as ckpt

    lock = tmp_path / "c.pt.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # a flock is per open file: this one stands for the other host's
        os.write(fd, b"pid 4242 on gpu-node-17, since Fri Nov 27 23:00:00 2026")
        with pytest.raises(ckpt.CheckpointInUse, match="gpu-node-17") as refused:
            ckpt.claim(tmp_path / "c.pt")
        assert "if that run is gone" in str(refused.value) and f"remove '{lock}'" in str(refused.value)
    finally:
        os.close(fd)


def test_this_process_is_told_by_its_claims_not_by_the_pid_and_host_a_lock_file_names(tmp_path):
    """Containers on two nodes may share a host name and a pid: a lock file naming them, held by no claim
    of this process, is another run's, and gets no advice to close() an object of this one."""
    import fcntl
    import socket

    from fastdata import checkpoint as ckpt

    lock = tmp_path / "c.pt.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # another node's run with this pid and host name
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since Fri Nov 27 23:00:00 2026".encode())
        with pytest.raises(ckpt.CheckpointInUse) as refused:
            ckpt.claim(tmp_path / "c.pt")
        assert "this process itself" not in str(refused.value)
    finally:
        os.close(fd)


def test_clean_stale_leaves_a_save_in_progress_alone_where_flock_needs_a_writable_descriptor(tmp_path, monkeypatch):
    """NFSv4 emulates flock with POSIX locks: an exclusive one on a descriptor opened read-only fails
    (EBADF). clean_stale opened the temporaries read-only, took that for "no locks here", and removed the
    temporary another run was writing: that run's save then failed naming a .tmp file."""
    import errno
    import fcntl
    import tempfile

    from fastdata import checkpoint as ckpt

    real = fcntl.flock

    def nfs_flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)

    fd, tmp = tempfile.mkstemp(prefix="c.pt" + ckpt.TMP_MARK, dir=tmp_path)   # another run, saving
    try:
        real(fd, fcntl.LOCK_EX)
        monkeypatch.setattr(fcntl, "flock", nfs_flock)
        assert ckpt.clean_stale(tmp_path / "c.pt") == [] and os.path.exists(tmp)
    finally:
        os.close(fd)
    assert ckpt.clean_stale(tmp_path / "c.pt") == [Path(tmp)]   # once it is let go: a crashed save's, removed


def test_a_forked_child_does_not_keep_a_killed_runs_path_in_use(tmp_path):
    """A flock belongs to the open file, and a forked child (a DataLoader worker) holds a copy of the
    claim's descriptor: a run killed while its children lived on was refused on resume ("in use by
    another run", naming the dead pid) until the last child ended."""
    import time

    from fastdata import checkpoint as ckpt

    claim = ckpt.claim(tmp_path / "c.pt")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:   # a worker that outlives its parent for a while
        os.write(ready_w, b"1")   # os.fork's after-in-child hooks have run by now
        time.sleep(3)
        os._exit(0)
    # Waited for: the parent racing ahead of the child's start found its lock still shared (a full-suite
    # run on 2 loaded cores); a killed run's workers have long started.
    os.read(ready_r, 1)
    os.close(ready_r)
    os.close(ready_w)
    try:
        os.close(claim.fd)   # the run is killed: its own descriptor goes, its lock file stays
        claim.fd = None
        again = ckpt.claim(tmp_path / "c.pt")
        assert again is not None
        again.release()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
