"""Shard identity end to end: the index records each shard's size and sha256, readers refuse a shard
that is not what its index says (checked when the shard is opened or downloaded), the cache keys shards
by digest, and ``pack`` never leaves an index that describes other shards. Remote cases run against
the tests' HTTP server and moto's S3 server on 127.0.0.1. Also: subsets stream window by window, and
packing never changes what a loader yields (channels, pixels, labels, statistics)."""
from __future__ import annotations

import importlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import BACKENDS
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, Shards
from fastdata.errors import DecodeError
from shard_servers import http_server, s3_server

pack_module = importlib.import_module("fastdata.packing.writer")
pack = pack_module.pack
NONE = Augmentation(crop="center", size=16)
PER_SAMPLE = 4096          # a 24x32 BMP (2,358 bytes) in a tar: header, padded data, the .cls member
SHARD = 6 * PER_SAMPLE     # 6 samples a shard


def _versions(root: Path, n: int = 48, classes: int = 3):
    """Two versions of one data set, as a re-pack meets them: the same file names and sizes (BMPs of one
    size), other pixels and other labels. Returns (source A, source B, A's bytes, B's bytes)."""
    out = []
    for version in (0, 1):
        rng = np.random.default_rng(version)
        samples, blobs = [], []
        for i in range(n):
            path = root / f"v{version}" / f"img{i:03d}.bmp"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(path)
            samples.append((path, (i + version) % classes))
            blobs.append(path.read_bytes())
        source = ImageFolder.from_samples(samples, [f"c{k}" for k in range(classes)], root=root / f"v{version}")
        out.append((source, blobs))
    sizes = {len(b) for _, blobs in out for b in blobs}
    assert len(sizes) == 1, "the two versions must lay out the same shards"
    (a, a_bytes), (b, b_bytes) = out
    return a, b, a_bytes, b_bytes


def _read_all(shards):
    """(bytes or None, label) per sample: None where the read is a DecodeError."""
    got = []
    for i in range(len(shards)):
        try:
            got.append((shards.read(i), int(shards.labels[i])))
        except DecodeError:
            got.append((None, int(shards.labels[i])))
    return got


def test_an_interrupted_repack_leaves_no_index_and_a_reader_of_the_old_one_refuses_new_shards(
        tmp_path, monkeypatch):
    a, b, a_bytes, _ = _versions(tmp_path)
    out = tmp_path / "out"
    pack(a, out, shard_size=SHARD, workers=0, progress=False)
    assert _read_all(Shards(out, cache_dir=tmp_path / "verdicts")) == [(a_bytes[i], int(a.labels[i]))
                                                                       for i in range(48)]
    old = Shards(out, cache_dir=tmp_path / "verdicts")   # holds version A's index, no shard open yet

    real = pack_module.SampleReader.read

    def dies_halfway(self, i):
        if i == 24:
            raise RuntimeError("killed")
        return real(self, i)

    monkeypatch.setattr(pack_module.SampleReader, "read", dies_halfway)
    with pytest.raises(RuntimeError, match="killed"):
        pack(b, out, shard_size=SHARD, workers=0, progress=False)
    # The first 4 shards are version B's now: no index may say they are A's.
    assert not (out / "index.json").exists()
    with pytest.raises(FileNotFoundError, match="index.json"):
        Shards(out)
    # A reader opened before holds A's index: B's shards are refused (never A's labels on B's pixels).
    got = _read_all(old)
    assert [g[0] is None for g in got] == [i < 24 for i in range(48)]
    assert got[24:] == [(a_bytes[i], int(a.labels[i])) for i in range(24, 48)]
    loader = make_loader(old, "torch", batch_size=8, device="cpu", augment=NONE, num_workers=0,
                         on_error="skip", train=False)
    with pytest.warns(RuntimeWarning, match="skipped 24 undecodable"):
        assert sum(len(y) for _, y in loader) == 24


