"""Review of 9816a6f (dali: an array batch's draws made for the next 64 full batches at once), 172e77e
(a record keeps the source's labels array, gathered lazily), fa9b320 (ids_keeper(None): the planned
samples) and 6ee63ca (memory: a group of one batch is the gather itself)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import skip_missing

try:
    import nvidia.dali.plugin.pytorch  # noqa: F401
except ImportError as e:
    skip_missing(f"the dali backend needs nvidia-dali-cuda120 ({e})", allow_module_level=True)
from fastdata.datasets import ArraySource  # noqa: E402
from test_dali import _close_what_the_test_opened, dali, torch_loader  # noqa: E402,F401


def _arrays(n):
    images = np.random.default_rng(5).integers(1, 256, (n, 9, 8, 3), dtype=np.uint8)
    return ArraySource(images, np.arange(n) % 10, mean=(0.0,) * 3, std=(1.0,) * 3)


def _pass(loader):
    xs, ys, ids = [], [], []
    for x, y in loader:
        xs.append(x.clone())
        ys.append(y.clone())
        ids.append(loader.batch_ids.copy())
    return xs, ys, ids


def _same(a, b):
    (xa, ya, ia), (xb, yb, ib) = a, b
    assert [len(x) for x in xa] == [len(x) for x in xb]
    for p, q in zip(xa, xb):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    for p, q in zip(ya, yb):
        assert torch.equal(p, q)
    for p, q in zip(ia, ib):
        assert np.array_equal(p, q)


@pytest.mark.parametrize("driver", ["caller", "thread"])
def test_ranks_even_batches_epochs_and_elastic_resume_match_torch(driver):
    n = 1403
    src = _arrays(n)
    for rank in (0, 1):
        kw = dict(batch_size=5, train=True, seed=11, drop_last=False, world_size=2, rank=rank, even_batches=True)
        t, d = torch_loader(src, **kw), dali(src, driver=driver, **kw)
        for epoch in (0, 1):   # the stream goes on into the next epoch
            _same(_pass(d), _pass(t))
        t.set_epoch(5)
        d.set_epoch(5)
        _same(_pass(d), _pass(t))
        # a pass left early mid-stretch, then an elastic resume from another layout at an odd offset
        it = iter(d)
        for _ in range(70):
            next(it)
        del it
        other = torch_loader(src, batch_size=3, train=True, seed=11, drop_last=False, world_size=1, rank=0)
        it = iter(other)
        for _ in range(131):
            next(it)
        state = other.state_dict()
        del it
        for lo in (t, d):
            lo.load_state_dict(state)
        _same(_pass(d), _pass(t))
        _same(_pass(d), _pass(t))


@pytest.mark.parametrize("rank", [0, 2, 3])
def test_ids_of_a_skipped_padding_file_match_the_torch_backend(tmp_path, photo_folder, rank):
    """fa9b320: dali says None (the planned samples) for a batch that lost no file and the ids it kept
    otherwise. 18 photos over 4 ranks, batches of 2, even_batches: the last step pads with the epoch's
    first samples, and photo 0 (in the first batch and the padding) is broken: batch_ids,
    batch_padding, skipped_ids and the labels are the torch backend's, every batch, two passes."""
    import shutil
    import warnings

    from fastdata.datasets import ImageFolder
    root = tmp_path / "bad"
    shutil.copytree(photo_folder, root)
    bad = sorted(root.glob("class_000/*.jpg"))[0]
    bad.write_bytes(bad.read_bytes()[:1500])
    src = ImageFolder(root)
    kw = dict(batch_size=2, world_size=4, rank=rank, even_batches=True, drop_last=False, shuffle=False,
              train=False, on_error="skip")
    got = {}
    for name, lo in (("torch", torch_loader(src, **kw)), ("dali", dali(src, **kw))):
        rows = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(2):
                for _, y in lo:
                    rows.append((lo.batch_ids.tolist(), lo.batch_padding, y.tolist()))
                rows.append(lo.skipped_ids.tolist())
        got[name] = rows
    assert got["dali"] == got["torch"]
    assert got["dali"][-1] == ([] if rank == 3 else [0])   # the broken photo: rank 0 reads it, 2 pads with it
