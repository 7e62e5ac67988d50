import importlib
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from conftest import load_example, require, skip_missing
from fastdata.datasets import ArraySource
from fastdata.packing import pack
from fastdata.shards import index as shard_index
from fastdata.shards import read_index
from fastdata.shards.index import BadIndex, dali_index_text, parse_index

REPO = Path(__file__).resolve().parents[1]
# The module that writes the shards (tests replace its reader's read and its steps).
pack_module = importlib.import_module("fastdata.packing.writer")


def _jpeg(path, array, **save):
    Image.fromarray(array).save(path, format="JPEG", quality=95, **save)


@pytest.fixture
def photos(tmp_path):
    """Three classes of small photos: RGB JPEGs of several sizes, a PNG, a grey JPEG, an EXIF-rotated
    JPEG (orientation 6: stored landscape, shown portrait) and one larger photo."""
    rng = np.random.default_rng(0)
    root = tmp_path / "photos"
    for c in ("cat", "dog", "eel"):
        (root / c).mkdir(parents=True)
    for k in range(4):
        _jpeg(root / "cat" / f"c{k}.jpg", rng.integers(0, 256, (20 + 3 * k, 30, 3), dtype=np.uint8))
        _jpeg(root / "dog" / f"d{k}.JPEG", rng.integers(0, 256, (25, 18 + 2 * k, 3), dtype=np.uint8))
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "eel" / "png.png")
    _jpeg(root / "eel" / "grey.jpg", rng.integers(0, 256, (24, 24), dtype=np.uint8))
    # Stored 200 wide x 100 tall, top half red, bottom half blue; orientation 6 shows it rotated 90°
    # clockwise: 100 wide x 200 tall, red on the right.
    rotated = np.zeros((100, 200, 3), np.uint8)
    rotated[:50, :, 0] = 255
    rotated[50:, :, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    _jpeg(root / "eel" / "rotated.jpg", rotated, exif=exif.tobytes())
    _jpeg(root / "eel" / "zbig.jpg", rng.integers(0, 256, (120, 300, 3), dtype=np.uint8))
    return root


def _originals(root):
    from fastdata.datasets import ImageFolder

    src = ImageFolder(root)
    return src, [Path(p).read_bytes() for p in src.paths]


def _tars(out):
    return sorted(str(p) for p in Path(out).glob("*.tar"))


def test_webdataset_reads_every_original_file_and_label(photos, tmp_path):
    out = tmp_path / "out"
    report = pack(photos, out, shard_size="4KB", workers=0, progress=False)
    src, originals = _originals(photos)
    assert report.samples == len(src) and report.shards == len(_tars(out)) > 3
    assert report.index == out / "index.json"

    wds = require("webdataset")

    seen = {}
    for sample in wds.WebDataset(_tars(out), shardshuffle=False, empty_check=False):
        i = int(sample["__key__"])
        image = [k for k in sample if k not in ("__key__", "__url__", "__local_path__", "cls")]
        assert len(image) == 1
        seen[i] = (image[0], sample[image[0]], int(sample["cls"]))
    assert sorted(seen) == list(range(len(src)))
    for i, path in enumerate(src.paths):
        ext, data, label = seen[i]
        assert data == originals[i], path                      # the original bytes, not a re-encode
        assert label == src.labels[i]
        assert ext == {".JPEG": "jpg"}.get(Path(path).suffix, Path(path).suffix[1:].lower())


def test_index_offsets_point_at_each_original_and_records_the_source(photos, tmp_path):
    out = tmp_path / "out"
    pack(photos, out, shard_size="4KB", workers=0, progress=False)
    src, originals = _originals(photos)
    idx = read_index(out)
    assert len(idx) == len(src) and idx.classes == ["cat", "dog", "eel"]
    assert idx.labels.tolist() == src.labels.tolist()
    assert idx.fingerprint == src.fingerprint()
    assert idx.source["mean"] == list(src.mean) and idx.source["channels"] == 3
    for i in range(len(src)):
        shard = idx.shards[idx.shard[i]]
        blob = (out / shard.name).read_bytes()
        assert blob[idx.offset[i]: idx.offset[i] + idx.size[i]] == originals[i]
    for shard in idx.shards:
        blob = (out / shard.name).read_bytes()
        assert len(blob) == shard.size
        import hashlib

        assert hashlib.sha256(blob).hexdigest() == shard.sha256
    # The index is compact: parallel arrays, not an object per sample.
    doc = json.loads((out / "index.json").read_text())
    assert isinstance(doc["samples"]["offset"], list) and doc["num_samples"] == len(src)


def test_tar_headers_are_deterministic_and_workers_write_the_same_bytes(photos, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    pack(photos, a, shard_size="4KB", workers=0, progress=False)
    report = pack(photos, b, shard_size="4KB", workers=2, progress=False)
    assert report.written == report.shards > 1
    assert [Path(p).name for p in _tars(a)] == [Path(p).name for p in _tars(b)]
    for pa, pb in zip(_tars(a), _tars(b)):
        assert Path(pa).read_bytes() == Path(pb).read_bytes()
    assert (a / "index.json").read_bytes() == (b / "index.json").read_bytes()
    with tarfile.open(_tars(a)[0]) as tar:
        members = tar.getmembers()
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.mode == 0o444 for m in members)
    names = [m.name for m in members]
    assert names[:2] == ["00000000.cls", "00000000.jpg"]   # sorted per key, as webdataset's TarWriter does


def test_dali_idx_files_are_v1_2_and_dali_reads_the_shards_with_them(photos, tmp_path):
    out = tmp_path / "out"
    pack(photos, out, shard_size="4KB", workers=0, progress=False)
    src, originals = _originals(photos)
    first = (out / "shard-000000.idx").read_text().splitlines()
    assert first[0].split()[0] == "v1.2" and int(first[0].split()[1]) == len(first) - 1
    fields = first[1].split()
    assert len(fields) % 4 == 0 and fields[3] == "00000000.cls" and fields[7] == "00000000.jpg"
    try:
        from nvidia.dali import fn, pipeline_def
    except ImportError as e:
        skip_missing(f"DALI is not importable here: {e}")

    tars = _tars(out)
    idxs = [t[:-4] + ".idx" for t in tars]

    @pipeline_def(batch_size=len(src), num_threads=1, device_id=None)
    def pipe():
        image, label = fn.readers.webdataset(paths=tars, index_paths=idxs, ext=["jpg;png", "cls"],
                                             missing_component_behavior="error", random_shuffle=False)
        return image, label

    p = pipe()
    p.build()
    images, labels = p.run()
    got = sorted((bytes(np.asarray(images.at(k))), int(bytes(np.asarray(labels.at(k))))) for k in range(len(src)))
    assert got == sorted(zip(originals, src.labels.tolist()))


def test_an_error_mid_shard_leaves_no_complete_looking_shard_and_a_rerun_skips_finished_ones(
        photos, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_read = pack_module.SampleReader.read

    def failing_read(self, i):
        if i == 5:
            raise RuntimeError("disk on fire")
        return real_read(self, i)

    monkeypatch.setattr(pack_module.SampleReader, "read", failing_read)
    with pytest.raises(RuntimeError, match="disk on fire"):
        pack(photos, out, shard_size="2KB", workers=0, progress=False)   # one sample per shard
    assert sorted(p.name for p in out.glob("*.tar")) == [f"shard-{j:06d}.tar" for j in range(5)]
    assert not list(out.glob("*.tmp-*")) and not (out / "index.json").exists()
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}

    monkeypatch.setattr(pack_module.SampleReader, "read", real_read)
    time.sleep(0.01)
    report = pack(photos, out, shard_size="2KB", workers=0, progress=False)
    assert report.skipped == 5 and report.written == report.shards - 5
    assert all((out / name).stat().st_mtime_ns == t for name, t in mtimes.items())   # not rewritten
    assert len(read_index(out)) == report.samples


@pytest.mark.parametrize("workers", [0, 2])
def test_every_file_pack_refuses_is_named_in_one_run_and_the_other_shards_are_written(photos, tmp_path, workers):
    """A folder with several files no loader reads took one run per file (pack stopped at the first):
    now the shards without one are written, and one error names them all, listing them in OUT."""
    from fastdata.datasets import ImageFolder

    names = ImageFolder(photos).paths
    bad = [names[1], names[2], names[7], names[10]]   # shards 1, 2, 7, 10 (one sample a shard)
    for k, name in enumerate(bad):
        Path(name).write_bytes(b"not a photo %d\n" % k if k else b"\x00")
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        pack(photos, out, shard_size="2KB", workers=workers, progress=False)
    said = str(info.value)
    assert "\n" not in said and said.startswith("pack: 4 files of the source cannot go into a shard, so 4 ")
    assert all(f"'{name}' (not an image the loaders read" in said for name in bad[:3]) and "and 1 more" in said
    listed = out / "pack-refused.txt"
    assert f"all listed in '{listed}'" in said and f"the {len(names) - 4} other shard(s) are written" in said
    assert [line.split("\t")[0] for line in listed.read_text().splitlines()] == bad
    assert len(_tars(out)) == len(names) - 4 and not (out / "index.json").exists()
    assert not list(out.glob("*.tmp-*"))
    for name in bad:   # fixed in place: the re-run writes those shards and keeps the others
        _jpeg(name, np.full((20, 20, 3), 7, np.uint8))
    report = pack(photos, out, shard_size="2KB", workers=workers, progress=False)
    assert (report.written, report.skipped) == (4, len(names) - 4)
    assert len(read_index(out)) == len(names) and not listed.exists()


def test_one_refused_file_keeps_its_own_sentence(photos, tmp_path):
    from fastdata.datasets import ImageFolder

    name = ImageFolder(photos).paths[3]
    Path(name).write_bytes(b"GIF89a")
    with pytest.raises(ValueError, match=f"^pack: '{re.escape(name)}' is not an image the loaders read .*"
                                         f"then pack again; the 11 other shard\\(s\\) are written and kept$"):
        pack(photos, tmp_path / "out", shard_size="2KB", workers=0, progress=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_refused_files_with_a_newline_or_a_tab_in_their_names_keep_the_message_and_the_list_one_line_each(
        photos, tmp_path, workers):
    """Linux names may hold any byte but '/': a newline in one refused name split the message, and the
    command printed its last line only (starting inside that name: the count and the names before it
    gone); in pack-refused.txt it split the file's line and a tab moved the name/reason split."""
    from fastdata.packing import RefusedFiles

    cat = os.fsencode(photos / "cat")
    odd = [b"new\nline.jpg", b"tab\there.jpg", b"bad\xffbyte.jpg", b"zz.jpg"]
    for name in odd:
        with open(os.path.join(cat, name), "wb") as f:
            f.write(b"not a photo")
    out = tmp_path / "out"
    with pytest.raises(RefusedFiles) as info:   # from the worker processes too (pickled)
        pack(photos, out, shard_size="2KB", workers=workers, progress=False)
    said = str(info.value)
    assert "\n" not in said and "\t" not in said and said.startswith("pack: 4 files of the source cannot go ")
    assert "new\\nline.jpg' (" not in said and "new\\nline.jpg', " in said and "tab\\there.jpg'" in said
    assert sorted(os.fsencode(r.name) for r in info.value.refused) == sorted(os.path.join(cat, n) for n in odd)
    lines = (out / "pack-refused.txt").read_bytes().splitlines()
    assert len(lines) == len(odd) and all(line.count(b"\t") == 1 for line in lines)
    assert sorted(line.split(b"\t")[0] for line in lines) == sorted(
        os.path.join(cat, n).replace(b"\n", b"\\n").replace(b"\t", b"\\t") for n in odd)
    done = subprocess.run([sys.executable, "-m", "fastdata", "pack", str(photos), str(tmp_path / "cli"),
                           "--shard-size", "2KB", "--workers", "0", "--no-progress"], capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.endswith("then pack again\n"), done.stderr
    assert done.stderr.count("\n") == 1 and ": pack: 4 files of the source cannot go " in done.stderr, done.stderr


def test_a_killed_pack_leaves_only_a_temporary_file_and_a_rerun_finishes(photos, tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import time
        import importlib
        m = importlib.import_module("fastdata.packing.writer")
        real = m.SampleReader.read
        def slow(self, i):
            if i >= 3:
                time.sleep(0.3)
            return real(self, i)
        m.SampleReader.read = slow
        m.pack({str(photos)!r}, {str(out)!r}, shard_size="4KB", workers=0, progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("*.tar.tmp-*")) or not (out / "shard-000000.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "pack ended before it could be killed"
            time.sleep(0.02)
        time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    partial = list(out.glob("*.tar.tmp-*"))
    assert partial, "the shard being written stays under its temporary name"
    unfinished = partial[0].name.split(".tmp-")[0]
    assert not (out / unfinished).exists() and not (out / "index.json").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    assert "shard-000000.tar" in kept

    report = pack(photos, out, shard_size="4KB", workers=0, progress=False)
    assert report.skipped == len(kept) and report.written == report.shards - len(kept)
    assert all((out / name).stat().st_mtime_ns == t for name, t in kept.items())
    assert not list(out.glob("*.tmp-*"))
    assert len(read_index(out)) == report.samples


def test_a_damaged_finished_shard_is_rewritten(photos, tmp_path):
    out = tmp_path / "out"
    pack(photos, out, shard_size="4KB", workers=0, progress=False)
    first = out / "shard-000000.tar"
    good = first.read_bytes()
    first.write_bytes(good[:600] + b"X" + good[601:])       # same size, one byte off
    report = pack(photos, out, shard_size="4KB", workers=0, progress=False)
    assert report.written == 1 and first.read_bytes() == good


def test_a_repack_with_fewer_shards_removes_the_earlier_plans_extra_shards(photos, tmp_path):
    out = tmp_path / "out"
    many = pack(photos, out, shard_size="4KB", workers=0, progress=False).shards
    few = pack(photos, out, shard_size="1MB", workers=0, progress=False).shards
    assert few == 1 < many
    assert [Path(p).name for p in _tars(out)] == ["shard-000000.tar"]
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard-000000.idx", "shard-000000.json",
                                                     "shard-000000.tar"]
    wds = require("webdataset")

    keys = [s["__key__"] for s in wds.WebDataset(_tars(out), shardshuffle=False, empty_check=False)]
    assert sorted(keys) == [f"{i:08d}" for i in range(len(_originals(photos)[0]))]   # each sample once


def test_a_member_past_the_image_limit_is_refused_when_packing_naming_the_file(photos, tmp_path, monkeypatch):
    monkeypatch.setattr(pack_module, "MAX_MEMBER_BYTES", 20_000)
    with pytest.raises(ValueError, match=r"zbig\.jpg'\) is [\d,]+ bytes, past the image limit of 20,000 bytes"):
        pack(photos, tmp_path / "out", workers=0, progress=False)
    pack(photos, tmp_path / "out", max_side=64, workers=0, progress=False)   # re-encoded, it fits


def test_max_side_re_encodes_larger_photos_upright_and_keeps_small_ones(photos, tmp_path):
    out = tmp_path / "out"
    pack(photos, out, max_side=64, workers=0, progress=False)
    src, originals = _originals(photos)
    idx = read_index(out)
    blob = (out / idx.shards[0].name).read_bytes()
    for i, path in enumerate(src.paths):
        data = blob[idx.offset[i]: idx.offset[i] + idx.size[i]]
        name = Path(path).name
        if name in ("rotated.jpg", "zbig.jpg"):
            assert idx.ext(i) == "jpg" and len(data) < len(originals[i])
            shrunk = Image.open(io.BytesIO(data))
            assert max(shrunk.size) == 64 and shrunk.getexif().get(0x0112) in (None, 1)
            upright = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
            assert (shrunk.width / shrunk.height - upright.width / upright.height) < 0.05
            reference = np.asarray(upright.resize(shrunk.size), dtype=np.float32)
            assert np.abs(np.asarray(shrunk.convert("RGB"), dtype=np.float32) - reference).mean() < 12
            if name == "rotated.jpg":
                assert shrunk.size == (32, 64)                      # portrait, as shown
                pixels = np.asarray(shrunk.convert("RGB"), dtype=np.int32)
                assert pixels[:, -5:, 0].mean() > 200 and pixels[:, :5, 2].mean() > 200   # red right
        else:
            assert data == originals[i], name                      # small enough: original bytes


def _write_idx(path, array):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_an_mnist_root_packs_the_split_asked_for_as_png(tmp_path):
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    images, labels = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8), rng.integers(0, 10, 30, dtype=np.uint8)
    _write_idx(raw / "t10k-images-idx3-ubyte", images)
    _write_idx(raw / "t10k-labels-idx1-ubyte", labels)
    out = tmp_path / "out"
    report = pack(tmp_path / "mnist", out, split="test", shard_size="20KB", workers=0, progress=False)
    assert report.samples == 30 and report.shards > 1
    idx = read_index(out)
    assert idx.exts == ["png"] and idx.labels.tolist() == labels.tolist()
    assert idx.source["split"] == "test" and idx.source["channels"] == 1
    for i in range(30):
        blob = (out / idx.shards[idx.shard[i]].name).read_bytes()
        png = Image.open(io.BytesIO(blob[idx.offset[i]: idx.offset[i] + idx.size[i]]))
        assert png.mode == "L" and np.array_equal(np.asarray(png), images[i])
    with pytest.raises(FileNotFoundError, match="train-images"):
        pack(tmp_path / "mnist", tmp_path / "out2", split="train", progress=False)


def test_python_api_takes_arrays_and_map_style_datasets(tmp_path):
    import torch

    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (6, 10, 12, 3), dtype=np.uint8)
    labels = np.arange(6) % 3

    class Pairs(torch.utils.data.Dataset):   # a Dataset fastdata cannot convert: read through __getitem__
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.from_numpy(images[i]).permute(2, 0, 1), int(labels[i])

    for name, data in (("arrays", ArraySource(images, labels)), ("dataset", Pairs())):
        out = tmp_path / name
        pack(data, out, shard_size="1KB", workers=0, progress=False)
        idx = read_index(out)
        assert idx.labels.tolist() == labels.tolist(), name
        for i in range(6):
            blob = (out / idx.shards[idx.shard[i]].name).read_bytes()
            decoded = np.asarray(Image.open(io.BytesIO(blob[idx.offset[i]: idx.offset[i] + idx.size[i]])))
            assert np.array_equal(decoded, images[i]), name
    with pytest.raises(ValueError, match="split applies to a source given by path"):
        pack(ArraySource(images, labels), tmp_path / "x", split="test", progress=False)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_side=0), ValueError, r"^max_side must be an integer >= 1 or None, got 0"),
    (dict(max_side=True), TypeError, r"^max_side must be an integer >= 1 or None, got True"),
    (dict(workers=-1), ValueError, r"^workers must be an integer >= 0 or None, got -1"),
    (dict(workers=1.0), TypeError, r"^workers must be an integer >= 0 or None, got 1.0"),
    (dict(split="val"), ValueError, r"^unknown split 'val'; choose from \[None, 'train', 'test'\]"),
])
def test_bad_pack_arguments_are_refused_by_name_before_anything_is_written(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        pack("digits", tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_ranks_pack_disjoint_shards_and_rank_0_merges_their_parts(photos, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    pack(photos, single, shard_size="4KB", workers=0, progress=False)
    with pytest.raises(TimeoutError, match=r"ranks \[1\].*index.rank1.json"):
        pack(photos, tmp_path / "alone", shard_size="4KB", workers=0, progress=False, rank=0, world_size=2,
             timeout=0.2)
    # Rank 1 alone writes its shards and its part, then waits for rank 0's index, which never comes.
    with pytest.raises(TimeoutError, match=r"rank 1 waited 0.3 s for rank 0 to write .*index.json"):
        pack(photos, multi, shard_size="4KB", workers=0, progress=False, rank=1, world_size=2, timeout=0.3)
    assert (multi / "index.rank1.json").exists() and not (multi / "index.json").exists()
    written_by_1 = sorted(p.name for p in multi.glob("*.tar"))
    shards = len(read_index(single).shards)
    assert written_by_1 == [f"shard-{j:06d}.tar" for j in range(1, shards, 2)]
    r0 = pack(photos, multi, shard_size="4KB", workers=0, progress=False, rank=0, world_size=2, timeout=30)
    assert r0.index == multi / "index.json" and r0.written == (r0.shards + 1) // 2
    assert (multi / "index.json").read_bytes() == (single / "index.json").read_bytes()
    assert not list(multi.glob("index.rank*.json"))
    # Run again, rank 1 finds its shards done and this pack's index there: it returns at once.
    r1 = pack(photos, multi, shard_size="4KB", workers=0, progress=False, rank=1, world_size=2, timeout=0.3)
    assert r1.index is None and r1.written == 0 and (multi / "index.json").read_bytes() == \
        (single / "index.json").read_bytes()


def test_ranks_in_two_processes_at_once(photos, tmp_path):
    out = tmp_path / "out"
    code = ("import sys; from fastdata.packing import pack; "
            f"pack({str(photos)!r}, {str(out)!r}, shard_size='4KB', workers=0, progress=False, "
            "rank=int(sys.argv[1]), world_size=2, timeout=60)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=REPO) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(read_index(out)) == len(_originals(photos)[0])


def test_under_a_process_group_every_rank_returns_once_the_index_exists(photos, tmp_path):
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import importlib, os, sys, time
        import torch.distributed as dist
        from fastdata.packing import pack
        rank = int(sys.argv[1])
        m = importlib.import_module("fastdata.packing.writer")
        real = m._write_index
        def slow_write(*args):   # rank 0 takes its time: the other rank must not return before it is done
            time.sleep(1.0)
            return real(*args)
        m._write_index = slow_write
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=rank, world_size=2)
        report = pack({str(photos)!r}, {str(out)!r}, shard_size="4KB", workers=0, progress=False)
        assert os.path.exists({str(out / 'index.json')!r}), rank    # rank 1 too: it may read it next
        assert (report.index is not None) == (rank == 0)
        from fastdata import distributed as fdist
        fdist.cleanup(barrier=False)   # gloo's threads finish before exit
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=REPO) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(read_index(out)) == len(_originals(photos)[0])


# ------------------------------------------------------------------------------ index validation
@pytest.fixture
def index_doc(photos, tmp_path):
    out = tmp_path / "out"
    pack(photos, out, shard_size="10KB", workers=0, progress=False)   # several samples per shard
    doc = json.loads((out / "index.json").read_text())
    assert len(doc["shards"]) > 1 and max(s["samples"] for s in doc["shards"]) > 2
    return doc


def _parse(doc, **kw):
    return parse_index(json.dumps(doc), "https://example.org/data/index.json", **kw)


def test_a_valid_index_parses(index_doc):
    idx = _parse(index_doc)
    assert len(idx) == index_doc["num_samples"] and idx.member(0) == "00000000.jpg"


@pytest.mark.parametrize("name", ["../escape.tar", "/etc/passwd", "a\\b.tar", "", "a/../../b.tar", "c:x.tar",
                                  "./x.tar", "a//b.tar"])
def test_shard_names_that_would_leave_the_folder_are_refused_naming_them(index_doc, name):
    index_doc["shards"][1]["name"] = name
    with pytest.raises(BadIndex, match=r"index.json.*shards\[1\]\.name"):
        _parse(index_doc)


def test_not_json_is_refused_and_a_pickle_is_never_loaded(tmp_path):
    import pickle

    with pytest.raises(BadIndex, match="not JSON.*pickle"):
        parse_index(pickle.dumps({"format": "fastdata-shards"}), "idx.json")
    with pytest.raises(BadIndex, match="format is"):
        parse_index(b"{}", "idx.json")


_WHERE = "https://example.org/data/index.json"


def _index_error(data) -> str:
    """The message ``parse_index`` refuses ``data`` with: it names the index (the pack's manifest, not a
    shard) by its address, and says what writes one."""
    with pytest.raises(BadIndex) as info:
        parse_index(data, _WHERE)
    message = str(info.value)
    assert message.startswith(f"index '{_WHERE}'") and "shard index" not in message, message
    assert "python -m fastdata pack" in message, message
    return message


def test_an_index_that_is_not_json_says_what_is_wrong_and_where(index_doc):
    import re

    text = json.dumps(index_doc).encode()
    assert "is empty (0 bytes)" in _index_error(b"")
    assert "holds only whitespace (2 bytes)" in _index_error(b" \n")
    half = len(text) // 2
    cut = _index_error(text[:half])
    assert re.search(rf"is truncated: its {half} bytes end inside the JSON \(line 1 column \d+: ", cut), cut
    assert "copy it again" in cut
    assert "is not JSON" in _index_error(b'{\n  "a": 1,\n    oops}') and \
        "line 3 column 5" in _index_error(b'{\n  "a": 1,\n    oops}')
    latin = _index_error(b'{"a":\n  "caf\xe9"}')              # an e-acute in Latin-1: not UTF-8
    assert "not UTF-8" in latin and "line 2 column 7" in latin, latin
    html = _index_error(b"<!DOCTYPE html><html>sign in</html>")
    assert "looks like HTML" in html and "check the URL" in html, html


def test_a_large_file_given_as_the_index_is_not_read_whole(tmp_path, monkeypatch):
    """A video or disk image given as the index (a wrong path) was read whole into memory, GBs, before
    the JSON parser refused its first byte. Its start says it is no index; a file that starts as one is
    read up to storage.MAX_READ_BYTES, not past."""
    import tracemalloc

    from fastdata.shards import storage

    video = tmp_path / "clip.mp4"
    with open(video, "wb") as f:
        f.write(b"\x00\x00\x00\x18ftypmp42")
        f.truncate(64 * 2**20)   # sparse: 64 MiB that cost no disk
    tracemalloc.start()
    try:
        with pytest.raises(BadIndex, match="clip.mp4' is not JSON"):
            read_index(video)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
    monkeypatch.setattr(storage, "MAX_READ_BYTES", 10_000)
    (tmp_path / "big.json").write_bytes(b"{" + b" " * 20_000 + b"}")
    with pytest.raises(storage.StorageError, match="larger than 10,000 bytes"):
        read_index(tmp_path / "big.json")


def test_a_large_json_file_given_as_the_index_is_read_whole_to_say_what_it_is(index_doc, tmp_path):
    """Only a file that is no JSON is refused from its first 4 KB: a JSON array's head was called
    "truncated: an interrupted copy or download" (a labels file given by a wrong path is "not an
    object"), and an index saved as UTF-16 or UTF-32 (which json reads; no "{" byte first) failed so."""
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps([{"file": f"img{i}.jpg", "label": i % 10} for i in range(300)]))
    with pytest.raises(BadIndex, match="labels.json': must be a JSON object, got list") as info:
        read_index(labels)
    assert "truncated" not in str(info.value)
    text = json.dumps(index_doc, indent=40)
    assert len(text) > 4096
    for encoding in ("utf-16", "utf-16-be", "utf-32"):
        (tmp_path / "out" / f"{encoding}.json").write_bytes(text.encode(encoding))
        assert len(read_index(tmp_path / "out" / f"{encoding}.json")) == len(read_index(tmp_path / "out"))


@pytest.mark.parametrize("edit, found", [
    (lambda d: d.update(classes="cat"), "classes must be a non-empty list of class names, got str 'cat'"),
    (lambda d: d.update(shards={}), "shards must be a list of shard records, got dict {}"),
    (lambda d: d.update(fingerprint=7), "fingerprint must be a string, got int 7"),
    (lambda d: d.update(samples=[]), "samples must be an object of parallel arrays, got list []"),
    (lambda d: d.pop("samples"), "field 'samples' is missing"),
    (lambda d: d.update(format="wids-shard-index-v1"),
     "format is 'wids-shard-index-v1', expected 'fastdata-shards'"),
])
def test_an_index_of_another_schema_names_the_field_expected_and_found(index_doc, edit, found):
    edit(index_doc)
    message = _index_error(json.dumps(index_doc))
    assert found in message, message


@pytest.mark.parametrize("version, why", [(2, "newer fastdata"), (0, "no fastdata writes"), ("1", "no fastdata")])
def test_an_index_of_another_version_says_which_versions_this_fastdata_reads(index_doc, version, why):
    index_doc["version"] = version
    message = _index_error(json.dumps(index_doc))
    assert f"version is {version!r}" in message and "this fastdata reads version 1" in message, message
    assert why in message, message


def test_read_index_of_a_folder_without_one_names_the_missing_index(tmp_path):
    from fastdata.shards.index import IndexNotFound

    where = tmp_path / "index.json"
    with pytest.raises(IndexNotFound) as info:
        read_index(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError) and "shard" not in message.split(":")[0], message
    assert message.startswith(f"cannot read the index at {where}: FileNotFoundError: [Errno 2]"), message
    assert "it is missing" in message and "python -m fastdata pack" in message, message
    where.mkdir()                                   # a folder where the file should be: unreadable
    with pytest.raises(OSError) as info:
        read_index(tmp_path)
    message = str(info.value)
    assert message.startswith(f"cannot read the index at {where}: IsADirectoryError: [Errno 21]"), message
    assert "python -m fastdata pack" in message, message


def _set(doc, field, i, value):
    doc["samples"][field][i] = value


@pytest.mark.parametrize("edit, match", [
    (lambda d: _set(d, "offset", 1, -512), r"sample 1 \(samples.offset\)"),
    (lambda d: _set(d, "offset", 1, d["samples"]["offset"][1] + 7), r"sample 1 \(samples.offset\).*multiple of 512"),
    (lambda d: _set(d, "offset", 0, 0), r"sample 0 \(samples.offset\)"),
    (lambda d: _set(d, "offset", 2, d["shards"][d["samples"]["shard"][2]]["size"]),
     r"sample 2 \(samples.offset/size\).*past the end"),
    (lambda d: _set(d, "size", 1, -3), r"sample 1 \(samples.size\)"),
    (lambda d: _set(d, "size", 3, 10**9), r"sample 3 \(samples.size\)"),
    (lambda d: _set(d, "label", 0, 3), r"sample 0 \(samples.label\).*outside \[0, 3\)"),
    (lambda d: _set(d, "offset", 4, "12"), r"samples.offset must hold 64-bit integers; entry 4"),
    (lambda d: d.update(num_samples=d["num_samples"] + 1), "num_samples"),
    (lambda d: d["shards"][0].update(samples=d["shards"][0]["samples"] + 1), r"samples"),
    (lambda d: d["samples"]["label"].pop(), r"samples.label has \d+ entries"),
    (lambda d: d["shards"][0].update(size=-512), r"shards\[0\].size"),
    (lambda d: d["shards"][0].update(sha256="zz"), r"shards\[0\].sha256"),
    (lambda d: d["shards"][1].update(name=d["shards"][0]["name"]), "appears twice"),
    (lambda d: d.update(version=99), "version is 99"),
])
def test_lying_fields_are_refused_naming_the_index_and_the_field(index_doc, edit, match):
    edit(index_doc)
    with pytest.raises(BadIndex, match=r"^index 'https://example.org/data/index.json'") as info:
        _parse(index_doc)
    assert info.match(match)


def test_members_overlapping_another_sample_are_refused(index_doc):
    # Two samples in one shard: the second's data moved onto the first's.
    shard = index_doc["samples"]["shard"]
    i = next(k for k in range(1, len(shard)) if shard[k] == shard[k - 1])
    index_doc["samples"]["offset"][i] = index_doc["samples"]["offset"][i - 1]
    with pytest.raises(BadIndex, match=rf"sample ({i}|{i - 1}) \(samples.offset\).*overlaps"):
        _parse(index_doc)


def test_a_member_past_the_image_size_limit_is_refused(index_doc):
    biggest = max(index_doc["samples"]["size"])
    _parse(index_doc, max_member_bytes=biggest)
    with pytest.raises(BadIndex, match="past the image limit"):
        _parse(index_doc, max_member_bytes=biggest - 1)


def test_dali_index_text_refuses_whitespace_in_member_names():
    assert dali_index_text([[("cls", 512, 1, "0.cls"), ("jpg", 1536, 9, "0.jpg")]]) == \
        "v1.2 1\ncls 512 1 0.cls jpg 1536 9 0.jpg\n"
    with pytest.raises(ValueError, match="whitespace"):
        dali_index_text([[("jpg", 512, 9, "a b.jpg")]])


def test_read_index_takes_the_folder_or_the_file(index_doc, tmp_path):
    assert len(read_index(tmp_path / "out")) == len(read_index(tmp_path / "out" / shard_index.INDEX_NAME))


# ---------------------------------------------------------------------------------------- command line
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fastdata", "pack", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_cli_packs_a_folder_end_to_end(photos, tmp_path):
    out = tmp_path / "out"
    run = _cli(photos, out, "--shard-size", "4KB", "--workers", "1", "--no-progress")
    assert run.returncode == 0, run.stderr
    assert "index.json" in run.stdout
    assert len(read_index(out)) == len(_originals(photos)[0])


@pytest.mark.parametrize("args, rc, match", [
    (["--shard-size", "12XB"], 2, "argument --shard-size: shard size '12XB' is not a size"),
    (["--max-side", "0"], 2, "argument --max-side: must be an integer >= 1"),
    (["--split", "val"], 2, "argument --split: invalid choice"),
    (["--split", "test"], 1, "--split test applies to MNIST and digits"),
    (["--timeout", "-1"], 2, "argument --timeout: "),
])
def test_cli_bad_arguments_are_one_line_errors(photos, tmp_path, args, rc, match):
    run = _cli(photos, tmp_path / "out", *args)
    assert run.returncode == rc
    last = run.stderr.strip().splitlines()
    assert match in last[-1] and "Traceback" not in run.stderr


def test_cli_reads_a_pack_of_shards_as_its_source(photos, tmp_path):
    """pack and bench take a pack (a folder holding index.json, or a URL of one) as SOURCE, as
    Shards(...) does in Python: resizing or resharding a pack from the command line said "image folder
    ... has no class sub-folders"."""
    from fastdata.datasets import ImageFolder, Shards, spec

    first = tmp_path / "first"
    pack(ImageFolder(photos), first, shard_size="4KB", workers=0, progress=False)
    assert isinstance(spec.open_source(first), Shards) and isinstance(spec.open_source(f"file://{first}"), Shards)
    with pytest.raises(ValueError, match="is a pack of shards"):
        spec.open_source(first, split="test")
    run = _cli(first, tmp_path / "small", "--max-side", "16", "--workers", "1", "--no-progress")
    assert run.returncode == 0, run.stderr
    small = Shards(tmp_path / "small")
    assert small.labels.tolist() == ImageFolder(photos).labels.tolist()
    assert max(max(Image.open(io.BytesIO(small.read(i))).size) for i in range(len(small))) == 16


def test_cli_missing_source_and_a_file_as_out_are_one_line_errors(photos, tmp_path):
    run = _cli(tmp_path / "nowhere", tmp_path / "out")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: fastdata pack: SOURCE")
    (tmp_path / "file").write_text("x")
    run = _cli(photos, tmp_path / "file")
    assert run.returncode == 2 and "argument OUT: " in run.stderr and "is a file" in run.stderr


# ------------------------------------------------------------------------ --max-side and image modes
def _gradient(mode: str, width: int = 120, height: int = 90) -> Image.Image:
    """A smooth picture (JPEG's loss stays small) in ``mode``, values spanning the mode's range."""
    yy, xx = np.mgrid[0:height, 0:width]
    grad = xx / (width - 1) * 0.7 + yy / (height - 1) * 0.3
    rgb = np.stack([grad * 255, (1 - grad) * 255, np.full_like(grad, 128.0)], -1).astype(np.uint8)
    if mode == "I;16":
        return Image.fromarray((grad * 65535).astype(np.uint16))
    if mode == "I":
        return Image.fromarray((grad * 65535).astype(np.int32))
    if mode == "F":
        return Image.fromarray((grad * 255).astype(np.float32))
    if mode == "RGBA":
        return Image.fromarray(np.dstack([rgb, np.full((height, width), 90, np.uint8)]))
    return Image.fromarray(rgb).convert(mode)      # P, CMYK, L, LA


@pytest.mark.parametrize("mode, ext", [("I;16", "png"), ("I", "tiff"), ("F", "tiff"), ("P", "png"),
                                       ("RGBA", "png"), ("LA", "png"), ("CMYK", "jpg"), ("L", "png")])
def test_max_side_gives_the_pixels_the_loaders_give_for_every_mode(tmp_path, mode, ext):
    from fastdata import Augmentation
    from fastdata.images.photo import load_photo

    folder = tmp_path / "photos" / "only"
    folder.mkdir(parents=True)
    path = folder / f"image.{ext}"
    _gradient(mode).save(path)
    assert Image.open(path).mode == mode
    out = tmp_path / "out"
    pack(tmp_path / "photos", out, max_side=48, workers=0, progress=False)
    idx = read_index(out)
    blob = (out / idx.shards[0].name).read_bytes()
    small = blob[idx.offset[0]: idx.offset[0] + idx.size[0]]
    assert idx.ext(0) == "jpg" and max(Image.open(io.BytesIO(small)).size) == 48
    aug = Augmentation(crop="center", size=32)
    want = load_photo(path.read_bytes(), str(path), aug, np.random.default_rng(0)).astype(np.float32)
    got = load_photo(small, "small.jpg", aug, np.random.default_rng(0)).astype(np.float32)
    assert np.abs(want - got).mean() < 3 and np.abs(want - got).max() < 16, (want.mean(), got.mean())


# ----------------------------------------------------------------------------------------- torchrun
TORCHRUN_PACK = textwrap.dedent("""
    import importlib, os, sys, time
    from fastdata.__main__ import main
    photos, out = sys.argv[1], sys.argv[2]
    m = importlib.import_module("fastdata.packing.writer")
    real = m._write_index
    def slow_write(*args):   # rank 0 takes its time: no rank may return before the index exists
        time.sleep(1.5)
        return real(*args)
    m._write_index = slow_write
    rc = main(["pack", photos, out, "--shard-size", "4KB", "--workers", "0", "--no-progress", "--timeout", "120"])
    import torch.distributed as dist
    assert not dist.is_initialized()                    # torchrun starts no process group
    assert os.path.exists(os.path.join(out, "index.json")), f"rank {os.environ['RANK']} returned before the index"
    sys.exit(rc)
""")


def test_torchrun_pack_without_a_process_group_returns_on_every_rank_after_the_index(photos, tmp_path):
    script = tmp_path / "pack_under_torchrun.py"
    script.write_text(TORCHRUN_PACK)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(photos), str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(read_index(out)) == len(_originals(photos)[0])
    assert not list(out.glob("index.rank*.json"))


# Under torchrun each rank refuses the samples named in REFUSE (a comma list of sample indices) as a
# file no loader reads; rank 0 reads slowly, so rank 1 meets its refusals first: torchrun used to stop
# rank 0 there, and the run named rank 1's files only.
TORCHRUN_REFUSING = textwrap.dedent("""
    import os, sys, time
    from fastdata.__main__ import main
    from fastdata.packing import reader
    photos, out = sys.argv[1], sys.argv[2]
    refuse = {int(i) for i in os.environ.get("REFUSE", "").split(",") if i}
    real = reader.SampleReader.read
    def read(self, i):
        if os.environ["RANK"] == "0":
            time.sleep(0.3)
        if i in refuse:
            name = self.source.sample_name(i)
            raise reader.RefusedFile(f"pack: '{name}' is refused by this test", name, "refused by this test")
        return real(self, i)
    reader.SampleReader.read = read
    sys.exit(main(["pack", photos, out, "--shard-size", "2KB", "--workers", "0", "--no-progress", "--timeout", "120"]))
""")


def _torchrun(script, *args, **env_vars):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_vars}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_torchrun_pack_names_every_ranks_refused_files_in_one_run_and_a_rerun_finishes(photos, tmp_path):
    """One rank's refusal ended the torchrun job (torchrun stopped the other ranks where they were), so a
    run named only the refused files of the ranks that finished first. Now every rank writes its shards,
    rank 0 lists every rank's refused files in one pack-refused.txt and publishes no index, and every
    rank ends with the same line; the next run, after the files are fixed, is not misled by that list
    or rank 0's word of the failure (the same plan: only REFUSE changes)."""
    from fastdata.datasets import ImageFolder

    names = ImageFolder(photos).paths
    script = tmp_path / "refusing.py"
    script.write_text(TORCHRUN_REFUSING)
    out = tmp_path / "out"
    run = _torchrun(script, photos, out, REFUSE="1,2,7,10")   # shards 2, 10 are rank 0's; 1, 7 rank 1's
    said = [line for line in run.stderr.splitlines() if line.startswith("error: fastdata pack")]
    assert run.returncode != 0 and len(said) == 2 and said[0] == said[1], run.stdout[-3000:] + run.stderr[-3000:]
    listed = out / "pack-refused.txt"
    assert ": pack: 4 files of the source cannot go into a shard, so 4 shard(s) are not written: " in said[0]
    assert all(f"'{names[i]}'" in said[0] for i in (1, 2, 7)) and ", and 1 more (all listed in " \
        f"'{listed}'); the {len(names) - 4} other shard(s) are written and kept; " in said[0]
    assert [line.split("\t") for line in listed.read_text().splitlines()] == \
        [[names[i], "refused by this test"] for i in (1, 2, 7, 10)]
    assert len(_tars(out)) == len(names) - 4 and not (out / "index.json").exists()
    assert not list(out.glob("index.rank*.json")) and not list(out.glob("pack-refused.rank*"))
    run = _torchrun(script, photos, out)   # fixed
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(f"{len(names)} samples in {len(names)} shards (2 written, 4 kept)") == 2, run.stdout
    assert len(read_index(out)) == len(names) and not listed.exists() and not (out / "pack-refused.json").exists()
    assert not list(out.glob("index.rank*.json"))


