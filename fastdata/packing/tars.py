"""``TarImages``: WebDataset-style tars written by another tool (``webdataset``'s ``TarWriter``, Python's
``tarfile``, GNU tar), read as a source of encoded photos, so that ``python -m fastdata pack TARS/ OUT``
converts them into a pack (index, digests, DALI ``.idx`` files) that ``Shards`` streams.

Why a scan, and not webdataset's reader: fastdata reads a sample by its byte range, so it needs every
member's offset (``tarfile`` gives it, after pax and GNU long-name headers), and tars made by hand are
not in WebDataset's order: GNU tar adds a folder's files in directory order (``a.cls``, ``b.jpg``,
``a.jpg``), and webdataset, which groups only consecutive members, splits such samples apart. Here
members are grouped by key over the whole tar.

The rules, as WebDataset's and DALI's where they have one:
- A sample's key is the member's path with its file name cut at the first dot (``dir/a.b.jpg``: key
  ``dir/a``, extension ``b.jpg``); extensions are compared in lower case (``A.JPG`` is a JPEG).
- Its image is the member whose last extension is an image's (``IMAGE_EXTENSIONS``; ``.jpeg`` too). A
  key with several: the one with a plain extension (``a.jpg`` before ``a.seg.png``); else the key is
  split at the last dot (``img.001.jpg``/``img.001.cls`` and ``img.002.jpg``/``img.002.cls`` are two
  samples); else an error naming the members.
- Its label is the first of ``.cls``, ``.class``, ``.label``, ``.target``, ``.txt``, ``.json`` it has:
  an integer, or a class name (text; in JSON a number, a string, or an object's ``label``/``cls``/
  ``class``/``target``). Integers are the classes ``0 .. max``; names are sorted into classes. An
  index past ``MAX_CLASS_INDEX`` (2**24 - 1) is refused: it would make that many class names.
- An image member larger than ``max_member_bytes`` (``shards.index.MAX_MEMBER_BYTES``, what ``pack``
  writes and shard readers accept) is refused when scanned: a tar's header claims any size.
- Directories, symbolic links and macOS's ``._`` files are not members of a sample; a hard link reads
  its target's bytes. A sparse member (GNU tar ``--sparse``) is refused: its bytes are not in one piece.
- Compressed tars (``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``) are read through their decompressor
  (a member costs the decompression up to it: fine for ``pack``, which reads them in order; random
  reads of an uncompressed tar cost one ``pread``).

A sample without an image or a label, labels of both kinds, a member past the end of a truncated tar:
each is an error naming the tar and the member, raised when the source is created (a truncated
``.tar.gz`` when its bytes are read), never a sample quietly dropped or given another's label.
"""
from __future__ import annotations

import importlib
import json
import os
import tarfile
import threading
import zlib
from dataclasses import dataclass

import numpy as np

from ..config import SourceKind
from ..datasets.base import IMAGENET_MEAN, IMAGENET_STD, Source
from ..datasets.folders import IMAGE_EXTENSIONS, ImageFolder, PathTable
from ..errors import DecodeError
from ..shards.index import MAX_MEMBER_BYTES, TAR_ENDINGS, tar_names

#: The module that decompresses each compressed tar ending (the endings read: shards.index.TAR_ENDINGS).
_COMPRESSED = {".tar.gz": "gzip", ".tgz": "gzip", ".tar.bz2": "bz2", ".tbz2": "bz2", ".tar.xz": "lzma",
               ".txz": "lzma"}
_IMAGES = {e[1:] for e in IMAGE_EXTENSIONS}
#: Label members, most specific first: the first one a sample has is its label.
_LABELS = ("cls", "class", "label", "target", "txt", "json")
_JSON_KEYS = ("label", "cls", "class", "target")
_LABEL_BYTES = 2**20
#: The largest integer label (class index) taken: classes are ``0 .. max``, one name each, so a crafted
#: label ``1000000000000`` would allocate 10**12 names. 16.7 million classes is far past any dataset's.
MAX_CLASS_INDEX = 2**24 - 1


@dataclass(frozen=True)
class _Member:
    name: str       # the member's path in the tar
    offset: int     # of its data in the (uncompressed) tar
    size: int
    data: bytes | None = None   # a label member's bytes, read during the scan


def find_tars(location) -> list[str]:
    """The tars ``location`` names: itself (a tar file) or the tar files directly in it (a folder), sorted."""
    path = os.fspath(location)
    if os.path.isfile(path):
        return [path] if path.lower().endswith(TAR_ENDINGS) else []
    return [os.path.join(path, name) for name in tar_names(path)[0]]


