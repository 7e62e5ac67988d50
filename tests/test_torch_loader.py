"""torch backend: PIL recipe against torchvision's, reduced-scale decoding, batched workers."""
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import file_bytes
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder
from fastdata.images.photo import load_photo


def torchvision_eval(paths, mean, std):
    from torchvision import transforms as T

    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    return torch.stack([tf(Image.open(p).convert("RGB")) for p in paths])


def test_eval_recipe_matches_torchvision(photo_folder):
    """Resize-shorter-256 + center-crop-224 done as one PIL resize of the crop box (with Image.draft's
    reduced-scale decode) agrees with torchvision's two-step Resize + CenterCrop of the full decode.
    Tolerance: the DCT-domain downscale and the single resampling differ from decode-then-resize
    by a few grey levels (mean |diff| under 0.03 in normalized units ≈ 2/255 after the 1/0.225 std)."""
    src = ImageFolder(photo_folder)
    x = torch.cat([x for x, _ in make_loader(src, "torch", batch_size=6, train=False, device="cpu",
                                             num_workers=0)])
    ref = torchvision_eval(src.paths, src.mean, src.std)
    diff = (x - ref).abs()
    assert diff.mean() < 0.03, diff.mean()
    assert torch.quantile(diff.flatten()[::97], 0.99) < 0.2


def test_draft_decodes_at_reduced_scale_without_changing_the_result_much(photo_folder, monkeypatch):
    path = ImageFolder(photo_folder).paths[0]
    aug = Augmentation(crop="center", size=56, resize=64)   # a small output lets draft use 1/4 scale
    from PIL import JpegImagePlugin

    calls = []
    orig = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        out = orig(self, mode, size)
        calls.append(out)
        return out

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    fast = load_photo(*file_bytes(path), aug, np.random.default_rng(0)).astype(np.float32)
    assert calls and calls[0] is not None, "draft must be asked to shrink the JPEG decode"
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", lambda self, mode, size: None)
    slow = load_photo(*file_bytes(path), aug, np.random.default_rng(0)).astype(np.float32)
    assert fast.shape == slow.shape == (56, 56, 3)
    assert np.abs(fast - slow).mean() < 3.0


def test_random_resized_crop_varies_and_flips(photo_folder):
    src = ImageFolder(photo_folder)
    loader = make_loader(src, "torch", batch_size=6, device="cpu", num_workers=2, seed=0)
    a = torch.cat([x for x, _ in loader])
    b = torch.cat([x for x, _ in loader])
    assert a.shape == (18, 3, 224, 224)
    assert (a - b).abs().mean() > 0.1, "two epochs must crop differently"
    flip = Augmentation(crop="center", size=224, resize=256, hflip=1.0)
    flipped = torch.cat([x for x, _ in make_loader(src, "torch", batch_size=6, train=False, augment=flip,
                                                   device="cpu", num_workers=0)])
    plain = torch.cat([x for x, _ in make_loader(src, "torch", batch_size=6, train=False, device="cpu",
                                                 num_workers=0)])
    torch.testing.assert_close(flipped, plain.flip(3))


def test_photos_without_a_resizing_crop_are_refused(photo_folder):
    with pytest.raises(ValueError, match="needs a crop that fixes the output size"):
        make_loader(ImageFolder(photo_folder), "torch", batch_size=6, augment=Augmentation.none(),
                    device="cpu")


@pytest.mark.parametrize("bad, error", [(True, TypeError), (2.0, TypeError), (0, ValueError)])
def test_a_bad_prefetch_factor_is_refused_by_name(photo_folder, bad, error):
    """With workers, prefetch_factor goes to the DataLoader: True (a bool is an int) and 2.0 slipped
    through the old isinstance(pf, int) check or reached the DataLoader."""
    with pytest.raises(error, match=rf"^prefetch_factor must be an integer >= 1, got {bad}"):
        make_loader(ImageFolder(photo_folder), "torch", batch_size=6, num_workers=1, prefetch_factor=bad,
                    device="cpu", train=False, augment=Augmentation.imagenet_eval(size=16, resize=16))