# TORCHRUN_REFUSING, and: CRASH_RANK1 stops rank 1 right after it wrote its part (a Ctrl-C, a crash: the
# part stays); LATE_RANK1 makes rank 1's first read wait that many seconds (it writes its part late).
TORCHRUN_STOPPED = textwrap.dedent("""
    import os, sys, time
    from fastdata.__main__ import main
    from fastdata.packing import reader, writer
    photos, out = sys.argv[1], sys.argv[2]
    refuse = {int(i) for i in os.environ.get("REFUSE", "").split(",") if i}
    late = [float(os.environ.get("LATE_RANK1", "0"))] if os.environ["RANK"] == "1" else []
    real = reader.SampleReader.read
    def read(self, i):
        if os.environ["RANK"] == "0":
            time.sleep(0.3)
        elif late:
            time.sleep(late.pop())
        if i in refuse:
            name = self.source.sample_name(i)
            raise reader.RefusedFile(f"pack: '{name}' is refused by this test", name, "refused by this test")
        return real(self, i)
    reader.SampleReader.read = read
    if os.environ["RANK"] == "1" and os.environ.get("CRASH_RANK1"):
        writer.barrier = lambda: os._exit(3)
    sys.exit(main(["pack", photos, out, "--shard-size", "2KB", "--workers", "0", "--no-progress", "--timeout", "120"]))
""")


