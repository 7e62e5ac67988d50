"""Shards as a user who keeps data in shards runs them, second pass: the faults that test_qa_shards and
test_shards_* leave out. A source that must travel to spawn/forkserver workers, S3 without credentials,
a shard written in place while a reader holds it open, and what the other tests do not cover
(tars written by other tools, per-epoch downloads of a large shard). Every server is started here on
127.0.0.1; every data set is made here."""
from __future__ import annotations

import os
import pickle
import re
import shutil

import numpy as np
import pytest

import fastdata
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, Shards, make_image_folder

NONE = Augmentation(crop="center", size=32)
KW = dict(batch_size=8, device="cpu", train=False, augment=NONE, shuffle=True, seed=2, drop_last=False)


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    """32 small JPEGs in 2 classes packed into 4 shards."""
    root = tmp_path_factory.mktemp("qa-shards2")
    folder = make_image_folder(root / "photos", classes=2, per_class=16, seed=3, size_range=((40, 64), (40, 64)))
    fastdata.pack(ImageFolder(folder), root / "packed", shard_size=40_000, progress=False, workers=0)
    return root / "packed"


# ---------------------------------------------------------------- a source that travels to workers
@pytest.mark.requires("fsspec", "aiohttp")
def test_a_shards_source_pickles_local_and_remote_and_reads_the_same_bytes_after(pack_dir, tmp_path):
    """A spawn or forkserver DataLoader worker (the torch backend's multiprocessing_context; Python
    3.14's default on Linux) pickles the source: Shards held locks (its open files' and the sha256
    verdicts') and the remote cache's copy lost its file names, so no such worker ever started."""
    from shard_servers import http_server

    local = Shards(pack_dir)
    first = local.read(0)                                  # files open, a verdict taken: state to travel
    copy = pickle.loads(pickle.dumps(local))
    assert copy.read(0) == first and copy.read(len(copy) - 1) == local.read(len(local) - 1)
    with http_server(pack_dir) as server:
        remote = Shards(server.url, cache_dir=tmp_path / "cache")
        assert remote.read(5) == local.read(5)
        copy = pickle.loads(pickle.dumps(remote))
        assert copy.read(6) == local.read(6)
        assert copy.cached_path("shard-000000.tar") == remote.cached_path("shard-000000.tar")
        remote.close()
        copy.close()


@pytest.mark.requires("fsspec", "aiohttp")
def test_spawned_torch_workers_read_shards_over_http(pack_dir, tmp_path):
    from shard_servers import http_server

    reference = [y.numpy() for _, y in make_loader(Shards(pack_dir), "torch", num_workers=0, **KW)]
    with http_server(pack_dir) as server:
        source = Shards(server.url, cache_dir=tmp_path / "cache")
        loader = make_loader(source, "torch", num_workers=2, multiprocessing_context="spawn", **KW)
        got = [y.numpy() for _, y in loader]
        source.close()
    assert len(got) == len(reference) == 4
    for y, ye in zip(got, reference):
        np.testing.assert_array_equal(y, ye)


# ---------------------------------------------------------------- S3 without credentials
def test_s3_without_credentials_says_to_give_credentials_not_to_re_pack(pack_dir, tmp_path, monkeypatch):
    """botocore's NoCredentialsError is no OSError: the index's error said 'it must be the file
    index.json that pack writes; re-run pack' for a bucket whose index is fine."""
    from fastdata.shards.storage import StorageError
    from shard_servers import s3_server

    files = {p.name: p.read_bytes() for p in pack_dir.iterdir() if p.is_file()}
    with s3_server(files=files) as (url, options):
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        endpoint = {"client_kwargs": options["client_kwargs"]}     # the endpoint, no key or secret
        with pytest.raises(StorageError) as caught:
            Shards(url, storage_options=endpoint, cache_dir=tmp_path / "cache", retries=1)
        message = str(caught.value)
        assert f"the index at {url}/index.json" in message
        assert "no credentials were found" in message and "AWS_ACCESS_KEY_ID" in message
        assert "check the credentials" in message and "re-run pack" not in message
        assert "not retried" in message
        # With them, the same bucket reads.
        assert len(Shards(url, storage_options=options, cache_dir=tmp_path / "cache")) == 32


