"""The contract every backend honours, and the parts of it that are the same for all of them.

- ``for images, labels in loader``: images float (N, C, H, W) normalized on ``loader.device``,
  labels int64 (N,) on the same device.
  With ``batch_transforms`` that mix samples (MixUp, CutMix), labels are soft: float (N, classes).
- ``len(loader)`` equals the batches one pass yields. The epoch advances when a pass hands out its
  last batch (or ``set_epoch`` is called), not on ``iter()`` and not only on StopIteration: a consumer
  that takes exactly ``len(loader)`` batches (Lightning, ``islice``) gets a new epoch each pass, while
  ``next(iter(loader))`` peeks at the first batch of the coming epoch without changing the run (of an
  epoch of more than one batch), and a pass left early (``break``) is read again from its start by the
  next ``iter()``, as a DataLoader does.
- A new ``iter()`` supersedes the previous one: the older epoch is closed first (its workers, threads
  and pipelines released), and using the older iterator afterwards raises RuntimeError. Two
  interleaved epochs are an error, never wrong data.
- The order and the random augmentation of epoch ``e`` derive from ``(seed, e)`` (see sampling.py);
  so do the ``batch_transforms``' draws, from ``(seed, e, batch)``.
- ``state_dict()`` records the consumer's position (epoch, batches handed out); ``load_state_dict()``
  makes the next ``iter()`` continue from there, with exactly the batches an uninterrupted run sees.

A subclass implements ``_epoch(epoch, batches)`` → iterator of (images, labels) on the device.
"""
from __future__ import annotations

import inspect
import weakref
from typing import TYPE_CHECKING, ClassVar, Iterator, cast

import numpy as np
import torch

from ..augment import output_size, recipe, require_padding_fits
from ..config import LoaderConfig, check_integer, check_reals, check_unit_stats, unknown_options
from ..datasets import Source, SourceKind, check_transform_and_augment
from ..datasets.base import loader_classes, reading_call
from ..datasets.sample_transforms import recipe_choices
from ..decode import warn_skipped
from ..errors import PositionMismatch
from ..normalize import Normalizer
from ..sampling import EpochPlan, distributed_info, seed_for
from .accelerate_state import AccelerateTracker
from .sample_ids import SampleIds

if TYPE_CHECKING:
    from ..batch_transforms import BatchPipeline

_SUPERSEDED = ("this iterator was superseded by a newer iter() on the same loader: each iter() closes "
               "the previous pass (two passes of one loader cannot run interleaved, they share its "
               "workers). Keep one iterator per pass; to look at a batch outside the loop use "
               "next(iter(loader)) before it (a peek does not advance the epoch), or a second loader")


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) ready for an upload to ``device`` that does not make the host wait: pinned
    where ``device`` is a GPU (a copy from pageable memory is synchronous: torch copies through a
    staging buffer and waits for it), as it is elsewhere."""
    if device.type != "cuda":
        return t
    with torch.cuda.device(device):   # the pinning context is the loader's GPU, not cuda:0
        return t.pin_memory()


def labels_on(device: torch.device, labels) -> torch.Tensor:
    """A batch's labels (int64 array-like, known on the host) as the contract's int64 (N,) on ``device``,
    without making the host wait: pinned and copied ``non_blocking``. The pinned buffer may be dropped
    at once: torch's caching host allocator records the copy's stream and reuses the block only after
    the copy's event has completed (ATen/core/CachingHostAllocator.h)."""
    t = torch.as_tensor(np.asarray(labels, dtype=np.int64)).view(-1)
    return pinned(t, device).to(device, non_blocking=device.type == "cuda")


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and None in (t.device.index, device.index) or t.device == device