def test_torchrun_pack_after_a_stopped_run_does_not_merge_that_runs_part_and_its_refusals(photos, tmp_path):
    """A run stopped after rank 1 wrote its part (refusing a file) left that part; the next run, the file
    fixed, had rank 0 merge it as this run's when rank 1 was slower to write its own: the fixed file was
    named again, no index was written, and rank 1 never learnt why (its part of this run was not the one
    merged). Each rank now removes its own part of an earlier run as it starts."""
    from fastdata.datasets import ImageFolder

    names = ImageFolder(photos).paths
    script = tmp_path / "stopped.py"
    script.write_text(TORCHRUN_STOPPED)
    out = tmp_path / "out"
    run = _torchrun(script, photos, out, REFUSE="1", CRASH_RANK1="1")   # sample 1: rank 1's shard 1
    assert run.returncode != 0 and (out / "index.rank1.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    assert "refused by this test" in (out / "index.rank1.json").read_text()
    run = _torchrun(script, photos, out, LATE_RANK1="4")   # fixed; rank 1 writes its part last
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(read_index(out)) == len(names) and not (out / "pack-refused.json").exists()
    assert not list(out.glob("index.rank*.json"))


def test_under_a_process_group_every_rank_raises_every_ranks_refused_files(photos, tmp_path):
    from fastdata.datasets import ImageFolder

    names = ImageFolder(photos).paths
    for i in (2, 3):   # one shard of each rank
        Path(names[i]).write_bytes(b"not a photo")
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import json, sys
        import torch.distributed as dist
        from fastdata.packing import RefusedFiles, pack
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=rank, world_size=2)
        try:
            pack({str(photos)!r}, {str(out)!r}, shard_size="2KB", workers=0, progress=False, timeout=60)
        except RefusedFiles as e:
            print(json.dumps([str(e), [r.name for r in e.refused], e.shards]))
        from fastdata import distributed as fdist
        fdist.cleanup(barrier=False)   # gloo's threads finish before exit
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    said = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and said[0] == said[1]
    message, refused, shards = said[0]
    assert refused == [names[2], names[3]] and shards == ["shard-000002.tar", "shard-000003.tar"]
    assert message.startswith("pack: 2 files of the source cannot go into a shard, so 2 shard(s) are not written")
    assert [line.split("\t")[0] for line in (out / "pack-refused.txt").read_text().splitlines()] == refused
    assert not (out / "index.json").exists() and not list(out.glob("index.rank*.json"))


