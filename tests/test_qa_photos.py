"""Photo folders as real data sets hold them, read by every backend that reads files: the files listed
(torchvision's ImageFolder's list, less dot names), the odd-but-valid ones decoded alike by every backend
and as Pillow reads them, in the training and the evaluation recipe, and the files each refuses.
(Broken files, CMYK/grey/palette/alpha/16-bit-grey JPEG and PNG, EXIF 6 and 8, XMP, MPO, bombs and
links that loop are test_reliability_input's and test_real_broken_files'; this file holds the rest.)"""
from __future__ import annotations

import io
import os
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps, PngImagePlugin

from fastdata import Augmentation, DecodeError, make_loader
from fastdata.backends.memory import nvimgcodec
from fastdata.datasets import ImageFolder

EVAL = Augmentation(crop="center", size=32, resize=32)
TRAIN = Augmentation(crop="random_resized", size=32, hflip=0.5)
PLAIN = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))   # images come out as pixel / 255
_NV = pytest.mark.skipif(nvimgcodec() is None, reason="nvImageCodec is not installed")
#: (backend, its options) for every way a file is decoded on the CPU.
BACKENDS = [
    pytest.param("torch", {"num_workers": 0}, id="torch"),
    pytest.param("prefetch", {"num_workers": 0}, id="prefetch"),
    pytest.param("memory", {"cache_build": "threads"}, id="memory-threads"),
    pytest.param("memory", {"cache_build": "processes", "cache_workers": 1}, id="memory-processes"),
    pytest.param("memory", {"cache_build": "nvimgcodec"}, id="memory-nvimgcodec", marks=_NV),
    pytest.param("dali", {}, id="dali-host"),
    pytest.param("dali", {"decode": "dali"}, id="dali-dali"),
    pytest.param("auto", {"quiet": True}, id="auto"),
]
#: Pillow's exif_transpose of each EXIF orientation, applied to the scene to store it: each method is its
#: own inverse but the quarter turns, which swap.
_STORE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
          5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
          8: Image.Transpose.ROTATE_270}


