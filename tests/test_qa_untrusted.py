"""Untrusted and hostile inputs: what a file a user downloaded (a checkpoint someone shared, an image folder,
tar shards, an ``index.json`` on a server they do not control) can do to a fastdata user.

Nothing in such a file may run code, write outside the cache folder, allocate memory from a number it
claims, or hang the run: each is refused with an error naming the file (skipped under ``on_error="skip"``
where it is one sample). Tests marked ``xfail(strict=True)`` are open defects in files another part of
the project owns (the reason names the file and the fix); a fix there makes them pass, and strict xfail
then fails until the mark is removed.
"""
from __future__ import annotations

import io
import json
import os
import struct
import tarfile

import pytest
import torch
from PIL import Image

from conftest import png_claiming
from engine_helpers import BACKENDS
from fastdata import Augmentation, DecodeError, fit, make_loader
from fastdata import checkpoint as ckpt
from fastdata.datasets import ImageFolder, SyntheticDigits
from fastdata.models import SmallCNN

#: What a crafted payload writes when it runs: a test that finds it failed to stop the code.
_MARK = "PWNED"


class _Payload:
    """A pickled object whose unpickling runs a command (``__reduce__`` names ``os.system``): what a
    checkpoint made to attack whoever resumes from it holds."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _run(path, *, resume, backend="torch", ema=None, accumulate=1):
    torch.manual_seed(0)
    model = SmallCNN(width=8)
    loader = make_loader(SyntheticDigits(256, seed=1), backend, batch_size=64, num_workers=0, device="cpu", seed=3)
    return fit(model, loader, epochs=1, checkpoint=path, resume=resume, progress=False, ema=ema,
               accumulate=accumulate)


def _poisoned(real: dict, marker) -> dict:
    """A real fastdata checkpoint with one value replaced by a payload: what a shared checkpoint looks like."""
    return {**real, "scheduler": _Payload(marker)}


def test_a_crafted_checkpoint_does_not_run_its_code_on_resume(tmp_path):
    path = tmp_path / "c.pt"
    _run(path, resume=False)
    torch.save(_poisoned(ckpt.load(path), tmp_path / _MARK), path)   # plain torch.save: pickles the payload
    with pytest.raises(ckpt.CheckpointError) as info:
        _run(path, resume=True)
    assert not (tmp_path / _MARK).exists(), "resuming ran the code a checkpoint named"
    text = str(info.value)
    # Was: torch's opening paragraph alone ("Re-running `torch.load` with `weights_only` set to `False`
    # will likely succeed ..."): the advice that runs the payload, and not a word of what was refused.
    assert "c.pt'" in text and "posix.system" in text and "It did not run" in text
    assert "never load it with weights_only=False" in text and "will likely succeed" not in text


@pytest.mark.parametrize("read", ["load", "from_bytes", "load_shared"])
def test_every_checkpoint_reader_refuses_a_payload_without_running_it(tmp_path, read):
    path = tmp_path / "shared.pt"
    torch.save({"format": "fastdata-checkpoint-2", "model": {}, "x": _Payload(tmp_path / _MARK)}, path)
    with pytest.raises(ckpt.CheckpointError, match="shared.pt'.*posix.system"):
        if read == "from_bytes":
            ckpt.from_bytes(path.read_bytes(), path)
        else:
            getattr(ckpt, read)(path)
    assert not (tmp_path / _MARK).exists()


def test_a_pickled_class_of_ones_own_is_named_with_the_narrow_allowlist(tmp_path):
    """Not blocked but not allowed: the error names the class and ``add_safe_globals`` for it, and warns
    against ``weights_only=False`` for a file from elsewhere."""
    from fractions import Fraction

    path = tmp_path / "f.pt"
    torch.save({"scheduler": {"rate": Fraction(1, 3)}}, path)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load(path)
    text = str(info.value)
    assert "fractions.Fraction" in text and "add_safe_globals([fractions.Fraction])" in text
    assert "do not load it with weights_only=False" in text


@pytest.mark.parametrize("key, value", [("model", 5), ("optimizer", ["x"]), ("optimizer", {"state": {}}),
                                        ("partial", None), ("partial", ["x"]), ("history", 5), ("rng_ranks", "x"),
                                        ("rng_ranks", {"junk": 1}), ("grad_norms", 5), ("rng", "x"),
                                        ("format", "fastdata-checkpoint-" + "9" * 5000)])
def test_a_checkpoint_of_wrong_entry_types_is_refused_naming_the_entry(tmp_path, key, value):
    """``weights_only`` loads any dict of plain types: a damaged or crafted checkpoint whose entries are
    of other types than fit writes is a CheckpointError naming the file (and the entry), before anything
    is restored. Was: "TypeError: 'int' object is not iterable", "AttributeError: 'list' object has no
    attribute 'get'", KeyError: 0, or int()'s digit limit, naming nothing."""
    path = tmp_path / "c.pt"
    _run(path, resume=False)
    torch.save({**ckpt.load(path), key: value}, path)
    with pytest.raises(ckpt.CheckpointError, match="c.pt'") as info:
        _run(path, resume=True)
    assert key == "format" or f"'{key}'" in str(info.value)


