"""Write the upgrade fixtures of tests/test_qa_upgrade.py with the fastdata that is importable (an old
release). Run from outside the repository, with the old revision first on the path:

    git worktree add /tmp/old-REV REV
    cd /tmp && PYTHONPATH=/tmp/old-REV /work/main/.venv/bin/python \\
        /work/main/tests/data/upgrade/make_fixture.py /work/main/tests/data/upgrade/REV

It uses only what every release since the first (effeab8) has: ``fit``'s keywords, ``make_loader``,
``state_dict()``, and (where the release has them) ``pack``, ``Shards`` and ``log_dir``. The model and the
run are defined in ``upgrade_run.py`` beside this file, which the tests import too: the same run
resumed by this version must end on the old release's weights.
"""
import json
import os
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from upgrade_run import BACKENDS, _accepts, loader_args, run  # noqa: E402

import fastdata  # noqa: E402
from fastdata import make_loader  # noqa: E402
from fastdata.datasets import SyntheticDigits  # noqa: E402


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(fastdata.__file__)))
    rev = subprocess.run(["git", "-C", repo, "log", "-1", "--format=%h %cd", "--date=iso"],
                         capture_output=True, text=True, check=True).stdout.strip()
    meta = {"revision": rev, "fastdata": fastdata.__file__}
    logs = _accepts(fastdata.fit, "log_dir")
    # The whole run (its last weights: what a resume must end on), then the same run crashed at its 6th
    # step: mid.pt is its save at step 4 (checkpoint_every=4), mid-epoch 1 of 2.
    _, model = run(f"{out}/full.pt", log_dir=None)
    torch.save(model.state_dict(), f"{out}/full_weights.pt")
    os.remove(f"{out}/full.pt")
    run(f"{out}/mid.pt", crash_at=6, log_dir=f"{out}/runlog" if logs else None)
    for junk in ("mid.pt.lock", "runlog/runlog.lock"):
        if os.path.exists(f"{out}/{junk}"):
            os.remove(f"{out}/{junk}")
    # Each backend's position after 2 batches, and the labels a resumed loader must read from there.
    states, expect = {}, {}
    for backend in BACKENDS:
        loader = make_loader(SyntheticDigits(48, seed=2), backend=backend, **loader_args(backend))
        it = iter(loader)
        next(it), next(it)
        states[backend] = loader.state_dict()
        expect[backend] = {"rest": [y.tolist() for _, y in it], "next_epoch": [y.tolist() for _, y in loader]}
        loader.close()
    if hasattr(fastdata, "pack"):
        from fastdata.datasets import Shards

        fastdata.pack(SyntheticDigits(12, seed=4), f"{out}/packed", shard_size="1MB", progress=False)
        shards = Shards(f"{out}/packed")
        loader = make_loader(shards, backend="torch", batch_size=4, device="cpu", seed=1, num_workers=0)
        it = iter(loader)
        next(it)
        states["shards"] = loader.state_dict()
        expect["shards"] = {"rest": [y.tolist() for _, y in it], "fingerprint": shards.fingerprint(),
                            "labels": [int(y) for y in shards.labels]}
        loader.close()
    torch.save(states, f"{out}/loader_states.pt")
    json.dump({"meta": meta, "loaders": expect}, open(f"{out}/expect.json", "w"), indent=1)
    shutil.rmtree(f"{out}/__pycache__", ignore_errors=True)


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]))
