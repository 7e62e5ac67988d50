"""The dali backend as a user runs it (QA pass): interrupted passes, resumes and lifetimes that the
contract covers and tests/test_dali.py does not reach. CPU pipelines (DALI's device "cpu")."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import decode_ids, indexed_source, label_of, skip_missing  # noqa: E402

try:
    import nvidia.dali.plugin.pytorch  # noqa: F401
except ImportError as e:
    skip_missing(f"the dali backend needs nvidia-dali-cuda120 ({e})", allow_module_level=True)
from fastdata import make_loader  # noqa: E402
from fastdata.config import Augmentation  # noqa: E402

_OPENED: list = []


@pytest.fixture(autouse=True)
def _close_what_the_test_opened():
    yield
    while _OPENED:
        _OPENED.pop().close()


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