def _storage_claiming(numel: int, size: int) -> bytes:
    """A checkpoint whose one tensor's pickle claims ``numel`` storage elements and a ``size`` shape over
    a 16-byte record: numbers from the file, which must not become an allocation."""
    import pickletools
    import zipfile

    buffer = io.BytesIO()
    torch.save({"t": torch.zeros(4)}, buffer)
    archive = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for info in archive.infolist():
            data = archive.read(info)
            if info.filename.endswith("data.pkl"):
                ints = [pos for op, arg, pos in pickletools.genops(data) if op.name == "BININT1" and arg == 4]
                # The storage's element count (in the persistent id), then the tensor's size tuple.
                for pos, value in sorted(zip(ints[:2], (numel, size)), reverse=True):
                    data = data[:pos] + b"J" + struct.pack("<i", value) + data[pos + 2:]
            w.writestr(info.filename, data)
    return out.getvalue()


@pytest.mark.parametrize("numel, size", [(2**30, 4), (4, 2**30), (2**30, 2**30)])
def test_a_checkpoint_claiming_a_huge_tensor_is_refused_without_allocating_it(tmp_path, numel, size):
    path = tmp_path / "big.pt"
    path.write_bytes(_storage_claiming(numel, size))
    with pytest.raises(ckpt.CheckpointError, match="big.pt'.*(record size|resize storage)"):
        ckpt.load(path)


