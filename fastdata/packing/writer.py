"""``pack``: write a source as tar shards, their DALI ``.idx`` files and ``index.json``; see the
package's docstring for the layout, interruptions and ranks."""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import itertools
import json
import os
import re
import sys
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

import numpy as np

from ..checks import check_choice, check_integer
from ..config import default_workers
from ..datasets.spec import SPLITS
from ..shards.index import INDEX_NAME, MAX_MEMBER_BYTES, TAR_BLOCK, index_document, write_dali_index, write_json_atomic
from ..shards.storage import file_sha256
from .ranks import (
    FAILED_NAME,
    barrier,
    drop_other_index,
    has_group,
    merge_parts,
    part_path,
    read_failure,
    wait_for_index,
    wait_until_every_rank_knows,
)
from .reader import PACK_VERSION, RefusedFile, SampleReader, one_line

if TYPE_CHECKING:
    from ..datasets.base import Source

#: Files named in full in a refusal's one-line message; all of them are in OUT's ``REFUSED_LIST``.
_SHOWN = 3
REFUSED_LIST = "pack-refused.txt"


class RefusedFiles(ValueError):
    """Files of the source that ``pack`` did not copy (``RefusedFile`` each, ``refused``), in ``shards``
    shards that were therefore not written; the others were. Raised once the pack has gone through every
    shard, so one run names every such file. The message is one line (the command prints it as it is)."""

    def __init__(self, refused: list, shards: list, written: int = 0, listed: str | None = None):
        self.refused, self.shards, self.written, self.listed = list(refused), list(shards), written, listed
        super().__init__(self._message())

    def __reduce__(self):   # a worker's shard refusal, rebuilt whole in the parent
        return type(self), (self.refused, self.shards, self.written, self.listed)

    def _message(self) -> str:
        kept = f"; the {self.written} other shard(s) are written and kept" if self.written else ""
        if len(self.refused) == 1:
            return f"{self.refused[0]}{kept}"
        # Consecutive files refused for one reason (every sample of a damaged shard) share its words.
        shown = ", ".join(", ".join(f"'{one_line(r.name)}'" for r in run) + f" ({one_line(why)})" for why, run in
                          ((why, list(run)) for why, run in itertools.groupby(self.refused[:_SHOWN], lambda r: r.why)))
        more = f", and {len(self.refused) - _SHOWN} more" if len(self.refused) > _SHOWN else ""
        where = f" (all listed in '{self.listed}')" if self.listed and more else ""
        return (f"pack: {len(self.refused)} files of the source cannot go into a shard, so {len(self.shards)} "
                f"shard(s) are not written: {shown}{more}{where}{kept}; pack copies only images it can read: "
                f"remove or fix these files, then pack again")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*\Z", re.IGNORECASE)


def parse_size(text) -> int:
    """Bytes from ``256MB``, ``1.5GiB``, ``100kb`` or a plain integer (decimal units: KB = 1000, binary
    units: KiB = 1024). Anything else is a ``ValueError`` naming the accepted forms."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"shard size {text!r} is not a size; use bytes or a number with a unit: "
                             f"256MB, 1GB, 512MiB ({', '.join(u for u in _UNITS if u)})")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise ValueError(f"shard size {text!r} must be at least 1 byte")
    return value


@dataclass(frozen=True)
class ShardPlan:
    index: int
    name: str
    start: int      # first sample id
    stop: int       # one past the last
    identity: str   # digest of the inputs (see SampleReader.shard_identity)


def plan_shards(estimates: np.ndarray, shard_size: int) -> list[tuple[int, int]]:
    """[start, stop) sample ranges: consecutive samples until the next would take the shard's estimated
    tar bytes past ``shard_size`` (a shard holds at least one sample). Depends on the estimates only,
    so a re-run plans the same shards."""
    # Per sample: the image's header and padded data, and the .cls member (header + one block).
    cost = TAR_BLOCK + (estimates + TAR_BLOCK - 1) // TAR_BLOCK * TAR_BLOCK + 2 * TAR_BLOCK
    ranges, start, used = [], 0, 0
    for i, c in enumerate(cost.tolist()):
        if i > start and used + c > shard_size:
            ranges.append((start, i))
            start, used = i, 0
        used += c
    if len(cost):
        ranges.append((start, len(cost)))
    return ranges


class _HashingFile:
    """A write-only file that hashes and counts what passes through (tarfile asks for ``tell``)."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.n += len(data)
        return len(data)

    def tell(self) -> int:
        return self.n


