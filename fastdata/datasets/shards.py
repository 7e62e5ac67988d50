"""Shards: a dataset packed by ``fastdata pack`` (WebDataset-layout tars plus ``index.json``), read from a
local folder or any fsspec URL (``https://``, ``s3://``, ``gs://``), by every backend.

The index gives every sample's shard, byte offset and size, so a sample is one read of its bytes (its
512-byte tar header is read with it and checked against the index, which cannot otherwise prove which
member sits at an offset). A remote location is read through a bounded per-node cache of whole shards
(``fastdata.shards.cache``): small-file reads over a network are what make remote data slow, whole
shards are not. The epoch's order (``epoch_order``) shuffles shards, then samples within a window of
``window`` shards, from ``(seed, epoch)`` alone: every rank reads the current window's shards, and the
order does not depend on the world size, so elastic resume reads every sample once, as for folders.
While a pass runs, the loader tells the source where it is (``reading``) and, once, how far its readers
run ahead of that (``plan_in_flight``); the shards of the next window are fetched ahead of the readers
on a thread of the loader's process (``shards.readahead``), and readers in worker processes find them
published in the shared cache folder (or wait, on the shard's lock, for the download in progress).

A shard is checked against the index when it is opened, not per sample: its size at every open, its
sha256 once per version of a local file (``shards.verdicts.Verdicts``) and before a download is published
(the cache keys shards by digest). A shard that is not what the index says is a ``DecodeError`` for its
samples (``on_error="skip"``: skipped and counted), never another pack's labels on its pixels.

A pack of arrays (MNIST, digits, ``ArraySource``, a Dataset of one image size: ``image_shape`` in the
index) reads back as arrays: every PNG is decoded once when ``Shards`` is created, and loaders see
what the source gave (its channels, pixels, default augmentation and statistics), not 3-channel photos.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..config import Augmentation, SourceKind
from ..errors import DecodeError
from .arrays import ArraySource, array_augmentation, take_images
from .base import IMAGENET_MEAN, IMAGENET_STD, Source, channel_stats, check_labels
from .folders import ImageFolder, photo_augmentation

if TYPE_CHECKING:   # the shards format is imported where it is used: importing fastdata loads none of it
    from ..shards.cache import ShardCache
    from ..shards.readahead import ReadAhead

_TAR_HEADER = 512
#: Shards' window when none is given, in every release (positions saved before it was recorded assume it).
_DEFAULT_WINDOW = 4


def _tar_name(header: bytes) -> str:
    """The member name in a ustar header (its prefix field joined, as tarfile does)."""
    name = header[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
    prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace") if header[257:262] == b"ustar" else ""
    return f"{prefix}/{name}" if prefix else name


class Shards(Source):
    """A packed dataset (``python -m fastdata pack``) at ``location``: a folder or an fsspec URL.

    Args:
        location: the folder ``pack`` wrote (``index.json`` and the tars), local or a URL.
        cache_dir: where whole shards of a remote location are kept (give the ranks of a node the same
            folder: one downloads, the others read); default a folder per dataset under the system's
            temporary directory. A local folder is read in place, without a cache; its shards' sha256
            verdicts are kept in ``cache_dir/.verified`` (default: under the temporary directory).
        cache_limit: bytes of shards the cache may hold; default half the free space of ``cache_dir``'s
            disk. It must hold ``2 x window`` of the largest shards (the window being read and the
            next, fetched ahead), which is checked here; and, for no shard to be downloaded twice in a
            pass, the shards of the batches the loader's readers have in flight (``plan_in_flight``).
        window: shards whose samples are shuffled together; more windows mix better, more shards per
            window cost cache space.
        storage_options, retries, timeout: for the transport (``fastdata.shards.storage.Storage``):
            credentials come from fsspec's and boto's usual places or ``storage_options``, never printed.
        mean, std: normalization statistics in [0, 1] units; default the index's, else ImageNet's.
        transform: a per-sample callable on the decoded PIL photo (torch/prefetch backends), as
            ``ImageFolder(transform=...)``; not for a pack of arrays (use ``augment=``).
    """

    kind = SourceKind.FILES
    hwc_samples = True
    random_access = False

    def __init__(self, location, *, cache_dir=None, cache_limit: int | None = None, window: int = _DEFAULT_WINDOW,
                 storage_options: dict | None = None, retries: int = 5, timeout: float = 60.0,
                 mean=None, std=None, transform=None):
        from ..checks import check_integer
        from ..shards.index import INDEX_NAME, load_index
        from ..shards.storage import Storage, redact
        from .sample_transforms import check_sample_transform

        self.window = check_integer("window", window, minimum=1)
        cache_limit = check_integer("cache_limit (bytes)", cache_limit, minimum=1, optional=True)
        self.storage = Storage(location, retries=retries, timeout=timeout, storage_options=storage_options)
        where = self.storage.url(INDEX_NAME)
        self.index = load_index(self.storage)   # its errors name the index, never a shard
        info = self.index.source or {}
        self.classes = list(self.index.classes)
        self.num_classes = len(self.classes)
        self.labels = check_labels(self.index.labels, f"labels of {where}", self.num_classes)
        self.location = redact(self.storage.location)   # what messages show: no credentials
        self.name = f"shards:{self.location}"
        shape = _image_shape(info.get("image_shape"))
        if transform is not None:
            if shape is not None:
                raise ValueError(f"Shards '{where}' holds arrays of {shape[0]}x{shape[1]}x{shape[2]} (packed from "
                                 f"{info.get('type', 'an array source')}): transform= applies to photos; "
                                 f"give the loader augment= instead")
            check_sample_transform(transform, f"Shards '{where}'")
        self.transform = transform
        self._ids = np.arange(len(self.labels), dtype=np.int64)   # into the index (a subset maps here)
        self._cache: ShardCache | None = None
        self._cache_dir, self._cache_limit = cache_dir, cache_limit
        self._verdicts = None
        if self.storage.is_local:
            from ..shards.verdicts import Verdicts

            self._verdicts = Verdicts(os.path.join(cache_dir, ".verified") if cache_dir is not None else
                                      os.path.join(tempfile.gettempdir(), "fastdata-shards", "verified"))
        else:
            self._open_cache()   # the budget is checked now, not at the first read in a worker
        self._prefetcher: ReadAhead | None = None
        # The samples past the position the loader tells that its readers may be reading (plan_in_flight).
        self._in_flight = (0, 0)
        self._lag = 0   # over several ranks one global batch (plan_in_flight): others may read the batch told
        self._stop_ahead: weakref.finalize | None = None   # stops the prefetcher if this is never closed
        self._files = _OpenFiles(2 * self.window, self._cache is not None)
        self._pid = os.getpid()
        self.channels = 3
        self.images: np.ndarray | None = None
        if shape is not None:
            self._load_arrays(shape, info)
        self.mean, self.std = self._statistics(mean, std, info)

    # ------------------------------------------------------------------ the cache
    def _open_cache(self):
        from ..shards.cache import ShardCache

        cache_dir = self._cache_dir
        if cache_dir is None:
            tag = hashlib.sha1(f"{self.location}\0{self.index.fingerprint}".encode()).hexdigest()[:16]
            cache_dir = os.path.join(tempfile.gettempdir(), "fastdata-shards", tag)
        try:
            os.makedirs(cache_dir, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=cache_dir)   # writable: said now, not at a read
            os.close(fd)
            os.unlink(probe)
        except OSError as e:   # a file there, a file above it, a read-only disk: "File exists" named nothing
            raise ValueError(f"Shards: cache_dir '{cache_dir}' cannot be a folder of shards ({type(e).__name__}: "
                             f"{e.strerror or e}); give cache_dir= a folder that can be written") from None
        limit = self._cache_limit
        if limit is None:
            limit = shutil.disk_usage(cache_dir).free // 2
        sizes = {s.name: int(s.size) for s in self.index.shards}
        # Keyed by digest: a location re-packed under the same shard names is never read from old copies.
        self._cache = ShardCache(self.storage, cache_dir, limit_bytes=int(limit), expected_sizes=sizes,
                                 window=min(2 * self.window, len(sizes)),
                                 digests={s.name: s.sha256 for s in self.index.shards})
        self._cache_dir = cache_dir

    def cached_path(self, name: str) -> str | None:
        """Where shard ``name`` of a remote location is kept in the cache (its file name carries its
        digest: ``shard-000000.<16 hex digits>.tar``); None for a local folder, read in place."""
        return None if self._cache is None else self._cache.path(name)

    # ------------------------------------------------------------------ a pack of arrays
    def _load_arrays(self, shape: tuple, info: dict) -> None:
        """Decode every sample once into ``images`` (N, H, W, C) uint8: this source then is an array
        source (``kind`` ARRAY), as the one that was packed."""
        import io

        from PIL import Image

        images = np.empty((len(self.index), *shape), dtype=np.uint8)
        for i in np.argsort(self.index.shard, kind="stable"):   # shard by shard: each one fetched once
            data = self.read(int(i))
            try:
                with Image.open(io.BytesIO(data)) as img:
                    arr = np.asarray(img)
            except Exception as e:  # noqa: BLE001 - any decoder failure is this sample's
                raise DecodeError(self.sample_name(int(i)), f"{type(e).__name__}: {e}") from None
            arr = arr.reshape(*arr.shape[:2], -1)
            if arr.shape != shape or arr.dtype != np.uint8:
                raise DecodeError(self.sample_name(int(i)), f"decodes to {arr.dtype} {arr.shape}, but the index "
                                                            f"says every image is uint8 {shape}")
            images[i] = arr
        self.close()          # every shard is read: no file stays open, nothing is fetched ahead
        self.images, self.channels = images, shape[2]
        self.kind, self.random_access = SourceKind.ARRAY, True
        self.digits = bool(info.get("digits"))

    def _statistics(self, mean, std, info: dict) -> tuple[tuple, tuple]:
        """(mean, std): the ones given, else the index's (the packed source's), else ImageNet's for photos
        and the pixels' own for arrays; one value per channel."""
        packed_mean, packed_std = info.get("mean"), info.get("std")
        if self.images is not None and (not packed_mean or len(packed_mean) != self.channels):
            packed_mean, packed_std = channel_stats(self.images)
        mean = tuple(mean if mean is not None else packed_mean or IMAGENET_MEAN)
        std = tuple(std if std is not None else packed_std or IMAGENET_STD)
        if len(mean) == 1 and self.channels == 3:
            mean, std = mean * 3, std * 3 if len(std) == 1 else std
        return mean, std

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image of a pack of arrays (an AttributeError for photos)."""
        if self.images is None:
            raise AttributeError(f"{self!r} holds photos of their own sizes, not arrays of one shape")
        return self.images.shape[1:]

    def __getstate__(self):
        # A copy (a DataLoader worker) opens its own files and cache handle; the prefetcher stays home.
        state = self.__dict__.copy()
        state.update(self._own_handles())
        return state

    def _own_handles(self) -> dict:
        """The per-process, per-copy state, fresh: open shard files, the read-ahead thread and its stop.
        One place for the fields a copy (``__getstate__``, ``_take``) or a forked process (``_check_process``)
        must not share."""
        return {"_files": _OpenFiles(2 * self.window, self._cache is not None), "_prefetcher": None,
                "_stop_ahead": None}

    def _check_process(self):
        if self._pid != os.getpid():   # forked: the parent's descriptors and thread are not ours
            if self._stop_ahead is not None:
                # Never run here: the parent's thread does not exist in this process, and its Condition
                # may have been copied locked by it.
                self._stop_ahead.detach()
            self.__dict__.update(self._own_handles())
            self._pid = os.getpid()

    # ------------------------------------------------------------------ Source: the bytes
    def sample_name(self, i: int) -> str:
        """``location/shard.tar:KEY.ext``: the shard and member of sample ``i`` (errors name it)."""
        j = int(self._ids[i])
        return f"{self.storage.url(self.index.shards[int(self.index.shard[j])].name)}:{self.index.member(j)}"

    def stamp(self, i: int) -> tuple[int, int]:
        """Sample ``i``'s size and a stamp of its shard's sha256, from the index alone (nothing fetched):
        a reshard or resize by ``pack`` plans without downloading every shard twice, and a source packed
        again under the same shard names (another digest) is not taken for the old one."""
        j = int(self._ids[i])
        digest = self.index.shards[int(self.index.shard[j])].sha256
        return int(self.index.size[j]), int(digest[:15], 16)   # 60 bits of the digest: an int64 stamp

    def read_stamped(self, i: int) -> tuple[bytes, int]:
        """Sample ``i``'s bytes from its shard (a shard's bytes never change under one index: stamp 0)."""
        # Imported here, as the rest of the shards format: importing fastdata loads none of it.
        from ..shards.cache import CacheFull
        from ..shards.storage import ShardMismatch

        self._check_process()
        j = int(self._ids[i])
        shard = self.index.shards[int(self.index.shard[j])].name
        offset, size = int(self.index.offset[j]), int(self.index.size[j])
        cache = self._cache
        try:
            path = self.storage.local_path(shard) if cache is None else cache.get(shard)
            if path is None:   # a remote location always gets a cache (__init__): cannot happen
                raise RuntimeError(f"{self!r}: shard {shard!r} is neither local nor cached")
        except ShardMismatch as e:
            raise DecodeError(self.sample_name(i), f"its shard is not the one the index describes: {e}") from None
        except (CacheFull, TimeoutError):
            # The node's cache (its disk full, a lock held past wait_timeout), not this sample's shard: as a
            # DecodeError, on_error="skip" skipped every sample after it and the pass yielded nothing.
            raise
        except OSError as e:   # StorageError: the shard and URL are in its message; credentials are not
            raise DecodeError(self.sample_name(i), f"cannot fetch its shard ({e})") from None
        try:
            raw = self._files.pread(path, offset - _TAR_HEADER, size + _TAR_HEADER,
                                    check=lambda fd: self._check_shard(j, path, fd))
        except ShardMismatch as e:
            raise DecodeError(self.sample_name(i), f"its shard is not the one the index describes: {e}") from None
        except OSError as e:
            raise DecodeError(self.sample_name(i), f"cannot read its shard ({type(e).__name__}: {e})") from None
        finally:
            # Released by every reader of this process, the file may be evicted: its descriptor is closed
            # first, else an evicted shard's bytes stayed on the disk (deleted, still open) while the cache
            # counted them free, up to 2 x window shards per worker past cache_limit.
            if cache is not None:
                cache.release(shard, last=_Forget(self._files, path))
        if len(raw) != size + _TAR_HEADER:
            raise DecodeError(self.sample_name(i), f"its shard ends {size + _TAR_HEADER - len(raw)} bytes before "
                                                   f"the member's end: a truncated shard")
        member, expected = _tar_name(raw[:_TAR_HEADER]), self.index.member(j)
        if member != expected:
            raise DecodeError(self.sample_name(i), f"the shard holds {member!r} at offset {offset}, not "
                                                   f"{expected!r}: the index does not describe this shard "
                                                   f"(re-pack, or re-download both)")
        return raw[_TAR_HEADER:], 0

    def _check_shard(self, j: int, path: str, fd: int) -> None:
        """Called when a shard file is opened: it is the shard the index describes. Local files: size and
        sha256 (``Verdicts``: hashed once per file version). Cached downloads were hashed before they were
        published under their digest's name: their size is checked."""
        from ..shards.storage import ShardMismatch

        info = self.index.shards[int(self.index.shard[j])]
        where = self.storage.url(info.name)
        if self._verdicts is not None:
            self._verdicts.check(path, fd, size=info.size, sha256=info.sha256, name=info.name, where=where)
        elif os.fstat(fd).st_size != info.size:
            raise ShardMismatch(f"the cached copy of shard '{info.name}' is {os.fstat(fd).st_size} bytes, "
                                f"its index says {info.size}", info.name, where)

    # ------------------------------------------------------------------ Source: order and streaming
    def epoch_order(self, seed: int, epoch: int) -> np.ndarray | None:
        """Shards shuffled, then samples within each window of ``window`` shards (``shards.order``); a
        subset: the same over the shards it touches. None for a pack of arrays (in memory: a plain
        permutation, as the packed source's)."""
        if self.images is not None:
            return None
        from ..shards.order import epoch_order, subset_epoch_order

        if self.indices is not None:
            return subset_epoch_order(self.index.shard[self._ids], seed, epoch, window=self.window)
        return epoch_order(self.index.shard_sizes, seed, epoch, window=self.window, shuffle=True)

    def reading(self, order: np.ndarray, position: int, next_order=None, padding: int = 0) -> None:
        """The pass reads ``order`` and has handed out its first ``position`` samples: fetch the next
        ``window`` shards ahead (remote locations only), in this process, on a thread. ``next_order``
        (a callable giving the next epoch's order): once this pass is in its last shards, the next
        epoch's first ones are fetched too, so a pass does not start with every reader waiting.
        ``padding``: the pass's last step reads ``order[:padding]`` again (even_batches): their shards
        are kept cached (not retired) and fetched again before it if evicted meanwhile."""
        if self._cache is None:
            return
        self._check_process()
        if self._prefetcher is None:
            from ..shards.readahead import ReadAhead

            self._prefetcher = ReadAhead(self._cache, self.index, self._ids, self.window, self.location)
            # The thread holds the prefetcher, not this source: a source dropped without close() is
            # collected, and this stops its thread then (or at interpreter exit), instead of leaving it
            # waiting for work forever. The finalizer holds the prefetcher only, so it keeps nothing alive.
            self._stop_ahead = weakref.finalize(self, self._prefetcher.stop)
        self._prefetcher.want(order, position, next_order, self._in_flight, self._lag, padding=padding)

    def plan_in_flight(self, batches: int, batch_size: int, read: int = 0, ranks: int = 1) -> None:
        """The loader's readers may read up to ``batches`` batches of ``batch_size`` samples (the global
        batch: positions in the epoch's order count every rank's samples) past the position it last told
        ``reading``, the batch it is handing out included; the first ``read`` of them are read already
        (decoded batches in a queue). A DataLoader's workers: ``num_workers x prefetch_factor + 1`` (it
        sends out the next batch's indices as it hands one out, before the loader tells the source); a
        loader without workers: 1; dali: ``2 x prefetch_queue_depth + 2``, ``read=prefetch_queue_depth``.
        The read-ahead fetches the shards the readers may be reading, and ahead only as far as the cache
        holds them all; it retires the shards they have finished, which are evicted first. Where those
        shards alone are more than ``cache_limit`` holds and one is downloaded again, a ``RuntimeWarning``
        says so once, with the bytes it takes. A local folder has no cache: nothing changes. Over several
        ``ranks``, a shard is retired one global batch later: a rank tells its position once it has handed
        out its share of a batch, while another rank's readers may still read theirs."""
        from ..checks import check_integer

        batches = check_integer("Shards.plan_in_flight: batches", batches, minimum=0)
        batch_size = check_integer("Shards.plan_in_flight: batch_size", batch_size, minimum=1)
        read = check_integer("Shards.plan_in_flight: read (batches)", read, minimum=0, maximum=max(batches - 1, 0))
        ranks = check_integer("Shards.plan_in_flight: ranks", ranks, minimum=1)
        self._in_flight, self._lag = (read * batch_size, batches * batch_size), batch_size if ranks > 1 else 0

    # ------------------------------------------------------------------ the rest of Source
    def fingerprint(self) -> str:
        # The index's fingerprint (the packed source's), not the location: a copy of the shards on
        # another store or a local disk resumes. The window of a pack of photos too: it decides the
        # epoch's order, so a position saved under another window would read other samples than the
        # ones the run had left. (A pack of arrays is shuffled as an array source: no window.)
        return self._fingerprint(window=self.images is None)

    def _fingerprint(self, *, window: bool) -> str:
        """The fingerprint, with the window or (as releases before 2026-11-27 built it) without."""
        tag = f" window={self.window}" if window else ""
        return (f"Shards n={len(self)} classes={self.num_classes} index={self.index.fingerprint}"
                f"{tag}{self._subset_tag()}")

    def saved_fingerprint(self, saved: str) -> str:
        """The fingerprint a loader position saved over this pack is compared with: ``saved`` itself, but
        for a position saved before fastdata recorded the window (2026-11-27), which is taken as the
        default window's, with a warning, when this loader reads with that default."""
        # The older fingerprint built as it was (no window), not found by text: an index's own fingerprint
        # (a pack made from another pack) may hold a ' window=' of its own.
        if self.window != _DEFAULT_WINDOW or self.images is not None or saved != self._fingerprint(window=False):
            return saved
        warnings.warn(f"this position over '{self.location}' was saved by an older fastdata, which did not "
                      f"record the shards' window: it is taken as window={_DEFAULT_WINDOW}, the default then "
                      f"and now (a run that set another window read another order)", RuntimeWarning, stacklevel=3)
        return self.fingerprint()

    @property
    def sample_transform(self):
        """The ``transform`` given, or None."""
        return self.transform

    def default_augmentation(self, train: bool):
        """A pack of arrays: the array source's recipe (digits, CIFAR-like, none); photos: ImageFolder's."""
        if self.images is not None:
            return array_augmentation(train, self.digits, self.image_shape)
        return photo_augmentation(train, self.transform)

    def __getitem__(self, i):
        """(image, label) of sample ``i``: as ``ArraySource[i]`` for a pack of arrays, else as ``ImageFolder[i]``."""
        if self.images is not None:
            return ArraySource.__getitem__(self, i)
        return ImageFolder.__getitem__(self, i)

    def _take(self, idx: np.ndarray) -> None:
        self._ids = self._ids[idx]
        # The copy reads its own samples: a read-ahead thread of the source it came from maps that
        # source's positions, and its open files are that source's to close.
        self.__dict__.update(self._own_handles())
        if self.images is not None:
            self.images = take_images(self.images, idx)
        self.labels = self.labels[idx]

    def close(self) -> None:
        """Stop fetching ahead, close the shards' files and release the cache's hold."""
        if self._stop_ahead is not None:
            self._stop_ahead()          # the prefetcher's stop(), once: collection will not call it again
        self._prefetcher = self._stop_ahead = None
        self._files.close()

    def __repr__(self):
        return f"Shards({self.location!r}, n={len(self)}, shards={len(self.index.shards)})"