def test_a_local_shard_rewritten_in_place_is_hashed_again_and_refused(tmp_path, monkeypatch):
    a, b, _, _ = _versions(tmp_path)
    out, other = tmp_path / "out", tmp_path / "other"
    pack(a, out, shard_size=SHARD, workers=0, progress=False)
    pack(b, other, shard_size=SHARD, workers=0, progress=False)
    storage = importlib.import_module("fastdata.shards.storage")
    hashed = []
    real = storage.file_sha256
    monkeypatch.setattr(storage, "file_sha256", lambda *args: hashed.append(args) or real(*args))
    first = Shards(out, cache_dir=tmp_path / "verdicts")
    first.read(0)
    assert len(hashed) == 1
    Shards(out, cache_dir=tmp_path / "verdicts").read(1)     # another reader: the verdict is on disk
    assert len(hashed) == 1
    tar = out / "shard-000000.tar"
    tar.write_bytes((other / "shard-000000.tar").read_bytes())   # same size, other content, new mtime
    with pytest.raises(DecodeError, match=r"shard-000000\.tar:00000002\.bmp.*not the one the index describes"):
        Shards(out, cache_dir=tmp_path / "verdicts").read(2)
    assert len(hashed) == 2
    tar.write_bytes(tar.read_bytes()[:-512])                  # and truncated: refused on its size alone
    with pytest.raises(DecodeError, match=r"bytes, but its index says"):
        Shards(out, cache_dir=tmp_path / "verdicts").read(3)
    assert len(hashed) == 2


def _s3_put(options, url, folder):
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    for p in Path(folder).iterdir():
        if p.is_file():
            fs.pipe_file(f"{url.removeprefix('s3://')}/{p.name}", p.read_bytes())


@pytest.mark.parametrize("transport", ["http", "s3"])
def test_a_repacked_remote_location_is_never_served_from_the_old_cached_shards(tmp_path, transport):
    a, b, a_bytes, b_bytes = _versions(tmp_path)
    out, cache = tmp_path / "out", tmp_path / "cache"
    pack(a, out, shard_size=SHARD, workers=0, progress=False)
    if transport == "http":
        server = http_server(out)
        served = server.__enter__()
        url, options = served.url, None
    else:
        server = s3_server()
        url, options = server.__enter__()
        _s3_put(options, url, out)
    try:
        first = Shards(url, cache_dir=cache, storage_options=options)
        assert _read_all(first) == [(a_bytes[i], int(a.labels[i])) for i in range(48)]
        first.close()
        pack(b, out, shard_size=SHARD, workers=0, progress=False)   # re-packed where it is served from
        if transport == "s3":
            _s3_put(options, url, out)
        again = Shards(url, cache_dir=cache, storage_options=options)
        assert _read_all(again) == [(b_bytes[i], int(b.labels[i])) for i in range(48)]
        if transport == "http":
            assert all(served.count(f"/shard-{j:06d}.tar", "GET") == 2 for j in range(8)), served.requests
        again.close()
    finally:
        server.__exit__(None, None, None)


def test_a_remote_shard_that_changed_under_its_index_is_a_decode_error_and_skip_counts_it(tmp_path):
    a, b, a_bytes, _ = _versions(tmp_path)
    out, other = tmp_path / "out", tmp_path / "other"
    pack(a, out, shard_size=SHARD, workers=0, progress=False)
    pack(b, other, shard_size=SHARD, workers=0, progress=False)
    with http_server(out) as server:
        shards = Shards(server.url, cache_dir=tmp_path / "cache")        # reads A's index
        (out / "shard-000001.tar").write_bytes((other / "shard-000001.tar").read_bytes())
        with pytest.raises(DecodeError, match=r"shard-000001\.tar:00000006\.bmp.*not the one the index "
                                              r"describes.*sha256"):
            shards.read(6)
        shards.read(5)                                                    # other shards are fine
        gets = server.count("/shard-000001.tar", "GET")
        with pytest.raises(DecodeError):
            shards.read(7)
        assert server.count("/shard-000001.tar", "GET") == gets           # not downloaded again per sample
        assert not list((tmp_path / "cache").glob("shard-000001*"))       # never published
        loader = make_loader(Shards(server.url, cache_dir=tmp_path / "cache"), "torch", batch_size=8,
                             device="cpu", augment=NONE, num_workers=0, on_error="skip", train=False)
        with pytest.warns(RuntimeWarning, match="skipped 6 undecodable"):
            assert sum(len(y) for _, y in loader) == 42


