"""prefetch backend: same batches as torch, bounded read-ahead, the CUDA stream path."""
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import DEVICES, batches_without_host_sync, decode_ids, indexed_source, pairs
from fastdata import make_loader
from procs import wait_until


def test_same_batches_as_the_torch_backend():
    src = indexed_source(500)
    a = make_loader(src, "torch", batch_size=50, device="cpu", num_workers=2, seed=2)
    b = make_loader(src, "prefetch", batch_size=50, device="cpu", num_workers=2, seed=2, depth=3)
    for (xa, ya), (xb, yb) in pairs(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def _blocked_in_put(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside the prefetch producer's put(), i.e. waiting for room in the queue."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "put" and frame.f_code.co_filename.endswith("prefetch.py"):
            return True
        frame = frame.f_back
    return False


def test_read_ahead_is_bounded_by_depth():
    src = indexed_source(2000)
    loader = make_loader(src, "prefetch", batch_size=10, device="cpu", num_workers=0, depth=2)
    produced = []
    orig = loader.host_batches

    def counting(*args):
        for item in orig(*args):
            produced.append(1)
            yield item

    loader.host_batches = counting
    it = iter(loader)
    next(it)
    producer = next(t for t in threading.enumerate() if t.name == "fastdata-prefetch")
    # consumer holds 1, the queue holds `depth`, the producer holds one more while blocked on put
    assert wait_until(lambda: _blocked_in_put(producer) and len(produced) >= 4, timeout=30)
    assert len(produced) == 1 + 2 + 1
    assert _blocked_in_put(producer) and len(produced) == 4, "the producer ran past the bound"
    it.close()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        make_loader(indexed_source(10), "prefetch", batch_size=5, device="cpu", depth=0)


def test_thread_ends_when_the_consumer_breaks():
    loader = make_loader(indexed_source(1000), "prefetch", batch_size=10, device="cpu", num_workers=0)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == "fastdata-prefetch"], 10)


class _Gated(torch.utils.data.Dataset):
    """Sample i is a 4x4 image filled with i. Samples from ``gate_from`` on wait for ``gate`` (a
    multiprocessing Event, shared with forked workers): the batch holding them is 'slow' until the test
    opens the gate."""

    def __init__(self, n, gate, gate_from):
        self.n, self.gate, self.gate_from = n, gate, gate_from

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.gate_from:
            self.gate.wait()
        return torch.full((1, 4, 4), i, dtype=torch.uint8), i % 10


def test_a_break_during_a_slow_batch_ends_the_epoch_and_the_next_one_is_whole():
    """Issue 10.1: the break must not wait for the slow batch, and the producer, still inside the shared
    DataLoader iterator then, must not race the next epoch (that lost batches or crashed)."""
    import multiprocessing as mp

    gate = mp.get_context("fork").Event()
    loader = make_loader(_Gated(40, gate, gate_from=4), "prefetch", batch_size=4, device="cpu", train=False,
                         num_workers=1, mean=(0.0,), std=(1 / 255,), multiprocessing_context="fork")
    failsafe = threading.Timer(60, gate.set)   # a broken break would wait for the gate forever
    failsafe.start()
    try:
        for i, (x, y) in enumerate(loader):
            break                              # batch 1 is stuck behind the gate in the worker now
        assert not gate.is_set(), "the break waited for the slow batch"
    finally:
        failsafe.cancel()
    gate.set()
    for epoch in range(2):
        ids = sorted(int(v) for x, _ in loader for v in x[:, 0, 0, 0].round())
        assert ids == list(range(40)), f"epoch {epoch + 1} after the break was not whole"
    loader.close()


