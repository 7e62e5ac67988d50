"""The index of a packed data set (``index.json``) and the per-tar DALI index files (``.idx``).

``index.json`` says what ``fastdata.pack`` wrote: the shards (name, bytes, samples, sha256) and,
per sample, its shard, where its image's bytes lie in that tar (offset of the data, size), the image's
extension and its label; the classes, the source's fingerprint and normalization statistics. Per-sample
fields are parallel arrays, not one object per sample: ImageNet's 1.28 M samples stay a few tens of MB,
and they are parsed straight into arrays (``_load_json``), never into lists of Python ints first.

An index may come from a remote server, so ``parse_index`` treats it as untrusted input: JSON only
(never pickle), shard names that would leave the data folder, offsets and sizes that do not fit a tar
of the stated size, members larger than an image limit and counts that disagree are refused, each
error naming the index and the field.

The index is the pack's manifest, not a shard: every error about it (``load_index``, ``read_index``,
``parse_index``) calls it the index, gives its full address (path or redacted URL), says what is wrong
(missing, unreadable and why, not JSON and where, which field is not what was expected, which versions
are read) and what to do; ``index.json`` is written by ``python -m fastdata pack``.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import warnings
from dataclasses import dataclass, field

import numpy as np

from .storage import Storage, StorageError, is_local, redact

FORMAT = "fastdata-shards"
VERSION = 1
INDEX_NAME = "index.json"
TAR_BLOCK = 512
#: The largest image member an index may announce (a JPEG of 100 megapixels is about 30 MB).
MAX_MEMBER_BYTES = 64 * 2**20
#: The largest shard an index may announce: far past any tar, and sums of offsets stay inside int64.
_MAX_SHARD_BYTES = 2**62

_EXT = re.compile(r"[A-Za-z0-9]+\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


#: What every error about the index's content ends with: what writes one, so what to do about it.
_REPACK = "index.json is written by `python -m fastdata pack`: re-run pack to write it again"


class BadIndex(ValueError):
    """An index that is not what ``pack`` writes (a ``ValueError``, so ``cli.input_errors`` reports it)."""


class IndexNotFound(StorageError, FileNotFoundError):
    """The location has no ``index.json`` (no such file, a 404, no such key): it is not a pack, or the
    pack was interrupted before it wrote the index (last). A ``FileNotFoundError``; not a shard's error."""


@dataclass
class ShardInfo:
    """One shard as the index describes it."""

    name: str       # path relative to the data folder (or URL prefix), "/"-separated
    size: int       # bytes of the tar
    samples: int
    sha256: str


@dataclass
class ShardIndex:
    """A validated ``index.json``. Sample ``i`` is member ``key(i) + "." + ext(i)`` of shard
    ``shards[shard[i]]``, its bytes at ``[offset[i], offset[i] + size[i])`` of that tar."""

    shards: list[ShardInfo]
    classes: list[str]
    shard: np.ndarray       # int64 (N,)
    offset: np.ndarray      # int64 (N,)
    size: np.ndarray        # int64 (N,)
    ext_code: np.ndarray    # int64 (N,), into exts
    exts: list[str]
    labels: np.ndarray      # int64 (N,)
    key_width: int
    fingerprint: str
    source: dict = field(default_factory=dict)   # name, split, channels, mean, std: informative

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def shard_sizes(self) -> np.ndarray:
        """Samples per shard (for ``order.epoch_order``)."""
        return np.array([s.samples for s in self.shards], dtype=np.int64)

    def key(self, i: int) -> str:
        """Sample ``i``'s WebDataset key: its index, zero-padded to ``key_width`` digits."""
        return f"{int(i):0{self.key_width}d}"

    def ext(self, i: int) -> str:
        """Sample ``i``'s image extension (``jpg``, ``png``, ...): what its bytes are."""
        return self.exts[int(self.ext_code[i])]

    def member(self, i: int) -> str:
        """Sample ``i``'s image member name in its tar: ``KEY.ext``."""
        return f"{self.key(i)}.{self.ext(i)}"


