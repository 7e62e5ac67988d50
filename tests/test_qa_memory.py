"""QA pass over the memory backend as a user runs it: options kept when broken files are skipped, and a
closed loader that says so."""
from __future__ import annotations

import shutil

import pytest
import torch

from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder
from fastdata.datasets.folders import make_image_folder

EVAL = Augmentation(crop="center", size=24, resize=28)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same 11 small photos twice: once alone, once beside an undecodable file."""
    clean = make_image_folder(tmp_path_factory.mktemp("clean"), classes=1, per_class=11, seed=4,
                              size_range=((40, 60), (30, 50)))
    broken = tmp_path_factory.mktemp("broken") / "photos"
    shutil.copytree(clean, broken)
    (broken / "class_000" / "img_00003b.jpg").write_bytes(b"not a jpeg")
    return clean, broken


def _rank_batches(root, rank, **kw):
    loader = make_loader(ImageFolder(root), "memory", batch_size=2, train=False, device="cpu", augment=EVAL,
                         rank=rank, world_size=2, drop_last=False, even_batches=True, **kw)
    return len(loader), [(x, y) for x, y in loader]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_even_batches_hold_when_broken_files_are_skipped(folders):
    """on_error='skip' re-planned the epoch for the decodable files without even_batches: 11 kept photos
    over 2 ranks gave rank 0 a last batch of 2 and rank 1 one of 1 (the padding accelerate's gather
    relies on was gone). Now each rank's batches are those of the same folder without the broken file."""
    clean, broken = folders
    for rank in (0, 1):
        n_ref, ref = _rank_batches(clean, rank)
        n_got, got = _rank_batches(broken, rank, on_error="skip")
        assert n_got == n_ref == len(got)
        assert [len(y) for _, y in got] == [len(y) for _, y in ref]
        for (x, y), (rx, ry) in zip(got, ref, strict=True):
            assert torch.equal(y, ry) and torch.equal(x, rx)


def test_a_closed_loader_says_it_was_closed(folders):
    """Iterating a closed loader failed deep in the gather ("'NoneType' object has no attribute
    'shape'"); it now names what happened."""
    loader = make_loader(ImageFolder(folders[0]), "memory", batch_size=4, train=False, device="cpu", augment=EVAL)
    assert len(list(loader)) == 3
    loader.close()
    with pytest.raises(RuntimeError, match="memory loader was closed"):
        next(iter(loader))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_loader_that_fails_half_built_frees_its_share_of_the_budget(folders, tmp_path):
    """Too few decodable files fail after the cache is built. The half-built loader, still referenced by
    the kept exception (as a notebook keeps the last traceback), counted against the budget of every
    later loader and held its cache; the error named neither the source nor the counts."""
    import gc

    from fastdata.backends.memory import LIVE, live_cache_bytes

    root = tmp_path / "mostly_broken"
    (root / "a").mkdir(parents=True)
    shutil.copy(next((folders[0] / "class_000").iterdir()), root / "a" / "ok.jpg")
    for name in ("x.jpg", "y.jpg"):
        (root / "a" / name).write_bytes(b"not a jpeg")
    # Against what is live before: in a full run, other tests' loaders may still be referenced.
    gc.collect()
    before = live_cache_bytes(torch.device("cpu")), len(LIVE)
    with pytest.raises(ValueError, match=r"only 1 of the 3 files of ImageFolder.*2 skipped.*batch of 2") as kept:
        make_loader(ImageFolder(root), "memory", batch_size=2, train=True, device="cpu",
                    augment=Augmentation(crop="random_resized", size=24), on_error="skip")
    assert kept.value is not None
    assert (live_cache_bytes(torch.device("cpu")), len(LIVE)) == before


@pytest.mark.parametrize("kind", ["digits", "photos"])
def test_close_ends_a_running_pass_and_frees_its_cache(folders, kind):
    """close() with an iterator still alive (a peeked pass, a fetcher holding it) told the budget the
    cache was freed while the pass's views kept it allocated (digits), or let the pass go on into a
    freed cache, failing with "'NoneType' object is not subscriptable" (photos). The pass now ends, and
    its next next() says the loader was closed (it read as a short epoch, without a word)."""
    import gc
    import weakref

    from fastdata.backends.memory import live_cache_bytes
    from fastdata.datasets import SyntheticDigits

    if kind == "digits":
        loader = make_loader(SyntheticDigits(n=128), "memory", batch_size=16, device="cpu",
                             augment=Augmentation.digits_train())
    else:
        loader = make_loader(ImageFolder(folders[0]), "memory", batch_size=2, device="cpu",
                             augment=Augmentation(crop="random_resized", size=24))
    held = weakref.ref(loader.ready if loader.ready is not None else loader.cache)
    it = iter(loader)
    next(it)
    loader.close()
    gc.collect()
    assert held() is None and live_cache_bytes(torch.device("cpu")) == 0
    with pytest.raises(RuntimeError, match="the memory loader was closed while this pass ran"):
        next(it)