def test_a_repack_of_other_data_removes_the_old_index_before_any_shard_is_rewritten(photos, tmp_path, monkeypatch):
    out = tmp_path / "out"
    pack(photos, out, shard_size="4KB", workers=0, progress=False)
    seen = []
    real = pack_module.write_shard

    def spy(reader, plan, *args, **kw):
        seen.append((out / "index.json").exists())
        return real(reader, plan, *args, **kw)

    monkeypatch.setattr(pack_module, "write_shard", spy)
    pack(photos, out, shard_size="4KB", max_side=20, workers=0, progress=False)   # another plan
    assert seen and not any(seen)
    doc = json.loads((out / "index.json").read_text())
    assert doc["source"]["max_side"] == 20 and len(doc["plan"]) == 64
    seen.clear()
    pack(photos, out, shard_size="4KB", max_side=20, workers=0, progress=False)   # the same: nothing to write
    assert seen == [] and json.loads((out / "index.json").read_text()) == doc


# ------------------------------------------------------------------ any source, through its interface
def _loader_batches(source):
    from fastdata import Augmentation, make_loader

    loader = make_loader(source, "torch", batch_size=4, device="cpu", train=False, num_workers=0,
                         augment=Augmentation(crop="center", size=16))
    return [(x.numpy(), y.numpy()) for x, y in loader]


