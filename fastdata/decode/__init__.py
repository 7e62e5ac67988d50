"""The decode-and-skip layer below the backends: sample ids → uint8 images, and the ids kept. The
decoders it calls are ``fastdata.images``' (one room for every bytes → pixels path); this layer reads
the sources, batches, applies the recipe and the skips, and holds DALI's feed (``dali_*``).

Every backend that decodes on the host goes through here (the torch backend's workers per batch, the
memory backend once for its cache), so there is one definition of what is decoded how, which files
``on_error="skip"`` drops, and one warning for them (``warn_skipped``) about one counter,
``loader.skipped``. DALI decodes in its own pipeline but refuses the same files (it validates them with
the same PIL decode) and counts into the same counter.

- arrays: a gather, then the recipe with vectorized numpy (``augment.augment_batch``);
- files: PIL per file (``images.photo.load_photo``: ``Image.draft`` shrinks the JPEG decode), or, with a
  per-sample ``transform`` (``ImageFolder(root, transform=...)``), the full decode through it;
- torch Datasets: each sample through the source's one conversion (``DatasetSource.as_array``).

Per-sample transforms (an ImageFolder's, a torch Dataset's own) draw from torch's, Python's and numpy's
global generators. Each sample's are seeded from the batch's generator first (one seed per sample,
drawn up front), so a run repeats exactly whatever the workers, and a skipped file does not change the
other samples' draws; the caller's generator states are restored afterwards (with ``num_workers=0``
this runs in the training process, whose dropout and initialization must not be reseeded).
"""
from __future__ import annotations

import random
import warnings
import weakref
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..augment import augment_array, augment_batch, require_fixed_size
from ..config import Augmentation, Crop
from ..datasets import SourceKind, check_transform_and_augment, transform_output
from ..errors import user_stacklevel
from ..images.on_error import OnError
from ..images.photo import load_photo


class Decoded(NamedTuple):
    """One batch decoded: the images and labels of the samples kept, and their ids."""

    images: np.ndarray   # uint8 (kept, H, W, C)
    labels: np.ndarray   # int64 (kept,)
    kept: np.ndarray     # int64 sample ids, in the order asked for; fewer only with on_error="skip"


def decode(source, ids: np.ndarray, aug, rng: np.random.Generator, on_error: str | OnError = "raise", *,
           checked: np.ndarray | None = None) -> Decoded:
    """Samples ``ids`` of ``source`` with the recipe ``aug`` applied (random parameters from ``rng``).

    ``on_error="skip"`` drops files that do not decode (DecodeError) instead of raising; the ids that
    remain are returned. A skipped file still consumes the draws it made before failing, exactly as
    it would have had it decoded, so the other samples' augmentation does not depend on it.

    Args:
        source: a fastdata source (``datasets.as_source`` applied).
        ids: sample ids of ``source``.
        aug: the recipe; None or ``Augmentation()`` for a source with a per-sample transform (a recipe
            on top of one is refused: ``datasets.check_transform_and_augment``).
        rng: the batch's generator; every random draw comes from it.
        on_error: ``"raise"`` or ``"skip"`` (or its ``OnError``) for files that do not decode.
        checked: bool (len(source),): which files some process already decoded whole (see
            ``_CHECKED``); this process's own flags when None.
    """
    ids = np.asarray(ids, dtype=np.int64)
    on_error = OnError(on_error)
    check_transform_and_augment(source, aug)
    if source.kind is SourceKind.ARRAY:
        # The gather is a copy of the rows: the flips may go into it (no second copy of the batch).
        images = np.ascontiguousarray(augment_batch(source.images[ids], aug, rng, owned=True))
        return Decoded(images, source.labels[ids], ids)
    if source.kind is SourceKind.FILES:
        if source.sample_transform is not None:
            return _files_transformed(source, ids, rng, on_error)
        require_fixed_size(source, aug)   # photos of mixed sizes only stack after a size-fixing crop
        return _files(source, ids, aug, rng, on_error, _checked(source) if checked is None else checked)
    if source.kind is SourceKind.DATASET:
        return _dataset(source, ids, aug, rng, on_error)
    raise TypeError(f"cannot decode a {type(source).__name__} (kind {source.kind!r}); sources are of kind "
                    f"{[k.value for k in SourceKind if k is not SourceKind.ABSTRACT]}")


# For each files source, which of its files this process has decoded whole once. Until then a region
# decode checks the file's whole scan first (images.photo.crop_photo): every backend refuses the same
# broken files in the first epoch whatever the crop, and later epochs decode only the crop's window.
# One byte per file; a weak key, so a dropped source takes its flags with it. The torch backend's
# workers share one set instead (BatchDecoder.checked).
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _checked(source) -> np.ndarray:
    flags = _CHECKED.get(source)
    if flags is None or len(flags) != len(source):
        flags = _CHECKED[source] = np.zeros(len(source), dtype=bool)
    return flags


