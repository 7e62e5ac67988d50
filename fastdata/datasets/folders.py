"""ImageFolder: encoded photos on disk, one sub-folder per class (torchvision's layout and order)."""
from __future__ import annotations

import operator
import os
import stat
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..config import Augmentation, SourceKind
from ..errors import DecodeError
from .base import IMAGENET_MEAN, IMAGENET_STD, Source, check_labels
from .sample_transforms import check_sample_transform, transform_output

#: torchvision's ``IMG_EXTENSIONS``: the same folder lists the same files in both ImageFolders (their
#: fingerprints agree, so a checkpoint resumes across the two), and every file Pillow decodes counts.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _scandir(folder) -> list:
    """os.scandir that names the folder it cannot read (os.walk skips it silently: its images vanish)."""
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as e:
        raise type(e)(e.errno, f"cannot read folder '{folder}' of the image folder: {e.strerror}; its "
                                f"images would be missing (fix its permissions or remove it)") from None


def _is_folder(entry: os.DirEntry) -> bool:
    """Whether a folder entry is a folder, following links. A link that cannot be followed (a loop,
    ``a.jpg -> a.jpg``) is not one: like a dangling link it is listed as a file, and reading it is the
    DecodeError naming it that ``on_error`` skips, rather than an OSError that refuses the whole folder."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _walk_images(folder, exts, visited: set, marked: set, real_root: str):
    """Image files under ``folder``, following links to folders, each real folder once (``visited``:
    those of this class, so a loop ends and a folder linked twice is read once). A link to one of the
    ``marked`` folders (the root, a class folder) is skipped: it would loop, or relabel another class's
    photos. A real sub-folder is read even where a class folder links to it: it is this class's too.
    Yields ``(folder, name)`` pairs: the sort key of torchvision's order, without splitting each path
    again (``os.path.dirname`` and ``basename`` per file cost as much as the rest of the listing).

    Depth first with an explicit stack of listings, not a call per level: a downloaded folder nested
    deeper than Python's recursion limit (1,000) was a RecursionError naming nothing. The visiting
    order is the recursive walk's exactly (a sub-folder is walked where its entry is met), so which
    path of a folder linked twice is listed, and so every sample id, is unchanged."""
    stack = [(os.fspath(folder), iter(_scandir(folder)))]
    while stack:
        folder_name, entries = stack[-1]
        entry = next(entries, None)
        if entry is None:
            stack.pop()
            continue
        if entry.name.startswith("."):
            continue
        if _is_folder(entry):
            real = os.path.realpath(entry.path)
            if real_root.startswith(real.rstrip(os.sep) + os.sep):
                raise ValueError(f"folder link '{entry.path}' points to '{real}', which contains the image "
                                 f"folder '{real_root}' itself: reading it would loop")
            if real in visited or (real in marked and entry.is_symlink()):
                continue
            visited.add(real)
            stack.append((entry.path, iter(_scandir(entry.path))))
        elif entry.name.lower().endswith(exts):
            yield folder_name, entry.name


#: How ``os.fsdecode`` decodes a file name.
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


class PathTable(Sequence):
    """File paths as one ``bytes`` buffer and the end offset of each (int64): ``ImageFolder.paths``.

    Why not a list of str: a forked DataLoader worker that reads a file touches its path object's
    reference count, and so copies the memory page holding it: over an ImageNet epoch each worker
    copied all 1.28M of the parent's path objects (about 140 MB a worker, 64 workers on a node of 8
    GPUs), and the list cost twice the paths' bytes. Two objects, whatever the count: reading path ``i``
    writes to no shared page. A read-only sequence of str (indexing, ``len``, iteration, ``==`` with a
    list, ``+`` with one: a list), as the list was; not a list: ``list(paths)`` for one to change,
    shuffle or ``json.dump`` (the paths and ``labels`` go together: change both through ``subset``).
    """

    __slots__ = ("_blob", "_ends")

    #: Paths gathered at once by ``take`` (its transient index arrays: ~25 bytes per byte of path).
    _TAKE_RUN = 1 << 14

    def __init__(self, paths=()):
        try:
            encoded = [os.fsencode(p) for p in paths]
        except UnicodeEncodeError:
            raise _unencodable(paths) from None
        self._blob = b"".join(encoded)
        self._ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        ends = self._ends
        n, j = len(ends), operator.index(i)
        j = j + n if j < 0 else j
        if not 0 <= j < n:
            raise IndexError(f"path index {i} is out of range for {n} paths")
        # bytes.decode, not os.fsdecode: the same decoding at half the cost, and a backend (DALI's
        # reader of plain files) names every file of every batch through this.
        return self._blob[ends[j - 1] if j else 0:ends[j]].decode(_FS_ENCODING, _FS_ERRORS)

    def __iter__(self):
        a, blob = 0, self._blob
        for b in self._ends.tolist():
            yield blob[a:b].decode(_FS_ENCODING, _FS_ERRORS)
            a = b

    def __eq__(self, other):
        if isinstance(other, PathTable):
            return self._blob == other._blob and np.array_equal(self._ends, other._ends)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            # as a list compares: False (not TypeError) against a list of anything but paths
            return len(self) == len(other) and all(isinstance(b, (str, os.PathLike)) and a == os.fspath(b)
                                                   for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other):   # ``paths + [...]``: a list, as the list's ``+`` made one
        if isinstance(other, (list, tuple, PathTable)):
            return [*self, *other]
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, (list, tuple)):
            return [*other, *self]
        return NotImplemented

    __hash__ = None   # type: ignore[assignment]   # equal to a list, which has none

    @classmethod
    def concat(cls, tables: list) -> "PathTable":
        """The paths of ``tables``, one after the other."""
        out = cls()
        if tables:
            out._blob = b"".join(t._blob for t in tables)
            bases = np.cumsum([0] + [len(t._blob) for t in tables[:-1]])
            out._ends = np.concatenate([t._ends + base for t, base in zip(tables, bases)])
        return out

    def take(self, idx: np.ndarray) -> "PathTable":
        """The paths ``idx`` (int64), in that order, as a new table: vectorized, no str per path."""
        idx = np.asarray(idx, dtype=np.int64)
        all_starts = np.concatenate([[0], self._ends[:-1]])
        out = PathTable()
        out._ends = np.cumsum(self._ends[idx] - all_starts[idx])
        blob, parts = np.frombuffer(self._blob, np.uint8), []
        # In runs of paths: the index arrays below hold 8 bytes per byte of path, so the whole table at
        # once peaked at ~24x its buffer (1.2 GB for ImageNet's 67 MB of paths; the list was ~10 MB).
        for a in range(0, len(idx), self._TAKE_RUN):
            starts = all_starts[idx[a:a + self._TAKE_RUN]]
            lengths = self._ends[idx[a:a + self._TAKE_RUN]] - starts
            # byte k of the run is byte (k - new start + old start) of its path in the old buffer
            shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
            parts.append(blob[np.arange(len(shift)) + shift].tobytes())
        out._blob = b"".join(parts)
        return out

    def __repr__(self):
        first = f", first {self[0]!r}" if len(self) else ""
        return f"PathTable({len(self)} paths{first})"


def _unencodable(paths) -> ValueError:
    """The error for a path no file can have: a str whose surrogate no bytes decode to (only \\udc80-
    \\udcff are os.fsdecode's stand-ins for undecodable bytes), named, with its character and place."""
    for p in paths:
        try:
            os.fsencode(p)
        except UnicodeEncodeError as e:
            return ValueError(f"path {p!r} names no file: its character {e.object[e.start]!r} (at {e.start}) is a "
                              f"lone surrogate, which the file-system encoding ({_FS_ENCODING}, errors="
                              f"{_FS_ERRORS}) cannot turn into bytes; a name that is not {_FS_ENCODING} is read "
                              f"as os.listdir and os.fsdecode give it (its bytes as \\udc80-\\udcff), or "
                              f"given as bytes")
    return ValueError("a path cannot be encoded to bytes")   # the paths changed under the call


def _refuse_empty(empty: list[str], exts) -> None:
    """The error for class folders without an image: all of them at once (not one per run), and the
    way to keep such a class (a validation split that lacks one keeps the training split's labels)."""
    names = ", ".join(f"'{e}'" for e in empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
    raise FileNotFoundError(f"class folder{'s' if len(empty) > 1 else ''} {names} "
                            f"{'have' if len(empty) > 1 else 'has'} no images with endings {list(exts)}: "
                            f"remove {'them' if len(empty) > 1 else 'it'}, or list the files with "
                            f"ImageFolder.from_samples(samples, classes), which keeps a class without files")


def read_file(path) -> tuple[bytes, int]:
    """(a file's bytes, a stamp of its size and mtime), read once; a failure is the DecodeError that
    names the file, as every backend raises it."""
    try:
        # O_NONBLOCK: opening a named pipe waits for a writer, forever (a hung epoch); for a regular
        # file it changes nothing. Only a regular file is read: a pipe, or a link to /dev/zero, would
        # be read until memory runs out.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = _KIND_OF_MODE.get(stat.S_IFMT(mode), "a special file")
                raise DecodeError(str(path), f"not a regular file ({kind}): an image is read from a file")
            data = f.read()
            st = os.fstat(fd)   # after the read, as before: the stamp describes the bytes read
    except OSError as e:
        raise _file_error(path, e) from None
    return data, file_stamp(st)


#: How ``read_file`` names a file that is not a regular one.
_KIND_OF_MODE = {stat.S_IFIFO: "a named pipe", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                 stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}


def _file_error(path, e: OSError) -> DecodeError:
    """The DecodeError naming ``path`` for the OSError of reading or stat-ing it."""
    if isinstance(e, FileNotFoundError):
        return DecodeError(str(path), "file not found")
    return DecodeError(str(path), f"cannot read the file ({type(e).__name__}: {e.strerror or e})")


def file_stamp(st: os.stat_result) -> int:
    """The stamp of a file's size and modification time, in 63 bits (``read_file``'s and ``stat_file``'s)."""
    return (st.st_size * 1_000_003 + st.st_mtime_ns) & 0x7FFF_FFFF_FFFF_FFFF


def stat_file(path) -> tuple[int, int]:
    """(a file's size, ``read_file``'s stamp of it) from one ``stat``, without reading it; a failure is
    the DecodeError that ``read_file`` would raise."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise _file_error(path, e) from None
    return st.st_size, file_stamp(st)


#: Files per stat task of ``_file_sizes``.
_STAT_RUN = 4096


def _file_sizes(paths: Sequence[str]) -> list[int]:
    """Each file's size (-1 for one gone since the walk: its batch will name it, and a checkpoint must
    not fail). On threads, a run of files per task: on a network file system a stat is a round trip
    that releases the GIL, and 1.28M of them in a row are minutes."""
    def sizes(run: range) -> list[int]:
        out = []
        for i in run:
            try:
                out.append(os.stat(paths[i]).st_size)
            except OSError:
                out.append(-1)
        return out

    runs = [range(a, min(a + _STAT_RUN, len(paths))) for a in range(0, len(paths), _STAT_RUN)]
    if len(runs) <= 1:
        return sizes(range(len(paths)))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(8, len(runs))) as pool:
        return [size for run in pool.map(sizes, runs) for size in run]


def photo_augmentation(train: bool, transform) -> Augmentation:
    """The default recipe of photos (``ImageFolder.default_augmentation``, and ``Shards`` packed from
    photos): ImageNet's training or evaluation crops; none with a per-sample ``transform``, which is
    the augmentation."""
    if transform is not None:
        return Augmentation.none()
    return Augmentation.imagenet_train() if train else Augmentation.imagenet_eval()


def _tars_hint(root: Path) -> str:
    """Advice for a folder of tar files taken for an image folder: WebDataset shards of another tool,
    which ``pack`` converts (``fastdata.packing.TarImages``); empty for any other folder."""
    from ..shards.index import foreign_tars  # at the call: only a failed listing needs it

    tars = foreign_tars(root)
    if not tars:
        return ""
    return (f"; it holds {len(tars)} tar file(s) ({tars[0]}, ...): WebDataset shards written by another "
            f"tool are converted once with `python -m fastdata pack {root} OUT`, and OUT is then the "
            f"source (Shards(OUT))")


class ImageFolder(Source):
    """One sub-folder per class of image files (ImageNet's layout); classes sorted by name. The files
    are those torchvision's ImageFolder lists (``IMAGE_EXTENSIONS``: JPEG, PNG, BMP, TIFF, WebP, PPM/PGM),
    except names starting with a dot (macOS's ``._`` AppleDouble files are not images).

    ``ImageFolder.from_samples`` builds one over a given file list instead (what torchvision's
    ImageFolder/DatasetFolder hold in ``.samples``). ``source[i]`` is ``(uint8 tensor (H, W, 3), label)``:
    the file decoded at full size (EXIF orientation applied, converted to RGB), then ``transform``.

    Args:
        root: the folder whose sub-folders are the classes.
        extensions: file endings that count as images (case-insensitive).
        mean, std: normalization statistics in [0, 1] units (ImageNet's by default).
        transform: a per-sample callable applied to each decoded RGB PIL image (after EXIF orientation
            and RGB conversion) by the backends that decode per sample on the CPU (torch, prefetch). It
            returns a PIL image, a uint8 tensor (C, H, W) or a uint8 array (H, W, C), of one size for
            every sample (end it with a fixed-size crop or resize). A float output (ToTensor, ToDtype,
            Normalize at the end) is refused: normalization happens on the device (pass mean=/std=).
            With a transform the source's default augmentation is none (the transform is the
            augmentation) and a loader's ``augment`` other than none is refused. Its random draws use
            torch's, Python's and numpy's global generators, seeded per sample from the batch's seed,
            so runs repeat whatever the number of workers (the caller's generators are restored).
    """

    kind = SourceKind.FILES
    hwc_samples = True

    def __init__(self, root, extensions=IMAGE_EXTENSIONS, *, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                 transform=None):
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"image folder '{root}' does not exist")
        if not root.is_dir():
            raise NotADirectoryError(f"image folder '{root}' is not a directory")
        exts = tuple(e.lower() for e in extensions)
        classes = sorted(e.name for e in _scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise FileNotFoundError(f"image folder '{root}' has no class sub-folders "
                                    f"(expected root/<class>/<image>{exts[0]}){_tars_hint(root)}")
        # Every real directory is walked once per class. The root and the class folders are marked up
        # front, so a link back to them (a/loop -> ..) neither loops (os.walk(followlinks=True) re-reads
        # the tree through it: 6 images became 2,706) nor relabels another class's images. Once per class,
        # not once for the tree: a folder linked from two classes (a label view made of links) is in
        # both, as torchvision lists it, not in whichever class sorts first.
        real_root = os.path.realpath(root)
        marked = {real_root} | {os.path.realpath(root / c) for c in classes}
        parts, counts, empty = [], [], []
        for cls in classes:
            # torchvision's order: folders by path, then the files of each by name (its
            # sorted(os.walk(...)) then sorted(fnames)), so a nested class folder lists "z.jpg" before
            # "more/b.jpg" in both, and sample i is the same file in both (fingerprints, indices=).
            # Packed class by class: one class's str objects at a time, never the whole list's.
            files = PathTable(os.path.join(folder, name) for folder, name in
                              sorted(_walk_images(root / cls, exts, {os.path.realpath(root / cls)}, marked, real_root)))
            if not len(files):
                empty.append(str(root / cls))
            parts.append(files)
            counts.append(len(files))
        if empty:
            _refuse_empty(empty, exts)
        labels = np.repeat(np.arange(len(classes), dtype=np.int64), counts)
        self._init(root, classes, PathTable.concat(parts), labels, mean, std, transform,
                   f"imagefolder:{root.name}")

    @classmethod
    def from_samples(cls, samples, classes, *, root=None, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                     transform=None, name: str | None = None) -> "ImageFolder":
        """An image-folder source over a given file list: torchvision's ``DatasetFolder.samples``, or
        any list of ``(path, class index)``. Read by every backend, as a walked folder is.

        Args:
            samples: ``(path, label)`` pairs; labels are integers in ``[0, len(classes))``; a path is a
                str (a name that is not UTF-8 as ``os.fsdecode`` gives it), bytes or a ``PathLike``.
            classes: the class names, index = label (classes with no file are allowed); None: unnamed,
                ``0 .. max(label)``.
            root: the folder paths are relative to in the fingerprint (a copy of the data elsewhere
                still resumes); None → the paths' common folder.
            mean, std, transform: as for ``ImageFolder``.
            name: how messages name the source; None → ``imagefolder:<root's name>``.
        """
        samples = list(samples)
        if not samples:
            raise ValueError("samples is empty: an image-folder source needs at least one (path, label)")
        for i, s in enumerate(samples):
            if not isinstance(s, (tuple, list)) or len(s) != 2 or not isinstance(s[0], (str, bytes, os.PathLike)):
                raise TypeError(f"samples[{i}] must be a (path, label) pair, got {s!r}")
        if classes is None:   # a list of (path, label) with no names: the labels' classes, 0 .. max
            classes = list(range(int(check_labels([lab for _, lab in samples], "samples' labels").max()) + 1))
        classes = list(classes)
        if not classes:
            raise ValueError("classes is empty: name at least one class")
        paths = [os.fsdecode(p) for p, _ in samples]   # bytes (a Linux name as it is) read as os.listdir's str
        labels = check_labels([lab for _, lab in samples], "samples' labels", num_classes=len(classes))
        root = Path(root) if root is not None else Path(os.path.commonpath([os.path.dirname(p) or "."
                                                                            for p in paths]))
        self = cls.__new__(cls)
        self._init(root, classes, paths, labels, mean, std, transform, name or f"imagefolder:{root.name}")
        return self

    def _init(self, root, classes, paths, labels, mean, std, transform, name) -> None:
        if transform is not None:
            check_sample_transform(transform, f"ImageFolder '{root}'")
        self.root = root
        self.classes = classes
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        self.paths = paths if isinstance(paths, PathTable) else PathTable(paths)
        self.labels = labels
        self.channels = 3
        self.num_classes = len(classes)
        self.mean, self.std = tuple(mean), tuple(std)
        self.name = name
        self.transform = transform
        self._fingerprint: str | None = None

    @property
    def sample_transform(self):
        """The ``transform`` given, or None."""
        return self.transform

    def fingerprint(self) -> str:
        # The file list (relative paths and labels) and the file sizes. Not the mtimes: copying a data
        # set to a node's local disk changes them but not the data. Computed once (one stat per file),
        # at the first checkpoint or resume: for ImageNet's 1.28M files that took ~17 s on one thread,
        # half of it os.path.relpath (two abspaths, so two getcwd calls, per file).
        if self._fingerprint is None:
            # os.fsencode, not str.encode: a name that is not UTF-8 (a Latin-1 name from an old camera or
            # archive) is a str with surrogates that encode() refuses; for any other name the same bytes.
            # str(): torchvision's ImageNet names each class by a tuple of synonyms (a name is itself).
            crc = zlib.crc32(os.fsencode("\n".join(map(str, self.classes))))
            sizes = _file_sizes(self.paths)
            prefix = os.path.join(os.fspath(self.root), "")
            rows = []
            for path, label, size in zip(self.paths, self.labels.tolist(), sizes, strict=True):
                rel = path[len(prefix):] if path.startswith(prefix) else ""
                # normpath only where it may change something ("//", a "." or ".." part, a final "/"):
                # per file, it was a third of the time of this loop.
                if not rel or rel.startswith(".") or rel.endswith("/") or "//" in rel or "/." in rel:
                    if not rel or rel.startswith("..") or os.path.normpath(rel) != rel:
                        rel = os.path.relpath(path, self.root)   # what the slice equals for a normal path
                rows.append(f"{rel}\0{label}\0{size}\n")
                if len(rows) == 4096:   # one encode and one crc32 per run of rows (CRC-32 chains: the
                    crc = zlib.crc32(os.fsencode("".join(rows)), crc)   # same value as row by row)
                    rows = []
            crc = zlib.crc32(os.fsencode("".join(rows)), crc)
            self._fingerprint = (f"{type(self).__name__} n={len(self)} classes={self.num_classes} "
                                 f"files={crc:08x}{self._subset_tag()}")
        return self._fingerprint

    def default_augmentation(self, train: bool) -> Augmentation:
        """Training: ``Augmentation.imagenet_train()``; evaluation: ``imagenet_eval()``. With a
        ``transform``: none (the transform is the augmentation).

        Args:
            train: the training recipe (else the evaluation one).
        """
        return photo_augmentation(train, self.transform)

    def read_stamped(self, i: int) -> tuple[bytes, int]:
        """File ``i``'s bytes and a stamp of its size and modification time, from the open file (no
        second path lookup): a photo replaced in place is learnt again by a backend that keeps headers."""
        return read_file(self.paths[i])

    def stamp(self, i: int) -> tuple[int, int]:
        """File ``i``'s size and ``read_stamped``'s stamp, from one ``stat``: ``pack`` plans with it
        instead of reading every file twice (once to plan, once to write)."""
        return stat_file(self.paths[i])

    def sample_name(self, i: int) -> str:
        """File ``i``'s path."""
        return str(self.paths[i])

    def _take(self, idx: np.ndarray) -> None:
        # ``paths`` is public: a subclass or a user may have set a list (``self.paths = [...]``), as
        # before it was a PathTable; packed here, as _init packs it.
        paths = self.paths if isinstance(self.paths, PathTable) else PathTable(self.paths)
        self.paths = paths.take(idx)
        self.labels = self.labels[idx]
        self._fingerprint = None

    def __getitem__(self, i):
        """(uint8 tensor (H, W, 3), int label) of sample ``i``: decoded at full size, then ``transform``.

        Args:
            i: an integer in ``[-len, len)``.
        """
        import torch

        from ..images.photo import load_photo

        i = self._index(i)
        image = load_photo(self.read(i), self.sample_name(i), Augmentation.none(), np.random.default_rng(0))
        if self.transform is not None:
            from PIL import Image

            image = transform_output(self.transform(Image.fromarray(image)), self, self.sample_name(i))
        return torch.from_numpy(np.array(image)), int(self.labels[i])  # a writable copy: PIL's is read-only


# ------------------------------------------------------------------------------ per-sample transforms


def _natural_image(rng: np.random.Generator, h: int, w: int, label: int, classes: int) -> np.ndarray:
    """1/f^2-spectrum colour noise (the statistics of photos) plus a class-dependent tint and shapes."""
    fy = np.fft.fftfreq(h)[:, None]
    fx = np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx * fx + fy * fy)
    f[0, 0] = 1.0
    amp = 1.0 / f ** 1.05
    out = np.empty((h, w, 3), np.float32)
    base = rng.normal(size=(h, w // 2 + 1)) + 1j * rng.normal(size=(h, w // 2 + 1))
    for c in range(3):  # channels share most of their structure, as in photos
        spec = (base + 0.5 * (rng.normal(size=base.shape) + 1j * rng.normal(size=base.shape))) * amp
        spec[0, 0] = 0
        ch = np.fft.irfft2(spec, s=(h, w))
        out[..., c] = ch / (ch.std() + 1e-8)
    hue = 2 * np.pi * label / max(classes, 1)
    tint = np.array([np.cos(hue), np.cos(hue - 2.1), np.cos(hue + 2.1)], np.float32)
    img = 118 + 42 * out + 35 * tint
    # A few class-specific bright blobs so that classes are learnable from content, not only colour.
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(2 + label % 3):
        cy, cx, r = rng.uniform(0.2, 0.8) * h, rng.uniform(0.2, 0.8) * w, rng.uniform(0.06, 0.15) * min(h, w)
        mask = ((yy - cy) ** 2 + (xx - cx) ** 2) < r * r
        img[mask] += 60 * tint
    return np.clip(img, 0, 255).astype(np.uint8)


def make_image_folder(root, classes: int = 10, per_class: int = 20, seed: int = 0, *,
                      size_range=((400, 500), (300, 400)), quality: int = 90) -> Path:
    """Write a JPEG folder that looks like ImageNet's: 400-500 x 300-400 px, quality 90, ~80-120 KB.

    Deterministic by seed; existing files of the same name are overwritten. Returns ``root``.

    Args:
        root: the folder to write (created if missing).
        classes: number of class sub-folders.
        per_class: photos per class.
        seed: the same seed writes the same photos.
        size_range: ((min width, max width), (min height, max height)) in pixels; half the photos are
            then turned to portrait.
        quality: JPEG quality.
    """
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng([seed, 0x1A6E])
    for c in range(classes):
        d = root / f"class_{c:03d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w = int(rng.integers(size_range[0][0], size_range[0][1] + 1))
            h = int(rng.integers(size_range[1][0], size_range[1][1] + 1))
            if rng.random() < 0.5:  # ImageNet has portrait images too
                w, h = h, w
            arr = _natural_image(rng, h, w, c, classes)
            Image.fromarray(arr).save(d / f"img_{i:05d}.jpg", quality=quality)
    return root
