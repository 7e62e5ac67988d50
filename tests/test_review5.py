"""Review of 49bb0e0 (memory: one draws thread per loader, batch_ids checked when read, a group's
batches split from it): a forked child must not wait for draws its parent's thread was making; the
batch_ids contract (raise when a backend yields other rows than its ids without saying which) holds
when read late; a group split with an empty or padded last batch gives the one-by-one batches."""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import pytest
import torch

from fastdata import Augmentation, make_loader
from fastdata.backends.memory.epochs import DrawAhead
from fastdata.datasets import SyntheticDigits

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _in_forked_child(fn, timeout: float = 10.0) -> int:
    """Run ``fn()`` in a forked child: 0 when it returned True within ``timeout`` s, 1 when it returned
    something else or raised, 2 when it was still running (a hang)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # "multi-threaded, use of fork()": the point
        pid = os.fork()
    if pid == 0:   # the child: never back into pytest
        code = 2
        try:
            result: list = []

            def run():
                try:
                    result.append(fn() is True)
                except BaseException:   # noqa: BLE001 (reported by the exit code)
                    result.append(False)

            t = threading.Thread(target=run, daemon=True)
            t.start()
            t.join(timeout)
            code = 2 if not result else (0 if result[0] else 1)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@needs_fork
def test_a_forked_childs_take_does_not_wait_for_its_parents_draws_thread():
    """A fork while the draws thread makes an epoch's draws: the child has no such thread (the commit's
    pid check starts one in start()), but take() waited for the copied job's event, which nothing in
    the child ever sets: a hang. A thread joined after a fork returns at once, so before 49bb0e0 the
    child drew in place."""
    gate = threading.Event()
    ahead = DrawAhead()
    ahead.start((1, 0), lambda: gate.wait(60) and None)   # still drawing when the process forks
    try:
        code = _in_forked_child(lambda: ahead.take((1, 0), []) is None)
    finally:
        gate.set()
        ahead.close()
    assert code == 0, "the forked child's take() hung" if code == 2 else code


@needs_fork
def test_a_forked_child_reads_the_memory_loaders_next_epoch():
    """The same through the loader: a child forked while epoch 1's draws are being made reads epoch 1
    (drawn in place), not a hang at its first batch."""
    loader = make_loader(SyntheticDigits(300, seed=2), "memory", batch_size=50, device="cpu", seed=1,
                         augment=Augmentation(crop="translate", pad=2, hflip=0.5))
    gate = threading.Event()
    draw = loader.draw_epoch

    def gated(epoch, batches, start):
        if threading.current_thread().name == "fastdata-memory-draws":
            gate.wait(60)
        return draw(epoch, batches, start)

    loader.draw_epoch = gated   # the draws thread's job calls self.draw_epoch
    for _ in loader:            # epoch 0; epoch 1's draws now wait on the thread
        pass

    def child():
        torch.set_num_threads(1)   # as a DataLoader worker does: the parent's OpenMP pool is not the child's
        return sum(len(y) for _, y in loader) == 300

    try:
        code = _in_forked_child(child)
    finally:
        gate.set()
        loader.close()
    assert code == 0, "the forked child hung at its first batch" if code == 2 else code


def _dropping_backend():
    from fastdata.backends.base import Loader
    from fastdata.decode import decode

    class Dropping(Loader):
        """Yields each batch without its first row and records nothing (ids_keeper never called)."""

        name = "dropping"

        def _epoch(self, epoch, batches, start):
            for k, ids in enumerate(batches):
                d = decode(self.source, ids, self.augment, self.batch_rng(epoch, start + k))
                yield self.normalize(torch.from_numpy(d.images))[1:], torch.from_numpy(d.labels)[1:]

    return Dropping


def test_batch_ids_of_a_backend_that_drops_rows_unsaid_raise_however_late_they_are_read():
    """Checked when read now, not per batch: read after the next batch, after the pass's end, or twice,
    batch_ids still refuse to name rows they cannot, and name the last batch's when they can."""
    from fastdata.config import LoaderConfig

    loader = _dropping_backend()(SyntheticDigits(40, seed=1), LoaderConfig(batch_size=8, device="cpu", train=False))
    it = iter(loader)
    next(it)
    next(it)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="yielded a batch of 7 rows for 8 sample ids"):
            _ = loader.batch_ids
    for _ in it:
        pass
    with pytest.raises(RuntimeError, match="yielded a batch of 7 rows for 8 sample ids"):
        _ = loader.batch_ids
    loader.close()


def test_batch_ids_read_late_name_the_last_batch_handed_out():
    """The memory backend's fast path keeps the plan's array and the labels: read after later batches,
    or after the pass, batch_ids name the batch last handed out (the partial last one included)."""
    loader = make_loader(SyntheticDigits(110, seed=1), "memory", batch_size=25, device="cpu", seed=3,
                         drop_last=False)
    planned = [np.asarray(b) for b in loader.batch_sampler]
    got = []
    for k, (_x, y) in enumerate(loader):
        if k % 2:
            got.append((k, loader.batch_ids.copy(), len(y)))
    assert [len(ids) for _, ids, _ in got] == [n for _, _, n in got]
    for k, ids, _ in got:
        assert np.array_equal(ids, planned[k])
    assert np.array_equal(loader.batch_ids, planned[-1]) and len(planned[-1]) == 10
    loader.close()


@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("rank", [0, 3])
def test_grouped_batches_with_an_empty_or_padded_last_batch_are_the_one_by_one_batches(rank, even, monkeypatch):
    """The split of a group (CUDA's grouping, run here on the CPU) with sizes 0 (a rank with no sample
    of the last step) and even_batches' padded last batch: the batches, the rows batch_ids name, and
    batch_padding are those of one gather per batch."""
    from fastdata.backends import memory
    from fastdata.backends.memory import epochs

    src = SyntheticDigits(82, seed=2)
    kw = dict(batch_size=10, device="cpu", seed=5, drop_last=False, rank=rank, world_size=4, even_batches=even,
              augment=Augmentation(crop="translate", pad=2, hflip=0.5))

    def read(loader):
        return [(x.clone(), y.clone(), loader.batch_ids.copy(), loader.batch_padding) for x, y in loader]

    one_by_one = read(make_loader(src, "memory", **kw))
    monkeypatch.setattr(memory.loader, "group_bounds",
                        lambda bounds, sample, device: epochs.group_bounds(bounds, sample, torch.device("cuda"),
                                                                           limit=10**9))
    grouped = read(make_loader(src, "memory", **kw))
    assert len(grouped) == len(one_by_one) == 3
    assert len(one_by_one[-1][1]) == (1 if even else (1 if rank < 2 else 0))
    for (xa, ya, ia, pa), (xb, yb, ib, pb) in zip(one_by_one, grouped, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and np.array_equal(ia, ib) and pa == pb
        assert len(ib) == len(yb)


def test_a_pass_that_ended_keeps_no_batch_for_its_ids_check():
    """batch_ids counts a batch's rows when read; the labels it counts them from are let go when the
    pass ends (the last batch's, a view of memory's whole epoch of labels: megabytes on a GPU), and a
    loader that yields fewer rows than ids without saying which still raises when read after it."""
    import gc
    import weakref

    loader = make_loader(SyntheticDigits(100, seed=1), "memory", batch_size=30, device="cpu", drop_last=False)
    refs = [weakref.ref(y) for _, y in loader]
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(loader.batch_ids) == 10   # the partial last batch
    loader.close()
