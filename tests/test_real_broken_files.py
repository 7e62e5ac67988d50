"""Real broken and odd files, as a photo folder meets them: every backend refuses the same files, names
each one, skips and counts them under on_error="skip", decodes the odd-but-valid ones alike, and never
hangs. (Truncated, empty, random-byte and PNG-named-.jpg files, CMYK, 16-bit, alpha, palette and
EXIF-6 photos and bombs are test_reliability_input's; this file holds what it does not.)"""
from __future__ import annotations

import io
import os
import re
import struct
import threading
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import fastdata
from conftest import png_claiming
from fastdata import Augmentation, DecodeError, make_loader
from fastdata.datasets import ImageFolder, Shards
from fastdata.datasets.folders import read_file

EVAL = Augmentation(crop="center", size=32, resize=32)
PLAIN = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))   # images come out as pixel / 255
#: (backend, its options): the dali backend with both of its CPU decoders.
BACKENDS = [("torch", {"num_workers": 2}), ("prefetch", {"num_workers": 0}), ("memory", {}),
            ("dali", {"decode": "host"}), ("dali", {"decode": "dali"})]
IDS = ["torch", "prefetch", "memory", "dali-host", "dali-dali"]
#: Pillow warns about the corrupt EXIF blocks below wherever it reads them (in a cache-building thread too).
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")


def _loader(root_or_source, backend, opts, **kw):
    if backend == "dali":
        pytest.importorskip("nvidia.dali.plugin.pytorch")
    source = root_or_source if isinstance(root_or_source, (ImageFolder, Shards)) else ImageFolder(root_or_source)
    kw = {"batch_size": 4, "train": False, "device": "cpu", "augment": EVAL, **PLAIN, **opts, **kw}
    return make_loader(source, backend, **kw)