def _files(source, ids, aug, rng, on_error: OnError, checked: np.ndarray) -> Decoded:
    size = aug.size
    # Written in place, kept ones contiguous: no list of arrays and no second copy in np.stack.
    out = np.empty((len(ids), size, size, 3), dtype=np.uint8)
    keep: list[int] = []
    for j, i in enumerate(ids):
        photo = on_error.attempt(_photo, source, i, aug, rng, bool(checked[i]))
        if photo is None:
            continue
        out[len(keep)] = photo
        checked[i] = True
        keep.append(j)
    kept = ids[keep]
    return Decoded(out[: len(keep)], source.labels[kept], kept)


def _photo(source, i, aug, rng, checked: bool = False) -> np.ndarray:
    """Sample ``i``'s bytes decoded with the recipe (``images.photo.load_photo``)."""
    return load_photo(source.read(i), source.sample_name(i), aug, rng, checked=checked)


_NO_RECIPE = Augmentation()


@contextmanager
def seeded_globals():
    """Yields ``seed(s)``, which seeds the global generators per-sample transforms draw from (torch's
    CPU generator, ``random``, ``numpy.random``); their states are restored on exit. Only the CPU
    generator: ``torch.manual_seed`` would also reseed every CUDA generator of the caller."""
    gen = torch.default_generator
    saved = gen.get_state(), random.getstate(), np.random.get_state()

    def seed(s: int) -> None:
        gen.manual_seed(s)
        random.seed(s)
        np.random.seed(s % 2 ** 32)

    try:
        yield seed
    finally:
        gen.set_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def _same_size(source, images: list, where: list) -> None:
    """A per-sample transform's outputs must stack: refuse mixed sizes, naming two of them."""
    shapes = [a.shape[:2] for a in images]
    if len(set(shapes)) > 1:
        j = next(k for k, s in enumerate(shapes) if s != shapes[0])
        (h0, w0), (h1, w1) = shapes[0], shapes[j]
        raise ValueError(f"the transform of {source!r} returned images of different sizes in one batch: "
                         f"{h0}x{w0} for {where[0]!r} and {h1}x{w1} for {where[j]!r}; end the transform with "
                         f"a fixed-size crop or resize (RandomResizedCrop(224), or Resize(256) then "
                         f"CenterCrop(224))")


def _files_transformed(source, ids, rng, on_error: OnError) -> Decoded:
    """Files through the source's per-sample transform: the full decode (EXIF orientation applied,
    RGB) as a PIL image → the transform → uint8 (H, W, 3). No recipe (the transform is the recipe)."""
    from PIL import Image

    transform = source.sample_transform
    seeds = rng.integers(0, 2 ** 63, size=len(ids))   # up front: a skip does not shift the others
    images, keep = [], []
    with seeded_globals() as seed:
        for j, i in enumerate(ids):
            photo = on_error.attempt(_photo, source, i, _NO_RECIPE, rng)   # the empty recipe draws nothing
            if photo is None:
                continue
            path = source.sample_name(i)
            seed(int(seeds[j]))
            images.append(transform_output(transform(Image.fromarray(photo)), source, path))
            keep.append(j)
    kept = ids[keep]
    _same_size(source, images, [source.sample_name(i) for i in kept])
    batch = np.stack(images) if images else np.empty((0, 0, 0, 3), np.uint8)
    return Decoded(batch, source.labels[kept], kept)


def _dataset(source, ids, aug, rng, on_error: OnError) -> Decoded:
    # A sample whose image the dataset cannot read is a DecodeError naming it (read_pair): skipped
    # under on_error="skip", as a broken file is (drawing nothing, so the others keep their draws).
    if source.sample_transform is not None:
        # The dataset's own transform runs inside its __getitem__: one seeded call per sample.
        seeds = rng.integers(0, 2 ** 63, size=len(ids))
        samples, kept = [], []
        with seeded_globals() as seed:
            for s, i in zip(seeds, ids):
                seed(int(s))
                pair = on_error.attempt(source.read_pair, int(i))
                if pair is not None:
                    samples.append(pair)
                    kept.append(int(i))
    else:
        # A Dataset may draw in its own __getitem__ (an augmentation not named transform, a random
        # pick): seeded per batch, so a resumed run and a rerun read what the first run read, whatever
        # the caller's generators hold (they are restored after). The seed is spawned, not drawn: the
        # recipe's draws below stay those of the same batch of arrays.
        with seeded_globals() as seed:
            seed(int(np.random.default_rng(rng.bit_generator.seed_seq.spawn(1)[0]).integers(0, 2 ** 63)))
            samples, kept = source.fetch_kept(ids, on_error)
    ds_ids = [source.dataset_index(i) for i in kept]
    images, labels = [], []
    for k, (image, label) in enumerate(samples):
        arr = source.as_array(image)  # every sample converted to source.channels the same way
        # Translation needs one size for the batch: drawn for the stacked batch below (all offsets,
        # then all flips); the other recipes are drawn per sample, in order.
        images.append(arr if aug.crop is Crop.TRANSLATE else augment_array(arr, aug, rng))
        labels.append(source.as_label(label, ds_ids[k]))
    if not aug.crop.fixes_size:
        shapes = {a.shape for a in images}
        if len(shapes) > 1:
            fix = ("end the dataset's transform with a fixed-size crop or resize (CenterCrop(224), ...)"
                   if source.sample_transform is not None else
                   "use a recipe with a resizing crop (Augmentation.imagenet_eval())")
            raise ValueError(f"{source.name} returned images of different sizes {sorted(shapes)[:3]}; {fix}")
    batch = np.stack(images) if images else np.empty((0, 0, 0, source.channels), np.uint8)
    if aug.crop is Crop.TRANSLATE:
        batch = augment_batch(batch, aug, rng, owned=True)   # np.stack made it
    return Decoded(np.ascontiguousarray(batch), np.asarray(labels, dtype=np.int64), np.asarray(kept, dtype=np.int64))


