"""QA pass over evaluation and inference as users run them: every sample once, in a stable order, each
row of a batch mapped to its sample (``loader.batch_ids``) on every backend, with skipped files, two
ranks with padding and a resumed pass; and ``evaluate``'s own checks."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from torch import nn

from conftest import backend_params, decode_ids, indexed_source
from fastdata import Augmentation, evaluate, make_loader
from fastdata.datasets import ImageFolder
from fastdata.datasets.folders import make_image_folder

EVAL = Augmentation(crop="center", size=24, resize=28)


def _loader(source, backend, **kw):
    kw = {"batch_size": 16, "device": "cpu", "num_workers": 1, "train": False, **kw}
    return make_loader(source, backend, **kw)


def _pass(loader):
    """[(decoded ids of the rows, loader.batch_ids)] of one pass."""
    return [(decode_ids(x), loader.batch_ids.copy()) for x, _ in loader]


@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_each_row_is_named_by_batch_ids_once_in_a_stable_order(backend):
    """A user writing (file, prediction) rows had only the planned ids (batch_sampler) to go by; each
    batch's rows now come with their samples' ids, and an evaluation pass reads every sample once, in
    the same order each pass, whatever set_epoch says."""
    loader = _loader(indexed_source(70), backend)
    assert len(loader.batch_ids) == 0 and not loader.drop_last and len(loader) == 5
    first = _pass(loader)
    for rows, ids in first:
        assert np.array_equal(rows, ids)
    assert np.array_equal(np.concatenate([ids for _, ids in first]), np.arange(70))
    assert [len(ids) for _, ids in first] == [16, 16, 16, 16, 6]
    loader.set_epoch(3)
    again = _pass(loader)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    with pytest.raises(ValueError, match="read-only"):
        loader.batch_ids[0] = 5   # the loader's own record: a copy is the caller's


@pytest.mark.parametrize("backend", backend_params())
def test_two_ranks_with_padding_cover_every_sample_once(backend):
    """Under even_batches the last batch's padding rows repeat the epoch's start: a loop of one's own drops
    the last loader.padding() rows of the last batch (as evaluate does), and the ranks' ids then cover
    every sample exactly once."""
    seen = []
    for rank in (0, 1):
        loader = _loader(indexed_source(71), backend, batch_size=8, rank=rank, world_size=2, even_batches=True)
        pad, last = loader.padding(), len(loader) - 1
        assert (rank, pad) in ((0, 0), (1, 1))
        for k, (x, _) in enumerate(loader):
            ids = loader.batch_ids
            assert np.array_equal(decode_ids(x), ids)
            assert loader.batch_padding == (pad if k == last else 0)
            seen.append(ids[:len(ids) - loader.batch_padding])
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(71))


@pytest.mark.parametrize("backend", backend_params())
def test_a_resumed_pass_names_its_rows(backend):
    source = indexed_source(70)
    loader = _loader(source, backend)
    it = iter(loader)
    head = [loader.batch_ids.copy() for _ in zip(range(2), it)]
    state = loader.state_dict()
    resumed = _loader(source, backend)
    resumed.load_state_dict(state)
    rest = _pass(resumed)
    assert all(np.array_equal(rows, ids) for rows, ids in rest)
    assert np.array_equal(np.concatenate(head + [ids for _, ids in rest]), np.arange(70))


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """12 photos of 12 classes (a label names its photo), and one undecodable file in class 4."""
    root = make_image_folder(tmp_path_factory.mktemp("photos"), classes=12, per_class=1, seed=2,
                             size_range=((40, 60), (30, 50)))
    (root / "class_004" / "img_00000b.jpg").write_bytes(b"not a jpeg")
    return root


@pytest.mark.parametrize("backend", backend_params())
def test_skipped_files_are_named_and_the_rows_stay_mapped(backend, broken):
    """on_error='skip' made a batch shorter than its planned ids (torch, prefetch, dali) or re-planned the
    memory backend over the files it kept, whose batch_sampler then gave positions among them, not the
    folder's ids: a CSV written from them put predictions against the wrong files. The warning counted
    the skipped files without naming one."""
    source = ImageFolder(broken)
    bad = [i for i in range(len(source)) if source.sample_name(i).endswith("img_00000b.jpg")]
    loader = _loader(source, backend, batch_size=4, augment=EVAL, on_error="skip")
    planned = np.concatenate(list(loader.batch_sampler))
    assert sorted(planned.tolist()) == [i for i in range(len(source)) if i not in bad or backend != "memory"]
    ids = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _, labels in loader:
            assert np.array_equal(labels.numpy(), source.labels[loader.batch_ids])
            ids.append(loader.batch_ids)
    assert sorted(np.concatenate(ids).tolist()) == [i for i in range(len(source)) if i not in bad]
    assert loader.skipped_ids.tolist() == bad and loader.skipped == 1
    assert source.sample_name(int(loader.skipped_ids[0])).endswith("class_004/img_00000b.jpg")


def test_evaluate_names_both_devices_when_the_model_is_elsewhere():
    """A model on another device than the loader failed inside its first layer with torch's "Tensor on
    device meta is not on the expected device cpu!"; fit names both devices, and now evaluate too."""
    loader = _loader(indexed_source(20), "torch", num_workers=0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).to("meta")
    with pytest.raises(ValueError, match="model is on meta.*evaluation loader yields batches on cpu"):
        evaluate(model, loader)
    # A model split over devices with a part on the loader's (model parallel) is the caller's design.
    split = nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.Linear(10, 10).to("meta"))
    with pytest.raises(RuntimeError, match="meta"):   # meta cannot compute: what matters is no ValueError
        evaluate(split, loader)



