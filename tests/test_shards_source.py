"""fastdata.datasets.Shards: packed shards read by every backend, from a folder, over HTTP and from S3
(servers the tests start on 127.0.0.1), with the contract's order, sharding and resume."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from conftest import BACKENDS, pairs
from fastdata import Augmentation, make_loader
from fastdata.datasets import ImageFolder, Shards, make_image_folder
from fastdata.errors import DecodeError
from shard_servers import Faults, http_server, s3_server

NONE = Augmentation(crop="center", size=32)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A folder of 60 photos in 3 classes, and its shards (about 6 photos a shard)."""
    from fastdata.packing import pack

    root = tmp_path_factory.mktemp("shards")
    folder = make_image_folder(root / "photos", classes=3, per_class=20, seed=1)
    out = root / "packed"
    pack(ImageFolder(folder), out, shard_size=6 * 100_000, progress=False)   # ~90 KB photos: ~6 a shard
    return ImageFolder(folder), out


def _batches(loader):
    return [(x.cpu().numpy(), y.cpu().numpy()) for x, y in loader]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_reads_shards_as_it_reads_the_folder(packed, backend):
    folder, out = packed
    shards = Shards(out)
    assert len(shards) == len(folder) and shards.classes == folder.classes
    kw = dict(batch_size=16, device="cpu", train=False, augment=NONE, num_workers=2)
    # Closed when read: a dali loader's reader threads stop here, not whenever the collector gets to it.
    with make_loader(shards, backend, **kw) as loader:
        from_shards = _batches(loader)
    with make_loader(folder, backend, **kw) as loader:
        from_folder = _batches(loader)
    shards.close()
    assert len(from_shards) == len(from_folder) == 4
    for (xs, ys), (xf, yf) in zip(from_shards, from_folder):
        np.testing.assert_array_equal(ys, yf)            # the packed order is the folder's
        np.testing.assert_allclose(xs, xf, atol=1e-6)    # the same bytes decode to the same pixels


def test_a_shuffled_epoch_reads_each_sample_once_window_by_window_and_resumes_exactly(packed):
    _, out = packed
    shards = Shards(out, window=2)
    kw = dict(batch_size=8, device="cpu", augment=NONE, num_workers=0, shuffle=True, drop_last=False, seed=3)
    loader = make_loader(shards, "torch", **kw)
    order = loader.plan.order(0)
    np.testing.assert_array_equal(np.sort(order), np.arange(len(shards)))
    # The order is the shards' own (shard windows), not a permutation of everything: cut into windows
    # of 2 shards (in the order the epoch first reaches them), each window's samples fill one stretch
    # of the order, all of them, before any other shard's.
    shard_of = shards.index.shard[order]
    reached = list(dict.fromkeys(shard_of.tolist()))
    sizes = np.bincount(shard_of, minlength=len(shards.index.shards))
    at = 0
    for w in range(0, len(reached), 2):
        window = reached[w:w + 2]
        span = int(sizes[window].sum())
        assert set(shard_of[at:at + span].tolist()) == set(window), (w, shard_of.tolist())
        at += span
    assert at == len(order) and len(reached) >= 6
    first = _batches(loader)
    assert not np.array_equal(loader.plan.order(1), order)
    # Interrupted after 3 batches, resumed in a new loader: the rest is the uninterrupted run's.
    again = make_loader(Shards(out, window=2), "torch", **kw)
    it = iter(again)
    for _ in range(3):
        next(it)
    state = again.state_dict()
    resumed = make_loader(Shards(out, window=2), "torch", **kw)
    resumed.load_state_dict(state)
    rest = _batches(resumed)
    assert len(rest) == len(first) - 3
    for (a, la), (b, lb) in zip(rest, first[3:]):
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_read_disjoint_parts_that_cover_the_epoch(packed, world):
    _, out = packed
    seen = []
    for rank in range(world):
        loader = make_loader(Shards(out), "memory", batch_size=4, device="cpu", augment=NONE, shuffle=True,
                             drop_last=False, rank=rank, world_size=world, seed=1)
        seen.append(np.concatenate([b for b in loader.batch_sampler]))
    ids = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(ids), np.arange(60))


