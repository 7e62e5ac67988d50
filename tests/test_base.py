"""The base loader's share of the contract: superseded iterators, positions, resume checks."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import procs
from conftest import CONCRETE, decode_ids, indexed_source, require, skip_missing
from fastdata import Augmentation, make_loader
from fastdata.datasets import ArraySource, DatasetSource, ImageFolder, make_image_folder

NONE = Augmentation.none()


def _loader(backend, src=None, **kw):
    kw = {"batch_size": 20, "device": "cpu", "train": False, "num_workers": 2, **kw}
    return make_loader(src if src is not None else indexed_source(200), backend, **kw)


def _prefetch_threads() -> int:
    return sum(t.name == "fastdata-prefetch" for t in threading.enumerate())


# ---------------------------------------------------------------- a second iter() while an epoch runs
@pytest.mark.parametrize("backend", CONCRETE)
def test_a_new_iter_supersedes_the_running_epoch(backend):
    loader = _loader(backend)
    assert len(loader) == 10
    first = iter(loader)
    for _ in range(3):
        next(first)
    second = iter(loader)  # the unfinished epoch 0 is read again, from its start
    ids = [decode_ids(x) for x, _ in second]
    assert len(ids) == len(loader)  # exactly one epoch: not 12 batches, no missing ones
    np.testing.assert_array_equal(np.concatenate(ids), np.arange(200))
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        next(first)
    with pytest.raises(RuntimeError, match="superseded"):
        next(first)  # stays an error, never a batch of another epoch
    # The loader goes on working: the next epoch is complete too.
    assert np.array_equal(np.concatenate([decode_ids(x) for x, _ in loader]), np.arange(200))
    assert loader.epoch == 2  # two passes ran to their end; the one left early did not count
    loader.close()


@pytest.mark.parametrize("backend", CONCRETE)
def test_a_peek_does_not_change_the_run(backend):
    kw = dict(shuffle=True, seed=1, augment=Augmentation(crop="translate", pad=2, hflip=0.5))
    plain = _loader(backend, **kw)
    want = [[(x.clone(), y.clone()) for x, y in plain] for _ in range(2)]
    loader = _loader(backend, **kw)
    images, labels = next(iter(loader))  # a peek, dropped at once
    assert images.shape[0] == 20
    assert procs.wait_until(lambda: _prefetch_threads() == 0, 10)  # the peek's thread is gone
    assert loader.epoch == 0
    torch.testing.assert_close(images, want[0][0][0], rtol=0, atol=0)  # it showed the coming batch
    for epoch in range(2):
        got = list(loader)
        assert len(got) == len(want[epoch])
        for (x, y), (wx, wy) in zip(got, want[epoch]):
            torch.testing.assert_close(x, wx, rtol=0, atol=0)
            torch.testing.assert_close(y, wy, rtol=0, atol=0)
    assert loader.state_dict()["epoch"] == 2
    loader.close()
    plain.close()


def test_superseding_a_prefetch_epoch_ends_its_thread():
    loader = _loader("prefetch")
    first = iter(loader)
    next(first)
    assert _prefetch_threads() == 1
    second = iter(loader)
    next(second)
    assert _prefetch_threads() == 1  # the first epoch's producer was stopped before the second began
    second.close()
    assert procs.wait_until(lambda: _prefetch_threads() == 0, 10)
    del first
    loader.close()


# ---------------------------------------------------------------- set_epoch and the saved position
@pytest.mark.parametrize("backend", ["memory", "torch"])
def test_set_epoch_then_state_dict_resumes_in_that_epoch(backend):
    kw = dict(train=True, augment=NONE, num_workers=0, seed=4)
    a = _loader(backend, **kw)
    list(a)  # epoch 0 done
    a.set_epoch(3)
    state = a.state_dict()
    assert (state["epoch"], state["batch"]) == (3, 0)
    b = _loader(backend, **kw)
    b.load_state_dict(state)
    got = [decode_ids(x) for x, _ in b]
    want = [decode_ids(x) for x, _ in a]  # a's epoch 3
    assert len(got) == len(want) == len(a)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_set_epoch_checks_its_argument():
    loader = _loader("memory", num_workers=0)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises((TypeError, ValueError), match="epoch"):
            loader.set_epoch(bad)


# ---------------------------------------------------------------- load_state_dict validates every key
KEYS = ["epoch", "batch", "seed", "batch_size", "world_size", "num_samples", "shuffle", "drop_last", "source"]


@pytest.mark.parametrize("key", KEYS)
def test_a_state_without_a_key_is_refused_naming_it(key):
    loader = _loader("memory", num_workers=0)
    state = loader.state_dict()
    assert set(state) == {*KEYS, "samples", "format"}
    del state[key]
    with pytest.raises(ValueError, match=f"no '{key}' key"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("key, bad", [
    ("epoch", -1), ("epoch", 1.0), ("epoch", "1"), ("epoch", True), ("epoch", None),
    ("batch", 2.5), ("batch", -1), ("batch", 11), ("batch", "3"), ("batch", False),
    ("seed", 0.0), ("batch_size", "20"), ("world_size", 1.0), ("num_samples", 200.0),
    ("shuffle", 0), ("drop_last", "False"), ("source", 123),
    ("samples", -1), ("samples", 201), ("samples", 2.5), ("batch_size", 0),
])
def test_a_state_value_of_the_wrong_type_or_range_is_refused_naming_the_key(key, bad):
    loader = _loader("memory", num_workers=0)
    state = {**loader.state_dict(), key: bad}
    with pytest.raises((TypeError, ValueError), match=f"'{key}'"):
        loader.load_state_dict(state)
    assert loader.state_dict()["epoch"] == 0  # nothing was applied


def test_a_state_written_before_elastic_resume_still_resumes_at_its_batch():
    a = _loader("memory", num_workers=0, augment=NONE, seed=3)
    it = iter(a)
    want = [decode_ids(x) for x, _ in it]
    state = {**a.state_dict(), "epoch": 0, "batch": 4}
    del state["samples"], state["format"]  # the format of earlier versions: neither key
    b = _loader("memory", num_workers=0, augment=NONE, seed=3)
    b.load_state_dict(state)
    assert b.state_dict()["samples"] == 4 * 20
    got = [decode_ids(x) for x, _ in b]
    assert len(got) == len(want) - 4
    for g, w in zip(got, want[4:]):
        np.testing.assert_array_equal(g, w)


def test_a_state_says_its_format_and_round_trips_it():
    a = _loader("memory", num_workers=0)
    state = a.state_dict()
    assert state["format"] == type(a).STATE_FORMAT == 2
    b = _loader("memory", num_workers=0)
    b.load_state_dict(state)
    assert b.state_dict() == state


def test_a_state_without_a_format_is_read_as_the_version_before_the_key():
    """States saved before the key existed (tests/test_qa_upgrade.py's fixtures too) resume as before."""
    a = _loader("memory", num_workers=0, augment=NONE, seed=3)
    it = iter(a)
    want = [decode_ids(x) for x, _ in it]
    state = {k: v for k, v in {**a.state_dict(), "epoch": 0, "batch": 3, "samples": 60}.items() if k != "format"}
    b = _loader("memory", num_workers=0, augment=NONE, seed=3)
    b.load_state_dict(state)
    assert b.state_dict() == {**state, "format": 2}
    got = [decode_ids(x) for x, _ in b]
    assert len(got) == len(want) - 3 and all(np.array_equal(g, w) for g, w in zip(got, want[3:]))


@pytest.mark.parametrize("saved", [3, 99, 10 ** 5000], ids=["3", "99", "5001-digits"])
def test_a_state_of_a_newer_format_is_refused_naming_both_formats(saved):
    """A newer fastdata's keys may mean another position: refused before any of them is read (a newer
    format need not even hold today's keys), naming both formats and what to do."""
    loader = _loader("memory", num_workers=0)
    newer = {"format": saved, "epoch": 1, "position": 7}
    shown = str(saved) if saved < 10 ** 18 else "bit number"
    with pytest.raises(ValueError, match=rf"'format' is .*{shown}.*newer fastdata.*formats 1 to 2.*Upgrade fastdata"):
        loader.load_state_dict(newer)
    with pytest.raises(ValueError, match=rf"'format' is .*{shown}.*newer"):
        loader.load_state_dict({**loader.state_dict(), "format": saved})
    assert loader.state_dict()["epoch"] == 0  # nothing was applied


@pytest.mark.parametrize("bad", ["2", 2.0, True, None, [2]])
def test_a_format_that_is_not_an_int_is_refused_naming_the_key(bad):
    loader = _loader("memory", num_workers=0)
    with pytest.raises(TypeError, match="loader state 'format' must be int"):
        loader.load_state_dict({**loader.state_dict(), "format": bad})


@pytest.mark.parametrize("bad", [0, -1])
def test_a_format_below_the_first_is_refused_naming_the_key(bad):
    loader = _loader("memory", num_workers=0)
    with pytest.raises(ValueError, match=f"'format' is out of range: {bad}"):
        loader.load_state_dict({**loader.state_dict(), "format": bad})


def test_a_state_of_this_format_without_samples_is_refused():
    """Only a state without ``format`` (written before it) may lack ``samples``: one that says format 2
    and has no ``samples`` was not written by state_dict(), and ``batch`` alone is not its position."""
    loader = _loader("memory", num_workers=0)
    state = loader.state_dict()
    del state["samples"]
    with pytest.raises(ValueError, match="no 'samples' key"):
        loader.load_state_dict(state)
    loader.load_state_dict({**state, "format": 1})   # format 1: batch alone, as before elastic resume


def test_a_state_that_is_not_a_dict_is_refused():
    with pytest.raises(TypeError, match="state must be the dict"):
        _loader("memory", num_workers=0).load_state_dict([("epoch", 0)])


def test_a_state_survives_a_weights_only_checkpoint(tmp_path):
    a = _loader("memory", num_workers=0, train=True, augment=NONE)
    it = iter(a)
    next(it), next(it)
    torch.save({"loader": a.state_dict()}, tmp_path / "c.pt")
    b = _loader("memory", num_workers=0, train=True, augment=NONE)
    b.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True)["loader"])
    assert len(list(b)) == len(b) - 2