_CTRL_C_SCRIPT = """
import sys, time
sys.path[:0] = [{tests!r}, {root!r}]
import torch
from fastdata import make_loader

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(0.01 if i < 8 else 30)     # from batch 2 on, a sample takes half a minute
        if i >= 8:
            open({slow_done!r}, "a").close()  # a slow sample finished: something waited for it
        return torch.full((1, 4, 4), i % 256, dtype=torch.uint8), i % 10

loader = make_loader(Slow(), "prefetch", batch_size=4, device="cpu", num_workers=2, train=False,
                     mean=(0.0,), std=(1 / 255,))
for i, _ in enumerate(loader):
    print("batch", i, flush=True)
"""


def test_ctrl_c_during_a_prefetch_epoch_exits_promptly(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while the consumer waits for a slow
    batch: the process ends with KeyboardInterrupt, leaving no process, without waiting for the slow
    samples (each takes 30 s and marks a file when done: the file must not exist)."""
    script, slow_done = tmp_path / "ctrl_c.py", tmp_path / "slow_sample_done"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(_CTRL_C_SCRIPT.format(tests=tests, root=os.path.dirname(tests), slow_done=str(slow_done)))
    # SIGINT back to its default in the child, as under a terminal: a CI job run in the background of a
    # non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "batch 0"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)   # a hang's limit, not the test's measure
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    def group_gone():
        try:
            os.killpg(proc.pid, 0)
            return False
        except ProcessLookupError:
            return True

    assert "KeyboardInterrupt" in out, out[-2000:]
    assert wait_until(group_gone, timeout=10), "worker processes outlived the interrupted run"
    assert not slow_done.exists(), "the exit waited for a slow sample"


def _slow_side_stream(loader, cycles):
    """Queue a GPU sleep on the prefetch side stream before each batch's copy: the copies finish late."""
    orig = loader.host_batches

    def slowed(*args):
        for images, labels in orig(*args):
            with torch.cuda.stream(loader.stage.stream):
                torch.cuda._sleep(cycles)
            yield images, labels

    loader.host_batches = slowed


@pytest.mark.cuda
@pytest.mark.parametrize("slow", ["side_stream", "consumer"])
def test_cuda_prefetch_batches_survive_a_racing_consumer(slow):
    """Large batches (38 MB as float), read asynchronously by the consumer and dropped at once.

    side_stream: the copies run late. Without the consumer stream's wait on the batch's event, the read
    sees memory the copy has not written yet.
    consumer: the reads run late. Without record_stream, a dropped batch's memory goes straight back to
    the side stream's pool, and the copy of batch k+depth overwrites it before the queued read of
    batch k runs. Checksums are compared with the same batches built on the CPU.
    """
    src = indexed_source(384, size=224, channels=3)
    ref = [(x.double().sum(), y) for x, y in make_loader(src, "torch", batch_size=64, device="cpu",
                                                         train=False, num_workers=0)]
    loader = make_loader(src, "prefetch", batch_size=64, device="cuda", train=False, num_workers=2, depth=3)
    if slow == "side_stream":
        _slow_side_stream(loader, 50_000_000)
    for epoch in range(2):
        sums, labels = [], []
        for x, y in loader:
            if slow == "consumer":
                torch.cuda._sleep(50_000_000)   # the read below runs late on the consumer stream
            sums.append(x.double().sum())       # asynchronous: a device scalar, no host sync
            labels.append(y.clone())
            del x, y                            # dropped while its read is still queued
        got = torch.stack(sums).cpu()           # the one sync
        torch.testing.assert_close(got, torch.stack([s for s, _ in ref]), rtol=1e-9, atol=0)
        for a, (_, b) in zip(labels, ref, strict=True):
            assert torch.equal(a.cpu(), b)
    loader.close()


@pytest.mark.cuda
def test_cuda_prefetch_memory_is_flat_over_epochs_and_after_a_break():
    src = indexed_source(2000, size=32, channels=3)
    loader = make_loader(src, "prefetch", batch_size=100, device="cuda", train=False, num_workers=2, depth=3)
    for x, _ in loader:   # warm up: the caching allocator's pools reach their working size
        pass
    del x
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for epoch in range(3):
        ids = []
        for x, _ in loader:
            ids.append(decode_ids(x))
        del x
        torch.cuda.synchronize()
        np.testing.assert_array_equal(np.concatenate(ids), np.arange(2000))
        assert torch.cuda.memory_allocated() == base, f"epoch {epoch}: device memory grew"
    for i, (x, _) in enumerate(loader):
        if i == 2:
            break
    del x
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base, "a break left prefetched batches allocated"
    loader.close()


def _host_batches(n_batches, pulled, pin=False):
    """Any source of host uint8 batches: here a plain generator (what the stage must accept)."""
    for k in range(n_batches):
        pulled.append(k)
        images = torch.full((4, 6, 6, 3), k, dtype=torch.uint8)
        labels = torch.full((4,), k, dtype=torch.int64)
        yield (images.pin_memory(), labels.pin_memory()) if pin else (images, labels)


@pytest.mark.parametrize("device", DEVICES)
def test_the_stage_wraps_any_iterator_of_host_batches(device):
    from fastdata.normalize import Normalizer
    from fastdata.prefetch import PrefetchStage

    dev = torch.device(device)
    norm = Normalizer((0.5,) * 3, (0.25,) * 3, dev)
    stage = PrefetchStage(dev, depth=2)
    pulled = []
    out = []
    for x, y in stage(_host_batches(5, pulled, pin=dev.type == "cuda"), norm):
        assert x.device.type == dev.type and x.shape == (4, 3, 6, 6) and x.dtype == torch.float32
        out.append((x.cpu(), y.cpu()))
    assert pulled == list(range(5))
    for k, (x, y) in enumerate(out):
        assert torch.equal(y, torch.full((4,), k))
        assert torch.allclose(x, torch.full_like(x, (k / 255 - 0.5) / 0.25))
    stage.close()


def test_the_stage_refuses_a_depth_below_one():
    from fastdata.prefetch import PrefetchStage

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="depth must be an integer >= 1"):
            PrefetchStage(torch.device("cpu"), depth=bad)


