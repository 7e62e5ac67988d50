"""Defects earlier QA passes found in the loaders and sources and left unmended (carried over): the
class names copied at every access, a path with a lone surrogate, a Ctrl-C inside the dali backend's
close(), the memory backend's cache_size warning, ranks without a process group deciding on their own
free RAM, check_picklable's copy of nested arrays."""
from __future__ import annotations

import copy
import os
import pickle

import numpy as np
import pytest

from conftest import indexed_source
from fastdata import Augmentation, make_loader
from fastdata.datasets import ArraySource, ImageFolder


# ------------------------------------------------------------------ 1. class names, made once
def test_loader_classes_is_one_plain_list_made_once():
    """``loader.classes`` (and ``source.classes``) built a new list at each access: a loop naming each
    sample's class copied all 10,000 names per sample. Now the source's own list every time: a plain
    list (a read-only kind of list was tried, and broke Lightning's hparams.yaml and checkpoints read
    where fastdata is not installed); the list a caller gave is still copied once."""
    names = [f"c{k}" for k in range(10_000)]
    src = ArraySource(np.zeros((4, 8, 8, 3), np.uint8), [0, 1, 2, 3], classes=names)
    loader = make_loader(src, "memory", batch_size=2, device="cpu", augment=Augmentation.none())
    assert loader.classes is loader.classes is src.classes
    assert loader.classes == names and type(loader.classes) is list and loader.classes[9_999] == "c9999"
    names.append("later")   # the caller's own list, given to the source: not the source's names
    assert len(src.classes) == 10_000
    again = pickle.loads(pickle.dumps(loader.classes))
    assert type(again) is list and again == loader.classes and copy.deepcopy(src.classes) == names[:-1]


def test_class_names_go_where_a_list_goes():
    """Lightning writes hparams to YAML, which represents a list and nothing derived from it."""
    yaml = pytest.importorskip("yaml")
    src = ArraySource(np.zeros((2, 8, 8, 3), np.uint8), [0, 1], classes=["cat", "dog"])
    loader = make_loader(src, "memory", batch_size=2, device="cpu", augment=Augmentation.none())
    assert yaml.safe_load(yaml.safe_dump({"classes": loader.classes})) == {"classes": ["cat", "dog"]}


def test_loader_classes_of_a_source_without_names_and_of_a_plain_list():
    """Unnamed classes are 0 .. num_classes-1, also made once; a source of one's own that keeps a plain
    list is copied once, and again only when it holds another list."""
    loader = make_loader(indexed_source(16), "memory", batch_size=4, device="cpu", augment=Augmentation.none())
    assert loader.classes == list(range(loader.num_classes)) and loader.classes is loader.classes

    class Plain:   # what loader_classes reads of a source: classes, or num_classes
        num_classes = 2
        classes = ["a", "b"]

    from fastdata.datasets.base import loader_classes

    first, made = loader_classes(Plain)
    assert first == ["a", "b"] and loader_classes(Plain, made)[0] is first
    Plain.classes = ["a", "c"]
    assert loader_classes(Plain, made)[0] == ["a", "c"]