# ---------------------------------------------------------------- resume refuses other data of the same size
def test_resume_refuses_another_array_of_the_same_size():
    a = _loader("memory", num_workers=0)
    state = a.state_dict()
    other = indexed_source(200)
    images = other.images.copy()
    images[-1, 3, 3] ^= 1  # one pixel of the last image (the fingerprint samples the first and last)
    labels = other.labels.copy()
    for changed in (ArraySource(images, other.labels, mean=other.mean, std=other.std),
                    ArraySource(other.images, np.roll(labels, 1), mean=other.mean, std=other.std)):
        with pytest.raises(ValueError, match="source was 'ArraySource n=200 image=8x8x1 crc=.*' and is now"):
            _loader("memory", changed, num_workers=0).load_state_dict(state)
    _loader("memory", indexed_source(200), num_workers=0).load_state_dict(state)  # the same data: fine


def test_resume_refuses_another_image_folder_of_the_same_size_but_not_a_copy(tmp_path):
    import shutil

    kw = dict(num_workers=0, augment=Augmentation(crop="center", size=16, resize=16), batch_size=2)
    first = make_image_folder(tmp_path / "a", classes=2, per_class=2, seed=0, size_range=((20, 24), (20, 24)))
    state = _loader("torch", ImageFolder(first), **kw).state_dict()
    assert state["source"].startswith("ImageFolder n=4 classes=2 files=")
    copy = shutil.copytree(first, tmp_path / "copy")  # another disk, new mtimes: the same data
    _loader("torch", ImageFolder(copy), **kw).load_state_dict(state)
    other = make_image_folder(tmp_path / "b", classes=2, per_class=2, seed=1, size_range=((20, 24), (20, 24)))
    with pytest.raises(ValueError, match="source was 'ImageFolder n=4 classes=2 files="):
        _loader("torch", ImageFolder(other), **kw).load_state_dict(state)
    renamed = shutil.copytree(first, tmp_path / "renamed")
    (renamed / "class_000" / "img_00000.jpg").rename(renamed / "class_000" / "img_00009.jpg")
    with pytest.raises(ValueError, match="source was"):
        _loader("torch", ImageFolder(renamed), **kw).load_state_dict(state)


