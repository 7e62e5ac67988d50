"""The dali backend as a user runs it (QA pass): interrupted passes, resumes and lifetimes that the
contract covers and tests/test_dali.py does not reach. CPU pipelines (DALI's device "cpu")."""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import decode_ids, indexed_source, label_of, skip_missing  # noqa: E402

try:
    import nvidia.dali.plugin.pytorch  # noqa: F401
except ImportError as e:
    skip_missing(f"the dali backend needs nvidia-dali-cuda120 ({e})", allow_module_level=True)
from fastdata import make_loader  # noqa: E402
from fastdata.config import Augmentation  # noqa: E402

# test_dali's list of the loaders a test opened, and its autouse fixture that closes them at the test's end.
from test_dali import _OPENED, _close_what_the_test_opened  # noqa: E402, F401


def opened(loader):
    _OPENED.append(loader)
    return loader


def loaders(n: int = 60, **kw):
    """(torch loader, dali loader) of one shuffled, unaugmented indexed source with the same options."""
    src = indexed_source(n)
    kw = dict(device="cpu", batch_size=5, shuffle=True, seed=3, drop_last=False, augment=Augmentation.none(), **kw)
    return (opened(make_loader(src, backend="torch", num_workers=0, **kw)),
            opened(make_loader(src, backend="dali", **kw)))


def pass_of(loader) -> list:
    """One pass: each batch's sample ids (read from the pixels) and labels."""
    return [(decode_ids(x), y.numpy()) for x, y in loader]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_while_waiting_for_dali_leaves_the_next_pass_exact(interrupt):
    """Ctrl-C while the training thread waits for DALI (which runs the input callback on that thread)
    ends the pass inside the loader, not in the consumer's loop. The next pass must be the epoch read
    again from its start with each batch's own labels: it went on with the stream the interrupt had
    broken, so later batches came from the wrong place and labels no longer matched their images."""
    torch_loader, dali = loaders()
    pass_of(dali), pass_of(torch_loader)    # a whole epoch: the stream goes on into the next one
    real, calls = dali.prepare, [0]

    def prepare(epoch, k, ids):   # DALI's input callback for array batches, on the training thread
        calls[0] += 1
        if calls[0] == 6:
            raise interrupt
        return real(epoch, k, ids)

    dali.prepare = prepare
    with pytest.raises(interrupt):
        for _ in dali:
            pass
    again, expected = pass_of(dali), pass_of(torch_loader)
    assert dali.epoch == torch_loader.epoch == 2
    assert len(again) == len(expected) == 12
    for (ids, labels), (want, _) in zip(again, expected):
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(labels, label_of(ids))


def test_a_pass_whose_loader_was_closed_says_so():
    """``close()`` between two batches of a pass (a ``with`` block left, a teardown) frees the pipeline;
    the pass's next batch was "TypeError: 'NoneType' object is not an iterator", naming nothing."""
    _, dali = loaders()
    batches = iter(dali)
    next(batches)
    dali.close()
    with pytest.raises(RuntimeError, match=r"dali loader was closed while this pass ran"):
        next(batches)


def _pass_in_a_fork(loader) -> list | str:
    """One pass of ``loader`` in a forked child: its (ids or labels) per batch, or why it failed."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child():
        try:
            writer.send([y.numpy() if x.shape[-1] != 8 else decode_ids(x) for x, y in loader])
        except BaseException as e:   # the parent's assertion shows it
            writer.send(f"{type(e).__name__}: {e}")

    proc = ctx.Process(target=child)
    proc.start()
    try:
        if not reader.poll(120):
            return "the child's pass hung"
        return reader.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def _folder_with_a_tiff(root):
    """A small photo folder with a TIFF: given to DALI's decoder as a PNG copy in the loader's folder of
    copies (decode="dali")."""
    from PIL import Image

    from fastdata.datasets import ImageFolder
    from fastdata.datasets.folders import make_image_folder

    make_image_folder(root, classes=2, per_class=4, seed=1)
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "class_000" / "scan.tif")
    return ImageFolder(root)


@pytest.fixture
def temp_folder(tmp_path, monkeypatch):
    """TMPDIR of this test alone (forked children inherit it): the folders of copies made there."""
    import tempfile

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.parametrize("kind", ["arrays", "host", "dali"])
def test_a_loader_used_in_a_forked_child_after_a_pass_in_the_parent(kind, tmp_path, temp_folder):
    """A dali loader inherited by a forked child (multiprocessing's default start on Linux) after the
    parent ran a pass: the child's pass hung forever, fed by a stream whose DALI and reading threads
    live in the parent only. Now the child builds its own, reads the epoch the parent would read next,
    and the parent's loader and folder of copies are left as they were."""
    if kind == "arrays":
        _, loader = loaders()
        pass_of(loader)
    else:
        loader = opened(make_loader(_folder_with_a_tiff(tmp_path / "photos"), backend="dali", device="cpu",
                                    decode=kind, batch_size=3,
                                    drop_last=False, seed=1, augment=Augmentation.imagenet_train(size=16)))
        assert sum(len(y) for _, y in loader) == 9
    copies = loader._rewrite_dir
    assert (copies is not None) == (kind == "dali")
    got = _pass_in_a_fork(loader)
    assert not isinstance(got, str), got
    expected = [decode_ids(x) if kind == "arrays" else y.numpy() for x, y in loader]   # the parent's next epoch
    assert len(got) == len(expected) > 1
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert loader._rewrite_dir == copies and (copies is None or len(os.listdir(copies)) == 1)
    assert len(os.listdir(temp_folder)) == (kind == "dali")   # the child made and left no folder


def test_a_folder_of_copies_made_in_a_forked_child_is_removed_at_its_exit(tmp_path, temp_folder):
    """A loader first iterated in a forked child makes its folder of copies there; multiprocessing ends
    the child with os._exit, which skips the atexit that closes loaders, and the folder stayed in TMPDIR."""
    loader = opened(make_loader(_folder_with_a_tiff(tmp_path / "photos"), backend="dali", device="cpu",
                                decode="dali", batch_size=3, drop_last=False,
                                augment=Augmentation.imagenet_eval(size=16)))
    got = _pass_in_a_fork(loader)
    assert not isinstance(got, str), got
    assert sum(len(labels) for labels in got) == 9
    assert os.listdir(temp_folder) == []
