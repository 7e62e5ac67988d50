"""Review of the untrusted-input guards (fastdata/images/photo.py's scan limit, fastdata/checkpoint.py's
zip checks, fastdata/engine/state.py's entry checks): real files they must not refuse."""
import io
import os

import numpy as np
import pytest
from PIL import Image

from fastdata import Augmentation
from fastdata.errors import DecodeError
from fastdata.images import photo


def _photo() -> Image.Image:
    """A picture with detail (a random walk along each row): its scans hold real entropy-coded data."""
    rng = np.random.default_rng(0)
    rows = np.cumsum(rng.normal(0, 6, (96, 128, 3)), axis=1) + 128
    return Image.fromarray(np.clip(rows, 0, 255).astype(np.uint8))


def _jpeg(img: Image.Image | None = None, **options) -> bytes:
    buffer = io.BytesIO()
    (img or _photo()).save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def _decodes_everywhere(data: bytes, name="x/photo.jpg") -> None:
    """open_image and load_photo (region decoding on and off) take the file, as Pillow does."""
    Image.open(io.BytesIO(data)).load()
    photo.open_image(name, io.BytesIO(data)).close()
    aug = Augmentation.imagenet_train(size=16)
    assert photo.load_photo(data, name, aug, np.random.default_rng(0)).shape == (16, 16, 3)


# --------------------------------------------------------------------------------- JPEG scan count
def test_ff_da_bytes_in_an_icc_profile_are_no_scans(monkeypatch):
    """An ICC profile is opaque binary (LUT profiles run to megabytes): byte pairs FF DA in it are no
    start-of-scan markers, and a baseline photo carrying 600 of them decodes in one pass. A count of
    every FF DA in the file refused it as 'a JPEG of 601 scans'."""
    rng = np.random.default_rng(1)
    profile = rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes() + b"\xff\xda" * 600
    data = _jpeg(icc_profile=profile)
    assert data.count(b"\xff\xda") > photo.MAX_JPEG_SCANS
    for region in ("0", "1"):
        monkeypatch.setenv("FASTDATA_REGION_DECODE", region)
        _decodes_everywhere(data)
    assert photo.jpeg_scans(data) == 1


def test_data_after_the_end_of_the_picture_is_no_scans():
    """A motion photo (Google's, Samsung's) is a JPEG with a video appended after its end; every decoder
    stops at the end-of-image marker. Compressed bytes hold an FF DA pair every 64 kB: 40 MB appended
    counted 600-odd scans and refused the photo."""
    rng = np.random.default_rng(2)
    tail = rng.integers(0, 256, 600 * 65_536, dtype=np.uint8).tobytes()
    data = _jpeg(progressive=True) + tail
    assert data.count(b"\xff\xda") > photo.MAX_JPEG_SCANS
    photo.check_scans("x/motion.jpg", data)
    assert photo.jpeg_scans(data) == 10


def test_an_mpo_counts_the_scans_of_the_picture_decoded(monkeypatch):
    """A multi-picture file (MPO: a camera's stereo pair, a phone's photo with its depth or gain map) is
    decoded as its first picture, so only that picture's scans are passes of the decode."""
    img = _photo()
    buffer = io.BytesIO()
    img.save(buffer, "MPO", save_all=True, append_images=[img.rotate(90), img.rotate(180)], progressive=True)
    data = buffer.getvalue()
    monkeypatch.setattr(photo, "MAX_JPEG_SCANS", 12)   # raised or lowered at will: read at each call
    photo.open_image("x/pair.jpg", io.BytesIO(data)).close()
    assert data.count(b"\xff\xda") == 30 and photo.jpeg_scans(data) == 10


@pytest.mark.parametrize("options", [{}, {"progressive": True}, {"progressive": True, "optimize": True},
                                     {"optimize": True, "subsampling": 0}])
def test_real_encodings_count_their_scans_exactly(options):
    """Baseline: 1 scan; libjpeg's progressive script: 10, optimized or not; an EXIF block with a
    progressive thumbnail of its own (10 scans more in its bytes) adds none."""
    thumb = _jpeg(_photo().resize((32, 24)), progressive=True)
    exif = Image.Exif()
    exif[0x0112] = 1
    app1 = exif.tobytes() + thumb   # the thumbnail's bytes inside the APP1 block, after the IFDs
    data = _jpeg(exif=app1, **options)
    assert data.count(b"\xff\xda") >= 11
    assert photo.jpeg_scans(data) == (10 if options.get("progressive") else 1)
    _decodes_everywhere(data)


def test_restart_markers_and_fill_bytes_are_walked_over():
    """Restart markers (FF D0-D7, one per interval of MCUs) sit inside a scan's data and fill bytes (FF)
    may precede any marker: neither is a scan, and neither ends the walk early."""
    plain = _jpeg(progressive=True)
    at = plain.index(b"\xff\xda")
    padded = plain[:at] + b"\xff" * 7 + plain[at:]
    assert photo.jpeg_scans(padded) == 10
    Image.open(io.BytesIO(padded)).load()
    for progressive, scans in ((False, 1), (True, 10)):
        buffer = io.BytesIO()   # a restart marker after every MCU (16x16 pixels): 47 of them a scan
        _photo().save(buffer, "JPEG", restart_marker_blocks=1, progressive=progressive)
        data = buffer.getvalue()
        assert sum(data.count(bytes([0xFF, 0xD0 + i])) for i in range(8)) >= 47
        assert photo.jpeg_scans(data) == scans
        Image.open(io.BytesIO(data)).load()