def test_the_stage_takes_a_plain_iterator_without_close():
    from fastdata.normalize import Normalizer
    from fastdata.prefetch import PrefetchStage

    batches = [(torch.zeros((2, 3, 3, 1), dtype=torch.uint8), torch.arange(2))] * 3
    stage = PrefetchStage(torch.device("cpu"), depth=1)
    out = list(stage(iter(batches), Normalizer((0.0,), (1.0,), torch.device("cpu"))))
    assert len(out) == 3 and all(x.shape == (2, 1, 3, 3) for x, _ in out)
    stage.close()


def test_a_break_during_a_slow_source_batch_ends_the_thread_when_that_batch_returns():
    """The producer, inside a slow source batch when the consumer breaks, leaves as soon as that batch
    returns: the batch is not normalized (it normalized a batch nobody took, the thread outliving the
    break by that much more), the source is not asked for another, and it is closed."""
    from fastdata.normalize import Normalizer
    from fastdata.prefetch import PrefetchStage

    gate, pulled, closed, normalized = threading.Event(), [], [], []
    failsafe = threading.Timer(60, gate.set)   # a producer that never leaves must not hang the suite

    def slow_source():
        try:
            for k in range(10):
                if k == 1:
                    gate.wait()                # batch 1 is slow: the consumer breaks meanwhile
                pulled.append(k)
                yield torch.full((2, 3, 3, 1), k, dtype=torch.uint8), torch.full((2,), k)
        finally:
            closed.append(True)

    norm = Normalizer((0.0,), (1.0,), torch.device("cpu"))

    def counting(images):
        normalized.append(int(images[0, 0, 0, 0]))
        return norm(images)

    stage = PrefetchStage(torch.device("cpu"), depth=2)
    failsafe.start()
    try:
        it = stage(slow_source(), counting)
        next(it)
        producer = next(t for t in threading.enumerate() if t.name == "fastdata-prefetch")
        it.close()                              # the break
        # Only the failsafe (60 s) opens the gate before the line below: a break that waited for the slow
        # batch returns with the gate open, or not at all.
        assert producer.is_alive() and not gate.is_set(), "the break waited for the slow batch"
        gate.set()                              # the slow batch returns
        producer.join(10)
        assert not producer.is_alive(), "the producer outlived the slow batch"
    finally:
        failsafe.cancel()
        gate.set()
    assert pulled == [0, 1] and closed == [True]
    assert normalized == [0], "the batch read after the break was normalized"
    stage.close()