def _scene(h=48, w=64) -> np.ndarray:
    """An asymmetric picture (a turn or a mirror changes it): gradients plus a red block top left."""
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack([xx * 255 // w, yy * 255 // h, 255 - (xx + yy) * 255 // (w + h)], -1).astype(np.uint8)
    img[h // 12:h // 3, w // 16:w // 3] = (250, 40, 40)
    return img


def _png16(arr: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG written by hand (Pillow writes none in colour): 2 grey+alpha, 2 RGB, 6 RGBA."""
    h, w = arr.shape[:2]
    raw = b"".join(b"\0" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _ycck(pil: Image.Image) -> bytes:
    """A YCCK JPEG (Adobe transform 2, as Photoshop saves CMYK) that decodes to ``pil.convert("CMYK")``.
    libjpeg turns YCC into RGB and stores C = 255 - R; Pillow reads Adobe CMYK inverted, so C = R: the
    planes written are the YCC of (C, M, Y), inverted since Pillow inverts what it writes, K as it is."""
    cmyk = np.asarray(pil.convert("CMYK")).astype(np.float64)
    c, m, y = cmyk[..., 0], cmyk[..., 1], cmyk[..., 2]
    ycc = np.stack([0.299 * c + 0.587 * m + 0.114 * y,
                    -0.168736 * c - 0.331264 * m + 0.5 * y + 128,
                    0.5 * c - 0.418688 * m - 0.081312 * y + 128], -1)
    planes = np.concatenate([255 - ycc.round().clip(0, 255), cmyk[..., 3:]], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(planes, "CMYK").save(buf, "JPEG", quality=98)
    data = bytearray(buf.getvalue())
    at = data.find(b"Adobe") + 11   # APP14: "Adobe", version, flags0, flags1, transform
    assert data[at] == 0
    data[at] = 2
    return bytes(data)


def _top_down_bmp(pil: Image.Image) -> bytes:
    """A BMP whose rows run top to bottom (a negative height), as some scanners and Windows tools write."""
    buf = io.BytesIO()
    pil.save(buf, "BMP")
    data = bytearray(buf.getvalue())
    (offset,), (w, h) = struct.unpack_from("<I", data, 10), struct.unpack_from("<ii", data, 18)
    row = (w * 3 + 3) & ~3
    rows = [data[offset + i * row: offset + (i + 1) * row] for i in range(h)]
    data[offset: offset + row * h] = b"".join(rows[::-1])
    struct.pack_into("<i", data, 22, -h)
    return bytes(data)


def _jpeg(pil: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    pil.save(buf, "JPEG", quality=95, **kw)
    return buf.getvalue()


def _write_valid(root) -> None:
    """Odd but valid photos, one scene each, in four classes."""
    scene = Image.fromarray(_scene())
    dirs = {name: root / name for name in ("jpeg", "png", "other", "sizes", "exif")}
    for d in dirs.values():
        d.mkdir(parents=True)
    jpeg, png, other, sizes, exif = dirs.values()
    (jpeg / "ycck.jpg").write_bytes(_ycck(scene))
    for sub in ("4:4:4", "4:2:2", "4:1:1"):
        (jpeg / f"sub{sub.replace(':', '')}.JPG").write_bytes(_jpeg(scene, subsampling=sub))
    (jpeg / "restart_markers.jpeg").write_bytes(_jpeg(scene, restart_marker_blocks=2))
    (jpeg / "grey_progressive.JPEG").write_bytes(_jpeg(scene.convert("L"), progressive=True))
    grey = np.asarray(scene.convert("L")).astype(np.uint16) * 257
    scene.convert("LA").save(png / "la.png")
    scene.convert("1", dither=Image.Dither.NONE).save(png / "onebit.Png")
    (png / "rgb48.png").write_bytes(_png16(_scene().astype(np.uint16) * 257, 2))
    alpha = np.full(grey.shape + (1,), 40000, np.uint16)
    (png / "rgba64.png").write_bytes(_png16(np.concatenate([_scene().astype(np.uint16) * 257, alpha], -1), 6))
    (png / "la16.png").write_bytes(_png16(np.stack([grey, alpha[..., 0]], -1), 4))
    scene.save(png / "animated.png", save_all=True, append_images=[scene.transpose(Image.Transpose.ROTATE_180)])
    scene.save(other / "pages.tif", save_all=True, append_images=[scene.transpose(Image.Transpose.ROTATE_180)])
    scene.convert("CMYK").save(other / "cmyk.tiff")
    (other / "top_down.BMP").write_bytes(_top_down_bmp(scene))
    Image.new("RGB", (1, 1), (200, 30, 30)).save(sizes / "one.jpg", quality=95)
    Image.new("RGB", (1, 1), (30, 200, 30)).save(sizes / "one.png")
    Image.fromarray(_scene(3, 2)).save(sizes / "two_by_three.png")
    Image.fromarray(_scene(8, 4000)).save(sizes / "wide.jpg", quality=90)
    Image.fromarray(_scene(4000, 8)).save(sizes / "tall.png")
    Image.fromarray(_scene(4000, 6000)).save(sizes / "large.jpg", quality=80)
    for orientation in range(1, 9):
        block = Image.Exif()
        block[0x0112] = orientation
        stored = scene.transpose(_STORE[orientation]) if orientation in _STORE else scene
        (exif / f"o{orientation}.jpg").write_bytes(_jpeg(stored, exif=block.tobytes()))
        stored.save(exif / f"o{orientation}.png", exif=block.tobytes())
        if orientation in (3, 5, 6, 8):   # TIFF's own Orientation tag (Pillow turns a TIFF as it loads it)
            stored.save(exif / f"o{orientation}.tif", tiffinfo={0x0112: orientation})


@pytest.fixture(scope="module")
def valid_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("valid")
    _write_valid(root)
    return root


def _pillow_reading(path) -> np.ndarray:
    """Pillow's own reading of a file: EXIF applied, RGB (16-bit scaled), resize 32 + center crop 32."""
    img = ImageOps.exif_transpose(Image.open(path))
    if img.mode.startswith("I"):
        img = Image.fromarray((np.asarray(img).astype(np.float64) / 257).round().astype(np.uint8))
    img = img.convert("RGB")
    w, h = img.size
    s = 32 / min(w, h)
    img = img.resize((max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BILINEAR)
    left, top = (img.width - 32) // 2, (img.height - 32) // 2
    return np.asarray(img.crop((left, top, left + 32, top + 32))).astype(np.float32)


def _epoch(source, backend, opts, augment, **kw) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(images, labels, loader) of one epoch in the source's order, warnings of skipped files silenced."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali.plugin.pytorch")
    kw = {"batch_size": 16, "train": augment is TRAIN, "shuffle": False, "drop_last": False, "device": "cpu",
          "augment": augment, "seed": 5, **PLAIN, **opts, **kw}
    loader = make_loader(source, backend, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        batches = list(loader)
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]), loader


@pytest.fixture(scope="module")
def torch_readings(valid_folder):
    """The torch backend's epoch of the valid folder in each recipe: the reference the others meet."""
    source = ImageFolder(valid_folder)
    return {aug.crop: _epoch(source, "torch", {"num_workers": 0}, aug)[:2] for aug in (EVAL, TRAIN)}


def test_the_torch_backend_reads_each_odd_photo_as_pillow_does(valid_folder, torch_readings):
    images, _ = torch_readings["center"]
    got = images.permute(0, 2, 3, 1).numpy() * 255
    upright = _pillow_reading(valid_folder / "exif" / "o1.png")
    for path, pixels in zip(ImageFolder(valid_folder).paths, got, strict=True):
        name = os.path.relpath(path, valid_folder)
        diff = np.abs(pixels - _pillow_reading(path)).mean()
        assert diff < 4, f"{name} differs from Pillow's reading by {diff:.1f} grey levels"
        if name.startswith("exif"):   # every orientation comes out the scene's way up, not mirrored
            assert np.abs(pixels - upright).mean() < 3, name


@pytest.mark.parametrize("recipe", [EVAL, TRAIN], ids=["eval", "train"])
@pytest.mark.parametrize("backend, opts", BACKENDS)
def test_every_backend_decodes_the_odd_photos_as_the_torch_backend(valid_folder, torch_readings, backend, opts,
                                                                   recipe):
    source = ImageFolder(valid_folder)
    images, labels, loader = _epoch(source, backend, opts, recipe)
    ref, ref_labels = torch_readings[recipe.crop]
    assert images.dtype == torch.float32 and labels.dtype == torch.int64
    assert images.shape == ref.shape == (len(source), 3, 32, 32) and loader.skipped == 0
    assert torch.equal(labels, ref_labels) and labels.tolist() == source.labels.tolist()
    diff = ((images - ref).abs() * 255).mean((1, 2, 3))
    for path, d in zip(source.paths, diff.tolist(), strict=True):
        name = os.path.relpath(path, valid_folder)
        w, h = Image.open(path).size
        if loader.name == "memory" and recipe is TRAIN and max(w, h) / min(w, h) > 8:
            # The training cache keeps the longer side at cache_size (256): a 4000 x 8 strip is cached
            # 256 x 1, and a crop of it loses the rows (documented: resolution for memory).
            continue
        # DALI's own decoder and resize, and the memory cache's resample, round otherwise: a few levels.
        assert d < (3.0 if opts.get("decode") == "dali" or loader.name == "memory" else 0.5), (name, d)


# ------------------------------------------------------------------------ what the folder lists
def _write_messy(root) -> None:
    """What real folders hold besides photos: upper-case endings, a file without one, macOS's and
    Windows' own files, notes, sub-sub-folders, spaces and non-ASCII in class names, links to a file and
    to a class folder, a dot folder, a photo beside the classes."""
    jpeg = _jpeg(Image.fromarray(_scene()))
    files = {"cats/a.JPG": jpeg, "cats/b.jpeg": jpeg, "cats/C.Png": None, "cats/no_ending": jpeg,
             "cats/.DS_Store": b"\0\0\0\1Bud1", "cats/._a.JPG": b"\0\5\26\7\0\2\0\0Mac OS X        ",
             "cats/Thumbs.db": b"\xd0\xcf\x11\xe0", "cats/README.txt": b"notes", "cats/meta.json": b"{}",
             "cats/2019/summer/z.jpg": jpeg, "cats/2019/a b.jpg": jpeg, "cats/.thumbs/t.jpg": jpeg,
             "dogs and wolves/ü.jpg": jpeg, "dogs and wolves/x.tif": None, "Ärger/p.BMP": None,
             ".ipynb_checkpoints/cp.jpg": jpeg, "stray.jpg": jpeg}
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            Image.fromarray(_scene()).save(path, {".png": "PNG", ".tif": "TIFF", ".bmp": "BMP"}[path.suffix.lower()])
        else:
            path.write_bytes(data)
    os.symlink(root / "cats" / "b.jpeg", root / "Ärger" / "link.jpg")
    os.symlink(root / "dogs and wolves", root / "linked class")


def test_the_folder_lists_torchvisions_files_and_classes_less_dot_names(tmp_path):
    datasets = pytest.importorskip("torchvision.datasets")
    _write_messy(tmp_path)
    ours = ImageFolder(tmp_path)
    theirs = datasets.ImageFolder(tmp_path)
    # torchvision counts dot folders as classes and dot files as images; fastdata skips both (docs/sources.md)
    classes = [c for c in theirs.classes if not c.startswith(".")]
    assert ours.classes == classes == ["cats", "dogs and wolves", "linked class", "Ärger"]
    dotted = lambda p: any(part.startswith(".") for part in os.path.relpath(p, tmp_path).split(os.sep))  # noqa: E731
    samples = [(p, classes.index(theirs.classes[y])) for p, y in theirs.samples if not dotted(p)]
    assert list(zip(ours.paths, ours.labels.tolist(), strict=True)) == samples
    assert [os.path.relpath(p, tmp_path) for p in ours.paths[:5]] == \
        ["cats/C.Png", "cats/a.JPG", "cats/b.jpeg", "cats/2019/a b.jpg", "cats/2019/summer/z.jpg"]
    images, labels, _ = _epoch(ours, "torch", {"num_workers": 0}, EVAL)
    assert images.shape == (len(samples), 3, 32, 32) and labels.tolist() == [y for _, y in samples]



def test_a_folder_linked_from_two_classes_is_in_both_as_torchvision_lists_it(tmp_path):
    # Folders were read once for the whole tree: a folder linked from two classes (a label view built
    # with links) went to the class that sorts first, and a class folder that is a link to another
    # class's own sub-folder took that sub-folder out of it; silently, where torchvision lists both.
    datasets = pytest.importorskip("torchvision.datasets")
    root, shared = tmp_path / "root", tmp_path / "shared"
    for path in (root / "a" / "x.png", root / "a" / "sub" / "s.png", root / "b" / "y.png", shared / "z.png"):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(path)
    os.symlink(shared, root / "a" / "shared")
    os.symlink(shared, root / "b" / "shared")
    os.symlink(root / "a" / "sub", root / "c")
    ours, theirs = ImageFolder(root), datasets.ImageFolder(root)
    assert list(zip(ours.paths, ours.labels.tolist(), strict=True)) == theirs.samples
    assert [os.path.relpath(p, root) for p in ours.paths] == ["a/x.png", "a/shared/z.png", "a/sub/s.png",
                                                              "b/y.png", "b/shared/z.png", "c/s.png"]


def test_every_class_folder_without_images_is_named_at_once(tmp_path):
    # One empty class folder was named per run: a folder with several (a split that lost some classes,
    # folders holding only macOS's ._ files) took a run per folder to find, and nothing said how to keep
    # such a class.
    for cls in ("a", "b_empty", "c_only_dot_files", "d"):
        (tmp_path / cls).mkdir()
    for cls in ("a", "d"):
        Image.new("RGB", (8, 8)).save(tmp_path / cls / "x.png")
    (tmp_path / "c_only_dot_files" / "._x.png").write_bytes(b"\0\5\26\7")
    with pytest.raises(FileNotFoundError, match="have no images") as err:
        ImageFolder(tmp_path)
    assert str(tmp_path / "b_empty") in str(err.value) and str(tmp_path / "c_only_dot_files") in str(err.value)
    assert "from_samples" in str(err.value)

# ---------------------------------------------------------------------- what each backend refuses
@pytest.fixture(scope="module")
def misnamed_folder(tmp_path_factory):
    """Good photos, a JPEG named .png and a PNG named .jpg (files renamed by hand, or by a scraper)."""
    root = tmp_path_factory.mktemp("misnamed")
    (root / "a").mkdir()
    scene = Image.fromarray(_scene())
    for i in range(3):
        scene.transpose(Image.Transpose.ROTATE_180).save(root / "a" / f"good{i}.jpg", quality=90)
    (root / "a" / "jpeg_named.png").write_bytes(_jpeg(scene))
    scene.save(root / "a" / "png_named.jpg", "PNG")
    return root


@pytest.mark.parametrize("build", ["threads", "processes", pytest.param("nvimgcodec", marks=_NV)])
def test_every_training_cache_build_refuses_a_jpeg_named_png(misnamed_folder, build):
    # nvImageCodec's build decoded the JPEG bytes it was handed without asking what the name promised,
    # and cached the photo that every other backend refuses.
    source = ImageFolder(misnamed_folder)
    opts = {"cache_build": build, "cache_workers": 1}
    with pytest.raises(DecodeError) as err:
        _epoch(source, "memory", opts, TRAIN)
    assert os.path.basename(err.value.path) == "jpeg_named.png" and "named .png" in err.value.reason
    images, _, loader = _epoch(source, "memory", opts, TRAIN, on_error="skip")
    assert loader.skipped == 2 and len(images) == 3
    assert sorted(loader.kept.tolist()) == [i for i, p in enumerate(source.paths) if "good" in p]


# ------------------------------------------------------------------- valid files Pillow stumbles on
def _exif_with_a_mistyped_tag(orientation: int) -> bytes:
    """An EXIF block whose Make (0x010F, ASCII by the standard) is stored as a RATIONAL, beside the
    orientation: old cameras and editors write such blocks. Pillow reads it (Make = 0.5), but cannot
    write it back, which ``ImageOps.exif_transpose`` does (it drops the orientation from a copy)."""
    ifd = struct.pack("<H", 2) + struct.pack("<HHII", 0x010F, 5, 1, 38) + struct.pack("<HHIHH", 0x0112, 3, 1,
                                                                                       orientation, 0)
    return b"Exif\0\0" + b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + struct.pack("<II", 1, 2)


@pytest.fixture(scope="module")
def stumbling_folder(tmp_path_factory):
    """A photo turned by EXIF orientation 6 whose block has a mistyped tag, beside the same photo upright,
    and a CIELAB TIFF (Photoshop's Lab mode)."""
    root = tmp_path_factory.mktemp("stumbling")
    (root / "a").mkdir()
    scene = Image.fromarray(_scene())
    (root / "a" / "mistyped_exif6.jpg").write_bytes(_jpeg(scene.transpose(_STORE[6]),
                                                          exif=_exif_with_a_mistyped_tag(6)))
    (root / "a" / "upright.jpg").write_bytes(_jpeg(scene))
    lab = Image.frombytes("LAB", scene.size, np.full(_scene().shape, (60, 150, 100), np.uint8).tobytes())
    lab.save(root / "a" / "z_lab.tif")
    return root


@pytest.mark.parametrize("recipe", [EVAL, TRAIN], ids=["eval", "train"])
@pytest.mark.parametrize("backend, opts", BACKENDS)
def test_a_photo_with_a_mistyped_exif_tag_is_turned_not_a_crash(stumbling_folder, backend, opts, recipe):
    # exif_transpose rewrote the EXIF block of the turned copy and raised AttributeError on the mistyped
    # tag: every PIL decode failed with an error naming no file, which on_error="skip" did not skip.
    source = ImageFolder.from_samples([(stumbling_folder / "a" / n, 0) for n in ("mistyped_exif6.jpg", "upright.jpg")],
                                      ["a"])
    images, _, loader = _epoch(source, backend, opts, recipe)
    assert len(images) == 2 and loader.skipped == 0
    if recipe is EVAL:   # turned the right way: the upright photo's picture
        assert float((images[0] - images[1]).abs().mean() * 255) < 3



def _raw_profile_exif(orientation: int) -> PngImagePlugin.PngInfo:
    """ImageMagick's way of keeping a photo's EXIF block in a PNG: a "Raw profile type exif" text chunk
    (the block in hex), which Pillow's getexif reads and DALI's and nvImageCodec's PNG decoders do not."""
    block = Image.Exif()
    block[0x0112] = orientation
    raw = block.tobytes()
    text = "\nexif\n" + f"{len(raw):8d}\n" + "\n".join(raw.hex()[i:i + 72] for i in range(0, 2 * len(raw), 72))
    info = PngImagePlugin.PngInfo()
    info.add_text("Raw profile type exif", text + "\n", zip=True)
    return info


@pytest.mark.parametrize("backend, opts", BACKENDS)
def test_an_orientation_in_a_pngs_raw_exif_profile_turns_no_backend(tmp_path, backend, opts):
    # Pillow's reading turned such a PNG (torch, memory, decode="host"), DALI's own decoder did not: upside
    # down in one backend only (3), or refused by it alone (6). As XMP's orientation, it turns none.
    (tmp_path / "a").mkdir()
    stored = Image.fromarray(_scene()).transpose(_STORE[6])
    stored.save(tmp_path / "a" / "plain.png")
    for orientation in (3, 6):
        stored.save(tmp_path / "a" / f"raw{orientation}.png", pnginfo=_raw_profile_exif(orientation))
    assert Image.open(tmp_path / "a" / "raw6.png").getexif().get(0x0112) == 6   # what Pillow alone reads
    images, _, loader = _epoch(ImageFolder(tmp_path), backend, opts, EVAL)
    assert len(images) == 3 and loader.skipped == 0
    for i in (1, 2):   # raw3, raw6: the picture as stored, as plain.png
        assert float((images[i] - images[0]).abs().mean() * 255) < 0.5

_PIL_BACKENDS = [p for p in BACKENDS if p.id != "dali-dali"]


@pytest.mark.parametrize("backend, opts", _PIL_BACKENDS)
def test_a_lab_tiff_is_converted_or_refused_by_name(stumbling_folder, backend, opts):
    # Converting CIELAB to RGB needs Pillow's littleCMS; without it the conversion raised ImportError
    # (naming no file, not skipped by on_error="skip") from every backend that decodes with PIL.
    from PIL import features

    source = ImageFolder(stumbling_folder)
    if features.check("littlecms2"):
        images, _, loader = _epoch(source, backend, opts, EVAL)
        assert len(images) == 3 and loader.skipped == 0
        return
    with pytest.raises(DecodeError) as err:
        _epoch(source, backend, opts, EVAL)
    assert os.path.basename(err.value.path) == "z_lab.tif"
    assert "LAB" in err.value.reason and "littlecms2" in err.value.reason
    images, _, loader = _epoch(source, backend, opts, EVAL, on_error="skip")
    assert len(images) == 2 and loader.skipped == 1



def _exif_with_a_byte_resolution() -> bytes:
    """An EXIF block whose XResolution is one BYTE (a RATIONAL by the standard), with a ResolutionUnit:
    Pillow's JPEG header reading takes the DPI from it and fails (IndexError), so it opens no such JPEG."""
    ifd = struct.pack("<H", 2) + struct.pack("<HHIBxxx", 0x011A, 1, 1, 72) + struct.pack("<HHIHxx", 0x0128, 3, 1, 2)
    return b"Exif\0\0" + b"II*\0" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0)


@pytest.mark.parametrize("backend, opts", [p for p in BACKENDS if p.id in ("torch", "memory-threads", "dali-dali")])
def test_a_file_pillow_cannot_open_is_named_with_its_format_and_why(tmp_path, backend, opts):
    # All were "not an image format Pillow recognizes": a JPEG whose EXIF block breaks Pillow's header
    # reading is a JPEG (the failure is Pillow's JPEG reader's); a phone's HEIC photo named .jpg and a
    # macOS ._ file say what they are.
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "dpi.jpg").write_bytes(_jpeg(Image.fromarray(_scene()), exif=_exif_with_a_byte_resolution()))
    (tmp_path / "a" / "phone.jpg").write_bytes(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(200))
    (tmp_path / "a" / "._mac.jpg").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X        " + bytes(100))
    try:   # Pillow 12 fails on that block (an IndexError it does not catch); a later one may not
        Image.open(tmp_path / "a" / "dpi.jpg").close()
        names = ["phone.jpg", "._mac.jpg"]
    except Exception:
        names = ["dpi.jpg", "phone.jpg", "._mac.jpg"]
    reasons = {}
    for name in names:
        with pytest.raises(DecodeError) as err:
            _epoch(ImageFolder.from_samples([(tmp_path / "a" / name, 0)], ["a"]), backend, opts, EVAL)
        reasons[name] = err.value.reason
    if "dpi.jpg" in reasons:
        assert "a JPEG file whose header Pillow cannot read (SyntaxError: index out of range)" in reasons["dpi.jpg"]
    assert "HEIF/AVIF photo (brand heic" in reasons["phone.jpg"] and "pillow-heif" in reasons["phone.jpg"]
    # (listed by torchvision's ImageFolder, whose .samples a torchvision folder is read through)
    assert "macOS AppleDouble file" in reasons["._mac.jpg"]


# ------------------------------------------------------------- files DALI's own decoder reads otherwise
def _pnm(arr: np.ndarray, maxval: int) -> bytes:
    """A binary PGM (2-D) or PPM of ``arr`` in [0, 255] rescaled to ``maxval`` (a 12-bit scanner's 4095,
    say): the header's maxval says what white is."""
    magic, h, w = (b"P5" if arr.ndim == 2 else b"P6"), arr.shape[0], arr.shape[1]
    values = (arr.astype(np.float64) * maxval / 255).round()
    body = values.astype(">u2" if maxval > 255 else "u1").tobytes()
    return magic + f" {w} {h} {maxval}\n".encode() + body


def _dali_case(name: str, folder) -> None:
    """Write the file ``name`` (its ending is its format) into ``folder``."""
    scene = Image.fromarray(_scene())
    path = folder / name
    if name.endswith(("pgm", "ppm")):
        maxval = int(name.split("_")[1].split(".")[0])
        path.write_bytes(_pnm(np.asarray(scene.convert("L")) if name.endswith("pgm") else _scene(), maxval))
    elif name == "orientation6.tif":
        scene.transpose(_STORE[6]).save(path, tiffinfo={0x0112: 6})   # TIFF's own orientation tag
    else:
        pixels = {"float.tif": lambda: Image.fromarray(_scene()[..., 1].astype(np.float32)),
                  "int32.tif": lambda: Image.fromarray(_scene()[..., 1].astype(np.int32)),
                  }.get(name, lambda: scene.convert({"grey_alpha.tif": "LA", "palette_alpha.tif": "PA",
                                                     "onebit.tif": "1"}[name]))
        pixels().save(path)


#: Valid files that DALI's own decoder (decode="dali": the default on a GPU) reads otherwise than Pillow,
#: which the torch, memory and decode="host" backends read them with. Found here on DALI 2.4 (CPU).
_DALI_READS_OTHERWISE = {
    # a silently different picture (mean difference 40-128 grey levels):
    "grey_alpha.tif": "a grey + alpha TIFF: DALI's picture is not the grey one",
    "palette_alpha.tif": "a palette + alpha TIFF: DALI's picture is not the palette's colours",
    "float.tif": "a 32-bit float TIFF (values 0-255): DALI saturates it to white",
    "grey_4095.pgm": "a 16-bit PGM whose maxval is 4095 (12-bit data): DALI ignores maxval, all but black",
    "colour_1023.ppm": "a 16-bit PPM whose maxval is 1023: DALI ignores maxval, all but black",
    "grey_100.pgm": "an 8-bit PGM whose maxval is 100: DALI ignores maxval, too dark",
    # refused by DALI's decoder alone (a DecodeError naming it, where every other backend decodes it):
    "onebit.tif": "a 1-bit TIFF without BitsPerSample (the default 1): nvImageCodec's parser refuses it",
    "int32.tif": "a 32-bit integer TIFF: 'Invalid sample_type'",
    "orientation6.tif": "a TIFF whose own Orientation tag is 6: DALI does not turn it, Pillow does",
}


# DALI's own decoder read these otherwise until decode/dali_input gave it a PNG of Pillow's reading for
# every format but JPEG/MPO/PNG/BMP (its own tests: tests/test_dali_input.py).
@pytest.mark.parametrize("name", sorted(_DALI_READS_OTHERWISE))
def test_dalis_own_decoder_reads_a_valid_file_as_the_other_backends_do(tmp_path, name):
    _dali_case(name, tmp_path)
    source = ImageFolder.from_samples([(tmp_path / name, 0)], ["a"])

    def reading(backend, opts):
        try:
            return _epoch(source, backend, opts, EVAL)[0]
        except DecodeError as e:
            assert e.path == str(tmp_path / name)
            return None

    ref, got = reading("torch", {"num_workers": 0}), reading("dali", {"decode": "dali"})
    # Alike: both refuse it, or both decode it to the same picture (DALI's resize rounds otherwise).
    if (ref is None) != (got is None):
        pytest.fail(f"{name}: the torch backend {'refuses' if ref is None else 'decodes'} it, DALI's decoder not")
    if ref is not None:
        diff = float((got - ref).abs().mean() * 255)
        assert diff < 3, f"{name}: DALI's picture differs from the torch backend's by {diff:.1f} levels"


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_load_truncated_images_is_honoured_by_every_backend_alike(tmp_path, monkeypatch, suffix):
    # A common recipe (ImageFile.LOAD_TRUNCATED_IMAGES = True) makes Pillow decode a cut file, grey
    # below the cut: torch, memory and decode="host" then keep it, DALI's own decoder refused it by name
    # (it now gets Pillow's reading as a PNG: decode/dali_input).
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    buf = io.BytesIO()
    Image.fromarray(_scene(96, 128)).save(buf, "JPEG" if suffix == ".jpg" else "PNG")
    (tmp_path / f"cut{suffix}").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    source = ImageFolder.from_samples([(tmp_path / f"cut{suffix}", 0)], ["a"])
    kept = {name: len(_epoch(source, backend, opts, EVAL, on_error="skip")[0])
            for name, backend, opts in (("torch", "torch", {"num_workers": 0}), ("memory", "memory", {}),
                                        ("dali-host", "dali", {}), ("dali-dali", "dali", {"decode": "dali"}))}
    assert kept == {"torch": 1, "memory": 1, "dali-host": 1, "dali-dali": 1}