def test_shards_over_http_are_fetched_whole_into_the_cache_once(packed, tmp_path):
    folder, out = packed
    with http_server(out) as server:
        shards = Shards(server.url, cache_dir=tmp_path / "cache", window=2)
        loader = make_loader(shards, "torch", batch_size=16, device="cpu", train=False, augment=NONE,
                             num_workers=2)
        try:
            got = _batches(loader)
        finally:
            shards.close()   # its read-ahead thread stops here, not whenever the collector gets to it
        tars = [name for name in os.listdir(out) if name.endswith(".tar")]
        # Each shard downloaded once (a GET each, whoever asked first: the prefetcher or a worker).
        assert all(server.count(name, "GET") == 1 for name in tars), server.requests
    ref = _batches(make_loader(folder, "torch", batch_size=16, device="cpu", train=False, augment=NONE,
                               num_workers=0))
    for (a, la), (b, lb) in pairs(got, ref):
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_allclose(a, b, atol=1e-6)
    # Cached under their identity: STEM.<16 hex digits of the sha256>.tar.
    digests = {s.name: s.sha256[:16] for s in Shards(out).index.shards}
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.tar")) == \
        sorted(f"{name[:-4]}.{digests[name]}.tar" for name in tars)


def test_shards_from_s3_train_through_the_dali_and_memory_backends(packed, tmp_path):
    _, out = packed
    files = {p.name: p.read_bytes() for p in Path(out).iterdir() if p.is_file()}
    with s3_server(files=files) as (url, options):
        for backend in ("memory", "dali"):
            shards = Shards(url, cache_dir=tmp_path / backend, storage_options=options)
            loader = make_loader(shards, backend, batch_size=16, device="cpu", augment=Augmentation(
                crop="random_resized", size=24, hflip=0.5), num_workers=1)
            try:
                labels = np.concatenate([y.numpy() for _, y in loader])
            finally:
                loader.close()
                shards.close()
            assert len(labels) == 48 and set(labels.tolist()) <= {0, 1, 2}


def test_a_corrupt_shard_is_a_decode_error_naming_the_member_and_skip_passes_it(packed, tmp_path):
    import shutil

    _, out = packed
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    tar = bad / "shard-000000.tar"
    data = bytearray(tar.read_bytes())
    data[600:2000] = b"\0" * 1400          # the first member's JPEG bytes, past its header
    tar.write_bytes(bytes(data))
    shards = Shards(bad, cache_dir=tmp_path / "verdicts")
    with pytest.raises(DecodeError, match=r"shard-000000\.tar:00000000\.jpg.*not the one the index describes"
                                          r".*sha256"):
        list(make_loader(shards, "torch", batch_size=8, device="cpu", train=False, augment=NONE, num_workers=0))
    # The shard's digest is not the index's: every sample of it is refused (its other members' bytes are
    # intact, but nothing proves they are the ones the index describes), the other shards are read.
    in_first = int((shards.index.shard == 0).sum())
    loader = make_loader(Shards(bad, cache_dir=tmp_path / "verdicts"), "torch", batch_size=8, device="cpu",
                         train=False, augment=NONE, num_workers=0, on_error="skip")
    with pytest.warns(RuntimeWarning, match=f"skipped {in_first} undecodable"):
        n = sum(len(y) for _, y in loader)
    assert n == 60 - in_first and in_first > 1


def test_offsets_that_lie_are_refused_and_a_shard_that_disagrees_with_its_index_too(packed, tmp_path):
    import json
    import shutil

    from fastdata.shards.index import BadIndex

    _, out = packed
    bad = tmp_path / "lying"
    shutil.copytree(out, bad)
    doc = json.loads((bad / "index.json").read_text())
    samples = doc["samples"]
    assert samples["shard"][0] == samples["shard"][1]
    samples["offset"][0], samples["offset"][1] = samples["offset"][1], samples["offset"][0]
    (bad / "index.json").write_text(json.dumps(doc))
    with pytest.raises(BadIndex, match="index.json"):
        Shards(bad)
    # An index true to itself over a shard that is not the one it describes (another pack's shard of
    # the same layout): the member's tar header names another sample, and the read says so.
    shutil.copy(out / "index.json", bad / "index.json")
    tar = bad / "shard-000000.tar"
    data = bytearray(tar.read_bytes())
    start = samples["offset"][1] - 512   # the first image member's header (offset 0 swapped in above)
    assert data[start:start + 12] == b"00000000.jpg"
    data[start:start + 12] = b"00000099.jpg"
    header = data[start:start + 512]
    header[148:156] = b" " * 8
    data[start + 148:start + 156] = b"%06o\0 " % sum(header)
    tar.write_bytes(bytes(data))
    with pytest.raises(DecodeError, match=r"not the one the index describes.*sha256"):
        Shards(bad, cache_dir=tmp_path / "verdicts").read(0)     # the shard's digest is not the index's
    # Even with the index's digest of that shard, its member headers are checked at each read.
    import hashlib

    doc = json.loads((out / "index.json").read_text())
    doc["shards"][0]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (bad / "index.json").write_text(json.dumps(doc))
    with pytest.raises(DecodeError, match="holds '00000099.jpg' at offset .* the index does not describe"):
        Shards(bad, cache_dir=tmp_path / "verdicts").read(0)


