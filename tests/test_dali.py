"""The dali backend on CPU (CI has no GPU): the contract, agreement with the torch backend, errors.

The CUDA test at the end runs the nvJPEG ("mixed") path where a GPU exists.
"""
from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch

from conftest import MEAN, STD, decode_ids, indexed_source, label_of, pairs, skip_missing  # noqa: E402
from engine_helpers import first_command_run  # noqa: E402

try:
    import nvidia.dali.plugin.pytorch  # noqa: F401
except ImportError as e:
    skip_missing(f"the dali backend needs nvidia-dali-cuda120 ({e})", allow_module_level=True)
from fastdata import make_loader  # noqa: E402
from fastdata.config import Augmentation  # noqa: E402
from fastdata.datasets import ArraySource, ImageFolder, SyntheticDigits  # noqa: E402
from fastdata.errors import DecodeError  # noqa: E402
from fastdata.sampling import EpochPlan  # noqa: E402

NONE = Augmentation.none()


# Every loader a test opens, closed when the test ends: a loader left open keeps reading ahead in its
# threads (the stream goes on into the next epoch), which a later test's counters would see.
_OPENED: list = []


@pytest.fixture(autouse=True)
def _close_what_the_test_opened():
    yield
    while _OPENED:
        _OPENED.pop().close()


def dali(source, **kw):
    kw.setdefault("device", "cpu")
    _OPENED.append(make_loader(source, backend="dali", **kw))
    return _OPENED[-1]


def torch_loader(source, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("num_workers", 0)
    _OPENED.append(make_loader(source, backend="torch", **kw))
    return _OPENED[-1]


def epoch_ids(loader):
    return [decode_ids(x) for x, _ in loader]


# ---------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_batches_shape_dtype_layout_labels(dtype, channels_last):
    src = indexed_source(200, size=8, channels=3)
    loader = dali(src, batch_size=64, train=False, augment=NONE, dtype=dtype, channels_last=channels_last)
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    for x, y in batches:
        assert x.device.type == "cpu" and y.device.type == "cpu"
        assert x.dtype == dtype and x.shape[1:] == (3, 8, 8)
        assert y.dtype == torch.int64 and y.shape == (x.shape[0],)
        assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        np.testing.assert_array_equal(y.numpy(), label_of(decode_ids(x)))
    assert [len(y) for _, y in batches] == [64, 64, 64, 8]


def test_normalization_matches_formula():
    src = indexed_source(64, size=8)
    (x, _), = list(dali(src, batch_size=64, train=False, augment=NONE))
    raw = torch.from_numpy(src.images).permute(0, 3, 1, 2).float()
    expected = (raw / 255 - MEAN[0]) / STD[0]
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=0)


def test_every_sample_once_in_the_plans_order():
    src = indexed_source(1000)
    loader = dali(src, batch_size=64, train=True, shuffle=True, drop_last=False, augment=NONE, seed=11)
    got = epoch_ids(loader)
    plan = EpochPlan(1000, 64, True, False, 11)
    assert len(got) == len(loader) == len(plan) == 16
    assert [len(g) for g in got] == [64] * 15 + [40]
    for g, want in zip(got, plan.batches(0)):  # the same order as every other backend
        np.testing.assert_array_equal(g, want)
    assert sorted(np.concatenate(got).tolist()) == list(range(1000))


def test_drop_last_gives_full_batches():
    src = indexed_source(1000)
    loader = dali(src, batch_size=64, train=True, augment=NONE)
    got = epoch_ids(loader)
    assert len(got) == len(loader) == 15 and all(len(g) == 64 for g in got)
    assert len(np.unique(np.concatenate(got))) == 15 * 64


def test_seed_epoch_and_set_epoch():
    src = indexed_source(300)
    a = dali(src, batch_size=50, train=True, augment=NONE, seed=3)
    b = dali(src, batch_size=50, train=True, augment=NONE, seed=3)
    e0a, e0b = np.concatenate(epoch_ids(a)), np.concatenate(epoch_ids(b))
    np.testing.assert_array_equal(e0a, e0b)                       # same seed, same order
    e1 = np.concatenate(epoch_ids(a))                              # iter() again = next epoch
    assert not np.array_equal(e0a, e1) and sorted(e0a) == sorted(e1)
    a.set_epoch(0)
    np.testing.assert_array_equal(np.concatenate(epoch_ids(a)), e0a)
    c = dali(src, batch_size=50, train=True, augment=NONE, seed=4)
    assert not np.array_equal(np.concatenate(epoch_ids(c)), e0a)


def test_abandoned_epoch_then_fresh_epochs():
    # Breaking out leaves prefetched batches inside DALI; the next iter() must not see them. A pass
    # left early does not advance the epoch (base.py): the next iter() reads epoch 0 from its start.
    src = indexed_source(640)
    loader = dali(src, batch_size=64, train=True, augment=NONE, seed=2, prefetch_queue_depth=3)
    for _ in zip(range(2), loader):
        pass
    plan = EpochPlan(640, 64, True, True, 2)
    for epoch in (0, 1):
        got = epoch_ids(loader)
        assert len(got) == 10
        for g, want in zip(got, plan.batches(epoch)):
            np.testing.assert_array_equal(g, want)