def _epoch(loader) -> tuple[torch.Tensor, int]:
    """(all images of one epoch, in order; loader.skipped), warnings of skipped files silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        images = [x for x, _ in loader]
    return torch.cat(images), loader.skipped


def _refusal(root_or_source, backend, opts) -> DecodeError:
    """The DecodeError that building a loader (memory decodes then) and reading an epoch raises. Its
    traceback is dropped: the frames in it hold the failed epoch, whose workers would end only at a later
    garbage collection, 5 s each, in another test."""
    try:
        _epoch(_loader(root_or_source, backend, opts))
    except DecodeError as e:
        e.__traceback__ = None
        return e
    raise AssertionError(f"{backend} {opts} refused no file")


def _scene(h=48, w=64) -> np.ndarray:
    """An asymmetric picture (a rotation or a flip changes it)."""
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([xx * 255 // w, yy * 255 // h, 255 - (xx + yy) * 255 // (w + h)], -1).astype(np.uint8)
    img[4:16, 4:20] = (250, 40, 40)
    return img


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95, **kw)
    return buf.getvalue()


# ----------------------------------------------------------------- refused alike, decoded alike
@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    """Good photos and what a real folder holds besides: a JPEG named .png, a progressive JPEG, a
    palette PNG with a transparent entry, a 1-bit BMP, an EXIF-8 photo, a link to a good photo, a
    dangling link and a text file named .jpg."""
    root = tmp_path_factory.mktemp("photos")
    good, odd = root / "a_good", root / "b_odd"
    good.mkdir()
    odd.mkdir()
    scene = Image.fromarray(_scene())
    for i in range(3):
        Image.fromarray(np.roll(_scene(), 9 * i, 1)).save(good / f"g{i}.jpg", quality=92)
    (odd / "jpeg_named.png").write_bytes(_jpeg(scene))
    scene.save(odd / "progressive.jpg", "JPEG", quality=95, progressive=True)
    palette = scene.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.save(odd / "palette_transparent.png", transparency=0)
    scene.convert("1").save(odd / "onebit.bmp")
    exif = Image.Exif()
    exif[0x0112] = 8
    (odd / "rotated8.jpg").write_bytes(_jpeg(scene.transpose(Image.Transpose.ROTATE_270), exif=exif.tobytes()))
    os.symlink(good / "g1.jpg", odd / "link.jpg")
    os.symlink(root / "nowhere.jpg", odd / "dangling.jpg")
    (odd / "text.jpg").write_text("not a photo\n" * 10)
    return root


BAD = ["dangling.jpg", "jpeg_named.png", "text.jpg"]   # in the folder's order


@pytest.fixture(scope="module")
def torch_reference(photo_folder):
    loader = _loader(photo_folder, "torch", {"num_workers": 0}, on_error="skip")
    return _epoch(loader)


@pytest.mark.parametrize("backend, opts", BACKENDS, ids=IDS)
def test_every_backend_refuses_the_same_files_and_decodes_the_odd_ones_alike(backend, opts, photo_folder,
                                                                              torch_reference):
    err = _refusal(photo_folder, backend, opts)
    assert os.path.basename(err.path) == BAD[0] and "not found" in err.reason
    loader = _loader(photo_folder, backend, opts, on_error="skip")
    ref, _ = torch_reference
    for _ in range(2):
        images, skipped = _epoch(loader)
        assert skipped == len(BAD) and len(images) == len(loader.dataset) - len(BAD) == len(ref)
        diff = (images - ref).abs() * 255
        # DALI's own decode and resize round differently (test_dali's tolerance); the others are exact
        assert diff.mean() < 0.5 and diff.max() <= 8, (backend, opts, float(diff.mean()), float(diff.max()))
    # and the odd ones are right, not only alike: each is the scene (or, for the link, photo g1)
    names = [os.path.basename(p) for p in loader.dataset.paths if os.path.basename(p) not in BAD]
    scene = np.asarray(Image.fromarray(_scene()).resize((43, 32), Image.Resampling.BILINEAR).crop((5, 0, 37, 32)))
    for name, got in zip(names, ref.permute(0, 2, 3, 1).numpy() * 255, strict=True):
        if name in ("progressive.jpg", "palette_transparent.png", "rotated8.jpg"):
            assert np.abs(got - scene).mean() < 15, name
    assert torch.equal(ref[names.index("link.jpg")], ref[names.index("g1.jpg")])


def test_a_file_deleted_after_the_source_was_made_is_named_by_every_backend(tmp_path, photo_folder):
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    for i in range(3):
        (root / "a" / f"g{i}.jpg").write_bytes((photo_folder / "a_good" / f"g{i}.jpg").read_bytes())
    source = ImageFolder(root)
    (root / "a" / "g1.jpg").unlink()
    for backend, opts in BACKENDS:
        err = _refusal(source, backend, opts)
        assert err.path == str(root / "a" / "g1.jpg") and err.reason == "file not found", backend
        images, skipped = _epoch(_loader(source, backend, opts, on_error="skip"))
        assert (len(images), skipped) == (2, 1), backend


@pytest.mark.parametrize("backend, opts", BACKENDS, ids=IDS)
def test_a_resume_past_skipped_files_reads_the_rest_of_the_epoch_exactly(backend, opts, photo_folder):
    def loader():
        return _loader(photo_folder, backend, opts, on_error="skip", train=True, seed=3, drop_last=False)

    whole, _ = _epoch(loader())
    interrupted = loader()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        batches = iter(interrupted)
        first = next(batches)[0]   # of 3 batches (memory, which left the 3 files out: of 2)
        state = interrupted.state_dict()
        del batches
    resumed = loader()
    resumed.load_state_dict(state)
    rest, _ = _epoch(resumed)
    assert torch.equal(torch.cat([first, rest]), whole), "a sample lost or read twice across the resume"


# ------------------------------------------------------------------------ files that are not files
def test_a_link_that_loops_is_a_file_every_backend_names_not_a_folder_that_cannot_be_opened(tmp_path,
                                                                                              photo_folder):
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    (root / "a" / "g0.jpg").write_bytes((photo_folder / "a_good" / "g0.jpg").read_bytes())
    loop = root / "a" / "loop.jpg"
    os.symlink(loop, loop)
    source = ImageFolder(root)   # was: OSError "Too many levels of symbolic links" for the whole folder
    assert source.paths == [str(root / "a" / "g0.jpg"), str(loop)]
    for backend, opts in BACKENDS[::2]:
        err = _refusal(source, backend, opts)
        assert err.path == str(loop) and "symbolic links" in err.reason
        images, skipped = _epoch(_loader(source, backend, opts, on_error="skip"))
        assert (len(images), skipped) == (1, 1)


def test_file_names_that_are_not_utf8_checkpoint_and_pack(tmp_path, photo_folder):
    """A Latin-1 name (an old camera's, a Windows archive's) is a str with surrogates in Python: the
    loaders read it, but the folder's fingerprint encoded it as UTF-8, so state_dict (every checkpoint)
    and pack failed with UnicodeEncodeError."""
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    for i, name in enumerate([b"caf\xe9.jpg", b"g.jpg", b"na\xefve.jpg"]):
        with open(os.path.join(os.fsencode(root / "a"), name), "wb") as f:
            f.write((photo_folder / "a_good" / f"g{i}.jpg").read_bytes())
    source = ImageFolder(root)

    def loader():
        return _loader(source, "torch", {"num_workers": 0}, train=True, seed=1, drop_last=False, batch_size=2)

    whole, _ = _epoch(loader())
    interrupted = loader()
    batches = iter(interrupted)
    first = next(batches)[0]
    state = interrupted.state_dict()
    del batches
    resumed = loader()
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([first, _epoch(resumed)[0]]), whole)
    fastdata.pack(source, tmp_path / "packed", progress=False, workers=0)
    images, skipped = _epoch(_loader(Shards(tmp_path / "packed"), "torch", {"num_workers": 0}))
    assert (len(images), skipped) == (3, 0)


def _within(seconds: float, fn):
    """fn()'s result or exception, or AssertionError when it does not return in time (a daemon thread:
    a hang fails the test instead of the session)."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as e:   # noqa: BLE001 (handed to the test)
            out.append(("err", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still running after {seconds} s: a hang"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value


def test_a_named_pipe_or_a_device_named_jpg_is_refused_at_once_not_read_forever(tmp_path, photo_folder):
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    (root / "a" / "g0.jpg").write_bytes((photo_folder / "a_good" / "g0.jpg").read_bytes())
    pipe, device = root / "a" / "pipe.jpg", root / "a" / "zeros.jpg"
    os.mkfifo(pipe)                 # open() waited for a writer forever
    os.symlink("/dev/zero", device)  # read() never ended
    for path, kind in ((pipe, "named pipe"), (device, "character device")):
        with pytest.raises(DecodeError, match=f"not a regular file \\(a {kind}") as info:
            _within(10, lambda p=path: read_file(p))
        assert info.value.path == str(path)
    loader = _loader(root, "torch", {"num_workers": 0}, on_error="skip")
    images, skipped = _within(30, lambda: _epoch(loader))
    assert (len(images), skipped) == (1, 2)


def test_a_file_pillow_cannot_identify_is_named_with_what_it_starts_with(tmp_path):
    (tmp_path / "a").mkdir()
    text = tmp_path / "a" / "notes.jpg"
    text.write_text("shopping list\n")
    err = _refusal(tmp_path, "torch", {"num_workers": 0})
    assert err.path == str(text)
    # not Pillow's "cannot identify image file <_io.BytesIO object at 0x7f...>"
    assert "object at 0x" not in str(err) and "b'shopping list\\n'" in err.reason


# ------------------------------------------------------------------------------ corrupt EXIF blocks
def _with_exif(jpeg: bytes, tiff: bytes) -> bytes:
    segment = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + (len(segment) + 2).to_bytes(2, "big") + segment + jpeg[2:]


def _ifd(entries, count=None, offset=8) -> bytes:
    """A big-endian TIFF block with one IFD of ``entries`` (tag, type, count, 4 value bytes)."""
    body = struct.pack(">H", len(entries) if count is None else count)
    for tag, kind, num, value in entries:
        body += struct.pack(">HHI", tag, kind, num) + value
    return b"MM\x00\x2a" + struct.pack(">I", offset) + body + struct.pack(">I", 0)


_SIX = (0x0112, 3, 1, struct.pack(">HH", 6, 0))
#: EXIF blocks found broken in the wild, each around an orientation of 6.
CORRUPT_EXIF = {
    # an entry before the orientation whose values lie past the block: Pillow stops there (no turn)
    "values_past_the_end": _ifd([(0x010F, 2, 0xFFFFFFF, struct.pack(">I", 0xFFFFFF00)), _SIX]),
    "ifd_count_too_big": _ifd([_SIX], count=200),               # Pillow keeps what it read: turned
    "orientation_as_long": _ifd([(0x0112, 4, 1, struct.pack(">I", 6))]),   # Pillow takes it: turned
    "ifd_past_the_end": _ifd([_SIX], offset=5000),              # nothing read: as stored
    "unknown_byte_order": b"XX" + _ifd([_SIX])[2:],             # not TIFF for Pillow: as stored
}


@pytest.fixture(scope="module")
def exif_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("exif")
    (root / "x").mkdir()
    stored = _jpeg(Image.fromarray(_scene()).transpose(Image.Transpose.ROTATE_90))
    for name, tiff in CORRUPT_EXIF.items():
        (root / "x" / f"{name}.jpg").write_bytes(_with_exif(stored, tiff))
    return root


def _as_pillow_shows(path) -> np.ndarray:
    """Pillow's reading, EXIF applied, center-cropped like EVAL (resize 32, crop 32)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Pillow's "Corrupt EXIF data" warnings
        img = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    w, h = img.size
    s = 32 / min(w, h)
    img = img.resize((round(w * s), round(h * s)), Image.Resampling.BILINEAR)
    left, top = (img.width - 32) // 2, (img.height - 32) // 2
    return np.asarray(img.crop((left, top, left + 32, top + 32))).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CORRUPT_EXIF))
def test_the_header_walk_reads_a_corrupt_exif_block_as_pillow_or_leaves_it_to_pillow(name):
    from fastdata.images.region import jpeg_orientation

    data = _with_exif(_jpeg(Image.fromarray(_scene())), CORRUPT_EXIF[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pillow = Image.open(io.BytesIO(data)).getexif().get(0x0112, 1)
    assert jpeg_orientation(data) in (None, pillow)


def _check_turned_as_pillow(exif_folder, backend, opts):
    loader = _loader(exif_folder, backend, opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        images, _ = _epoch(loader)
    for path, got in zip(loader.dataset.paths, images.permute(0, 2, 3, 1).numpy() * 255, strict=True):
        diff = np.abs(got - _as_pillow_shows(path)).mean()
        assert diff < 6, f"{backend} {opts}: {os.path.basename(path)} is {diff:.0f} levels from Pillow's reading"


@pytest.mark.parametrize("backend, opts", BACKENDS[:4], ids=IDS[:4])
def test_a_corrupt_exif_block_turns_a_photo_as_pillow_does(backend, opts, exif_folder):
    """The region decoder's header walk read an orientation Pillow never reaches (after an entry whose
    values lie past the block): the box was drawn for the turned photo and cut from the unturned one,
    a squashed crop, while the dali backend's host decode (Pillow's reading) kept it as stored."""
    _check_turned_as_pillow(exif_folder, backend, opts)


#: The corrupt blocks DALI's decoder turns to another height and width than Pillow's reading does.
DALI_TURNS_OTHERWISE = ["ifd_count_too_big", "orientation_as_long", "unknown_byte_order"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("packed", [False, True], ids=["file names", "shard bytes"])
def test_a_corrupt_exif_block_turns_a_photo_as_pillow_does_in_dalis_own_decoder(exif_folder, tmp_path, packed,
                                                                                 device):
    """decode='dali': DALI's decoder applies the EXIF orientation as it reads the block, and the crop
    windows are drawn in Pillow's reading. On a malformed block the two disagreed on the photo's height
    and width: the batch failed ('the cropping window ... is not valid'), and the file was refused by
    name, where every other backend decodes it as Pillow turns it. DALI is now given such a file with
    its block rewritten to Pillow's orientation (decode.dali_input), from a copy for plain files (DALI
    reads them by name), in the bytes fed for shards; a second epoch reads the same; close() removes
    the copies. On a GPU nvJPEG reads the rewritten block."""
    source = exif_folder
    if packed:
        fastdata.pack(ImageFolder(exif_folder), tmp_path / "packed", progress=False, workers=0)
        source = Shards(tmp_path / "packed")
    loader = _loader(source, "dali", {"decode": "dali"}, device=device)
    photos = ImageFolder(exif_folder).paths   # pack keeps the folder's order
    for _ in range(2):
        images, skipped = _epoch(loader)
        assert skipped == 0
        for path, got in zip(photos, images.permute(0, 2, 3, 1).cpu().numpy() * 255, strict=True):
            assert np.abs(got - _as_pillow_shows(path)).mean() < 6, os.path.basename(path)
    copies = loader._rewrite_dir
    assert (copies is not None) != packed    # copies for plain files only
    loader.close()
    assert copies is None or not os.path.exists(copies)


def test_dalis_own_decoder_refuses_by_name_a_photo_it_still_turns_otherwise_than_pillow(exif_folder, monkeypatch):
    """The safety net behind the rewrite: a file DALI still turns to another height and width than
    Pillow's reading (here: the rewrite switched off) failed the whole batch with a RuntimeError that
    on_error='skip' could not skip, the probe finding no culprit, each file decoding alone. The probe
    compares each file's size as DALI turns it with Pillow's: such a file is refused by name and
    skipped and counted, and the others are read as Pillow turns them."""
    import fastdata.decode.dali_input as dali_input

    monkeypatch.setattr(dali_input, "dali_bytes", lambda data, orientation: None)
    first = DALI_TURNS_OTHERWISE[0]
    with pytest.raises(DecodeError, match=f"{first}.jpg.*turns it to 64x48.*orientation 6.*malformed EXIF"):
        _epoch(_loader(exif_folder, "dali", {"decode": "dali"}, on_error="raise"))
    loader = _loader(exif_folder, "dali", {"decode": "dali"}, on_error="skip")
    for _ in range(2):
        images, skipped = _epoch(loader)
        assert skipped == len(DALI_TURNS_OTHERWISE) and len(images) == len(CORRUPT_EXIF) - skipped
    kept = [q for q in loader.dataset.paths if os.path.basename(q)[:-4] not in DALI_TURNS_OTHERWISE]
    for path, got in zip(kept, images.permute(0, 2, 3, 1).numpy() * 255, strict=True):
        assert np.abs(got - _as_pillow_shows(path)).mean() < 6, path


@pytest.mark.parametrize("name", sorted(CORRUPT_EXIF))
def test_the_memory_caches_nvimagecodec_build_turns_a_corrupt_exif_photo_as_pillow(tmp_path, name):
    """The memory backend's nvImageCodec build (cache_build='nvimgcodec'; on a GPU, the default) let the
    decoder apply the EXIF orientation as it reads the block, which on a malformed block is not
    Pillow's reading: that photo was cached turned otherwise than every other build and backend caches
    it. The decoder now decodes as stored and the photo is turned by fastdata's reading (Pillow's; a
    block the header walk cannot vouch for goes to PIL)."""
    from fastdata.backends.memory import NvWholeDecoder, WholePhotos, nvimgcodec

    if nvimgcodec() is None:
        pytest.skip("nvImageCodec is not installed")
    (tmp_path / "c").mkdir()
    stored = _jpeg(Image.fromarray(_scene()).transpose(Image.Transpose.ROTATE_90))
    (tmp_path / "c" / "p.jpg").write_bytes(_with_exif(stored, CORRUPT_EXIF[name]))
    photos = WholePhotos(ImageFolder(tmp_path), 40)
    nv = NvWholeDecoder(photos, torch.device("cpu"))
    got, ref = (torch.zeros((1, 40, 40, 3), dtype=torch.uint8) for _ in range(2))
    s_got, s_ref = np.zeros((1, 4), np.int64), np.zeros((1, 4), np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Pillow's "Corrupt EXIF data"
        assert nv.decode_rows([0], got, s_got).all() and photos.decode_rows([0], ref, s_ref).all()
    np.testing.assert_array_equal(s_got, s_ref)
    assert torch.equal(got, ref)


# -------------------------------------------------------------------------------------------- pack
def test_pack_refuses_an_empty_or_unreadable_file_before_writing_anything(tmp_path, photo_folder):
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    for i in range(3):
        (root / "a" / f"g{i}.jpg").write_bytes((photo_folder / "a_good" / f"g{i}.jpg").read_bytes())
    (root / "a" / "text.jpg").write_text("not a photo\n")
    empty = root / "a" / "empty.jpg"
    empty.write_bytes(b"")
    out = tmp_path / "packed"
    # Was: packed, then Shards(out) refused the whole index ("an image member is not empty").
    with pytest.raises(ValueError, match="empty file") as info:
        fastdata.pack(ImageFolder(root), out, progress=False, workers=0)
    assert str(empty) in str(info.value) and not list(out.glob("*.tar"))
    empty.unlink()
    os.symlink(root / "gone.jpg", root / "a" / "dangling.jpg")
    # Was: a DecodeError whose hint, on_error='skip', is an option pack does not have.
    with pytest.raises(ValueError, match="dangling.jpg' \\(file not found\\)") as info:
        fastdata.pack(ImageFolder(root), out, progress=False, workers=0)
    assert "on_error" not in str(info.value)
    (root / "a" / "dangling.jpg").unlink()
    # The file that is no image is refused by name too (pack opens each header before copying it: a
    # link in a downloaded folder to a private file named x.jpg was packed), nothing written.
    with pytest.raises(ValueError, match="text.jpg' is not an image the loaders read"):
        fastdata.pack(ImageFolder(root), out, progress=False, workers=0)
    assert not list(out.glob("*.tar"))
    (root / "a" / "text.jpg").unlink()
    # What is left packs, and reads back as the folder does.
    fastdata.pack(ImageFolder(root), out, progress=False, workers=0)
    for backend, opts in BACKENDS[::2]:
        loader = _loader(Shards(out), backend, opts, on_error="skip")
        for _ in range(2):
            images, skipped = _epoch(loader)
            assert (len(images), skipped) == (3, 0)


@pytest.mark.parametrize("bad", ["bomb.png", "text.jpg"])
def test_pack_with_max_side_names_a_file_it_cannot_re_encode(tmp_path, photo_folder, bad):
    root = tmp_path / "photos"
    (root / "a").mkdir(parents=True)
    (root / "a" / "g0.jpg").write_bytes((photo_folder / "a_good" / "g0.jpg").read_bytes())
    (root / "a" / bad).write_bytes(png_claiming(100_000, 100_000) if bad == "bomb.png" else b"not a photo\n")
    # Was: Pillow's DecompressionBombError naming no file; Pillow's "<_io.BytesIO object at 0x7f...>". Both
    # are now refused by pack's header check, before any re-encoding.
    said = "is not an image the loaders read"
    with pytest.raises(ValueError, match=f"'{re.escape(str(root / 'a' / bad))}'.*") as info:
        fastdata.pack(ImageFolder(root), tmp_path / "packed", max_side=16, progress=False, workers=0)
    assert said in str(info.value) and "object at 0x" not in str(info.value)