# ------------------------------------------------------------------ 2. file names that are not UTF-8
def _photo_bytes(value: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((20, 24, 3), value, np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def latin1_folder(tmp_path):
    """A folder whose class folder and file names are Latin-1 bytes, not UTF-8 (an old camera's or
    archive's), made through bytes paths as Linux holds them."""
    root = os.fsencode(tmp_path / "photos")
    for c in (b"cat", b"d\xfcsel"):
        os.makedirs(os.path.join(root, c))
        for k in range(3):
            fd = os.open(os.path.join(root, c, b"f\xe9te%d.jpg" % k), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, _photo_bytes(40 * k))
            os.close(fd)
    return os.fsdecode(root)


@pytest.mark.parametrize("backend", ["torch", "memory", "dali"])
def test_an_image_folder_of_names_that_are_not_utf8_is_read_by_every_backend(latin1_folder, backend):
    """Linux file names are bytes; Python gives an undecodable one as a str with \\udc80-\\udcff
    (surrogateescape), which PathTable keeps and gives back byte for byte."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    src = ImageFolder(latin1_folder)
    assert src.classes == ["cat", "d\udcfcsel"] and os.fsencode(src.paths[5]).endswith(b"d\xfcsel/f\xe9te2.jpg")
    extra = {"num_workers": 0} if backend == "torch" else {}
    with make_loader(src, backend, batch_size=3, device="cpu", augment=Augmentation.imagenet_eval(size=16),
                     **extra) as ld:
        assert sorted(y for _, labels in ld for y in labels.tolist()) == [0, 0, 0, 1, 1, 1]


def test_from_samples_takes_undecodable_and_bytes_paths_and_names_one_no_file_can_have(latin1_folder):
    """from_samples over os.fsdecode's names, or the names as bytes, reads the files; a str whose lone
    surrogate no bytes decode to ("\\ud800") failed with UnicodeEncodeError naming no path."""
    walked = ImageFolder(latin1_folder)
    as_str = ImageFolder.from_samples(list(zip(walked.paths, walked.labels.tolist())), walked.classes)
    as_bytes = ImageFolder.from_samples([(os.fsencode(p), y) for p, y in zip(walked.paths, walked.labels.tolist())],
                                        walked.classes)
    assert as_str.paths == walked.paths and as_bytes.paths == walked.paths
    assert as_bytes.read(5) == _photo_bytes(80)
    bad = os.path.join(latin1_folder, "cat", "a\ud800.jpg")
    with pytest.raises(ValueError, match=r"path '.*a\\ud800\.jpg' names no file: its character '\\ud800' \(at "
                                         r"\d+\) is a lone surrogate.*utf-8.*surrogateescape.*as bytes"):
        ImageFolder.from_samples([(walked.paths[0], 0), (bad, 1)], ["cat", "dog"])


# ------------------------------------------------------------------ 3. Ctrl-C inside the dali backend's close()
def _dali_loader_with_copies(root):
    """A dali loader (decode='dali', CPU) that has read a pass, and its folder of rewritten copies."""
    pytest.importorskip("nvidia.dali")
    from test_qa_dali import _folder_with_a_tiff

    loader = make_loader(_folder_with_a_tiff(root), backend="dali", device="cpu", decode="dali", batch_size=3,
                         drop_last=False, seed=1, augment=Augmentation.imagenet_train(size=16))
    assert sum(len(y) for _, y in loader) == 9
    assert loader._rewrite_dir is not None and os.listdir(loader._rewrite_dir)
    return loader, loader._rewrite_dir


def test_a_ctrl_c_while_dali_close_joins_its_threads_still_removes_the_copies(tmp_path):
    """A KeyboardInterrupt inside close() (here: while it joins the reading threads) skipped removing
    the folder of copies, which then stayed until the process's exit (a notebook kernel's life). Now
    it is removed and the KeyboardInterrupt still reaches the caller."""
    loader, copies = _dali_loader_with_copies(tmp_path / "photos")
    real = loader._readers.shutdown

    def interrupted(timeout=None):
        real(timeout)
        raise KeyboardInterrupt

    loader._readers.shutdown = interrupted
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert not os.path.exists(copies) and loader._rewrite_dir is None
    loader.assembler.shutdown(1.0)   # what the interrupt kept close() from doing


def test_a_ctrl_c_inside_removing_the_copies_leaves_them_for_the_next_close(tmp_path, monkeypatch):
    """Interrupted inside the removal itself, the loader forgot the folder first: a second close()
    could not remove it. Now it is forgotten once removed."""
    import shutil

    loader, copies = _dali_loader_with_copies(tmp_path / "photos")
    real = shutil.rmtree

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(shutil, "rmtree", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert os.path.exists(copies) and loader._rewrite_dir == copies
    loader.close()
    assert not os.path.exists(copies) and loader._rewrite_dir is None


# ------------------------------------------------------------------ 6. check_picklable's copy of nested arrays
class _Held:
    """A source's attributes as check_picklable reads them (vars())."""

    def __init__(self, **attrs):
        vars(self).update(attrs)


def _checked_peak(source) -> int:
    """The peak of memory allocated while check_picklable checks ``source`` (bytes)."""
    import tracemalloc

    from fastdata.datasets.base import check_picklable

    tracemalloc.start()
    try:
        check_picklable(source, "multiprocessing_context='spawn'")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_check_picklable_does_not_copy_arrays_nested_in_a_source():
    """Under spawn/forkserver, check_picklable pickled every attribute but a top-level array: an array
    in a dict (or an ImageFolder's PathTable, or a source pickled whole by its __reduce__) was copied
    into pickle's output once, 64 MiB here, to be thrown away. Now its peak is a few KiB, and what it
    is for still holds: an unpicklable object nested beside the arrays is named."""

    from fastdata.datasets.base import check_picklable

    big = np.ones(64 * 2**20, np.uint8)
    held = _Held(features={"train": big, "names": ["a", "b"]}, table=(big[: 2**20].tobytes(), big))
    assert _checked_peak(held) < 2 * 2**20
    for unpicklable in ({"train": big, "fn": lambda x: x}, np.array([lambda x: x, 1], dtype=object)):
        with pytest.raises(TypeError, match=r"_Held cannot be sent.*its attribute 'features'"):
            check_picklable(_Held(features=unpicklable), "multiprocessing_context='spawn'")


def test_check_picklable_does_not_pickle_a_list_of_plain_values_element_by_element():
    """A source holding ImageNet's 1.28M paths as a list: pickling it element by element (each string
    memoized) took 1.2 s at every loader made under spawn, and its memo as many entries. A list of plain
    values always pickles; one holding any other object (a str subclass, a lambda) is still checked."""

    from fastdata.datasets.base import check_picklable

    paths = [f"train/n{i % 1000:08d}/img_{i}.JPEG" for i in range(200_000)]
    held = _Held(paths=paths, labels=[i % 1000 for i in range(200_000)], pairs=(("a", 1), ("b", 2)))
    assert _checked_peak(held) < 2 * 2**20

    class Path(str):
        def __reduce__(self):
            raise TypeError("a path bound to an open archive")

    for unpicklable in (["a", Path("b")], ("a", lambda x: x), [["a", "b"], [lambda x: x]]):
        with pytest.raises(TypeError, match=r"_Held cannot be sent.*its attribute 'paths'"):
            check_picklable(_Held(paths=unpicklable), "multiprocessing_context='spawn'")


# ------------------------------------------------------------------ 5. ranks without a process group
_CHOOSE = """
import json, sys
import fastdata.backends.memory.budgeting as budgeting
from fastdata import Augmentation
from fastdata.config import LoaderConfig
from fastdata.datasets import ImageFolder
from fastdata.registry import choose

# This rank's node has this much RAM available (another job's usage on rank 1's): what the ranks differ in.
budgeting.available_ram = lambda: int(sys.argv[2])
config, _ = LoaderConfig.from_kwargs(None, dict(batch_size=2, device="cpu",
                                                augment=Augmentation.imagenet_train(size=16)))
print(json.dumps(choose(ImageFolder(sys.argv[1]), config, {})))
"""


def test_ranks_without_a_process_group_choose_the_same_backend_whatever_ram_each_has_free(tmp_path):
    """backend='auto' under torchrun's variables, before init_process_group: each rank decided on its
    own host's available RAM (MemAvailable), so a rank whose node had less free picked torch where the
    others picked memory. Two real rank processes, one with 1 TiB available and one with 1 MiB: the
    same backend now, decided on the host's total RAM split between the node's ranks."""
    import json
    import subprocess
    import sys

    from fastdata.datasets.folders import make_image_folder

    make_image_folder(tmp_path / "photos", classes=2, per_class=4, seed=1)   # a 1.5 MiB cache at 256²
    script = tmp_path / "choose.py"
    script.write_text(_CHOOSE)
    import fastdata

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(fastdata.__file__)),
                                         env.get("PYTHONPATH", "")])   # the fastdata under test
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "photos"), str(free)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2"})
             for r, free in enumerate((2**40, 2**20))]
    outs = [p.communicate(timeout=300) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), [err[-2000:] for _, err in outs]
    (name0, why0), (name1, why1) = (json.loads(out) for out, _ in outs)
    assert name0 == name1 == "memory", (why0, why1)
    assert why0 == why1 and "the host's total RAM shared by LOCAL_WORLD_SIZE=2 ranks" in why0