def _fail(where: str, message: str):
    raise BadIndex(f"index '{where}': {message} ({_REPACK})")


def _found(value) -> str:
    """``value`` as an error shows what it found instead: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_shard_name(name, where: str, what: str = "shard name") -> str:
    """``name`` if it is a relative, "/"-separated path that stays inside the data folder; else an error
    naming it: empty, absolute, with a drive or a backslash, a ``..`` or ``.`` or empty component, a
    hidden component (``.locks/x``: the cache keeps its lock and temporary files under such names), or a
    control character (a file name from a remote index becomes a path in the local cache)."""
    if not isinstance(name, str) or not name:
        _fail(where, f"{what} {name!r} is empty or not a string")
    if name.startswith("/") or "\\" in name or ":" in name or os.path.isabs(name):
        _fail(where, f"{what} {name!r} is absolute or has a drive, a backslash or a ':'; "
                     f"shard names are relative paths with '/'")
    if any(part in ("", ".", "..") for part in name.split("/")):
        _fail(where, f"{what} {name!r} has an empty, '.' or '..' component: it would leave the data folder")
    if any(part.startswith(".") for part in name.split("/")):
        _fail(where, f"{what} {name!r} has a hidden component (starting with '.'): the shard cache keeps its "
                     f"lock and temporary files under such names, and pack never writes one")
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        _fail(where, f"{what} {name!r} has a control character")
    return name


def _int(value, where: str, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(where, f"{what} must be an integer, got {value!r}")
    if value < low:
        _fail(where, f"{what} is {value}; it must be >= {low}")
    return value


def _int_array(values, n: int, where: str, what: str) -> np.ndarray:
    if isinstance(values, np.ndarray):   # parsed by _load_json: int64 already
        if len(values) != n:
            _fail(where, f"{what} has {len(values)} entries but the index has {n} samples")
        return values
    if not isinstance(values, list):
        _fail(where, f"{what} must be a list of {n} integers, got {type(values).__name__}")
    if len(values) != n:
        _fail(where, f"{what} has {len(values)} entries but the index has {n} samples")
    arr = np.array(values) if values else np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.dtype == np.uint64:
        bad = next((i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, int)
                    or not -2**63 <= v < 2**63), None)
        detail = f"entry {bad} is {values[bad]!r}" if bad is not None else f"dtype {arr.dtype}"
        _fail(where, f"{what} must hold 64-bit integers; {detail}")
    return arr.astype(np.int64)


def _sample_error(where: str, index: int, what: str, message: str):
    _fail(where, f"sample {index} ({what}): {message}")


def parse_index(data, where: str, *, max_member_bytes: int = MAX_MEMBER_BYTES) -> ShardIndex:
    """A validated ``ShardIndex`` from the bytes (or text) of an ``index.json``.

    Args:
        data: the file's content (bytes or str). Parsed as JSON only.
        where: the index's location, for the errors (a path or URL).
        max_member_bytes: the largest image member accepted.
    """
    doc = _document(data, where)
    classes, key_width, n = _header(doc, where)
    shards = _shards(doc["shards"], where, n)
    exts, shard, offset, size, ext_code, labels = _sample_arrays(doc["samples"], n, where)
    if n:
        _check_codes(where, shards, classes, exts, shard, ext_code, labels)
        _check_members(where, shards, shard, offset, size, max_member_bytes)
    source = doc.get("source", {})
    return ShardIndex(shards=shards, classes=list(classes), shard=shard, offset=offset, size=size,
                      ext_code=ext_code, exts=list(exts), labels=labels, key_width=key_width,
                      fingerprint=doc["fingerprint"], source=source if isinstance(source, dict) else {})


#: A JSON array of at least 4 KB of integers only (digits, commas, minus signs, JSON's whitespace): the
#: per-sample fields, which ``_load_json`` parses with numpy.
_LONG_INT_ARRAY = re.compile(rb"\[[0-9,\x20\t\n\r-]{4096,}\]")
_ARRAY_MARK = "\x00fastdata-array-"   # what such an array is replaced with before json.loads sees the rest
# Every character but a digit as a space, a digit as "d": the entries' digits and digit runs, counted by
# bytes.count at C speed (see _int64_text).
_DIGITS = bytes(ord("d") if ord("0") <= c <= ord("9") else ord(" ") for c in range(256))
_POWERS_OF_10 = 10 ** np.arange(19, dtype=np.int64)   # 1 ... 10**18: digits of n = how many are <= n
_INT64 = np.iinfo(np.int64)


def _load_json(data):
    """``json.loads(data)``, with its long arrays of plain integers (the per-sample fields) parsed by
    numpy, straight from the text into int64 arrays, instead of into lists of Python ints first: an int
    in a list costs 36 bytes, so ImageNet's 1.28 M samples x 5 fields took about 300 MB for a moment,
    as arrays 49 MB. The same format and the same result: an array is taken only when every entry is
    a JSON integer within int64, else it is left to json.loads; a document the fast path is unsure of
    (an array matched inside a string, one placed outside ``samples``) is parsed by json.loads whole,
    which also raises the errors (with the real line and column)."""
    if not isinstance(data, bytes):
        return json.loads(data)
    arrays: list[np.ndarray] = []
    parts, last = [], 0
    # A mark of this parse only: an index's own string that spells a mark (the index is untrusted) must not
    # be taken for one of its arrays.
    array_mark = f"{_ARRAY_MARK}{secrets.token_hex(8)}-"
    for m in _LONG_INT_ARRAY.finditer(data):
        values = _int64_text(data[m.start() + 1: m.end() - 1])
        if values is not None:
            parts += [data[last:m.start()], f'"\\u0000{array_mark[1:]}{len(arrays)}"'.encode()]
            arrays.append(values)
            last = m.end()
    if not arrays:
        return json.loads(data)
    try:
        doc = json.loads(b"".join(parts) + data[last:])
    except ValueError:   # a match inside a string broke it: the plain parse says what the text is
        return json.loads(data)
    samples = doc.get("samples") if isinstance(doc, dict) else None
    marks = {k: v for k, v in samples.items() if isinstance(v, str) and v.startswith(array_mark)} \
        if isinstance(samples, dict) else {}
    if sorted(marks.values()) != sorted(f"{array_mark}{i}" for i in range(len(arrays))):
        return json.loads(data)
    for key, mark in marks.items():
        samples[key] = arrays[int(mark[len(array_mark):])]
    return doc


def _int64_text(text: bytes) -> np.ndarray | None:
    """The entries of a JSON array's inside ``text`` as int64, or None unless each is a JSON integer
    (no leading zero, no lone '-', no empty entry) within int64 (numpy would clip one beyond it)."""
    if re.search(rb"-[^0-9]", text):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # numpy warns (here: raises) where the text stops being numbers
        try:
            values = np.fromstring(text, dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            return None
    if len(values) != text.count(b",") + 1 or (values == _INT64.max).any() or (values == _INT64.min).any():
        return None
    # An entry of whitespace only ("1, ,2"), which numpy reads as 0, has no digits: each entry must be one
    # run of digits. A leading zero ("007"), which JSON forbids and numpy reads, is then a digit more in the
    # text than in the numbers written plainly. Both counted, not searched for (a regex over the text took
    # as long as the parse); the runs first, since an empty entry's missing digit hides a leading zero's.
    shape = text.translate(_DIGITS)
    if shape.count(b" d") + shape.startswith(b"d") != len(values):
        return None
    plain = np.maximum(np.searchsorted(_POWERS_OF_10, np.abs(values), side="right"), 1).sum()
    return values if shape.count(b"d") == plain else None


def _document(data, where: str) -> dict:
    """The JSON object, of this format and version, with every top-level field present."""
    try:
        doc = _load_json(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadIndex(_not_json(data, where, e)) from None
    except RecursionError:   # json's parser recurses per level: "[[[[...": crafted, never written by pack
        raise BadIndex(f"index '{where}' is not JSON (it nests arrays or objects deeper than Python's parser "
                       f"goes); {_REPACK}") from None
    if not isinstance(doc, dict):
        _fail(where, f"must be a JSON object, got {_found(doc)}")
    if doc.get("format") != FORMAT:
        _fail(where, f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    version = doc.get("version")
    if version != VERSION:
        why = ("an index of a newer fastdata: upgrade fastdata, or re-pack with this one" if
               isinstance(version, int) and not isinstance(version, bool) and version > VERSION
               else "no fastdata writes that version")
        _fail(where, f"version is {version!r}; this fastdata reads version {VERSION} only ({why})")
    for key in ("shards", "classes", "samples", "num_samples", "fingerprint", "key_width"):
        if key not in doc:
            _fail(where, f"field '{key}' is missing (the index has {', '.join(map(repr, doc))})"[:400])
    return doc


def _not_json(data, where: str, error: Exception) -> str:
    """Why ``data`` did not parse, as a message: empty, truncated (an interrupted copy: the text ends
    inside the JSON), a web page or a pickle instead, or where (line and column) the JSON goes wrong."""
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    if not raw.strip():
        what = "is empty (0 bytes)" if not raw else f"holds only whitespace ({len(raw)} bytes)"
        return f"index '{where}' {what}; {_REPACK}"
    if isinstance(error, UnicodeDecodeError):
        line, column = raw.count(b"\n", 0, error.start) + 1, error.start - raw.rfind(b"\n", 0, error.start)
        problem = f"is not JSON: byte {raw[error.start]:#04x} at line {line} column {column} is not UTF-8"
    elif isinstance(error, json.JSONDecodeError):
        # JSON that runs out before its last bracket closes: the failure is at the end, or is a string
        # that never ends.
        cut = error.pos >= len(error.doc.rstrip()) or error.msg.startswith("Unterminated string")
        where_in = f"line {error.lineno} column {error.colno}"
        problem = (f"is truncated: its {len(raw)} bytes end inside the JSON ({where_in}: {error.msg}); an "
                   f"interrupted copy or download: copy it again" if cut else f"is not JSON ({error.msg}: {where_in})")
    else:
        problem = f"is not JSON ({error})"
    start = raw.lstrip()[:1]
    if start[:1] == b"\x80":
        problem += " (it looks like a pickle, which is never loaded)"
    elif start[:1] == b"<":   # <!DOCTYPE html>, <html>, <?xml ...>: what servers answer with instead
        problem += (" (it looks like HTML or XML: a web page, such as a login or a proxy's error page, "
                    "was served instead of the index; check the URL)")
    return f"index '{where}' {problem}; {_REPACK}"


def _header(doc: dict, where: str) -> tuple[list, int, int]:
    """(classes, key_width, num_samples), checked."""
    classes = doc["classes"]
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        _fail(where, f"classes must be a non-empty list of class names, got {_found(classes)}")
    if not isinstance(doc["fingerprint"], str):
        _fail(where, f"fingerprint must be a string, got {_found(doc['fingerprint'])}")
    key_width = _int(doc["key_width"], where, "key_width", 1)
    if key_width > 18:
        _fail(where, f"key_width is {key_width}; at most 18 digits")
    return classes, key_width, _int(doc["num_samples"], where, "num_samples")


def _shards(raw_shards, where: str, n: int) -> list[ShardInfo]:
    """The shard list, each entry checked, holding ``n`` samples in all."""
    if not isinstance(raw_shards, list):
        _fail(where, f"shards must be a list of shard records, got {_found(raw_shards)}")
    shards, names = [], set()
    for j, s in enumerate(raw_shards):
        if not isinstance(s, dict):
            _fail(where, f"shards[{j}] must be an object with name, size, samples, sha256")
        name = check_shard_name(s.get("name"), where, f"shards[{j}].name")
        if name in names:
            _fail(where, f"shards[{j}].name {name!r} appears twice")
        names.add(name)
        size = _int(s.get("size"), where, f"shards[{j}].size ({name})")
        if size > _MAX_SHARD_BYTES:   # numpy's int64 would overflow on it, or offsets added to it
            _fail(where, f"shards[{j}].size ({name}) is {size} bytes, past {_MAX_SHARD_BYTES} (2**62): no tar is "
                         f"that large")
        if size % TAR_BLOCK:
            _fail(where, f"shards[{j}].size ({name}) is {size}, not a multiple of {TAR_BLOCK}: not a tar")
        samples = _int(s.get("samples"), where, f"shards[{j}].samples ({name})")
        sha = s.get("sha256")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            _fail(where, f"shards[{j}].sha256 ({name}) must be 64 lowercase hex digits, got {sha!r}")
        shards.append(ShardInfo(name, size, samples, sha))
    if sum(s.samples for s in shards) != n:
        _fail(where, f"the shards hold {sum(s.samples for s in shards)} samples but num_samples is {n}")
    return shards


def _sample_arrays(samples, n: int, where: str) -> tuple:
    """(exts, shard, offset, size, ext_code, label): the per-sample parallel arrays, ``n`` integers each."""
    if not isinstance(samples, dict):
        _fail(where, f"samples must be an object of parallel arrays, got {_found(samples)}")
    for key in ("shard", "offset", "size", "ext", "label", "exts"):
        if key not in samples:
            _fail(where, f"field 'samples.{key}' is missing")
    exts = samples["exts"]
    if not isinstance(exts, list) or not exts or not all(isinstance(e, str) and _EXT.match(e) for e in exts):
        _fail(where, f"samples.exts must be a non-empty list of extensions (letters and digits), got {exts!r}"[:300])
    return (exts,) + tuple(_int_array(samples[key], n, where, f"samples.{key}")
                           for key in ("shard", "offset", "size", "ext", "label"))


def _first(mask) -> int:
    return int(np.argmax(mask))


def _check_codes(where, shards, classes, exts, shard, ext_code, labels) -> None:
    """Every sample names a shard, an extension and a class that exist, and each shard's count agrees."""
    if ((shard < 0) | (shard >= len(shards))).any():
        i = _first((shard < 0) | (shard >= len(shards)))
        _sample_error(where, i, "samples.shard", f"shard {shard[i]} is not one of the {len(shards)} shards")
    counts = np.bincount(shard, minlength=len(shards))
    for j, s in enumerate(shards):
        if counts[j] != s.samples:
            _fail(where, f"shards[{j}] ({s.name}) says {s.samples} samples but {counts[j]} samples name it")
    if ((ext_code < 0) | (ext_code >= len(exts))).any():
        i = _first((ext_code < 0) | (ext_code >= len(exts)))
        _sample_error(where, i, "samples.ext", f"code {ext_code[i]} is not one of the {len(exts)} exts")
    if ((labels < 0) | (labels >= len(classes))).any():
        i = _first((labels < 0) | (labels >= len(classes)))
        _sample_error(where, i, "samples.label", f"label {labels[i]} is outside [0, {len(classes)})")