def _split(name: str, dot: str = "first") -> tuple[str, str]:
    """(key, lower-case extension) of member ``name``: its file name cut at the first (or last) dot."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".") if dot == "first" else base.rpartition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _kind(ext: str) -> str | None:
    last = ext.rpartition(".")[2]
    return "image" if last in _IMAGES else "label" if last in _LABELS else None


def _scan(tar_path: str, max_member_bytes: int = MAX_MEMBER_BYTES) -> list[_Member]:
    """The tar's file members in order (hard links resolved to their target's bytes), checked to lie
    inside the file, image members no larger than ``max_member_bytes``."""
    members: dict[str, _Member] = {}
    last = None
    try:
        with tarfile.open(tar_path, "r:*") as tar:
            for m in tar:
                last = m.name
                if m.issparse():
                    raise ValueError(f"tar '{tar_path}': member '{m.name}' is sparse (GNU tar --sparse): its bytes "
                                     f"are not stored in one piece; create the tar again without --sparse")
                if m.islnk():
                    target = members.get(m.linkname)
                    if target is not None:   # its data: the bytes of the member it links to
                        members[m.name] = _checked(_Member(m.name, target.offset, target.size, target.data),
                                                   tar_path, max_member_bytes)
                    continue
                if m.isreg():   # directories, symbolic links, devices: no sample's bytes
                    members[m.name] = _checked(_Member(m.name, m.offset_data, m.size, _label_bytes(tar, m, tar_path)),
                                               tar_path, max_member_bytes)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        # tarfile checks that each member's data is there before it reads the next header.
        where = f"it ends inside or after member '{last}'" if last else "at its first member"
        raise ValueError(f"tar '{tar_path}' is truncated or damaged: {where} ({type(e).__name__}: {e}); copy "
                         f"or create it again") from None
    return [m for m in members.values() if not m.name.rpartition("/")[2].startswith("._")]


def _checked(member: _Member, tar_path: str, max_member_bytes: int) -> _Member:
    """``member``, unless it is an image past the limit: a tar's header claims any size, and a 5 MB
    ``.tar.gz`` of zeros holds a 1 GB member that each read of the sample would put in memory."""
    if member.size > max_member_bytes and _kind(_split(member.name)[1]) == "image":
        raise ValueError(f"tar '{tar_path}': image member '{member.name}' is {member.size:,} bytes, past the "
                         f"image limit of {max_member_bytes:,} bytes (shards.index.MAX_MEMBER_BYTES, which "
                         f"pack and shard readers keep to); re-encode the photo smaller, or read such tars "
                         f"directly with TarImages(..., max_member_bytes=N)")
    return member


def _label_bytes(tar: tarfile.TarFile, m: tarfile.TarInfo, tar_path: str) -> bytes | None:
    """A label member's bytes (read now: a ``.tar.gz`` is not read twice to learn its labels), else None."""
    if _kind(_split(m.name)[1]) != "label":
        return None
    if m.size > _LABEL_BYTES:
        raise ValueError(f"tar '{tar_path}': label member '{m.name}' is {m.size} bytes: a label is a class "
                         f"index or name (at most {_LABEL_BYTES} bytes)")
    f = tar.extractfile(m)
    data = f.read() if f is not None else b""
    if len(data) != m.size:
        raise EOFError(f"member '{m.name}' ends after {len(data)} of its {m.size} bytes")
    return data


def _samples(tar_path: str, members: list[_Member]) -> list[tuple[_Member, _Member]]:
    """(image, label) per sample of one tar, in the order of their first member."""
    groups: dict[str, list[tuple[str, _Member]]] = {}
    for m in members:
        key, ext = _split(m.name)
        if _kind(ext) is not None:
            groups.setdefault(key, []).append((ext, m))
    out = []
    for key, group in groups.items():
        # Keys with dots (img.001.jpg + img.001.cls, img.002.jpg + img.002.cls: one WebDataset key 'img'):
        # when every full stem has its own image and label, each is a sample.
        by_stem: dict[str, list] = {}
        for ext, m in group:
            by_stem.setdefault(_split(m.name, "last")[0], []).append((ext, m))
        stems = [_pair(g) for g in by_stem.values()]
        if len(stems) > 1 and all(p is not None and None not in p for p in stems):
            out += stems
            continue
        pair = _pair(group)
        if pair is None:
            names = ", ".join(m.name for ext, m in group if _kind(ext) == "image")
            raise ValueError(f"tar '{tar_path}': sample '{key}' has several images ({names}) and none is "
                             f"the sample's own: WebDataset's key is the file name up to its first dot; "
                             f"give each sample one image (KEY.jpg) and one label (KEY.cls)")
        out.append(pair)
    for image, label in out:
        if image is None or label is None:
            what, has = ("image", label) if image is None else ("label (.cls, .txt, .json, ...)", image)
            raise ValueError(f"tar '{tar_path}': sample '{_split(has.name)[0]}' has no {what} member, only "
                             f"'{has.name}'; every sample needs an image and its label")
    return out