class _FakeCuda:
    """torch.cuda's streams and events, and the host-to-device copy, replaced by objects that log what
    is done on which host thread: the CUDA path's logic runs on the CPU. A copy is a clone; the stream
    a copy runs on is the calling thread's current one (thread-local, as CUDA's is)."""

    def __init__(self, monkeypatch):
        self.log, local = [], threading.local()
        fake = self

        def note(*what):
            fake.log.append((*what, threading.current_thread().name))

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name

            def wait_event(self, event):
                note("wait_event", self.name, event.batch)

        class Event:
            def record(self, stream):
                self.batch = getattr(local, "copied", None)
                note("record", stream.name, self.batch)

        @contextlib.contextmanager
        def stream(s):
            before, local.stream = getattr(local, "stream", None), s
            try:
                yield
            finally:
                local.stream = before

        consumer = Stream(name="consumer")
        original_to = torch.Tensor.to

        def to(t, *args, **kwargs):
            if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
                local.copied = int(t.reshape(-1)[0])    # the batch number the test's source wrote
                note("copy", getattr(getattr(local, "stream", None), "name", "default"), local.copied,
                     kwargs.get("non_blocking", False))
                return t.clone()
            return original_to(t, *args, **kwargs)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: note("record_stream", s.name, int(t.reshape(-1)[0])))

    def of(self, what):
        return [entry[1:] for entry in self.log if entry[0] == what]


@pytest.mark.parametrize("device", ["cpu", "cuda-logic"])
def test_the_producer_thread_prepares_batches_while_the_consumer_steps(device, monkeypatch):
    """Issue 30.5: the host work of batch k+1 (pulling it from the source, launching its copy and
    normalization) runs on the producer thread during the consumer's step on batch k, not in the
    consumer's next(). The consumer, in its step on batch k, waits until the producer has prepared
    batches up to the bound (k + depth + 2 in all: the one it holds, depth queued, one waiting for room):
    that happens only if someone else prepares them meanwhile (the stage that launched copies from
    next() never got there). On the CUDA path (its streams and events logged on the CPU) every copy runs
    on the side stream, non-blocking, on the producer thread; the consumer's stream waits on each
    batch's event when that batch is handed over, after the event was recorded, then record_stream."""
    from fastdata.prefetch import PrefetchStage

    fake = _FakeCuda(monkeypatch) if device == "cuda-logic" else None
    n, depth = 8, 2
    pulled, prepared = [], []

    def source():
        for k in range(n):
            pulled.append((k, threading.current_thread().name))
            yield torch.full((2, 3, 3, 1), k, dtype=torch.uint8), torch.full((2,), k)

    def normalize(images):
        prepared.append(int(images[0, 0, 0, 0]))
        return images.float()

    stage = PrefetchStage(torch.device("cuda" if fake else "cpu"), depth=depth)
    main = threading.current_thread().name
    got = []
    for k, (x, y) in enumerate(stage(source(), normalize)):
        got.append(int(y[0]))
        bound = min(k + depth + 2, n)
        assert wait_until(lambda b=bound: len(prepared) >= b, timeout=20), \
            f"step {k}: {len(prepared)} batches prepared, the producer did not run during the step"
        time.sleep(0.05)                                   # room to overshoot, if it could
        assert len(prepared) == bound, f"step {k}: {len(prepared)} prepared, the bound is {bound}"
    stage.close()
    assert got == list(range(n)) and prepared == list(range(n))
    assert {name for _, name in pulled} == {"fastdata-prefetch"} != {main}
    if fake is None:
        return
    copies = fake.of("copy")
    assert [c[1] for c in copies] == [k for k in range(n) for _ in "xy"]
    assert all(stream == "side" and non_blocking and thread == "fastdata-prefetch"
               for stream, _, non_blocking, thread in copies)
    assert [r[:2] for r in fake.of("record")] == [("side", k) for k in range(n)]
    assert fake.of("wait_event") == [("consumer", k, main) for k in range(n)]
    assert fake.of("record_stream") == [("consumer", k, main) for k in range(n) for _ in "xy"]
    order = [(e[0], e[2]) for e in fake.log if e[0] in ("record", "wait_event", "record_stream")]
    for k in range(n):
        assert order.index(("record", k)) < order.index(("wait_event", k)) < order.index(("record_stream", k))