def test_resume_refuses_another_torch_dataset_of_the_same_size():
    class Grey(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.full((1, 8, 8), i, dtype=torch.uint8), i % 10

    class Other(Grey):
        pass

    kw = dict(num_workers=0, augment=NONE)
    state = _loader("torch", DatasetSource(Grey()), **kw).state_dict()
    _loader("torch", DatasetSource(Grey()), **kw).load_state_dict(state)
    with pytest.raises(ValueError, match="source was '.*Grey n=40' and is now '.*Other n=40'"):
        _loader("torch", DatasetSource(Other()), **kw).load_state_dict(state)


@pytest.mark.parametrize("field, bad", [("mean", float("nan")), ("std", float("inf")), ("std", 0.0),
                                        ("mean", "0.5")])
def test_non_finite_statistics_of_a_source_are_refused_naming_them(field, bad):
    src = indexed_source(40)
    stats = {"mean": src.mean, "std": src.std, field: (bad,)}
    bad_src = ArraySource(src.images, src.labels, **stats)
    with pytest.raises((TypeError, ValueError), match=field):
        _loader("memory", bad_src, num_workers=0)
    with pytest.raises((TypeError, ValueError), match=field):  # the same through make_loader's keywords
        _loader("memory", src, num_workers=0, **{field: bad})


def test_a_finished_or_closed_iterator_keeps_ending_after_a_new_iter():
    loader = _loader("memory", num_workers=0)
    done = iter(loader)
    assert len(list(done)) == len(loader)
    stopped = iter(loader)
    next(stopped)
    stopped.close()
    fresh = iter(loader)
    assert next(done, None) is None and next(stopped, None) is None  # StopIteration, not "superseded"
    assert len(list(fresh)) == len(loader)


def test_each_backend_declares_the_source_kinds_it_reads_and_fits_says_why():
    from fastdata.backends.base import Loader
    from fastdata.backends.memory import MemoryLoader
    from fastdata.backends.torch_loader import TorchLoader
    from fastdata.config import LoaderConfig
    from fastdata.datasets import SourceKind

    cfg = LoaderConfig(device="cpu", num_workers=0)
    dataset = DatasetSource(torch.utils.data.TensorDataset(torch.zeros(4, 1, 1, dtype=torch.uint8),
                                                           torch.zeros(4, dtype=torch.int64)))
    assert SourceKind.DATASET in TorchLoader.reads and SourceKind.DATASET not in Loader.reads
    assert TorchLoader.fits(dataset, cfg)[0]
    ok, why = MemoryLoader.fits(dataset, cfg)
    # Said in the user's words (the "internal words" were "kind 'dataset'"), with the way out.
    assert not ok and "cannot read" in why and "map-style Dataset" in why and "torch" in why
    with pytest.raises(TypeError, match="cannot read"):   # __init__ enforces the same declaration
        MemoryLoader(dataset, cfg)


def test_memory_fits_weighs_the_cache_against_the_reserve_and_stable_leaves_out_free_memory(monkeypatch):
    from fastdata.backends import memory
    from fastdata.config import LoaderConfig

    src = indexed_source(40)
    cfg = LoaderConfig(device="cpu", num_workers=0, augment=Augmentation(crop="translate", pad=2))
    need = memory.cache_bytes(src, cfg)
    assert need > 0
    ok, why = memory.MemoryLoader.fits(src, cfg)
    assert ok and "fits" in why
    ok, why = memory.MemoryLoader.fits(src, cfg, {"memory_reserve": 10**18})
    assert not ok and "does not fit" in why
    # On a GPU the free memory caps the budget, but not under stable=True (equal on every rank).
    gib = 2**30
    monkeypatch.setattr(memory.budgeting, "total_bytes", lambda device: 8 * gib)
    monkeypatch.setattr(memory.budgeting, "free_bytes", lambda device: need - 1)
    gpu = LoaderConfig(device="cpu", num_workers=0, augment=cfg.augment)
    object.__setattr__(gpu, "device", torch.device("cuda", 0))   # no GPU here: only the budget is read
    assert not memory.MemoryLoader.fits(src, gpu)[0]
    assert memory.MemoryLoader.fits(src, gpu, stable=True)[0]


# ---------------------------------------------------------------- the DataLoader-shaped surface
def test_a_loader_answers_what_code_written_for_a_dataloader_asks(photo_folder):
    loader = _loader("memory", batch_size=20)
    assert len(loader.dataset) == 200 and loader.dataset is loader.source
    assert loader.batch_size == 20 and loader.num_classes == 10
    assert loader.classes == list(range(10))
    folder = make_loader(ImageFolder(photo_folder), "torch", batch_size=4, device="cpu", num_workers=0)
    assert folder.classes == ImageFolder(photo_folder).classes and len(folder.dataset) == len(folder.source)


@pytest.mark.parametrize("backend", CONCRETE)
def test_the_dataloader_attributes_are_plain_values_and_sampler_set_epoch_picks_the_order(backend):
    loader = make_loader(indexed_source(100), backend, batch_size=16, device="cpu", num_workers=0,
                         drop_last=False, augment=Augmentation.none(), seed=2)
    assert loader.drop_last is False and loader.num_workers == 0 and loader.pin_memory is False
    assert len(loader.sampler) == 100 and len(loader.batch_sampler) == len(loader) == 7
    assert loader.sampler.num_replicas == 1 and loader.sampler.rank == 0 and loader.sampler.shuffle
    assert loader.batch_sampler.batch_size == 16 and loader.batch_sampler.sampler.seed == 2
    # The sampler lists the coming pass's samples, in its order.
    listed = list(loader.sampler)
    np.testing.assert_array_equal(np.concatenate([decode_ids(x) for x, _ in loader]), listed)
    # The standard DDP loop: sampler.set_epoch(e) before each epoch reads epoch e.
    loader.sampler.set_epoch(4)
    assert loader.epoch == 4 and loader.sampler.epoch == 4
    e4 = np.concatenate([decode_ids(x) for x, _ in loader])
    other = make_loader(indexed_source(100), backend, batch_size=16, device="cpu", num_workers=0,
                        drop_last=False, augment=Augmentation.none(), seed=2)
    other.set_epoch(4)
    np.testing.assert_array_equal(np.concatenate([decode_ids(x) for x, _ in other]), e4)
    # A position restored in the middle of epoch e survives set_epoch(e), which Lightning calls at the
    # start of the resumed epoch; another epoch's set_epoch starts that epoch.
    other.set_epoch(2)
    it = iter(other)
    done = np.concatenate([decode_ids(next(it)[0]) for _ in range(3)])
    state = other.state_dict()
    resumed = make_loader(indexed_source(100), backend, batch_size=16, device="cpu", num_workers=0,
                          drop_last=False, augment=Augmentation.none(), seed=2)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)
    rest = [decode_ids(x) for x, _ in resumed]
    assert len(rest) == 4  # the 7 of the epoch less the 3 done
    rest = np.concatenate(rest)
    np.testing.assert_array_equal(np.sort(np.concatenate([done, rest])), np.arange(100))
    resumed.sampler.set_epoch(3)
    assert resumed.state_dict()["epoch"] == 3 and len(resumed) == 7


