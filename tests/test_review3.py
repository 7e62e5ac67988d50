"""Review of the round's changes (5df94b3..a438d7f): each test failed on the code before its fix."""
from __future__ import annotations

import json

import pytest

from fastdata.shards import index as shard_index
from fastdata.shards.index import BadIndex


# ---------------------------------------------------------------- the index's numpy fast path
def _index_bytes(n: int) -> bytes:
    from test_qa_carried_clients import _index_bytes as index_bytes  # an index as pack writes one

    return index_bytes(n)


def _same_as_plain_json(monkeypatch, data: bytes):
    """parse_index's outcome on ``data`` with the fast path, and the one json.loads gives."""
    def outcome():
        try:
            index = shard_index.parse_index(data, "index.json")
        except BadIndex as e:
            return "error", str(e)
        return "ok", index.offset.tolist(), index.labels.tolist(), index.source

    fast = outcome()
    monkeypatch.setattr(shard_index, "_load_json", json.loads)
    return fast, outcome()


@pytest.mark.parametrize("entries", [b"01, ,7", b"01,7, ", b"0 ,01, 3"])
def test_an_empty_entry_beside_a_leading_zero_is_refused_as_json_refuses_it(monkeypatch, entries):
    """numpy reads an entry of whitespace only ("1, ,2") as 0, a digit fewer than 0 written plainly; a
    leading zero elsewhere is a digit more: the digit count alone balanced, and the text was taken."""
    doc = _index_bytes(3_000)
    data = doc.replace(b'"label":[0,1,2,', b'"label":[' + entries + b",", 1)   # 3 entries for 3
    assert data != doc
    fast, plain = _same_as_plain_json(monkeypatch, data)
    assert plain[0] == "error" and "is not JSON" in plain[1]
    assert fast == plain


def test_a_string_spelling_the_array_mark_is_not_taken_for_an_array(monkeypatch):
    """An index whose samples.offset is a string that spells the mark the fast path puts in place of an
    array (here of the array under source), is refused as json.loads's parse refuses it (offset is not a
    list), not read with the other array as its offsets."""
    doc = json.loads(_index_bytes(3_000))
    doc["source"] = {"x": doc["samples"]["offset"]}
    for number in range(6):   # the mark of the array under source: its place among the document's arrays
        doc["samples"]["offset"] = f"\x00fastdata-array-{number}"
        data = json.dumps(doc, separators=(",", ":")).encode()
        with monkeypatch.context() as patch:
            fast, plain = _same_as_plain_json(patch, data)
        assert plain[0] == "error" and "samples.offset must be a list" in plain[1]
        assert fast == plain, number


def test_every_short_spelling_of_an_entry_parses_as_json_loads_parses_it():
    """Each string of up to 4 characters of digits, '-', ',', a space and a newline, placed first and last
    in a long array of integers: the fast path gives json.loads's result or its error (before, it took
    1,718 spellings of up to 6 characters that json.loads refuses, e.g. ' ,0' and '00,-')."""
    import itertools

    import numpy as np

    body = ",".join(["12"] * 1500)
    for n in range(1, 5):
        for chars in itertools.product("01-, \n9", repeat=n):
            entry = "".join(chars)
            for text in (f'{{"samples":{{"a":[{body},{entry}]}}}}', f'{{"samples":{{"a":[{entry}{body}]}}}}'):
                outcomes = []
                for parse in (json.loads, shard_index._load_json):
                    try:
                        value = parse(text.encode())["samples"]["a"]
                        outcomes.append(value.tolist() if isinstance(value, np.ndarray) else value)
                    except json.JSONDecodeError as e:
                        outcomes.append(str(e))
                assert outcomes[0] == outcomes[1], entry


# ---------------------------------------------------------------- cli.exit_with under torchrun
@pytest.fixture
def two_ranks(monkeypatch):
    """This process as rank 1 of 2 whose group's store is an in-memory one (no peer ever posts)."""
    import torch.distributed as dist

    from fastdata import distributed

    store = dist.HashStore()
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    return store