# ------------------------------------------------------------------ errors about the index
# The index (index.json, the pack's manifest) is not a shard: its errors name it as the index, with its
# full address, what is wrong and what to do; a shard's errors keep naming the shard.
def _without_index(out, tmp_path) -> Path:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    (bare / "index.json").unlink()
    return bare


def _index_error(error, pack: bool = True) -> str:
    """``error``'s message, which names the index, not a shard; ``pack``: and says what writes one."""
    message = str(error)
    assert "shard 'index.json'" not in message and "shard index" not in message, message
    assert not pack or "python -m fastdata pack" in message, message
    return message


@pytest.mark.parametrize("kind", ["folder", "file-url", "http", "s3"])
def test_a_missing_index_is_named_as_the_index_at_its_address(packed, tmp_path, kind):
    import contextlib

    from conftest import require

    bare = _without_index(packed[1], tmp_path)
    with contextlib.ExitStack() as stack:
        options = None
        if kind == "folder":
            location, where = str(bare), str(bare / "index.json")
        elif kind == "file-url":
            location = where = f"file://{bare}"
            where += "/index.json"
        elif kind == "http":
            location = stack.enter_context(http_server(bare)).url
            where = f"{location}/index.json"
        else:
            require("moto.server")
            files = {p.name: p.read_bytes() for p in bare.iterdir()}
            location, options = stack.enter_context(s3_server(files=files))
            where = f"{location}/index.json"
        with pytest.raises(FileNotFoundError) as info:
            Shards(location, storage_options=options, retries=1, cache_dir=tmp_path / "cache")
    message = _index_error(info.value)
    assert message.startswith(f"cannot read the index at {where}: "), message
    assert "it is missing" in message, message
    assert ("check the URL" if kind in ("http", "s3") else "the folder that `python -m fastdata pack` wrote") \
        in message, message