def test_accelerate_learns_the_end_of_a_pass_and_the_padding_to_drop():
    """accelerate's gather_for_metrics and accumulate() read GradientState, which only its own
    DataLoader wrappers feed: a fastdata loader tells it the end of the pass and the remainder."""
    require("accelerate")
    from accelerate.state import GradientState

    loader = make_loader(indexed_source(70), "memory", batch_size=16, device="cpu", train=False,
                         rank=0, world_size=2, even_batches=True, num_workers=0)
    state = GradientState()
    seen = []
    for x, _ in loader:
        seen.append((state.end_of_dataloader, state.remainder, len(x)))
    assert seen == [(False, 6, 16), (False, 6, 16), (True, 6, 3)]  # 70 = 2 steps of 32 + 6 real, split 3 + 3
    assert not state.in_dataloader  # the pass ended: accelerate no longer reads this loader


def test_a_loader_is_stateful_for_torch_and_lightning():
    from torch.distributed.checkpoint.stateful import Stateful

    loader = _loader("memory")
    assert isinstance(loader, Stateful)  # torch.distributed.checkpoint saves it as it is
    # Lightning saves a dataloader's position in its checkpoints when it passes this protocol check
    # (its fit loop tests isinstance(loader, _Stateful)).
    types = require("lightning.fabric.utilities.types")
    assert isinstance(loader, types._Stateful)


