"""Defects carried over from earlier rounds in the shards, distributed and client-library paths:
``read_index`` given a file other than ``index.json``, one ``error:`` line for a refusal every rank shares,
accelerate's ``remainder`` when a padding sample is skipped, the Lightning example's guard of
ModelCheckpoint's private methods, where bench's and pack's progress bars draw, and the index's memory."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from fastdata.datasets import ArraySource
from fastdata.packing import pack
from fastdata.shards import read_index
from fastdata.shards.index import BadIndex, IndexNotFound


# ---------------------------------------------------------------- read_index of a file
@pytest.fixture
def packed(tmp_path):
    rng = np.random.default_rng(0)
    out = tmp_path / "packed"
    pack(ArraySource(rng.integers(0, 256, (6, 8, 8, 3), dtype=np.uint8), np.arange(6) % 2), out,
         shard_size="1KB", workers=0, progress=False)
    return out


def test_read_index_reads_an_index_under_another_name(packed):
    shutil.copy(packed / "index.json", packed / "other.json")
    index = read_index(packed / "other.json")
    assert len(index) == 6 and index.labels.tolist() == [0, 1] * 3
    assert len(read_index(packed)) == len(read_index(packed / "index.json")) == 6


@pytest.mark.parametrize("name, says", [
    ("shard-000000.tar", "is a tar file (a shard), not an index"),
    ("shard-000000.idx", "is a DALI index of one shard ('shard-000000.tar')"),
    ("shard-000000.json", "is the record pack writes beside shard 'shard-000000.tar'"),
])
def test_read_index_refuses_a_packs_other_files_naming_the_file_and_what_to_give(packed, name, says):
    with pytest.raises(BadIndex) as e:
        read_index(packed / name)
    assert f"index '{packed / name}' {says}" in str(e.value)
    assert f"give the folder '{packed}' or its index.json" in str(e.value)


def test_read_index_of_a_json_that_is_not_an_index_names_it_and_the_format(packed):
    (packed.parent / "notes.json").write_text('{"a": 1}')
    with pytest.raises(BadIndex, match=r"index '.*notes.json': format is None, expected 'fastdata-shards'"):
        read_index(packed.parent / "notes.json")
    with pytest.raises(IndexNotFound, match=r"index '.*missing.json' is missing: there is no such file"):
        read_index(packed / "missing.json")