def test_a_local_index_that_cannot_be_read_or_parsed_says_why(packed, tmp_path):
    _, out = packed
    bare = _without_index(out, tmp_path)
    where = bare / "index.json"
    where.mkdir()                                    # a folder in the index's place
    with pytest.raises(OSError) as info:
        Shards(bare)
    message = _index_error(info.value)
    assert message.startswith(f"cannot read the index at {where}: IsADirectoryError: [Errno 21]"), message
    where.rmdir()
    text = (out / "index.json").read_bytes()
    where.write_bytes(text[: len(text) // 3])        # an interrupted copy
    with pytest.raises(ValueError) as info:
        Shards(bare)
    message = _index_error(info.value)
    assert message.startswith(f"index '{where}' is truncated: its {len(text) // 3} bytes end inside"), message
    if os.geteuid() != 0:                            # root reads a file of mode 000 all the same
        where.write_bytes(text)
        where.chmod(0)
        try:
            with pytest.raises(PermissionError) as info:
                Shards(bare)
        finally:
            where.chmod(0o644)
        message = _index_error(info.value)
        assert "[Errno 13]" in message and "permissions" in message, message


def test_the_index_file_given_as_the_location_says_to_give_its_folder(packed):
    _, out = packed
    with pytest.raises(FileNotFoundError) as info:
        Shards(out / "index.json")
    message = str(info.value)
    assert message.startswith(f"shard location '{out / 'index.json'}' is a file, not a folder"), message
    assert f"give the folder that holds it: '{out}'" in message, message


def test_an_index_server_that_fails_is_named_with_the_url_and_what_to_do(packed, tmp_path):
    _, out = packed
    with http_server(out, Faults(fail_first=-1)) as server:     # every request: 500
        with pytest.raises(OSError) as info:
            Shards(server.url, retries=1, timeout=5, cache_dir=tmp_path / "cache")
    message = _index_error(info.value, pack=False)   # the server, not the pack, is at fault
    assert message.startswith(f"cannot read the index at {server.url}/index.json: ClientResponseError: 500"), message
    assert "after 2 attempts" in message and "check the URL and that the server is up" in message, message
    with http_server(out, Faults(fail_first=-1, status=403)) as server:
        with pytest.raises(OSError) as info:
            Shards(server.url, retries=1, cache_dir=tmp_path / "cache")
    message = _index_error(info.value, pack=False)
    assert message.startswith(f"cannot read the index at {server.url}/index.json: ClientResponseError: 403"), message
    assert "refused" in message and "credentials" in message, message
    # A server that answers with a web page (a login, a proxy's error) instead of the index.
    page = tmp_path / "page"
    page.mkdir()
    (page / "index.json").write_text("<html><body>Please sign in</body></html>")
    with http_server(page) as server:
        with pytest.raises(ValueError) as info:
            Shards(server.url, cache_dir=tmp_path / "cache")
    message = _index_error(info.value)
    assert message.startswith(f"index '{server.url}/index.json' is not JSON"), message
    assert "looks like HTML" in message and "check the URL" in message, message


def test_a_missing_shard_is_still_named_as_the_shard(packed, tmp_path):
    import shutil

    _, out = packed
    gone = tmp_path / "gone"
    shutil.copytree(out, gone)
    (gone / "shard-000000.tar").unlink()
    with http_server(gone) as server:
        shards = Shards(server.url, retries=1, cache_dir=tmp_path / "cache")
        try:
            with pytest.raises(DecodeError) as info:   # its samples' error, naming the shard
                shards.read(0)
        finally:
            shards.close()
    message = str(info.value)
    assert "shard 'shard-000000.tar'" in message and f"{server.url}/shard-000000.tar" in message, message
    assert "the index" not in message.split(":")[0], message


def test_a_subset_of_shards_reads_its_own_samples_window_by_window(packed):
    _, out = packed
    shards = Shards(out, window=2)
    picked = np.random.default_rng(0).permutation(len(shards))   # every sample, in another order
    sub = shards.subset(picked)
    order = sub.epoch_order(1, 0)                                  # positions into the subset
    np.testing.assert_array_equal(np.sort(order), np.arange(len(sub)))
    shard_of = shards.index.shard[picked[order]]
    # A window of 2 shards at a time: each shard's samples are read in one stretch of at most 2 shards.
    first_seen = {int(s): k for k, s in reversed(list(enumerate(shard_of)))}
    last_seen = {int(s): k for k, s in enumerate(shard_of)}
    for s in first_seen:
        assert len(set(shard_of[first_seen[s]: last_seen[s] + 1].tolist())) <= 2
    loader = make_loader(sub, "torch", batch_size=16, device="cpu", augment=NONE, num_workers=0,
                         shuffle=True, drop_last=False)
    labels = np.concatenate([y.numpy() for _, y in loader])
    np.testing.assert_array_equal(np.sort(labels), np.sort(shards.labels))
    assert sub.read(0) == shards.read(int(picked[0]))


def test_the_next_epochs_first_shards_are_fetched_while_a_pass_ends(packed, tmp_path, request):
    """With a cache that holds only the window being read and the next (the smallest allowed), the
    window the next epoch starts with is downloaded during this pass's last batches, not while every
    reader of the next pass waits for it, and nothing evicts it before the next pass reads it."""
    import time

    _, out = packed
    with http_server(out) as server:
        from fastdata.shards.index import read_index

        largest = max(s.size for s in read_index(out / "index.json").shards)
        shards = Shards(server.url, cache_dir=tmp_path / "cache", window=2, cache_limit=4 * largest)
        request.addfinalizer(shards.close)   # closed even when an assertion below fails
        loader = make_loader(shards, "torch", batch_size=8, device="cpu", augment=NONE, num_workers=0, seed=5)
        first_pass = sum(1 for _ in loader)
        assert first_pass == len(loader) and loader.epoch == 1
        upcoming = shards.epoch_order(5, 1)
        seen, names = set(), []
        for j in shards._ids[upcoming]:          # the next epoch's shards, in the order it first reads them
            name = shards.index.shards[int(shards.index.shard[j])].name
            if name not in seen:
                seen.add(name)
                names.append(name)
        start = names[:2]                        # its first window
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(os.path.exists(shards.cached_path(n)) for n in start):
            time.sleep(0.05)
        assert all(os.path.exists(shards.cached_path(n)) for n in start), (start, server.requests,
                                                                            shards._prefetcher.error)
        gets = server.count(method="GET")
        fetched = {n: server.count(n, "GET") for n in start}
        next(iter(loader))                       # the next pass starts on shards already here
        # nothing evicted them before the pass read them: not one more GET of either
        assert {n: server.count(n, "GET") for n in start} == fetched, server.requests
        assert server.count(method="GET") - gets <= len(names) - len(start)
        shards.close()


@pytest.mark.parametrize("where", ["local", "http"])
def test_many_threads_reading_through_few_open_files_get_every_samples_own_bytes(packed, tmp_path, where):
    """dali's reader threads read one Shards at once. With window=1 two shard files stay open, so the
    threads keep closing and opening them under each other: each must still get its own sample's bytes
    (an unlocked cache of descriptors raised KeyError and EBADF, and a closed number reused by another
    shard's open would have read that shard). Over HTTP the threads read the cache's copies, whose
    mtime each use stamps (the eviction order): 2% of the reads failed as "the file changed at each of
    3 reads" while the other threads' uses kept changing it."""
    import contextlib
    import threading

    folder, out = packed
    reference = Shards(out, window=4)
    expected = [reference.read(i) for i in range(len(reference))]
    with contextlib.ExitStack() as stack:
        location = out if where == "local" else stack.enter_context(http_server(out)).url
        shards = Shards(location, window=1, **({"cache_dir": tmp_path / "cache"} if where == "http" else {}))
        stack.callback(shards.close)
        errors, rng = [], np.random.default_rng(0)
        # Over HTTP, every thread in the pass's order: all of them on one shard at a time, as dali's are.
        orders = [rng.permutation(len(shards)) if where == "local" else np.arange(len(shards)) for _ in range(6)]

        def reader(order):
            try:
                for _ in range(3):
                    for i in order:
                        assert shards.read(int(i)) == expected[int(i)], int(i)
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(repr(e))

        threads = [threading.Thread(target=reader, args=(o,)) for o in orders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        assert len(shards._files._open) <= 2
    reference.close()


def _read_ahead(shards: Shards):
    """The source's read-ahead thread, started by telling it a pass begins."""
    shards.reading(shards.epoch_order(0, 0), 0)
    thread = shards._prefetcher._thread
    assert thread.is_alive() and thread.name == "fastdata-shards"
    return thread


def test_a_shards_source_dropped_without_close_stops_its_read_ahead_thread(packed, tmp_path):
    """The thread held the prefetcher, not the source: a source dropped without close() was collected
    and its thread waited for work forever (one more per dropped source, for the life of the process)."""
    import gc
    import threading

    _, out = packed
    before = {t for t in threading.enumerate() if t.name == "fastdata-shards"}
    shards = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=2)
    thread = _read_ahead(shards)
    del shards
    gc.collect()
    # Stopped and joined by the collection itself: nothing left to wait for.
    assert not thread.is_alive()
    assert {t for t in threading.enumerate() if t.name == "fastdata-shards"} <= before
    closed = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=2)
    thread = _read_ahead(closed)
    closed.close()
    assert not thread.is_alive()
    closed.close()                                   # a second close() is a no-op


def test_a_shards_source_left_open_at_exit_stops_its_read_ahead_thread(packed, tmp_path):
    """At interpreter exit the source's read-ahead thread is stopped (not abandoned mid-download to the
    interpreter's teardown). The check runs in an exit hook registered first, so it runs last."""
    import subprocess
    import sys

    _, out = packed
    script = f"""
import atexit
state = {{}}
atexit.register(lambda: print("alive at exit:", state["thread"].is_alive()))
from fastdata.datasets import Shards
shards = Shards({f"file://{out}"!r}, cache_dir={str(tmp_path / "cache")!r}, window=2)
shards.reading(shards.epoch_order(0, 0), 0)
state["thread"] = shards._prefetcher._thread
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "alive at exit: False" in done.stdout, (done.stdout, done.stderr)


def _read_in_child(shards: Shards, parents, result) -> None:
    shards.read(0)                      # the first read in this process drops the parent's prefetcher
    result.put(not parents.alive and shards._stop_ahead is None)


def test_a_forked_copy_never_stops_its_parents_read_ahead_thread(packed, tmp_path):
    """A forked DataLoader worker inherits the source with the parent's prefetcher and its stopper. The
    child must not run that stopper when its copy is collected: the thread is not in the child, and the
    Condition it would take may have been copied locked by that thread. The parent's thread runs on."""
    import multiprocessing as mp

    _, out = packed
    shards = Shards(f"file://{out}", cache_dir=tmp_path / "cache", window=2)
    try:
        thread = _read_ahead(shards)
        ctx = mp.get_context("fork")
        result = ctx.Queue()
        child = ctx.Process(target=_read_in_child, args=(shards, shards._stop_ahead, result))
        child.start()
        assert result.get(timeout=60) is True
        child.join(timeout=60)
        assert child.exitcode == 0
        assert thread.is_alive() and shards._stop_ahead.alive
    finally:
        shards.close()
    assert not thread.is_alive()