def _same_batches(a, b):
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_allclose(xa, xb, atol=1e-6)


def test_a_source_of_your_own_packs_through_read_stamped_and_reads_back_the_same(photos, tmp_path):
    """Issue 32: the docs' own example source (``ZipImages``, examples/custom_source.py) was refused
    ("pack cannot read ZipImages"): pack read files through ``.paths``, not the Source interface."""
    example = load_example("custom_source")
    ZipImages, zip_folder = example.ZipImages, example.zip_folder
    from fastdata.datasets import Shards

    source = ZipImages(zip_folder(photos, tmp_path / "photos.zip"))
    out = tmp_path / "out"
    pack(source, out, shard_size="4KB", workers=0, progress=False)
    shards = Shards(out)
    assert shards.classes == source.classes and shards.labels.tolist() == source.labels.tolist()
    assert [shards.read(i) for i in range(len(source))] == [source.read(i) for i in range(len(source))]
    assert read_index(out).exts == ["jpg", "png"] and read_index(out).fingerprint == source.fingerprint()
    _same_batches(_loader_batches(shards), _loader_batches(source))


def test_shards_repack_to_another_shard_size_and_max_side(photos, tmp_path):
    """Re-packing shards (to reshard or to resize) reads them through the same interface."""
    from fastdata.datasets import ImageFolder, Shards

    first = tmp_path / "first"
    pack(photos, first, shard_size="4KB", workers=0, progress=False)
    again = tmp_path / "again"
    report = pack(Shards(first), again, shard_size="1MB", workers=0, progress=False)
    assert report.shards == 1 < len(read_index(first).shards)
    resharded = Shards(again)
    assert resharded.classes == ["cat", "dog", "eel"]
    assert [resharded.read(i) for i in range(len(resharded))] == _originals(photos)[1]
    _same_batches(_loader_batches(resharded), _loader_batches(ImageFolder(photos)))
    small = tmp_path / "small"
    pack(Shards(first), small, max_side=64, workers=2, progress=False)
    idx = read_index(small)
    assert idx.labels.tolist() == ImageFolder(photos).labels.tolist()
    assert max(max(Image.open(io.BytesIO(Shards(small).read(i))).size) for i in range(len(idx))) == 64