def test_the_package_ships_its_type_annotations():
    import importlib.resources

    assert importlib.resources.files("fastdata").joinpath("py.typed").is_file()


class _TransformedArrays(ArraySource):
    """An array source carrying a per-sample callable, as ImageFolder(transform=...) does."""

    sample_transform = staticmethod(lambda image: image)


@pytest.mark.parametrize("backend", ["memory", "dali"])
def test_backends_that_augment_whole_batches_refuse_a_per_sample_transform(backend):
    from fastdata import registry

    if not registry.spec(backend).available:
        skip_missing(registry.spec(backend).unavailable_reason)
    src = _TransformedArrays(np.zeros((16, 4, 4), np.uint8), np.arange(16) % 2)
    with pytest.raises(TypeError, match=f"backend '{backend}' cannot run the per-sample transform.*"
                                        r"batch_transforms=\[\.\.\.\].*'torch' or 'prefetch'"):
        make_loader(src, backend, batch_size=4, device="cpu")
    # auto does not pick them for it
    assert make_loader(src, "auto", batch_size=4, device="cpu", quiet=True).name in ("torch", "prefetch")


@pytest.mark.parametrize("takes_next", [True, False], ids=["next_order", "two_arguments"])
def test_a_stream_is_told_where_the_pass_is_from_its_start_to_its_end(takes_next):
    """``reading`` is called before the first batch (position 0), after each batch, and with the whole
    order once the last batch is out; a stream whose ``reading`` takes ``next_order`` also gets the next
    epoch's order, and one written with two arguments still works."""
    calls = []
    base = indexed_source(40)

    class Stream(type(base)):
        random_access = False

        if takes_next:
            def reading(self, order, position, next_order=None):
                calls.append((len(order), position, None if next_order is None else next_order()))
        else:
            def reading(self, order, position):
                calls.append((len(order), position, None))

    stream = Stream.__new__(Stream)
    stream.__dict__.update(base.__dict__)
    loader = make_loader(stream, "torch", batch_size=8, device="cpu", augment=Augmentation.none(), num_workers=0,
                         seed=3, drop_last=True)
    assert sum(1 for _ in loader) == 5
    assert [c[1] for c in calls] == [0, 8, 16, 24, 32, 40]
    assert all(c[0] == 40 for c in calls)
    if takes_next:
        np.testing.assert_array_equal(calls[-1][2], loader.plan.order(1))
        assert not np.array_equal(loader.plan.order(0), loader.plan.order(1))


# ---------------------------------------------------------------- labels handed to the device
def test_labels_reach_a_gpu_pinned_and_without_a_host_wait(monkeypatch):
    """labels_on (the dali backend's labels, known on the host): on a CUDA device the int64 labels are
    pinned in that device's context and copied non_blocking; a pageable copy made the H200's
    sync-debug test fail ("called a synchronizing CUDA operation"). On the CPU: a plain int64 tensor."""
    from fastdata.backends import base

    calls = []

    class Pinned:
        def __init__(self, t):
            self.t = t

        def to(self, device, non_blocking=False):
            calls.append(("to", str(device), non_blocking))
            return self.t

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or Pinned(t))

    class Context:
        def __init__(self, device):
            calls.append(("context", str(device)))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Context)
    got = base.labels_on(torch.device("cuda:1"), np.array([3, 1, 2], dtype=np.int32))
    assert calls == [("context", "cuda:1"), "pin", ("to", "cuda:1", True)]
    assert got.dtype == torch.int64 and got.tolist() == [3, 1, 2]
    calls.clear()
    got = base.labels_on(torch.device("cpu"), [[4], [5]])
    assert calls == [] and got.dtype == torch.int64 and got.tolist() == [4, 5]