def _check_members(where, shards, shard, offset, size, max_member_bytes) -> None:
    """Every sample's bytes are a tar member's data: not empty, within the limit, block-aligned after a
    header, inside its shard, and clear of the next member's header."""
    if (size <= 0).any():
        i = _first(size <= 0)
        _sample_error(where, i, "samples.size", f"size {size[i]} bytes: an image member is not empty")
    if (size > max_member_bytes).any():
        i = _first(size > max_member_bytes)
        _sample_error(where, i, "samples.size", f"size {size[i]} bytes is past the image limit of "
                                                f"{max_member_bytes} bytes (max_member_bytes)")
    # A member's data follows its 512-byte header, on a block boundary.
    if ((offset < TAR_BLOCK) | (offset % TAR_BLOCK != 0)).any():
        i = _first((offset < TAR_BLOCK) | (offset % TAR_BLOCK != 0))
        _sample_error(where, i, "samples.offset", f"offset {offset[i]} is not a tar data offset "
                                                  f"(a multiple of {TAR_BLOCK}, after a header)")
    shard_bytes = np.array([s.size for s in shards], dtype=np.int64)[shard]
    # Not offset + size > shard_bytes: that sum wraps in int64 for an offset near 2**63 (crafted) and
    # passes. Sizes are in (0, max_member_bytes] and shard sizes in [0, 2**62] here, so this cannot wrap.
    past = offset > shard_bytes - size
    if past.any():
        i = _first(past)
        _sample_error(where, i, "samples.offset/size",
                      f"bytes [{offset[i]}, {int(offset[i]) + int(size[i])}) run past the end of "
                      f"{shards[shard[i]].name} ({shard_bytes[i]} bytes)")
    # Within a shard, each member must end (padded) before the next one's header.
    by = np.lexsort((offset, shard))
    same = shard[by][1:] == shard[by][:-1]
    end = offset[by][:-1] + (size[by][:-1] + TAR_BLOCK - 1) // TAR_BLOCK * TAR_BLOCK
    clash = same & (offset[by][1:] < end + TAR_BLOCK)
    if clash.any():
        k = _first(clash)
        i, other = int(by[k + 1]), int(by[k])
        _sample_error(where, i, "samples.offset", f"offset {offset[i]} overlaps sample {other}'s data "
                                                  f"or its own header in {shards[shard[i]].name}")


