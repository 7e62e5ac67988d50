"""Shards as a user with a dataset in a bucket meets them: a pack of small JPEGs served over HTTP (the tests'
server on 127.0.0.1), read by every backend through a cache smaller than the pack, and the faults a real
bucket gives that no other test covers: a location URL carrying a token, a cache_dir that is not a folder,
and a shard that stays unreachable while ``on_error="skip"`` passes its samples."""
from __future__ import annotations

import json
import os
import threading
import time
import warnings

import numpy as np
import pytest

from conftest import BACKENDS, require
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, Shards, make_image_folder
from shard_servers import Faults, http_server

pytestmark = pytest.mark.requires("fsspec", "aiohttp")

NONE = Augmentation(crop="center", size=32)
KW = dict(batch_size=16, device="cpu", train=False, augment=NONE, shuffle=True, seed=5, drop_last=False)


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    """96 small JPEGs in 4 classes packed into 16 shards of ~6 photos."""
    from fastdata.packing import pack

    root = tmp_path_factory.mktemp("qa-shards")
    folder = make_image_folder(root / "photos", classes=4, per_class=24, seed=1, size_range=((40, 64), (40, 64)))
    pack(ImageFolder(folder), root / "packed", shard_size=30_000, progress=False)
    return root / "packed"


def _largest(pack_dir) -> int:
    return max(s["size"] for s in json.loads((pack_dir / "index.json").read_text())["shards"])


def _cached_bytes(cache_dir) -> int:
    total = 0
    for folder, dirs, names in os.walk(cache_dir):
        dirs[:] = [d for d in dirs if d != ".locks"]
        for n in names:
            try:
                total += os.path.getsize(os.path.join(folder, n))
            except FileNotFoundError:   # published or evicted between the listing and the stat
                pass
    return total


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_epochs_over_http_through_an_evicting_cache_give_the_local_packs_batches(pack_dir, tmp_path, backend):
    limit = 2 * _largest(pack_dir)                   # window=1: the smallest budget accepted, 1/8 of the pack
    cache = tmp_path / "cache"
    reference = make_loader(Shards(pack_dir, window=1), "torch", num_workers=0, **KW)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _cached_bytes(cache))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    with http_server(pack_dir) as server:
        source = Shards(server.url, window=1, cache_dir=cache, cache_limit=limit)
        watcher.start()
        try:
            with make_loader(source, backend, num_workers=2, **KW) as loader:
                for _ in range(2):
                    got = [(x.numpy(), y.numpy()) for x, y in loader]
                    expected = [(x.numpy(), y.numpy()) for x, y in reference]
                    assert len(got) == len(expected) == 6
                    for (x, y), (xe, ye) in zip(got, expected):
                        np.testing.assert_array_equal(y, ye)
                        np.testing.assert_allclose(x, xe, atol=1e-5)
        finally:
            stop.set()
            watcher.join()
            source.close()
        assert server.count(".tar", "GET") > 16        # it evicted and fetched again: the cache was small
    assert 0 < peak[0] <= limit


def test_a_location_url_with_a_token_reads_and_never_prints_the_token(pack_dir, tmp_path):
    # An Azure SAS or CDN token on the folder's URL: every file's URL keeps it after the file name.
    with http_server(pack_dir) as server:
        source = Shards(f"{server.url}/?sig=SECRET", cache_dir=tmp_path / "cache", cache_limit=10**8)
        assert len(source) == 96
        names = {p for _, p, _ in server.requests}
        assert names == {"/index.json"}
        n = sum(len(y) for _, y in make_loader(source, "torch", num_workers=0, **KW))
        assert n == 96
        assert all(p == "/index.json" or p.startswith("/shard-") and p.endswith(".tar") for _, p, _ in server.requests)
        assert "SECRET" not in source.sample_name(0) and "SECRET" not in repr(source)
        assert source.sample_name(0).startswith(f"{server.url}/shard-")
        assert source.storage._remote("shard-000000.tar")[1] == f"{server.url}/shard-000000.tar?sig=SECRET"