def test_a_checkpoint_whose_entry_inflates_past_the_file_is_refused_unread(tmp_path):
    """A zip bomb: a deflated entry of 64 MiB of zeros in a 70 kB file. torch.load allocates an entry's
    stated size before it checks it (2 MB took 2.5 GB and 13 s); it is refused from the zip directory."""
    import zipfile

    buffer = io.BytesIO()
    torch.save({"t": torch.zeros(4)}, buffer)
    saved = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(path, "w") as w:
        for info in saved.infolist():
            if not info.filename.endswith("data/0"):
                w.writestr(info, saved.read(info))
                continue
            entry = zipfile.ZipInfo(info.filename)
            entry.compress_type = zipfile.ZIP_DEFLATED
            with w.open(entry, "w") as f:
                for _ in range(64):
                    f.write(bytes(2**20))
    assert path.stat().st_size < 2**20
    with pytest.raises(ckpt.CheckpointError, match=r"bomb.pt' .*entry 'archive/data/0' says it expands to "
                                                   r"67,108,864 bytes, more than the whole file"):
        ckpt.load(path)
    with pytest.raises(ckpt.CheckpointError, match="more than the whole file"):
        ckpt.from_bytes(path.read_bytes(), path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fastdatas_own_checkpoints_load_with_weights_only(tmp_path, backend):
    """The allowlist is torch's default one: every checkpoint fit writes (EMA,
    accumulation, each backend's loader state) loads with ``weights_only=True`` and resumes, nothing
    else widened for it."""
    if backend == "prefetch":
        pytest.skip("prefetch needs a CUDA device")
    path = tmp_path / "own.pt"
    _run(path, resume=False, backend=backend, ema=0.99, accumulate=2)
    state = torch.load(path, weights_only=True)
    assert state["loader"]["epoch"] == 1 and state["ema"] is not None
    # torch registers its own at import; fastdata none.
    widened = [g for g in torch.serialization.get_safe_globals()
               if str(getattr(g, "__module__", "")).startswith(("fastdata", "numpy", "collections", "dataclasses"))]
    assert widened == []
    history = _run(path, resume=True, backend=backend, ema=0.99, accumulate=2)
    assert len(history) == 1


# ----------------------------------------------------------------------------------------- images
def _jpeg_claiming(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.find(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    return bytes(data)


def _folder_with(root, name: str, data: bytes):
    for c, color in (("a", "red"), ("b", "blue")):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(3):
            Image.new("RGB", (16, 16), color).save(root / c / f"g{i}.jpg")
    (root / "a" / name).write_bytes(data)
    return root / "a" / name


def _loader(root, backend, on_error):
    kw = {"num_workers": 0} if backend == "torch" else {}
    return make_loader(ImageFolder(root), backend, batch_size=7, device="cpu", on_error=on_error, drop_last=False,
                       augment=Augmentation.imagenet_train(size=16), **kw)


BOMBS = {"bomb.png": lambda: png_claiming(100_000, 100_000), "bomb.jpg": lambda: _jpeg_claiming(60_000, 60_000),
         "wide.png": lambda: png_claiming(2**31 - 1, 1)}
CPU_BACKENDS = [b for b in BACKENDS if b != "prefetch"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_decompression_bomb_is_refused_by_name_and_skipped_by_every_backend(tmp_path, backend, name):
    """A header claiming 10 gigapixels (a 69-byte PNG, a 600-byte JPEG) is a DecodeError naming the file
    before any pixel buffer exists; under skip it is counted and the other six photos are read."""
    bomb = _folder_with(tmp_path / "photos", name, BOMBS[name]())
    with pytest.raises(DecodeError, match="decompression-bomb limit") as info:
        for _ in _loader(tmp_path / "photos", backend, "raise"):
            pass
    assert info.value.path == str(bomb)
    loader = _loader(tmp_path / "photos", backend, "skip")
    seen = sum(len(images) for images, _ in loader)
    assert seen == 6 and loader.skipped == 1


def test_a_multi_frame_tiff_costs_its_first_frame_only(tmp_path):
    """A TIFF of 500 frames (a slide stack, or a file made to make readers walk every frame) is read as
    its first frame: no backend seeks through the others."""
    frames = [Image.new("RGB", (4, 4), (i, 0, 0)) for i in range(500)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "TIFF", save_all=True, append_images=frames[1:])
    _folder_with(tmp_path / "photos", "stack.tif", buffer.getvalue())
    for backend in CPU_BACKENDS:
        loader = _loader(tmp_path / "photos", backend, "raise")
        assert sum(len(images) for images, _ in loader) == 7, backend


def _jpeg_of_scans(extra: int, side: int = 64) -> bytes:
    """A progressive JPEG of a flat picture with its smallest scan repeated ``extra`` more times: libjpeg
    warns about the repeated refinement and decodes each one (a pass over every block), 30-odd bytes a
    scan. At 8000² and 10 000 scans, 300 kB held a decoder for minutes; here small, to count, not to time."""
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (120, 130, 140)).save(buffer, "JPEG", progressive=True)
    data = buffer.getvalue()
    starts = [i for i in range(len(data) - 1) if data[i:i + 2] == b"\xff\xda"]
    scans = [data[a:b] for a, b in zip(starts, starts[1:] + [len(data) - 2])]
    return data[:-2] + min(scans, key=len) * extra + b"\xff\xd9"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_jpeg_of_thousands_of_scans_is_refused_before_decoding(tmp_path, backend):
    from fastdata.images import photo

    many = _jpeg_of_scans(photo.MAX_JPEG_SCANS)
    bad = _folder_with(tmp_path / "photos", "scans.jpg", many)
    Image.open(io.BytesIO(many)).load()   # Pillow decodes it (no error), however long it takes
    with pytest.raises(DecodeError, match=r"JPEG of \d+ scans, past the limit of 500") as info:
        for _ in _loader(tmp_path / "photos", backend, "raise"):
            pass
    assert info.value.path == str(bad)
    loader = _loader(tmp_path / "photos", backend, "skip")
    assert sum(len(images) for images, _ in loader) == 6 and loader.skipped == 1
    # A progressive photo's ten scans, and 500, are read.
    bad.write_bytes(_jpeg_of_scans(photo.MAX_JPEG_SCANS - 20))
    assert sum(len(images) for images, _ in _loader(tmp_path / "photos", backend, "raise")) == 7


@pytest.mark.parametrize("region", ["1", "0"])
def test_both_jpeg_header_paths_count_the_scans(monkeypatch, region):
    """With region decoding the header is read without Pillow (``photo._jpeg_header``), and Pillow's
    ``open_image`` is not reached: each path refuses the file itself."""
    import numpy as np

    from fastdata.images import photo

    monkeypatch.setenv("FASTDATA_REGION_DECODE", region)
    if region == "1" and not photo.region_decode_enabled():
        pytest.skip("no region decoder (nvImageCodec) here")
    aug = Augmentation.imagenet_train(size=16)
    with pytest.raises(DecodeError, match="scans, past the limit") as info:
        photo.load_photo(_jpeg_of_scans(photo.MAX_JPEG_SCANS + 1), "x/scans.jpg", aug, np.random.default_rng(0))
    assert info.value.path == "x/scans.jpg"
    monkeypatch.setattr(photo, "MAX_JPEG_SCANS", 10_000)   # raised on purpose: read
    out = photo.load_photo(_jpeg_of_scans(600), "x/scans.jpg", aug, np.random.default_rng(0))
    assert out.shape == (16, 16, 3)


def test_the_nvimagecodec_cache_build_counts_the_scans_too(tmp_path):
    """``cache_build="nvimgcodec"`` decodes JPEGs without Pillow (``NvWholeDecoder``): it hands a file of
    too many scans to ``load_whole``, which names it, instead of decoding every scan."""
    from fastdata.images import photo
    from fastdata.images.whole import nvimgcodec

    if nvimgcodec() is None:
        pytest.skip("nvImageCodec is not installed")
    bad = _folder_with(tmp_path / "photos", "scans.jpg", _jpeg_of_scans(photo.MAX_JPEG_SCANS))
    with pytest.raises(DecodeError, match="scans, past the limit") as info:
        make_loader(ImageFolder(tmp_path / "photos"), "memory", batch_size=7, device="cpu", cache_size=64,
                    cache_build="nvimgcodec", augment=Augmentation.imagenet_train(size=16))
    assert info.value.path == str(bad)


# ------------------------------------------------------------------------------------ image folders
@pytest.mark.parametrize("kind", ["fifo", "device", "loop", "unreadable"])
def test_a_special_file_named_like_a_photo_is_named_or_skipped_never_waited_on(tmp_path, kind):
    root = tmp_path / "photos"
    bad = _folder_with(root, "x.jpg", b"")
    bad.unlink()
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "device":
        bad.symlink_to("/dev/zero")
    elif kind == "loop":
        bad.symlink_to(bad)
    else:
        bad.write_bytes(b"\xff\xd8")
        bad.chmod(0)
        if os.access(bad, os.R_OK):
            pytest.skip("running as root: a mode of 000 does not stop this user reading")
    for backend in CPU_BACKENDS:
        with pytest.raises(DecodeError) as info:
            for _ in _loader(root, backend, "raise"):
                pass
        assert info.value.path == str(bad), backend
        loader = _loader(root, backend, "skip")
        assert sum(len(images) for images, _ in loader) == 6 and loader.skipped == 1, backend


# ----------------------------------------------------------------------------------- tars and packs
def _tar_gz_with_member(path, name: str, size: int) -> None:
    """A .tar.gz holding two small photos and an image member of ``size`` zero bytes (a few MB compressed:
    a zip bomb's ratio)."""
    class Zeros(io.RawIOBase):
        def __init__(self, n):
            self.left = n

        def readable(self):
            return True

        def readinto(self, b):
            k = min(len(b), self.left)
            b[:k] = bytes(k)
            self.left -= k
            return k

    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for i in range(2):
            photo = io.BytesIO()
            Image.new("RGB", (8, 8)).save(photo, "JPEG")
            for member, data in ((f"g{i}.jpg", photo.getvalue()), (f"g{i}.cls", b"0")):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(name)
        info.size = size
        tar.addfile(info, io.BufferedReader(Zeros(size)))
        info = tarfile.TarInfo(name.rpartition(".")[0] + ".cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"1"))


def test_a_tar_image_member_past_the_image_limit_is_refused_when_scanned(tmp_path):
    from fastdata.packing.tars import TarImages
    from fastdata.shards.index import MAX_MEMBER_BYTES

    (tmp_path / "tars").mkdir()
    _tar_gz_with_member(tmp_path / "tars" / "s.tar.gz", "bomb.jpg", MAX_MEMBER_BYTES + 1)
    with pytest.raises(ValueError, match=r"s\.tar\.gz.*bomb\.jpg"):
        TarImages(tmp_path / "tars")


def test_a_hard_link_to_a_large_member_is_held_to_the_image_limit_too(tmp_path):
    """A hard link named ``x.jpg`` reads its target's bytes: a target of any other name (``x.bin``, no
    image, never checked itself) must not carry a member past the limit in. ``max_member_bytes`` moves it."""
    from fastdata.packing.tars import TarImages

    (tmp_path / "tars").mkdir()
    with tarfile.open(tmp_path / "tars" / "s.tar", "w") as tar:
        for name, data in (("x.bin", b"\xff" * 4000), ("x.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("x.jpg")
        info.type, info.linkname = tarfile.LNKTYPE, "x.bin"
        tar.addfile(info)
    with pytest.raises(ValueError, match=r"s\.tar.*x\.jpg.*4,000 bytes.*1,000.*max_member_bytes"):
        TarImages(tmp_path / "tars", max_member_bytes=1000)
    assert len(TarImages(tmp_path / "tars", max_member_bytes=4000)) == 1


def test_tar_members_that_point_outside_are_never_written_anywhere(tmp_path):
    """``../``, absolute names, symbolic and hard links and devices in a foreign tar: the scan reads byte
    ranges and writes nothing; links and devices are no sample's bytes, a hard link to an outside path
    is left out."""
    from fastdata.packing.tars import TarImages

    (tmp_path / "tars").mkdir()
    photo = io.BytesIO()
    Image.new("RGB", (8, 8)).save(photo, "JPEG")
    with tarfile.open(tmp_path / "tars" / "s.tar", "w") as tar:
        for name, data in (("../../evil.jpg", photo.getvalue()), ("../../evil.cls", b"0"),
                           ("/tmp/abs.jpg", photo.getvalue()), ("/tmp/abs.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, kind, target in (("sym.jpg", tarfile.SYMTYPE, "/etc/passwd"),
                                   ("hard.jpg", tarfile.LNKTYPE, "/etc/passwd"), ("dev.jpg", tarfile.CHRTYPE, "")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)
    before = set(os.listdir(tmp_path))
    source = TarImages(tmp_path / "tars")
    assert sorted(source.members) == ["../../evil.jpg", "/tmp/abs.jpg"] and len(source) == 2
    assert all(len(source.read_stamped(i)[0]) == len(photo.getvalue()) for i in range(2))
    assert set(os.listdir(tmp_path)) == before and not (tmp_path.parent / "evil.jpg").exists()


def _index_doc(tmp_path) -> dict:
    """The index.json of a small real pack, as a document to tamper with."""
    import fastdata

    root = tmp_path / "src"
    _folder_with(root, "g9.jpg", _jpeg_claiming(16, 16))
    fastdata.pack(ImageFolder(root), tmp_path / "pack", progress=False, workers=0)
    return json.loads((tmp_path / "pack" / "index.json").read_text())


def test_an_index_offset_that_overflows_is_refused(tmp_path):
    from fastdata.shards.index import BadIndex, parse_index

    doc = _index_doc(tmp_path)
    doc["samples"]["offset"][0] = 2**63 - 512   # a multiple of 512: only the end check can refuse it
    with pytest.raises(BadIndex, match="samples.offset"):
        parse_index(json.dumps(doc).encode(), "remote/index.json")


def test_an_index_shard_size_past_int64_is_a_bad_index(tmp_path):
    from fastdata.shards.index import BadIndex, parse_index

    doc = _index_doc(tmp_path)
    doc["shards"][0]["size"] = 10**30 // 512 * 512
    with pytest.raises(BadIndex, match=r"shards\[0\]\.size"):
        parse_index(json.dumps(doc).encode(), "remote/index.json")


@pytest.mark.parametrize("name", [".locks/shard-0.tar.lock", "sub/.hidden.tar", ".shard-0.tar"])
def test_an_index_shard_name_with_a_hidden_component_is_refused(tmp_path, name):
    """A remote index's shard name becomes a path in the shard cache, which keeps its lock files under
    ``.locks/``: a shard named ``.locks/x.tar.lock`` would be written over one. ``pack`` writes none."""
    from fastdata.shards.index import BadIndex, parse_index

    doc = _index_doc(tmp_path)
    assert not any(part.startswith(".") for s in doc["shards"] for part in s["name"].split("/"))
    doc["shards"][0]["name"] = name
    with pytest.raises(BadIndex, match=r"shards\[0\]\.name.*hidden"):
        parse_index(json.dumps(doc).encode(), "remote/index.json")


def test_pack_refuses_a_file_that_is_no_image_instead_of_copying_it(tmp_path):
    import fastdata

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    root = tmp_path / "downloaded"
    link = _folder_with(root, "x.jpg", b"")
    link.unlink()
    link.symlink_to(secret)
    with pytest.raises(ValueError, match="not an image") as refused:
        fastdata.pack(ImageFolder(root), tmp_path / "pack", progress=False, workers=0)
    assert str(link) in str(refused.value)
    packed = b"".join(p.read_bytes() for p in (tmp_path / "pack").glob("*.tar"))
    assert b"PRIVATE KEY" not in packed


@pytest.mark.parametrize("name, data", [("x.jpg", b"abc"), ("p.jpg", "png"), ("t.png", b"\x00" * 100)],
                         ids=["three-bytes", "png-named-jpg", "zeros"])
def test_pack_refuses_bytes_the_loaders_would_not_open_naming_the_file(tmp_path, name, data):
    """Pack checks each file's header as the loaders' ``open_image`` does: a few bytes, a PNG named .jpg
    (every loader refuses it by name), zeros; the refusal names the file, and no shard holds it."""
    import fastdata

    if data == "png":
        png = io.BytesIO()
        Image.new("RGB", (8, 8)).save(png, "PNG")
        data = png.getvalue()
    bad = _folder_with(tmp_path / "src", name, data)
    with pytest.raises(ValueError, match="not an image the loaders read") as refused:
        fastdata.pack(ImageFolder(tmp_path / "src"), tmp_path / "pack", progress=False, workers=0)
    assert str(bad) in str(refused.value)


def test_a_folder_nested_past_pythons_recursion_limit_is_listed(tmp_path):
    root = tmp_path / "deep"
    (root / "c").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(root / "c" / "top.jpg")
    here = os.getcwd()
    try:   # one level at a time: os.makedirs recurses too, and a long path passes PATH_MAX
        os.chdir(root / "c")
        for _ in range(1050):
            os.mkdir("d")
            os.chdir("d")
        Image.new("RGB", (8, 8)).save("bottom.jpg")
    finally:
        os.chdir(here)
    try:
        assert len(ImageFolder(root)) == 2
    finally:
        _remove_deep(root / "c", 1050)


def _recursive_walk(folder, exts, visited, marked, real_root):
    """``folders._walk_images`` as it was written before its explicit stack (one call per level): the
    reference its order must keep, since the order of the files decides every sample id."""
    from fastdata.datasets.folders import _is_folder, _scandir

    for entry in _scandir(folder):
        if entry.name.startswith("."):
            continue
        if _is_folder(entry):
            real = os.path.realpath(entry.path)
            if real_root.startswith(real.rstrip(os.sep) + os.sep):
                raise ValueError(f"loop through '{entry.path}'")
            if real in visited or (real in marked and entry.is_symlink()):
                continue
            visited.add(real)
            yield from _recursive_walk(entry.path, exts, visited, marked, real_root)
        elif entry.name.lower().endswith(exts):
            yield os.fspath(folder), entry.name


def test_the_folder_walk_lists_files_in_the_order_of_the_recursive_walk(tmp_path, monkeypatch):
    """Nested folders, links to folders (a folder linked twice, a link to another class, a link back to
    the class folder, links into a sibling's sub-folder), odd names: the same (folder, file) pairs in
    the same order as the recursive walk, and the same ImageFolder paths, labels and classes."""
    from fastdata.datasets import folders

    root = tmp_path / "root"
    photo = io.BytesIO()
    Image.new("RGB", (4, 4)).save(photo, "PNG")
    files = ["a/z.png", "a/b c/ü.png", "a/b c/d/e/f.PNG", "a/b-c/x.png", "a/b_c/.hidden.png", "a/ä/1.png",
             "a/shared/s.png", "a/shared/deeper/t.png", "b/x.png", "b/sub dir/y.tif", "b/sub dir/n.txt",
             "c/only.png", "a/\u3042/q.png", "a/Z/q.png", "a/z2/q.png", "a/b c.png"]
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(photo.getvalue())
    for link, target in (("a/again", "shared"), ("a/0first", "shared/deeper"), ("b/to_a", "../a"),
                         ("b/to_shared", "../a/shared"), ("a/shared/back", ".."), ("c/self", "."),
                         ("c/dangling.png", "nowhere.png"), ("c/into_b_sub", "../b/sub dir")):
        os.symlink(target, root / link)
    real_root = os.path.realpath(root)
    classes = sorted(p.name for p in root.iterdir())
    marked = {real_root} | {os.path.realpath(root / c) for c in classes}
    listed = []
    for cls in classes:
        start = {os.path.realpath(root / cls)}
        new = list(folders._walk_images(root / cls, (".png", ".tif"), set(start), marked, real_root))
        assert new == list(_recursive_walk(root / cls, (".png", ".tif"), set(start), marked, real_root)), cls
        listed += new
    assert ("%s/b/sub dir" % root, "y.tif") in listed and len(listed) > len(files) - 3
    source = ImageFolder(root)
    monkeypatch.setattr(folders, "_walk_images", _recursive_walk)
    before = ImageFolder(root)
    assert list(source.paths) == list(before.paths) and source.classes == before.classes
    assert source.labels.tolist() == before.labels.tolist()


def _remove_deep(folder, depth: int) -> None:
    """Remove a chain of ``depth`` folders named ``d`` bottom-up: shutil.rmtree (pytest's cleanup of
    tmp_path) recurses once per level too, and failed on this tree."""
    here = os.getcwd()
    try:
        os.chdir(os.path.join(folder, *["d"] * depth))
        os.remove("bottom.jpg")
        for _ in range(depth):
            os.chdir("..")
            os.rmdir("d")
    finally:
        os.chdir(here)


_HUGE_LABEL = """
import io, resource, sys, tarfile
from PIL import Image
photo = io.BytesIO()
Image.new("RGB", (8, 8)).save(photo, "JPEG")
with tarfile.open(sys.argv[1] + "/s.tar", "w") as tar:
    for name, data in (("a.jpg", photo.getvalue()), ("a.cls", b"0"), ("b.jpg", photo.getvalue()),
                       ("b.cls", b"1000000000000")):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
from fastdata.packing.tars import TarImages
resource.setrlimit(resource.RLIMIT_DATA, (2 * 2**30, 2 * 2**30))   # the bug's list of names stops here
try:
    TarImages(sys.argv[1])
except ValueError as e:
    print("refused:", e)
except MemoryError:
    print("MemoryError")
"""


def test_a_tar_label_of_a_huge_class_index_is_refused_not_allocated(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _HUGE_LABEL, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.stdout.startswith("refused:") and "b.cls" in run.stdout, run.stdout + run.stderr[-2000:]


def _gzip_idx(path, shape, body_bytes: int) -> None:
    """A gzipped IDX file whose header says ``shape`` and whose body inflates to ``body_bytes`` zeros
    (written a megabyte at a time: a bomb of any size is a few kB per MB)."""
    import gzip

    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(struct.pack(">HBB", 0, 8, len(shape)) + struct.pack(">" + "I" * len(shape), *shape))
        for start in range(0, body_bytes, 2**20):
            f.write(bytes(min(2**20, body_bytes - start)))


def test_a_gzipped_idx_file_that_inflates_past_its_header_is_refused_unread(tmp_path):
    """A ``.gz`` IDX file of 12 announced bytes that inflates to 96 MB (a gzip bomb, ~100 kB on disk):
    refused naming the file after one byte past the body, not read whole into memory."""
    import tracemalloc

    from fastdata.datasets.mnist import read_idx

    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    _gzip_idx(path, (3, 2, 2), 96 * 2**20)
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=f"IDX file '{path}' does not match its header"):
            read_idx(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak:,} bytes held to refuse it"


def test_a_gzipped_idx_header_claiming_more_than_gzip_can_hold_is_refused(tmp_path):
    """A header saying 2**32-1 images of 2**16 x 2**16 in a gzip of a few bytes: no such body can be in
    it, so it is refused before any read (a read of that size would allocate it up front)."""
    from fastdata.datasets.mnist import read_idx

    path = tmp_path / "x-idx3-ubyte.gz"
    _gzip_idx(path, (2**32 - 1, 2**16, 2**16), 100)
    with pytest.raises(ValueError, match=f"IDX file '{path}' .*more than a gzip file of"):
        read_idx(path)


class _HostileHTTP:
    """A server on 127.0.0.1 whose every GET answers ``body_bytes`` zeros: with ``mode='no-range'`` as a
    200 whatever the Range asked (a server that ignores ranges, a shard of that size); with
    ``mode='gzip'`` gzip-encoded (``Content-Encoding: gzip``, some kB on the wire), whatever was asked."""

    def __init__(self, mode: str, body_bytes: int):
        import gzip
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        wire = bytes(body_bytes) if mode == "no-range" else gzip.compress(bytes(body_bytes), 9)
        self.requests: list = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(inner):
                self.requests.append((inner.path, inner.headers.get("Range"), inner.headers.get("Accept-Encoding")))
                inner.send_response(200)
                inner.send_header("Content-Length", str(len(wire)))
                if mode == "gzip":
                    inner.send_header("Content-Encoding", "gzip")
                inner.end_headers()
                try:
                    for k in range(0, len(wire), 2**20):
                        inner.wfile.write(wire[k:k + 2**20])
                except OSError:   # the client stopped reading: what it should do
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/pack"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _peak_while(fn):
    """(what ``fn`` raised, the peak of Python memory traced meanwhile, every thread's)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(Exception) as raised:
            fn()
        return raised.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("mode", ["no-range", "gzip"])
def test_a_remote_range_read_holds_no_more_than_the_range_from_a_hostile_server(mode):
    """A server that answers a sample's 1 kB range with a 200 of a 64 MB shard, or with a gzip bomb:
    the read is refused naming the shard, holding about the range (fsspec's _cat_file read the whole
    reply, then the length was checked)."""
    pytest.importorskip("aiohttp")
    from fastdata.shards.storage import Storage, StorageError

    server = _HostileHTTP(mode, 64 * 2**20)
    try:
        storage = Storage(server.url, retries=0)
        error, peak = _peak_while(lambda: storage.read_ranges("shard-0.tar", [(512, 1536)]))
    finally:
        server.close()
    assert isinstance(error, StorageError) and "shard-0.tar" in str(error), repr(error)
    assert peak < 16 * 2**20, f"{peak:,} bytes held for a 1 kB range"
    assert server.requests[0][1] == "bytes=512-1535" and server.requests[0][2] == "identity"


def test_a_remote_index_sent_as_a_gzip_bomb_is_refused_unread():
    """index.json answered gzip-encoded (a few kB inflating to 64 MB): asked unencoded, refused by name."""
    pytest.importorskip("aiohttp")
    from fastdata.shards.storage import Storage, StorageError

    server = _HostileHTTP("gzip", 64 * 2**20)
    try:
        error, peak = _peak_while(lambda: Storage(server.url, retries=0).read("index.json", subject="the index"))
    finally:
        server.close()
    assert isinstance(error, StorageError) and "the index" in str(error) and "gzip" in str(error), repr(error)
    assert peak < 16 * 2**20, f"{peak:,} bytes held"