@pytest.mark.cuda
def test_cuda_prefetch_waits_for_data_no_longer_than_torch_under_a_slow_step():
    """Issue 30.5 on a GPU: with a step that keeps the GPU busy for about 5 ms and waits for it
    (a sync, as a step that reads its loss does: the GIL is free meanwhile), the prefetch producer has
    the next batch copied and normalized before the training thread asks, while the torch backend still
    pulls it from the DataLoader and launches its copy inside next(). Batches of 3 MiB: where auto
    picks prefetch.

    What is compared: the median time in next() over the batches after each epoch's first. The first
    batch (workers starting: 33-51 ms for both on an H200) and the occasional batch the workers were
    late with (6-18 ms, both) are the workers', not the stage's, and one of them decided the sum: the
    H200 run of 2026-11-27 read 0.22 s for torch and 0.37 s for prefetch over two epochs, then 79-90 ms
    against 60-86 ms in a rerun, while the medians were 0.31-0.48 ms against 0.03-0.06 ms every time
    (benchmarks/results/prefetch-next-cuda-h200.txt)."""
    import statistics

    waits = {}
    for backend in ("torch", "prefetch"):
        loader = make_loader(indexed_source(4096, size=64, channels=3), backend, batch_size=256, device="cuda",
                             num_workers=4, seed=1)
        for _ in loader:        # warm-up: workers forked, pinned and device pools at their working size
            pass
        times = []
        for _ in range(2):
            it = iter(loader)
            for k in itertools.count():
                start = time.perf_counter()
                batch = next(it, None)
                if batch is None:
                    break
                if k:
                    times.append(time.perf_counter() - start)
                x, y = batch
                # The model's step on the training stream; the sync leaves the GIL free meanwhile.
                torch.cuda._sleep(10_000_000)
                x[:, 0, 0, 0].sum().add_(y.sum())       # reads the batch there (after its event)
                torch.cuda.synchronize()
        waits[backend] = statistics.median(times)
        loader.close()
    assert waits["prefetch"] <= waits["torch"], f"median seconds in next() after each epoch's first batch: {waits}"


@pytest.mark.cuda
def test_cuda_prefetch_says_when_it_cannot_help(caplog):
    """Named explicitly on digit-sized batches (16 KiB here), prefetch says it cannot help and why."""
    with caplog.at_level("WARNING", logger="fastdata"):
        loader = make_loader(indexed_source(1000), "prefetch", batch_size=256, device="cuda", num_workers=0)
    assert "backend 'prefetch' cannot help here: a batch is 16 KiB of uint8" in caplog.text
    loader.close()


@pytest.mark.cuda
def test_cuda_prefetch_epoch_makes_no_host_sync():
    """No thread of a prefetch epoch (the training thread's next(), the producer's copies and launches,
    the DataLoader's pinning) synchronizes with the GPU: under torch's sync debug mode "error" any such
    call raises, and the producer's error is raised by the consumer."""
    loader = make_loader(indexed_source(2048, size=64, channels=3), "prefetch", batch_size=256, device="cuda",
                         num_workers=2)
    assert batches_without_host_sync(loader) == len(loader)
    loader.close()
