"""Defects carried over from earlier rounds in the shards, distributed and client-library paths:
``read_index`` given a file other than ``index.json``, one ``error:`` line for a refusal every rank shares,
accelerate's ``remainder`` when a padding sample is skipped, the Lightning example's guard of
ModelCheckpoint's private methods, where bench's and pack's progress bars draw, and the index's memory."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fastdata.datasets import ArraySource
from fastdata.packing import pack
from fastdata.shards import read_index
from fastdata.shards.index import BadIndex, IndexNotFound

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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


# ---------------------------------------------------------------- one error line per job under torchrun
EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    import argparse
    from fastdata import cli
    from fastdata import distributed as fdist
    from fastdata.checkpoint import CheckpointError

    case = sys.argv[1]
    if case == "alone":
        cli.EXIT_WAIT_S = 2.0   # rank 1 fails alone: it waits this long for the others
    fdist.init_distributed("cpu")
    rank = fdist.rank()
    args = argparse.Namespace(checkpoint=None, checkpoint_every=None, resume=True)

    def refuse():
        raise CheckpointError("checkpoint 'ck.pt' is truncated or corrupt")

    try:
        with cli.fit_errors(args):
            if case == "same":
                raise FloatingPointError("the loss went nan at step 3")
            if case == "differ":
                raise FloatingPointError(f"the loss went nan on rank {rank}")
            if case == "alone" and rank == 1:
                raise FloatingPointError("the loss went nan on rank 1 alone")
            if case == "relayed":   # rank 0 reads the checkpoint, rank 1 gets its verdict (PreparationError)
                fdist.decide_on_main(refuse, what="reading checkpoint 'ck.pt' on rank 0")
        time.sleep(4)   # rank 0 of "alone": still training while rank 1 decides
    finally:
        fdist.cleanup(barrier=False)
""")


def _torchrun_fails(script, *args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("case, lines", [
    ("same", ["error: the loss went nan at step 3"]),
    ("relayed", ["error: --checkpoint: checkpoint 'ck.pt' is truncated or corrupt"]),
    ("differ", ["error: the loss went nan on rank 0", "error: the loss went nan on rank 1"]),
    ("alone", ["error: the loss went nan on rank 1 alone"]),
])
def test_an_error_every_rank_shares_is_said_once_and_one_a_rank_has_alone_is_said(tmp_path, case, lines):
    script = tmp_path / "fail.py"
    script.write_text(EXIT_SCRIPT)
    assert sorted(_torchrun_fails(script, case, cwd=tmp_path)) == lines


def test_the_mnist_script_refusing_a_resume_under_torchrun_says_it_once(tmp_path):
    (tmp_path / "ck.pt").write_bytes(b"junk")
    said = _torchrun_fails(EXAMPLES / "train_mnist.py", "--data", "synthetic", "--data-root", str(tmp_path),
                           "--train-size", "256", "--test-size", "64", "--epochs", "1", "--batch-size", "64",
                           "--workers", "0", "--backend", "memory", "--device", "cpu", "--no-progress",
                           "--checkpoint", str(tmp_path / "ck.pt"), "--resume", cwd=tmp_path)
    assert len(said) == 1 and said[0].startswith(f"error: --checkpoint: checkpoint '{tmp_path / 'ck.pt'}'"), said