def _member(name: str, size: int) -> tarfile.TarInfo:
    # Fixed metadata: a re-pack of the same data gives byte-identical tars (and the same sha256).
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class OutputError(OSError):
    """Writing into OUT failed for a reason of OUT's own (its disk full, over quota, read-only): an
    ``OSError`` with its errno, whose message names the file and OUT (not the source)."""


#: What only writing can fail with: reading the source never fills a disk.
_OUT_ERRNOS = {errno.ENOSPC, errno.EROFS, getattr(errno, "EDQUOT", 122)}


@contextlib.contextmanager
def _writing(what: str, out):
    """Turn an ``OSError`` of OUT's own (``_OUT_ERRNOS``) raised inside into an ``OutputError`` naming ``what``."""
    try:
        yield
    except OSError as e:
        if e.errno not in _OUT_ERRNOS or isinstance(e, OutputError):
            raise
        raise OutputError(e.errno, f"cannot write {what} in '{out}': {e.strerror or e}; free space there (or "
                                   f"make it writable), or give another OUT; finished shards are kept and a "
                                   f"re-run writes only the others") from None


def write_shard(reader: SampleReader, plan: ShardPlan, out: str, key_width: int, progress=None) -> dict:
    """Write shard ``plan`` into folder ``out`` (temporary name, then ``os.replace``), then its DALI ``.idx``
    and its record ``NAME.json``; returns the record. A full disk is an ``OutputError`` naming the shard."""
    with _writing(f"shard '{os.path.join(out, plan.name)}'", out):
        return _write_shard(reader, plan, out, key_width, progress)


