"""Reliability, bad input: broken files, odd formats, bombs, bad folders and
arguments, a cache that does not fit. Every case must end in a clear, named error or a documented,
counted skip — never a hang, an out-of-memory or a silently wrong batch."""
from __future__ import annotations

import gc
import io
import shutil
import time
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import backend_params, indexed_source
from fastdata import Augmentation, CacheDoesNotFit, DecodeError, make_loader
from fastdata.datasets import MNIST, ImageFolder, make_image_folder
from procs import children, wait_until

FILE_BACKENDS = backend_params()   # every row of the registry; one not installed shows as skipped
EVAL = Augmentation(crop="center", size=32, resize=32)
PLAIN = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))  # images come out as pixel / 255


def _good_jpeg_bytes() -> bytes:
    rng = np.random.default_rng(0)
    arr = (rng.random((60, 80, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((20, 20, 3), 100, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _damaged_png_bytes() -> bytes:
    """A PNG with 16 bytes of its compressed pixel data inverted (bit rot, a bad copy): Pillow opens its
    header and fails on the data stream. Its EXIF chunk could follow the pixels, so reading its
    orientation loads it: that failure must not pass for an unreadable EXIF block."""
    arr = (np.random.default_rng(2).random((60, 80, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
    with pytest.raises(OSError):
        Image.open(io.BytesIO(bytes(data))).load()
    return bytes(data)


BAD_FILES = {
    "truncated_jpeg": lambda: _good_jpeg_bytes()[: len(_good_jpeg_bytes()) // 2],
    "zero_bytes": lambda: b"",
    "random_bytes": lambda: np.random.default_rng(1).bytes(4000),
    "png_named_jpg": _png_bytes,
    "png_broken_stream": _damaged_png_bytes,
}
#: The file name's ending, where it is not ".jpg".
BAD_SUFFIX = {"png_broken_stream": ".png"}


@pytest.fixture(scope="module")
def small_photos(tmp_path_factory):
    """2 classes x 3 small JPEGs: decoding costs nothing, the tests measure behaviour."""
    return make_image_folder(tmp_path_factory.mktemp("small"), classes=2, per_class=3, seed=4,
                             size_range=((70, 90), (50, 70)))


def _with_bad_file(small_photos, tmp_path, data: bytes, suffix: str = ".jpg"):
    root = tmp_path / "folder"
    shutil.copytree(small_photos, root)
    bad = root / "class_001" / f"img_00001_broken{suffix}"  # sorts inside the class, not only at the end
    bad.write_bytes(data)
    return root, bad


def _loader(root, backend, **kw):
    return make_loader(ImageFolder(root), backend, batch_size=4, train=False, device="cpu", num_workers=2,
                       augment=EVAL, **kw)


# ------------------------------------------------------------------------------------ broken files
@pytest.mark.parametrize("kind", sorted(BAD_FILES))
@pytest.mark.parametrize("backend", FILE_BACKENDS)
def test_a_broken_file_raises_a_decode_error_naming_it(backend, kind, small_photos, tmp_path):
    root, bad = _with_bad_file(small_photos, tmp_path, BAD_FILES[kind](), BAD_SUFFIX.get(kind, ".jpg"))
    t0 = time.monotonic()
    with pytest.raises(DecodeError) as info:
        loader = _loader(root, backend)   # memory decodes (and fails) here, at cache time
        for _ in loader:
            pass
    # "within seconds", told apart from a hang: generous, because the suite may run on busy cores
    assert time.monotonic() - t0 < 30, "the error must arrive within seconds, not hang"
    err = info.value
    assert str(bad) in str(err), str(err)
    # .path survives the trip from a worker process (DataLoader rebuilds the exception from its text)
    assert err.path == str(bad), (err.path, str(err)[:300])
    assert err.reason
    if backend in ("torch", "prefetch"):
        # decoded in a worker process: the message carries the worker's traceback down to the decoder
        assert "Original Traceback" in str(err) and "photo.py" in str(err), str(err)[:500]
    # (memory builds its cache in threads of this process: the DecodeError itself arrives, with .path)
    del info, err
    _shut_down_leftover_workers()  # memory's leftover (see the next test) must not stall later tests


def _shut_down_leftover_workers():
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    for obj in gc.get_objects():
        if type(obj) is _MultiProcessingDataLoaderIter:  # isinstance() trips deprecated proxies
            obj._shutdown_workers()
    gc.collect()


@pytest.mark.parametrize("backend", FILE_BACKENDS)
def test_a_failed_loader_is_cleaned_up_at_once(backend, small_photos, tmp_path):
    """After a worker's error the loader leaves nothing behind that stalls the process later: workers
    are shut down when the error is raised, not by a garbage-collection pass that can wait 5 s per
    worker on half-cleared queues, or run in a forked child."""
    root, _ = _with_bad_file(small_photos, tmp_path, b"")
    before = children()
    with pytest.raises(DecodeError):
        list(_loader(root, backend))
    # No gc.collect() here: the workers must be gone because the error shut them down, not because a
    # collection happened to finalize the iterator (which is what stalled for 5 s per worker).
    gone = wait_until(lambda: not (children() - before), 15)
    if gone:
        return
    _shut_down_leftover_workers()
    raise AssertionError("the failed loader's workers were still alive: they were not shut down with the error")


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
@pytest.mark.parametrize("backend", FILE_BACKENDS)
def test_skip_drops_the_file_counts_it_and_warns(backend, kind, small_photos, tmp_path):
    root, bad = _with_bad_file(small_photos, tmp_path, BAD_FILES[kind](), BAD_SUFFIX.get(kind, ".jpg"))
    src = ImageFolder(root)
    assert len(src) == 7
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = _loader(root, backend, on_error="skip")
        batches = [(x, y) for x, y in loader]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("skipped 1 " in m for m in messages), messages
    n = sum(len(y) for _, y in batches)
    assert n == 6, "the 6 good files are read, the broken one is not"
    labels = torch.cat([y for _, y in batches]).numpy()
    assert sorted(labels.tolist()) == [0, 0, 0, 1, 1, 1]
    assert len(batches) == len(loader), "len(loader) must equal the batches yielded"
    if backend == "memory":
        # memory drops the file when it builds the cache: the epoch is planned over 6 samples, and every
        # epoch counts (and reports) the file it lacks in the one counter every backend uses.
        assert loader.skipped_at_cache == 1 and loader.skipped == 1
        assert len(loader) == 2 and [len(y) for _, y in batches] == [4, 2]
        with pytest.warns(RuntimeWarning, match="skipped 1 undecodable"):
            assert sum(len(y) for _, y in loader) == 6 and loader.skipped == 1
    else:
        # the documented rule (TorchLoader docstring): len() counts batches of the 7-file plan; the
        # batch that held the broken file (the second: 3 + 4 files in order) comes out one short.
        assert loader.skipped == 1
        assert len(loader) == 2 and [len(y) for _, y in batches] == [4, 2]
        # the count is per epoch and the next epoch finds (and reports) the same file again
        with pytest.warns(RuntimeWarning, match="skipped 1 undecodable"):
            assert sum(len(y) for _, y in loader) == 6 and loader.skipped == 1


@pytest.mark.parametrize("backend", [p for p in FILE_BACKENDS if p.values[0] != "memory"])
def test_a_batch_of_only_broken_files_comes_out_empty_not_missing(backend, small_photos, tmp_path):
    """The length rule holds even when every file of a batch is skipped: that batch has 0 samples."""
    root = tmp_path / "folder"
    shutil.copytree(small_photos, root)
    for i in range(4):  # class_002 sorts last: with batch_size=4 and 6 + 4 files, it is the last batch
        (root / "class_002").mkdir(exist_ok=True)
        (root / "class_002" / f"bad_{i}.jpg").write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = make_loader(ImageFolder(root), backend, batch_size=4, train=False, device="cpu",
                             num_workers=2, augment=EVAL, on_error="skip")
        sizes = [len(y) for _, y in loader]
    assert len(loader) == 3 and sizes == [4, 2, 0], sizes
    assert loader.skipped == 4


# ------------------------------------------------------------------------------- odd image formats
def _scene(h=48, w=64) -> np.ndarray:
    """An asymmetric picture (a rotation or a flip changes it): gradients plus a bright top-left block."""
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([xx * 255 // w, yy * 255 // h, 255 - (xx + yy) * 255 // (w + h)], -1).astype(np.uint8)
    img[4:16, 4:20] = (250, 40, 40)
    return img


def _write_odd_formats(root):
    """Every odd format of one scene, in one class folder; returns {file name: what it is}."""
    d = root / "odd"
    d.mkdir(parents=True)
    scene = _scene()
    pil = Image.fromarray(scene)
    pil.convert("CMYK").save(d / "cmyk.jpg", "JPEG", quality=95)
    pil.convert("L").save(d / "grey.jpg", "JPEG", quality=95)
    pil.convert("P", palette=Image.ADAPTIVE, colors=64).save(d / "palette.png")
    rgba = pil.convert("RGBA")
    rgba.putalpha(128)
    rgba.save(d / "alpha.png")
    grey16 = (np.asarray(pil.convert("L")).astype(np.uint16) * 257)
    Image.fromarray(grey16).save(d / "grey16.png")                 # mode I;16
    assert Image.open(d / "grey16.png").mode.startswith("I")
    # EXIF orientation 6 (rotate 90° CW to display): store the scene turned the other way.
    stored = pil.transpose(Image.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(d / "exif6.jpg", "JPEG", quality=95, exif=exif.tobytes())
    # An orientation in XMP alone (tiff:Orientation): ignored, as nvImageCodec, DALI and torchvision.io
    # ignore it, so the scene is stored as it is displayed.
    buf = io.BytesIO()
    pil.save(buf, "JPEG", quality=95)
    xmp = (b'http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf='
           b'"http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description xmlns:tiff='
           b'"http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    data = buf.getvalue()
    (d / "xmp6.jpg").write_bytes(data[:2] + b"\xff\xe1" + (len(xmp) + 2).to_bytes(2, "big") + xmp + data[2:])
    assert Image.open(d / "xmp6.jpg").getexif().get(0x0112) == 6   # what Pillow alone would apply
    # A multi-picture JPEG (a phone's photo with a gain map appended, MPF index in APP2) named .jpg: a
    # JPEG whose first picture is the photo.
    pil.save(d / "mpo.jpg", "MPO", save_all=True, append_images=[pil.resize((16, 12))], quality=95)
    assert Image.open(d / "mpo.jpg").format == "MPO"
    # The other formats torchvision's ImageFolder lists (the WebP codec may be missing from Pillow).
    for ext in ("bmp", "tif", "ppm"):
        pil.save(d / f"scene.{ext}")
    pil.convert("L").save(d / "grey.pgm")
    return d


def _reference(path) -> np.ndarray:
    """Pillow's own reading: EXIF applied, converted to RGB (16-bit scaled), resize 32 + center-crop 32."""
    img = Image.open(path)
    from PIL import ImageOps

    if "xmp" not in path.rsplit("/", 1)[-1]:   # (Pillow would apply XMP's orientation too)
        img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I"):
        img = Image.fromarray((np.asarray(img).astype(np.float64) / 257).round().astype(np.uint8))
    img = img.convert("RGB")
    w, h = img.size
    s = 32 / min(w, h)
    img = img.resize((round(w * s), round(h * s)), Image.BILINEAR)
    left, top = (img.width - 32) // 2, (img.height - 32) // 2
    return np.asarray(img.crop((left, top, left + 32, top + 32)))


@pytest.fixture(scope="module")
def odd_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    _write_odd_formats(root)
    return root


@pytest.mark.parametrize("backend", FILE_BACKENDS)
def test_odd_formats_become_3_channel_images_matching_pillow(backend, odd_folder):
    src = ImageFolder(odd_folder)
    loader = make_loader(src, backend, batch_size=len(src), train=False, device="cpu", num_workers=0,
                         augment=EVAL, **({"cache_size": 32} if backend == "memory" else {}), **PLAIN)
    (x, _), = list(loader)
    assert x.shape == (len(src), 3, 32, 32)
    got = (x.permute(0, 2, 3, 1).numpy() * 255)
    scene_ref = _reference_scene()
    for i, path in enumerate(src.paths):
        name = path.rsplit("/", 1)[-1]
        ref = _reference(path).astype(np.float32)
        diff = np.abs(got[i] - ref).mean()
        # resamplers differ a little between backends (PIL box filter, DALI's antialiased linear,
        # the memory cache's grid_sample): a few grey levels on average
        assert diff < 8.0, f"{backend}: {name} differs from Pillow's reading by {diff:.1f} grey levels"
        if name not in ("grey.jpg", "grey16.png", "grey.pgm"):
            # orientation and colour are right: close to the scene itself, and far from its mirror
            to_scene = np.abs(got[i] - scene_ref).mean()
            to_mirror = np.abs(got[i] - scene_ref[:, ::-1]).mean()
            assert to_scene < 12 and to_mirror > 2 * to_scene, (backend, name, to_scene, to_mirror)
        else:
            assert np.abs(got[i] - got[i][..., :1]).max() < 1.0, f"{name}: grey must give R = G = B"


def _reference_scene():
    img = Image.fromarray(_scene())
    img = img.resize((43, 32), Image.BILINEAR)
    left = (43 - 32) // 2
    return np.asarray(img.crop((left, 0, left + 32, 32))).astype(np.float32)


# ----------------------------------------------------------------------------- decompression bombs
@pytest.fixture(scope="module")
def bomb_folder(tmp_path_factory):
    """A real decompression bomb: a 12000 x 12000 1-bit PNG (144 Mpx, tens of KB on disk)."""
    root = tmp_path_factory.mktemp("bomb")
    d = root / "cls"
    d.mkdir()
    Image.fromarray(_scene()).save(d / "a_fine.jpg", "JPEG")
    Image.new("1", (12000, 12000)).save(d / "b_bomb.png", optimize=False)
    assert (d / "b_bomb.png").stat().st_size < 5_000_000
    return root


@pytest.mark.parametrize("backend", FILE_BACKENDS)
def test_a_decompression_bomb_is_a_named_error(backend, bomb_folder):
    bomb = bomb_folder / "cls" / "b_bomb.png"
    t0 = time.monotonic()
    with pytest.raises(DecodeError, match="decompression-bomb") as info:
        loader = make_loader(ImageFolder(bomb_folder), backend, batch_size=2, train=False, device="cpu",
                             num_workers=0, augment=EVAL)
        list(loader)
    assert info.value.path == str(bomb)
    assert "144000000" in str(info.value) or "12000x12000" in str(info.value)  # says how big it is
    assert time.monotonic() - t0 < 30, "refused at once, never decoded (a decode would take minutes)"


# ----------------------------------------------------------------------- bad folders and IDX files
def test_folder_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        ImageFolder(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no class sub-folders") as info:
        ImageFolder(empty)
    assert str(empty) in str(info.value) and "tar" not in str(info.value)
    # WebDataset shards of another tool, taken for an image folder: the way to read them is named.
    (empty / "train-000.tar").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no class sub-folders.*1 tar file\(s\) \(train-000.tar.*"
                                                r"fastdata pack .*empty OUT"):
        ImageFolder(empty)
    root = tmp_path / "root"
    (root / "cats").mkdir(parents=True)
    (root / "dogs").mkdir()
    Image.fromarray(_scene()).save(root / "cats" / "a.jpg")
    (root / "dogs" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match="has no images") as info:
        ImageFolder(root)
    assert str(root / "dogs") in str(info.value)
    afile = tmp_path / "file.jpg"
    afile.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="file.jpg"):
        ImageFolder(afile)


def _write_idx(path, array: np.ndarray, magic: bytes | None = None, cut: int = 0):
    import struct

    header = magic or bytes([0, 0, 0x08, array.ndim])
    data = header + struct.pack(">" + "I" * array.ndim, *array.shape) + array.astype(np.uint8).tobytes()
    path.write_bytes(data[: len(data) - cut] if cut else data)


def _mnist_layout(tmp_path, images_kw=None, labels_kw=None):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    _write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 255, (20, 28, 28)), **(images_kw or {}))
    _write_idx(raw / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 20), **(labels_kw or {}))
    return raw


def test_mnist_idx_files_good_wrong_magic_and_truncated(tmp_path):
    _mnist_layout(tmp_path / "good")
    assert len(MNIST(tmp_path / "good", train=False, download=False)) == 20  # the writer is right
    raw = _mnist_layout(tmp_path / "magic", images_kw={"magic": b"\x1f\x8b\x08\x03"})
    with pytest.raises(ValueError, match="wrong magic number") as info:
        MNIST(tmp_path / "magic", train=False, download=False)
    assert str(raw / "t10k-images-idx3-ubyte") in str(info.value)
    raw = _mnist_layout(tmp_path / "short", labels_kw={"cut": 3})
    with pytest.raises(ValueError, match="truncated") as info:
        MNIST(tmp_path / "short", train=False, download=False)
    assert str(raw / "t10k-labels-idx1-ubyte") in str(info.value)
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        MNIST(tmp_path / "absent", train=False, download=False)


# ----------------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("backend", backend_params(auto=True))
def test_bad_sizes_are_refused_at_construction(backend):
    src = indexed_source(100)
    for bs in (0, -4):
        with pytest.raises(ValueError, match=rf"batch_size must be an integer >= 1, got {bs}"):
            make_loader(src, backend, batch_size=bs, device="cpu")
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0"):
        make_loader(src, backend, batch_size=10, device="cpu", num_workers=-1)
    with pytest.raises(ValueError, match="fewer than one batch of 128") as info:
        make_loader(src, backend, batch_size=128, device="cpu", drop_last=True, num_workers=0)
    assert "drop_last=False" in str(info.value)  # says what to do
    # without drop_last, a dataset smaller than a batch is one (partial) batch
    loader = make_loader(src, backend, batch_size=128, device="cpu", drop_last=False, num_workers=0)
    sizes = [len(y) for _, y in loader]
    assert sizes == [100] and len(loader) == 1


# ----------------------------------------------------------------------- a cache that does not fit
def test_a_memory_cache_that_does_not_fit_is_refused_before_allocating(monkeypatch, small_photos):
    import fastdata.backends.memory as memory

    free = 1_000_000
    monkeypatch.setattr(memory.budgeting, "free_bytes", lambda device: free)

    def no_decoding(self):
        raise AssertionError("the cache was being built before the size check")

    monkeypatch.setattr(memory.MemoryLoader, "_decode_files", no_decoding)
    src = ImageFolder(small_photos)
    need = len(src) * 256 * 256 * 3
    with pytest.raises(CacheDoesNotFit) as info:
        make_loader(src, "memory", batch_size=2, device="cpu", num_workers=0)
    msg = str(info.value)
    assert str(need) in msg and str(free) in msg, msg  # both sizes
    assert isinstance(info.value, MemoryError)
    # auto does not pick a backend that would be refused (it asks memory.free_bytes, patched above)
    auto = make_loader(src, "auto", batch_size=2, device="cpu", num_workers=0)
    assert auto.name != "memory"
