"""Defects carried over from earlier rounds in the shards, distributed and client-library paths:
``read_index`` given a file other than ``index.json``, one ``error:`` line for a refusal every rank shares,
accelerate's ``remainder`` when a padding sample is skipped, the Lightning example's guard of
ModelCheckpoint's private methods, where bench's and pack's progress bars draw, and the index's memory."""
from __future__ import annotations

import io
import json
import os
import re
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


def test_shards_given_another_file_of_a_pack_says_it_reads_the_folders_index_json(packed):
    """Shards reads a pack's folder (its index.json); given a copy of an index under another name, it
    said 'give the folder that holds it', whose index.json may be another index than the file given."""
    from fastdata.datasets import Shards
    from fastdata.shards.storage import ShardNotFound

    shutil.copy(packed / "index.json", packed / "other.json")
    with pytest.raises(ShardNotFound) as e:
        Shards(packed / "other.json")
    assert str(e.value) == (f"shard location '{packed / 'other.json'}' is a file, not a folder: a shard location "
                            f"is the folder `python -m fastdata pack` wrote, whose index.json is read "
                            f"('{packed}' has one)")


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
        cli.EXIT_WAIT_S = 2.0   # rank 1 fails alone (it prints at once; only a relay would wait this long)
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


# ---------------------------------------------------------------- accelerate: remainder under on_error="skip"
SKIP_GATHER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from accelerate import Accelerator
    from fastdata import Augmentation, make_loader
    from fastdata import distributed as fdist
    from fastdata.datasets import ImageFolder

    accelerator = Accelerator(cpu=True)
    # 37 photos, 2 ranks x batch 4: the last step holds 5 (32-36), split 3 + 3 with sample 0 as padding.
    loader = make_loader(ImageFolder(sys.argv[1]), "torch", batch_size=4, train=False, even_batches=True,
                         on_error="skip", num_workers=0, device="cpu", augment=Augmentation.imagenet_eval(size=16),
                         quiet=True)
    assert accelerator.prepare(loader) is loader
    gathered = []
    for images, labels in loader:
        # Ids as objects: under skip the ranks' batches differ in length, which a tensor all-gather cannot take.
        gathered += accelerator.gather_for_metrics(loader.batch_ids.tolist(), use_gather_object=True)
    with open(os.path.join(sys.argv[2], f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"gathered": gathered, "remainder": loader.remainder, "skipped": loader.skipped_ids.tolist()}, f)
    fdist.cleanup()
    accelerator.end_training()
""")


def _two_ranks_over_photos(tmp_path, broken: int, script_text: str) -> None:
    """``script_text`` run by torchrun on 2 CPU ranks, given a folder of 37 photos whose ``broken``-th
    is not a photo, and ``tmp_path`` for what it writes; it must exit 0."""
    from fastdata.datasets import ImageFolder, make_image_folder

    root = make_image_folder(tmp_path / "photos", classes=1, per_class=37, size_range=((20, 30), (20, 30)))
    Path(ImageFolder(root).sample_name(broken)).write_bytes(b"not a photo")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    script = tmp_path / "script.py"
    script.write_text(script_text)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(root), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.requires("accelerate")
@pytest.mark.parametrize("broken", [
    0,    # the padding sample (and the epoch's first): skipped at both places
    33,   # a real sample of the padded last step: its rank's last batch is one row short
], ids=["padding-skipped", "real-skipped"])
def test_gather_for_metrics_counts_each_readable_sample_once_when_one_of_the_last_step_is_skipped(tmp_path, broken):
    _two_ranks_over_photos(tmp_path, broken, SKIP_GATHER_SCRIPT)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert broken in r0["skipped"] + r1["skipped"]
    assert r0["gathered"] == r1["gathered"] and r0["remainder"] == r1["remainder"]
    assert sorted(r0["gathered"]) == [i for i in range(37) if i != broken]   # each readable sample once


ONE_RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import accelerate.state   # imported, as transformers imports it, but no Accelerator is made
    import torch.distributed as dist
    from fastdata import Augmentation, make_loader
    from fastdata.datasets import ImageFolder

    dist.init_process_group("gloo")
    done = os.path.join(sys.argv[2], "done")
    if dist.get_rank() == 0:   # rank 0 alone reads the evaluation set (a plain DDP program may)
        loader = make_loader(ImageFolder(sys.argv[1]), "torch", batch_size=4, train=False, even_batches=True,
                             on_error="skip", num_workers=0, device="cpu", augment=Augmentation.imagenet_eval(size=16),
                             quiet=True)
        rows = sum(len(labels) for _, labels in loader)
        open(done, "w").write(str(rows))
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
""")