def check_yielded(loader: "Loader", batch, done: int, planned: int) -> None:
    """Hold a backend written outside fastdata to the contract at each batch it yields (fastdata's own
    are held by tests/test_contract.py): (images, labels), images normalized float (N, C, H, W) of the
    loader's dtype on its device, labels int64 (N,) there, and no more than ``len(loader)`` batches.
    Metadata only: nothing is read from the device. Broken, each went on without a word."""
    where = f"backend {loader.name!r} ({type(loader).__name__}._epoch)"
    if done >= planned:
        raise RuntimeError(f"{where} yielded more than len(loader) = {planned} batches in a pass; it yields one "
                           f"batch per entry of the batches it is given")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise RuntimeError(f"{where} yielded {type(batch).__name__}; the contract is a pair of tensors "
                           f"(images, labels)")
    images, labels = batch
    dtype, device = loader.config.dtype, loader.device
    if images.dtype != dtype or images.dim() != 4 or not _on(images, device):
        raise RuntimeError(f"{where} yielded images {images.dtype} of shape {tuple(images.shape)} on {images.device}; "
                           f"the contract is normalized {dtype} (N, C, H, W) on {device}: pass the uint8 "
                           f"(N, H, W, C) batch through self.normalize on the device")
    if labels.dtype != torch.int64 or tuple(labels.shape) != (images.shape[0],) or not _on(labels, device):
        raise RuntimeError(f"{where} yielded labels {labels.dtype} of shape {tuple(labels.shape)} on {labels.device}; "
                           f"the contract is int64 ({images.shape[0]},) on {device}, one per image")


class EpochIterator:
    """What ``iter(loader)`` returns: the epoch's batches, until a newer ``iter()`` supersedes it."""

    __slots__ = ("_batches", "_superseded", "__weakref__")

    def __init__(self, batches):
        self._batches = batches
        self._superseded: str | None = None   # why it ended under its consumer: what next() then raises

    def __iter__(self):
        return self

    def __next__(self):
        if self._superseded:
            raise RuntimeError(self._superseded)
        return next(self._batches)

    def close(self) -> None:
        """End the epoch early and release what it holds (also happens when the iterator is dropped)."""
        self._batches.close()

    def _supersede(self, why: str = _SUPERSEDED) -> None:
        """End the pass for ``why`` (a newer ``iter()``, or its loader closed): a later ``next()`` raises
        it, where a pass that just stopped would read as an epoch that ended early."""
        if self._batches.gi_frame is None:  # finished or closed: it keeps ending, as iterators do
            return
        self._superseded = why
        # close() runs the epoch's finally blocks now: workers, threads and pipelines are released
        # before the newer epoch starts using them.
        self._batches.close()


class LoaderSampler:
    """``loader.sampler``: what code written for a DataLoader with a DistributedSampler asks of it.

    ``set_epoch(e)`` picks epoch ``e``'s order (Lightning calls it before every epoch, DDP loops by
    hand); a position restored by ``load_state_dict`` in that same epoch is kept, as a
    StatefulDataLoader keeps its iterator's state when its sampler's epoch is set. ``len`` is the
    samples this rank reads per epoch; iterating gives them, in the coming pass's order.
    """

    def __init__(self, loader: "Loader"):
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (kept where a restored position is already in that epoch)."""
        epoch = check_integer("epoch", epoch, minimum=0)
        if epoch != self._loader._next[0]:
            self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the loader's next pass reads."""
        return self._loader.epoch

    @property
    def num_replicas(self) -> int:
        """The ranks the epoch is split over (DistributedSampler's name)."""
        return self._loader.plan.world_size

    @property
    def rank(self) -> int:
        """This process's share."""
        return self._loader.plan.rank

    @property
    def shuffle(self) -> bool:
        """Whether each epoch is a new permutation of ``(seed, epoch)``."""
        return self._loader.plan.shuffle

    @property
    def seed(self) -> int:
        """The seed the orders derive from."""
        return self._loader.plan.seed

    @property
    def drop_last(self) -> bool:
        """Whether the partial last step is left out."""
        return self._loader.plan.drop_last

    @property
    def num_samples(self) -> int:
        """Samples this rank reads per epoch (``len``), DistributedSampler's name."""
        return len(self)

    def __len__(self) -> int:
        return self._loader.plan.rank_samples()

    def __iter__(self) -> Iterator[int]:
        for ids in self._loader.plan.batches_from(*self._loader._next):
            yield from self._loader.source_ids(ids).tolist()

    def __repr__(self):
        return (f"LoaderSampler(epoch={self.epoch}, rank={self.rank}, num_replicas={self.num_replicas}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})")


