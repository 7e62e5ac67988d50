"""fastdata/__init__.py: the package's front door names what the README promises, and importing it does
not pull in the shard writer."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

import fastdata


def test_every_exported_name_resolves():
    for name in fastdata.__all__:
        assert getattr(fastdata, name) is not None, name
    assert {"pack", "Shards", "make_loader"} <= set(dir(fastdata))


def test_pack_then_shards_from_the_package_reads_the_samples_back(tmp_path):
    # Issue 24 promises fastdata.pack(source, out); what it writes reads back as fastdata.Shards(out).
    from fastdata.datasets import ArraySource

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    labels = np.array([0, 1, 2, 0, 1, 2])
    report = fastdata.pack(ArraySource(images, labels), tmp_path / "out", progress=False, workers=0)
    assert report.samples == 6
    shards = fastdata.Shards(tmp_path / "out")
    assert len(shards) == 6 and list(shards.labels) == labels.tolist()


def test_importing_fastdata_leaves_the_shard_writer_unloaded():
    code = "import sys, fastdata; print('fastdata.packing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_an_unknown_attribute_is_still_an_attribute_error():
    try:
        fastdata.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("fastdata.no_such_name did not raise")