@pytest.mark.parametrize("make", ["file", "inside-a-file"])
def test_a_cache_dir_that_cannot_be_a_folder_is_refused_naming_it(pack_dir, tmp_path, make):
    (tmp_path / "afile").write_text("not a folder")
    cache_dir = tmp_path / "afile" if make == "file" else tmp_path / "afile" / "cache"
    with http_server(pack_dir) as server:
        with pytest.raises(ValueError, match=rf"^Shards: cache_dir '{cache_dir}' cannot be a folder of shards"):
            Shards(server.url, cache_dir=cache_dir)


@pytest.fixture
def read_only_folder(tmp_path):
    """An existing folder that cannot be written: mode 0o500, or as root (who writes anyway) a read-only
    bind mount (skipped where this process may not mount)."""
    import subprocess

    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o500)
        yield folder
        folder.chmod(0o700)
        return
    done = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"root, and cannot mount a read-only folder here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_cache_dir_is_refused_naming_it(pack_dir, read_only_folder):
    with http_server(pack_dir) as server:
        with pytest.raises(ValueError, match=rf"^Shards: cache_dir '{read_only_folder}' cannot be a folder of "
                                             rf"shards \(.*(Read-only|Permission)"):
            Shards(server.url, cache_dir=read_only_folder)


def test_a_shard_that_stays_unreachable_is_retried_once_not_once_per_sample_under_skip(pack_dir, tmp_path):
    """A 503 that never ends for one shard: its samples are skipped and counted; before, every sample
    went through all the retries again (with the default retries and backoff, 15 s a sample: hours for
    a real shard of thousands)."""
    failing = "/shard-000003.tar"
    local = threading.local()

    class Requests(list):   # the server's handler records each request in its own thread, then asks _take
        def append(self, item):
            local.path = item[1]
            super().append(item)

    with http_server(pack_dir, Faults(fail_first=-1, status=503)) as server:
        server.requests = Requests()
        server._take = lambda kind, limit: kind == "fail" and getattr(local, "path", "") == failing
        source = Shards(server.url, cache_dir=tmp_path / "cache", window=2, retries=2)
        source.storage.backoff = 0.01
        samples = int((np.asarray(source.index.shard) == 3).sum())
        assert samples >= 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = make_loader(source, "torch", num_workers=0, on_error="skip", **KW)
            n = sum(len(y) for _, y in loader)
        assert n == 96 - samples
        assert any(f"skipped {samples} " in str(w.message) for w in caught)
        # The read-ahead thread's try and the first reader's: 3 requests each, not 3 per sample.
        assert server.count(failing) <= 2 * 3
        source.close()