def test_a_rank_stopped_by_torchrun_while_it_waits_has_said_its_own_line(two_ranks, monkeypatch, capsys):
    """Rank 1 fails alone while rank 0 exits otherwise (a traceback): torchrun SIGTERMs rank 1 at once.
    Rank 1 waited EXIT_WAIT_S for the others' lines before printing its own, so the stop cut it off and
    the job's error was lost; before exit_with a rank printed its line at once. Its line is out before
    any wait now."""
    import time

    from fastdata import cli

    def stopped(seconds):   # torchrun's SIGTERM, as a handler that raises turns it
        raise SystemExit(143)

    monkeypatch.setattr(time, "sleep", stopped)
    with pytest.raises(SystemExit):
        raise cli.exit_with("error: --data-root: rank 1's folder is missing")
    assert "error: --data-root: rank 1's folder is missing" in capsys.readouterr().err


# ---------------------------------------------------------------- check_picklable's stand-ins
@pytest.mark.parametrize("nest", [lambda v: v, lambda v: {"views": [v]}], ids=["attribute", "nested"])
def test_check_picklable_still_refuses_a_memoryview(nest):
    """A memoryview cannot be pickled (TypeError), so spawn's workers fail at the first batch; the new
    pickler stood in for it as for bytes and passed the source (the check before refused it)."""
    import numpy as np

    from fastdata.datasets import ArraySource
    from fastdata.datasets.base import check_picklable

    source = ArraySource(np.zeros((4, 8, 8, 3), np.uint8), np.arange(4) % 2)
    source.header = nest(memoryview(b"a header"))
    with pytest.raises(TypeError, match="its attribute 'header' .*cannot pickle .*memoryview"):
        check_picklable(source, "multiprocessing_context='spawn'")


