"""decode.dali_outputs: the dali backend's pipelines driven through DALI's scheduling API, batches handed
to torch without a host wait on a GPU. On the CPU: the driver's order (prefetch, one batch per next, the
end of the input), the copy where DALI may reuse a buffer, and the option. On a GPU (``cuda``): batches
read on the consumer's stream, a copying executor's batches, the same pixels as a host hand-over."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import skip_missing
from fastdata.decode.dali_outputs import DRIVER_CHOICES, HANDOVER_CHOICES, DrivenOutputs, Outputs, output_stream

try:
    import nvidia.dali  # noqa: F401
except ImportError as e:
    skip_missing(f"DALI's outputs need nvidia-dali-cuda120 ({e})", allow_module_level=True)


def _counting_pipe(batches: int, *, exec_dynamic: bool = True, depth: int = 2, gpu: bool = False):
    """A pipeline whose batch k is 4 images of value k (an endless source would never end: this one
    raises StopIteration after ``batches``), and the list of batches its source was asked for."""
    from nvidia.dali import fn, pipeline_def, types

    asked = []

    def source():
        k = len(asked)
        if k >= batches:
            raise StopIteration
        asked.append(k)
        return [np.full((2, 3, 1), k, np.uint8) for _ in range(4)]

    @pipeline_def(batch_size=4, num_threads=1, device_id=0 if gpu else None, prefetch_queue_depth=depth,
                  exec_dynamic=exec_dynamic)
    def graph():
        img = fn.external_source(source=source, batch=True, layout="HWC", dtype=types.UINT8)
        return img.gpu() if gpu else img

    pipe = graph()
    pipe.build()
    return pipe, asked


def test_every_batch_in_order_then_the_end():
    pipe, asked = _counting_pipe(5)
    out = Outputs(pipe, torch.device("cpu"))
    assert asked == []   # nothing runs before the first batch is asked for
    got = [int(x[0, 0, 0, 0]) for x in out]
    assert got == [0, 1, 2, 3, 4] and asked == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):   # drained: stays ended
        next(out)


def test_the_first_batch_fills_the_queue_and_each_next_asks_for_one_more():
    pipe, asked = _counting_pipe(10, depth=3)
    out = Outputs(pipe, torch.device("cpu"))
    first = next(out)
    assert first.shape == (4, 2, 3, 1) and first.dtype == torch.uint8
    assert len(asked) == 3 + 1   # the queue's depth, then one more for the batch taken
    next(out)
    assert len(asked) == 5


@pytest.mark.parametrize("exec_dynamic", [True, False])
def test_a_batch_kept_by_the_consumer_is_not_overwritten_by_later_ones(exec_dynamic):
    """Without ``exec_dynamic`` DALI reuses an output buffer once it is released: the batch is copied out
    first. With it, the DLPack view keeps the buffer (DALI's reference counting)."""
    pipe, _ = _counting_pipe(8, exec_dynamic=exec_dynamic)
    kept = list(Outputs(pipe, torch.device("cpu")))
    assert [int(x.float().mean()) for x in kept] == list(range(8))


def test_no_stream_on_the_cpu_or_for_a_host_hand_over():
    assert HANDOVER_CHOICES == ("stream", "host")
    assert output_stream(torch.device("cpu"), "stream") is None
    assert output_stream(torch.device("cuda", 0), "host") is None   # no CUDA call: works on any machine


def test_handover_option_is_checked_and_names_its_choices():
    import fastdata
    from fastdata.datasets import SyntheticDigits

    with pytest.raises(ValueError, match=r"handover.*'stream'.*'host'"):
        fastdata.make_loader(SyntheticDigits(64), "dali", batch_size=16, handover="async")
    loader = fastdata.make_loader(SyntheticDigits(64), "dali", batch_size=16, handover="host", train=False)
    assert sum(len(y) for _, y in loader) == 64   # on the CPU both values read the same
    loader.close()


def _driver_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "fastdata-dali-driver"]


def test_a_driver_thread_hands_over_every_batch_in_order_then_the_end():
    """driver="thread": DALI's iteration (the input callback among it) runs in a thread of its own, at most
    ``ahead`` batches past the consumer; the consumer gets the same batches, then StopIteration, again at
    every later next."""
    import threading
    import time

    pipe, asked = _counting_pipe(6, depth=2)
    out = DrivenOutputs(Outputs(pipe, torch.device("cpu")), ahead=1)
    assert asked == [] and not _driver_threads()   # started by the first next
    callers = set()
    real = pipe.schedule_run

    def schedule_run():
        callers.add(threading.current_thread().name)
        return real()

    pipe.schedule_run = schedule_run
    first = next(out)
    time.sleep(0.2)   # the thread runs ahead: DALI's queue (2), the batch it holds, its queue of 1
    assert int(first[0, 0, 0, 0]) == 0 and len(asked) <= 2 + 1 + 1 + 1
    assert [int(x[0, 0, 0, 0]) for x in out] == [1, 2, 3, 4, 5]
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(out)
    assert callers == {"fastdata-dali-driver"}   # never the consumer's thread
    out.close()
    assert not _driver_threads()