def test_s3_requests_are_retried_retries_times_not_times_s3fs_and_botocores_own_retries(tmp_path):
    """An endpoint that closes every connection: ``retries=2`` is 3 attempts. s3fs (5 tries) and botocore
    (4 retries) retried inside each of ours, so a bucket that was down took minutes to be named."""
    import socket

    require("s3fs")
    from fastdata.shards.storage import Storage, StorageError
    from shard_servers import S3_KEYS

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    accepted, stop = [0], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted[0] += 1
            conn.close()                                  # closed before any answer: a dropped connection

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        storage = Storage("s3://bucket/ds", retries=2, backoff=0.01, timeout=5,
                          storage_options={"client_kwargs": {"endpoint_url": endpoint}, **S3_KEYS})
        with pytest.raises(StorageError, match=r"cannot download shard 'shard-000000\.tar' at "
                                               r"s3://bucket/ds/shard-000000\.tar: .*after 3 attempts") as caught:
            storage.fetch("shard-000000.tar", tmp_path / "x.tar", size=10)
        assert "testing" not in str(caught.value)         # the key and secret are never printed
        # aiohttp asks once more on a connection closed before any answer: at most 2 per attempt (was 150).
        assert 3 <= accepted[0] <= 2 * 3
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.mark.parametrize("code, status", [("SlowDown", 503), ("ServiceUnavailable", 503), ("InternalError", 500)])
def test_s3_throttling_and_5xx_as_s3fs_raises_them_are_retried(code, status):
    """s3fs turns S3's 503 SlowDown into OSError(EBUSY) with the ClientError as its cause: it was taken as
    final (now that s3fs's own loop no longer retries, the only retries are ours)."""
    require("s3fs")
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    from fastdata.shards.storage import is_transient

    error = ClientError({"Error": {"Code": code, "Message": "Please reduce your request rate."},
                         "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
    assert is_transient(translate_boto_error(error))
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    assert not is_transient(translate_boto_error(denied))


def test_half_files_of_a_killed_process_whose_pid_is_running_again_are_removed(pack_dir, tmp_path):
    """A container restarted on a kept cache_dir runs its trainer under the pid it had (PID 1, say):
    the half download and the reservations the killed run left carry a pid that is alive, were kept
    forever and counted against the budget, and with a small cache no room could ever be made (each
    read waited wait_timeout, 10 minutes, then failed)."""
    largest = _largest(pack_dir)
    cache = tmp_path / "cache"
    with http_server(pack_dir) as server:
        source = Shards(server.url, window=1, cache_dir=cache, cache_limit=2 * largest)
        names = [os.path.basename(source.cached_path(s.name)) for s in source.index.shards[:3]]
        source.close()
        pid = os.getpid()   # the killed run's pid, alive again
        left = [cache / f"{names[0]}.tmp-{pid}-0a1b2c3d", cache / f"{names[1]}.tmp-{pid}-reserved0a1b2c3d",
                cache / f"{names[2]}.tmp-{pid}-reserved4e5f6a7b"]
        left[0].write_bytes(b"\0" * (largest // 2))
        for marker in left[1:]:
            marker.touch()
        source = Shards(server.url, window=1, cache_dir=cache, cache_limit=2 * largest)
        assert not [p for p in left if p.exists()]
        source._cache.wait_timeout = 5.0          # were they kept, each read below would wait this long
        n = sum(len(y) for _, y in make_loader(source, "torch", num_workers=0, **KW))
        source.close()
    assert n == 96
    assert not list(cache.glob("*.tmp-*"))


def test_a_position_saved_under_another_window_is_refused_not_read_as_another_order(pack_dir):
    """window decides the epoch's order: a loader of window=4 resuming a window=2 run read 80 samples
    of which some the run had read and missed others, without a word."""
    kw = dict(KW, batch_size=8, num_workers=0)
    crashed = make_loader(Shards(pack_dir, window=2), "torch", **kw)
    it = iter(crashed)
    next(it), next(it)
    state = crashed.state_dict()
    del it
    other = make_loader(Shards(pack_dir, window=4), "torch", **kw)
    with pytest.raises(ValueError, match=r"cannot resume.*source was .*window=2.* and is now .*window=4"):
        other.load_state_dict(state)
    same = make_loader(Shards(pack_dir, window=2), "torch", **kw)
    same.load_state_dict(state)                          # the run's own window resumes
    rest = np.concatenate([ids for ids in same.batch_sampler])
    np.testing.assert_array_equal(np.sort(rest), np.sort(crashed.plan.order(0)[16:]))


def test_a_server_that_stops_answering_is_named_as_a_timeout_with_its_limit(pack_dir, tmp_path):
    """fsspec's FSTimeoutError has no text: the error read 'FSTimeoutError: (no message)'."""
    from fastdata.shards.storage import Storage, StorageError

    with http_server(pack_dir, Faults(delay=5.0)) as server:
        storage = Storage(server.url, retries=1, backoff=0.01, timeout=0.3)
        with pytest.raises(StorageError, match=r"shard 'shard-000000\.tar' at .*/shard-000000\.tar: FSTimeoutError: "
                                               r"no answer or no bytes for 0\.3 s \(timeout=\) .*after 2 attempts"):
            storage.fetch("shard-000000.tar", tmp_path / "x.tar", size=10)
        assert server.count("/shard-000000.tar") == 2