@pytest.fixture(scope="module")
def first_broken(tmp_path_factory):
    """7 photos whose first (the sample even_batches repeats as padding) does not decode."""
    root = make_image_folder(tmp_path_factory.mktemp("first"), classes=1, per_class=7, seed=3,
                             size_range=((40, 60), (30, 50)))
    (root / "class_000" / "img_00000.jpg").write_bytes(b"not a jpeg")
    return root


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_skipped_padding_sample_does_not_cost_a_real_one(backend, first_broken):
    """Rank 1's last batch was planned as [4, 5, 6] + padding [0]; 0 does not decode, so the batch came out
    [4, 5, 6] and evaluate cut padding()'s one row off it: sample 6 was never counted (5 of the 6
    decodable photos over the ranks, on torch, prefetch and dali). Rows that are padding are now those
    the batch holds (batch_padding)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 24 * 24, 2))
    counted, named = 0, []
    for rank in (0, 1):
        loader = _loader(ImageFolder(first_broken), backend, batch_size=4, augment=EVAL, on_error="skip",
                         rank=rank, world_size=2, even_batches=True)
        counted += evaluate(model, loader)["samples"]
        for _ in loader:
            named.extend(loader.batch_ids[:len(loader.batch_ids) - loader.batch_padding].tolist())
    assert counted == 6 and sorted(named) == [1, 2, 3, 4, 5, 6]



def test_a_bf16_loader_on_the_cpu_tells_the_evaluate_caller_what_to_pass():
    """evaluate(model, bf16 loader) with amp's default (off on the CPU) said "pass amp='bf16' to fit" to a
    caller of evaluate; the hint now names both, and amp='bf16' evaluates the float32 model."""
    loader = _loader(indexed_source(20), "torch", num_workers=0, dtype="bf16")
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with pytest.raises(TypeError, match=r"pass amp='bf16' to fit or evaluate"):
        evaluate(model, loader)
    assert evaluate(model, loader, amp="bf16")["samples"] == 20


def test_a_pass_left_during_a_slow_batch_does_not_shift_the_next_ones_ids(monkeypatch):
    """prefetch's producer thread, still waiting for a slow batch when the consumer broke out of the pass,
    recorded that batch's ids after the next pass had begun: every row of the next pass was then named
    by the batch before it."""
    import threading
    import time

    from fastdata.decode import BatchDecoder

    slow = threading.Event()
    original = BatchDecoder.__getitem__

    def getitem(self, job):
        if slow.is_set():
            slow.clear()
            time.sleep(1.0)   # longer than the consumer's 0.5 s wait for the producer on a break
        return original(self, job)

    monkeypatch.setattr(BatchDecoder, "__getitem__", getitem)
    loader = _loader(indexed_source(64), "prefetch", num_workers=0, depth=1)
    it = iter(loader)
    next(it)
    slow.set()
    time.sleep(0.2)   # the producer is inside the slow batch
    it.close()
    rows = _pass(loader)
    assert all(np.array_equal(decoded, ids) for decoded, ids in rows)


def _simple_backend():
    from conftest import load_example

    return load_example("custom_backend").SimpleLoader


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_example_backend_names_its_rows_with_skipped_files(broken):
    """examples/custom_backend.py, the model of a backend of one's own, records the samples each batch
    keeps, so its rows are named right when on_error='skip' drops a file."""
    from fastdata.config import LoaderConfig

    source = ImageFolder(broken)
    loader = _simple_backend()(source, LoaderConfig(batch_size=4, device="cpu", train=False, augment=EVAL,
                                                     on_error="skip"))
    for _, labels in loader:
        assert np.array_equal(labels.numpy(), source.labels[loader.batch_ids])
    assert [source.sample_name(int(i)).split("/")[-1] for i in loader.skipped_ids] == ["img_00000b.jpg"]


def test_a_backend_that_drops_samples_without_saying_which_is_named():
    """A backend of one's own that yields fewer rows than the batch's ids and records nothing: batch_ids
    would have named the rows by the planned ids, off by one from the dropped sample on. Reading them is
    now an error naming the backend and what to call."""
    from fastdata.config import LoaderConfig

    class Dropping(_simple_backend()):
        name = "dropping"

        def _epoch(self, epoch, batches, start):
            for images, labels in super()._epoch(epoch, batches, start):
                yield images[1:], labels[1:]

        def ids_keeper(self):
            return lambda ids: None

    loader = Dropping(indexed_source(20), LoaderConfig(batch_size=8, device="cpu", train=False))
    next(iter(loader))
    with pytest.raises(RuntimeError, match=r"backend 'dropping' yielded a batch of 7 rows for 8 sample ids.*"
                                           r"self\.ids_keeper\(\)"):
        _ = loader.batch_ids


def test_a_keeper_told_none_names_the_batch_by_its_planned_ids():
    """ids_keeper(None) says a batch holds its planned samples (the dali backend says so for every batch
    that lost no file: no numpy call per batch); batches recorded with ids between such batches keep
    their own ids, in order, and a short batch recorded as None is still refused when read."""
    from fastdata.config import LoaderConfig

    class Saying(_simple_backend()):
        name = "saying"

        def _epoch(self, epoch, batches, start):
            keep = super().ids_keeper()
            for k, (images, labels) in enumerate(super()._epoch(epoch, batches, start)):
                if k == 1:   # drops its first sample, and says which it kept
                    keep(self.source_ids(batches[k][1:]))
                    yield images[1:], labels[1:]
                else:
                    keep(None)
                    yield (images[1:], labels[1:]) if k == 3 else (images, labels)

        def ids_keeper(self):
            return lambda ids: None

    source = indexed_source(32)
    loader = Saying(source, LoaderConfig(batch_size=8, device="cpu", train=False))
    planned = [loader.source_ids(b) for b in loader.plan.batches_from(0, 0)]
    for k, (_, labels) in enumerate(loader):
        if k == 3:
            with pytest.raises(RuntimeError, match="yielded a batch of 7 rows for 8 sample ids"):
                _ = loader.batch_ids
            continue
        expect = planned[k][1:] if k == 1 else planned[k]
        assert np.array_equal(loader.batch_ids, expect) and np.array_equal(labels.numpy(), source.labels[expect])


@pytest.mark.parametrize("backend", backend_params())
def test_batch_ids_index_the_subset_read(backend):
    """With indices= the loader reads a subset (loader.dataset): its ids index that, as documented."""
    indices = np.arange(40)[::-3]
    loader = _loader(indexed_source(40), backend, batch_size=4, indices=indices)
    rows = _pass(loader)
    assert all(np.array_equal(decoded, indices[ids]) for decoded, ids in rows)
    assert sorted(np.concatenate([ids for _, ids in rows]).tolist()) == list(range(len(indices)))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_on_the_gpu_rows_are_named_and_a_cpu_model_is_refused(backend, broken):
    """On CUDA: batch_ids name the rows (prefetch's side stream, DALI's GPU pipeline, memory's device
    cache), skipped files included; evaluate names both devices for a model left on the CPU."""
    loader = _loader(indexed_source(70), backend, device="cuda")
    rows = _pass(loader)
    assert all(np.array_equal(decoded, ids) for decoded, ids in rows)
    assert np.array_equal(np.concatenate([ids for _, ids in rows]), np.arange(70))
    source = ImageFolder(broken)
    skipping = _loader(source, backend, device="cuda", batch_size=4, augment=EVAL, on_error="skip")
    for _, labels in skipping:
        assert np.array_equal(labels.cpu().numpy(), source.labels[skipping.batch_ids])
    assert skipping.skipped_ids.tolist() == [i for i in range(len(source))
                                             if source.sample_name(i).endswith("img_00000b.jpg")]
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with pytest.raises(ValueError, match=r"model is on cpu but the evaluation loader yields batches on cuda:\d"):
        evaluate(model, loader)
    assert evaluate(model.to(loader.device), loader)["samples"] == 70


@pytest.mark.requires("lightning")
def test_lightning_predict_steps_see_their_own_batch_ids(tmp_path):
    """Lightning's predict loop does not fetch ahead of a loader with a len(), so loader.batch_ids read in
    predict_step name that step's rows, as docs/contract.md says."""
    from conftest import optional

    L = optional("lightning")
    loader = _loader(indexed_source(40), "prefetch", batch_size=8)

    class Predictor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(1, 1)

        def predict_step(self, batch, batch_idx):
            return decode_ids(batch[0]), loader.batch_ids.copy()

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    out = trainer.predict(Predictor(), dataloaders=loader)
    assert len(out) == 5 and all(np.array_equal(rows, ids) for rows, ids in out)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_resumed_pass_with_skipped_files_names_its_rows(backend, broken):
    """After load_state_dict the rest of the pass is named by the folder's ids, the memory backend's
    positions among its kept files included."""
    source = ImageFolder(broken)
    loader = _loader(source, backend, batch_size=4, augment=EVAL, on_error="skip")
    it = iter(loader)
    next(it)
    head = loader.batch_ids.copy()
    resumed = _loader(source, backend, batch_size=4, augment=EVAL, on_error="skip")
    resumed.load_state_dict(loader.state_dict())
    rest = []
    for _, labels in resumed:
        assert np.array_equal(labels.numpy(), source.labels[resumed.batch_ids])
        rest.append(resumed.batch_ids.copy())
    bad = [i for i in range(len(source)) if source.sample_name(i).endswith("img_00000b.jpg")]
    assert sorted(np.concatenate([head, *rest]).tolist()) == [i for i in range(len(source)) if i not in bad]