def read_index(path, *, max_member_bytes: int = MAX_MEMBER_BYTES) -> ShardIndex:
    """``load_index`` of a local pack: ``path`` is the folder ``pack`` wrote, its ``index.json``, or an
    index under another name (a copy). The other files of a pack (a shard's tar, its ``.idx``, its record
    ``NAME.json``, a rank's part) are refused, naming the file and what to give instead. One path for
    all, so a local index is read, refused and explained as ``Shards`` reads it. A URL (the folder or its
    ``index.json``) is read remotely, with no retries (``load_index`` of a ``Storage`` for those)."""
    path = os.fspath(path)
    if not is_local(path):   # a URL: the folder's index.json, read remotely (read_index read URLs so before)
        return load_index(Storage(os.path.dirname(path) if os.path.basename(path) == INDEX_NAME else path,
                                  retries=0), max_member_bytes=max_member_bytes)
    folder, name = os.path.split(path)
    folder = folder or "."
    if os.path.isdir(path) or (name == INDEX_NAME and os.path.isdir(folder)):
        return load_index(Storage(path if os.path.isdir(path) else folder, retries=0),
                          max_member_bytes=max_member_bytes)
    if not os.path.lexists(path):
        raise IndexNotFound(f"index '{path}' is missing: there is no such file or folder; give the folder that "
                            f"`python -m fastdata pack` wrote (index.json beside its tars), or its index.json",
                            name, path, code=errno.ENOENT)
    if name.lower().endswith(TAR_ENDINGS + (".idx",)):   # a shard (maybe GBs): never read as JSON
        raise BadIndex(f"index '{path}' is {_pack_file(folder, name)}")
    data = _head_unless_json(path)
    if data is None:
        try:
            data = Storage(folder, retries=0).read(name, subject="the index")
        except StorageError as e:
            raise _with_advice(e, local=True) from None
    try:
        return parse_index(data, path, max_member_bytes=max_member_bytes)
    except BadIndex as e:
        what = _pack_file(folder, name)
        raise (BadIndex(f"index '{path}' is {what}") if what else e) from None