def test_a_driver_threads_error_reaches_the_consumer_as_the_callers_does():
    """An error inside DALI's iteration (here the input callback's, raised from ``schedule_run``) ends the
    thread and is raised to the consumer after the same batches as with the caller driver; raised again
    at every later next, never a hang."""
    from nvidia.dali import fn, pipeline_def, types

    def source(info):
        if info.iteration == 3:
            raise ValueError("batch 3 cannot be made")
        return [np.full((2, 2, 1), info.iteration, np.uint8) for _ in range(2)]

    @pipeline_def(batch_size=2, num_threads=1, device_id=None, prefetch_queue_depth=2)
    def graph():
        return fn.external_source(source=source, batch=True, batch_info=True, layout="HWC", dtype=types.UINT8)

    got = {}
    for driver in DRIVER_CHOICES:
        pipe = graph()
        pipe.build()
        out = Outputs(pipe, torch.device("cpu"))
        out = DrivenOutputs(out) if driver == "thread" else out
        got[driver] = []
        with pytest.raises(Exception, match="batch 3 cannot be made"):
            for x in out:
                got[driver].append(int(x[0, 0, 0, 0]))
        if driver == "thread":
            with pytest.raises(Exception, match="batch 3 cannot be made"):
                next(out)
        out.close()
    assert got["thread"] == got["caller"] and got["caller"]
    assert not _driver_threads()


def test_closing_a_driver_thread_that_waits_for_room_stops_it():
    """The consumer leaves a pass early: the thread, waiting to queue a batch, stops at close(), which
    also closes the outputs; a driver never started closes at once."""
    pipe, asked = _counting_pipe(50)
    out = DrivenOutputs(Outputs(pipe, torch.device("cpu")), ahead=1)
    next(out)
    out.close()
    assert not _driver_threads() and len(asked) < 50
    DrivenOutputs(Outputs(_counting_pipe(3)[0], torch.device("cpu"))).close()


def test_a_driver_threads_error_keeps_no_pipeline_alive_once_closed():
    """The error the thread hands over is kept to raise again; its traceback holds the consumer's frame,
    and that frame the outputs: a cycle that kept DALI's pipeline (threads, buffers) until the cyclic GC
    ran. Closed and dropped, the pipeline goes at once; a next() after close() says so, never hangs."""
    import gc
    import weakref

    from nvidia.dali import fn, pipeline_def, types

    def source(info):
        if info.iteration == 2:
            raise OSError("a shard's read failed")
        return [np.zeros((2, 2, 1), np.uint8) for _ in range(2)]

    @pipeline_def(batch_size=2, num_threads=1, device_id=None, prefetch_queue_depth=2)
    def graph():
        return fn.external_source(source=source, batch=True, batch_info=True, layout="HWC", dtype=types.UINT8)

    pipe = graph()
    pipe.build()
    alive = weakref.ref(pipe)
    out = DrivenOutputs(Outputs(pipe, torch.device("cpu")))
    gc.disable()
    try:
        with pytest.raises(OSError, match="read failed"):
            list(out)
        out.close()
        with pytest.raises(RuntimeError, match="closed"):
            next(out)
        del out, pipe
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["arrays", "folder"])
def test_the_dali_backend_with_a_driver_thread_gives_the_callers_batches(kind, photo_folder):
    """Over two epochs, a pass left early and a set_epoch back: the same images and labels with
    driver="thread" as with the default, and no driver thread left after close()."""
    import itertools

    import fastdata
    from fastdata.datasets import ImageFolder, SyntheticDigits

    src = SyntheticDigits(200, seed=2) if kind == "arrays" else ImageFolder(photo_folder)
    runs = {}
    for driver in DRIVER_CHOICES:
        loader = fastdata.make_loader(src, "dali", batch_size=8, seed=4, driver=driver)
        seen = [b for _ in range(2) for b in loader]
        seen += list(itertools.islice(loader, 2))   # left early
        loader.set_epoch(0)
        seen += list(loader)
        runs[driver] = [(x.clone(), y.clone()) for x, y in seen]
        loader.close()
    assert len(runs["thread"]) == len(runs["caller"])
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(runs["thread"], runs["caller"]))
    assert not _driver_threads()
    with pytest.raises(ValueError, match=r"driver.*'caller'.*'thread'"):
        fastdata.make_loader(src, "dali", batch_size=8, driver="process")