class BatchDecoder(Dataset):
    """A DataLoader "dataset" of whole batches: job ``(ids, seed)`` → ``(uint8 images (N, H, W, C),
    int64 labels (N,), kept ids)``: two tensors and a list of ints.

    Stateless, so persistent workers serve every epoch. Why batches, not samples: one job message and
    one shared-memory tensor per batch instead of per image, and no Python collate.

    Args:
        source: the fastdata source.
        augment: the recipe (see ``decode``).
        on_error: ``"raise"`` or ``"skip"`` (or its ``OnError``).
    """

    def __init__(self, source, augment, on_error: str | OnError = "raise"):
        on_error = OnError(on_error)
        if source.sample_transform is None:   # with one, each batch checks that its outputs stack
            require_fixed_size(source, augment)
        check_transform_and_augment(source, augment)
        self.source, self.augment, self.on_error = source, augment, on_error
        # Which files a worker has decoded whole (``_CHECKED``), one byte each in shared memory that
        # every worker reads and writes: a file checked by one worker is not checked again by the
        # next one that gets it, which would otherwise cost each worker a full decode of every file in
        # the first epochs (with 2 workers, about 0.3 ms a photo in the second epoch). Two workers may
        # check the same file at once; both then do, which is harmless.
        self.checked = None
        if source.kind is SourceKind.FILES and source.sample_transform is None:
            self.checked = torch.zeros(len(source), dtype=torch.bool).share_memory_()

    def __len__(self):  # jobs come from the sampler; a length keeps DataLoader's bookkeeping happy
        return len(self.source)

    def __getitem__(self, job):
        """Decode one batch.

        Args:
            job: ``(ids, seed)``: the sample ids and the seed of the batch's generator.
        """
        ids, seed = job
        flags = None if self.checked is None else self.checked.numpy()
        d = decode(self.source, ids, self.augment, np.random.default_rng(seed), self.on_error, checked=flags)
        # The kept ids as a list: a worker sends each tensor through its own shared-memory segment and
        # file descriptor, while a few ints travel pickled inside the reply at no extra cost.
        return torch.from_numpy(d.images), torch.from_numpy(d.labels), d.kept.tolist()


def warn_skipped(backend: str, count: int, epoch: int) -> None:
    """The one warning for samples dropped with on_error='skip' (every backend, once per epoch).

    Args:
        backend: the backend's name, first in the message.
        count: samples skipped (0: no warning).
        epoch: the epoch they were skipped in, from 0 (``set_epoch``'s); the message counts from 1, as
            ``fit``'s lines ("epoch 1/3") do.
    """
    if count:
        warnings.warn(f"{backend}: skipped {count} undecodable sample(s) in epoch {epoch + 1} "
                      f"(on_error='skip'; loader.skipped_ids names them)", RuntimeWarning, stacklevel=user_stacklevel())


def collect_before_fork() -> None:
    """Collect the parent's cyclic garbage right before DataLoader forks its workers.

    Why: a forked worker inherits the parent's unreachable-but-uncollected objects, and its own garbage
    collector may finalize them there. For a DALI pipeline (e.g. a failed DaliLoader kept in a cycle by
    its exception's traceback) that deadlocks the worker forever in the pipeline's destructor (its
    executor threads do not exist in the child), and the main process waits for the batch forever;
    a DataLoader iterator finalized in a child fails with "can only test a child process". Collected
    here, in the parent, they are destroyed where they were made. Costs one GC pass per worker start
    (once per loader with persistent workers).
    """
    import gc

    gc.collect()