def _head_unless_json(path: str, head: int = 4096) -> bytes | None:
    """The first ``head`` bytes of a larger file that does not start as JSON text, else None: enough for
    parse_index to say what the file is instead (a web page, a pickle, another format), where reading
    it whole held a video or a disk image of GBs in memory first. JSON is read whole (up to
    ``storage.MAX_READ_BYTES``): its head alone would be "truncated" (a JSON array given as the index is
    "not an object"), and json reads UTF-16 and UTF-32 too, which start with no ``{`` byte."""
    try:
        if os.path.getsize(path) <= head:
            return None
        with open(path, "rb") as f:
            start = f.read(head)
    except OSError:
        return None   # read whole by Storage, whose error names the file
    text = start.decode(json.detect_encoding(start), errors="replace").lstrip("\ufeff \t\r\n")
    return None if text[:1] in ("{", "[", '"') else start


def _pack_file(folder: str, name: str) -> str:
    """What file ``name`` of a pack's ``folder`` is, when it is not the index, and what to give instead
    (empty if it is none of a pack's other files)."""
    instead = (f"give the folder '{folder}' or its {INDEX_NAME}" if os.path.isfile(os.path.join(folder, INDEX_NAME))
               else f"'{folder}' has no {INDEX_NAME}: give the folder `python -m fastdata pack` wrote")
    stem = name.rpartition(".")[0]
    if name.lower().endswith(TAR_ENDINGS):
        if name in foreign_tars(folder):
            instead += f" (tars of another tool are converted first: python -m fastdata pack '{folder}' OUT)"
        return f"a tar file (a shard), not an index: {instead}"
    if name.lower().endswith(".idx"):   # as read_index tests it: a case it refuses is said here too
        return f"a DALI index of one shard ('{stem}.tar'), not the pack's index: {instead}"
    if re.fullmatch(r"index\.rank\d+\.json", name):
        return (f"one rank's part of a pack, not its index: rank 0 merges the parts into {INDEX_NAME} once "
                f"every rank is done (re-run pack if it was interrupted); {instead}")
    if name.endswith(".json") and os.path.isfile(os.path.join(folder, f"{stem}.tar")):
        return f"the record pack writes beside shard '{stem}.tar', not the pack's index: {instead}"
    return ""