def test_open_source_reads_digits_and_names_a_missing_folder(tmp_path):
    """The one source-name parser pack and bench share (test_cli holds that bench's is this one)."""
    from fastdata.datasets import spec

    assert len(spec.open_source("digits", digits=100)) == 100
    assert len(spec.open_source("digits", split="test")) == 10_000
    with pytest.raises(FileNotFoundError, match="neither 'digits' nor a folder nor a URL"):
        spec.open_source(tmp_path / "nowhere")


# ------------------------------------------------------------------ planning reads nothing it can stat
def _counting(cls, *args, hide_stamp=False):
    """A ``cls`` source that counts the reads of each sample (by name) and of ``stamp``, the cheap hook;
    with ``hide_stamp``, a source without that hook (only reading tells the sizes)."""
    import collections
    import threading

    class Counting(cls):
        def read_stamped(self, i):
            with lock:
                reads[self.sample_name(i)] += 1
            return super().read_stamped(i)

        def stamp(self, i):
            with lock:
                stamps[self.sample_name(i)] += 1
            return None if hide_stamp else super().stamp(i)

    reads, stamps, lock = collections.Counter(), collections.Counter(), threading.Lock()
    source = Counting(*args)
    return source, reads, stamps


def test_pack_reads_each_file_once_and_a_rerun_over_a_finished_pack_reads_none(photos, tmp_path):
    """pack read every file twice (once through read_stamped to plan the shards, again to write them),
    and a re-run after an interruption read the whole source to plan. Now: a stat to plan."""
    from fastdata.datasets import ImageFolder

    out = tmp_path / "out"
    source, reads, stamps = _counting(ImageFolder, photos)
    names = [source.sample_name(i) for i in range(len(source))]
    first = pack(source, out, shard_size="4KB", workers=0, progress=False)
    assert first.shards > 3 and reads == {n: 1 for n in names} and stamps == {n: 1 for n in names}

    reads.clear()
    again = pack(source, out, shard_size="4KB", workers=0, progress=False)
    assert again.skipped == again.shards and again.written == 0
    assert not reads                                                       # a stat per file, no read

    # A file replaced in place (another size and time) is still seen: its shard alone is rewritten.
    changed = Path(names[1])
    _jpeg(changed, np.full((40, 30, 3), 7, np.uint8))
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = pack(source, out, shard_size="4KB", workers=0, progress=False)
    assert third.written == 1 and names[1] in reads and set(reads) < set(names)
    from fastdata.datasets import Shards

    assert Shards(out).read(1) == changed.read_bytes()