class InOrderLoaderSampler(LoaderSampler, torch.utils.data.SequentialSampler):
    """``loader.sampler`` of a loader that does not shuffle, a ``SequentialSampler`` to code that asks:
    Lightning's ``overfit_batches`` rebuilds, as a DataLoader, every loader whose sampler is not one,
    which fails on a fastdata loader (a ValueError before the first step), even one made with
    ``shuffle=False``. Under DDP it is this rank's share, in order. LoaderSampler's methods come
    first; SequentialSampler's ``__init__`` (its ``data_source``) is not used."""


def sampler_of(loader: "Loader") -> LoaderSampler:
    """``loader``'s sampler: an ``InOrderLoaderSampler`` when its epochs are not shuffled."""
    return LoaderSampler(loader) if loader.plan.shuffle else InOrderLoaderSampler(loader)


class LoaderBatchSampler:
    """``loader.batch_sampler``: the coming pass's batches of source sample ids (``len`` = ``len(loader)``)
    as planned; ``loader.batch_ids`` says which of them each batch yielded holds."""

    def __init__(self, loader: "Loader"):
        self._loader = loader

    @property
    def sampler(self) -> LoaderSampler:
        """The loader's sampler."""
        return sampler_of(self._loader)

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self._loader.batch_size

    @property
    def drop_last(self) -> bool:
        """Whether the partial last step is left out."""
        return self._loader.plan.drop_last

    def __len__(self) -> int:
        return len(self._loader.plan.batches_from(*self._loader._next))

    def __iter__(self) -> Iterator[list]:
        for ids in self._loader.plan.batches_from(*self._loader._next):
            yield self._loader.source_ids(ids).tolist()


