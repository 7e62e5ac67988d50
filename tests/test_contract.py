"""The batch contract, held against every backend by the same tests."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import BACKENDS as INSTALLED
from conftest import DEVICES, MEAN, STD, decode_ids, indexed_source, label_of, load_example, pairs
from fastdata import Augmentation, make_loader, registry
from fastdata.datasets import ImageFolder, SyntheticDigits

NONE = Augmentation.none()
# The built-in backends plus the "Writing a backend" example, held to the same contract.
BACKENDS = INSTALLED + ["simple"]


@pytest.fixture(scope="module", autouse=True)
def example_backend():
    """examples/custom_backend.py's SimpleLoader, registered for this module's tests only."""
    module = load_example("custom_backend")
    module.register()
    yield module.SimpleLoader
    registry.unregister("simple")


@pytest.fixture(scope="module")
def zip_source(tmp_path_factory):
    """examples/custom_source.py's ZipImages over a ZIP of 16x16 PNGs whose pixels encode their id (as
    indexed_source's; PNG keeps them exact), member ``c<label>/<id>.png``: the archive's order (by member
    name) is not the ids', so an order the loader took from anywhere but the source shows."""
    from PIL import Image

    module = load_example("custom_source")
    folder = tmp_path_factory.mktemp("zipped")
    n, size = 203, 16
    for i in range(n):
        pixels = np.tile(np.linspace(40, 200, size * size, dtype=np.uint8).reshape(size, size, 1), (1, 1, 3))
        pixels[0, 0], pixels[0, 1] = i % 256, i // 256
        (folder / f"c{label_of(i)}").mkdir(exist_ok=True)
        Image.fromarray(pixels).save(folder / f"c{label_of(i)}" / f"{i:05d}.png")
    src = module.ZipImages(module.zip_folder(folder, tmp_path_factory.mktemp("zip") / "data.zip"),
                           mean=MEAN * 3, std=STD * 3)
    src.ids = np.array([int(m.split("/")[1][:5]) for m in src.members])   # sample index -> encoded id
    return src


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_array_kind_source_without_its_pixels_is_refused_by_name(backend):
    """A source of kind ARRAY promises ``images`` and ``image_shape`` (datasets.base.ArrayPixels). One of
    one's own that declares the kind without them is refused when the loader is built, by every backend
    alike, naming what is missing; it was an AttributeError from whichever backend touched it first
    (memory: 'images', dali: 'image_shape')."""
    from fastdata.datasets import Source, SourceKind

    class NoPixels(Source):
        kind = SourceKind.ARRAY
        channels, num_classes, mean, std = 3, 2, (0.5,) * 3, (0.25,) * 3

        def __init__(self):
            self.labels = np.zeros(8, np.int64)

    refusal = "of kind 'array' but has no images and no image_shape.*ArrayPixels"
    with pytest.raises((TypeError, ValueError), match=refusal):
        make_loader(NoPixels(), backend, batch_size=4, device="cpu")