@pytest.mark.parametrize("version", [1, 2])
def test_the_total_ram_ranks_decide_on_is_capped_by_the_memory_cgroups_limit(tmp_path, monkeypatch, version):
    """The rank-independent pool is the host's RAM under the tightest cgroup limit (a container's, a
    job's), not its usage: the same in every process of the job."""
    from fastdata import host_memory
    from test_qa_memory import _cgroup_tree

    mib = 2**20
    root, proc = _cgroup_tree(tmp_path, version, {"job": str(1024 * mib), "job/step": str(4096 * mib)},
                              usage=600 * mib, inactive=100 * mib)
    assert host_memory.cgroup_limit(root, proc) == 1024 * mib and host_memory.cgroup_room(root, proc) == 524 * mib
    assert host_memory.cgroup_limit(*_cgroup_tree(tmp_path / "none", version, {}, usage=1, inactive=0)) is None
    monkeypatch.setattr(host_memory, "cgroup_limit", lambda: 1024 * mib)
    assert host_memory.total_ram() == 1024 * mib


# ------------------------------------------------------------------ 4. the memory backend's cache_size warning
def test_a_cache_size_under_the_crop_says_what_to_pass_what_it_costs_and_whether_it_fits(tmp_path):
    """The slots are sized before decoding, from cache_size (256 by default: 192 KiB a photo), and the
    warning for a crop larger than them said "pass cache_size>=384 (the budget allowing)": not how to
    pass it, why it matters, nor whether that cache fits. Now it names all three."""
    from fastdata.datasets.folders import make_image_folder

    make_image_folder(tmp_path / "photos", classes=2, per_class=4, seed=1)
    with pytest.warns(UserWarning, match=r"cache_size=24 is smaller than the crop size 32: .* blurrier than the "
                                         r"torch and dali backends' crops of the full photo\. Pass cache_size>=32 "
                                         r"\(make_loader\(source, 'memory', cache_size=32\); 'auto' passes it on\): "
                                         r"the cache then takes [\d.]+ MiB, which the budget allows \("):
        loader = make_loader(ImageFolder(tmp_path / "photos"), "memory", batch_size=2, device="cpu", cache_size=24,
                             augment=Augmentation.imagenet_train(size=32))
    assert "blurrier" in loader._small_slots_text(loader.cache, 32)
    huge = loader._small_slots_text(loader.cache, 200_000)   # 8 photos at 200,000² would take 894 GiB
    assert "the cache then takes" in huge and "more than the" in huge and "the budget allows: lower memory_reserve, " \
        "or use the 'torch' or 'dali' backend, which crop from the full photo" in huge