@pytest.mark.cuda
def test_gpu_a_driver_thread_gives_the_callers_batches_read_late_on_the_consumers_stream(photo_folder):
    """On a GPU the thread copies each batch on a side stream; the consumer's stream waits for it and the
    batch is marked used there: read 50M cycles late on a consumer side stream, each batch is still the
    caller driver's."""
    import fastdata
    from fastdata.datasets import ImageFolder

    src = ImageFolder(photo_folder)
    kw = dict(batch_size=4, train=True, seed=3, device="cuda")
    want = [x.float().sum().item() for x, _ in fastdata.make_loader(src, "dali", **kw)]
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for x, _ in fastdata.make_loader(src, "dali", driver="thread", **kw):
            torch.cuda._sleep(50_000_000)
            sums.append(x.float().sum())
    side.synchronize()
    assert [s.item() for s in sums] == pytest.approx(want, rel=0, abs=0)


@pytest.mark.cuda
def test_gpu_batches_are_read_on_the_consumers_stream_with_no_host_wait_between():
    """``share_outputs`` given the consumer's stream makes that stream wait for DALI's iteration (DALI 2.4's
    ``PopOutputs``: a ``cudaStreamWaitEvent``); the outputs keep DALI's own stream (``out.stream`` is not
    the consumer's: ``set_output_order=false``), so what is checked is what the consumer reads: work
    queued on its stream right after each hand-over, the host never waiting in between, sees DALI's
    batch, on torch's default stream (handle 0: the pipeline device's legacy default stream) as on a
    side stream."""
    device = torch.device("cuda", 0)
    for consumer in (torch.cuda.default_stream(device), torch.cuda.Stream(device)):
        pipe, _ = _counting_pipe(4, gpu=True)
        with torch.cuda.stream(consumer):
            sums = [x.sum() for x in Outputs(pipe, device)]   # each queued on the consumer's stream
        consumer.synchronize()
        assert [int(s) for s in sums] == [24 * k for k in range(4)]   # 4 images of 2x3x1 of value k


@pytest.mark.cuda
def test_gpu_batches_of_an_executor_that_reuses_buffers_are_copied_and_handed_over_by_the_host():
    """Without ``exec_dynamic`` DALI refuses a stream (``share_outputs``: "Asynchronous outputs require
    ..."), and reuses a buffer once released: each batch is copied, the copy waited for, first."""
    pipe, _ = _counting_pipe(8, exec_dynamic=False, gpu=True)
    kept = list(Outputs(pipe, torch.device("cuda", 0), "stream"))
    assert [int(x.float().mean()) for x in kept] == list(range(8))


@pytest.mark.cuda
def test_gpu_stream_hand_over_gives_the_host_hand_overs_batches_on_any_consumer_stream(photo_folder):
    """The same pixels whether the host waits for each batch or the consumer's stream does, read on a
    side stream (the work must be ordered on that stream, not the default one) with the host never
    waiting in between."""
    import fastdata
    from fastdata.datasets import ImageFolder

    src = ImageFolder(photo_folder)
    kw = dict(batch_size=4, train=True, seed=3, device="cuda")
    host = [x for x, _ in fastdata.make_loader(src, "dali", handover="host", **kw)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        got = [x.clone() for x, _ in fastdata.make_loader(src, "dali", handover="stream", **kw)]
    side.synchronize()   # the one wait, at the end
    assert len(got) == len(host) and all(torch.equal(a, b) for a, b in zip(got, host))


@pytest.mark.cuda
def test_gpu_a_batch_read_late_on_the_consumers_stream_is_still_that_batch():
    """DALI returns a buffer torch dropped to its pool ordered on DALI's stream, where its next iteration
    may reuse it while the consumer's stream, queued behind a slow step, has not read it yet. Each batch is
    torch's copy, and DALI's buffer is kept until that copy ran: a consumer 50M cycles behind still reads
    every batch's own values."""
    device = torch.device("cuda", 0)
    side = torch.cuda.Stream(device)
    pipe, _ = _counting_pipe(16, gpu=True)
    sums = []
    with torch.cuda.stream(side):
        for x in Outputs(pipe, device, dtype=torch.bfloat16):
            assert x.dtype == torch.bfloat16 and x.device == device   # converted in the copy
            torch.cuda._sleep(50_000_000)   # a slow step before the batch is read
            sums.append(x.float().sum())
    side.synchronize()
    assert [int(s) for s in sums] == [24 * k for k in range(16)]