# ---------------------------------------------------------------- class names in checkpoints
def test_class_names_in_a_checkpoint_are_written_and_read_back(tmp_path):
    """loader.classes and source.classes are plain lists: as a read-only subclass (tried this session),
    torch.load(weights_only=True) (torch's default since 2.6) refused them, and fastdata.checkpoint.save
    refused to write them: a checkpoint that kept the class names with the weights no longer saved or
    loaded."""
    import io

    import numpy as np
    import torch

    from fastdata import checkpoint
    from fastdata.datasets import ArraySource

    source = ArraySource(np.zeros((4, 8, 8, 3), np.uint8), np.arange(4) % 2, classes=["cat", "dog"])
    checkpoint.save({"classes": source.classes}, tmp_path / "ck.pt")
    assert checkpoint.load(tmp_path / "ck.pt")["classes"] == ["cat", "dog"]
    buffer = io.BytesIO()
    torch.save({"classes": source.classes}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["classes"] == ["cat", "dog"]


# ---------------------------------------------------------------- read_index of a pack's other files
def test_read_index_of_a_shards_dali_index_in_capitals_says_what_the_file_is(tmp_path):
    """read_index refuses a '.IDX' without reading it (the suffix test ignores case), but the message
    that says what the file is tested '.idx' case-sensitively: the error read "index '...IDX' is " and
    stopped there."""
    import numpy as np

    from fastdata.datasets import ArraySource
    from fastdata.packing import pack
    from fastdata.shards import read_index

    out = tmp_path / "packed"
    pack(ArraySource(np.zeros((4, 8, 8, 3), np.uint8), np.arange(4) % 2), out, workers=0, progress=False)
    (out / "SHARD.IDX").write_text("0 512 100\n")
    with pytest.raises(BadIndex, match=r"SHARD.IDX' is a DALI index of one shard \('SHARD.tar'\), not the pack's"):
        read_index(out / "SHARD.IDX")


# ---------------------------------------------------------------- Shards.saved_fingerprint
def test_an_old_position_over_a_pack_whose_index_fingerprint_names_a_window_resumes_under_the_default(tmp_path):
    """A pack made from another pack (``pack(Shards(...), OUT)``) records that Shards' fingerprint, with
    its ' window=4', as its index's. A position saved over it before the window was recorded was still
    refused under the default window: the upgrade looked for ' window=' anywhere in the saved text, and
    removed the first one from this loader's (the index's, not the window's)."""
    import json

    from fastdata.datasets import ImageFolder, Shards
    from fastdata.datasets.folders import make_image_folder
    from fastdata.packing import pack

    pack(ImageFolder(make_image_folder(tmp_path / "photos", classes=2, per_class=3, seed=1)), tmp_path / "packed",
         workers=0, progress=False)
    index = json.loads((tmp_path / "packed" / "index.json").read_text())
    index["fingerprint"] = "Shards n=6 classes=2 index=ImageFolder(abc) window=4"   # as a repack writes it
    (tmp_path / "packed" / "index.json").write_text(json.dumps(index))
    source = Shards(tmp_path / "packed")
    old = f"Shards n=6 classes=2 index={index['fingerprint']}"   # the fingerprint before b328565
    with pytest.warns(RuntimeWarning, match="older fastdata"):
        assert source.saved_fingerprint(old) == source.fingerprint()
    assert Shards(tmp_path / "packed", window=2).saved_fingerprint(old) == old   # another window: refused


# ---------------------------------------------------------------- the memory backend's cache_size warning
def test_the_small_slots_warning_counts_the_cache_back_into_a_gpus_free_memory_only(monkeypatch):
    """On a GPU the budget is min(total - reserve - other caches, free). The cache just built has left the
    free memory, not the first bound; the warning added its bytes to the minimum, so where the first bound
    is the smaller one it said a cache_size=crop cache 'the budget allows' past the GPU's total."""
    import types

    import torch

    from fastdata.backends.memory import loader as memory_loader
    from fastdata.backends.memory.budgeting import Budget

    gpu, gib = torch.device("cuda", 0), 2**30
    # 80 GiB GPU, 8 GiB reserve: 72 GiB for caches; the 10 GiB cache built leaves 70 GiB free.
    monkeypatch.setattr(memory_loader, "budget", lambda device, reserve=None, exclude=None:
                        Budget(gpu, 80 * gib, 8 * gib, 0, 70 * gib))
    fake = types.SimpleNamespace(device=gpu, opts={"memory_reserve": None}, cache_size=256, source="photos")

    class Cache:   # len() = photos; nbytes: what the built cache holds
        nbytes = 10 * gib

        def __len__(self):
            return 180_000

    text = memory_loader.MemoryLoader._small_slots_text(fake, Cache(), 384)   # 180,000 x 384² x 3: 74 GiB
    assert text.endswith("74.16 GiB, more than the 72.00 GiB the budget allows: lower memory_reserve, or use the "
                         "'torch' or 'dali' backend, which crop from the full photo"), text


def test_read_index_of_a_url_reads_it_as_before(tmp_path):
    """read_index handed a URL (the folder or its index.json) to Storage, which reads it remotely; the
    checks of local files that replaced that call found no such file and said the URL was missing."""
    import numpy as np

    from fastdata.datasets import ArraySource
    from fastdata.packing import pack
    from fastdata.shards import read_index
    from shard_servers import http_server

    pack(ArraySource(np.zeros((4, 8, 8, 3), np.uint8), np.arange(4) % 2), tmp_path / "packed", workers=0,
         progress=False)
    with http_server(tmp_path) as server:
        assert len(read_index(f"{server.url}/packed")) == len(read_index(f"{server.url}/packed/index.json")) == 4


def test_an_index_nested_too_deep_for_the_json_parser_is_a_bad_index():
    """An index is untrusted input: arrays nested 100,000 deep raised json's RecursionError, naming
    neither the index nor the problem."""
    data = b'{"format": "fastdata-shards", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(BadIndex, match=r"index 'index.json' is not JSON \(it nests arrays or objects deeper than"):
        shard_index.parse_index(data, "index.json")
