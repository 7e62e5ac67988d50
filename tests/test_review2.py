"""Second review of the session's changes: what a user's own code did with the list that
``ImageFolder.paths`` (and ``TarImages.members``) was, now a ``PathTable``, and what the changes claim."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fastdata.datasets.folders import ImageFolder, PathTable


def _folder(n=5):
    return ImageFolder.from_samples([(f"/data/c{i % 2}/img_{i}.jpg", i % 2) for i in range(n)], ["a", "b"],
                                    root="/data")


def test_paths_concatenate_with_a_list_as_the_list_did():
    """``folder.paths + extra`` (and ``extra + folder.paths``) built a longer list of paths; the
    PathTable raised TypeError (a Sequence has no ``+``)."""
    paths = _folder().paths
    extra = ["/more/x.jpg"]
    assert paths + extra == [*list(paths), "/more/x.jpg"] and isinstance(paths + extra, list)
    assert extra + paths == ["/more/x.jpg", *list(paths)] and isinstance(extra + paths, list)
    assert paths + paths == list(paths) * 2 and paths + () == list(paths)
    with pytest.raises(TypeError):
        paths + "x.jpg"   # a str is not a list of paths (the list refused it too)


def test_paths_compare_unequal_to_a_list_of_non_paths_instead_of_raising():
    """A list compared with anything is True or False; ``PathTable == [1, 2]`` raised TypeError from
    ``os.fspath`` (a user's ``if folder.paths == cached:`` with a cache of other things)."""
    paths = _folder(2).paths
    assert (paths == [1, 2]) is False and (paths != [1, 2]) is True
    assert ([1, 2] == paths) is False
    assert (paths == [None, 0.5]) is False
    assert paths == list(paths) and list(paths) == paths and not (paths != list(paths))


def test_take_is_not_many_times_the_table_in_memory():
    """``subset()`` of an ImageFolder gathers its paths with ``PathTable.take``. Vectorized over the
    whole table at once it built three int64 arrays of one entry per BYTE of path (24x the buffer):
    1.2 GB at its peak for ImageNet's 67 MB of paths, where the list it replaced took ~10 MB. Now in
    runs: the output, its copy when joined, and one run's indices."""
    n = 200_000
    table = PathTable(f"/data/imagenet/n{i % 1000:08d}/img_{i:09d}.JPEG" for i in range(n))
    blob = len(table._blob)
    idx = np.random.default_rng(0).permutation(n)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        got = table.take(idx)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * blob, f"take's peak {peak / 2**20:.0f} MiB for a table of {blob / 2**20:.0f} MiB"
    assert len(got) == n and all(got[j] == table[int(i)] for j, i in enumerate(idx[:1000]))
    assert got[n - 1] == table[int(idx[-1])] and got == [table[int(i)] for i in idx]


@pytest.mark.parametrize("idx", [[], [0], [4, 0], [3, 3, 1], list(range(5))[::-1]])
def test_take_keeps_order_and_handles_empty_and_repeated_indices(idx):
    folder = _folder()
    got = folder.paths.take(np.asarray(idx, dtype=np.int64))
    assert got == [folder.paths[i] for i in idx] and type(got) is PathTable
    assert PathTable().take(np.asarray([], dtype=np.int64)) == []


def test_a_peak_lr_refusal_names_the_argument_of_the_scheduler_in_use(tmp_path):
    """fit refuses a resume under another rate for any scheduler (a group's ``initial_lr``), not only
    OneCycleLR (``max_lr``); its advice said "Resume with max_lr=0.1" to a StepLR user, who has no
    max_lr: the rate is the optimizer's lr. OneCycleLR's wording is unchanged (test_engine_state)."""
    import pickle

    import torch
    from torch import nn

    from engine_helpers import ListLoader
    from fastdata.engine import fit
    from fastdata.engine.schedule import PeakLrChanged

    def run(lr, resume):
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        batches = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(2)]
        fit(model, ListLoader(batches), epochs=1 + resume, optimizer=optimizer,
            scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1), checkpoint=tmp_path / "c.pt", resume=resume,
            progress=False)

    run(0.1, False)
    with pytest.raises(PeakLrChanged, match=r"Resume with the optimizer's lr=0\.1, or start a new run") as info:
        run(0.5, True)
    assert "max_lr" not in str(info.value) and (info.value.was, info.value.now) == (0.1, 0.5)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
