"""How the ranks of one ``pack`` share a folder: each writes its part (``index.rank<r>.json``: its shards'
records and the files it refused), rank 0 merges the parts into ``index.json``, and every rank returns
only once that index exists. When any rank refused files, rank 0 lists them all in ``pack-refused.txt``
instead, publishes no index and says so in ``FAILED_NAME``, and every rank raises the same error.

With a ``torch.distributed`` process group the ranks meet at barriers; without one (``torchrun -m
fastdata pack`` starts none) rank 0 waits for the parts' files, and the other ranks for an
``index.json`` of this pack (its ``plan`` digest) that lists their shards as they wrote them, or for
rank 0's ``FAILED_NAME`` naming their part of this run (its ``token``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..shards.index import INDEX_NAME

#: Rank 0's word that this pack failed: its refused files, and the tokens of the parts it merged (each
#: rank's, new per run), so that a rank never takes an earlier run's failure for this run's.
FAILED_NAME = "pack-refused.json"


def has_group() -> bool:
    """Whether a ``torch.distributed`` process group exists (the ranks can meet at a barrier)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank, when there is a process group; else return at once."""
    import torch.distributed as dist

    if has_group():
        dist.barrier()


def drop_other_index(out: Path, plan_digest: str) -> None:
    """Remove ``out/index.json`` unless it is this pack's (the same plan: it describes the very shards
    this pack writes). Another pack's index left in place while shards are rewritten, and an
    interrupted re-pack, would describe new shards with the old labels."""
    path = out / INDEX_NAME
    try:
        with open(path, "rb") as f:
            same = json.loads(f.read()).get("plan") == plan_digest
    except FileNotFoundError:
        return
    except (OSError, ValueError, AttributeError):
        same = False
    if not same:
        path.unlink(missing_ok=True)


def _poll(ready, timeout: float | None, cap: float, timed_out):
    """``ready()``'s first result that is not None, called again after 0.05 s, doubling up to ``cap``;
    ``TimeoutError(timed_out())`` once ``timeout`` seconds have passed (None: wait as long as it takes)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.05
    while True:
        result = ready()
        if result is not None:
            return result
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(timed_out())
        time.sleep(delay)
        delay = min(delay * 2, cap)


def part_path(out: Path, rank: int) -> Path:
    """Rank ``rank``'s part of the pack in ``out``."""
    return out / f"index.rank{rank}.json"


def read_failure(out: Path, rank: int, token: str) -> dict | None:
    """Rank 0's ``FAILED_NAME`` document when it names this rank's part of this run (``token``), else None
    (none there, or an earlier run's: its refusals may since have been fixed)."""
    try:
        with open(out / FAILED_NAME, "rb") as f:
            doc = json.loads(f.read())
        tokens = doc["tokens"]
        return doc if 0 <= rank < len(tokens) and tokens[rank] == token else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wait_for_index(out: Path, plan_digest: str, mine: list, rank: int, token: str,
                   timeout: float | None) -> dict | None:
    """A rank other than 0, without a process group: return once ``out/index.json`` is this pack's
    (its plan) and lists this rank's shards as it wrote them (size and sha256): None; or once rank 0
    said that this run failed (``read_failure``): its document."""
    want = {r["name"]: (r["size"], r["sha256"]) for r in mine}
    seen = None

    def ready() -> dict | None:   # {} for the index: _poll takes the first result that is not None
        nonlocal seen
        failed = read_failure(out, rank, token)
        if failed is not None:
            return failed
        try:
            st = os.stat(out / INDEX_NAME)
            version = (st.st_ino, st.st_size, st.st_mtime_ns)
            if version != seen:   # an index of ImageNet is tens of MB: parsed again only when replaced
                seen = version
                with open(out / INDEX_NAME, "rb") as f:
                    doc = json.loads(f.read())
                listed = {s["name"]: (s["size"], s["sha256"]) for s in doc["shards"]}
                if doc.get("plan") == plan_digest and all(listed.get(k) == v for k, v in want.items()):
                    return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass   # not there yet, or being replaced
        return None

    return _poll(ready, timeout, 1.0, lambda: f"pack: rank {rank} waited {timeout:g} s for rank 0 to write "
                                              f"'{out / INDEX_NAME}' for this pack; run rank 0 with the same "
                                              f"arguments (it merges every rank's part into the index)") or None


#: How long a failing rank without a process group waits for the others to learn of the failure.
SEEN_WAIT_S = 10.0


def wait_until_every_rank_knows(out: Path, world: int) -> None:
    """A failed pack without a process group: wait (``SEEN_WAIT_S`` at most) until every rank has learnt
    that it failed, which each says by removing its part (rank 0 keeps them until then). Why: torchrun
    stops every other rank as soon as one exits with an error, and a rank stopped so never says it."""
    def ready() -> bool | None:
        return True if not any(part_path(out, r).exists() for r in range(world)) else None

    try:
        _poll(ready, SEEN_WAIT_S, 0.05, lambda: "")
    except TimeoutError:   # a rank gone (its own timeout, killed): not kept for the next run to merge
        for r in range(world):
            part_path(out, r).unlink(missing_ok=True)


def merge_parts(out: Path, world: int, config: dict, timeout: float | None) -> tuple[dict, list, list]:
    """Rank 0: once each ``index.rank<r>.json`` of this pack is there, every part's records (by shard
    name), the shards with refused files (each part's ``refused`` entries) and the parts' tokens (by
    rank). A part of another pack (another plan or world size, left by an earlier run) counts as not
    there yet."""
    records: dict = {}
    refused: list = []
    tokens: list = [None] * world
    missing = list(range(world))

    def ready() -> tuple | None:
        for r in list(missing):
            try:
                with open(part_path(out, r)) as f:
                    part = json.load(f)
            except (OSError, ValueError):
                continue
            if part.get("config") != config:
                continue
            for record in part["records"]:
                records[record["name"]] = record
            refused.extend(part.get("refused", []))
            tokens[r] = part.get("token")
            missing.remove(r)
        return None if missing else (records, refused, tokens)

    return _poll(ready, timeout, 2.0, lambda: f"pack: rank 0 waited {timeout:g} s for the parts of ranks {missing} "
                                              f"({', '.join(f'index.rank{r}.json' for r in missing)} in '{out}'); "
                                              f"run those ranks with the same arguments, or a part there is from "
                                              f"another pack")