# ------------------------------------------------------------------ pinning device (issue 9.10)
def test_the_dataloader_gets_no_pin_memory_device():
    import warnings

    from conftest import indexed_source
    from fastdata.backends import torch_loader as tl
    from fastdata.decode import BatchDecoder

    src = indexed_source(40)
    fetcher = BatchDecoder(src, Augmentation.none())
    sampler = tl.JobSampler()
    sampler.jobs = [(np.arange(10), 0)]
    dl = tl.make_dataloader(fetcher, sampler, 0, True, tl.TorchLoader.options)
    assert dl.pin_memory and dl.pin_memory_device == ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(dl)
    assert not [w for w in caught if "pin_memory_device" in str(w.message)]
    scope = tl.device_scope(torch.device("cuda", 1), pin=True)   # constructing it touches no GPU
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    assert tl.device_scope(torch.device("cuda", 1), pin=False).__class__.__name__ == "nullcontext"
    assert tl.device_scope(torch.device("cpu"), pin=True).__class__.__name__ == "nullcontext"


def test_the_iterator_is_created_and_advanced_inside_the_device_scope(monkeypatch):
    """The pin thread takes the current device when the iterator is created; without workers, pinning
    runs at each next(): both inside the scope. No batch is handed over inside it."""
    import contextlib

    from torch.utils.data import dataloader as dlmod

    from conftest import indexed_source
    from fastdata.backends import torch_loader as tl

    active = []

    @contextlib.contextmanager
    def scope(device, pin):
        active.append(device)
        try:
            yield
        finally:
            active.pop()

    monkeypatch.setattr(tl, "device_scope", scope)
    seen = []
    orig_iter, orig_next = dlmod.DataLoader.__iter__, dlmod._BaseDataLoaderIter.__next__

    def spy_iter(self):
        seen.append(("iter", list(active)))
        return orig_iter(self)

    def spy_next(self):
        seen.append(("next", list(active)))
        return orig_next(self)

    monkeypatch.setattr(dlmod.DataLoader, "__iter__", spy_iter)
    monkeypatch.setattr(dlmod._BaseDataLoaderIter, "__next__", spy_next)
    loader = make_loader(indexed_source(40), "torch", batch_size=10, device="cpu", num_workers=0)
    for _ in range(2):
        for x, y in loader:
            assert active == [], "a batch was handed over inside the device scope"
    assert [k for k, _ in seen].count("iter") == 2 and [k for k, _ in seen].count("next") == 2 * 5
    assert all(a == [torch.device("cpu")] for _, a in seen), seen


