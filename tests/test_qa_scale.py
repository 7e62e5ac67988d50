"""Scale QA: what breaks or becomes unusable as the data grows (ImageNet's 1.28M files, 10k classes, long
epochs), held as algorithmic properties that a few thousand samples show: how many Python objects a
source keeps per sample, what a forked worker copies, what grows with the steps of an epoch. No
wall-clock assertions. The figures measured at full size are in the QA report, not here."""
from __future__ import annotations

import gc
import math
import os
import pickle
import sys
import types

import numpy as np
import pytest
from PIL import Image

from fastdata.datasets import ImageFolder
from fastdata.datasets.folders import PathTable


def _linked_folder(root, classes: int, per_class: int, nested: bool = False):
    """An image folder of ``classes`` x ``per_class`` files, hard links of one tiny JPEG per class (the
    count is the point, not the bytes); in ``nested``, every other file in a sub-folder."""
    seed = root / "seed.jpg"
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(seed)
    for c in range(classes):
        d = root / "data" / f"n{c:05d}"
        (d / "sub").mkdir(parents=True)
        for i in range(per_class):
            os.link(seed, (d / "sub" if nested and i % 2 else d) / f"img_{i:05d}.JPEG")
    return root / "data"


def _reachable_objects(obj, limit: int) -> int:
    """How many Python objects ``obj``'s attributes reach (through containers and instances, not through
    classes, modules or functions), counting up to ``limit``."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen, todo = {id(obj)}, list(gc.get_referents(obj))
    while todo and len(seen) < limit:
        o = todo.pop()
        if id(o) in seen or isinstance(o, skip):
            continue
        seen.add(id(o))
        todo.extend(gc.get_referents(o))
    return len(seen)


# ----------------------------------------------------------------------------- ImageFolder's file list


def test_image_folder_keeps_no_python_object_per_file(tmp_path):
    """ImageNet's 1.28M paths were a list of str: 140 MB of objects (the packed table: 77 MB), and the
    per-file objects are what a forked worker copies page by page (next test). The source now reaches
    a fixed number of objects whatever its file count; before, one str per file."""
    n = 3000
    src = ImageFolder(_linked_folder(tmp_path, 3, n // 3))
    assert len(src) == n
    for source in (src, src.subset(np.arange(0, n, 2)),
                   ImageFolder.from_samples(list(zip(src.paths, src.labels.tolist())), src.classes)):
        assert _reachable_objects(source, limit=n // 2) < 300, "a per-file Python object is back"


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/smaps_rollup"),
                    reason="reads the child's private memory from /proc/self/smaps_rollup (Linux)")
def test_forked_reader_of_every_path_copies_no_parent_memory(tmp_path):
    """A DataLoader worker is a fork; reading path i touched the refcount of the parent's str i, and so
    copied its page: over an ImageNet epoch 143 MB per worker (measured: private dirty memory of a child
    that named every file, 1.4 MB -> 143 MB before, -> 26 MB after, of its own allocations). Here: 60,000
    paths of ~100 bytes, 6 MB of str objects to copy before; the child now dirties far less than that."""
    n = 60_000
    src = ImageFolder.from_samples([(f"{tmp_path}/n{i % 10:08d}/n{i % 10:08d}_{i:010d}.JPEG" + "x" * 40, i % 10)
                                    for i in range(n)], list(range(10)))
    # An array, not a list: iterating a list of the parent's ints would dirty their pages too.
    order = np.random.default_rng(0).permutation(n)
    gc.collect()
    gc.freeze()   # the parent's objects out of the child's collections: a collection would dirty them too
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: a worker reading every sample's name, in a shuffled order
        try:
            before = _private_dirty()
            for k in range(n):
                src.sample_name(order[k])
            os.write(write, str(_private_dirty() - before).encode())
        finally:
            os._exit(0)
    os.close(write)
    dirtied = int(os.read(read, 100) or b"-1")
    os.waitpid(pid, 0)
    gc.unfreeze()
    assert 0 <= dirtied < 2 * 2**20, f"a child reading every path dirtied {dirtied / 2**20:.1f} MiB"


def _private_dirty() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Private_Dirty"))


def test_path_table_is_the_sequence_the_list_was(tmp_path):
    """``ImageFolder.paths`` stays what code reading it expects: str items, negative indices, slices,
    ``==`` with a list, pickling (spawned workers), and names that are not UTF-8 round-trip."""
    odd = os.fsdecode(b"caf\xe9.jpg")   # a Latin-1 name: a str with a surrogate
    paths = ["/d/a.jpg", "/d/b/c.png", f"/d/{odd}", ""]
    table = PathTable(paths)
    assert list(table) == paths and table == paths and table != paths[:-1] and len(table) == 4
    assert table[-2] == f"/d/{odd}" and table[1:3] == paths[1:3] and table[np.int64(1)] == "/d/b/c.png"
    assert os.fsencode(table[2]) == b"/d/caf\xe9.jpg"
    with pytest.raises(IndexError):
        table[4]
    assert pickle.loads(pickle.dumps(table)) == table
    assert table.take(np.array([2, 0, 0, 3])) == [paths[2], paths[0], paths[0], ""]
    assert PathTable.concat([PathTable(paths[:1]), PathTable([]), PathTable(paths[1:])]) == paths
    assert np.asarray(table).tolist() == paths


def test_image_folder_order_and_subset_unchanged(tmp_path):
    """torchvision's order (folders by path, then names), nested folders included, as before the file list
    was packed: the same as sorting the walk's paths by (dirname, basename)."""
    root = _linked_folder(tmp_path, 3, 7, nested=True)
    src = ImageFolder(root)
    expected = []
    for c in sorted(os.listdir(root)):
        files = [os.path.join(d, f) for d, _, fs in os.walk(root / c) for f in fs]
        expected += sorted(files, key=lambda p: (os.path.dirname(p), os.path.basename(p)))
    assert src.paths == expected
    assert src.labels.tolist() == [i // 7 for i in range(21)]
    sub = src.subset([20, 3, 5])
    assert sub.paths == [expected[20], expected[3], expected[5]] and sub.labels.tolist() == [2, 0, 0]
    assert sub.sample_name(0) == expected[20]


def test_tar_images_keep_no_python_object_per_member(tmp_path):
    """``TarImages`` (WebDataset tars of another tool, read by ``make_loader`` and ``pack``) held its member
    names as a list of str: the ImageFolder's fork copy (above), once per tar member."""
    import io
    import tarfile

    from fastdata.packing import TarImages

    jpeg = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(jpeg, format="JPEG")
    n = 2000
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        for i in range(n):
            for ext, data in (("jpg", jpeg.getvalue()), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    src = TarImages(tmp_path / "a.tar")
    assert len(src) == n and src.sample_name(5).endswith("a.tar:000005.jpg")
    sub = src.subset([7, 2])
    assert sub.sample_name(0).endswith(":000007.jpg") and sub.read(1) == jpeg.getvalue()
    for source in (src, sub):
        assert _reachable_objects(source, limit=n // 2) < 300, "a per-member Python object is back"


# ----------------------------------------------------------------------------- the engine's per-step bookkeeping


def _fake_events(monkeypatch, done=lambda t: True):
    """torch.cuda.Event stand-ins on a fake GPU clock: steps of 10 ms, gaps that vary, a slow first step.
    ``done(t)``: whether the GPU has reached time ``t`` (``query``)."""
    import torch

    clock = iter(float(t) for t in np.cumsum(np.tile([3.0, 10.0, 1.0, 10.0, 7.0, 10.0], 10_000)) + 3000.0)

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = next(clock)

        def query(self):
            return done(self.t)

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "training stream")


@pytest.mark.parametrize("warmup", [0, 3, 1500])
def test_step_timer_keeps_a_bounded_number_of_events(monkeypatch, warmup):
    """StepTimer kept two CUDA events per step until the epoch's end (80,000 for a 40,000-step epoch) and
    read them all there; it now folds the completed ones into sums as it goes, with the same figure, for
    a steady state marked before or after the folding, and for the whole epoch (the meter's fallback)."""
    import torch

    from fastdata.engine import StepTimer, idle_fraction

    _fake_events(monkeypatch)
    timer = StepTimer(torch.device("cuda", 0))
    starts, ends, most = [], [], 0
    for step in range(5000):
        if step == warmup and warmup:
            timer.mark_steady()
        timer.start()
        starts.append(timer.starts[-1])
        timer.end()
        ends.append(timer.ends[-1])
        most = max(most, len(timer.starts) + len(timer.ends))
    assert most < 2500, f"{most} of 10,000 events held at once"
    assert timer.idle_fraction() == pytest.approx(idle_fraction(starts[warmup:], ends[warmup:]))
    timer.steady_from = 0   # EpochMeter.record's "measured whole"
    assert timer.idle_fraction() == pytest.approx(idle_fraction(starts, ends))


def test_step_timer_folds_only_what_the_gpu_completed(monkeypatch):
    """An event is read only once ``query`` says the GPU reached it: a GPU far behind the host keeps its
    events (nothing waits), and they fold once it catches up."""
    import torch

    from fastdata.engine import StepTimer

    reached = [0.0]
    _fake_events(monkeypatch, done=lambda t: t <= reached[0])
    timer = StepTimer(torch.device("cuda", 0))
    for _ in range(3 * StepTimer.FOLD):
        timer.start()
        timer.end()
    assert timer.folded == 0 and len(timer.ends) == 3 * StepTimer.FOLD
    reached[0] = math.inf
    for _ in range(64):
        timer.start()
        timer.end()
    assert timer.folded > 0


@pytest.mark.cuda
def test_step_timer_folds_real_cuda_events():
    """The folding on a GPU: ``query`` and ``elapsed_time`` of real events give the figure of every event
    kept (folding reads only events the GPU completed, so nothing here waits but the final sync)."""
    import torch

    from fastdata.engine import StepTimer, idle_fraction

    device = torch.device("cuda", torch.cuda.current_device())
    timer = StepTimer(device)
    x = torch.randn(256, 256, device=device)
    starts, ends = [], []
    for step in range(3 * StepTimer.FOLD):
        if step == 5:
            timer.mark_steady()
        timer.start()
        starts.append(timer.starts[-1])
        x = torch.tanh(x @ x)
        timer.end()
        ends.append(timer.ends[-1])
    torch.cuda.synchronize(device)
    assert timer.folded > 0
    assert timer.idle_fraction() == pytest.approx(idle_fraction(starts[5:], ends[5:]), rel=1e-4)


# ----------------------------------------------------------------------------- resume deep into an epoch


@pytest.mark.parametrize("backend", ["torch", "prefetch"])
def test_resume_near_an_epochs_end_reads_only_the_rest(tmp_path, backend):
    """Resuming at sample 900k of ImageNet must not read (or decode) the 900k before it: a loader restored
    at sample 1,900 of 2,000 reads the 100 left, each once (measured at full size: the first batch after
    a resume at 900,000 of 1.28M came in 0.3-0.5 s on every backend, as a fresh epoch's)."""
    from fastdata import Augmentation, make_loader

    reads = []

    class Counting(ImageFolder):
        def read_stamped(self, i):
            reads.append(i)
            return super().read_stamped(i)

    src = Counting(_linked_folder(tmp_path, 4, 500))
    loader = make_loader(src, backend, batch_size=50, device="cpu", num_workers=0, train=False,
                         augment=Augmentation.imagenet_eval(size=4, resize=4))
    state = loader.state_dict()
    loader.load_state_dict(dict(state, samples=1900, batch=38))
    seen = [int(i) for _ in loader for i in loader.batch_ids]
    assert len(seen) == 100 and sorted(reads) == sorted(seen)
    loader.close()


def _reference_fingerprint(src) -> str:
    """ImageFolder's fingerprint as it was computed before (row by row): checkpoints keep resuming."""
    import zlib

    crc = zlib.crc32(os.fsencode("\n".join(map(str, src.classes))))
    prefix = os.path.join(os.fspath(src.root), "")
    for path, label in zip(src.paths, src.labels):
        size = os.stat(path).st_size if os.path.exists(path) else -1
        rel = path[len(prefix):] if path.startswith(prefix) else ""
        if not rel or rel.startswith("..") or os.path.normpath(rel) != rel:
            rel = os.path.relpath(path, src.root)
        crc = zlib.crc32(os.fsencode(f"{rel}\0{label}\0{size}\n"), crc)
    return f"ImageFolder n={len(src)} classes={src.num_classes} files={crc:08x}"


def test_fingerprint_normalizes_only_odd_paths_and_keeps_its_value(tmp_path, monkeypatch):
    """The fingerprint (at the first checkpoint) ran os.path.normpath on every file, a third of its Python
    time at 1.28M files; now only on a path where it may change something, with the same value."""
    root = _linked_folder(tmp_path, 3, 1000, nested=True)
    src = ImageFolder(root)
    expected, calls = _reference_fingerprint(src), []
    real = os.path.normpath
    monkeypatch.setattr(os.path, "normpath", lambda p: calls.append(p) or real(p))
    assert src.fingerprint() == expected
    assert len(calls) < 10, f"normpath ran {len(calls)} times for {len(src)} plain paths"
    monkeypatch.undo()
    odd = [str(root / "n00000" / "img_00000.JPEG"), f"{root}/n00001//img_00002.JPEG", f"{root}/./n00002/img_00000.JPEG",
           f"{root}/n00000/sub/../img_00002.JPEG", str(tmp_path / "seed.jpg"), f"{root}/n00001/sub/img_00001.JPEG"]
    given = ImageFolder.from_samples([(p, k % 3) for k, p in enumerate(odd)], ["a", "b", "c"], root=root)
    assert given.fingerprint() == _reference_fingerprint(given)