# ------------------------------------------------------------------------------ subsets stream by window
def test_a_split_of_remote_shards_downloads_each_shard_it_touches_once_an_epoch(tmp_path):
    from fastdata.datasets import split

    rng = np.random.default_rng(3)
    folder = tmp_path / "photos"
    samples = []
    for i in range(128):
        path = folder / f"img{i:03d}.bmp"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(path)
        samples.append((path, i % 4))
    out = tmp_path / "out"
    pack(ImageFolder.from_samples(samples, list("abcd")), out, shard_size=8 * PER_SAMPLE, workers=0,
         progress=False)
    with http_server(out) as server:
        largest = max(s.size for s in Shards(out).index.shards)
        # The smallest cache window=2 accepts: 4 of the 16 shards.
        shards = Shards(server.url, cache_dir=tmp_path / "cache", window=2, cache_limit=4 * largest)
        assert len(shards.index.shards) == 16
        part, _ = split(shards, [0.5, 0.5], seed=1)          # 64 samples, spread over all 16 shards
        touched = len(set(shards.index.shard[part._ids].tolist()))
        assert touched == 16
        loader = make_loader(part, "torch", batch_size=8, device="cpu", augment=NONE, num_workers=0,
                             shuffle=True, seed=2)
        before = server.count(method="GET")
        labels = np.concatenate([y.numpy() for _, y in loader])
        gets = server.count(method="GET") - before
        shards.close()
    assert sorted(labels.tolist()) == sorted(part.labels.tolist())
    # Each touched shard once, plus the next epoch's first window (2 shards) fetched while this one ends,
    # and a shard or two fetched again when the read-ahead races the reader for the 4-shard cache (the
    # whole set's epochs have the same slack). A plain permutation of the 64 samples took about one
    # download per sample (60 here).
    assert gets <= touched + 4, gets


# -------------------------------------------------------------------------- packing changes nothing
def _write_idx(path, array):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def _same_batches(a, b, backend="torch", **kw):
    kw = dict(batch_size=8, device="cpu", num_workers=0, seed=4, drop_last=False, **kw)
    la, lb = make_loader(a, backend, **kw), make_loader(b, backend, **kw)
    got = 0
    for (xa, ya), (xb, yb) in zip(la, lb, strict=True):
        assert xa.shape == xb.shape and xa.dtype == xb.dtype
        np.testing.assert_array_equal(ya.numpy(), yb.numpy())
        np.testing.assert_allclose(xa.numpy(), xb.numpy(), atol=1e-5)
        got += len(ya)
    return got, tuple(xa.shape[1:])


def test_packed_mnist_reads_back_as_the_mnist_it_was(tmp_path):
    import subprocess
    import sys

    from fastdata.datasets import MNIST

    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (40, 28, 28), dtype=np.uint8)
    _write_idx(raw / "train-images-idx3-ubyte", images)
    _write_idx(raw / "train-labels-idx1-ubyte", rng.integers(0, 10, 40, dtype=np.uint8))
    source = MNIST(tmp_path / "data", train=True, download=False)
    out = tmp_path / "mnist-train"
    run = subprocess.run([sys.executable, "-m", "fastdata", "pack", str(tmp_path / "data"), str(out), "--split",
                          "train", "--shard-size", "10KB", "--no-progress"], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    shards = Shards(out)
    assert len(shards.index.shards) > 1
    assert shards.channels == source.channels == 1 and shards.image_shape == (28, 28, 1)
    assert shards.mean == source.mean and shards.std == source.std
    np.testing.assert_array_equal(shards.labels, source.labels)
    np.testing.assert_array_equal(shards.images, source.images)
    assert shards.default_augmentation(True) == source.default_augmentation(True)
    for backend in BACKENDS:
        n, shape = _same_batches(source, shards, backend, train=True)   # the digits recipe, the same draws
        assert n == 40 and shape == (1, 28, 28)
    sub = shards.subset(np.arange(10, 30))
    np.testing.assert_array_equal(sub.images, source.images[10:30])


def test_a_packed_rgb_folder_and_rgb_arrays_read_back_as_they_were(tmp_path):
    from fastdata.datasets import ArraySource, make_image_folder

    folder = ImageFolder(make_image_folder(tmp_path / "photos", classes=2, per_class=5, seed=2))
    pack(folder, tmp_path / "folder", shard_size="200KB", workers=0, progress=False)
    shards = Shards(tmp_path / "folder")
    assert shards.channels == folder.channels == 3 and shards.kind is folder.kind
    assert shards.mean == folder.mean and shards.std == folder.std
    assert _same_batches(folder, shards, augment=Augmentation(crop="center", size=32), shuffle=False) == \
        (10, (3, 32, 32))

    rng = np.random.default_rng(6)
    arrays = ArraySource(rng.integers(0, 256, (20, 12, 10, 3), dtype=np.uint8), np.arange(20) % 4)
    pack(arrays, tmp_path / "arrays", shard_size="2KB", workers=0, progress=False)
    shards = Shards(tmp_path / "arrays")
    assert shards.channels == 3 and shards.mean == arrays.mean and shards.std == arrays.std
    assert _same_batches(arrays, shards, train=True) == (20, (3, 12, 10))
    with pytest.raises(ValueError, match="transform= applies to photos"):
        Shards(tmp_path / "arrays", transform=lambda img: img)
    assert os.path.exists(tmp_path / "arrays" / "index.json")