def _write_shard(reader: SampleReader, plan: ShardPlan, out: str, key_width: int, progress=None) -> dict:
    final = os.path.join(out, plan.name)
    for stale in glob.glob(glob.escape(final) + ".tmp-*"):   # left by a killed run: this shard is ours now
        os.remove(stale)
    tmp = f"{final}.tmp-{os.getpid()}"
    offsets, sizes, exts, labels, dali = [], [], [], [], []
    shapes: set[tuple | None] = set()
    refused: list[RefusedFile] = []
    try:
        with open(tmp, "wb") as f:
            hashed = _HashingFile(f)
            # USTAR: every header is exactly one block, so a member's data starts 512 bytes after it.
            # (tarfile's stub asks for a readable, seekable file; writing a stream it only writes and tells.)
            with tarfile.open(fileobj=cast(IO[bytes], hashed), mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(plan.start, plan.stop):
                    try:
                        ext, data, label, shape = reader.read(i)
                        if len(data) > MAX_MEMBER_BYTES:   # read_index would refuse the whole index for it
                            raise RefusedFile(
                                f"pack: sample {i} ({reader.describe(i)}) is {len(data):,} bytes, past the image "
                                f"limit of {MAX_MEMBER_BYTES:,} bytes that shard readers accept; re-encode "
                                f"large photos with max_side (--max-side)", reader.source.sample_name(i),
                                f"{len(data):,} bytes, past the limit of {MAX_MEMBER_BYTES:,}: use --max-side")
                    except RefusedFile as e:
                        refused.append(e)
                    if refused:   # this shard will not be published: its other files are only checked
                        if progress is not None:
                            progress(1)
                        continue
                    shapes.add(shape)
                    key = f"{i:0{key_width}d}"
                    members = sorted([(ext, data), ("cls", str(label).encode())])
                    entry = []
                    for member_ext, payload in members:
                        offset = tar.offset + TAR_BLOCK
                        tar.addfile(_member(f"{key}.{member_ext}", len(payload)), io.BytesIO(payload))
                        entry.append((member_ext, offset, len(payload), f"{key}.{member_ext}"))
                        if member_ext == ext:
                            offsets.append(offset)
                            sizes.append(len(payload))
                    exts.append(ext)
                    labels.append(label)
                    dali.append(entry)
                    if progress is not None:
                        progress(1)
            if refused:
                raise RefusedFiles(refused, [plan.name])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    stem = os.path.splitext(final)[0]
    write_dali_index(stem + ".idx", dali)
    record = {"name": plan.name, "size": hashed.n, "samples": plan.stop - plan.start, "sha256": hashed.sha.hexdigest(),
              "start": plan.start, "identity": plan.identity,
              # The arrays' (H, W, C) when every image of the shard has it (None: files, or mixed sizes).
              "shape": list(only) if len(shapes) == 1 and (only := next(iter(shapes))) is not None else None,
              "offset": offsets, "member_size": sizes, "ext": exts, "label": labels}
    write_json_atomic(stem + ".json", record)
    return record


def finished_record(out: str, plan: ShardPlan) -> dict | None:
    """The record of shard ``plan`` if a previous run finished it as planned: its record matches the plan,
    and the tar (with its ``.idx``) is there with the recorded size and sha256. Else None (re-pack it)."""
    stem = os.path.join(out, os.path.splitext(plan.name)[0])
    try:
        with open(stem + ".json") as f:
            record = json.load(f)
        if (record.get("identity") != plan.identity or record.get("start") != plan.start or "shape" not in record
                or record.get("samples") != plan.stop - plan.start or not os.path.exists(stem + ".idx")):
            return None
        tar = os.path.join(out, plan.name)
        if os.path.getsize(tar) != record["size"] or file_sha256(tar) != record["sha256"]:
            return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


# Worker processes get the reader once, not once per shard (an array source may be large).
_WORKER_READER: SampleReader | None = None


def _init_worker(reader: SampleReader) -> None:
    global _WORKER_READER
    _WORKER_READER = reader


def _write_in_worker(plan: ShardPlan, out: str, key_width: int) -> dict:
    if _WORKER_READER is None:
        raise RuntimeError("pack: a worker process started without its reader (_init_worker)")
    return write_shard(_WORKER_READER, plan, out, key_width)


@dataclass
class PackReport:
    """What ``pack`` did. ``index``: the ``index.json`` written (rank 0), else None (other ranks)."""

    out: Path
    index: Path | None
    shards: int          # planned in all
    written: int         # by this process
    skipped: int         # by this process: finished by an earlier run
    samples: int


def pack(source, out, *, shard_size="256MB", max_side: int | None = None, workers: int | None = None,
         split: str | None = None, rank: int | None = None, world_size: int | None = None,
         progress: bool = True, timeout: float | None = None) -> PackReport:
    """Write ``source`` into folder ``out`` as tar shards, their DALI ``.idx`` files and ``index.json``.

    Args:
        source: ``"digits"``, an MNIST root or an image folder (a path), or anything
            ``fastdata.registry.as_source`` accepts (a fastdata source, a torchvision dataset, ...).
        out: the folder to write (created; finished shards already there are kept).
        shard_size: target bytes per shard (``"256MB"``, ``"1GiB"`` or an int), planned on the input
            sizes: re-encoded samples (``max_side``, arrays as PNG) make smaller shards.
        max_side: re-encode photos whose longer side exceeds it as JPEG (quality 90) with that longer
            side, upright; None keeps every file's original bytes.
        workers: processes writing shards (None: this process's share of the usable cores, the usable
            cores ÷ ``LOCAL_WORLD_SIZE`` under a launcher; at most one per shard; 0 or 1: this process).
        split: ``"train"`` or ``"test"``, for a path naming MNIST or ``digits`` (default train).
        rank, world_size: this process's share under a launcher (None: torch.distributed, else the
            launcher's variables, else a single process). Rank r packs shards r, r + world, ...;
            rank 0 merges the ranks' parts into ``index.json``.
        progress: show a progress bar.
        timeout: seconds rank 0 waits for the other ranks' parts, and the other ranks for the index
            (None: as long as it takes); then a ``TimeoutError`` says which files are missing.

    Raises:
        RefusedFiles (a ``ValueError``): files that cannot go into a shard (not an image the loaders
            read, unreadable, too large). Raised after every other shard is written, naming them all
            (and listing them in ``out/pack-refused.txt``): fix them and run again. Under a launcher,
            every rank first writes its own shards, then every rank raises the same error, naming the
            refused files of all ranks (rank 0 lists them), and no ``index.json`` is written.
    """
    # The text bar, as fit's: tqdm.auto's widget fails in a notebook without ipywidgets.
    from tqdm import tqdm

    from ..engine.meter import shows_live
    from ..sampling import distributed_info

    check_choice("split", split, (None, *SPLITS))
    shard_size = parse_size(shard_size)
    max_side = check_integer("max_side", max_side, minimum=1, optional=True)
    workers = check_integer("workers", workers, minimum=0, optional=True)
    source = _pack_source(source, split)
    rank, world = distributed_info(rank, world_size)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside [0, world_size={world})")
    out = _make_out(Path(out))
    if world > 1:
        # First: this rank's part of an earlier run stopped after writing it (Ctrl-C, a crash) would be
        # merged by rank 0 as this run's, refusals included, until this rank writes its own.
        part_path(out, rank).unlink(missing_ok=True)

    reader = SampleReader(source, max_side)
    n = len(reader.labels)
    if n == 0:
        raise ValueError(f"pack: the source {source!r} has no samples")
    key_width = max(8, len(str(n - 1)))
    plans = _plan(reader, shard_size)
    plan_digest = hashlib.sha256("\n".join(p.identity for p in plans).encode()).hexdigest()
    _refuse_inputs_in_out(source, out, n)
    # First, before any shard is rewritten: an index of another pack must not describe them meanwhile.
    drop_other_index(out, plan_digest)
    mine = plans[rank::world]
    records, todo = _finished_records(out, mine)
    # Drawn where fit's bar draws (a terminal or a notebook), never into a pipe or a log file.
    bar = tqdm(total=sum(p.stop - p.start for p in mine), unit="img",
               disable=not (progress and shows_live(sys.stderr)),
               desc=f"pack {out.name}" + (f" rank {rank}/{world}" if world > 1 else ""))
    bar.update(sum(r["samples"] for r in records.values()))
    refusals = _write_all(reader, todo, out, key_width, workers, records, bar)

    report = PackReport(out=out, index=None, shards=len(plans), written=len(todo),
                        skipped=len(mine) - len(todo), samples=n)
    written = _Written(source, plans, key_width, split, shard_size, max_side, plan_digest)
    if world == 1:
        if refusals:
            raise _refused(_joined(refusals), out / REFUSED_LIST, written=len(records))
        for name in (REFUSED_LIST, FAILED_NAME):   # an earlier run's
            (out / name).unlink(missing_ok=True)
        with _writing(f"the index '{out / INDEX_NAME}'", out):
            report.index = _write_index(out, written, records)
        return report
    config = {"pack_version": PACK_VERSION, "world_size": world, "num_samples": n, "key_width": key_width,
              "plan": plan_digest}
    mine_records = [records[p.index] for p in mine if p.index in records]   # a refused shard has none
    report.index = _pack_ranks(out, rank, world, config, written, mine_records, refusals, timeout)
    return report


def _pack_ranks(out: Path, rank: int, world: int, config: dict, written: _Written, mine: list, refusals: list,
                timeout: float | None) -> Path | None:
    """The ranks' ending: each writes its part (the records ``mine`` of its shards, its ``refusals``),
    rank 0 merges them into ``index.json`` (returned there), and every rank returns once that index
    exists. When any rank refused files, rank 0 lists them all and writes no index, and every rank
    raises the same ``RefusedFiles``: one run names the refused files of every rank."""
    # New per run: rank 0's word of a failure names it, so an earlier run's word is never taken for this run's.
    token = uuid.uuid4().hex
    part = {"config": config, "rank": rank, "token": token, "records": mine,
            "refused": [{"shard": i, "names": e.shards, "files": [[str(f), f.name, f.why] for f in e.refused]}
                        for i, e in refusals]}
    with _writing(f"this rank's part '{part_path(out, rank)}'", out):
        write_json_atomic(part_path(out, rank), part)
    barrier()
    index = failure = None
    if rank == 0:
        records, refused, tokens = merge_parts(out, world, config, timeout)
        for stale in out.glob("pack-refused.rank*.txt"):   # lists of an earlier fastdata: one per rank
            stale.unlink(missing_ok=True)
        if refused:
            failure = _fail_ranks(out, written.plan, refused, tokens, len(records))
        else:
            with _writing(f"the index '{out / INDEX_NAME}'", out):
                index = _write_index(out, written, records)
            for name in (REFUSED_LIST, FAILED_NAME):   # an earlier run's
                (out / name).unlink(missing_ok=True)
        # A failure without a group: each rank removes its own part once it knows (rank 0 waits for that).
        for r in [0] if failure is not None and not has_group() else range(world):
            part_path(out, r).unlink(missing_ok=True)
    # Every rank returns once the index exists (a rank may read it next): with a process group the
    # barrier says so; without one (torchrun runs the command with no group), the other ranks wait
    # for an index.json of this pack that describes their shards, or for rank 0's word of a failure.
    barrier()
    if rank != 0:
        doc = read_failure(out, rank, token) if has_group() else \
            wait_for_index(out, written.plan, mine, rank, token, timeout)
        if doc is not None:
            failure = _refusal_of(doc)
            part_path(out, rank).unlink(missing_ok=True)   # this rank knows: rank 0 may end
    if failure is not None:
        if not has_group():
            wait_until_every_rank_knows(out, world)
        raise failure
    return index


def _fail_ranks(out: Path, plan: str, refused: list, tokens: list, written: int) -> RefusedFiles:
    """Rank 0, when the parts hold refused files: list them all in ``REFUSED_LIST`` (in the source's
    order), tell the other ranks in ``FAILED_NAME`` and return the error that every rank raises."""
    refused = sorted(refused, key=lambda s: s["shard"])
    files = [RefusedFile(*f) for s in refused for f in s["files"]]
    e = _refused(RefusedFiles(files, [n for s in refused for n in s["names"]]), out / REFUSED_LIST, written)
    doc = {"plan": plan, "tokens": tokens, "refused": [[str(f), f.name, f.why] for f in e.refused],
           "shards": e.shards, "written": e.written, "listed": e.listed}
    with _writing(f"'{out / FAILED_NAME}'", out):
        write_json_atomic(out / FAILED_NAME, doc)
    return _refusal_of(doc)


def _refusal_of(doc: dict) -> RefusedFiles:
    """The ``RefusedFiles`` of rank 0's ``FAILED_NAME`` document: the same on every rank."""
    return RefusedFiles([RefusedFile(*f) for f in doc["refused"]], doc["shards"], doc["written"], doc["listed"])


def _pack_source(source, split):
    """The fastdata source ``pack`` reads: opened from a path, or through ``as_source``."""
    if isinstance(source, (str, os.PathLike)):
        from ..datasets.spec import open_source  # at the call: a test stands in for the shared parser
        from .tars import TarImages, find_tars

        if _is_tars(source, find_tars(source)):   # WebDataset tars of another tool: converted to a pack
            if split is not None:
                raise ValueError(f"--split {split} applies to MNIST and digits; '{source}' holds tars")
            return TarImages(source)
        return open_source(source, split=split)
    if split is not None:
        raise ValueError("split applies to a source given by path ('digits', an MNIST root); "
                         "pass the split's dataset itself")
    from ..registry import as_source

    return as_source(source)


def _write_all(reader: SampleReader, todo: list[ShardPlan], out: Path, key_width: int, workers: int | None,
               records: dict, bar) -> list[tuple[int, RefusedFiles]]:
    """``_write_shards`` with the progress ``bar``; returns its refusals."""
    try:
        return _write_shards(reader, todo, out, key_width, workers, records, bar.update)
    finally:
        bar.close()


def _joined(refusals: list[tuple[int, RefusedFiles]]) -> RefusedFiles:
    """One ``RefusedFiles`` of the shards' ``refusals``, in the source's order."""
    return RefusedFiles([f for _, e in refusals for f in e.refused], [n for _, e in refusals for n in e.shards])


def _refused(e: RefusedFiles, listed: Path, written: int) -> RefusedFiles:
    """``e`` with every refused file listed in file ``listed`` (name, tab, why; one per line, a control
    character of either as its escape: ``one_line``; a name's other bytes as they are): a message shows
    a few, and a folder may hold thousands. Without the list (OUT cannot be written) the message still
    names the first ones."""
    try:
        with open(listed, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.writelines(f"{one_line(r.name)}\t{one_line(r.why)}\n" for r in e.refused)
        where = str(listed)
    except OSError:
        where = None
    return RefusedFiles(e.refused, e.shards, written=written, listed=where)


def _make_out(out: Path) -> Path:
    """``out``, created: a file there is a ``NotADirectoryError``, a folder that cannot be made (a name
    too long, no permission, a read-only disk) an ``OutputError``, each naming OUT, not the source."""
    try:
        a_file = out.exists() and not out.is_dir()   # a name too long is raised by exists() already
        if not a_file:
            out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(e.errno, f"cannot create the folder '{out}': {e.strerror or e}") from None
    if a_file:
        raise NotADirectoryError(f"pack: OUT '{out}' is a file, not a folder")
    return out


def _refuse_inputs_in_out(source, out: Path, n: int) -> None:
    """A ValueError when packing into ``out`` would overwrite what ``source`` reads (``_inputs_in_out``):
    before anything is written, as a reshard in place destroyed the pack it read half-way."""
    overwritten = _inputs_in_out(source, out, n)
    if overwritten:
        more = f" and {len(overwritten) - 1} more" if len(overwritten) > 1 else ""
        raise ValueError(f"pack: OUT '{out}' holds files the source reads ({overwritten[0]}{more}): packing "
                         f"there would remove their index and replace them while they are still read; give "
                         f"another OUT, then put it in place of the folder")


def _inputs_in_out(source, out: Path, n: int) -> list[str]:
    """The files ``source`` reads that packing into ``out`` would replace or remove: a pack's own tars
    when OUT is the pack being resharded or resized, tars of another tool named as ``pack`` names its
    shards. Found through ``sample_name`` (a file, or ``archive:member``), as every reader names them."""
    from ..config import SourceKind

    if getattr(source, "kind", None) != SourceKind.FILES or not out.is_dir():
        return []
    here, same, found = os.stat(out), {}, set()
    for i in range(n):
        name = source.sample_name(i)
        for path in (name, name.rpartition(":")[0]):   # a file, or an archive's member: its archive
            folder, base = os.path.split(path)
            if not (_SHARD_FILE.match(base) or base == INDEX_NAME):
                continue                      # a name pack never writes: no stat (ImageNet: 1.28 M names)
            if folder not in same:
                try:
                    st = os.stat(folder or ".")
                    same[folder] = (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)
                except OSError:               # a URL: not a local file
                    same[folder] = False
            if same[folder]:
                found.add(path)
    return sorted(found)


def _is_tars(path, tars: list) -> bool:
    """Whether ``path`` names tars to convert: a tar file, or a folder with tars and no sub-folder (an
    image folder's classes) and no ``index.json`` (a pack's tars are read through their index)."""
    if not tars or not os.path.isdir(path):
        return bool(tars)
    return not os.path.exists(os.path.join(path, INDEX_NAME)) and not any(
        e.is_dir() and not e.name.startswith(".") for e in os.scandir(path))


def _plan(reader: SampleReader, shard_size: int) -> list[ShardPlan]:
    """Every shard of the pack (all ranks'), planned on the inputs' estimated sizes."""
    estimates, ident = reader.plan_inputs()
    ranges = plan_shards(estimates, shard_size)
    name_width = max(6, len(str(len(ranges) - 1)))
    return [ShardPlan(j, f"shard-{j:0{name_width}d}.tar", a, b, reader.shard_identity(a, b, ident))
            for j, (a, b) in enumerate(ranges)]


def _finished_records(out: Path, mine: list[ShardPlan]) -> tuple[dict, list[ShardPlan]]:
    """(records of the shards already written, by index; the plans still to write)."""
    records, todo = {}, []
    for plan in mine:
        record = finished_record(str(out), plan)
        if record is None:
            todo.append(plan)
        else:
            records[plan.index] = record
    return records, todo


def _write_shards(reader: SampleReader, todo: list[ShardPlan], out: Path, key_width: int, workers: int | None,
                  records: dict, progress) -> list[tuple[int, RefusedFiles]]:
    """Write the ``todo`` shards, here or on a process pool, adding each one's record to ``records``. A
    shard holding files pack refuses is not written, and the others still are: returned are the refused
    shards' (index, ``RefusedFiles``), in the source's order. Any other error stops the pack at once."""
    refused: list[tuple[int, RefusedFiles]] = []   # (shard, its refusal): named in the source's order
    # By default the ranks of one node share its cores rather than each starting a process per core.
    n_workers = min(len(todo), workers if workers is not None else default_workers())
    if n_workers <= 1:
        for plan in todo:
            try:
                records[plan.index] = write_shard(reader, plan, str(out), key_width, progress)
            except RefusedFiles as e:
                refused.append((plan.index, e))
    else:
        from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

        pool = ProcessPoolExecutor(n_workers, initializer=_init_worker, initargs=(reader,))
        try:
            futures = {pool.submit(_write_in_worker, p, str(out), key_width): p for p in todo}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in done:
                    if isinstance(fut.exception(), RefusedFiles):
                        refused.append((futures[fut].index, cast(RefusedFiles, fut.exception())))
                        continue
                    record = fut.result()   # any other error of a worker stops the pack, naming its sample
                    records[futures[fut].index] = record
                    progress(record["samples"])
        finally:
            # On an error, shards not started are dropped rather than written after it.
            pool.shutdown(wait=True, cancel_futures=True)
    return sorted(refused, key=lambda r: r[0])


@dataclass(frozen=True)
class _Written:
    """What ``index.json`` records about a pack besides its shards' records."""

    source: Source
    plans: list
    key_width: int
    split: str | None
    shard_size: int
    max_side: int | None
    plan: str            # digest of the plan's shard identities: which pack wrote the index


def _write_index(out: Path, written: _Written, records: dict) -> Path:
    source, plans, key_width = written.source, written.plans, written.key_width
    by_index = {}
    for plan in plans:
        record = records.get(plan.index, records.get(plan.name))
        if record is None or record["identity"] != plan.identity:
            raise RuntimeError(f"pack: no finished record for shard {plan.name} in '{out}'")
        by_index[plan.index] = record
    shards, shard_ids, offsets, sizes, ext_names, labels = [], [], [], [], [], []
    for plan in plans:
        r = by_index[plan.index]
        shards.append({"name": r["name"], "size": r["size"], "samples": r["samples"], "sha256": r["sha256"]})
        shard_ids += [plan.index] * r["samples"]
        offsets += r["offset"]
        sizes += r["member_size"]
        ext_names += r["ext"]
        labels += r["label"]
    classes = [str(c) for c in source.classes]
    if labels and max(labels) >= len(classes):   # a Dataset with no targets or classes: labels seen while packing
        classes += [str(k) for k in range(len(classes), max(labels) + 1)]
    exts = sorted(set(ext_names))
    code = {e: k for k, e in enumerate(exts)}
    # One (H, W, C) for every sample: a pack of arrays, which Shards reads back as arrays.
    shapes = {tuple(by_index[p.index].get("shape") or ()) for p in plans}
    info = {"name": source.name, "type": type(source).__name__, "split": written.split,
            "channels": source.channels, "mean": list(source.mean), "std": list(source.std),
            "max_side": written.max_side, "shard_size": written.shard_size,
            "image_shape": list(shapes.pop()) if len(shapes) == 1 and () not in shapes else None,
            "digits": bool(getattr(source, "digits", False))}
    doc = index_document(shards=shards, classes=classes, key_width=key_width, plan=written.plan,
                         fingerprint=source.fingerprint(), source=info,
                         samples={"shard": shard_ids, "offset": offsets, "size": sizes, "exts": exts,
                                  "ext": [code[e] for e in ext_names], "label": labels})
    path = out / INDEX_NAME
    write_json_atomic(path, doc)
    _remove_unplanned(out, plans)
    return path


_SHARD_FILE = re.compile(r"shard-\d+\.(tar|idx|json)\Z")


def _remove_unplanned(out: Path, plans: list[ShardPlan]) -> None:
    """Delete shard files an earlier pack into ``out`` left beyond this plan (another shard size made
    more shards): a reader that lists ``*.tar`` (webdataset, DALI) would read their samples twice."""
    planned = {os.path.splitext(p.name)[0] for p in plans}
    for entry in os.scandir(out):
        if _SHARD_FILE.match(entry.name) and os.path.splitext(entry.name)[0] not in planned:
            os.remove(entry.path)