def test_a_cache_size_that_does_not_suit_the_photos_is_named(folders):
    """cache_size under the training crop's size (the default 256 under a 384 recipe) enlarged every
    shrunk photo's crops from the smaller copy without a word; at twice the largest photo or more
    (32 px PNGs under the default 256) the cache took 4-64x the memory for the same pixels. Both now
    warn, naming the way out; a cache_size that suits the photos, and the evaluation recipe (cached at
    its own size whatever cache_size is), say nothing. The largest photo here is 59 px."""
    import warnings

    src = ImageFolder(folders[0])

    def build(cache_size, size=32, **kw):
        return make_loader(src, "memory", batch_size=2, device="cpu", cache_size=cache_size,
                           augment=Augmentation(crop="random_resized", size=size), **kw)

    with pytest.warns(UserWarning, match=r"cache_size=24 is smaller than the crop size 32.*cache_size>=32") as w:
        build(24)
    assert w[0].filename == __file__                                 # the caller's line
    with pytest.warns(UserWarning, match=r"largest photo .* is 59 px.*cache_size=256.*pass cache_size=59"):
        build(256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(32)
        build(59, size=64)            # under the crop, but no photo was shrunk: nothing to gain
        build(117)                    # under twice the largest photo
        make_loader(src, "memory", batch_size=2, device="cpu", cache_size=8, train=False, augment=EVAL)


def test_budget_takes_a_device_as_make_loader_does(monkeypatch):
    """budget("cpu") failed with "'str' object has no attribute 'type'", and budget(torch.device("cuda"))
    left out the caches living on cuda:0 (a loader's device is always indexed)."""
    from fastdata.backends import memory
    from fastdata.datasets import SyntheticDigits

    loader = make_loader(SyntheticDigits(n=64), "memory", batch_size=16, device="cpu",
                         augment=Augmentation.digits_train())
    assert memory.budget("cpu").live == memory.budget(torch.device("cpu")).live == loader.footprint > 0
    # An unindexed CUDA device, on a stubbed GPU whose current device is 0, counts cuda:0's caches.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(memory.budgeting, "total_bytes", lambda d: 16 * 2**30)
    monkeypatch.setattr(memory.budgeting, "free_bytes", lambda d: 15 * 2**30)
    monkeypatch.setattr(loader, "device", torch.device("cuda", 0))
    assert memory.budget(torch.device("cuda")).live == memory.budget("cuda").live == loader.footprint


def _cgroup_tree(tmp_path, version: int, limits: dict[str, str], usage: int, inactive: int):
    """A fake /sys/fs/cgroup and /proc/self/cgroup: the process in cgroup /job/step, ``limits`` per
    directory ("" the mount, "job", "job/step")."""
    root = tmp_path / "cgroup"
    mount = root if version == 2 else root / "memory"
    limit_f, usage_f, key = (("memory.max", "memory.current", "inactive_file") if version == 2 else
                             ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    for rel in ("", "job", "job/step"):
        d = mount / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / limit_f).write_text(limits.get(rel, "max" if version == 2 else str(2**63 - 4096)) + "\n")
        (d / usage_f).write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"anon 1\n{key} {inactive}\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/job/step\n" if version == 2 else "5:cpu:/\n4:memory:/job/step\n")
    return str(root), str(proc)


@pytest.mark.parametrize("version", [1, 2])
def test_a_memory_cgroup_limit_caps_the_host_budget(tmp_path, monkeypatch, version):
    """/proc/meminfo shows the host's RAM: under a container's or a job's memory limit the budget let
    through caches the kernel then killed the process for (SIGKILL while the cache was built, no
    message). The room the cgroup leaves (limit - usage + inactive file pages, the tightest of the
    cgroup and its parents) now caps the host budget."""
    from fastdata import host_memory
    from fastdata.backends.memory import budgeting, check_fits
    from fastdata.config import LoaderConfig
    from fastdata.datasets import SyntheticDigits
    from fastdata.errors import CacheDoesNotFit

    mib = 2**20
    root, proc = _cgroup_tree(tmp_path, version, {"job": str(1024 * mib), "job/step": str(4096 * mib)},
                              usage=600 * mib, inactive=100 * mib)
    assert budgeting.cgroup_room(root, proc) == 524 * mib           # the parent's 1 GiB is the tighter
    unlimited = _cgroup_tree(tmp_path / "none", version, {}, usage=600 * mib, inactive=0)
    assert budgeting.cgroup_room(*unlimited) is None
    assert budgeting.cgroup_room(str(tmp_path / "no-cgroup-fs"), str(tmp_path / "no-proc")) is None

    monkeypatch.setattr(host_memory, "cgroup_room", lambda: mib)
    assert budgeting.available_ram() == mib
    src = SyntheticDigits(n=2048)                                   # 2 MiB padded uint8 cache
    with pytest.raises(CacheDoesNotFit, match="host RAM allows"):
        check_fits(src, LoaderConfig(device="cpu", batch_size=64))