class _OpenFiles:
    """The shard files a Shards keeps open (at most ``limit``, the oldest closed first), shared by the
    threads that read through it: dali's reader threads read samples of one source at once.

    A descriptor is closed only when no thread is reading from it. Closed under a reader, its number
    could be reused by the next ``open`` of another shard, and the reader would get another shard's
    bytes (the tar header check would then fail the sample); the dict alone, unlocked, also raced
    (KeyError, EBADF in the dali benchmark with a small cache)."""

    def __init__(self, limit: int, cached: bool = False):
        self.limit = max(1, int(limit))
        # A cache's copies: the cache stamps each use in the file's mtime (its LRU order), so between two
        # reads of one thread another thread's use changed the mtime, and reads by 8 threads failed as
        # "changed at each of 3 reads" (2% of them). A copy is never rewritten in place (a new version is
        # published under a new inode by os.replace): its identity is its size and inode.
        self.cached = bool(cached)
        self._lock = threading.Lock()
        self._open: dict[str, list] = {}   # path -> [fd, readers, retired, (size, mtime_ns) at open]

    def __reduce__(self):
        # Descriptors and the lock are this process's: a copy (a spawn or forkserver DataLoader
        # worker, which pickles the source) starts with none open. A lock cannot be pickled at all.
        return (_OpenFiles, (self.limit, self.cached))

    def pread(self, path: str, start: int, length: int, check=None) -> bytes:
        """``length`` bytes of ``path`` from ``start``; a read that fails (a cached shard replaced
        under us) opens the file afresh once. ``check(fd)`` runs on each new descriptor before it is
        used (and shared): it raises when the file is not what it must be.

        A descriptor stays open for many reads (epochs, with persistent workers), so a file written
        in place while it is open (``cp`` of a re-packed shard over it, ``rsync --inplace``) was never
        checked again: its new bytes were read under the old index's labels. Its size and mtime are
        compared after every read (one ``fstat``); a file that changed is opened and checked afresh
        (``check`` raises for another version) and read again."""
        for attempt in range(3):
            entry = self._take(path, check)
            try:
                data = os.pread(entry[0], length, start)
                if _version(os.fstat(entry[0]), self.cached) == entry[3]:
                    return data
                if attempt == 2:
                    raise OSError(errno.EAGAIN, f"the file changed at each of {attempt + 1} reads: it is being "
                                                f"written while it is read")
            except OSError:
                if attempt:
                    raise
            finally:
                self._give(entry)
            with self._lock:   # forgotten: the next _take opens the file afresh (and checks it)
                if self._open.get(path) is entry:
                    self._retire(self._open.pop(path))
        raise AssertionError("unreachable")

    def _take(self, path: str, check=None) -> list:
        with self._lock:
            entry = self._open.get(path)
            if entry is not None:
                entry[1] += 1
                return entry
        # Opened and checked outside the lock: a first open may hash the file, and the other threads
        # keep reading the shards already open meanwhile.
        fd = os.open(path, os.O_RDONLY)
        try:
            # The version before the check: a file that changes while it is hashed is checked again.
            version = _version(os.fstat(fd), self.cached)
            if check is not None:
                check(fd)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            entry = self._open.get(path)
            if entry is not None:               # another thread opened it meanwhile: use that one
                os.close(fd)
            else:
                entry = self._open[path] = [fd, 0, False, version]
                while len(self._open) > self.limit:   # the oldest first (dicts keep insertion order)
                    self._retire(self._open.pop(next(iter(self._open))))
            entry[1] += 1
            return entry

    def _give(self, entry: list) -> None:
        with self._lock:
            entry[1] -= 1
            if entry[2] and entry[1] == 0:
                os.close(entry[0])

    @staticmethod
    def _retire(entry: list) -> None:
        """Close ``entry`` now if no one reads from it, else when its last reader is done."""
        entry[2] = True
        if entry[1] == 0:
            os.close(entry[0])

    def forget(self, path: str) -> None:
        """Close ``path``'s descriptor (once its readers are done); the next read opens it afresh."""
        with self._lock:
            entry = self._open.pop(path, None)
            if entry is not None:
                self._retire(entry)

    def close(self) -> None:
        with self._lock:
            for entry in self._open.values():
                self._retire(entry)
            self._open.clear()

    def __del__(self):
        # A Shards dropped without close() (make_loader(Shards(path), ...) in a sweep: the loader does not
        # own its source, which may feed another loader) kept a descriptor per open shard for the life of
        # the process, one more for each loader of a sweep. Nobody reads through a collected object, and
        # a forked child that replaced it closes only its own copies.
        for entry in getattr(self, "_open", {}).values():
            try:
                os.close(entry[0])
            except OSError:
                pass


class _Forget(NamedTuple):
    """Closes ``files``' descriptor of ``path``: what a reader gives ``ShardCache.release`` as ``last``.
    A tuple, so that the cache keeps one per reader and file however many samples release it."""

    files: _OpenFiles
    path: str

    def __call__(self) -> None:
        self.files.forget(self.path)


def _version(st: os.stat_result, cached: bool = False) -> tuple[int, int]:
    """What tells one version of an open file from the next: its size and modification time; for a
    cache's copy (whose mtime records its last use), its size and inode."""
    return (st.st_size, st.st_ino) if cached else (st.st_size, st.st_mtime_ns)


def _image_shape(value) -> tuple[int, int, int] | None:
    """The index's ``source.image_shape`` ([H, W, C], C 1 or 3: a pack of arrays of one shape), or None."""
    if (isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                            and v > 0 for v in value) and value[2] in (1, 3)):
        return tuple(value)
    return None


__all__ = ["Shards", "Augmentation"]