def test_resume_gives_exactly_the_remaining_batches():
    src = indexed_source(700)
    kw = dict(batch_size=64, train=True, drop_last=False, augment=Augmentation.digits_train(), seed=9)
    full = dali(src, **kw)
    list(full)                                   # epoch 0
    want = [(x.clone(), y.clone()) for x, y in full]  # epoch 1, uninterrupted
    first = dali(src, **kw)
    list(first)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 4)
    resumed = dali(src, **kw)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(want) - 4
    for (x, y), (wx, wy) in zip(rest, want[4:]):
        torch.testing.assert_close(x, wx, rtol=0, atol=0)  # same ids *and* same random shifts
        assert torch.equal(y, wy)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_disjoint_covering_equal_counts(world, drop_last):
    n = 1003
    src = indexed_source(n)
    shards = [epoch_ids(dali(src, batch_size=32, train=True, drop_last=drop_last, augment=NONE,
                             rank=r, world_size=world, seed=5)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1          # every rank steps the same number of times
    ids = [np.concatenate(s) for s in shards]
    allids = np.concatenate(ids)
    assert len(np.unique(allids)) == len(allids)       # disjoint
    if drop_last:
        assert len(allids) == (n // (32 * world)) * 32 * world
    else:
        assert sorted(allids.tolist()) == list(range(n))  # covering


def test_empty_last_batch_on_a_rank():
    # 13 samples, 3 ranks x 4: the last step has 1 sample, so ranks 1 and 2 get an empty last batch.
    src = indexed_source(13)
    batches = list(dali(src, batch_size=4, train=False, augment=NONE, rank=2, world_size=3))
    assert [tuple(x.shape) for x, _ in batches] == [(4, 1, 8, 8), (0, 1, 8, 8)]
    assert batches[1][1].shape == (0,) and batches[1][1].dtype == torch.int64


def test_translation_equals_torch_backend_and_shift_statistics():
    # One bright pixel in the middle: its position in the output is the shift of that sample.
    n, size = 4000, 11
    images = np.zeros((n, size, size), np.uint8)
    images[:, 5, 5] = 255
    src = ArraySource(images, np.arange(n) % 10, mean=(0.0,), std=(1.0,), digits=True)
    kw = dict(batch_size=250, train=True, seed=7)     # digits_train: shifts of up to ±2 px
    d = torch.cat([x for x, _ in dali(src, **kw)])
    t = torch.cat([x for x, _ in torch_loader(src, **kw)])
    # The shifts are drawn from the same per-batch seed with the same helper: identical pixels.
    torch.testing.assert_close(d, t, rtol=0, atol=1e-6)

    flat = d[:, 0].reshape(len(d), -1).argmax(1)
    dy, dx = (flat // size - 5).numpy(), (flat % size - 5).numpy()
    assert (d[:, 0].reshape(len(d), -1).amax(1) > 0.99).all()  # the pixel never leaves a ±2 shift
    counts = np.zeros((5, 5))
    np.add.at(counts, (dy + 2, dx + 2), 1)
    expected = len(d) / 25                        # uniform over the 25 shifts
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 52.6, f"shift histogram not uniform (chi2={chi2:.1f} > 99.9% quantile, 24 dof)"


@pytest.mark.parametrize("n", [1300, 1305])
def test_generators_seeded_ahead_give_each_batch_its_own_draws_across_stretches_and_resumes(n, monkeypatch):
    """The input callback takes each batch's draws from a stretch drawn at once (64 batches: one
    batch's draw_params behind a training step took ~100 us, against ~15 in the loop): the draws are
    still batch_rng(epoch, k)'s over stretch boundaries, for a smaller last batch (its own generator),
    from a resumed position and when a batch is prepared again (a restart): the torch backend's pixels
    each time."""
    from fastdata.decode import dali_arrays

    images = np.zeros((n, 7, 7), np.uint8)
    images[:, 3, 3] = 255
    src = ArraySource(images, np.arange(n) % 10, mean=(0.0,), std=(1.0,), digits=True)
    kw = dict(batch_size=10, train=True, seed=3, drop_last=False)   # 130 or 131 batches: three stretches
    t = torch.cat([x for x, _ in torch_loader(src, **kw)])
    loader = dali(src, **kw)
    drawn = []
    real = dali_arrays.draw_params
    monkeypatch.setattr(dali_arrays, "draw_params", lambda *a: drawn.append(a[2]) or real(*a))
    torch.testing.assert_close(torch.cat([x for x, _ in loader]), t, rtol=0, atol=1e-6)
    # In stretches of 64 full batches (DALI runs ahead: the next epoch's first stretch too); a last
    # batch of 5 draws alone.
    assert drawn[:130] == [10] * 130 and (n == 1300 or 5 in drawn)
    assert len(drawn) % 64 == (n != 1300)
    state = loader.state_dict() | {"epoch": 0, "batch": 70, "samples": 700}
    loader.load_state_dict(state)                          # resumed mid-stretch
    torch.testing.assert_close(torch.cat([x for x, _ in loader]), t[700:], rtol=0, atol=1e-6)
    ids = loader.plan.batches_from(0, 0)[5]
    first, again = loader.prepare(0, 5, ids)[0], loader.prepare(0, 5, ids)[0]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_translation_fills_with_zeros():
    src = ArraySource(np.full((64, 8, 8), 255, np.uint8), np.zeros(64, np.int64), mean=(0.0,), std=(1.0,))
    x = torch.cat([x for x, _ in dali(src, batch_size=64, train=True, augment=Augmentation(crop="translate", pad=3))])
    zeros_per_image = (x[:, 0] == 0).sum((1, 2))
    assert (x[:, 0] > 0.99).sum() > 0 and (zeros_per_image > 0).float().mean() > 0.5
    assert set(torch.unique(x).tolist()) <= {0.0, 1.0}


def _colour_arrays(n=600, h=12, w=10):
    """Random RGB arrays with no black pixel (so only zero padding shows 0), not square (so a
    transposed window shows), normalized as pixel / 255."""
    images = np.random.default_rng(2).integers(1, 256, (n, h, w, 3), dtype=np.uint8)
    return ArraySource(images, np.arange(n) % 10, mean=(0.0,) * 3, std=(1.0,) * 3)


@pytest.mark.parametrize("host_pad", [False, True], ids=["slice-border-mode", "host-np.pad"])
@pytest.mark.parametrize("padding", ["reflect", "edge", "constant"])
def test_padded_translation_equals_torch_backend_pixel_for_pixel(padding, host_pad, monkeypatch):
    """cifar_train's reflect (and edge) translation: DALI's slice border mode ("reflect_101", "edge"),
    or a DALI without those (host_pad: np.pad on the host, a slice inside), gives the torch backend's
    pixels exactly for the same seed, flips included."""
    import fastdata.backends.dali as dali_mod

    if host_pad:
        monkeypatch.setattr(dali_mod, "slice_has_policy", lambda policy: False)
    src = _colour_arrays()
    kw = dict(batch_size=100, train=True, seed=5, augment=Augmentation.cifar_train(pad=4, padding=padding))
    loader = dali(src, **kw)
    assert loader._host_pad == (host_pad and padding != "constant")
    d = torch.cat([x for x, _ in loader])
    t = torch.cat([x for x, _ in torch_loader(src, **kw)])
    assert d.shape == t.shape == (600, 3, 12, 10)
    assert torch.equal(d, t), f"{padding}: {(d != t).sum().item()} pixels differ"
    assert bool((d == 0).any()) == (padding == "constant")   # only zero padding shifts black in
    again = torch.cat([x for x, _ in dali(src, **{**kw, "seed": 6})])
    assert not torch.equal(d, again), "another seed must shift differently"


def test_dali_reflect_is_not_dalis_own_reflect():
    """DALI's "reflect" repeats the edge pixel; numpy/torch/torchvision "reflect" is its "reflect_101".
    The installed DALI lists both, so the mapping is checked against its schema, not assumed."""
    from fastdata.backends.dali import SLICE_POLICY, slice_has_policy

    assert SLICE_POLICY == {"constant": "pad", "reflect": "reflect_101", "edge": "edge"}
    assert all(slice_has_policy(v) for v in SLICE_POLICY.values())   # DALI 2.4: native border modes
    assert not slice_has_policy("no_such_policy")


def test_reflect_pad_not_smaller_than_the_image_is_refused_at_construction():
    src = ArraySource(np.zeros((64, 4, 6, 3), np.uint8), np.zeros(64, np.int64))
    with pytest.raises(ValueError, match=r"of 4x6 px cannot be padded by pad=4 with padding='reflect'"):
        dali(src, batch_size=8, augment=Augmentation.cifar_train(pad=4))
    dali(src, batch_size=8, augment=Augmentation.cifar_train(pad=4, padding="edge"))   # edge fits any size
    # The largest pad that fits (height - 1) mirrors all but the edge row: still the torch backend's.
    fits = ArraySource(np.random.default_rng(1).integers(0, 256, (64, 5, 6, 3), dtype=np.uint8),
                       np.zeros(64, np.int64), mean=(0.0,) * 3, std=(1.0,) * 3)
    kw = dict(batch_size=32, train=True, seed=1, augment=Augmentation.cifar_train(pad=4))
    assert torch.equal(torch.cat([x for x, _ in dali(fits, **kw)]),
                       torch.cat([x for x, _ in torch_loader(fits, **kw)]))


# ------------------------------------------------------------------------------------ image folders
@pytest.mark.parametrize("decode", ["host", "dali"])
def test_eval_pixels_agree_with_torch_backend(photo_folder, decode):
    """Tolerance, in 0..255 pixel levels: mean |diff| < 0.5, 99th percentile <= 2, max <= 8.

    Both backends decode with libjpeg-turbo (DALI through nvImageCodec, the torch backend through PIL,
    which may also use ``Image.draft``'s DCT-domain downscale). decode="dali" resizes with DALI's
    ``fn.resize`` (antialiased linear) instead of PIL's BILINEAR with ``box``: their rounding differs
    by about one level on a minority of pixels (measured: mean 0.17, p99 1, max 1). decode="host"
    resizes with PIL itself. A wrong box, a half-pixel shift, a flip or the wrong normalization shows
    up as tens of levels.
    """
    src = ImageFolder(photo_folder)
    d_loader = dali(src, batch_size=8, train=False, decode=decode)
    t_loader = torch_loader(src, batch_size=8, train=False)
    d, dl = map(torch.cat, zip(*d_loader))
    t, tl = map(torch.cat, zip(*t_loader))
    assert d.shape == t.shape == (18, 3, 224, 224) and torch.equal(dl, tl)
    std = torch.tensor(src.std).view(1, 3, 1, 1)
    diff = ((d - t) * std * 255).abs()
    assert diff.mean() < 0.5
    assert diff.flatten().kthvalue(int(0.99 * diff.numel())).values <= 2.0
    assert diff.max() <= 8.0


@pytest.mark.parametrize("decode", ["host", "dali"])
def test_train_crops_follow_the_shared_recipe(photo_folder, decode):
    # The crop boxes and flips come from the same seeded draws as the torch backend's, so even the
    # random training crops agree to a few levels on average.
    src = ImageFolder(photo_folder)
    kw = dict(batch_size=6, train=True, seed=4, decode=decode)
    d = torch.cat([x for x, _ in dali(src, **kw)])
    t = torch.cat([x for x, _ in torch_loader(src, batch_size=6, train=True, seed=4)])
    assert d.shape == t.shape == (18, 3, 224, 224)
    std = torch.tensor(src.std).view(1, 3, 1, 1)
    per_image = ((d - t) * std * 255).abs().mean((1, 2, 3))
    assert per_image.max() < 3.0, per_image
    again = torch.cat([x for x, _ in dali(src, **kw)])
    assert torch.equal(d, again)


def test_files_need_a_resizing_crop(photo_folder):
    with pytest.raises(ValueError, match="random_resized"):
        dali(ImageFolder(photo_folder), batch_size=4, augment=Augmentation(crop="translate", pad=2))


def _broken_folder(tmp_path, photo_folder, damage):
    root = tmp_path / "broken"
    shutil.copytree(photo_folder, root)
    bad = root / "class_001" / "img_00002.jpg"
    data = bad.read_bytes()
    bad.write_bytes(damage(data))
    return root, bad


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b""], ids=["truncated", "empty"])
def test_broken_jpeg_raises_naming_the_file_and_loader_stays_usable(tmp_path, photo_folder, damage):
    root, bad = _broken_folder(tmp_path, photo_folder, damage)
    loader = dali(ImageFolder(root), batch_size=4, train=False)
    for _ in range(2):  # the second iter() builds a fresh pipeline and fails the same clear way
        with pytest.raises(DecodeError, match=str(bad.name)) as err:
            list(loader)
        assert str(bad) in str(err.value)


def test_broken_jpeg_skipped_and_counted(tmp_path, photo_folder):
    root, bad = _broken_folder(tmp_path, photo_folder, lambda b: b[: len(b) // 2])
    loader = dali(ImageFolder(root), batch_size=4, train=False, on_error="skip")
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="skipped 1"):
            batches = list(loader)
        assert len(batches) == len(loader) == 5
        assert sum(len(y) for _, y in batches) == 17 and loader.skipped == 1


def _truncate_90(data: bytes) -> bytes:
    return data[: len(data) * 9 // 10]


def _garble_scan(data: bytes) -> bytes:
    """200 random bytes in the middle of the scan data, from the first seed for which libjpeg (through
    PIL) reports a broken data stream; for most seeds it only warns, and no backend can tell."""
    import io

    from PIL import Image

    sos = data.index(b"\xff\xda")
    mid = sos + (len(data) - sos) // 2
    for seed in range(100):
        junk = np.random.default_rng(seed).integers(0, 256, 200, dtype=np.uint8).tobytes()
        out = data[:mid] + junk + data[mid + 200:]
        try:
            Image.open(io.BytesIO(out)).load()
        except OSError:
            return out
    raise AssertionError("no seed garbles the scan enough for libjpeg to refuse it")


DAMAGE = {"truncated_at_90%": _truncate_90, "garbage_in_scan": _garble_scan}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_broken_file_refused_in_the_first_epoch_whatever_the_crop(tmp_path, photo_folder, damage):
    # Region decoding reads only the rows around a crop: without a whole-file check, a file truncated
    # at 90% passed whenever the crop missed its last rows, and garbage that libjpeg only warns about
    # inside DALI gave a garbled image. Every seed's first epoch must fail, as the torch backend's does.
    root, bad = _broken_folder(tmp_path, photo_folder, DAMAGE[damage])
    src = ImageFolder(root)
    for seed in range(4):
        with pytest.raises(DecodeError, match=bad.name) as err:
            list(dali(src, batch_size=6, train=True, seed=seed))
        assert err.value.path == str(bad)
        with pytest.raises(DecodeError, match=bad.name):
            list(torch_loader(src, batch_size=6, train=True, seed=seed))


@pytest.mark.parametrize("decode", ["host", "dali"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_broken_file_skipped_every_epoch_like_the_torch_backend(tmp_path, photo_folder, damage, decode):
    root, _ = _broken_folder(tmp_path, photo_folder, DAMAGE[damage])
    src = ImageFolder(root)
    kw = dict(batch_size=6, train=True, seed=3, on_error="skip")
    d, t = dali(src, decode=decode, **kw), torch_loader(src, **kw)
    for _ in range(3):
        with pytest.warns(RuntimeWarning, match="skipped 1"):
            db = list(d)
        with pytest.warns(RuntimeWarning, match="skipped 1"):
            tb = list(t)
        assert d.skipped == t.skipped == 1
        assert [len(y) for _, y in db] == [len(y) for _, y in tb]
        for (dx, dy), (tx, ty) in zip(db, tb):
            # The skipped file's draws are consumed as the torch backend consumes them: the samples
            # after it get the same crops (a misaligned draw would differ by tens of levels).
            assert torch.equal(dy, ty)
            per_image = ((dx - tx) * torch.tensor(src.std).view(1, 3, 1, 1) * 255).abs().mean((1, 2, 3))
            assert per_image.max() < 3.0, per_image


def test_validate_false_trusts_the_files_and_changes_no_pixel(tmp_path, photo_folder):
    src = ImageFolder(photo_folder)
    kw = dict(batch_size=6, train=True, seed=5)
    checked = torch.cat([x for x, _ in dali(src, **kw)])
    trusted = torch.cat([x for x, _ in dali(src, validate=False, read_threads=1, **kw)])
    assert torch.equal(checked, trusted)
    # Unchecked, a file truncated at 90% reaches the decoder (DALI's, or the host's region decoder),
    # which fails only for some crops; whatever happens, the loader still names the file when it does.
    root, bad = _broken_folder(tmp_path, photo_folder, _truncate_90)
    for decode in ("host", "dali"):
        try:
            list(dali(ImageFolder(root), batch_size=6, train=False, validate=False, decode=decode))
        except DecodeError as e:
            assert e.path == str(bad)
    # Truncated at half, every crop reaches the damage: host decoding names the file, or skips it.
    root, bad = _broken_folder(tmp_path / "half", photo_folder, lambda b: b[: len(b) // 2])
    with pytest.raises(DecodeError, match=bad.name):
        list(dali(ImageFolder(root), batch_size=6, train=False, validate=False, decode="host"))
    loader = dali(ImageFolder(root), batch_size=6, train=False, validate=False, decode="host", on_error="skip")
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        assert sum(len(y) for _, y in loader) == 17


def test_files_read_off_the_training_thread_and_headers_once(photo_folder, monkeypatch):
    import threading

    import fastdata.decode.dali_files as dali_mod  # where the files are opened

    opened, threads = [], set()
    real_open = dali_mod.open_image

    def counting_open(path, fp=None):
        opened.append(path)
        threads.add(threading.current_thread().name)
        return real_open(path, fp)

    monkeypatch.setattr(dali_mod, "open_image", counting_open)
    src = ImageFolder(photo_folder)
    loader = dali(src, batch_size=4, train=True, read_threads=2)
    for _ in range(3):
        assert sum(len(y) for _, y in loader) == 16
    assert sorted(opened) == sorted(map(str, src.paths))  # each header once, over 3 epochs
    assert threading.main_thread().name not in threads and threads


def test_dali_failures_classified_by_type_and_origin():
    import os

    import nvidia.dali

    from fastdata.backends.dali import is_dali_failure

    dali_file = os.path.join(os.path.dirname(nvidia.dali.__file__), "pipeline.py")

    def raised(exc, filename):
        try:
            exec(compile("raise exc", filename, "exec"), {"exc": exc})
        except BaseException as e:
            return e

    text = "Critical error in pipeline:\nError in CPU operator `nvidia.dali.fn.decoders.image`"
    assert is_dali_failure(raised(RuntimeError(text), dali_file))               # DALI's executor
    assert not is_dali_failure(raised(RuntimeError(text), __file__))            # same words, not DALI
    assert not is_dali_failure(raised(RuntimeError("pipeline broke"), __file__))
    assert not is_dali_failure(raised(RuntimeError("the pipeline is invalid"), dali_file))  # no prefix
    assert not is_dali_failure(raised(torch.OutOfMemoryError(text), dali_file))  # a subclass: not DALI's
    assert not is_dali_failure(raised(ValueError(text), dali_file))
    assert not is_dali_failure(RuntimeError(text))                              # never raised


def test_real_dali_decoder_failure_is_classified(tmp_path, photo_folder):
    from nvidia.dali import fn, pipeline_def, types

    from fastdata.backends.dali import is_dali_failure

    @pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
    def probe():
        return fn.decoders.image(fn.external_source(name="enc", dtype=types.UINT8), device="cpu")

    pipe = probe()
    pipe.build()
    data = next(photo_folder.rglob("*.jpg")).read_bytes()
    with pytest.raises(RuntimeError) as err:
        pipe.run(enc=[np.frombuffer(data[: len(data) // 2], np.uint8)])
    assert is_dali_failure(err.value)


def test_unrelated_runtime_error_is_reraised_untouched(photo_folder, monkeypatch):
    loader = dali(ImageFolder(photo_folder), batch_size=4, train=False)
    boom = RuntimeError("my pipeline broke")

    def fail(*args):
        raise boom

    monkeypatch.setattr(loader, "_convert", fail)
    monkeypatch.setattr(loader, "_probe", lambda ids: pytest.fail("probed for an unrelated error"))
    with pytest.raises(RuntimeError) as err:
        list(loader)
    assert err.value is boom
    monkeypatch.undo()
    assert sum(len(y) for _, y in loader) == 18  # and the loader starts a fresh epoch afterwards


@pytest.mark.parametrize("driver", ["caller", "thread"])
def test_one_probe_pipeline_finds_every_bad_file(tmp_path, photo_folder, driver):
    # validate=False leaves the files to DALI: each truncated file fails a DALI batch, and the probe
    # that finds it is built once and reused after each failure. With a driver thread, DALI's failure
    # is raised to the consumer, which probes, skips and restarts the stream as the caller does.
    root = tmp_path / "two_bad"
    shutil.copytree(photo_folder, root)
    bad = [root / "class_000" / "img_00001.jpg", root / "class_002" / "img_00004.jpg"]
    for b in bad:
        b.write_bytes(b.read_bytes()[:2000])
    loader = dali(ImageFolder(root), batch_size=3, train=False, validate=False, on_error="skip", decode="dali",
                  driver=driver)
    probes = []
    real_probe = loader._probe

    def probe(ids):
        found = real_probe(ids)
        probes.append(loader._probe_pipe)
        return found

    loader._probe = probe
    with pytest.warns(RuntimeWarning, match="skipped 2"):
        assert sum(len(y) for _, y in loader) == 16
    assert len(probes) == 2 and probes[0] is probes[1] is not None
    with pytest.warns(RuntimeWarning, match="skipped 2"):  # known now: no DALI failure, no probe
        assert sum(len(y) for _, y in loader) == 16
    assert len(probes) == 2


@pytest.mark.parametrize("how", ["close", "second_iter"])
@pytest.mark.parametrize("kind", ["arrays", "files"])
def test_epoch_closed_or_superseded_mid_epoch_then_a_whole_epoch(kind, how, photo_folder):
    # A second iter() while an epoch runs closes the running one first (base.py): the pipeline and the
    # batches read ahead must go with it (it used to fail with a TypeError). No pass ran to its end,
    # so the whole one is epoch 0, read from its start.
    if kind == "arrays":
        src = indexed_source(640)
        loader = dali(src, batch_size=64, train=True, augment=NONE, seed=2, prefetch_queue_depth=3)
    else:
        src = ImageFolder(photo_folder)
        loader = dali(src, batch_size=4, train=False, shuffle=True, seed=2)
    if how == "close":
        for _ in range(2):
            it = iter(loader)
            next(it)
            it.close()
        full = list(loader)
    else:
        first = iter(loader)
        next(first)
        second = iter(loader)
        next(second)
        full = list(iter(loader))  # supersedes both
        with pytest.raises(RuntimeError):
            next(first)
    assert len(full) == len(loader)
    if kind == "arrays":
        plan = EpochPlan(640, 64, True, True, 2)
        for (x, _), want in zip(full, plan.batches(0)):
            np.testing.assert_array_equal(decode_ids(x), want)
    else:
        ys = torch.cat([y for _, y in full])
        assert len(ys) == 18
        plan = EpochPlan(18, 4, True, False, 2)
        want = np.concatenate(plan.batches(0))
        np.testing.assert_array_equal(ys.numpy(), src.labels[want])


# ------------------------------------------------------------------------------ where photos decode
def _record_graph_ops(monkeypatch):
    """Wrap the DALI operators the files' graph may use; returns the names called while building one."""
    import nvidia.dali.fn as fn

    called = []
    for holder, name in ((fn.decoders, "image_slice"), (fn.decoders, "image"), (fn, "resize"), (fn.io.file, "read")):
        real = getattr(holder, name)

        def wrapper(*a, _real=real, _name=name, **kw):
            called.append((_name, kw))
            return _real(*a, **kw)

        monkeypatch.setattr(holder, name, wrapper)
    return called


def test_cpu_pipeline_decodes_on_the_host_by_default(photo_folder, monkeypatch):
    # On the CPU, DALI's fn.resize cost more than its region decode (measured 1.8 ms per crop against
    # PIL-SIMD's 0.4 ms), so photos are decoded and resized in the reader threads and DALI only flips
    # and normalizes: no decoder and no resize in the pipeline.
    import threading

    import fastdata.images.region as region_mod

    called = _record_graph_ops(monkeypatch)
    boxes, threads = [], set()
    real_decode_box = region_mod.decode_box

    def counting_decode_box(data, box, out_size=None, **kw):
        boxes.append(box)
        threads.add(threading.current_thread().name)
        return real_decode_box(data, box, out_size, **kw)

    monkeypatch.setattr(region_mod, "decode_box", counting_decode_box)  # crop_photo imports it per call
    src = ImageFolder(photo_folder)
    loader = dali(src, batch_size=6, train=True, seed=1)
    assert loader.host_decode
    assert sum(len(y) for _, y in loader) == 18
    assert called == []
    # Every photo, off-thread; the stream goes on into the next epoch, whose first batches (at most
    # prefetch_queue_depth + 1 of 6) are decoded ahead while this one ends.
    assert 18 <= len(boxes) <= 18 + (loader.prefetch_queue_depth + 1) * 6
    assert threading.main_thread().name not in threads


def test_dali_decode_keeps_the_region_decoder_in_the_pipeline(photo_folder, monkeypatch):
    called = _record_graph_ops(monkeypatch)
    loader = dali(ImageFolder(photo_folder), batch_size=6, train=True, decode="dali")
    assert not loader.host_decode
    assert sum(len(y) for _, y in loader) == 18
    names = [n for n, _ in called]
    assert names == ["read", "image_slice", "resize"]   # plain files: DALI reads them (fn.io.file.read)
    kw = dict(called[1][1])
    assert kw["device"] == "cpu" and kw["axis_names"] == "HW"
    # DALI applies jpeg_fancy_upsampling to nvJPEG only; on the CPU libjpeg-turbo always upsamples so.
    assert kw["jpeg_fancy_upsampling"] is True
    assert called[2][1]["antialias"] is True


def test_a_gpu_decodes_whole_photos_with_nvjpeg_and_crops_in_the_resize():
    """nvJPEG (nvImageCodec 0.9, nvJPEG 12.x) refuses a region decode with fancy upsampling for
    chroma-subsampled JPEGs, and DALI decoded those on its CPU fallback: the GPU pipeline was built with
    image_slice on "mixed". It decodes whole photos on "mixed" (with fancy upsampling: libjpeg-turbo's
    chroma); the CPU keeps its window decode."""
    from fastdata.backends.dali import files_decoder

    op, kw = files_decoder(gpu=True)
    assert op == "image" and kw == {"device": "mixed", "jpeg_fancy_upsampling": True}
    op, kw = files_decoder(gpu=False)
    assert op == "image_slice" and kw["device"] == "cpu" and kw["axis_names"] == "HW"
    assert kw["normalized_anchor"] is False and kw["normalized_shape"] is False


def test_whole_photo_decode_crops_the_same_pixels_as_the_window_decode(photo_folder, monkeypatch):
    """The GPU's graph (a whole photo, the box as the resize's ROI in the photo's coordinates), run on
    the CPU's decoder: the same crops as the window decode (whose margin covers the filter's reach). A
    ROI left relative to a window, or a window fed to a whole-photo decode, is off by tens of levels."""
    import fastdata.backends.dali as dali_mod

    src = ImageFolder(photo_folder)
    kw = dict(batch_size=6, train=True, seed=4, decode="dali")
    window = torch.cat([x for x, _ in dali(src, **kw)])
    whole_op, whole_kw = dali_mod.files_decoder(gpu=True)
    monkeypatch.setattr(dali_mod, "files_decoder", lambda gpu: (whole_op, {**whole_kw, "device": "cpu"}))
    called = _record_graph_ops(monkeypatch)
    whole = torch.cat([x for x, _ in dali(src, **kw)])
    assert [n for n, _ in called] == ["read", "image", "resize"] and called[1][1]["device"] == "cpu"
    levels = ((whole - window) * torch.tensor(src.std).view(1, 3, 1, 1) * 255).abs()
    assert whole.shape == window.shape == (18, 3, 224, 224)
    assert levels.max() <= 1.01 and levels.mean() < 0.05, (levels.max(), levels.mean())


@pytest.mark.parametrize("region", [True, False], ids=["region_decode", "pil_decode"])
def test_host_decode_gives_the_torch_backends_pixels(photo_folder, monkeypatch, region):
    # Eval boxes (256-resize, 224 centre crop of ~450x350 photos) are too small for a reduced-scale
    # decode, so both backends decode every row at full scale and resize with the same PIL call. What
    # may differ is the decoder's rounding: nvImageCodec's libjpeg-turbo (region decode) and Pillow's
    # put a few pixels one level apart; fn.resize's own rounding, a shifted box or a flip would not
    # stay within that.
    if not region:   # as where nvImageCodec is missing: PIL decodes (with draft where it pays)
        monkeypatch.setenv("FASTDATA_REGION_DECODE", "0")
    src = ImageFolder(photo_folder)
    d = torch.cat([x for x, _ in dali(src, batch_size=8, train=False)])
    t = torch.cat([x for x, _ in torch_loader(src, batch_size=8, train=False)])
    levels = ((d - t) * torch.tensor(src.std).view(1, 3, 1, 1) * 255).abs()
    assert levels.max() < 1.01 and levels.mean() < 0.05
    assert (levels < 0.01).float().mean() > 0.99


def test_decode_option():
    src = indexed_source(64)
    assert not dali(src, batch_size=32).host_decode          # arrays: nothing to decode
    with pytest.raises(ValueError, match=r"unknown decode 'pil'; choose from \['auto', 'host', 'dali'\]"):
        dali(src, batch_size=32, decode="pil")


# -------------------------------------------------------------------------------------------- options
def test_options():
    src = indexed_source(64)
    loader = dali(src, batch_size=32, num_workers=1, train=False)
    assert loader.num_threads == 1 and loader.prefetch_queue_depth == 2
    assert dali(src, batch_size=32, num_threads=3, prefetch_queue_depth=1).num_threads == 3
    with pytest.raises(ValueError, match="prefetch_queue_depth"):
        dali(src, batch_size=32, prefetch_queue_depth=0)
    with pytest.raises(TypeError, match="unknown option"):
        dali(src, batch_size=32, workers=2)
    assert dali(src, batch_size=32, num_threads=3).read_threads == 3
    assert dali(src, batch_size=32, read_threads=5).read_threads == 5
    with pytest.raises(ValueError, match="read_threads"):
        dali(src, batch_size=32, read_threads=0)
    with pytest.raises(ValueError, match="validate"):
        dali(src, batch_size=32, validate="yes")


# ----------------------------------------------------------------------------------------------- CUDA
def gpu(source, **kw):
    return dali(source, device="cuda", **kw)


def _levels(a, b, std):
    """|a - b| in 0..255 pixel levels, for batches normalized with ``std``."""
    return ((a.float().cpu() - b.float().cpu()) * torch.tensor(std).view(1, -1, 1, 1) * 255).abs().flatten()


@pytest.mark.cuda
def test_cuda_the_first_command_on_dali_waits_for_data_at_most_5_percent(monkeypatch):
    """``train_mnist.py --backend dali``, the first command users run (SmallCNN on digits, batch 256, SGD
    fused, one cycle), waited on data for 17% of each epoch on an H200 in the first GPU run (torch 24%,
    memory 3-7%), before one pipeline per loader. The bar: at most 5% from the second epoch (memory's
    is 1%). Whatever the result, it prints where the wait went per batch: the input callback that
    gathers a batch on the training thread (``Feeder.__call__``, inside DALI's iterator), the rest of
    DALI's outputs (``_fetch`` less the callback: scheduling, ``share_outputs``, DLPack)
    and the hand-over (``_convert``). DALI calls the callback from inside its iterator, so ``fetch``
    includes it. Inside ``fetch``, DALI's three calls apart (``schedule_run`` includes the callback), and
    a pass of the same loader with no model beside it: whether DALI alone outruns the step (the H200 run
    of 2026-11-28 read 22.8% with fetch 1.0 ms a batch, and could not tell work from a wait). Since that
    run the training thread's part shrank on the CPU behind a step (0.79-0.81 -> 0.56-0.57 ms a batch,
    paired): 2 inputs fed instead of 4, the pass's labels uploaded once (convert 161 us on the H200),
    draws made 64 batches at a time, no ids recorded for planned batches."""
    import functools
    import statistics
    import time

    from nvidia.dali.pipeline import Pipeline

    from fastdata.backends.dali import DaliLoader
    from fastdata.datasets import SyntheticDigits
    from fastdata.decode.dali_feed import Feeder

    spent: dict = {"callback": [], "fetch": [], "convert": [], "schedule_run": [], "share_outputs": [],
                   "release_outputs": []}

    def timed(name, fn):
        @functools.wraps(fn)   # the signature kept: DALI counts the callback's arguments
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name].append(time.perf_counter() - t)
        return run

    for cls, attr, name in ((Feeder, "__call__", "callback"), (DaliLoader, "_fetch", "fetch"),
                            (DaliLoader, "_convert", "convert"), (Pipeline, "schedule_run", "schedule_run"),
                            (Pipeline, "share_outputs", "share_outputs"),
                            (Pipeline, "release_outputs", "release_outputs")):
        monkeypatch.setattr(cls, attr, timed(name, getattr(cls, attr)))
    history, diagnosis = first_command_run("dali")
    waits = [r["data_wait_fraction"] for r in history]
    per_batch = {k: statistics.median(v) * 1e6 for k, v in spent.items() if v}
    # The loader alone, warm (its second pass), for the same 60,000 digits: DALI's own pace.
    alone = dali(SyntheticDigits(60_000, seed=0), batch_size=256, device="cuda", seed=0)   # closed by the fixture
    for _ in alone:
        pass
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in alone)
    torch.cuda.synchronize()
    rate = n / (time.perf_counter() - t0)
    diagnosis += (f"\nthe loader alone, no model: {rate:,.0f} images/s ({256e3 / rate:.2f} ms a batch of 256)"
                  f"\nmedian per batch (us): {', '.join(f'{k} {v:.0f}' for k, v in per_batch.items())}; "
                  f"images/s {[round(r['images_per_second']) for r in history]}; gpu idle "
                  f"{[r['gpu_idle_fraction'] for r in history]} (a batch DALI had not finished is waited "
                  f"for on the GPU's stream since handover='stream', not in data wait)")
    print(diagnosis)   # in the GPU run's log whether the test passes or not
    assert max(waits[1:]) <= 0.05, f"data wait per epoch: {waits}\n{diagnosis}"


@pytest.mark.cuda
def test_cuda_the_first_command_on_dali_trains_alike_with_a_driver_thread():
    """driver="thread" runs DALI's iteration (1.0 ms a batch on the H200's training thread, 22.8% data
    wait with the default) in a thread of its own. Whether that helps a launch-bound step, where the
    thread competes for the GIL with the training thread (prefetch's producer: 0.85x torch there), is
    what this prints, both drivers in one run, for choosing the default (bench_dali_gpu's driver rows
    measure the rate). What it holds: both train the first command (over 90% of the digits right in
    the third epoch; the batches themselves are compared by tests/test_decode_dali_outputs.py)."""
    runs = {driver: first_command_run("dali", driver=driver) for driver in ("caller", "thread")}
    waits = {d: [round(r["data_wait_fraction"], 4) for r in h] for d, (h, _) in runs.items()}
    rates = {d: [round(r["images_per_second"]) for r in h] for d, (h, _) in runs.items()}
    print(f"data wait per epoch {waits}; images/s {rates}\n" + "\n".join(f"{d}: {g}" for d, (_, g) in runs.items()))
    assert all(h[-1]["train_accuracy"] > 0.9 for h, _ in runs.values()), (waits, rates)


@pytest.mark.cuda
def test_gpu_eval_pixels_close_to_torch_backend(photo_folder):
    """nvJPEG (with jpeg_fancy_upsampling, as libjpeg-turbo upsamples chroma) vs PIL: the IDCTs round
    differently by a level or two; nearest-neighbour chroma (DALI's default) or a wrong box would put
    the 99th percentile at tens of levels."""
    src = ImageFolder(photo_folder)
    g, gl = map(torch.cat, zip(*gpu(src, batch_size=8, train=False)))
    t, tl = map(torch.cat, zip(*torch_loader(src, batch_size=8, train=False)))
    assert g.is_cuda and gl.is_cuda and g.dtype == torch.float32 and gl.dtype == torch.int64
    assert g.shape == t.shape == (18, 3, 224, 224) and torch.equal(gl.cpu(), tl)
    diff = _levels(g, t, src.std)
    assert diff.mean() < 1.0
    assert diff.kthvalue(int(0.99 * diff.numel())).values <= 4.0
    digits = indexed_source(300)
    got = [decode_ids(x) for x, _ in gpu(digits, batch_size=64, train=False, augment=NONE)]
    assert sorted(np.concatenate(got).tolist()) == list(range(300))


@pytest.mark.cuda
@pytest.mark.parametrize("padding", ["reflect", "edge"])
def test_gpu_padded_translation_equals_torch_backend(padding):
    """The slice border modes on DALI's GPU kernel: the torch backend's (CPU) pixels, up to the float
    rounding of the normalization on another device."""
    src = _colour_arrays()
    kw = dict(batch_size=100, train=True, seed=5, augment=Augmentation.cifar_train(pad=4, padding=padding))
    g = torch.cat([x for x, _ in gpu(src, **kw)])
    t = torch.cat([x for x, _ in torch_loader(src, **kw)])
    assert g.is_cuda and g.shape == t.shape
    assert _levels(g, t, src.std).max() < 0.01


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gpu_half_dtypes_and_layouts(dtype, channels_last, photo_folder):
    memory = torch.channels_last if channels_last else torch.contiguous_format
    for src, size in ((ImageFolder(photo_folder), 224), (indexed_source(200, size=8, channels=3), 8)):
        loader = gpu(src, batch_size=8, train=False, dtype=dtype, channels_last=channels_last,
                     augment=None if size == 224 else NONE)
        ref = list(dali(src, batch_size=8, train=False, augment=None if size == 224 else NONE))
        for (x, y), (rx, _) in zip(loader, ref):
            assert x.is_cuda and y.is_cuda and x.dtype == dtype and x.shape[1:] == (3, size, size)
            assert x.is_contiguous(memory_format=memory), x.stride()
            # bf16 keeps 8 bits of mantissa: normalized values within ~1% (plus decoder rounding).
            assert _levels(x, rx, src.std).kthvalue(int(0.99 * x.numel())).values <= 6.0


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["arrays", "files"])
def test_gpu_batches_stay_intact_while_later_ones_arrive(kind, photo_folder):
    # DALI's default executor hands its output buffers to torch through DLPack without a copy; a
    # buffer DALI reused for a later batch would change a batch the training step still holds.
    if kind == "arrays":
        src, kw = indexed_source(4096, size=16, channels=3), dict(batch_size=128, augment=NONE)
    else:
        src, kw = ImageFolder(photo_folder), dict(batch_size=2, augment=Augmentation.imagenet_eval(size=64))
    loader = gpu(src, train=True, **kw)
    kept, sums, more = [], [], 0
    while more < 20:
        for x, _ in loader:
            if len(kept) < 3:
                kept.append(x)
                sums.append(x.double().sum())  # on the GPU, in stream order: no host wait
            else:
                more += 1
                if more == 20:
                    break
    assert torch.equal(torch.stack(sums).cpu(), torch.stack([x.double().sum() for x in kept]).cpu())
    if kind == "arrays":
        plan = EpochPlan(4096, 128, True, True, 0)
        for x, want in zip(kept, plan.batches(0)):
            np.testing.assert_array_equal(decode_ids(x), want)


@pytest.mark.cuda
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_gpu_broken_file_raises_or_is_skipped(tmp_path, photo_folder, damage):
    root, bad = _broken_folder(tmp_path, photo_folder, DAMAGE[damage])
    src = ImageFolder(root)
    for seed in range(2):
        with pytest.raises(DecodeError, match=bad.name):
            list(gpu(src, batch_size=6, train=True, seed=seed))
    skip = gpu(src, batch_size=6, train=True, seed=0, on_error="skip")
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="skipped 1"):
            assert sum(len(y) for _, y in skip) == 17
        assert skip.skipped == 1
    # Unvalidated, nvJPEG meets the file itself: the probe (one mixed pipeline) still names it.
    loose = gpu(src, batch_size=6, train=False, validate=False)
    try:
        list(loose)
    except DecodeError as e:
        assert e.path == str(bad)


@pytest.mark.cuda
def test_gpu_decodes_photos_on_the_gpu_not_on_dalis_cpu_fallback(tmp_path):
    """A region decode with fancy upsampling is refused by nvJPEG 12.x for chroma-subsampled JPEGs and
    DALI decoded them on its CPU fallback: the right pixels, at the CPU's speed. Measured as this
    process's CPU time (every thread: DALI's, the readers') for an epoch of 2-megapixel 4:2:0 photos,
    against PIL's CPU time to decode them in full (libjpeg-turbo, what the fallback runs). On the GPU
    the host only reads and parses the files (and may spin while waiting for the GPU): well under half."""
    import time

    from PIL import Image

    from fastdata.datasets import make_image_folder

    root = make_image_folder(tmp_path / "big", classes=2, per_class=32, seed=7,
                             size_range=((1600, 1800), (1150, 1250)))
    src = ImageFolder(root)
    start = time.process_time()
    for path in src.paths:
        with Image.open(path) as im:
            assert im.mode == "RGB"
            im.load()                       # a full decode (no draft)
    full = time.process_time() - start
    loader = gpu(src, batch_size=32, train=True, validate=False, num_threads=2)
    assert sum(len(y) for _, y in loader) == 64   # warm-up: the pipeline, nvJPEG's handles, headers read
    torch.cuda.synchronize()
    start = time.process_time()
    for _ in range(2):
        assert sum(len(y) for _, y in loader) == 64
    torch.cuda.synchronize()
    used = (time.process_time() - start) / 2
    assert used < 0.5 * full, f"an epoch took {used:.2f} s of CPU; decoding its photos with PIL {full:.2f} s"
    loader.close()


@pytest.mark.cuda
def test_gpu_memory_flat_over_epochs_and_after_a_break(photo_folder):
    src = ImageFolder(photo_folder)
    loader = gpu(src, batch_size=4, train=True, dtype=torch.bfloat16)
    for _ in loader:
        pass
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for epoch in range(3):
        for i, (x, y) in enumerate(loader):
            if epoch == 1 and i == 1:
                break  # an abandoned epoch: its prefetched batches must not stay allocated
        del x, y
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= base + (1 << 20), (epoch, base, torch.cuda.memory_allocated())
    loader.close()


def test_a_failed_epochs_pipeline_is_freed_at_once_not_by_the_cyclic_gc(tmp_path):
    """The DecodeError's traceback held DALI's frames, and they the pipeline, in a reference cycle: its
    threads lived on until the cyclic GC ran (12 → 40 threads over 20 failed epochs here)."""
    import gc
    import os

    from fastdata.datasets import make_image_folder

    root = make_image_folder(tmp_path / "photos", classes=2, per_class=8, seed=0, size_range=((40, 60), (30, 50)))
    bad = sorted(root.rglob("*.jpg"))[5]
    bad.write_bytes(bad.read_bytes()[:200])
    loader = make_loader(ImageFolder(root), "dali", batch_size=8, num_workers=2, device="cpu",
                         augment=Augmentation.imagenet_train(size=32))

    def threads():
        return len(os.listdir("/proc/self/task"))

    gc.disable()   # what happens between two runs of the cyclic GC
    try:
        counts = []
        for _ in range(8):
            with pytest.raises(DecodeError, match=bad.name):
                for _ in loader:
                    pass
            counts.append(threads())
    finally:
        gc.enable()
        loader.close()
    assert max(counts) <= counts[0] + 2, counts


@pytest.mark.parametrize("decode", ["host", "dali"])
def test_a_photo_replaced_in_place_between_epochs_is_read_again(tmp_path, decode):
    """dali kept each file's size from its first read: a photo replaced by one of another size got its
    boxes drawn for the old size (a wrong crop, or a box outside the image). Now the next epoch equals
    a fresh loader's, as the torch backend's does; decoded in DALI, which reads the files itself after
    their first epoch, a stat tells the change."""
    import os

    from PIL import Image

    from fastdata.datasets import make_image_folder

    root = make_image_folder(tmp_path / "photos", classes=2, per_class=6, seed=0, size_range=((60, 80), (50, 70)))
    aug = Augmentation.imagenet_train(size=32)

    def loader():
        return make_loader(ImageFolder(root), "dali", batch_size=4, num_workers=2, device="cpu", augment=aug, seed=3,
                           decode=decode)

    used = loader()
    for _ in used:
        pass
    target = sorted(root.rglob("*.jpg"))[3]
    for size in ((200, 150), (30, 24)):        # larger, then smaller than the box drawn for the old size
        # Written aside and renamed over it: saved in place, the stream's read-ahead could meet the file
        # truncated to 0 bytes mid-write (a fresh-clone CI under load: "empty file (0 bytes)").
        Image.new("RGB", size, (200, 30, 90)).save(target.with_suffix(".tmp"), "JPEG", quality=95)
        os.replace(target.with_suffix(".tmp"), target)
        os.utime(target, ns=(os.stat(target).st_atime_ns, os.stat(target).st_mtime_ns + 10**9))
        # The stream had read the next epoch's first batches ahead, before the replacement: that epoch
        # may still show the old photo there. The one after it reads every file after the change.
        for _ in used:
            pass
        epoch = used.epoch
        fresh = loader()
        fresh.set_epoch(epoch)
        for (a, ya), (b, yb) in zip(used, fresh, strict=True):
            assert torch.equal(a, b) and torch.equal(ya, yb)
        fresh.close()
    used.close()


# ------------------------------------------------------------------------- threads that let a program end
_SLOW_FOLDER = '''
import sys, threading, time
from fastdata import make_loader
from fastdata.config import Augmentation
from fastdata.datasets import ImageFolder

class SlowFolder(ImageFolder):
    """A folder on a storage that hangs: every file after the first 3 batches' takes {pause} s to read."""
    def read_stamped(self, i):
        if i not in FAST and threading.current_thread() is not threading.main_thread():
            time.sleep({pause})
        return super().read_stamped(i)

src = SlowFolder(sys.argv[1])
loader = make_loader(src, "dali", batch_size=4, device="cpu", num_workers=2, shuffle=False, train=False,
                     augment=Augmentation.imagenet_eval(size=32))
FAST = set(range(12))   # DALI's first next() asks for 2 batches (its prefetch), then for a third
'''


def _dali_threads(ignore=()):
    """The names of the live dali reading threads, but ``ignore``'s (threads of loaders of earlier tests,
    which a failed test may leave open: one such failure made the next test's count wrong)."""
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("fastdata-dali") and t not in ignore]


def _dali_thread_objects():
    import threading

    return {t for t in threading.enumerate() if t.name.startswith("fastdata-dali")}


def test_a_program_that_never_closes_its_loader_exits_at_once(photo_folder, tmp_path):
    """The readers were ThreadPoolExecutor threads, which the interpreter joins at exit: a loader left
    open with a read in progress (a hung file system here, a slow one in practice) kept the program
    from ending. Daemon threads and the exit hook that closes live loaders let it end."""
    import subprocess
    import sys
    import time

    script = tmp_path / "never_closed.py"
    script.write_text(_SLOW_FOLDER.format(pause=600) + "x, y = next(iter(loader))\nprint('got', len(y), flush=True)\n")
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])   # this checkout's fastdata, not an installed one
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(photo_folder)], capture_output=True, text=True,
                          env=env, timeout=120)   # a hang guard: the old loader waited for the 600 s reads
    assert proc.returncode == 0 and "got 4" in proc.stdout, proc.stderr[-2000:]
    assert time.monotonic() - start < 100


@pytest.mark.parametrize("how", ["close", "garbage_collected"])
def test_no_reading_thread_outlives_its_loader(photo_folder, how):
    """close() joins the threads (it used to leave them finishing their reads); a loader dropped
    without close() is collected, and closes them too."""
    import gc
    import time

    ns: dict = {}
    before = _dali_thread_objects()
    exec(_SLOW_FOLDER.format(pause=0.3).replace("sys.argv[1]", repr(str(photo_folder))), ns)
    loader = ns["loader"]
    it = iter(loader)
    next(it)
    assert _dali_threads(before)           # reading ahead: some reads are still sleeping
    if how == "close":
        loader.close()
        assert _dali_threads(before) == []
    else:
        # The reads in flight hold the loader until they end; then it is collected and closes the pool
        # (collected by the cyclic GC here: exec's namespace and the folder's class refer to each other).
        del it, loader, ns
        deadline = time.monotonic() + 10
        while _dali_threads(before) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert _dali_threads(before) == []


# ---------------------------------------------------------------------------- one pipeline per loader
def _count_builds(monkeypatch):
    from fastdata.backends.dali import DaliLoader

    builds = []
    real = DaliLoader._build

    def counting(self):
        builds.append(self.epoch)
        return real(self)

    monkeypatch.setattr(DaliLoader, "_build", counting)
    return builds


@pytest.mark.parametrize("consumer", ["islice", "full_loop", "break_then_fresh_iter"])
def test_one_pipeline_serves_every_epoch(monkeypatch, consumer):
    """Lightning and islice(loader, len(loader)) take exactly len(loader) batches and never the one more
    that ended DALI's epoch: 4 epochs built 4 pipelines. DALI now sees one stream; the batches stay
    those of each epoch's plan, pixel for pixel the torch backend's (random crops and flips)."""
    import itertools

    builds = _count_builds(monkeypatch)
    src = _colour_arrays(n=300)
    kw = dict(batch_size=64, train=True, drop_last=False, seed=8, augment=Augmentation.cifar_train(pad=2))
    loader, ref = dali(src, **kw), torch_loader(src, **kw)
    for epoch in range(4):
        if consumer == "islice":
            got = list(itertools.islice(loader, len(loader)))
        elif consumer == "full_loop":
            got = [b for b in loader]
        else:
            for _ in zip(range(2), loader):   # a pass left early: read again from its start
                pass
            got = list(loader)
        want = list(ref)
        assert len(got) == len(want) == 5
        for (x, y), (wx, wy) in zip(got, want):
            assert torch.equal(x, wx) and torch.equal(y, wy), epoch
    if consumer == "break_then_fresh_iter":
        assert len(builds) == 5   # one, then one after each break (the stream held that pass's batches)
    else:
        assert builds == [0]


def test_a_stream_is_rebuilt_only_where_the_position_jumps(monkeypatch, photo_folder):
    """set_epoch to another epoch, a resumed position, or the same epoch again: a new stream. Files
    decoded in DALI give the same batches as a loader built for that epoch alone."""
    builds = _count_builds(monkeypatch)
    src = ImageFolder(photo_folder)
    kw = dict(batch_size=4, train=True, seed=6, decode="dali", augment=Augmentation.imagenet_train(size=32))
    loader = dali(src, **kw)

    def alone(epoch):
        fresh = dali(src, **kw)
        fresh.set_epoch(epoch)
        return list(fresh)

    for epoch in (0, 1, 2):
        got = list(loader)
        for (x, y), (wx, wy) in zip(got, alone(epoch), strict=True):
            assert torch.equal(x, wx) and torch.equal(y, wy), epoch
    own = [b for b in builds if b is not None]
    assert len(own) == 4 and own[0] == 0     # the loader's one build, and one per fresh loader (3)
    loader.set_epoch(7)
    assert torch.equal(torch.cat([y for _, y in loader]), torch.cat([y for _, y in alone(7)]))
    assert len(builds) == 4 + 2              # set_epoch(7): rebuilt; and the fresh loader's own
    loader.set_epoch(8)                      # exactly where the stream is: no rebuild
    list(loader)
    assert len(builds) == 6


# ------------------------------------------------------------------- files read by DALI, not by Python
def _count_reads(monkeypatch):
    """Count the bytes read in Python: ImageFolder.read_stamped reads through folders.read_file."""
    import fastdata.datasets.folders as folders

    reads = []
    real = folders.read_file

    def counting(path):
        reads.append(str(path))
        return real(path)

    monkeypatch.setattr(folders, "read_file", counting)
    return reads


def test_plain_files_decoded_in_dali_are_read_by_dali_after_their_first_epoch(photo_folder, monkeypatch):
    """decode="dali" read every file in Python every epoch (a read and a copy per sample on the
    training host's cores). Now only the first epoch does (each file's size, EXIF and integrity); later
    epochs feed the names to fn.io.file.read. The pixels stay the byte path's."""
    from fastdata.datasets import ImageFolder as Folder

    class CopyFolder(Folder):
        """Not plain files to DALI: its bytes come through its own read_stamped (here, unchanged)."""

        def read_stamped(self, i):
            return super().read_stamped(i)

    reads = _count_reads(monkeypatch)
    called = _record_graph_ops(monkeypatch)
    kw = dict(batch_size=4, train=True, seed=2, decode="dali", augment=Augmentation.imagenet_train(size=48))
    by_name = dali(ImageFolder(photo_folder), **kw)
    epochs = [torch.cat([x for x, _ in by_name]) for _ in range(3)]
    assert sorted(reads) == sorted(map(str, ImageFolder(photo_folder).paths))   # once each, in 3 epochs
    assert [n for n, _ in called] == ["read", "image_slice", "resize"]
    reads.clear()
    called.clear()
    by_bytes = dali(CopyFolder(photo_folder), **kw)
    for want in epochs:
        assert torch.equal(torch.cat([x for x, _ in by_bytes]), want)
    assert len(reads) >= 3 * 18 and [n for n, _ in called] == ["image_slice", "resize"]


def test_unchanged_files_take_no_per_file_path_in_names_only_epochs(photo_folder, monkeypatch):
    """Once every file is learnt, an epoch decoded in DALI only stats each file and feeds its name: a
    batch whose files all kept their stamps goes through one list operation, not ``_read_file`` per
    file (whose Python cost per file was as large as the stat's), nor the scan for files to refuse. The
    batches stay a fresh loader's."""
    from fastdata.backends.dali import DaliLoader

    kw = dict(batch_size=4, train=True, seed=2, decode="dali", augment=Augmentation.imagenet_train(size=32))
    used = dali(ImageFolder(photo_folder), **kw)
    for _ in range(2):    # the first epoch learns the files; the second's read-ahead ran during the first
        for _ in used:
            pass
    calls = []
    real = DaliLoader._read_file
    monkeypatch.setattr(DaliLoader, "_read_file",
                        lambda self, i, *stat: calls.append((self is used, i)) or real(self, i, *stat))
    refusals = []   # the per-file refusal scan: none for a batch of known, unchanged files either
    scan = DaliLoader._refuse_unusable
    monkeypatch.setattr(DaliLoader, "_refuse_unusable",
                        lambda self, *a: refusals.append(self is used) or scan(self, *a))
    fresh = dali(ImageFolder(photo_folder), **kw)
    fresh.set_epoch(used.epoch)
    for (a, ya), (b, yb) in pairs(used, fresh):
        assert torch.equal(a, b) and torch.equal(ya, yb)
    for _ in used:
        pass
    fresh.close()
    assert {i for known, i in calls if not known} == set(range(18))   # the fresh loader learns each file
    assert [i for known, i in calls if known] == []                    # the loader that knows them: none
    assert True not in refusals and False in refusals


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_file_gone_after_its_first_epoch_is_named_or_skipped(tmp_path, photo_folder, on_error):
    root = tmp_path / "photos"
    shutil.copytree(photo_folder, root)
    loader = dali(ImageFolder(root), batch_size=4, train=False, decode="dali", on_error=on_error)
    assert sum(len(y) for _, y in loader) == 18
    gone = root / "class_001" / "img_00003.jpg"
    gone.unlink()
    if on_error == "raise":
        with pytest.raises(DecodeError, match=gone.name):
            list(loader)
    else:
        with pytest.warns(RuntimeWarning, match="skipped 1"):
            assert sum(len(y) for _, y in loader) == 17


@pytest.mark.parametrize("change", ["replaced", "gone"])
def test_a_batch_with_a_changed_file_stats_each_file_once(tmp_path, photo_folder, monkeypatch, change):
    """decode="dali" stats a known batch's files to notice a photo replaced in place. When one had
    changed (or could not be stat'ed), the per-file path that learns it stat'ed the whole batch again:
    two stats a file. Now the stats just taken are handed on: one each, whatever changed."""
    import collections
    import os

    from PIL import Image

    import fastdata.decode.dali_files as dali_files

    root = tmp_path / "photos"
    shutil.copytree(photo_folder, root)
    loader = dali(ImageFolder(root), batch_size=4, train=False, decode="dali", on_error="skip")
    assert sum(len(y) for _, y in loader) == 18   # every file learnt: later batches are names only
    loader.close()                                # no read-ahead thread stats files behind the test
    paths, ids = [str(p) for p in loader.source.paths], np.arange(4)
    target = paths[2]
    if change == "replaced":
        Image.new("RGB", (41, 37), (200, 30, 90)).save(target, quality=95)
        os.utime(target, ns=(os.stat(target).st_atime_ns, os.stat(target).st_mtime_ns + 10**9))
    else:
        os.unlink(target)
    stats, real = collections.Counter(), os.stat
    monkeypatch.setattr(dali_files.os, "stat", lambda path, *a, **kw: stats.update([str(path)]) or real(path, *a, **kw))
    inputs, record = loader.prepare(loader.epoch, 0, ids)
    assert {p: n for p, n in stats.items() if p in paths} == {paths[i]: 1 for i in ids}
    kept = [0, 1, 2, 3] if change == "replaced" else [0, 1, 3]
    assert len(inputs[0]) == len(kept) and inputs[0].dtype == np.uint8   # the names DALI is fed
    assert list(loader._dims[2, :2]) == [37, 41] or change == "gone"     # the replacement learnt

# ------------------------------------------------------------------------------------ decoder options
def test_decoder_options_reach_the_pipeline(photo_folder, monkeypatch):
    """hw_decoder_load, fancy_upsampling, affine and preallocate's hints (from the first batch's photos,
    read before the pipeline is built) are the decoder's arguments; affine is the pipeline's too. The
    CPU decoder accepts the mixed-only ones (DALI ignores them there), so the graph is checked here."""
    called = _record_graph_ops(monkeypatch)
    src = ImageFolder(photo_folder)
    loader = dali(src, batch_size=6, train=False, decode="dali", hw_decoder_load=0.25, fancy_upsampling=False,
                  affine=True, prefetch_queue_depth=3)
    assert sum(len(y) for _, y in loader) == 18
    kw = dict(called[1][1])
    assert called[1][0] == "image_slice"
    assert kw["hw_decoder_load"] == 0.25 and kw["jpeg_fancy_upsampling"] is False and kw["affine"] is True
    first = loader.plan.batches(0)[0]
    height, width = (int(v) for v in loader._dims[first, :2].max(0))
    assert height > 0 and (kw["preallocate_height_hint"], kw["preallocate_width_hint"]) == (height, width)
    assert kw["device_memory_padding"] >= 3 * height * width and kw["host_memory_padding"] >= 8 << 20
    assert loader._pipe._set_affinity is True and loader._pipe.prefetch_queue_depth == 3
    called.clear()
    plain = dali(src, batch_size=6, train=False, decode="dali", preallocate=False)
    list(plain)
    kw = dict(called[1][1])
    assert "preallocate_width_hint" not in kw and kw["hw_decoder_load"] == 1.0 and kw["affine"] is False
    assert kw["jpeg_fancy_upsampling"] is True and plain._pipe._set_affinity is False


@pytest.mark.parametrize("name, value, message", [
    ("hw_decoder_load", 1.5, r"hw_decoder_load must be a number in \[0, 1\]"),
    ("hw_decoder_load", "high", r"hw_decoder_load must be a number in \[0, 1\]"),
    ("hw_decoder_load", True, r"hw_decoder_load must be a number in \[0, 1\]"),
    ("preallocate", "yes", "preallocate must be True or False"),
    ("fancy_upsampling", 1, "fancy_upsampling must be True or False"),
    ("affine", None, "affine must be True or False"),
    ("prefetch_queue_depth", 0, "prefetch_queue_depth must be an integer >= 1 or None, got 0"),
    ("num_threads", 2.0, "num_threads must be an integer >= 1 or None, got 2.0"),
    ("decode", "gpu", r"unknown decode 'gpu'; choose from \['auto', 'host', 'dali'\]"),
])
def test_bad_decoder_options_are_refused_by_name(name, value, message):
    with pytest.raises(ValueError, match=message):
        dali(indexed_source(64), batch_size=32, **{name: value})


def test_prefetch_depth_defaults_to_4_on_a_gpu_where_memory_allows():
    from fastdata.decode.dali_options import DaliOptions, default_depth

    assert default_depth(gpu=False, batch_bytes=1 << 20, free_bytes=None) == 2
    assert default_depth(gpu=True, batch_bytes=1 << 20, free_bytes=None) == 4
    batch = 256 * 3 * 224 * 224 * 4                       # 154 MB of float32 outputs per batch
    assert default_depth(gpu=True, batch_bytes=batch, free_bytes=70 << 30) == 4
    assert default_depth(gpu=True, batch_bytes=batch, free_bytes=2 << 30) == 2   # 4 batches > 1/8 of it
    resolved = DaliOptions().resolve(num_workers=3, gpu=True, batch_bytes=batch, free_bytes=70 << 30)
    assert (resolved.num_threads, resolved.read_threads, resolved.prefetch_queue_depth) == (3, 3, 4)
    assert DaliOptions(prefetch_queue_depth=6).resolve(1, True, batch, 70 << 30).prefetch_queue_depth == 6
    assert dali(indexed_source(64), batch_size=32).prefetch_queue_depth == 2        # the CPU


def test_a_prefetch_depth_whose_outputs_cannot_fit_is_refused(monkeypatch):
    """DALI fills its whole queue before the first batch: a depth of 10**9 hung with no error (100,000
    too, on 200 KB batches of digits). A depth whose output batches alone exceed the free memory is
    refused, naming the numbers and the most that fits."""
    import fastdata.backends.dali as dali_backend
    from fastdata.decode.dali_options import DaliOptions

    batch = 256 * 3 * 224 * 224 * 4                       # 154 MB of float32 outputs per batch
    with pytest.raises(ValueError, match=r"prefetch_queue_depth=100 keeps 100 output batches of 147.0 MiB "
                                         r"each \(14.36 GiB\) ahead, more than the 2.00 GiB free on the GPU: "
                                         r"at most 13 fit\. DALI prepares every one before the first batch"):
        DaliOptions(prefetch_queue_depth=100).resolve(1, True, batch, 2 << 30)
    with pytest.raises(ValueError, match="not one fits: make the batches smaller"):
        DaliOptions(prefetch_queue_depth=1).resolve(1, True, batch, 1 << 20)
    assert DaliOptions(prefetch_queue_depth=13).resolve(1, True, batch, 2 << 30).prefetch_queue_depth == 13
    # Through make_loader on the CPU: the host's available RAM (cgroup-capped) is the bound.
    monkeypatch.setattr(dali_backend, "available_ram", lambda: 64 << 10)
    with pytest.raises(ValueError, match=r"prefetch_queue_depth=64 .* free on the host: at most 8 fit"):
        dali(indexed_source(64), batch_size=32, prefetch_queue_depth=64)     # 32 x 1x8x8 float32: 8 KiB
    assert dali(indexed_source(64), batch_size=32, prefetch_queue_depth=2).prefetch_queue_depth == 2


def test_nvjpeg_hints_cover_the_largest_photo_known():
    from fastdata.decode.dali_options import MAX_PADDING, nvjpeg_hints

    assert nvjpeg_hints(None) == {} and nvjpeg_hints(np.zeros((0, 2), np.int32)) == {}
    small = nvjpeg_hints(np.array([[300, 400], [500, 375]]))
    assert (small["preallocate_height_hint"], small["preallocate_width_hint"]) == (500, 400)
    assert small["device_memory_padding"] == 16 << 20 and small["host_memory_padding"] == 8 << 20   # DALI's
    big = nvjpeg_hints(np.array([[3000, 4000]]))
    assert big["device_memory_padding"] == big["host_memory_padding"] == 35 << 20   # 36 MB, whole MiB
    assert nvjpeg_hints(np.array([[9000, 9000]]))["device_memory_padding"] == MAX_PADDING


def _bench_dali_cpu():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dali_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_dali_cpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("decode", ["dali", "host"])
def test_labels_come_from_the_batch_record_not_through_dali(photo_folder, decode):
    """Labels are known in Python: fed through DALI they cost an input, an output and a DLPack hand-over
    per batch. The inputs fed hold images (or names), boxes and flips only; the labels handed out are
    the source's for the batch's files, int64."""
    loader = dali(ImageFolder(photo_folder), batch_size=4, train=True, seed=3, decode=decode,
                  augment=Augmentation.imagenet_train(size=32))
    got = torch.cat([y for _, y in loader])
    fed = loader._feeder.last
    assert not any(isinstance(x, np.ndarray) and x.dtype == np.int64 for x in fed), [np.asarray(x).dtype for x in fed]
    order = np.concatenate(loader.plan.batches_from(0, 0))
    assert got.dtype == torch.int64 and torch.equal(got, torch.as_tensor(ImageFolder(photo_folder).labels[order]))
    loader.close()


def test_the_cpu_benchmark_times_every_pipeline_on_the_same_images(tmp_path):
    """benchmarks/bench_dali_cpu.py's measure_pair (another script imports it) times every contender
    every round, and its ratios are the per-round ratios of those epochs, against each ceiling."""
    bench = _bench_dali_cpu()
    root = bench.small_jpegs(tmp_path / "jpegs", 40)
    assert len(list(root.rglob("*.jpg"))) == 40
    res = bench.measure_pair(root, batch=16, size=32, threads=1, rounds=2)
    assert res["images"] == 40 and set(res["rates"]) == {bench.READER, bench.FASTDATA, bench.BOX_READER}
    ours, theirs = res["rates"][bench.FASTDATA], res["rates"][bench.READER]
    box = res["rates"][bench.BOX_READER]
    assert len(ours) == len(theirs) == len(box) == 2 and min(ours + theirs + box) > 0
    assert res["ratios"] == pytest.approx([a / b for a, b in zip(ours, theirs)])
    assert res["vs_box"]["ratios"] == pytest.approx([a / b for a, b in zip(ours, box)])
    assert min(res["cpu_ms_per_image"][bench.FASTDATA]) > 0
    # Two rounds: the median's interval is the two rounds; the verdict reads the interval.
    assert res["ratio_interval"] == res["ratio_range"] == [min(res["ratios"]), max(res["ratios"])]
    res.update(ratio=1.0, ratio_interval=[0.96, 1.1], ratio_range=[0.5, 1.9])
    status, _, text = bench._verdict(res, "readers.file")
    assert status == "met" and "95% interval of the median 0.960–1.100; rounds 0.500–1.900" in text


def test_the_cpu_benchmark_ceiling_decodes_the_window_fastdata_decodes():
    """The ceiling of bench_dali_cpu.py is the same graph: for any box, its DALI arithmetic gives the
    window DaliFiles._windows (what the dali backend decodes) gives, margins and clipping included.
    (It first decoded the box alone with decoders.image_random_crop: less work than fastdata's.)"""
    from types import SimpleNamespace

    from nvidia.dali import fn, pipeline_def, types

    from fastdata.decode.dali_files import DaliFiles

    bench, size = _bench_dali_cpu(), 32
    rng = np.random.default_rng(0)
    hw = rng.integers(20, 300, (64, 2)).astype(np.int32)
    box = (rng.random((64, 2)) * (hw - 1) + 1).astype(np.int32)   # (h, w) in 1..side
    box[:4] = hw[:4]                                                # whole photos: clipped on every side
    anchor = (rng.random((64, 2)) * (hw - box + 1)).astype(np.int32)

    @pipeline_def(batch_size=64, num_threads=1, device_id=None)
    def window():
        h, a, b = (fn.external_source(source=[list(v)], dtype=types.INT32) for v in (hw, anchor, box))
        return bench.window_nodes(h, a, b, size)

    pipe = window()
    pipe.build()
    y0, shape = (np.stack([np.asarray(t) for t in out]) for out in pipe.run())
    dims = np.concatenate([hw, np.ones((64, 1), np.int32)], 1)   # upright photos
    boxes = np.concatenate([anchor, box], 1).astype(np.float64)
    me = SimpleNamespace(augment=SimpleNamespace(size=size))
    want_anchor, want_shape, _, _ = DaliFiles._windows(me, dims, boxes, True)
    np.testing.assert_array_equal(y0, want_anchor)
    np.testing.assert_array_equal(shape, want_shape)


@pytest.mark.cuda
def test_gpu_program_that_never_closes_its_loader_exits_at_once(photo_folder, tmp_path):
    """On the H200, pytest did not end after the DALI tests' summary: loaders were never closed, their
    reading threads were joined at exit and their GPU pipelines torn down in module teardown. A script
    that reads part of an epoch on the GPU and exits without close() must end promptly and cleanly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "gpu_never_closed.py"
    script.write_text(
        "import sys\nfrom fastdata import make_loader\nfrom fastdata.config import Augmentation\n"
        "from fastdata.datasets import ImageFolder\n"
        "loader = make_loader(ImageFolder(sys.argv[1]), 'dali', batch_size=4, device='cuda', train=True,\n"
        "                     augment=Augmentation.imagenet_train(size=64))\n"
        "it = iter(loader)\nx, y = next(it)\nprint('got', tuple(x.shape), x.device.type, flush=True)\n")
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), str(photo_folder)], capture_output=True, text=True,
                          env=env, timeout=120)   # the hang guard
    assert proc.returncode == 0 and "got (4, 3, 64, 64) cuda" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.cuda
def test_gpu_one_pipeline_reads_files_in_dali_with_the_decoder_options(photo_folder, monkeypatch):
    """On the GPU: one build over 3 epochs taken with islice, Python reads each file once (later
    epochs feed names to fn.io.file.read), and the options reach nvJPEG's ("mixed") decoder."""
    import itertools

    builds = _count_builds(monkeypatch)
    reads = _count_reads(monkeypatch)
    called = _record_graph_ops(monkeypatch)
    src = ImageFolder(photo_folder)
    kw = dict(batch_size=4, train=True, seed=3, augment=Augmentation.imagenet_train(size=64))
    loader = gpu(src, hw_decoder_load=0.5, fancy_upsampling=True, **kw)
    assert loader.prefetch_queue_depth == 4
    labels = [torch.cat([y for _, y in itertools.islice(loader, len(loader))]).cpu() for _ in range(3)]
    assert builds == [0] and sorted(reads) == sorted(map(str, src.paths))
    assert [n for n, _ in called] == ["read", "image", "resize"]
    kwargs = called[1][1]
    assert kwargs["device"] == "mixed" and kwargs["hw_decoder_load"] == 0.5 and kwargs["affine"] is False
    assert kwargs["preallocate_width_hint"] > 0 and kwargs["device_memory_padding"] >= 16 << 20
    ref = dali(src, decode="dali", **kw)
    for want in labels:
        assert torch.equal(torch.cat([y for _, y in ref]), want)


def test_a_stream_of_only_empty_batches_ends_every_pass(monkeypatch):
    """3 samples over 4 ranks: rank 3's one batch is empty in every epoch. The endless stream scanned
    empty batches forever looking for one to give DALI (the process grew by gigabytes). The feeder gives
    up after more than an epoch of them, and each pass still yields its empty batch."""
    builds = _count_builds(monkeypatch)
    loader = dali(indexed_source(3), batch_size=2, train=False, augment=NONE, rank=3, world_size=4)
    for _ in range(3):
        got = list(loader)
        assert [tuple(x.shape) for x, _ in got] == [(0, 1, 8, 8)]
    assert len(builds) <= 3   # a stream that gave up is restarted where more is needed, at most once a pass
    mixed = dali(indexed_source(9), batch_size=2, train=False, augment=NONE, rank=1, world_size=4)
    for _ in range(3):   # a full batch, then an empty one, epoch after epoch on one stream
        assert [len(y) for _, y in mixed] == [2, 0]


@pytest.mark.parametrize("driver", ["caller", "thread"])
@pytest.mark.parametrize("decode", ["host", "dali"])
def test_a_broken_file_is_raised_at_its_batch_after_every_batch_before_it(tmp_path, photo_folder, decode, driver):
    """The error of a file read ahead was raised into DALI's prefetch: the consumer lost the batches
    before it (and with the stream, a file of the next epoch would have failed this one). Now the
    batches before it arrive, then the DecodeError, as the torch backend does."""
    root, bad = _broken_folder(tmp_path, photo_folder, lambda b: b[: len(b) // 2])
    src = ImageFolder(root)
    index = [str(p) for p in src.paths].index(str(bad))
    loader = dali(src, batch_size=2, train=False, shuffle=False, decode=decode, prefetch_queue_depth=3,
                  driver=driver)
    got = []
    with pytest.raises(DecodeError, match=bad.name):
        for _, y in loader:
            got.append(y)
    assert len(got) == index // 2 and index // 2 >= 3


@pytest.mark.parametrize("recipe, inputs", [("translate", 2), ("center", 3), ("none", 2), ("photos", 4)])
def test_a_batch_is_fed_to_dali_in_fewer_inputs_its_parameters_packed(recipe, inputs, photo_folder, monkeypatch):
    """Each input of a batch is a feed through DALI's Python (``Pipeline._feed_input``) inside
    ``schedule_run``, on the training thread: ~90 us each behind a training step on this CPU. So the
    samples' parameters go in one array, split in the graph by subscripts (the decode window of photos
    on the CPU in a second; the flips alone where the array is float: a cast in DALI cost more than
    the feed), not 4 to 6 inputs; the pixels stay the torch backend's."""
    from nvidia.dali.pipeline import Pipeline

    fed: list = []
    real = Pipeline._feed_input
    monkeypatch.setattr(Pipeline, "_feed_input",
                        lambda self, name, *a, **k: fed.append(name) or real(self, name, *a, **k))
    if recipe == "photos":
        src, kw = ImageFolder(photo_folder), dict(batch_size=3, train=True, decode="dali", validate=False)
    else:
        crop = {"translate": dict(crop="translate", pad=2), "center": dict(crop="center", size=20, resize=24),
                "none": dict(crop="none")}[recipe]
        src = SyntheticDigits(60, seed=1)
        kw = dict(batch_size=20, augment=Augmentation(hflip=0.5, **crop))
    loader = dali(src, seed=3, **kw)
    got = [(x.clone(), y.clone()) for x, y in loader]
    # DALI is fed ahead (its queue, and the next epoch's first batches): the inputs, each fed once a batch.
    assert len(set(fed)) == inputs and len(fed) >= inputs * len(loader) and len(fed) % inputs == 0, fed
    if recipe in ("translate", "none"):   # the torch backend's pixels (resizes differ by ~0.01 anyway)
        for (x, y), (tx, ty) in zip(got, torch_loader(src, seed=3, **kw), strict=True):
            torch.testing.assert_close(x, tx, rtol=0, atol=1e-5)
            assert torch.equal(y, ty)


@pytest.mark.parametrize("source", ["digits", "photos-with-a-broken-file"])
def test_a_pass_uploads_its_labels_once_and_a_batch_with_a_skipped_file_its_own(source, photo_folder, tmp_path,
                                                                                 monkeypatch):
    """A batch's labels were pinned and copied to the device one batch at a time, on the training thread
    (161 us of each ~1.2 ms wait on the H200's first command): a pass uploads the labels of its planned
    batches once and hands out views. A batch that lost a file (on_error="skip") has other labels: its
    own, from its record. Either way every row's label is its sample's (batch_ids)."""
    from fastdata.backends import dali as dali_module

    uploads = []
    real = dali_module.labels_on
    monkeypatch.setattr(dali_module, "labels_on",
                        lambda device, labels: uploads.append(len(labels)) or real(device, labels))
    if source == "digits":
        src = SyntheticDigits(100, seed=1)
        loader = dali(src, batch_size=30, drop_last=False, augment=Augmentation(crop="translate", pad=2))
    else:
        root = tmp_path / "one_bad"
        shutil.copytree(photo_folder, root)
        (root / "class_001" / "img_00002.jpg").write_bytes(b"not a jpeg")
        src = ImageFolder(root)
        loader = dali(src, batch_size=4, train=False, on_error="skip", drop_last=False)
    for _ in range(2):
        uploads.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # the skipped file, once a pass
            for _, y in loader:
                assert y.tolist() == [int(src.labels[i]) for i in loader.batch_ids]
        if source == "digits":
            assert uploads == [100]                           # the pass's labels, once
        else:                                                 # the pass's, and the short batch's own
            assert sorted(uploads) == [3, 18]