@pytest.mark.requires("accelerate")
def test_a_program_without_an_accelerator_reading_on_one_rank_does_not_wait_on_the_others(tmp_path):
    """The ranks' sum of real rows at the last batch is for gather_for_metrics, which needs an Accelerator
    on every rank: a program that only imported accelerate and reads a loader on rank 0 alone hung in it."""
    _two_ranks_over_photos(tmp_path, 33, ONE_RANK_SCRIPT)
    assert (tmp_path / "done").read_text() == "18"   # rank 0's half (19 planned, 1 skipped), padding included


# ---------------------------------------------------------------- the Lightning example's private-method guard
@pytest.mark.requires("lightning")
def test_the_lightning_example_falls_back_when_a_private_save_method_takes_other_arguments(monkeypatch, tmp_path):
    """The --max-steps save calls ModelCheckpoint's private methods with the arguments of today's Lightning.
    A release that kept a name but changed its arguments passed the name check, then failed with a
    TypeError at the stop's batch, mid-training; it now warns and trains with Lightning's own saves."""
    import functools
    import inspect

    import lightning as L

    from conftest import load_example

    example = load_example("lightning_mnist")
    base = L.pytorch.callbacks.ModelCheckpoint
    real = base._save_last_checkpoint

    # Another release's method: a third argument it needs. Lightning's own hooks (that release's callers)
    # still reach the real one; the signature is what the example reads.
    @functools.wraps(real)
    def changed(self, *args, **kwargs):
        return real(self, *args[:2], **kwargs)

    params = list(inspect.signature(real).parameters.values())
    reason = inspect.Parameter("reason", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    changed.__signature__ = inspect.Signature([*params, reason])
    monkeypatch.setattr(base, "_save_last_checkpoint", changed)
    argv = ["--backend", "memory", "--data", "synthetic", "--data-root", str(tmp_path / "d"), "--train-size", "256",
            "--test-size", "64", "--batch-size", "32", "--workers", "0", "--epochs", "1", "--no-progress",
            "--ckpt-dir", str(tmp_path / "ck"), "--max-steps", "4"]
    with pytest.warns(RuntimeWarning, match=r"ModelCheckpoint has _save_last_checkpoint\(self, trainer, "
                                            r"monitor_candidates, reason\), not _save_last_checkpoint\(self, "
                                            r"trainer, candidates\): a run that --max-steps stops mid-epoch"):
        result = example.main(example.get_args_parser().parse_args(argv))
    assert result["global_step"] == 4 and (tmp_path / "ck" / "last.ckpt").exists()
    monkeypatch.undo()
    assert example._changed_private_methods(base) == []   # today's Lightning: the example's calls bind


# ---------------------------------------------------------------- where bench's and pack's bars draw
class _KernelStream(io.StringIO):
    """What a Jupyter kernel makes ``sys.stderr``: ipykernel's OutStream, which is no terminal."""

    def isatty(self):
        return False


_KernelStream.__module__ = "ipykernel.iostream"


@pytest.mark.parametrize("stream", ["notebook", "pipe"])
def test_bench_and_pack_draw_their_bars_where_fits_bar_draws(stream, monkeypatch, tmp_path):
    """bench drew on a terminal only (nothing in a notebook, whose stderr is no terminal) and pack
    everywhere (its bar redrawn into a pipe or a log file). Both now ask ``engine.meter.shows_live``,
    fit's own decision: a terminal or a notebook, never a pipe."""
    from fastdata import make_loader
    from fastdata.bench import measure_loader
    from fastdata.engine import meter

    err = _KernelStream() if stream == "notebook" else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert meter.shows_live(err) == (stream == "notebook")
    rng = np.random.default_rng(1)
    src = ArraySource(rng.integers(0, 256, (24, 8, 8, 3), dtype=np.uint8), np.arange(24) % 3)
    loader = make_loader(src, "memory", batch_size=4, device="cpu", num_workers=0, quiet=True)
    try:
        measure_loader(loader, batches=4, warmup=1, progress=True)
    finally:
        loader.close()
    bench_shown = err.getvalue()
    err.seek(0)
    err.truncate()
    pack(src, tmp_path / "packed", shard_size="4KB", workers=0, progress=True)
    pack_shown = err.getvalue()
    if stream == "notebook":
        assert "memory:" in bench_shown and "/5 [" in bench_shown, bench_shown
        assert "pack packed" in pack_shown and "/24 [" in pack_shown, pack_shown
    else:
        assert bench_shown == pack_shown == "", (bench_shown, pack_shown)


# ---------------------------------------------------------------- the memory of opening a large index
def _index_bytes(n: int, per: int = 1000) -> bytes:
    """An ``index.json`` of ``n`` samples, ``per`` to a shard, as the index module writes one."""
    from fastdata.shards.index import index_document

    rng = np.random.default_rng(0)
    size = rng.integers(20_000, 200_000, n)
    blocks = 1 + (size + 511) // 512   # each member: a header block, then its data padded to blocks
    shard = np.arange(n) // per
    offset, shards = np.zeros(n, np.int64), []
    for j in range(-(-n // per)):
        b = blocks[j * per:(j + 1) * per]
        offset[j * per:(j + 1) * per] = (np.concatenate([[0], np.cumsum(b)[:-1]]) + 1) * 512
        shards.append({"name": f"shard-{j:06d}.tar", "size": int(b.sum() + 2) * 512, "samples": len(b),
                       "sha256": "0" * 64})
    samples = {"shard": shard.tolist(), "offset": offset.tolist(), "size": size.tolist(), "ext": [0] * n,
               "label": (np.arange(n) % 1000).tolist(), "exts": ["jpg"]}
    doc = index_document(shards=shards, classes=[f"n{i:08d}" for i in range(1000)], samples=samples, key_width=8,
                         fingerprint="f", source={"name": "imagenet-like"})
    return json.dumps(doc, separators=(",", ":")).encode()


def test_a_large_index_is_parsed_into_arrays_without_lists_of_python_ints(tmp_path):
    """Opening ImageNet's index (1.28 M samples) took ~320 MB at its peak for a moment: json.loads made five
    lists of 1.28 M Python ints (36 bytes each) before they became int64 arrays. The per-sample arrays are
    now parsed by numpy from the text: measured in a fresh process on 200,000 samples, parse_index's peak
    (the arrays it keeps, 40 bytes a sample, included) is about 83 bytes a sample (it was about 200), and
    the index is the same."""
    path = tmp_path / "index.json"
    path.write_bytes(_index_bytes(200_000))
    script = textwrap.dedent(f"""
        import tracemalloc
        from fastdata.shards.index import parse_index
        data = open({str(path)!r}, "rb").read()
        tracemalloc.start()
        index = parse_index(data, "index.json")
        print(tracemalloc.get_traced_memory()[1], len(index))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    peak, n = map(int, out.stdout.split())
    assert n == 200_000 and peak / n < 120, f"{peak / n:.0f} bytes a sample at the peak"
    index = read_index(path)
    plain = json.loads(path.read_bytes())["samples"]
    for field, array in [("shard", index.shard), ("offset", index.offset), ("size", index.size),
                         ("ext", index.ext_code), ("label", index.labels)]:
        assert array.dtype == np.int64 and array.tolist() == plain[field], field


@pytest.mark.parametrize("field, first, error", [
    # JSON forbids leading zeros; numpy would read them: the plain parse refuses the text.
    ("label", b"00", r"is not JSON \(Expecting ',' delimiter"),
    # Past int64 numpy would clip; the plain parse reads it and the field check names it.
    ("offset", b"9223372036854775808", r"samples.offset must hold 64-bit integers; entry 0"),
    ("size", b"1.5", r"samples.size must hold 64-bit integers; entry 0 is 1.5"),
    ("shard", b"-", r"is not JSON"),
    ("ext", b"true", r"samples.ext"),
])
def test_a_large_index_with_an_entry_numpy_would_misread_is_refused_as_json_refuses_it(monkeypatch, field, first,
                                                                                       error):
    """Each such array is left to json.loads: the error is the very one the plain parse gives."""
    from fastdata.shards import index as shard_index

    data = re.sub(rb'"%s":\[-?[0-9]+' % field.encode(), b'"%s":[%s' % (field.encode(), first), _index_bytes(5_000),
                  count=1)
    with pytest.raises(BadIndex, match=error) as fast:
        shard_index.parse_index(data, "index.json")
    monkeypatch.setattr(shard_index, "_load_json", json.loads)   # the parse before numpy read the arrays
    with pytest.raises(BadIndex) as plain:
        shard_index.parse_index(data, "index.json")
    assert str(fast.value) == str(plain.value)


def test_an_array_of_integers_inside_a_string_or_outside_samples_is_left_to_json():
    from fastdata.shards.index import parse_index

    doc = json.loads(_index_bytes(2_000))
    numbers = "[" + ",".join(map(str, range(2_000))) + "]"
    doc["source"] = {"note": f"copied from {numbers}", "counts": list(range(2_000))}
    index = parse_index(json.dumps(doc, separators=(",", ":")).encode(), "index.json")
    assert index.source == doc["source"] and index.labels.tolist() == doc["samples"]["label"]
