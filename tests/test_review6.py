"""Review of e038d27/d6cb5ab (dali: a batch's parameters packed into fewer inputs, split in the graph)
and 16421af (dali: a pass's planned labels uploaded once, a view per batch; a record that holds other
samples keeps its own). Reviewed: the same pixels and labels bit for bit as before the three commits
(every recipe, host padding or not, photos decoded by DALI or on the host, shards, skipped files, ranks
with even_batches, empty batches). These hold the label views where the stream is restarted mid-pass
(a DALI failure, fed again from the failed batch) and where a rank's last batch is padded."""
from __future__ import annotations

import shutil
import warnings

import pytest

from conftest import skip_missing

try:
    import nvidia.dali.plugin.pytorch  # noqa: F401
except ImportError as e:
    skip_missing(f"the dali backend needs nvidia-dali-cuda120 ({e})", allow_module_level=True)
from fastdata import Augmentation  # noqa: E402
from fastdata.backends import dali as dali_module  # noqa: E402
from fastdata.datasets import ImageFolder, SyntheticDigits  # noqa: E402
from test_dali import _close_what_the_test_opened, dali  # noqa: E402,F401 (the autouse fixture closes them)


def _count_uploads(monkeypatch) -> list:
    uploads: list = []
    real = dali_module.labels_on
    monkeypatch.setattr(dali_module, "labels_on",
                        lambda device, labels: uploads.append(len(labels)) or real(device, labels))
    return uploads


@pytest.mark.parametrize("driver", ["caller", "thread"])
def test_a_stream_restarted_after_a_dali_failure_keeps_the_pass_labels(tmp_path, photo_folder, driver,
                                                                      monkeypatch):
    """validate=False: a truncated photo fails a DALI batch; the batch's files are probed, the bad one
    skipped, and the stream fed again from that batch (``batches[pos:]``). The batches after it are
    still the pass's planned ones: their labels are views of the pass's upload (one for the pass, and
    the short batch's own), and every row's label is its sample's."""
    root = tmp_path / "one_bad"
    shutil.copytree(photo_folder, root)
    bad = root / "class_000" / "img_00004.jpg"   # sample 4: batch 1 of 6 (not shuffled), 4 planned after it
    bad.write_bytes(bad.read_bytes()[:2000])
    src = ImageFolder(root)
    uploads = _count_uploads(monkeypatch)
    loader = dali(src, batch_size=3, train=False, validate=False, on_error="skip", decode="dali", driver=driver)
    for _ in range(2):   # the failures (restarts), then the files known bad (skipped when prepared)
        uploads.clear()
        sizes = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # "skipped 1"
            for _, y in loader:
                assert y.tolist() == [int(src.labels[i]) for i in loader.batch_ids]
                sizes.append(len(y))
        assert sizes == [3, 2, 3, 3, 3, 3]
        # Positions counted on from the restart's batch: the planned batches after it are views.
        assert sorted(uploads) == [2, 18]


@pytest.mark.parametrize("rank", [0, 1])
def test_even_batches_padding_rows_get_their_samples_labels_from_the_pass_upload(rank, monkeypatch):
    """2 ranks, 13 samples, batches of 4: the last step pads with samples of the epoch's start
    (even_batches). The padding is part of the plan: its rows' labels come from the pass's one upload
    and are their samples' labels."""
    src = SyntheticDigits(13, seed=2)
    uploads = _count_uploads(monkeypatch)
    loader = dali(src, batch_size=4, world_size=2, rank=rank, even_batches=True, drop_last=False, seed=1,
                   augment=Augmentation(crop="translate", pad=2, hflip=0.5))
    for _ in range(2):
        uploads.clear()
        got = [y.tolist() for _, y in loader]
        assert uploads == [sum(map(len, got))]
        assert [len(y) for y in got] == [4, 3]   # 13 samples over 2 ranks: 7 each, the last padded
        assert sum(got, []) == [int(src.labels[i]) for b in loader.plan.batches_from(loader.epoch - 1, 0) for i in b]
