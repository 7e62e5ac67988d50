"""Shards as a user who keeps data in shards runs them, second pass: the faults that test_qa_shards and
test_shards_* leave out. A source that must travel to spawn/forkserver workers, S3 without credentials,
a shard written in place while a reader holds it open, and what the other tests do not cover
(tars written by other tools, per-epoch downloads of a large shard). Every server is started here on
127.0.0.1; every data set is made here."""
from __future__ import annotations

import os
import pickle

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