def load_index(storage, *, max_member_bytes: int = MAX_MEMBER_BYTES) -> ShardIndex:
    """The validated index of a ``shards.storage.Storage``'s location (its ``index.json``), read with the
    storage's retries. Errors call it the index (never a shard) at its full, redacted address, and say
    what to do: ``IndexNotFound`` when there is none, a ``StorageError`` when it cannot be read,
    ``BadIndex`` when it is not an index ``pack`` wrote."""
    try:
        data = storage.read(INDEX_NAME, subject="the index")
    except StorageError as e:
        if isinstance(e, FileNotFoundError):
            e = IndexNotFound(str(e), e.name, e.url, e.attempts, e.transient, code=e.errno, status=e.status)
        if isinstance(e, FileNotFoundError) and not storage.is_local:
            path = storage.location.partition("?")[0].rstrip("/")
            if path.endswith("/" + INDEX_NAME):   # the index's own URL, given in place of its folder's
                e.args = (f"{e}; the location names the index itself: give the folder that holds it, "
                          f"'{redact(path[: -len(INDEX_NAME) - 1])}'",)
                raise e from None
        raise _with_advice(e, local=storage.is_local,
                           folder=storage.location if storage.is_local else None) from None
    return parse_index(data, storage.url(INDEX_NAME), max_member_bytes=max_member_bytes)


