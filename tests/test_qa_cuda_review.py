"""A desk review of fastdata's CUDA paths against the installed torch and DALI (no GPU in these sessions).

What a CPU can check is checked here: the dali backend's GPU graph as DALI itself validates it when the
pipeline is defined (argument names, and that every named argument input is on the CPU, are checked at
definition; only ``build()`` needs CUDA), and the bytes its prefetched outputs take. The ``cuda`` tests
exercise on a GPU what only a GPU can settle: that a batch the consumer drops while its reads are still
queued on the training stream is not overwritten under them (the classic zero-copy bug: DALI hands its
own buffers to torch through DLPack, outside torch's caching allocator and its ``record_stream``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import MEAN, STD, backend_params, indexed_source
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder


@pytest.fixture
def dali():
    """The CPU tests of the dali backend need DALI (not the module: its cuda tests of the other backends
    run in the GPU run's first call, before DALI is installed there)."""
    return pytest.importorskip("nvidia.dali")


# ------------------------------------------------------------------------- the bytes DALI prefetches
def test_a_bfloat16_loaders_depth_is_checked_against_dalis_float32_outputs(dali, monkeypatch):
    """DALI has no bfloat16: a bf16 loader's pipeline outputs float32 (crop_mirror_normalize's dtype,
    converted by torch when handed out), so each prefetched batch takes 4 bytes an element in DALI's
    queue. The depth check counted the loader's 2 bytes: a depth whose outputs do not fit passed (and
    the GPU's default depth of 4 was chosen for half the memory it takes)."""
    import fastdata.backends.dali as dali_backend

    src = indexed_source(64, size=8)             # batches of 16 x (1, 8, 8): 4,096 bytes as float32
    monkeypatch.setattr(dali_backend, "available_ram", lambda: 30_000)
    with pytest.raises(ValueError, match=r"prefetch_queue_depth=10 keeps 10 output batches .* at most 7 fit"):
        make_loader(src, "dali", batch_size=16, device="cpu", dtype="bfloat16", prefetch_queue_depth=10)
    # float16 is made in DALI: 2 bytes an element there, 20,480 bytes for 10 batches: it fits.
    make_loader(src, "dali", batch_size=16, device="cpu", dtype="float16", prefetch_queue_depth=10).close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_itemsize_the_depth_counts_is_what_dali_outputs(dali, dtype, monkeypatch):
    """output_itemsize against the pipeline's real output, read where it is handed to torch."""
    from fastdata.backends.dali import DaliLoader, output_itemsize

    seen = []
    real = DaliLoader._convert

    def convert(self, images, labels):
        seen.append(images.dtype)
        return real(self, images, labels)

    monkeypatch.setattr(DaliLoader, "_convert", convert)
    with make_loader(indexed_source(32), "dali", batch_size=16, device="cpu", dtype=dtype) as loader:
        images = [x for x, _ in loader]
    assert images[0].dtype == dtype and seen and {t.itemsize for t in seen} == {output_itemsize(dtype)}


# ----------------------------------------------------------------- the GPU graph, defined on the CPU
GPU_GRAPHS = {
    "photos-random-resized": ("photos", Augmentation.imagenet_train(size=32), {}),
    "photos-center-fp16-channels-last": ("photos", Augmentation.imagenet_eval(size=32, resize=40),
                                         {"dtype": "float16", "channels_last": True}),
    "arrays-translate-reflect": ("arrays", Augmentation(crop="translate", pad=2, padding="reflect", hflip=0.5), {}),
    "arrays-random-resized": ("arrays", Augmentation(crop="random_resized", size=8, hflip=0.5), {}),
    "arrays-none": ("arrays", Augmentation.none(), {}),
}


@pytest.mark.parametrize("case", list(GPU_GRAPHS))
def test_the_gpu_pipeline_graph_is_one_dali_accepts(dali, case, photo_folder, monkeypatch):
    """The dali backend's pipeline as it is built on a GPU (the ``mixed`` nvJPEG decoder with its tuning
    arguments and preallocation hints, the arrays moved with ``.gpu()``, the crop boxes and flips as
    named arguments), defined on this CPU machine: DALI checks each operator's argument names and that
    every named argument input is a CPU node when the graph is defined; only ``build()`` needs CUDA, so
    it is stubbed. A GPU run that failed on one of these would cost the whole call."""
    import nvidia.dali.fn as fn
    import nvidia.dali.pipeline as dali_pipeline
    import nvidia.dali.plugin.pytorch as dali_torch

    from fastdata.decode.dali_options import files_decoder

    kind, aug, extra = GPU_GRAPHS[case]
    src = ImageFolder(photo_folder) if kind == "photos" else indexed_source(64, size=8, channels=3)
    options = {"decode": "dali"} if kind == "photos" else {}
    loader = make_loader(src, "dali", batch_size=4, device="cpu", augment=aug, train=True, **extra, **options)
    try:
        next(iter(loader))    # learns the first batch's photo sizes: the preallocation hints
        built, decoders = [], []
        real = fn.decoders.image

        def image(*args, **kwargs):
            decoders.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(fn.decoders, "image", image)
        monkeypatch.setattr(dali_pipeline.Pipeline, "build", lambda self: built.append(self))
        monkeypatch.setattr(dali_torch, "DALIGenericIterator", lambda pipe, *a, **k: ("iterator", pipe))
        # What __init__ sets from the device: a GPU loader's flags, its decoder, its GPU index.
        loader.gpu, loader._decoder, loader.device = True, files_decoder(True), torch.device("cuda", 0)
        loader._build()
        assert built == [loader._pipe] and loader._pipe.device_id == 0
        if kind == "photos":
            (kw,) = decoders
            assert kw["device"] == "mixed" and kw["hw_decoder_load"] == 1.0 and kw["preallocate_width_hint"] > 0
        else:
            assert decoders == []
    finally:
        loader._iter = loader._pipe = None   # the stubs are no pipeline to free
        loader.close()


def test_the_pipelines_hand_their_outputs_over_without_a_copy(dali):
    """The module docstring's premise: DALI's default executor (exec_dynamic) keeps outputs valid as long
    as torch holds them, and DALIGenericIterator then hands them over through DLPack without a copy
    (nvidia/dali/plugin/pytorch/__init__.py: ``copy = not is_exec_dynamic``); under the old executor the
    buffers are reused after release_outputs (TensorGPU.__dlpack__'s note). The option set the backend
    passes must keep exec_dynamic on."""
    with make_loader(indexed_source(32), "dali", batch_size=8, device="cpu") as loader:
        it = iter(loader)
        next(it)   # the pass still running: its pipeline is the loader's
        assert loader._pipe.exec_dynamic is True
        it.close()


# ------------------------------------------------------------------------------ on a GPU
def _device_ids(x: torch.Tensor) -> torch.Tensor:
    """indexed_source's ids read back on the device (no host read): pixel (0, 0) + 256 x pixel (0, 1)."""
    px = torch.round((x[:, 0, 0, :2].float() * STD[0] + MEAN[0]) * 255)
    return px[:, 0] + 256 * px[:, 1]


def _late_reads(loader, sleep_cycles: int):
    """One pass whose every read of a batch is queued behind a long kernel on the training stream while
    the batch itself is dropped at once: (checksums, ids) as device tensors, read after the pass."""
    sums, ids = [], []
    for x, _ in loader:
        torch.cuda._sleep(sleep_cycles)      # the "step": the reads below run late on this stream
        sums.append(x.double().sum())
        ids.append(_device_ids(x))
        del x                                # dropped while its reads are still queued
    torch.cuda.synchronize()
    return torch.stack(sums).cpu(), torch.cat(ids).cpu()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", backend_params())
def test_cuda_a_batch_dropped_while_its_reads_are_queued_is_not_overwritten(backend):
    """Every backend: the consumer drops each batch at once while its reads wait on the training stream
    behind a 2 ms kernel; the host runs ahead, so the loader makes later batches meanwhile. A backend
    whose batch memory goes back to a pool without waiting for the training stream (torch's allocator
    without record_stream on a side stream's tensors, or DALI's own buffers, which torch's allocator
    does not manage) lets a later batch overwrite it before the queued read: other ids and sums.
    The reference is the same loader's pass with a synchronize after each batch."""
    src = indexed_source(48 * 64, size=32, channels=3)
    options = {"num_workers": 2} if backend in ("torch", "prefetch") else {}
    with make_loader(src, backend, batch_size=64, device="cuda", train=False, **options) as loader:
        ref = []
        for x, _ in loader:
            ref.append(x.double().sum().item())     # the synchronized pass: nothing is late
        for _ in range(2):
            sums, ids = _late_reads(loader, 4_000_000)
            assert np.array_equal(ids.numpy().astype(np.int64), np.arange(len(src)))
            torch.testing.assert_close(sums, torch.tensor(ref, dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.cuda
def test_cuda_dali_photos_dropped_while_their_reads_are_queued_are_not_overwritten(photo_folder):
    """The same on nvJPEG's path (photos decoded and resized into DALI's buffers), depth 2 so that
    DALI's pool gets each freed buffer back soon."""
    src = ImageFolder(photo_folder)
    aug = Augmentation.imagenet_eval(size=64, resize=72)
    with make_loader(src, "dali", batch_size=2, device="cuda", train=False, augment=aug,
                     prefetch_queue_depth=2) as loader:
        ref = [x.double().sum().item() for x, _ in loader]
        for _ in range(3):
            sums = []
            for x, _ in loader:
                torch.cuda._sleep(20_000_000)
                sums.append(x.double().sum())
                del x
            torch.cuda.synchronize()
            torch.testing.assert_close(torch.stack(sums).cpu(), torch.tensor(ref, dtype=torch.float64),
                                       rtol=1e-5, atol=0)


@pytest.mark.cuda
def test_cuda_a_dali_batch_outlives_the_pipeline_that_made_it():
    """A break ends the pass and frees its pipeline (DaliLoader._release): the batch the consumer still
    holds is DALI's memory, handed over through DLPack. It must stay valid while torch holds it (what
    TensorGPU.__dlpack__'s note promises the default executor), also while a new pipeline allocates
    and its read is queued behind a long kernel."""
    with make_loader(indexed_source(256, size=32, channels=3), "dali", batch_size=64, device="cuda",
                     train=False) as loader:
        ref = [x.double().sum().item() for x, _ in loader]
        for x, _ in loader:
            break
        assert loader._pipe is None                 # freed with the pass
        torch.cuda._sleep(20_000_000)
        held, ids = x.double().sum(), _device_ids(x)
        del x
        later = [y.double().sum() for y, _ in loader]   # a new pipeline, its buffers, while the read waits
        torch.cuda.synchronize()
        assert held.item() == pytest.approx(ref[0], rel=1e-6)
        assert np.array_equal(ids.cpu().numpy().astype(np.int64), np.arange(64))
        assert torch.stack(later).cpu().tolist() == pytest.approx(ref, rel=1e-6)


# ------------------------------------------------------------------------------ nvJPEG's hints
def test_the_hardware_decoders_hints_are_the_encoded_size_of_turned_photos():
    """preallocate_{height,width}_hint size the hardware JPEG decoder's buffers (DALI's schema: "used to
    preallocate memory for the HW JPEG decoder"), which decode the picture as encoded; DALI turns it by
    its EXIF orientation afterwards. The loader's sizes are as shown (DaliFiles: displayed_size), so a
    portrait phone photo (encoded 4000 wide, orientation 6) hinted 3000 x 4000 instead of 4000 wide:
    every such photo outgrew the buffers."""
    from fastdata.decode.dali_options import nvjpeg_hints

    shown = np.array([[4000, 3000, 6], [2000, 2500, 1]])       # (height, width, orientation) as shown
    hints = nvjpeg_hints(shown)
    assert (hints["preallocate_height_hint"], hints["preallocate_width_hint"]) == (3000, 4000)
    assert hints["device_memory_padding"] >= 3 * 4000 * 3000
    assert nvjpeg_hints(shown[:, :2])["preallocate_height_hint"] == 4000   # no orientation: as given


def test_the_pipeline_gets_the_turned_photos_encoded_size(tmp_path, monkeypatch):
    """The same, end to end on the CPU graph: a folder of one photo encoded 60 wide x 40 high and shown
    turned (orientation 6, 40 wide x 60 high) hints the decoder 40 x 60 (height x width)."""
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.fn as fn
    from PIL import Image

    (tmp_path / "a").mkdir()
    for k in range(2):
        img = Image.new("RGB", (60, 40), (40 * k, 90, 160))
        exif = Image.Exif()
        exif[0x0112] = 6
        img.save(tmp_path / "a" / f"p{k}.jpg", exif=exif.tobytes(), quality=90)
    hints = []
    real = fn.decoders.image_slice

    def image_slice(*args, **kwargs):
        hints.append((kwargs.get("preallocate_height_hint"), kwargs.get("preallocate_width_hint")))
        return real(*args, **kwargs)

    monkeypatch.setattr(fn.decoders, "image_slice", image_slice)
    src = ImageFolder(tmp_path)
    with make_loader(src, "dali", batch_size=2, device="cpu", decode="dali", train=False,
                     augment=Augmentation(crop="center", size=32, resize=32, hflip=0.0)) as loader:
        (x, _), = list(loader)
        assert x.shape == (2, 3, 32, 32) and list(loader._dims[:, 2]) == [6, 6]
    assert hints == [(40, 60)]


# ------------------------------------------------------------------ uploads from pageable memory
class _PageableUploads:
    """The host-to-device copies of pageable (unpinned) host memory dispatched on this thread: torch's
    sync debug mode does not see them when they are ``non_blocking`` (only ``memcpy_and_sync``, the
    blocking copy, calls ``warn_or_error_on_sync``: torch/include/c10/cuda/CUDAFunctions.h:79-88), yet
    CUDA stages pageable memory through its own buffer, so such a copy does not overlap as the code
    means it to. A TorchDispatchMode sees every op of its thread (not a prefetch producer's)."""

    def __init__(self, device_type: str = "cuda"):
        from torch.utils._python_dispatch import TorchDispatchMode

        found = self.found = []

        def host(t) -> bool:
            return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                name = func.overloadpacket.__name__
                src = args[0] if name == "_to_copy" else args[1] if name == "copy_" and len(args) > 1 else None
                dst = out if name == "_to_copy" else args[0] if name == "copy_" else None
                if host(src) and isinstance(dst, torch.Tensor) and dst.device.type == device_type \
                        and not src.is_pinned():
                    found.append((name, tuple(src.shape), src.dtype))
                return out

        self.mode = Mode()


def test_the_pageable_upload_spy_sees_to_and_copy_and_leaves_epochs_alone():
    """The spy of the cuda test below, checked here with the meta device standing in for the GPU: it
    flags ``.to()`` and ``copy_()`` of an unpinned host tensor, nothing else; an epoch runs under it."""
    spy = _PageableUploads("meta")
    with spy.mode:
        torch.ones(3).to("meta")
        torch.empty(2, 2, device="meta").copy_(torch.zeros(2, 2))
        torch.ones(4).to(torch.float64)             # host to host
        torch.empty(3, device="meta").double()      # on the device: not an upload
    assert spy.found == [("_to_copy", (3,), torch.float32), ("copy_", (2, 2), torch.float32)]
    quiet = _PageableUploads()
    with make_loader(indexed_source(64), "memory", batch_size=16, device="cpu") as loader, quiet.mode:
        assert sum(x.shape[0] for x, _ in loader) == 64
    assert quiet.found == []


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["arrays", "photos"])
@pytest.mark.parametrize("backend", backend_params())
def test_cuda_an_epoch_uploads_no_pageable_host_memory(backend, kind, photo_folder):
    """After a warm-up epoch (caches, pipelines, the first epoch's uploads), an epoch of each backend
    copies nothing from pageable host memory to the GPU on the consumer's thread: every upload is from
    pinned memory (DataLoader's pinning, ``base.pinned``), or made by DALI itself."""
    if kind == "arrays":
        src, aug, batch = indexed_source(512, size=16, channels=3), Augmentation(crop="translate", pad=2, hflip=0.5), 64
    else:
        src, aug, batch = ImageFolder(photo_folder), Augmentation.imagenet_train(size=32), 4
    options = {"num_workers": 2} if backend in ("torch", "prefetch") else {}
    if backend == "memory" and kind == "photos":
        options["cache_size"] = 40
    with make_loader(src, backend, batch_size=batch, device="cuda", augment=aug, **options) as loader:
        for _ in loader:
            pass
        spy = _PageableUploads()
        with spy.mode:
            batches = sum(1 for x, _ in loader if x.shape[0])
        torch.cuda.synchronize()
        assert batches == len(loader) and spy.found == [], spy.found[:5]


# ------------------------------------------------------------------------------ prefetch's GPU
def test_a_stage_on_cuda_without_an_index_serves_the_gpu_current_where_it_is_made(monkeypatch):
    """PrefetchStage(torch.device("cuda")) made while cuda:1 is current: its producer thread must make
    cuda:1 current too. torch.cuda.device resolves "cuda" to the current device of the thread that makes
    it (torch/cuda/__init__.py: device.__init__ calls _get_device_index), and the producer's scope is
    made on the producer thread, whose current device is cuda:0 (the current device is per thread): the
    DataLoader's pinning and the launches outside the side stream went to cuda:0."""
    import threading

    from fastdata.prefetch import PrefetchStage

    maker = threading.current_thread()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1 if threading.current_thread() is maker else 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("stream on", device))
    stage = PrefetchStage(torch.device("cuda"), depth=1)
    assert stage.device == torch.device("cuda", 1) and stage.stream == ("stream on", torch.device("cuda", 1))
    scopes = []
    producer = threading.Thread(target=lambda: scopes.append(stage.handoff.scope().idx))
    producer.start()
    producer.join()
    assert scopes == [1]
    assert PrefetchStage(torch.device("cuda", 0), depth=1).device == torch.device("cuda", 0)


@pytest.mark.cuda
def test_cuda_a_stage_on_plain_cuda_hands_its_batches_over_on_the_current_gpu():
    """The stage of the test above on a real GPU: made with an unindexed "cuda", it serves the current
    GPU, and its batches (pinned host uint8, normalized on the side stream) arrive whole."""
    from fastdata.prefetch import PrefetchStage

    host = [(torch.full((4, 8, 8, 3), k, dtype=torch.uint8).pin_memory(), torch.full((4,), k).pin_memory())
            for k in range(6)]
    stage = PrefetchStage(torch.device("cuda"), depth=2)
    assert stage.device == torch.device("cuda", torch.cuda.current_device())
    got = [(x.float().mean(), y) for x, y in stage(iter(host), lambda x: x.permute(0, 3, 1, 2).float())]
    stage.close()
    assert [float(m) for m, _ in got] == [float(k) for k in range(6)]
    assert all(y.device == stage.device and int(y[0]) == k for k, (_, y) in enumerate(got))