@pytest.mark.cuda
def test_cuda_batches_are_pinned_without_the_deprecated_option():
    import warnings

    from conftest import decode_ids, indexed_source

    loader = make_loader(indexed_source(200), "torch", batch_size=20, device="cuda", num_workers=2, train=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ids = np.concatenate([decode_ids(x) for x, _ in loader])
            np.testing.assert_array_equal(ids, np.arange(200))
    assert not [w for w in caught if "pin_memory_device" in str(w.message)]
    images, _ = next(loader.host_batches(0, loader.plan.batches(0), 0))
    assert images.is_pinned()
    loader.close()


@pytest.mark.cuda(devices=2)
def test_a_loader_on_the_second_gpu_pins_for_it_and_leaves_the_current_device_alone():
    from conftest import decode_ids, indexed_source

    torch.cuda.set_device(0)
    loader = make_loader(indexed_source(200), "torch", batch_size=20, device="cuda:1", num_workers=2,
                         train=False)
    ids = []
    for x, _ in loader:
        assert x.device == torch.device("cuda", 1)
        assert torch.cuda.current_device() == 0, "the loader changed the caller's current device"
        ids.append(decode_ids(x))
    np.testing.assert_array_equal(np.concatenate(ids), np.arange(200))
    pin_thread = loader._loader._iterator._pin_memory_thread
    assert pin_thread._args[2] == 1, "the pin thread runs on cuda:0"   # (in_queue, out_queue, device_id, ...)
    loader.close()


# ------------------------------------------------------------------ dead workers (issue 10.17)
@pytest.mark.parametrize("kill", [True, False])
def test_a_broken_connection_from_a_killed_worker_names_the_worker(kill, monkeypatch):
    """A SIGKILLed worker sometimes surfaces as ConnectionResetError/EOFError in the main process (the
    race DataLoader's SIGCHLD handler loses). Simulated deterministically: the handler is muted and the
    iterator raises the raw error after the kill. Without a dead worker, the error passes unchanged."""
    import os
    import signal
    import types

    from torch.utils.data._utils import signal_handling

    from conftest import indexed_source

    monkeypatch.setattr(signal_handling, "_error_if_any_worker_fails", lambda: None)
    loader = make_loader(indexed_source(400), "torch", batch_size=8, device="cpu", num_workers=2, train=False)
    it = iter(loader)
    next(it)
    dl_it = loader._loader._iterator
    victim = dl_it._workers[0]

    def broken(self):
        if kill:
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(timeout=10)
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(dl_it, "_next_data", types.MethodType(broken, dl_it))
    if kill:
        with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {victim.pid}\) was killed by signal SIGKILL"):
            next(it)
    else:
        with pytest.raises(ConnectionResetError):
            next(it)
    loader.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_share_which_files_have_been_checked_whole(photo_folder, context):
    """A file one worker decoded whole is not checked again by the other worker that gets it later:
    the flags live in shared memory, written by the workers and seen by every process."""
    src = ImageFolder(photo_folder)
    loader = make_loader(src, "torch", batch_size=4, num_workers=2, device="cpu", train=True, quiet=True,
                         multiprocessing_context=context)
    flags = loader.fetcher.checked
    assert flags is not None and flags.is_shared() and not flags.any()
    seen = sum(len(labels) for _, labels in loader)
    assert int(flags.sum()) == seen == len(loader) * 4  # every file decoded, whichever worker did it, seen here
    loader.close()