def _with_advice(error: StorageError, *, local: bool, folder: str | None = None) -> StorageError:
    """``error`` (about reading the index) with what to do about it appended to its message. ``folder``:
    the local folder the index was looked for in (its tars, written by another tool, are named)."""
    tars = len(foreign_tars(folder)) if isinstance(error, FileNotFoundError) and folder else 0
    if tars:
        advice = (f"the folder holds {tars} tar file(s) but no index: tars written by another tool (WebDataset "
                  f"style) are read once they are converted: python -m fastdata pack '{folder}' OUT, then "
                  f"Shards(OUT)")
    elif isinstance(error, FileNotFoundError):
        written = "the folder that `python -m fastdata pack` wrote"
        advice = (f"it is missing: give {written} (index.json beside its tars)" if local else
                  f"it is missing: check the URL ({written}, uploaded as it is: index.json beside its tars)")
        advice += ", or re-run pack (it writes index.json last, so an interrupted pack leaves none)"
    elif error.errno in (errno.EACCES, errno.EPERM) or error.status in (401, 403):
        advice = ("reading it was refused: check the file's permissions" if local else
                  "reading it was refused: check the credentials (storage_options, the environment) or the "
                  "URL's token")
    elif error.transient:
        advice = "the server did not answer it: check the URL and that the server is up, then try again " \
                 "(retries= and timeout= wait longer)"
    else:
        advice = "it must be the file index.json that `python -m fastdata pack` writes; re-run pack"
    error.args = (f"{error}; {advice}",)
    return error