class Loader(SampleIds):
    """Base class; see the module docstring for the contract.

    Args:
        source: a fastdata Source.
        config: the shared, validated options.
        **options: backend-specific options; each backend lists its own in ``options``.
    """

    name: ClassVar[str] = "base"
    #: backend-specific option → default; anything else passed to make_loader is an error.
    options: ClassVar[dict] = {}
    #: source kinds the backend can read (auto and the registry read this; __init__ enforces it).
    reads: ClassVar[frozenset] = frozenset({SourceKind.ARRAY, SourceKind.FILES})
    #: whether the backend runs a source's per-sample callable (``ImageFolder(transform=...)``): only
    #: backends that decode each sample on the CPU with PIL can (torch, prefetch).
    runs_sample_transforms: ClassVar[bool] = False
    # Set on the loader for accelerate while a pass runs (AccelerateTracker), read by accelerate's
    # GradientState; declared, not defined: a loader outside accelerate has neither.
    end_of_dataloader: bool
    remainder: int

    def __init__(self, source: Source, config: LoaderConfig, **options):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise TypeError(unknown_options(f"backend {self.name!r}", unknown, f"its options are "
                                            f"{sorted(self.options)}"))
        fits_kind, why = type(self)._reads(source)
        if not fits_kind:
            raise TypeError(why)
        self.opts = {**self.options, **options}
        self.source = source
        self.config = config
        # LoaderConfig's fields are annotated with what a user may pass (device="cuda", dtype="bf16",
        # shuffle=None); its __post_init__ resolves them, so a loader reads the resolved types.
        self.device = cast(torch.device, config.device)
        self.augment = recipe(source, config)
        require_padding_fits(source, self.augment)  # every backend refuses the same recipes, up front
        check_transform_and_augment(source, config.augment)  # a per-sample transform IS the augmentation
        # A source's own statistics (ArraySource(mean=...), ImageFolder(std=...)) get the checks that
        # LoaderConfig gives its mean/std: a NaN or a zero here makes every batch NaN or inf.
        mean = config.mean if config.mean is not None else check_reals("mean", source.mean)
        std = config.std if config.std is not None else check_reals("std", source.std)
        for name, values, given in (("mean", mean, config.mean), ("std", std, config.std)):
            if given is None:
                check_unit_stats(name, values, f" (the statistics of {source!r})")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {std} (from {source!r})")
        if len(mean) == 1 and source.channels > 1:
            mean, std = mean * source.channels, std * source.channels
        if len(mean) != source.channels or len(std) != source.channels:
            raise ValueError(f"mean/std have {len(mean)}/{len(std)} values but {source!r} has "
                             f"{source.channels} channel(s)")
        self.mean, self.std = tuple(mean), tuple(std)
        rank, world = distributed_info(config.rank, config.world_size)
        self.plan = EpochPlan(len(source), config.batch_size, cast(bool, config.shuffle), cast(bool, config.drop_last),
                              config.seed, rank, world, even=config.even_batches, order_fn=source.epoch_order)
        if len(self.plan) == 0:
            raise ValueError(
                f"{source!r} has {len(source)} samples, fewer than one batch of {config.batch_size}"
                f"{f' x {world} ranks' if world > 1 else ''} with drop_last=True: the loader would "
                f"yield nothing; lower batch_size or pass drop_last=False")
        self._next = (0, 0)           # (epoch, global sample offset) where the next iter() starts
        # (epoch, the pass's start offset, batches handed to the consumer, batches in the pass or None)
        self._position: tuple[int, int, int, int | None] = (0, 0, 0, None)
        # The running epoch's iterator, weakly: a dropped peek (next(iter(loader))) is finalized at
        # once, releasing its prefetch thread, instead of living until the next iter().
        self._current: weakref.ref[EpochIterator] | None = None
        # THE count of samples skipped with on_error="skip" in the current epoch, for every backend
        # (warned about once per epoch by decode.warn_skipped). ``_dropped``: samples a backend left out
        # for good before any epoch (memory's undecodable files at cache time): missing from every
        # epoch, so counted in every epoch's ``skipped``.
        self._dropped = 0
        self.skipped = 0
        #: uint8 NHWC batches → normalized NCHW floats on the device (see fastdata/normalize.py).
        self.normalizer = Normalizer(self.mean, self.std, self.device, cast(torch.dtype, config.dtype),
                                     config.channels_last)
        # An empty batch (a rank's share of a short last step) is (0, C, H, W) like every other, even
        # before any batch showed H and W: a decode of no samples knows neither (Normalizer.empty_shape).
        self.normalizer.size = output_size(source, self.augment)
        #: ``config.batch_transforms`` applied to every batch a backend yields (see ``_count``).
        self.batch_pipeline: BatchPipeline | None = None
        if config.batch_transforms:
            from ..batch_transforms import BatchPipeline

            self.batch_pipeline = BatchPipeline(config.batch_transforms, num_classes=source.num_classes,
                                                device=self.device, mean=self.mean, std=self.std)

    # ------------------------------------------------------------------ DataLoader-shaped surface
    @property
    def dataset(self) -> Source:
        """The source read (``len(loader.dataset)``, ``loader.dataset.classes``), as a DataLoader's."""
        return self.source

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank, as ``DataLoader.batch_size``."""
        return self.config.batch_size

    @property
    def sampler(self) -> LoaderSampler:
        """The order, as a DataLoader's sampler: ``loader.sampler.set_epoch(epoch)``, ``len``."""
        # Made per access, not kept: a loader holding an object that holds it back would be a reference
        # cycle, and a dropped loader's workers would then wait for the cyclic GC.
        return sampler_of(self)

    @property
    def batch_sampler(self) -> LoaderBatchSampler:
        """The coming pass's batches of sample ids, as a DataLoader's ``batch_sampler``."""
        return LoaderBatchSampler(self)

    @property
    def drop_last(self) -> bool:
        """Whether the partial last step is left out (the config's, derived from ``train``)."""
        return self.plan.drop_last

    @property
    def num_workers(self) -> int:
        """The worker processes (threads for DALI) the backend was given (``config.num_workers``)."""
        return cast(int, self.config.num_workers)   # None resolved to the usable cores by LoaderConfig

    @property
    def pin_memory(self) -> bool:
        """Whether host batches are pinned before their copy to the device (the torch backends on CUDA)."""
        return False

    @property
    def classes(self) -> list:
        """The class names (folder names; ``0 .. num_classes-1`` for arrays): the source's list, the same
        object at every access; ``list(loader.classes)`` for one to change."""
        names, self._classes_made = loader_classes(self.source, getattr(self, "_classes_made", None))
        return names

    @property
    def num_classes(self) -> int:
        """Number of classes: the width of soft labels (MixUp, CutMix) and of a model's output."""
        return self.source.num_classes

    # ------------------------------------------------------------------ selection
    @classmethod
    def fits(cls, source: Source, config: LoaderConfig, options: dict | None = None, *,
             stable: bool = False) -> tuple[bool, str]:
        """(whether this backend can serve ``source`` under ``config`` here, a human reason).

        ``options`` are make_loader's backend options; ``stable``: decide only on quantities equal on
        every rank of a distributed job (no process group to share one rank's decision). The default:
        it fits when the backend reads the source's kind. A backend with a resource limit (memory's
        cache budget) overrides this.
        """
        return cls._reads(source)

    @classmethod
    def _reads(cls, source) -> tuple[bool, str]:
        """(whether this backend reads ``source`` at all: its kind, and its per-sample transform)."""
        if source.kind not in cls.reads:
            return False, cls._cannot_read(source)
        if source.kind is SourceKind.ARRAY:
            # What every backend reads of an array source (datasets.base.ArrayPixels), checked here so
            # that a source of one's own declaring the kind without them is told so by name, not by an
            # AttributeError from inside whichever backend touched them first.
            missing = [a for a in ("images", "image_shape") if not hasattr(source, a)]
            if missing:
                return False, (f"{source!r} is of kind {SourceKind.ARRAY!r} but has no {' and no '.join(missing)}: "
                               f"a source of that kind holds every image in one uint8 (N, H, W, C) array "
                               f"'images', with its (H, W, C) 'image_shape' (fastdata.datasets.base."
                               f"ArrayPixels); give it both, or declare kind FILES (encoded images, "
                               f"read_stamped) or DATASET (a map-style Dataset)")
        transform = getattr(source, "sample_transform", None)
        if transform is not None and not cls.runs_sample_transforms:
            return False, (
                f"backend {cls.name!r} cannot run the per-sample transform of {source!r} "
                f"({type(transform).__name__}): it decodes and augments whole batches, not PIL images "
                f"one by one. Drop the transform and express it as augment=Augmentation(...) "
                f"({recipe_choices()}) plus batch_transforms=[...] (batched tensor ops on the device, every "
                f"backend; see fastdata.batch_transforms), or use backend 'torch' or 'prefetch', which run it")
        return True, f"{cls.name} reads {source.kind} sources"

    @classmethod
    def _cannot_read(cls, source) -> str:
        hint = getattr(source, "refusal_hint", None)
        if not hint:
            hint = (f"{cls.name!r} reads in-memory arrays (ArraySource, (images, labels) arrays, "
                    f"torchvision's CIFAR/MNIST) and image folders (ImageFolder, torchvision's ImageFolder)")
            if source.kind is SourceKind.DATASET:
                hint += "; or use backend 'torch' or 'prefetch', which read any map-style Dataset"
        what = "a map-style Dataset, whose samples only its own __getitem__ can produce" \
            if source.kind is SourceKind.DATASET else f"kind {source.kind!r}"
        return f"backend {cls.name!r} cannot read {source!r} ({what}): {hint}"

    # ------------------------------------------------------------------ the contract
    def __len__(self) -> int:
        return len(self.plan)

    def _end_running_pass(self, why: str = _SUPERSEDED) -> None:
        """End the pass in progress, if any: its generator's finally blocks run now, and its next
        ``next()`` raises ``why`` (a newer ``iter()``; a backend's ``close()``)."""
        ref = getattr(self, "_current", None)   # absent when close() runs after a failed __init__
        running = ref() if ref is not None else None
        if running is not None:
            running._supersede(why)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._end_running_pass()
        epoch, offset = self._next
        # _next stays until the pass runs to its end (_count): a peek or a pass left early does not
        # move the run on.
        batches = self.plan.batches_from(epoch, offset)
        self._position = (epoch, offset, 0, len(batches))
        self.skipped = self._dropped
        it = EpochIterator(self._count(epoch, offset, batches))
        self._current = weakref.ref(it)
        return it

    def _count(self, epoch: int, offset: int, batches: list):
        # Batch numbers (the augmentation seeds' index) continue from the offset: a resume under the
        # same layout gets exactly the uninterrupted run's numbers; a re-split one (elastic resume)
        # numbers its steps by where they start in the new layout.
        start = offset // self.plan.global_batch
        self._start_ids()   # before the backend's first batch: it may record what it keeps (ids_keeper)
        it = self._epoch(epoch, batches, start)
        done, ended = 0, False
        pipeline = self.batch_pipeline
        tracker = AccelerateTracker(self, offset)
        own = not type(self).__module__.startswith("fastdata.")   # a backend of one's own: check_yielded
        padding = self.plan.padding(offset)   # even_batches' samples at the end of the pass's last batch
        # A streaming source (shards) fetches ahead of where the pass is: told here, in this process.
        streaming = not self.source.random_access
        order = self.plan.order(epoch) if streaming else None
        if streaming:
            # Told before the first batch too, so the fetch-ahead starts with the pass (a worker forked
            # meanwhile keeps no shard locked: the shard cache unlocks before it closes a descriptor),
            # and given the next epoch's order, whose first shards it fetches while this pass ends, and
            # the padding the last step reads again (even_batches), whose shards it keeps for it.
            told = reading_call(self.source, self.plan, epoch, offset)
            told(order, self.plan.consumed(offset, 0))
        # Per batch on the training thread, so kept to what each batch needs (a GPU step of a small CNN
        # is a few milliseconds: microseconds here are the data wait the engine reports, and each call
        # into torch or numpy costs several after a step has run through the caches): the count once,
        # the rows counted against the batch's ids when batch_ids is read.
        total = len(batches)
        try:
            for batch in it:
                if own:
                    check_yielded(self, batch, done, total)
                if pipeline is not None:
                    # Seeded by (seed, epoch, batch, rank) like the recipe, so the transforms' draws do
                    # not depend on the backend, on workers, or on where a resumed run starts.
                    images, labels = batch
                    batch = pipeline(images, labels, seed_for(self.plan.seed, epoch, start + done, self.plan.rank,
                                                              0xBA7C))
                self._hand_out_ids(batches[done], padding if done == total - 1 else 0, batch[1])
                done += 1
                self._position = (epoch, offset, done, total)
                if order is not None:   # streaming. After the last batch: all it reads (drop_last leaves
                    # the rest unread)
                    told(order, len(order) if done == total else self.plan.consumed(offset, done))
                if done == total:
                    # The pass ends when its last batch is handed out, not when the consumer asks for one
                    # more: Lightning's fetcher, islice(loader, len(loader)) and zip(range(n), loader)
                    # never ask, and would otherwise replay this epoch forever.
                    ended = True
                    self._end_pass(epoch, offset)
                    tracker.last_batch(batch[1].shape[0] - self.batch_padding, batch[1].device)
                yield batch
        finally:
            self._settle_ids()
            tracker.close()
            close = getattr(it, "close", None)
            if close is not None:
                close()
        if not ended:  # an empty pass (resumed at its end), or a backend that yielded fewer batches
            self._end_pass(epoch, offset)

    def _end_pass(self, epoch: int, offset: int) -> None:
        # The next iter() starts the next epoch (unless set_epoch or load_state_dict said otherwise
        # meanwhile, which set _next themselves).
        if self._next == (epoch, offset):
            self._next = (epoch + 1, 0)
        # Samples left out for good (memory's cache) are the same on every rank: rank 0 reports them,
        # so a DDP job warns once per broken file, not once per rank.
        warn_skipped(self.name, self.skipped - (self._dropped if self.plan.rank else 0), epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` starts (or the one in progress)."""
        return self._next[0]

    def padding(self) -> int:
        """Samples of padding at the end of this rank's last batch in the next pass (``even_batches``
        repeats samples of the epoch's start there); 0 otherwise. ``evaluate`` leaves them out of its sums."""
        return self.plan.padding(self._next[1])

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` reads epoch ``epoch`` from its start (resume, DDP); so does an iterator
        that has not handed out a batch yet, as a DataLoader's would."""
        epoch = check_integer("epoch", epoch, minimum=0)
        self._next = (epoch, 0)
        # The position too: a checkpoint taken right after set_epoch() (at an epoch boundary) must
        # resume in this epoch, not in the one the loader last ran.
        self._position = (epoch, 0, 0, None)
        self._retarget_unstarted()

    def _retarget_unstarted(self) -> None:
        """An iterator that has not handed out a batch yet reads from ``_next``, as a DataLoader's
        iterator (its sampler is read at the first ``next()``) reads the epoch set after ``iter()``.
        Lightning resuming from a checkpoint saved on the last batch of a ``limit_train_batches`` epoch
        calls ``iter()`` after ``load_state_dict`` (still mid-epoch, for the loader) and only then
        ``sampler.set_epoch(next epoch)``, and trains on that iterator."""
        it = self._current() if self._current is not None else None
        if it is None or it._superseded or inspect.getgeneratorstate(it._batches) != inspect.GEN_CREATED:
            return
        epoch, offset = self._next
        batches = self.plan.batches_from(epoch, offset)
        it._batches = self._count(epoch, offset, batches)   # the unstarted generator held nothing yet
        self._position = (epoch, offset, 0, len(batches))

    #: What a saved position must agree on to be resumed: the same order over the same data. The world
    #: size and batch size may differ (elastic resume: the rest of the epoch is re-split).
    _SAME = ("seed", "num_samples", "shuffle", "drop_last", "source")

    #: The format of the state ``state_dict()`` writes, saved in it as ``"format"``: 2, the global offset
    #: ``samples`` beside ``batch`` (elastic resume); 1, ``batch`` alone. States written before the key
    #: existed have none and are read as 2 or 1 by whether they hold ``samples``. A state whose keys mean
    #: something else takes the next number, so that this version refuses it instead of resuming at
    #: another position than the one saved.
    STATE_FORMAT: ClassVar[int] = 2

    def _identity(self) -> dict:
        """What a saved position was taken under (``_SAME`` must match on load; the layout may not)."""
        p = self.plan
        return {"seed": p.seed, "batch_size": p.batch_size, "world_size": p.world_size,
                "num_samples": p.num_samples, "shuffle": p.shuffle, "drop_last": p.drop_last,
                "source": self.source.fingerprint()}

    def state_dict(self) -> dict:
        """The consumer's position and what it is valid for.

        ``samples``: the global offset into epoch ``epoch``'s order that every rank has read up to (the
        batches handed out, over all ranks); ``batch``: the same position in batches of this layout.
        """
        epoch, offset, done, total = self._position
        if total is not None and done >= total:
            epoch, samples = epoch + 1, 0
        else:
            samples = self.plan.consumed(offset, done)
        return {"format": self.STATE_FORMAT, "epoch": epoch, "batch": -(-samples // self.plan.global_batch),
                "samples": samples, **self._identity()}

    def _state_format(self, state: dict) -> int:
        """The format ``state`` was written in (``STATE_FORMAT``): refused when it is not an int, or newer
        than this version reads (a newer fastdata's keys may mean another position)."""
        if "format" not in state:   # written before the key existed: format 1 had no "samples"
            return 2 if "samples" in state else 1
        saved = state["format"]
        if not isinstance(saved, int) or isinstance(saved, bool):
            raise TypeError(f"loader state 'format' must be int, got {saved!r:.40} ({type(saved).__name__})")
        # Bounded: str() of a crafted 5000-digit int raises its own ValueError, naming nothing.
        shown = saved if abs(saved) < 10 ** 18 else f"a {saved.bit_length()}-bit number"
        if saved > self.STATE_FORMAT:
            raise ValueError(f"loader state 'format' is {shown}, written by a newer fastdata: this one reads "
                             f"loader state formats 1 to {self.STATE_FORMAT}. Upgrade fastdata to the version "
                             f"that saved it to resume from it, or start without it")
        if saved < 1:
            raise ValueError(f"loader state 'format' is out of range: {shown} (formats 1 to {self.STATE_FORMAT})")
        return saved

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s position.

        Under the same world size and batch size the remaining batches are exactly the interrupted
        run's. Under another (elastic resume: the job restarts on more or fewer GPUs, or with another
        batch size) the samples not yet read in that epoch are re-split over the new ranks: each is
        read exactly once (``drop_last=False``), with equal batch counts per rank. A different seed,
        dataset, shuffle or drop_last would change which samples remain, so it is refused, as is a
        state with a missing key or a value of the wrong type or range (each error names the key).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be the dict that state_dict() returned, got {type(state).__name__}")
        # First: a newer format's keys may be missing or mean another thing, and saying so is the answer.
        required = ("samples",) if self._state_format(state) >= 2 else ()
        mine = self._identity()
        missing = [k for k in ("epoch", "batch", *required, *mine) if k not in state]
        if missing:
            raise ValueError(f"loader state has no {missing[0]!r} key (missing: {missing}); it was not "
                             f"written by state_dict() of this version, so the position cannot be trusted")
        optional = ("samples",) if "samples" in state else ()  # states written before elastic resume
        for key in ("epoch", "batch", *optional, *mine):
            value, expected = state[key], type(mine.get(key, 0))
            ok = isinstance(value, bool) if expected is bool else \
                isinstance(value, expected) and not isinstance(value, bool)
            if not ok:
                raise TypeError(f"loader state {key!r} must be {expected.__name__}, got {value!r} "
                                f"({type(value).__name__})")
        for key in ("epoch", "batch", *optional, "batch_size", "world_size"):
            if state[key] < (1 if key in ("batch_size", "world_size") else 0):
                raise ValueError(f"loader state {key!r} is out of range: {state[key]}")
        upgrade = getattr(self.source, "saved_fingerprint", None)   # Shards: a position of an older release
        if upgrade is not None:
            state = {**state, "source": upgrade(state["source"])}
        diff = {k: (state[k], mine[k]) for k in self._SAME if state[k] != mine[k]}
        if diff:
            raise PositionMismatch(", ".join(f"{k} was {a!r} and is now {b!r}" for k, (a, b) in diff.items()))
        saved_global = state["batch_size"] * state["world_size"]
        if optional:
            samples = state["samples"]
        else:
            samples = min(state["batch"] * saved_global, self.plan.num_samples)
        if not 0 <= samples <= self.plan.num_samples:
            raise ValueError(f"loader state 'samples' {samples} is outside [0, {self.plan.num_samples}]")
        if state["batch"] * saved_global < samples or (state["batch"] - 1) * saved_global >= max(samples, 1):
            raise ValueError(f"loader state 'batch' {state['batch']} disagrees with 'samples' {samples} "
                             f"(batches of {state['batch_size']} x {state['world_size']} ranks)")
        self._next = (state["epoch"], samples)
        self._position = (state["epoch"], samples, 0, None)

    def close(self) -> None:
        """Release workers, threads and caches. The loader is not to be iterated afterwards (dali and
        memory refuse; torch and prefetch, which hold no cache, would start fresh workers)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"{type(self).__name__}(source={self.source!r}, batch_size={self.config.batch_size}, "
                f"batches={len(self)}, device={self.device}, augment={self.augment})")

    # ------------------------------------------------------------------ for subclasses
    def _epoch(self, epoch: int, batches: list[np.ndarray], start: int) -> Iterator:
        """Yield (images, labels) for ``batches`` (sample ids); ``start`` is the first batch's number."""
        raise NotImplementedError

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, H, W, C) on the device → the contract's normalized (N, C, H, W) batch: the loader's
        ``normalizer`` (fastdata/normalize.py). Backends call this, so wrapping it applies everywhere."""
        return self.normalizer(images)

    def batch_rng(self, epoch: int, batch: int) -> np.random.Generator:
        """The generator of batch ``batch``'s augmentation draws, seeded from ``(seed, epoch, batch)``."""
        return np.random.default_rng(self.plan.batch_seed(epoch, batch))

    def batch_rngs(self, epoch: int, first: int, count: int) -> list:
        """``[batch_rng(epoch, b) for b in range(first, first + count)]``, seeded at once: for a backend
        that draws a whole epoch (``EpochPlan.batch_rngs``: 10x less host time than one by one)."""
        return self.plan.batch_rngs(epoch, first, count)