# ---------------------------------------------------------------- a shard written in place
def test_a_shard_written_in_place_while_a_reader_holds_it_open_is_checked_again(pack_dir, tmp_path):
    """``cp`` of a re-packed shard over the old one writes the same inode: a loader that kept the file
    open from its first epoch read the new bytes in the next one under the old index's labels, without
    a word (the shard was checked only when it was opened)."""
    import shutil

    folder = tmp_path / "packed"
    shutil.copytree(pack_dir, folder)
    source = Shards(folder)
    index = source.index
    in_first = np.flatnonzero(index.shard == 0)
    assert len(in_first) >= 2
    loader = make_loader(source, "torch", num_workers=0, **KW)
    assert sum(len(y) for _, y in loader) == 32            # epoch 1: every shard opened and kept open
    # Another version of shard 0, written in place: one photo's bytes swapped for another's prefix.
    a, b = int(in_first[0]), int(in_first[1])
    tar = folder / index.shards[0].name
    with open(tar, "r+b") as f:
        f.seek(int(index.offset[b]))
        other = f.read(int(index.size[a]))
        f.seek(int(index.offset[a]))
        f.write(other[: int(index.size[a])].ljust(int(index.size[a]), b"\0"))
    os.utime(tar, ns=(os.stat(tar).st_atime_ns, os.stat(tar).st_mtime_ns + 10**9))   # a coarse clock
    with pytest.raises(fastdata.DecodeError, match=r"shard-000000\.tar:\d+\.jpg.*not the shard"):
        list(loader)
    skipping = make_loader(source, "torch", num_workers=0, on_error="skip", **KW)
    with pytest.warns(RuntimeWarning, match=rf"skipped {len(in_first)} "):
        assert sum(len(y) for _, y in skipping) == 32 - len(in_first)


# ---------------------------------------------------------------- tars written by other tools
def _photo(seed: int, fmt: str = "JPEG") -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (20 + seed % 7, 24, 3), dtype=np.uint8)).save(out, format=fmt)
    return out.getvalue()


def _tar(path, members, *, fmt=None, mode="w"):
    """Write ``members`` ([(name, bytes or None for a folder or ("link", target))]) with Python's tarfile."""
    import io
    import tarfile

    with tarfile.open(path, mode, **({"format": fmt} if fmt is not None else {})) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, tuple):
                info.type, info.linkname = tarfile.LNKTYPE, data[1]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _pairs_of(source) -> list:
    """(image bytes, class name) of every sample, sorted."""
    return sorted((source.read(i), source.classes[int(source.labels[i])]) for i in range(len(source)))