def _many_scans(extra: int) -> bytes:
    """A progressive JPEG with its smallest scan repeated ``extra`` more times (each a full pass)."""
    data = _jpeg(Image.new("RGB", (64, 64), (120, 130, 140)), progressive=True)
    starts = [i for i in range(len(data) - 1) if data[i:i + 2] == b"\xff\xda"]
    scans = [data[a:b] for a, b in zip(starts, starts[1:] + [len(data) - 2])]
    return data[:-2] + min(scans, key=len) * extra + b"\xff\xd9"


def test_scans_hidden_from_a_naive_walk_are_still_counted():
    """The walk reads markers as libjpeg does: junk between markers is skipped to the next marker (libjpeg
    warns and goes on), and an FF D9 inside a comment's bytes is no end of the picture. A walk that
    stopped at either would let a file of thousands of scans through; at a length no decoder should take,
    every FF DA pair counts."""
    many = _many_scans(600)
    at = many.index(b"\xff\xda", many.index(b"\xff\xda") + 1)   # between the first two scans
    comment = b"\xff\xfe\x00\x06\xff\xd9\xff\xd9"
    bogus = b"\xff\xfe\x00\x00"   # a length libjpeg refuses, and a more lenient decoder might skip
    for inserted in (comment, b"junk\x00", bogus):
        crafted = many[:at] + inserted + many[at:]
        assert photo.jpeg_scans(crafted) > photo.MAX_JPEG_SCANS
        with pytest.raises(DecodeError, match="scans, past the limit"):
            photo.check_scans("x/scans.jpg", crafted)


def test_a_file_of_endless_markers_is_counted_in_bounded_steps(monkeypatch):
    """Empty APP segments, four bytes each: a walk of one Python step per marker would spend seconds on a
    10 MB file. Past a bound of markers no photo has, the count falls back to every FF DA pair (an upper
    bound of the scans), so such a file is refused, not walked to its end."""
    searches = []

    class Counting:
        def search(self, data, pos):
            searches.append(pos)
            return marker.search(data, pos)

    marker = photo._MARKER
    monkeypatch.setattr(photo, "_MARKER", Counting())
    data = _jpeg()[:2] + b"\xff\xe0\x00\x02" * 2_500_000 + b"\xff\xda\x00\x02" * 501 + b"\xff\xd9"
    with pytest.raises(DecodeError, match="JPEG of 501 scans"):
        photo.check_scans("x/markers.jpg", data)
    assert len(searches) == photo._MAX_MARKERS