@pytest.mark.parametrize("backend", ["torch", "prefetch", "memory"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_leaves_the_callers_global_torch_rng_alone(backend, workers):
    """The DataLoader draws its workers' base seed from a generator: the global one, unless given its own.
    Swapping backends must not shift the training loop's dropout and initialization."""
    import torch

    from fastdata import make_loader
    from fastdata.datasets import SyntheticDigits

    loader = make_loader(SyntheticDigits(256, seed=3), backend, batch_size=64, device="cpu", num_workers=workers,
                         quiet=True)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    for _ in range(2):
        for _ in loader:
            pass
    assert torch.equal(torch.get_rng_state(), before)
    loader.close()


def test_a_datasets_own_randomness_in_workers_follows_the_loaders_seed():
    """The workers' generators are seeded from the DataLoader's base seed: drawn from the loader's own
    generator (not the global one), seeded by ``seed=``, so a Dataset that draws in ``__getitem__``
    repeats with the seed and changes with it."""
    import torch

    from fastdata import make_loader

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.randint(0, 256, (1, 4, 4), dtype=torch.uint8), i % 2

    def first(seed):
        loader = make_loader(Noisy(), "torch", batch_size=8, device="cpu", num_workers=1, seed=seed,
                             train=False, quiet=True)
        try:
            return next(iter(loader))[0]
        finally:
            loader.close()

    assert torch.equal(first(0), first(0))
    assert not torch.equal(first(0), first(1))


_PEER_LEAVES = """
import os, socket, sys, time
from multiprocessing import resource_sharer
if sys.argv[1] == "quiet":
    from fastdata.backends.torch_loader import quiet_worker
    quiet_worker(0)
resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))     # a worker sharing a batch's descriptor
peer = socket.socket(socket.AF_UNIX)
peer.connect(resource_sharer._resource_sharer._address)    # the main process comes for it,
peer.close()                                                # and leaves mid-handshake (Ctrl-C)
time.sleep(0.5)
raise ValueError("a worker's own error still shows")
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_a_worker_does_not_print_the_main_processs_ctrl_c_as_a_traceback(mode):
    """A worker hands batches over as file descriptors from multiprocessing's resource-sharer thread; when
    the main process goes away mid-transfer (Ctrl-C) that thread printed a BrokenPipe traceback under the
    run's one line. quiet_worker (the workers' worker_init_fn) silences that thread's peer-gone errors
    only: the worker's own errors still print. "plain" shows the traceback the hook removes."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PEER_LEAVES, mode], capture_output=True, text=True, timeout=60)
    assert "ValueError: a worker's own error still shows" in proc.stderr
    assert ("resource_sharer.py" in proc.stderr) == (mode == "plain"), proc.stderr


def test_the_workers_start_with_quiet_worker():
    from fastdata.backends.torch_loader import make_dataloader, quiet_worker

    opts = {"prefetch_factor": 2, "persistent_workers": True, "timeout": 0, "multiprocessing_context": None}
    assert make_dataloader([], None, 2, False, opts).worker_init_fn is quiet_worker
    assert make_dataloader([], None, 0, False, opts).worker_init_fn is None


def test_persistent_workers_must_be_a_flag():
    """persistent_workers="yes" was taken as true; a typo'd value is named, as every other flag is."""
    from conftest import indexed_source

    with pytest.raises(TypeError, match=r"torch backend: persistent_workers must be True or False, got 'yes'"):
        make_loader(indexed_source(64), "torch", batch_size=8, device="cpu", persistent_workers="yes")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pass_whose_loader_was_closed_says_so(workers):
    """next() on a pass after close() raised "generator raised StopIteration" (the DataLoader's iterator
    ended under it); it says the loader was closed, and a new pass reads the epoch again."""
    from conftest import indexed_source

    loader = make_loader(indexed_source(64), "torch", batch_size=8, num_workers=workers, device="cpu")
    it = iter(loader)
    next(it)
    loader.close()
    if workers:   # batches the workers had sent before close() may still come; then it says why it ends
        with pytest.raises(RuntimeError, match="the loader was closed while this pass ran"):
            for _ in it:
                pass
    assert sum(len(x) for x, _ in loader) == 64
    loader.close()


def test_a_workers_ctrl_c_guard_is_not_inherited_by_programs_it_runs():
    """quiet_worker keeps Ctrl-C from a DataLoader worker. With SIG_IGN, which survives exec, every
    program a user's dataset started from a worker (a decoder, ffmpeg) was deaf to Ctrl-C too (found
    by the review of the interactive QA pass); a do-nothing handler is reset in an exec'd child."""
    import multiprocessing
    import signal
    import subprocess
    import sys

    from fastdata.backends.torch_loader import quiet_worker

    ctx = multiprocessing.get_context("fork")
    answers = ctx.Queue()

    def worker():
        quiet_worker(0)
        probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
        answers.put((signal.getsignal(signal.SIGINT) is signal.SIG_DFL,
                     subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()))

    process = ctx.Process(target=worker)
    process.start()
    default_in_worker, ignored_in_program = answers.get(timeout=120)
    process.join(timeout=60)
    assert not default_in_worker             # the worker itself still keeps Ctrl-C off
    assert ignored_in_program == "False"     # the program it ran has Python's own Ctrl-C handling


def test_workers_share_this_processs_multiprocessing_folder(tmp_path):
    """Each worker made a pymp-* folder of its own when it first sent a batch (a batch's memory goes as a
    descriptor, through a listener socket in it), and a worker stopped mid-epoch could exit before its
    clean-up removed it: an empty folder left in TMPDIR now and then. The loader makes this process's
    first, which forked workers use: one folder while two workers run, none after the process ends."""
    import json
    import os
    import subprocess
    import sys

    script = """
import json, os, sys
from fastdata import make_loader
from fastdata.datasets import SyntheticDigits
loader = make_loader(SyntheticDigits(512, seed=0), "torch", batch_size=32, num_workers=2,
                     multiprocessing_context="fork")
it = iter(loader)
for _ in range(4):
    next(it)
print(json.dumps(sorted(d for d in os.listdir(sys.argv[1]) if d.startswith("pymp-"))))
loader.close()
"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-c", script, str(tmp)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stderr[-3000:]
    running = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(running) == 1, running          # the parent's, shared by both workers
    assert not [d for d in os.listdir(tmp) if d.startswith("pymp-")]   # gone with the process