# ------------------------------------------------------------------ 7. threads alive when workers fork
_FORKS = """
import os, sys, threading
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder

seen = []
main = os.getpid()
# Not multiprocessing's QueueFeederThread: torch's own, feeding the last epoch's worker queues, which its
# DataLoader closes without joining; it may still be ending at the next epoch's fork (CI at 5082348).
os.register_at_fork(before=lambda: os.getpid() == main and seen.append(
    sorted(t.name for t in threading.enumerate()
           if t is not threading.main_thread() and t.name != "QueueFeederThread")))
src, aug = ImageFolder(sys.argv[1]), Augmentation.imagenet_train(size=16)
for _ in make_loader(src, "memory", batch_size=4, device="cpu", augment=aug, cache_size=64):
    pass   # an evaluation or warm-up loader of another backend before the training one
loader = make_loader(src, "torch", batch_size=4, device="cpu", num_workers=2, persistent_workers=False, augment=aug)
for _ in range(2):
    for _ in loader:
        pass
print(seen)
"""


def test_a_torch_loaders_workers_fork_with_no_thread_of_fastdatas_alive(tmp_path):
    """Python 3.12 warns that forking a multi-threaded process may deadlock the child. It counts OS
    threads (numpy's OpenBLAS pool is enough: docs/install.md), which fastdata cannot help; but no
    thread of fastdata's own may be alive at a torch loader's fork: after another loader's pass (the
    memory backend's draw-ahead thread), at each epoch's fork of fresh workers."""
    import ast
    import subprocess
    import sys

    import fastdata
    from fastdata.datasets.folders import make_image_folder

    make_image_folder(tmp_path / "photos", classes=2, per_class=4, seed=1)
    script = tmp_path / "forks.py"
    script.write_text(_FORKS)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(fastdata.__file__))}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "photos")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    forks = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert len(forks) == 4 and forks == [[]] * 4, forks   # 2 workers x 2 epochs, each fork with none alive