def _pair(group: list[tuple[str, _Member]]):
    """(image or None, label or None) of one key's members; None when its image is ambiguous. Of several,
    the plain ones (``KEY.jpg``, ``KEY.cls``) are the sample's; labels in ``_LABELS``' order."""
    images = [(ext, m) for ext, m in group if _kind(ext) == "image"]
    labels = [(ext, m) for ext, m in group if _kind(ext) == "label"]
    if len(images) > 1:
        plain = [(ext, m) for ext, m in images if "." not in ext]
        if len(plain) != 1:
            return None
        images = plain
    label = min(labels, key=lambda em: (_LABELS.index(em[0].rpartition(".")[2]), "." in em[0]),
                default=(None, None))[1]
    return (images[0][1] if images else None), label


def _label(data: bytes, where: str):
    """The label a label member holds: an int, or a class name (str)."""
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"label member '{where}' is not text (UTF-8)") from None
    value: object = text
    if where.lower().endswith(".json"):
        try:
            value = json.loads(text)
        except ValueError:
            raise ValueError(f"label member '{where}' is not JSON: {text[:60]!r}") from None
        if isinstance(value, dict):
            key = next((k for k in _JSON_KEYS if k in value), None)
            if key is None:
                raise ValueError(f"label member '{where}' is a JSON object without any of {list(_JSON_KEYS)}: "
                                 f"{text[:80]!r}")
            value = value[key]
    if isinstance(value, str) and value.lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_CLASS_INDEX:
        raise ValueError(f"label member '{where}' holds class index {value}, past the largest taken "
                         f"({MAX_CLASS_INDEX}, 2**24 - 1): classes are 0 .. the largest index, one name each")
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value == "" or \
            (isinstance(value, int) and value < 0) or (where.lower().endswith(".cls") and isinstance(value, str)):
        raise ValueError(f"label member '{where}' holds {text[:60]!r}: a label is a class index (an integer "
                         f">= 0) or a class name")
    return value