def test_a_moved_source_keeps_its_finished_shards(photos, tmp_path):
    """A finished shard's identity is what it holds (names below the source's folder, sizes, times),
    not where the source lies: the identity used the full path, so moving the photos to a new disk
    (mv keeps times) re-packed everything. A file changed after the move is still seen."""
    from fastdata.datasets import ImageFolder

    out = tmp_path / "out"
    first = pack(ImageFolder(photos), out, shard_size="4KB", workers=0, progress=False)
    moved = tmp_path / "elsewhere" / "photos"
    moved.parent.mkdir()
    os.rename(photos, moved)
    source, reads, _ = _counting(ImageFolder, moved)
    again = pack(source, out, shard_size="4KB", workers=0, progress=False)
    assert again.shards == first.shards and again.skipped == again.shards and not reads
    changed = moved / "cat" / "c2.jpg"
    _jpeg(changed, np.full((40, 30, 3), 7, np.uint8))
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = pack(source, out, shard_size="4KB", workers=0, progress=False)
    assert third.written == 1 and str(changed) in reads


def test_names_are_taken_below_the_folder_they_share():
    from fastdata.packing.reader import _below_common_folder as below

    assert below(["/d/train/cat/a.jpg", "/d/train/cow/b.jpg", "/d/train/cat/c.jpg"]) == \
        ["cat/a.jpg", "cow/b.jpg", "cat/c.jpg"]                        # "/d/train/c" cut back to its folder
    assert below(["/d/x/only.jpg"]) == ["only.jpg"]
    assert below(["https://h/p/shard-0.tar:k1.jpg", "https://h/p/shard-1.tar:k2.jpg"]) == \
        ["shard-0.tar:k1.jpg", "shard-1.tar:k2.jpg"]
    assert below(["a.jpg", "b/c.jpg"]) == ["a.jpg", "b/c.jpg"] and below([]) == []