@pytest.mark.skipif(shutil.which("tar") is None, reason="makes one of its tars with GNU tar")
def test_webdataset_tars_of_other_tools_convert_with_pack_and_read_back_every_sample(tmp_path):
    """A folder of WebDataset-style tars written by tarfile and GNU tar: members out of order, a folder
    member, keys with dots, upper-case and .jpeg/.png endings, labels in .cls, .txt and .json, a
    second image (a mask) in a sample, pax and GNU long names, a hard link, a .tar.gz. Before, pack took
    the folder for an image folder ('no class sub-folders') and Shards said to give pack's folder: a
    user's WebDataset could not be read at all."""
    import json
    import subprocess
    import sys
    import tarfile

    tars = tmp_path / "wds"
    tars.mkdir()
    p = [_photo(k) for k in range(10)]
    long_key = "deep/" + "k" * 120
    _tar(tars / "a-000.tar", [
        ("b.cls", b"1"), ("a.jpg", p[0]), ("sub", None), ("sub/c.JPEG", p[1]), ("a.cls", b"0\n"),
        ("b.png", _photo(2, "PNG")), ("sub/c.txt", b" 7 "),
        (f"{long_key}.jpg", p[3]), (f"{long_key}.json", json.dumps({"label": 3, "w": 24}).encode()),
        ("img.v2.jpg", p[4]), ("img.v2.cls", b"2"),                      # a dot in the key
        ("d.jpg", p[5]), ("d.seg.png", _photo(6, "PNG")), ("d.cls", b"5"),  # an image and its mask
        ("e.jpg", ("link", "a.jpg")), ("e.cls", b"4"),                     # a hard link
        ("m.x.cls", b"1"), ("m.jpg", p[2]), ("m.x.jpg", p[6]), ("m.cls", b"0"),   # keys m and m.x
    ], fmt=tarfile.PAX_FORMAT)
    _tar(tars / "a-001.tar.gz", [("x.jpg", p[7]), ("x.json", b"6"), (f"{long_key}.jpg", p[8]),
                                 (f"{long_key}.cls", b"2")], fmt=tarfile.GNU_FORMAT, mode="w:gz")
    _tar(tars / "a-003.tar.xz", [("z.PNG", _photo(10, "PNG")), ("z.txt", b"3")], mode="w:xz")
    gnu = tmp_path / "gnu"
    (gnu / "f").mkdir(parents=True)
    (gnu / "f" / "y.jpg").write_bytes(p[9])
    (gnu / "f" / "y.cls").write_text("1")
    subprocess.run(["tar", "-cf", str(tars / "a-002.tar"), "-C", str(gnu), "f"], check=True)
    expected = sorted([(p[0], "0"), (_photo(2, "PNG"), "1"), (p[1], "7"), (p[3], "3"), (p[4], "2"), (p[5], "5"),
                       (p[0], "4"), (p[7], "6"), (p[8], "2"), (p[9], "1"), (_photo(10, "PNG"), "3"),
                       (p[2], "0"), (p[6], "1")])

    from fastdata.packing import TarImages
    from fastdata.shards.index import IndexNotFound

    with pytest.raises(IndexNotFound, match=r"holds 4 tar file\(s\) but no index.*python -m fastdata pack"):
        Shards(tars)
    assert _pairs_of(TarImages(tars)) == expected
    done = subprocess.run([sys.executable, "-m", "fastdata", "pack", str(tars), str(tmp_path / "out"),
                           "--no-progress", "--workers", "0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    packed = Shards(tmp_path / "out")
    assert packed.classes == [str(k) for k in range(8)] and _pairs_of(packed) == expected
    n = sum(len(y) for _, y in make_loader(packed, "torch", num_workers=0, **KW))
    assert n == 13


@pytest.mark.parametrize("case, match", [
    ("no-label", r"a-000\.tar': sample 'b' has no label \(\.cls, .* only 'b\.jpg'"),
    ("no-image", r"a-000\.tar': sample 'c' has no image member, only 'c\.cls'"),
    ("two-images", r"a-000\.tar': sample 'b' has several images \(b\.jpg, b\.png\)"),
    ("mixed-labels", r"class indices \(0\) and others with class names \('cat'\)"),
    ("bad-label", r"label member '.*a-000\.tar:b\.cls' holds 'cat'"),
    ("truncated", r"tar '.*a-000\.tar' is truncated or damaged: it ends inside or after member 'b\.jpg'"),
    ("truncated-gz", r"tar '.*a-000\.tar\.gz' is truncated or damaged"),
    ("captions", r"give 20 different text labels to 20 samples \(such as 'a photo of 0'\): captions, not classes"),
    ("sparse", r"member 's\.jpg' is sparse"),
])
def test_tars_that_cannot_be_converted_are_named_with_the_member_and_what_is_wrong(tmp_path, case, match):
    import subprocess

    from fastdata.packing import TarImages

    folder = tmp_path / "wds"
    folder.mkdir()
    members = [("a.jpg", _photo(0)), ("a.cls", b"0")]
    extra = {"no-label": [("b.jpg", _photo(1))], "no-image": [("c.cls", b"1")],
             "two-images": [("b.jpg", _photo(1)), ("b.png", _photo(2, "PNG")), ("b.cls", b"1")],
             "mixed-labels": [("b.jpg", _photo(1)), ("b.txt", b"cat")],
             "bad-label": [("b.jpg", _photo(1)), ("b.cls", b"cat")]}
    if case == "captions":
        members = [m for k in range(20) for m in ((f"c{k}.jpg", _photo(k)), (f"c{k}.txt", f"a photo of {k}".encode()))]
    if case == "sparse":
        if shutil.which("tar") is None:
            pytest.skip("makes a sparse member with GNU tar")
        data = tmp_path / "src"
        data.mkdir()
        with open(data / "s.jpg", "wb") as f:
            f.truncate(1 << 20)
            f.write(_photo(3))
        (data / "s.cls").write_text("0")
        subprocess.run(["tar", "-S", "--format=gnu", "-cf", str(folder / "a-000.tar"), "-C", str(data),
                        "s.jpg", "s.cls"], check=True)
    elif case == "truncated-gz":
        _tar(folder / "a-000.tar.gz", members + [("b.jpg", _photo(1)), ("b.cls", b"1")], mode="w:gz")
        whole = (folder / "a-000.tar.gz").read_bytes()
        (folder / "a-000.tar.gz").write_bytes(whole[: len(whole) // 2])
    else:
        _tar(folder / "a-000.tar", members + extra.get(case, [] if case == "captions" else
                                                       [("b.jpg", _photo(1)), ("b.cls", b"1")]))
    if case == "truncated":
        import tarfile

        with tarfile.open(folder / "a-000.tar") as tar:
            cut = tar.getmember("b.jpg").offset_data + 100
        whole = (folder / "a-000.tar").read_bytes()
        (folder / "a-000.tar").write_bytes(whole[:cut])   # inside b.jpg's data
    with pytest.raises(ValueError, match=match):
        TarImages(folder)
    with pytest.raises(ValueError, match=match):
        fastdata.pack(str(folder), tmp_path / "out", progress=False, workers=0)


# ---------------------------------------------------------------- the cache's bytes on disk
def _open_deleted(folder) -> int:
    """Bytes of files under ``folder`` that this process holds open after they were deleted: disk space
    the cache counts as free, which the file system cannot give back."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(folder)) and target.endswith(" (deleted)"):
                total += os.stat(f"/proc/self/fd/{fd}").st_size
        except OSError:   # closed meanwhile
            pass
    return total


@pytest.mark.requires("fsspec", "aiohttp")
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors through Linux's /proc")
def test_shards_the_cache_evicts_are_not_kept_open_by_the_reader(pack_dir, tmp_path):
    """A reader kept the last 2 x window shard files open after releasing them: once the cache evicted
    one, its bytes stayed on the disk (deleted, still open) while the cache counted them as free. Each
    DataLoader worker kept its own, so a cache_limit sized for the disk was overrun by up to
    workers x 2 x window shards (16 GB of 256 MB shards with 8 workers), and the disk filled."""
    import json

    from shard_servers import http_server

    largest = max(s["size"] for s in json.loads((pack_dir / "index.json").read_text())["shards"])
    cache = tmp_path / "cache"
    held = []
    with http_server(pack_dir) as server:
        source = Shards(server.url, window=1, cache_dir=cache, cache_limit=2 * largest)
        loader = make_loader(source, "torch", num_workers=0, **dict(KW, batch_size=2))
        for _ in range(2):
            for _, y in loader:
                held.append(_open_deleted(cache))
        source.close()
        assert server.count(".tar", "GET") > 4                    # the cache evicted and fetched again
    assert len(held) == 32 and max(held) == 0


def _cache_fds(folder) -> list[str]:
    """What this process's descriptors on files under ``folder`` point at."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{folder}{os.sep}"):
            found.append(target)
    return found


def _report_cache_fds(folder, queue):
    queue.put(_cache_fds(folder))


@pytest.mark.requires("fsspec", "aiohttp")
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors through Linux's /proc")
def test_a_worker_forked_during_a_download_keeps_no_descriptor_of_the_cache(pack_dir, tmp_path):
    """A DataLoader worker forks while the read-ahead thread downloads (a pass tells the source where it
    is before its first batch, as its workers start): the worker inherited the open download file, and
    once that shard was published and evicted, its bytes stayed on the disk for the worker's whole life
    (with persistent workers, the run's), past cache_limit."""
    import multiprocessing
    import threading
    import time

    from shard_servers import Faults, http_server

    cache = tmp_path / "cache"
    with http_server(pack_dir, Faults(stall=1.5)) as server:
        source = Shards(server.url, window=1, cache_dir=cache)
        def read_ahead():                          # what the read-ahead thread does
            source._cache.get("shard-000000.tar")
            source._cache.release("shard-000000.tar")

        ahead = threading.Thread(target=read_ahead)
        ahead.start()
        deadline = time.monotonic() + 20
        while not [t for t in _cache_fds(cache) if ".tmp-" in t] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [t for t in _cache_fds(cache) if ".tmp-" in t], "the download never opened its file"
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_report_cache_fds, args=(str(cache), queue))
        child.start()
        inherited = queue.get(timeout=30)
        child.join(30)
        ahead.join(30)
        assert source.read(0)                      # the parent's download finished as it was
        source.close()
    assert inherited == []


# ---------------------------------------------------------------- pack: a full OUT disk
@pytest.mark.parametrize("workers", [0, 2])
def test_pack_onto_a_full_disk_names_out_and_the_shard_not_the_source(tmp_path, monkeypatch, workers):
    """OUT's disk filling up mid-pack read 'error: fastdata pack: SOURCE 'photos': [Errno 28] No space
    left on device': the source named, neither OUT nor the shard, nor what to do."""
    import errno
    import shutil

    from fastdata.packing import command, writer

    photos = make_image_folder(tmp_path / "photos", classes=2, per_class=6, seed=1, size_range=((40, 64), (40, 64)))
    real = writer._HashingFile.write

    def write(self, data):
        if self.n + len(data) > 20_000:           # the disk fills inside the second shard
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(writer._HashingFile, "write", write)
    out = tmp_path / "out"
    with pytest.raises(OSError, match=r"cannot write shard '.*shard-00000\d\.tar' in '.*out': No space left on "
                                      r"device.*free space there") as caught:
        fastdata.pack(photos, out, shard_size=30_000, progress=False, workers=workers)
    assert caught.value.errno == errno.ENOSPC
    assert not list(out.glob("*.tmp-*")) and not (out / "index.json").exists()
    shutil.rmtree(out)
    args = command.get_args_parser().parse_args([str(photos), str(out), "--shard-size", "30000", "--no-progress",
                                                 "--workers", str(workers)])
    with pytest.raises(SystemExit, match=rf"^error: fastdata pack: OUT '{out}': cannot write shard .*No space "
                                         rf"left on device") as exited:
        command.main(args)
    assert "SOURCE" not in str(exited.value)


# ---------------------------------------------------------------- the node's cache is not a sample's fault
@pytest.mark.requires("fsspec", "aiohttp")
def test_a_full_cache_disk_stops_the_pass_even_under_skip_instead_of_skipping_every_sample(pack_dir, tmp_path):
    """A full cache disk (or a cache lock never freed) was a DecodeError of each sample: under
    on_error="skip" the pass went on and yielded nothing, then warned of 32 'undecodable' samples.
    The disk is the node's, not the samples': the error is raised as it is, naming the cache."""
    import errno

    from fastdata.shards.cache import CacheFull
    from shard_servers import http_server

    with http_server(pack_dir) as server:
        source = Shards(server.url, cache_dir=tmp_path / "cache")

        def fetch(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        source.storage.fetch = fetch                      # every download finds the disk full
        loader = make_loader(source, "torch", num_workers=0, on_error="skip", **KW)
        with pytest.raises(CacheFull, match=r"the disk holding the shard cache .*cache is full: shard 'shard-"):
            list(loader)
        source.close()
        # A cache disk remounted read-only mid-run: the same, naming what to do.
        source = Shards(server.url, cache_dir=tmp_path / "cache2")

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        source.storage.fetch = read_only
        loader = make_loader(source, "torch", num_workers=0, on_error="skip", **KW)
        with pytest.raises(CacheFull, match=r"shard cache .*cache2 is on a read-only file system .*writable"):
            list(loader)
        source.close()


@pytest.mark.requires("fsspec", "aiohttp")
def test_a_cache_dir_without_file_locks_is_refused_when_shards_is_created(pack_dir, tmp_path, monkeypatch):
    """A cache_dir on a file system without flock (a FUSE mount, Lustre without -o flock): every read
    failed, each as one sample's DecodeError, and under on_error="skip" every sample was skipped."""
    import errno
    import fcntl

    from fastdata.shards import cache as cache_module
    from shard_servers import http_server

    real = fcntl.flock

    def flock(fd, operation):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "cache")):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real(fd, operation)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("tells the cache's descriptors apart through Linux's /proc")
    monkeypatch.setattr(cache_module.fcntl, "flock", flock)
    with http_server(pack_dir) as server:
        with pytest.raises(ValueError, match=rf"the file system of cache_dir {tmp_path / 'cache'} does not support "
                                             rf"file locks \(flock: No locks available\)"):
            Shards(server.url, cache_dir=tmp_path / "cache")
        assert len(Shards(server.url, cache_dir=tmp_path / "other")) == 32


# ---------------------------------------------------------------- pack: OUT is what it reads
def test_packing_a_pack_into_its_own_folder_is_refused_before_anything_is_touched(pack_dir, tmp_path):
    """'python -m fastdata pack shards/ shards/ --shard-size ...' (reshard in place) removed the index,
    then replaced shards it had not read yet: it failed half-way, the pack destroyed. Tars of another tool
    named as pack names its shards (webdataset's ShardWriter writes shard-000000.tar) likewise."""
    import hashlib
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "packed"
    shutil.copytree(pack_dir, folder)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    done = subprocess.run([sys.executable, "-m", "fastdata", "pack", str(folder), str(folder), "--shard-size", "10KB",
                           "--no-progress", "--workers", "0"], capture_output=True, text=True)
    assert done.returncode == 1
    assert f"OUT '{folder}' holds files the source reads ({folder / 'shard-000000.tar'}" in done.stderr
    assert "give another OUT" in done.stderr and "on_error" not in done.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == before
    # The same pack into another folder, then that folder read: what the user meant, done right.
    fastdata.pack(str(folder), tmp_path / "resharded", shard_size="10KB", progress=False, workers=0)
    assert _pairs_of(Shards(tmp_path / "resharded")) == _pairs_of(Shards(folder))

    wds = tmp_path / "wds"
    wds.mkdir()
    _tar(wds / "shard-000000.tar", [("a.jpg", _photo(0)), ("a.cls", b"0"), ("b.jpg", _photo(1)), ("b.cls", b"1")])
    with pytest.raises(ValueError, match=r"holds files the source reads \(.*wds/shard-000000\.tar\)"):
        fastdata.pack(str(wds), wds, progress=False, workers=0)


def test_packing_a_damaged_pack_names_the_shard_and_gives_no_loader_advice(pack_dir, tmp_path):
    """A reshard of a pack with a truncated shard failed with the loaders' DecodeError hint, 'on_error=skip
    skips and counts such files', an option pack does not have."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "packed"
    shutil.copytree(pack_dir, folder)
    tar = folder / "shard-000001.tar"
    tar.write_bytes(tar.read_bytes()[:3000])
    done = subprocess.run([sys.executable, "-m", "fastdata", "pack", str(folder), str(tmp_path / "out"),
                           "--no-progress", "--workers", "0"], capture_output=True, text=True)
    assert done.returncode == 1
    # Every sample of the shard is refused, for one reason said once, the other shards written (5eef07a).
    said = done.stderr.strip().splitlines()[-1]
    assert re.search(rf"'{re.escape(str(folder / 'shard-000001.tar'))}:0+\d+\.jpg', '.*\.jpg' \(cannot be read: ",
                     said), said
    assert said.count("is 3000 bytes, but its index says") == 1 and "on_error" not in said


@pytest.mark.requires("fsspec", "aiohttp")
def test_the_index_url_given_as_the_location_says_to_give_its_folder(pack_dir):
    """A folder's index.json given in place of the folder is named so (test_shards_source); its URL was
    read as 'URL/index.json/index.json', a 404 whose advice was to check the URL or re-run pack."""
    from fastdata.shards.index import IndexNotFound
    from shard_servers import http_server

    with http_server(pack_dir) as server:
        with pytest.raises(IndexNotFound, match=rf"the location names the index itself: give the folder that holds "
                                                rf"it, '{server.url}'$"):
            Shards(f"{server.url}/index.json?sig=SECRET")
        assert len(Shards(server.url)) == 32


# ---------------------------------------------------------------- a slow link
@pytest.mark.requires("fsspec", "aiohttp")
def test_a_reader_waits_for_a_download_that_keeps_progressing_past_wait_timeout(pack_dir, tmp_path):
    """A shard over a slow link "takes as long as it takes while bytes keep coming" (timeout= bounds each
    wait for bytes): but a reader waiting for the read-ahead thread's download of that shard gave up
    after wait_timeout (10 minutes) however fast the bytes came, and the pass stopped."""
    import threading
    import time

    from shard_servers import Faults, http_server

    with http_server(pack_dir, Faults(trickle=2.0)) as server:
        source = Shards(server.url, window=1, cache_dir=tmp_path / "cache")
        cache = source._cache
        cache.wait_timeout = 0.6                          # the download takes 2 s, its bytes every 0.2 s
        errors = []

        def read_ahead():
            try:
                cache.get("shard-000000.tar", remember_failure=False)
                cache.release("shard-000000.tar")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ahead = threading.Thread(target=read_ahead)
        ahead.start()
        while not [p for p in (tmp_path / "cache").glob("shard-000000.*.tar.tmp-*") if p.stat().st_size]:
            assert ahead.is_alive() and not errors, errors
            time.sleep(0.01)
        path = cache.get("shard-000000.tar")              # waits on the download's lock, then reads it
        cache.release("shard-000000.tar")
        ahead.join(30)
        assert not errors and os.path.getsize(path) == source.index.shards[0].size
        assert server.count("/shard-000000.tar", "GET") == 1
        source.close()


def test_an_out_folder_that_cannot_be_made_is_named_as_out(tmp_path):
    """mkdir of a name too long for the file system failed inside the command's SOURCE wrapper:
    'fastdata pack: SOURCE <photos>: [Errno 36] File name too long' (test_qa_commands has the command)."""
    import errno

    from fastdata.packing import command
    from fastdata.packing.writer import OutputError

    photos = make_image_folder(tmp_path / "photos", classes=2, per_class=2, seed=0)
    out = tmp_path / ("x" * 300) / "out"
    with pytest.raises(OutputError, match=r"cannot create the folder '.*xxx/out': File name too long") as caught:
        fastdata.pack(photos, out, progress=False, workers=0)
    assert caught.value.errno == errno.ENAMETOOLONG
    args = command.get_args_parser().parse_args([str(photos), str(tmp_path / ("y" * 300)), "--no-progress"])
    with pytest.raises(SystemExit, match=r"^error: fastdata pack: OUT '.*yyy': cannot create the folder"):
        command.main(args)