class TarImages(Source):
    """WebDataset-style tars written by another tool, as a source of encoded photos (the module's rules).

    ``python -m fastdata pack TARS/ OUT`` reads a folder of them through this; ``make_loader`` reads it
    too (an uncompressed tar reads a sample with one ``pread``).

    Args:
        location: a tar (``.tar``, ``.tar.gz``, ``.tgz``) or a local folder holding tars (not its
            sub-folders).
        mean, std: normalization statistics in [0, 1] units (ImageNet's by default).
        max_member_bytes: the largest image member accepted (``shards.index.MAX_MEMBER_BYTES``, 64 MiB, by
            default: what ``pack`` writes and shard readers accept); a larger one is an error naming it.
    """

    kind = SourceKind.FILES
    hwc_samples = True
    transform = None

    def __init__(self, location, *, mean=IMAGENET_MEAN, std=IMAGENET_STD, max_member_bytes: int = MAX_MEMBER_BYTES):
        self.location = os.fspath(location)
        self.tars = find_tars(self.location)
        if not self.tars:
            raise FileNotFoundError(f"'{self.location}' is neither a tar ({', '.join(TAR_ENDINGS)}) nor a folder "
                                    f"holding tars")
        tar_of, offsets, sizes, members, raw = [], [], [], [], []
        for t, tar in enumerate(self.tars):
            for image, label in _samples(tar, _scan(tar, max_member_bytes)):
                tar_of.append(t)
                offsets.append(image.offset)
                sizes.append(image.size)
                members.append(image.name)
                raw.append(_label(label.data or b"", f"{tar}:{label.name}"))
        if not members:
            raise ValueError(f"the tars in '{self.location}' hold no samples (an image member and its label "
                             f"member, KEY.jpg and KEY.cls)")
        self.classes, labels = _classes(raw, self.location)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.num_classes, self.channels = len(self.classes), 3
        self.tar_of = np.asarray(tar_of, dtype=np.int64)
        self.offsets, self.sizes = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
        # Packed, not a list of str: a forked worker reading member i would copy its str's page
        # (datasets.folders.PathTable).
        self.members = PathTable(members)
        self.mean, self.std = tuple(mean), tuple(std)
        self.name = f"tars:{os.path.basename(os.path.normpath(self.location))}"
        # Per tar, its size and mtime: a sample's stamp changes when its tar is rewritten.
        self._versions = [zlib.crc32(f"{(st := os.stat(t)).st_size}\0{st.st_mtime_ns}".encode()) for t in self.tars]
        self._decompressors: dict = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def read_stamped(self, i: int) -> tuple[bytes, int]:
        """Sample ``i``'s image bytes from its tar; a tar that no longer holds them is a DecodeError."""
        tar, offset, size = self.tars[int(self.tar_of[i])], int(self.offsets[i]), int(self.sizes[i])
        try:
            if tar.lower().endswith(".tar"):
                with open(tar, "rb") as f:
                    data = os.pread(f.fileno(), size, offset)
            else:
                data = self._read_compressed(tar, offset, size)
        except (OSError, EOFError, ValueError, zlib.error) as e:   # lzma's and bz2's errors are OSErrors
            raise DecodeError(self.sample_name(i), f"cannot read it from its tar ({type(e).__name__}: {e})") from None
        if len(data) != size:
            raise DecodeError(self.sample_name(i), f"its tar ends {size - len(data)} bytes before the member's end: "
                                                   f"truncated since it was scanned")
        return data, self.stamp(i)[1]

    def _read_compressed(self, tar: str, offset: int, size: int) -> bytes:
        # One decompressor per tar and process: read in order (as pack does), each seek goes forward
        # from the last member; a seek backward starts the tar's decompression again.
        with self._lock:
            if self._pid != os.getpid():
                self._decompressors, self._pid = {}, os.getpid()
            f = self._decompressors.get(tar)
            if f is None:
                module = next(m for end, m in _COMPRESSED.items() if tar.lower().endswith(end))
                f = self._decompressors[tar] = importlib.import_module(module).open(tar, "rb")
            f.seek(offset)
            return f.read(size)

    def stamp(self, i: int) -> tuple[int, int]:
        """Sample ``i``'s size and a stamp of its tar's version and its place in it (nothing read)."""
        version = self._versions[int(self.tar_of[i])]
        return int(self.sizes[i]), (version << 31 ^ int(self.offsets[i])) & 0x7FFF_FFFF_FFFF_FFFF

    def sample_name(self, i: int) -> str:
        """``path/x.tar:KEY.jpg``: the tar and the member (decoders check the bytes against its ending)."""
        return f"{self.tars[int(self.tar_of[i])]}:{self.members[i]}"

    def fingerprint(self) -> str:
        crc = zlib.crc32("\n".join(self.classes).encode())
        for t, name, label, size in zip(self.tar_of, self.members, self.labels, self.sizes):
            crc = zlib.crc32(f"{os.path.basename(self.tars[t])}:{name}\0{label}\0{size}\n".encode(), crc)
        return f"TarImages n={len(self)} classes={self.num_classes} members={crc:08x}{self._subset_tag()}"

    def _take(self, idx: np.ndarray) -> None:
        # ``members`` is public: one set as a list (a subclass, a user's filter) is packed here
        members = self.members if isinstance(self.members, PathTable) else PathTable(self.members)
        self.members = members.take(idx)
        self.labels, self.tar_of = self.labels[idx], self.tar_of[idx]
        self.offsets, self.sizes = self.offsets[idx], self.sizes[idx]
        self._decompressors, self._lock = {}, threading.Lock()   # the copy reads on its own

    def __getstate__(self):
        # A copy sent to a worker process opens its own decompressors; a lock cannot be pickled.
        state = self.__dict__.copy()
        state["_decompressors"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # The recipe and ``source[i]`` are an image folder's: they need only ``read`` and ``sample_name``.
    default_augmentation = ImageFolder.default_augmentation
    __getitem__ = ImageFolder.__getitem__


def _classes(raw: list, where: str) -> tuple[list[str], list[int]]:
    """(class names, label per sample) from the labels read: integers are classes ``0 .. max``, names
    are sorted; both kinds at once is an error (which integer would a name be?)."""
    numbers = [v for v in raw if isinstance(v, int)]
    if numbers and len(numbers) != len(raw):
        name = next(v for v in raw if isinstance(v, str))
        raise ValueError(f"the tars in '{where}' label some samples with class indices ({numbers[0]}) and others "
                         f"with class names ({name!r}): give every sample the same kind of label")
    if numbers:
        return [str(k) for k in range(max(numbers) + 1)], numbers
    names = sorted(set(raw))
    if len(raw) >= 20 and len(names) > len(raw) // 2:
        raise ValueError(f"the tars in '{where}' give {len(names)} different text labels to {len(raw)} samples "
                         f"(such as {names[0][:40]!r}): captions, not classes; give each sample its class index "
                         f"(KEY.cls) or class name")
    index = {c: k for k, c in enumerate(names)}
    return names, [index[v] for v in raw]