def test_a_datasets_fingerprint_is_taken_once_per_pack(tmp_path, monkeypatch):
    """A wrapped Dataset's shards are identified by its fingerprint (a digest of all its targets),
    computed once for the pack, not once for each shard."""
    from fastdata.datasets import DatasetSource
    from fastdata.packing import reader as packing_reader

    class Pixels(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return np.full((8, 8, 3), i, np.uint8), i % 4

    calls = []
    original = DatasetSource.fingerprint
    monkeypatch.setattr(DatasetSource, "fingerprint", lambda self: calls.append(1) or original(self))
    source = DatasetSource(Pixels())
    plans = packing_reader.SampleReader(source, None)
    _, ident = plans.plan_inputs()
    ids = {plans.shard_identity(a, a + 10, ident) for a in range(0, 40, 10)}
    assert len(ids) == 4 and len(calls) == 1


def test_a_source_without_stamp_is_read_to_plan_and_packs_the_same(photos, tmp_path):
    from fastdata.datasets import ImageFolder

    source, reads, _ = _counting(ImageFolder, photos, hide_stamp=True)
    pack(source, tmp_path / "read", shard_size="4KB", workers=0, progress=False)
    assert set(reads.values()) == {2}                                      # to plan, then to write
    pack(ImageFolder(photos), tmp_path / "stat", shard_size="4KB", workers=0, progress=False)
    assert [p.read_bytes() for p in sorted((tmp_path / "read").glob("*.tar"))] == \
        [p.read_bytes() for p in sorted((tmp_path / "stat").glob("*.tar"))]


def test_a_zip_and_a_pack_are_planned_from_their_directory_and_index(photos, tmp_path):
    """ZipImages (its central directory) and Shards (its index: sizes and shard digests) answer
    ``stamp``: resharding or packing them reads each image once."""
    from fastdata.datasets import Shards

    example = load_example("custom_source")
    ZipImages, zip_folder = example.ZipImages, example.zip_folder
    archive = zip_folder(photos, tmp_path / "photos.zip")
    for cls, arg in ((ZipImages, archive), (Shards, tmp_path / "first")):
        if cls is Shards:
            pack(photos, arg, shard_size="4KB", workers=0, progress=False)
        source, reads, _ = _counting(cls, arg)
        if cls is ZipImages:   # the directory's stamp is the one reading gives (a backend's header cache)
            assert [source.stamp(i) for i in range(3)] == [(len(d), s) for d, s in map(source.read_stamped, range(3))]
            reads.clear()
        pack(source, tmp_path / f"from-{cls.__name__}", shard_size="1MB", workers=0, progress=False)
        assert set(reads.values()) == {1} and len(reads) == len(source), cls.__name__


def test_max_side_turns_a_photo_as_the_loaders_do_whatever_its_exif_block_holds(tmp_path):
    """pack --max-side turned photos with ImageOps.exif_transpose, which also rewrites the copy's EXIF
    block: a valid photo whose block holds a tag Pillow cannot write back (a Make stored as a RATIONAL, as
    old cameras write) stopped pack with an AttributeError naming no file; and it turned a PNG by the
    orientation in ImageMagick's 'Raw profile type exif' text chunk, which no loader does. It now turns
    by the loaders' reading (exif_orientation, decode_upright): the shard holds what they show."""
    from test_qa_photos import _exif_with_a_mistyped_tag, _raw_profile_exif

    (tmp_path / "photos" / "a").mkdir(parents=True)
    yy, xx = np.mgrid[0:120, 0:180]   # smooth, and no two corners alike: a turn shows
    scene = Image.fromarray(np.stack([xx * 255 // 179, yy * 255 // 119, (xx + yy) * 255 // 298], -1).astype(np.uint8))
    scene.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "photos" / "a" / "mistyped.jpg", quality=95,
                                                    exif=_exif_with_a_mistyped_tag(6))
    scene.save(tmp_path / "photos" / "a" / "raw.png", pnginfo=_raw_profile_exif(6))
    out = tmp_path / "out"
    pack(tmp_path / "photos", out, max_side=90, workers=0, progress=False)
    idx = read_index(out)
    blob = (out / idx.shards[0].name).read_bytes()
    for i in range(2):
        shrunk = Image.open(io.BytesIO(blob[idx.offset[i]: idx.offset[i] + idx.size[i]]))
        assert shrunk.size == (90, 60)   # landscape, as every loader shows both
        reference = np.asarray(scene.resize(shrunk.size), dtype=np.float32)
        assert np.abs(np.asarray(shrunk.convert("RGB"), dtype=np.float32) - reference).mean() < 12