# --------------------------------------------------------------------------------- checkpoints
class _Calls:
    """Pickles as a call of ``func(*args)``: what a checkpoint crafted to run code holds."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _crafted(tmp_path, func, args):
    import torch

    path = tmp_path / "shared.pt"
    torch.save({"format": "fastdata-checkpoint-2", "model": {}, "x": _Calls(func, args)}, path)
    return path


@pytest.mark.parametrize("func, args, named", [
    (eval, ("print('ran')",), "eval"), (exec, ("print('ran')",), "exec"), (getattr, (1, "real"), "getattr"),
    (__import__("subprocess").check_output, (["true"],), "check_output"),
    (__import__("runpy")._run_code, ("print('ran')", {}), "runpy._run_code")])
def test_a_checkpoint_calling_code_torch_does_not_block_is_never_advised_onto_the_allowlist(tmp_path, func,
                                                                                             args, named):
    """torch blocks the modules os, posix, nt and sys alone: a pickled eval, exec, getattr, subprocess call
    or runpy._run_code is "not an allowed global", like a class of one's own. The error told the user to
    allow it: "loads once that class is allowed: torch.serialization.add_safe_globals([eval])". Such a
    name runs code: the file was made to run it, and no advice leads to loading it."""
    from fastdata import checkpoint as ckpt

    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load(_crafted(tmp_path, func, args))
    text = str(info.value)
    assert named in text and "made to run" in text and "never load it with weights_only=False" in text
    assert "add_safe_globals" not in text


def test_a_tensors_only_file_is_pointed_to_a_weights_only_load():
    """A model's own weights given as fit's checkpoint: the hint to load them names weights_only=True.
    On torch 2.4 and 2.5 (pyproject allows them) a bare torch.load(path) unpickles with weights_only=False."""
    import torch

    from fastdata.engine.state import _format_hint

    hint = _format_hint({"weight": torch.zeros(2)})
    assert "torch.load(path, weights_only=True)" in hint and "torch.load(path))" not in hint


def test_many_deflated_entries_each_under_the_file_size_are_refused_together(tmp_path):
    """A zip bomb spread over entries: 1000 tensors of 64 kB of zeros, each entry deflated to some 100
    bytes, in a file of about 300 kB. No entry states more than the whole file, so the check of each one
    let it through, and torch.load allocated and inflated every entry: 64 MB held from 300 kB (a
    20 MB file: tens of GB). torch.save stores its entries, so together they never state more than
    the file."""
    import zipfile

    import torch

    from fastdata import checkpoint as ckpt

    buffer = io.BytesIO()
    torch.save({f"t{i}": torch.zeros(2**14) for i in range(1000)}, buffer)
    saved = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    path = tmp_path / "spread.pt"
    with zipfile.ZipFile(path, "w") as w:
        for info in saved.infolist():
            entry = zipfile.ZipInfo(info.filename)
            entry.compress_type = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            w.writestr(entry, saved.read(info))
    with zipfile.ZipFile(path) as archive:
        stated = [info.file_size for info in archive.infolist()]
    size = path.stat().st_size
    assert max(stated) < size < sum(stated) // 100
    with pytest.raises(ckpt.CheckpointError, match=r"spread.pt' .*1,00\d entries say they expand to [\d,]+ "
                                                   r"bytes together, more than the whole file"):
        ckpt.load(path)
    with pytest.raises(ckpt.CheckpointError, match="more than the whole file"):
        ckpt.from_bytes(path.read_bytes(), path)


def test_zip64_sizes_are_compared_as_stated(tmp_path):
    """A checkpoint past 4 GB states its entries' sizes in zip64 extra fields: an entry of 5 GiB in a
    file of 6 GiB (sparse here) is no bomb, and the same directory in a file of a few hundred bytes is."""
    import zipfile

    from fastdata import checkpoint as ckpt

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as w:
        w.writestr("archive/data/0", b"x" * 10)
        w.filelist[0].file_size = w.filelist[0].compress_size = 5 * 2**30   # written as zip64 at close
    raw = buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        assert archive.infolist()[0].file_size == 5 * 2**30
        assert ckpt._oversized(archive, len(raw)) is not None
    path = tmp_path / "large.zip"
    with open(path, "wb") as f:   # zip readers find the directory from the end: a prefix is allowed
        f.truncate(6 * 2**30)
        f.seek(6 * 2**30)
        f.write(raw)
    with zipfile.ZipFile(path) as archive:
        assert ckpt._oversized(archive, path.stat().st_size) is None


@pytest.mark.parametrize("size, checked", [(64, True), (224, False)])
def test_a_photo_has_its_scans_counted_once_a_decode(monkeypatch, size, checked):
    """With region decoding, load_photo counts the scans when it reads the header without Pillow; a
    crop decoded at a draft scale (a small output) or a file's first decode then opened the file with
    Pillow's open_image, which walked the same bytes again (some 50 µs more for a 100 kB photo)."""
    monkeypatch.setenv("FASTDATA_REGION_DECODE", "1")
    if not photo.region_decode_enabled():
        pytest.skip("no region decoder (nvImageCodec) here")
    walks = []
    walk = photo.jpeg_scans
    monkeypatch.setattr(photo, "jpeg_scans", lambda data: walks.append(1) or walk(data))
    data = _jpeg(_photo().resize((600, 480)))
    aug = Augmentation.imagenet_train(size=size)
    for seed in range(10):
        photo.load_photo(data, "x/photo.jpg", aug, np.random.default_rng(seed), checked=checked)
    assert len(walks) == 10


# ---------------------------------------------------------------- a file of a few bytes
@pytest.mark.parametrize("backend", ["torch", "memory", "dali"])
@pytest.mark.parametrize("data", [b"\xff\xd8\xff", b"BM", b"\x00"], ids=["jpeg-start", "bmp-start", "one-byte"])
def test_a_file_of_a_few_bytes_is_a_decode_error_naming_it_and_skipped_under_skip(tmp_path, backend, data):
    """A download cut off after 1-3 bytes: Pillow's BMP signature test reads 4 bytes and raised a bare
    struct.error out of the reason-finding for an unidentified file, naming no file, and on_error='skip'
    did not skip it (it is not a DecodeError)."""
    import warnings

    from conftest import require
    from fastdata import Augmentation, make_loader
    from fastdata.datasets import ImageFolder, make_image_folder
    from fastdata.errors import DecodeError

    if backend == "dali":
        require("nvidia.dali")
    root = make_image_folder(tmp_path / "p", classes=2, per_class=4, size_range=((20, 30), (20, 30)))
    bad = ImageFolder(root).sample_name(1)
    with open(bad, "wb") as f:
        f.write(data)
    kw = dict(batch_size=4, device="cpu", num_workers=0, train=False, drop_last=False,
              augment=Augmentation.imagenet_eval(size=16))
    with pytest.raises(DecodeError, match=os.path.basename(bad)):
        list(make_loader(ImageFolder(root), backend, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = make_loader(ImageFolder(root), backend, on_error="skip", **kw)
        assert sum(len(y) for _, y in loader) == 7
