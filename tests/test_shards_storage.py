"""fastdata.shards.storage against real servers on 127.0.0.1: a folder, file://, HTTP (with injected
faults) and S3 (moto's server, s3fs as the client). Every retry loop here is bounded by a small
``retries`` and ``backoff``."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest

from conftest import require
from fastdata.shards import storage as storage_mod
from fastdata.shards.storage import ShardNotFound, ShortRead, Storage, StorageError, check_name, redact
from shard_servers import Faults, http_server, s3_server

# Marked, not importorskip: in CI a missing fsspec fails these tests instead of skipping the module.
pytestmark = pytest.mark.requires("fsspec")

FAST = {"retries": 3, "backoff": 0.01}


@pytest.fixture
def shard_dir(tmp_path):
    """A folder with two shards of random bytes, one in a subfolder."""
    root = tmp_path / "remote"
    (root / "train").mkdir(parents=True)
    files = {"a.tar": os.urandom(70_000), "train/b.tar": os.urandom(1_234)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root, files


@pytest.fixture(params=["folder", "file-url", "http", "s3"])
def storage(request, shard_dir):
    """A Storage over the same two shards, read from each kind of location."""
    root, files = shard_dir
    if request.param == "folder":
        yield Storage(root, **FAST), files
    elif request.param == "file-url":
        yield Storage(f"file://{root}", **FAST), files
    elif request.param == "http":
        with http_server(root) as server:
            yield Storage(server.url, **FAST), files
    else:
        require("moto.server")
        with s3_server(files=files) as (url, options):
            yield Storage(url, storage_options=options, **FAST), files


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(retries=-1), ValueError, r"^Storage: retries must be an integer >= 0, got -1"),
    (dict(retries=2.5), TypeError, r"^Storage: retries must be an integer >= 0, got 2.5"),
    (dict(backoff=-0.1), ValueError, r"^Storage: backoff \(seconds\) must be a number >= 0, got -0.1"),
    (dict(timeout=0), ValueError, r"^Storage: timeout \(seconds\) must be a number > 0, got 0.0"),
    (dict(timeout=None), TypeError, r"^Storage: timeout \(seconds\) must be a number > 0, got None"),
])
def test_bad_storage_arguments_are_refused_by_name(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        Storage(tmp_path, **kwargs)


def test_reads_equal_the_file_bytes(storage, tmp_path):
    st, files = storage
    data = files["a.tar"]
    assert st.size("a.tar") == len(data)
    assert st.read("train/b.tar") == files["train/b.tar"]
    assert st.read_range("a.tar", 100, 5_000) == data[100:5_000]
    ranges = [(0, 1), (69_999, 70_000), (10, 10), (512, 40_000)]
    assert st.read_ranges("a.tar", ranges) == [data[s:e] for s, e in ranges]
    dest = tmp_path / "local" / "a.tar"
    dest.parent.mkdir()
    assert st.fetch("a.tar", dest) == str(dest)
    assert dest.read_bytes() == data
    assert os.listdir(dest.parent) == ["a.tar"]          # no temporary file left beside it


def test_storage_is_picklable_and_reads_after_the_trip(shard_dir):
    root, files = shard_dir
    with http_server(root) as server:
        st = Storage(server.url, **FAST)
        st.read_range("a.tar", 0, 10)                    # the original holds a live session now
        copy = pickle.loads(pickle.dumps(st))
        assert copy.read_range("a.tar", 5, 50) == files["a.tar"][5:50]


def test_500s_are_retried_and_succeed(shard_dir):
    root, files = shard_dir
    with http_server(root, Faults(fail_first=2)) as server:
        st = Storage(server.url, **FAST)
        assert st.read_range("a.tar", 0, 1000) == files["a.tar"][:1000]
        assert server.count("/a.tar") == 3


def test_retries_leave_the_global_random_stream_alone(shard_dir):
    """The retries' jitter comes from a generator of their own. Drawn from the global ``random`` (as it
    was), a retry in a reading thread moved the user's stream, and with it the draws of a batch
    transform seeded from it, whenever the network failed."""
    import random

    root, files = shard_dir
    random.seed(7)
    expected = random.getstate()
    with http_server(root, Faults(fail_first=2)) as server:
        assert Storage(server.url, **FAST).read_range("a.tar", 0, 100) == files["a.tar"][:100]
        assert server.count("/a.tar") == 3
    assert random.getstate() == expected


def test_a_dropped_connection_is_retried_and_succeeds(shard_dir):
    root, files = shard_dir
    with http_server(root, Faults(drop_first=2)) as server:
        st = Storage(server.url, **FAST)
        assert st.read_ranges("a.tar", [(0, 60_000)]) == [files["a.tar"][:60_000]]
        assert server.count("/a.tar") == 3


def test_a_slow_server_times_out_and_is_retried(shard_dir):
    root, files = shard_dir
    with http_server(root, Faults(delay=5.0, delay_first=1)) as server:
        st = Storage(server.url, timeout=0.3, **FAST)
        assert st.read_range("a.tar", 0, 100) == files["a.tar"][:100]
        assert server.count("/a.tar") == 2


def test_persistent_500s_end_in_an_error_naming_shard_and_url_without_credentials(shard_dir):
    root, _ = shard_dir
    with http_server(root, Faults(fail_first=-1)) as server:
        location = server.url.replace("http://", "http://alice:s3cret@")
        st = Storage(location, **FAST)
        with pytest.raises(StorageError) as info:
            st.read_range("a.tar", 0, 100)
        assert server.count("/a.tar") == FAST["retries"] + 1
    message = str(info.value)
    assert "'a.tar'" in message and f"{server.url}/a.tar" in message and "500" in message
    assert "after 4 attempts" in message
    assert "s3cret" not in message and "alice" not in message
    assert "s3cret" not in repr(st) and "s3cret" not in st.url("a.tar")
    # The underlying error (whose text may hold the raw URL) is quoted, not chained.
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert info.value.transient and info.value.attempts == 4


def test_a_404_is_final_at_once(shard_dir):
    root, _ = shard_dir
    with http_server(root) as server:
        st = Storage(server.url, **FAST)
        with pytest.raises(ShardNotFound, match="missing.tar") as info:
            st.read_range("missing.tar", 0, 10)
        assert server.count("/missing.tar") == 1
        assert isinstance(info.value, FileNotFoundError) and info.value.attempts == 1


def test_a_missing_s3_key_is_final_at_once(shard_dir):
    require("moto.server")
    with s3_server(files={"a.tar": b"x" * 10}) as (url, options):
        st = Storage(url, storage_options=options, **FAST)
        with pytest.raises(ShardNotFound, match="nope.tar") as info:
            st.read("nope.tar")
        assert info.value.attempts == 1
        assert "testing" not in str(info.value)         # the keys passed in storage_options


def test_a_short_read_is_retried_then_named(shard_dir):
    root, files = shard_dir
    with http_server(root, Faults(short_first=1)) as server:
        st = Storage(server.url, **FAST)
        assert st.read_range("a.tar", 0, 8_000) == files["a.tar"][:8_000]
        assert server.count("/a.tar") == 2
        server.faults = Faults(short_first=-1)
        with pytest.raises(ShortRead) as info:
            st.read_range("a.tar", 0, 8_000)
    assert info.value.expected == 8_000 and info.value.got == 4_000
    assert "expected 8000, got 4000" in str(info.value) and "'a.tar'" in str(info.value)


def test_a_read_past_the_end_is_a_short_read(shard_dir):
    root, _ = shard_dir
    st = Storage(root, retries=0)
    with pytest.raises(ShortRead, match="expected 20, got 10"):
        st.read_range("a.tar", 69_990, 70_010)


def test_an_interrupted_fetch_leaves_no_file_under_the_final_name(shard_dir, tmp_path):
    root, _ = shard_dir
    dest_dir = tmp_path / "cache"
    dest_dir.mkdir()
    with http_server(root, Faults(drop_first=-1)) as server:
        st = Storage(server.url, **FAST)
        with pytest.raises(StorageError, match="'a.tar'"):
            st.fetch("a.tar", dest_dir / "a.tar", size=70_000)
    assert os.listdir(dest_dir) == []


def test_a_fetch_stopped_by_ctrl_c_leaves_no_file(shard_dir, tmp_path, monkeypatch):
    root, _ = shard_dir
    dest = tmp_path / "a.tar"

    def copy_half_then_interrupt(src, dst):
        with open(src, "rb") as f, open(dst, "wb") as out:
            out.write(f.read(100))
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copyfile", copy_half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        Storage(root, **FAST).fetch("a.tar", dest)
    assert os.listdir(tmp_path) == ["remote"]


def test_a_download_of_the_wrong_size_is_retried_then_refused(shard_dir, tmp_path):
    root, _ = shard_dir
    with http_server(root) as server:
        st = Storage(server.url, **FAST)
        with pytest.raises(ShortRead, match="expected 80000, got 70000"):
            st.fetch("a.tar", tmp_path / "a.tar", size=80_000)      # the index says 80000: it lies
        assert server.count("/a.tar", "GET") == FAST["retries"] + 1
    assert not (tmp_path / "a.tar").exists()


def test_a_full_disk_is_raised_as_it_is(shard_dir, tmp_path, monkeypatch):
    """ENOSPC is the local disk's, not the storage's: not retried, not renamed, for the cache to handle."""
    root, _ = shard_dir
    calls = []

    def full(src, dst):
        calls.append(dst)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(OSError) as info:
        Storage(root, **FAST).fetch("a.tar", tmp_path / "a.tar")
    assert info.value.errno == 28 and not isinstance(info.value, StorageError) and len(calls) == 1


@pytest.mark.parametrize("url, hidden, kept", [
    ("https://user:pass@host:8443/data/a.tar", ["user", "pass"], "https://host:8443/data/a.tar"),
    ("https://bucket.s3.amazonaws.com/a.tar?X-Amz-Credential=AKIA1234&X-Amz-Signature=deadbeef",
     ["AKIA1234", "deadbeef"], "X-Amz-Signature=REDACTED"),
    ("simplecache::https://u:p@host/x?token=abc", ["u:p", "abc"], "simplecache::https://host/x?token=REDACTED"),
    ("error for 'https://h/a?sig=xyz' and 'https://h/b'", ["xyz"], "'https://h/b'"),
])
def test_redact_hides_what_a_url_carries_as_credentials(url, hidden, kept):
    out = redact(url)
    assert all(h not in out for h in hidden)
    assert kept in out


@pytest.mark.parametrize("name", ["../a.tar", "/etc/passwd", "a/../../b.tar", "a//b.tar", "", "a\\b.tar",
                                  "c:/x.tar", "./a.tar", "a/.."])
def test_names_that_could_escape_the_folder_are_refused(name, shard_dir):
    with pytest.raises(ValueError, match="refused|non-empty"):
        check_name(name)
    with pytest.raises(ValueError):
        Storage(shard_dir[0], **FAST).read(name)


def test_plain_relative_names_are_accepted():
    assert check_name("train/shard-000.tar") == "train/shard-000.tar"
    assert check_name("a..b.tar") == "a..b.tar"


def test_a_url_whose_filesystem_is_not_installed_says_what_to_install(monkeypatch):
    with pytest.raises(ImportError, match="nosuch://"):
        Storage("nosuch://bucket/x")
    monkeypatch.setitem(__import__("sys").modules, "gcsfs", None)     # as if gcsfs were not installed
    with pytest.raises(ImportError, match="pip install gcsfs"):
        Storage("gs://bucket/x")


def test_a_local_folder_needs_no_fsspec(shard_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "fsspec", None)
    root, files = shard_dir
    assert Storage(root).read_range("train/b.tar", 1, 4) == files["train/b.tar"][1:4]


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ShardNotFound, match="nowhere"):
        Storage(tmp_path / "nowhere")


def test_transient_and_final_errors_are_told_apart():
    assert storage_mod.is_transient(ConnectionResetError())
    assert storage_mod.is_transient(TimeoutError())
    assert not storage_mod.is_transient(FileNotFoundError("x"))
    assert not storage_mod.is_transient(PermissionError("x"))
    assert not storage_mod.is_transient(ValueError("x"))
    cause = ConnectionRefusedError()
    wrapped = FileNotFoundError("x")
    wrapped.__cause__ = cause            # fsspec's HTTP info() after a refused HEAD and GET
    assert storage_mod.is_transient(wrapped)