# A fixed-size crop of the whole 16x16 image: photos need one, and it keeps the encoded pixels exact.
WHOLE = Augmentation(crop="center", size=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_source_from_one_file_honours_the_contract_on_every_backend(backend, zip_source):
    """examples/custom_source.py (a new storage format as one Source subclass, no registration): every
    backend reads it through read()/sample_name() alone, with the contract's batches, order and resume."""
    kw = dict(device="cpu", augment=WHOLE, num_workers=2)
    loader = make_loader(zip_source, backend, batch_size=32, train=False, **kw)
    batches = [(x, y) for x, y in loader]
    assert len(batches) == len(loader) == 7   # ceil(203 / 32)
    for x, y in batches:
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape[1:] == (3, 16, 16)
        np.testing.assert_array_equal(y.numpy(), label_of(decode_ids(x)))
    seen = np.concatenate([decode_ids(x) for x, _ in batches])
    np.testing.assert_array_equal(seen, zip_source.ids)   # evaluation: the source's order, each once

    # Order: a new one each epoch, each covering every sample once, from the seed alone.
    kw.update(shuffle=True, drop_last=False, seed=3)
    a = make_loader(zip_source, backend, batch_size=32, **kw)
    e0, e1 = (np.concatenate([decode_ids(x) for x, _ in a]) for _ in range(2))
    for e in (e0, e1):
        np.testing.assert_array_equal(np.sort(e), np.arange(203))
    assert not np.array_equal(e0, e1) and not np.array_equal(e0, zip_source.ids)
    np.testing.assert_array_equal(np.concatenate([decode_ids(x) for x, _ in
                                                  make_loader(zip_source, backend, batch_size=32, **kw)]), e0)

    # Resume: a position saved after 3 batches of epoch 1 gives exactly the remaining batches.
    a.set_epoch(1)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    it.close()
    b = make_loader(zip_source, backend, batch_size=32, **kw)
    b.load_state_dict(state)
    rest = np.concatenate([decode_ids(x) for x, _ in b])
    np.testing.assert_array_equal(rest, e1[3 * 32:])


def epoch_ids(loader):
    batches = [(decode_ids(x), y.cpu().numpy()) for x, y in loader]
    return batches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_honour_the_contract(backend, device):
    src = indexed_source(1000)
    loader = make_loader(src, backend, batch_size=128, device=device, train=False, num_workers=2)
    assert len(loader) == 8  # ceil(1000 / 128): evaluation keeps the partial batch
    n_batches, seen = 0, []
    for images, labels in loader:
        n_batches += 1
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert images.device.type == device and labels.device.type == device
        assert images.shape[1:] == (1, 8, 8) and labels.shape == (images.shape[0],)
        ids = decode_ids(images)
        np.testing.assert_array_equal(labels.cpu().numpy(), label_of(ids))
        seen.append(ids)
    assert n_batches == len(loader)
    seen = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(seen), np.arange(1000))  # every sample exactly once
    np.testing.assert_array_equal(seen, np.arange(1000))             # evaluation: in order
    # The constant gradient part is normalized with the source's mean/std: values are exact.
    ref = (torch.linspace(40, 200, 64).to(torch.uint8).float().view(8, 8) / 255 - 0.5) / 0.25
    torch.testing.assert_close(images[0, 0, 1:].cpu(), ref[1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shuffled_epochs_cover_each_sample_once_and_follow_the_seed(backend):
    src = indexed_source(1000)
    kw = dict(batch_size=100, device="cpu", shuffle=True, drop_last=False, augment=NONE, num_workers=2, seed=3)
    a = make_loader(src, backend, **kw)
    e0 = np.concatenate([ids for ids, _ in epoch_ids(a)])
    e1 = np.concatenate([ids for ids, _ in epoch_ids(a)])
    for e in (e0, e1):
        np.testing.assert_array_equal(np.sort(e), np.arange(1000))
    assert not np.array_equal(e0, e1), "the next epoch must be a new order"
    assert not np.array_equal(e0, np.arange(1000)), "shuffle=True must shuffle"
    b = make_loader(src, backend, **kw)
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in epoch_ids(b)]), e0)  # same seed
    b.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate([ids for ids, _ in epoch_ids(b)]), e1)
    c = make_loader(src, backend, **{**kw, "seed": 4})
    assert not np.array_equal(np.concatenate([ids for ids, _ in epoch_ids(c)]), e0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_last_yields_full_batches_only(backend):
    loader = make_loader(indexed_source(1000), backend, batch_size=128, device="cpu", augment=NONE,
                         num_workers=0)
    assert loader.config.drop_last  # training default
    sizes = [len(y) for _, y in loader]
    assert sizes == [128] * 7 and len(loader) == 7


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_and_channels_last(backend, dtype):
    src = indexed_source(64, size=8, channels=3)
    loader = make_loader(src, backend, batch_size=32, device="cpu", dtype=dtype, channels_last=True,
                         augment=NONE, num_workers=0)
    images, _ = next(iter(loader))
    assert images.dtype == dtype and images.shape == (32, 3, 8, 8)
    assert images.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_continues_with_the_remaining_batches(backend):
    src = indexed_source(640)
    kw = dict(batch_size=64, device="cpu", seed=5, num_workers=2)
    full = make_loader(src, backend, **kw)
    reference = [decode_ids(x) for x, _ in full]           # epoch 0, uninterrupted (training aug on)
    for k in (0, 1, 4, len(full) - 1):
        a = make_loader(src, backend, **kw)
        it = iter(a)
        for _ in range(k):
            next(it)
        state = a.state_dict()
        assert (state["epoch"], state["batch"]) == (0, k)
        b = make_loader(src, backend, **kw)
        b.load_state_dict(state)
        rest = [decode_ids(x) for x, _ in b]
        assert len(rest) == len(full) - k
        for got, want in zip(rest, reference[k:]):
            np.testing.assert_array_equal(got, want)
    # a finished epoch saves as the start of the next one
    assert full.state_dict()["epoch"] == 1 and full.state_dict()["batch"] == 0


def _shard(src, backend, world, batch_size, **kw):
    return [make_loader(src, backend, batch_size=batch_size, device="cpu", num_workers=0, rank=r,
                        world_size=world, augment=NONE, seed=5, **kw) for r in range(world)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new_world, new_batch", [(1, 16), (3, 16), (2, 24), (3, 7)])
def test_an_epoch_resumed_on_another_world_size_reads_every_sample_once(backend, new_world, new_batch):
    # Elastic resume: 2 ranks read 3 steps of epoch 1 and save; the job comes back on new_world ranks
    # (and maybe another batch size). The union over the epoch is the dataset, once.
    src = indexed_source(203)
    old = _shard(src, backend, 2, 16, drop_last=False)
    seen = []
    for loader in old:
        loader.set_epoch(1)
        it = iter(loader)
        seen += [decode_ids(next(it)[0]) for _ in range(3)]
        it.close()
    states = [loader.state_dict() for loader in old]
    assert {s["samples"] for s in states} == {3 * 16 * 2} and states[0]["epoch"] == 1
    new = _shard(src, backend, new_world, new_batch, drop_last=False)
    counts = []
    for loader in new:
        loader.load_state_dict(states[0])  # rank 0's state: every rank saved the same position
        batches = [decode_ids(x) for x, _ in loader]
        counts.append(len(batches))
        seen += batches
    assert len(set(counts)) == 1, f"ranks run different numbers of steps: {counts}"
    ids = np.concatenate(seen)
    assert len(ids) == 203 and np.array_equal(np.sort(ids), np.arange(203)), "not every sample exactly once"
    # and a further epoch on the new layout is a normal, whole one
    assert new[0].epoch == 2 and len(list(new[0])) == len(new[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_under_the_same_layout_is_exact_and_a_different_order_is_refused(backend):
    src = indexed_source(640)
    kw = dict(batch_size=64, device="cpu", num_workers=0)
    whole = [(x, y) for x, y in make_loader(src, backend, **kw)]   # epoch 0 uninterrupted, training aug on
    a = make_loader(src, backend, **kw)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    # The same layout: the rest of the epoch, exactly (pixels, augmentation and labels), then epoch 1.
    same = make_loader(src, backend, **kw)
    same.load_state_dict(state)
    for (x, y), (wx, wy) in pairs(same, whole[3:]):
        assert torch.equal(x, wx) and torch.equal(y, wy)
    assert same.state_dict()["epoch"] == 1
    with pytest.raises(ValueError, match="seed was 0 and is now 1"):
        make_loader(src, backend, batch_size=64, device="cpu", num_workers=0, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="drop_last was True and is now False"):
        make_loader(src, backend, batch_size=64, device="cpu", num_workers=0,
                    drop_last=False).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples was 640 and is now 600"):
        make_loader(indexed_source(600), backend, batch_size=64, device="cpu",
                    num_workers=0).load_state_dict(state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_shards_are_disjoint_covering_and_equal_in_length(backend, world, drop_last):
    n = 1000
    per_rank = []
    for rank in range(world):
        loader = make_loader(indexed_source(n), backend, batch_size=64, device="cpu", augment=NONE,
                             drop_last=drop_last, rank=rank, world_size=world, num_workers=0, seed=1)
        batches = [decode_ids(x) for x, _ in loader]
        assert len(batches) == len(loader)
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1, "every rank must run the same number of steps"
    ids = np.concatenate([np.concatenate(b) for b in per_rank])
    assert len(ids) == len(set(ids.tolist())), "shards overlap"
    if drop_last:
        assert len(ids) == (n // (64 * world)) * 64 * world
    else:
        np.testing.assert_array_equal(np.sort(ids), np.arange(n))


def mean_image(loader, epochs=1):
    total, count = 0.0, 0
    for _ in range(epochs):
        for x, _ in loader:
            total = total + x.float().sum(0)
            count += len(x)
    return total / count


def test_augmentation_statistics_agree_across_backends():
    """Digit translation: each backend's average augmented image matches the others' far better than it
    matches the unaugmented average (which a missing or different augmentation would match)."""
    src = SyntheticDigits(3000, seed=2)
    plain = mean_image(make_loader(src, "torch", batch_size=250, device="cpu", augment=NONE, num_workers=0))
    means = {b: mean_image(make_loader(src, b, batch_size=250, device="cpu", num_workers=0), epochs=2)
             for b in BACKENDS}
    ref = means["torch"]
    gap_to_plain = (ref - plain).abs().mean()
    assert gap_to_plain > 0.02
    for b, m in means.items():
        assert (m - ref).abs().mean() < 0.35 * gap_to_plain, b


def test_photo_recipes_agree_across_backends(photo_folder):
    """Photos: evaluation crops of the same files agree closely; training crops have the same statistics."""
    src = ImageFolder(photo_folder)
    evals = {b: torch.cat([x for x, _ in make_loader(src, b, batch_size=6, train=False, device="cpu",
                                                     num_workers=0)]) for b in BACKENDS}
    for b, x in evals.items():
        assert x.shape == (18, 3, 224, 224)
        # memory crops 224 out of a 256-square cache (two resamplings); torch resizes the box once.
        assert (x - evals["torch"]).abs().mean() < 0.05, b
    for b in BACKENDS:
        loader = make_loader(src, b, batch_size=6, device="cpu", num_workers=0)
        x = torch.cat([x for _ in range(3) for x, _ in loader])
        assert x.shape == (54, 3, 224, 224)
        # Random crops zoom in: their pixel statistics stay those of the photos (|mean diff| small) but
        # individual crops differ from the evaluation crops.
        assert abs(x.mean() - evals["torch"].mean()) < 0.15, b
        assert (x[:18] - evals["torch"]).abs().mean() > 0.1, b


def test_normalization_statistics_of_digits():
    src = SyntheticDigits(2000, seed=1)
    for b in BACKENDS:
        x = torch.cat([x for x, _ in make_loader(src, b, batch_size=500, train=False, device="cpu",
                                                 num_workers=0)])
        assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1) < 0.02, b


def test_torch_dataset_source_works_with_torch_backends():
    from PIL import Image

    class Pils(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return Image.fromarray(np.full((12, 10, 3), i, np.uint8)), i % 4

    for b in ("torch", "prefetch", "auto"):
        loader = make_loader(Pils(), b, batch_size=8, train=False, device="cpu", num_workers=2,
                             mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
        xs, ys = zip(*loader)
        x, y = torch.cat(xs), torch.cat(ys)
        assert x.shape == (40, 3, 12, 10)
        np.testing.assert_array_equal(torch.round(x[:, 0, 0, 0] * 255).long().numpy(), np.arange(40))
        np.testing.assert_array_equal(y.numpy(), np.arange(40) % 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_consumer_that_takes_exactly_len_batches_gets_a_new_epoch_each_pass(backend):
    """Lightning's fetcher, islice(loader, len(loader)) and zip(range(n), loader) never ask for the batch
    after the last: the pass must end when its last batch is handed out, or every pass replays epoch 0."""
    from itertools import islice

    loader = make_loader(indexed_source(300), backend, batch_size=50, device="cpu", shuffle=True,
                         drop_last=False, augment=NONE, num_workers=0, seed=5)
    epochs = []
    for e in range(2):
        ids = np.concatenate([decode_ids(x) for x, _ in islice(loader, len(loader))])
        np.testing.assert_array_equal(np.sort(ids), np.arange(300))
        epochs.append(ids)
        # The position, loader.epoch and state_dict() agree once the last batch is out.
        assert loader.epoch == e + 1
        assert (loader.state_dict()["epoch"], loader.state_dict()["samples"]) == (e + 1, 0)
    assert not np.array_equal(epochs[0], epochs[1]), "the second pass replayed the first epoch"
    # zip(range(n), loader) too, and the epoch it reads is the one a plain loop would read.
    ref = make_loader(indexed_source(300), backend, batch_size=50, device="cpu", shuffle=True,
                      drop_last=False, augment=NONE, num_workers=0, seed=5)
    ref.set_epoch(2)
    expected = np.concatenate([decode_ids(x) for x, _ in ref])
    np.testing.assert_array_equal(np.concatenate([decode_ids(x) for _, (x, _) in zip(range(len(loader)), loader)]),
                                  expected)
    # A peek still changes nothing, and a pass left early is read again from its start.
    first = decode_ids(next(iter(loader))[0])
    assert loader.epoch == 3
    for k, (x, _) in enumerate(loader):
        if k == 2:
            break
    assert loader.epoch == 3
    np.testing.assert_array_equal(decode_ids(next(iter(loader))[0]), first)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3])
def test_even_batches_pad_the_last_step_like_distributed_sampler(backend, world):
    """even_batches: every rank's batches have equal sizes (gather works); the gathered steps are the
    epoch's order, whose first ``remainder`` samples of the last step are real."""
    n, batch = 301, 32
    per_rank = []
    for rank in range(world):
        loader = make_loader(indexed_source(n), backend, batch_size=batch, device="cpu", train=False,
                             augment=NONE, rank=rank, world_size=world, num_workers=0, even_batches=True)
        batches = [decode_ids(x) for x, _ in loader]
        assert len(batches) == len(loader) and sum(map(len, batches)) == len(loader.sampler)
        per_rank.append(batches)
    for k in range(len(per_rank[0])):
        assert len({len(b[k]) for b in per_rank}) == 1, f"step {k}: batch sizes differ between ranks"
    gathered = [np.concatenate([b[k] for b in per_rank]) for k in range(len(per_rank[0]))]
    remainder = loader.plan.remainder()
    assert remainder == n % (batch * world) and remainder > 0
    real = np.concatenate(gathered[:-1] + [gathered[-1][:remainder]])
    np.testing.assert_array_equal(real, np.arange(n))   # every sample once, in the epoch's order
    assert len(gathered[-1]) - remainder < world        # DistributedSampler's padding: fewer than the ranks