#: The endings of the tar files ``packing.TarImages`` reads (plain, gzip, bzip2 and xz): another tool's
#: WebDataset shards, which ``pack`` converts.
TAR_ENDINGS = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


def tar_names(folder) -> tuple[list[str], set[str]]:
    """The names of the tar files (``TAR_ENDINGS``) directly in local ``folder``, sorted, and the names of
    everything there (dot files aside in both; neither if the folder cannot be listed)."""
    try:
        entries = [e for e in os.scandir(folder) if not e.name.startswith(".")]
    except OSError:
        return [], set()
    tars = sorted(e.name for e in entries if e.name.lower().endswith(TAR_ENDINGS) and e.is_file())
    return tars, {e.name for e in entries}


def foreign_tars(folder) -> list[str]:
    """The names of the tar files in local ``folder`` that ``pack`` did not write, sorted (``tar_names``).
    ``pack`` writes a record ``NAME.json`` beside each of its tars: a folder of those is an interrupted
    pack, not another tool's tars."""
    tars, names = tar_names(folder)
    return [n for n in tars if f"{n.rpartition('.tar')[0]}.json" not in names]


def index_document(*, shards: list[dict], classes, samples: dict, key_width: int, fingerprint: str,
                   source: dict, plan: str | None = None) -> dict:
    """The JSON object of an ``index.json`` (``pack`` writes it; ``parse_index`` reads it). ``plan``:
    a digest of what the pack was made from, which tells ranks and re-runs whose index it is."""
    doc = {"format": FORMAT, "version": VERSION, "num_samples": len(samples["label"]), "key_width": key_width,
           "fingerprint": fingerprint, "classes": [str(c) for c in classes], "source": source,
           "shards": shards, "samples": samples}
    if plan is not None:
        doc["plan"] = plan
    return doc


def write_json_atomic(path, doc) -> None:
    """Write ``doc`` as compact JSON to ``path`` through a temporary file and ``os.replace``: a reader
    never sees half of it."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def dali_index_text(samples) -> str:
    """The text of a DALI ``fn.readers.webdataset`` index (format v1.2, as ``wds2idx`` writes it): line 1
    ``v1.2 <samples>``, then per sample ``<ext> <data offset> <size> <member name>`` for each member.

    Args:
        samples: per sample, a list of ``(ext, data_offset, size, member_name)``.
    """
    lines = [f"v1.2 {len(samples)}"]
    for members in samples:
        for ext, _offset, _size, name in members:
            # The format is space-separated: a space would shift every later field of the line.
            if any(c.isspace() for c in f"{ext}{name}"):
                raise ValueError(f"DALI index member {name!r} has whitespace, which the v1.2 format cannot hold")
        lines.append(" ".join(f"{e} {o} {s} {n}" for e, o, s, n in members))
    return "\n".join(lines) + "\n"


def write_dali_index(path, samples) -> None:
    """Write ``dali_index_text(samples)`` to ``path`` atomically (temporary file, ``os.replace``)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(dali_index_text(samples))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
