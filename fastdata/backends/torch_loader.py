"""``torch`` backend: a DataLoader whose workers each build whole uint8 batches.

Why batches, not samples: the main process sends a worker one job (the batch's sample ids and its
augmentation seed) and gets one uint8 (N, H, W, C) tensor back through shared memory. Per-sample
DataLoader traffic (one queue message and one tensor per image, then a Python collate) costs more
than decoding a 28x28 digit. Array sources are gathered and translated with vectorized numpy; files
go through PIL per sample (Pillow-SIMD accelerates the resize, ``Image.draft`` shrinks the decode).
Normalization to float happens once per batch on the device.

The ``prefetch`` backend is this one plus a stage (``fastdata.prefetch.PrefetchStage``: a producer thread,
with side-stream copies on CUDA) over the same host batches, so it is defined here, at the end,
as that composition rather than in a file that would import this one.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.util
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Sampler

from ..augment import output_size, recipe
from ..checks import check_flag, check_integer
from ..datasets import SourceKind
from ..datasets.base import check_picklable, tell_in_flight
from ..decode import BatchDecoder, collect_before_fork
from ..prefetch import PrefetchStage
from ..sampling import seed_for
from .base import Loader

log = logging.getLogger("fastdata")


class JobSampler(Sampler):
    """Yields the current epoch's jobs. One object for the DataLoader's lifetime, so persistent workers
    keep running between epochs; ``jobs`` is replaced before each epoch."""

    def __init__(self):
        self.jobs: list = []

    def __iter__(self):
        return iter(self.jobs)

    def __len__(self):
        return len(self.jobs)


def device_scope(device: torch.device, pin: bool):
    """The context in which a pinning DataLoader iterator is created and advanced: ``device`` current.

    Why: DataLoader's ``pin_memory_device`` is deprecated in torch 2.14 (a warning every epoch) and
    ignored; the iterator now pins for "the current accelerator". Its pin thread calls
    ``torch.accelerator.set_device_index(i)`` with ``i = torch.accelerator.current_device_index()`` read
    when the iterator is created (torch/utils/data/dataloader.py, _pin_memory_loop), and without
    workers the pinning runs in the calling thread at each ``next()``. Outside this scope both would use
    cuda:0 and create a context there for a loader on cuda:1. Only iterator creation and ``next()`` run
    inside it, never a ``yield``: the caller's current device must not change under it.
    """
    return torch.cuda.device(device) if pin and device.type == "cuda" else contextlib.nullcontext()


#: Errors a dead worker can surface as, besides DataLoader's own RuntimeError: the main process reads a
#: batch whose shared memory the killed worker was serving (ConnectionResetError/ConnectionRefusedError
#: from the fd-passing socket, EOFError from a half-written pickle, BrokenPipeError).
_WORKER_DEATH_SYMPTOMS = (ConnectionError, EOFError)


def dead_workers(iterator, wait: float = 1.0) -> list[str]:
    """One line per DataLoader worker of ``iterator`` that has died: pid and exit signal or code.

    A worker killed by a signal can break the connection before its exit is visible to waitpid, so
    this polls for up to ``wait`` seconds until some worker shows an exit status.
    """
    workers = list(getattr(iterator, "_workers", ()))
    end = time.monotonic() + wait
    while True:
        dead = [(w.pid, w.exitcode) for w in workers if w.exitcode not in (None, 0)]
        if dead or time.monotonic() >= end or not workers:
            break
        time.sleep(0.02)
    out = []
    for pid, code in dead:
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"number {-code}"
            out.append(f"DataLoader worker (pid {pid}) was killed by signal {name}")
        else:
            out.append(f"DataLoader worker (pid {pid}) exited with code {code}")
    return out


def worker_seed_generator(seed: int) -> torch.Generator:
    """The generator a DataLoader draws its workers' base seed from: its own, seeded from the loader's
    ``seed`` (and rank). Without one, each pass draws from torch's global generator, moving the caller's
    RNG (dropout, init) by a draw that memory and dali never make. The base seed seeds the workers'
    ``random``, numpy and torch generators, which a Dataset augmenting in its own ``__getitem__`` uses
    (fastdata seeds the batches and the transforms it runs itself), so it follows ``seed=``, as it
    followed ``torch.manual_seed`` before."""
    return torch.Generator().manual_seed(seed)


#: What a worker's fd-sharing thread meets when the process it sends a batch to goes away mid-transfer.
_PEER_GONE = (ConnectionError, EOFError, multiprocessing.AuthenticationError)


def _ignore_sigint(signum, frame) -> None:
    """A worker's SIGINT handler (see ``quiet_worker``): the main process alone acts on Ctrl-C."""


def quiet_worker(worker_id: int) -> None:
    """The workers' ``worker_init_fn``.

    Ctrl-C is the main process's alone: a worker ignores SIGINT. Jupyter's "interrupt kernel" sends it
    to the kernel's whole process group (jupyter_client's provisioner: ``os.killpg``), as a terminal's
    Ctrl-C does, and a worker that got it left its loop (torch's ``_worker_loop`` ends on
    KeyboardInterrupt) and exited: the same loader's next pass in that kernel failed with "DataLoader
    worker exited unexpectedly". The main process gets the KeyboardInterrupt and ends the pass; a
    worker whose main process is gone ends by itself (torch's ``ManagerWatchdog``).

    Also: a batch's tensors reach the main process as file descriptors,
    which each worker hands over from multiprocessing's resource-sharer thread
    (``multiprocessing/resource_sharer.py``, ``_serve``). On Ctrl-C the main process stops reading
    mid-transfer, and that thread prints the broken connection's traceback through ``sys.excepthook``
    unless the worker is already exiting: a race that put a BrokenPipe traceback under the one line an
    interrupted run prints (seen in CI with the Lightning example). Only that thread's peer-gone errors
    are silenced; anything else still reaches the previous hook."""
    # A handler that does nothing, not SIG_IGN: an ignored signal stays ignored across exec, so every
    # program a user's dataset starts from a worker (a decoder, ffmpeg) would be deaf to Ctrl-C too; a
    # handler is reset to the default in an exec'd child.
    signal.signal(signal.SIGINT, _ignore_sigint)
    previous = sys.excepthook

    def hook(kind, value, tb):
        frame = tb.tb_frame.f_code if tb is not None else None
        if issubclass(kind, _PEER_GONE) and frame is not None and frame.co_name == "_serve" \
                and frame.co_filename.endswith("resource_sharer.py"):
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def start_method(context) -> str:
    """How the DataLoader's workers start: ``multiprocessing_context`` (a name or a context), else the
    platform's default (the first of ``get_all_start_methods``; read without fixing it, which
    ``get_start_method()`` would)."""
    if context is None:
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context if isinstance(context, str) else context.get_start_method()


def make_dataloader(fetcher, sampler, workers: int, pin: bool, opts: dict, seed: int = 0) -> DataLoader:
    """The backend's DataLoader: one job per batch, no collate. No ``pin_memory_device`` (deprecated
    and ignored in torch 2.14): the pinning device comes from ``device_scope``. ``seed``: see
    ``worker_seed_generator``."""
    pf = opts["prefetch_factor"]
    if workers:
        # This process's multiprocessing folder (pymp-*), made now if it is not yet: a forked worker uses
        # its parent's instead of making its own when it first sends a batch (torch passes a batch's memory
        # as a descriptor, through a listener socket in that folder). A worker told to stop mid-epoch does
        # not join its queue's feeder thread, which may be making that folder while the worker's exit
        # clean-up runs: the folder was left behind in TMPDIR, now and then, by loaders cut and closed.
        # The parent's goes at its exit, with all in it. Where no temporary folder can be made, workers
        # that need one fail as they did before; a loader whose workers never do still works.
        with contextlib.suppress(OSError):
            multiprocessing.util.get_temp_dir()
    return DataLoader(
        fetcher, batch_size=None, sampler=sampler, num_workers=workers, pin_memory=pin,
        generator=worker_seed_generator(seed), worker_init_fn=quiet_worker if workers else None,
        persistent_workers=bool(workers and opts["persistent_workers"]),
        prefetch_factor=pf if workers else None, timeout=opts["timeout"],
        multiprocessing_context=opts["multiprocessing_context"] if workers else None)


class TorchLoader(Loader):
    """Multi-worker DataLoader backend.

    Undecodable files: ``on_error="raise"`` (default) raises ``DecodeError`` in the main process; its
    message holds the worker's traceback and ``.path`` names the file. ``on_error="skip"`` drops the
    file from its batch (that batch comes out smaller), adds it to ``loader.skipped`` and warns once
    at the end of the epoch. ``len(loader)`` is unchanged by skips: it counts batches, and a batch is
    empty (0 samples) only if all of its files were skipped.

    Options:
        prefetch_factor: batches each worker prepares ahead (default 2).
        persistent_workers: keep workers alive between epochs (default True; forking them anew each
            epoch costs seconds with large sources). False by default for a torch Dataset, as a
            DataLoader's: workers forked each epoch see what the main process changed in it since.
        timeout: seconds to wait for a worker's batch before raising (default 0: no limit; a dead worker
            is detected regardless).
        multiprocessing_context: 'fork', 'spawn' or 'forkserver' (default: the platform's).
    """

    name = "torch"
    reads = frozenset({SourceKind.ARRAY, SourceKind.FILES, SourceKind.DATASET})
    runs_sample_transforms = True  # its workers decode each sample with PIL: a per-sample callable fits there
    options = {"prefetch_factor": 2, "persistent_workers": True, "timeout": 0,
               "multiprocessing_context": None}

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        if source.kind is SourceKind.DATASET and "persistent_workers" not in options:
            # A user's Dataset may change between epochs in the main process (a curriculum's stage, a
            # resampled file list): persistent workers keep their fork's copy, and every epoch after
            # the first silently read the first one's data. A DataLoader re-forks its workers each
            # epoch by default, and so does this backend for a Dataset unless told otherwise.
            self.opts["persistent_workers"] = False
        check_flag("torch backend: persistent_workers", self.opts["persistent_workers"])
        self.fetcher = BatchDecoder(source, self.augment, config.on_error)
        self._sampler = JobSampler()
        self._pass_iterator = None   # the running pass's DataLoader iterator (see close)
        workers = config.num_workers
        if workers:   # the DataLoader reads prefetch_factor only with workers
            check_integer("prefetch_factor", self.opts["prefetch_factor"], minimum=1)
            method = start_method(self.opts["multiprocessing_context"])
            if method != "fork":   # spawned workers get the source pickled: what cannot be is named now
                check_picklable(source, f"multiprocessing_context={method!r}")
        self.pin = self.device.type == "cuda"
        self._loader = make_dataloader(self.fetcher, self._sampler, workers, self.pin, self.opts,
                                       seed=seed_for(self.plan.seed, self.plan.rank, 0x5EED))
        # Told once, here, whatever the subclass: each call replaces the last, so a subclass that reads
        # further ahead (prefetch's stage) says so in ``_reads_ahead`` rather than telling the source again.
        tell_in_flight(source, self.plan, self._reads_ahead())

    def _reads_ahead(self) -> int:
        """Batches the readers may be reading past the position this loader tells the source, the batch
        it is handing out included. The DataLoader sends out prefetch_factor batches per worker, and the
        next batch's indices as it hands one out, before the loader tells the source where it is: a
        streaming source keeps their shards. Without workers, the batch being read alone."""
        return self.num_workers * self.opts["prefetch_factor"] + 1 if self.num_workers else 1

    @property
    def pin_memory(self) -> bool:
        return self.pin

    def host_batches(self, epoch, batches, start):
        """uint8 (images, labels) batches in host memory (pinned on CUDA), in order; counts skips."""
        # The batches' seeds at once: one seed_for per batch was ~0.2 s before an ImageNet pass's first batch.
        seeds = self.plan.batch_seeds(epoch, start, len(batches)).tolist()
        jobs = list(zip(batches, seeds, strict=True))
        self._sampler.jobs = jobs
        keep_ids = self.ids_keeper()   # this pass's (loader.batch_ids): prefetch's producer may outlive it
        if self._loader.num_workers and getattr(self._loader, "_iterator", None) is None:
            collect_before_fork()
        it = None
        try:
            with device_scope(self.device, self.pin):
                it = iter(self._loader)
            # close() shuts this pass's workers down: a DataLoader keeps its iterator (_iterator) only
            # with persistent workers, and a torch Dataset's are not (each epoch forks them anew).
            self._pass_iterator = it
            for ids, _ in jobs:   # the DataLoader returns the jobs' batches in order
                with device_scope(self.device, self.pin):
                    batch = next(it, None)
                if batch is None:   # close() shut the workers down under this pass (its iterator ends)
                    raise RuntimeError("torch backend: the loader was closed while this pass ran; a new "
                                       "iter(loader) starts a fresh pass")
                images, labels, kept = batch
                self.skipped += len(ids) - len(kept)
                keep_ids(kept)   # before the batch is handed on (prefetch's producer runs ahead)
                yield images, labels
            with device_scope(self.device, self.pin):
                next(it, None)  # the end of the epoch, as a plain loop over the DataLoader reaches it
        except _WORKER_DEATH_SYMPTOMS as e:
            # A worker killed mid-batch (SIGKILL, the OOM killer) sometimes surfaces as a broken
            # connection instead of DataLoader's RuntimeError: name the dead worker, as the README promises.
            dead = dead_workers(it)
            self.close()
            if dead:
                raise RuntimeError("; ".join(dead) + f" (the main process saw {type(e).__name__}: {e})") from e
            raise
        except Exception:
            # A worker's error (DecodeError, ...) or a dead worker: shut the workers down here, now.
            # Otherwise the DataLoader iterator stays reachable only through the exception's traceback
            # (a reference cycle), and the cyclic GC finalizes it later at an arbitrary point: its queues
            # may already be cleared, so each worker join waits its 5 s timeout (10 s stalls in an
            # unrelated loader), or the finalizer runs in a forked child ("can only test a child
            # process"). The next iter() starts fresh workers.
            self.close()
            raise
        finally:
            if it is not None and it is not getattr(self._loader, "_iterator", None):
                self._end_pass_workers(it)

    def _end_pass_workers(self, it) -> None:
        """Shut down the workers of a pass that owns them (not persistent: a torch Dataset's, or
        ``persistent_workers=False``) when it ends, however it ends (a break, Ctrl-C), as a dropped
        DataLoader iterator's are. Kept in ``_pass_iterator``, they idled until the next pass or close():
        two processes, each with its copy of the dataset, after a notebook cell that looked at a few
        batches."""
        if self._pass_iterator is it:
            self._pass_iterator = None
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def _epoch(self, epoch, batches, start):
        # non_blocking: from pinned memory the copy is asynchronous, so the host goes on to the next
        # batch while the copy runs; normalization is queued on the same stream after the copy.
        for images, labels in self.host_batches(epoch, batches, start):
            images = images.to(self.device, non_blocking=self.pin)
            labels = labels.to(self.device, non_blocking=self.pin)
            yield self.normalize(images), labels

    def close(self):
        for it in (getattr(self._loader, "_iterator", None), getattr(self, "_pass_iterator", None)):
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()  # the workers otherwise live until garbage collection
        self._loader._iterator = self._pass_iterator = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def batch_bytes(source, config) -> int | None:
    """Bytes of one uint8 batch the torch backend copies to the device: batch size x the recipe's output
    (H, W) x channels; None where the output size is known only once a batch is read."""
    size = output_size(source, recipe(source, config))
    return None if size is None else config.batch_size * size[0] * size[1] * source.channels


class PrefetchLoader(TorchLoader):
    """The torch backend plus a PrefetchStage: a thread that pulls the DataLoader's batches and, on
    CUDA, copies and normalizes them on a side stream, ``depth`` batches ahead of the training thread.

    ``auto`` picks it on CUDA only where it can beat the torch backend (``fits``:
    ``PrefetchStage.helps``); named explicitly on batches too small for it to help, it says so once.

    Options (besides the torch backend's):
        depth: batches prepared ahead of the consumer (default 2).
    """

    name = "prefetch"
    options = {**TorchLoader.options, "depth": 2}

    @classmethod
    def fits(cls, source, config, options=None, *, stable=False):
        """The torch backend's kinds, and on CUDA batches large enough for the stage to help (see
        ``fastdata.prefetch``: a small batch has no copy worth hiding; 'torch' is as fast there)."""
        ok, why = super().fits(source, config, options, stable=stable)
        if not ok or config.device.type != "cuda":
            return ok, why
        return PrefetchStage.helps(batch_bytes(source, config))

    def __init__(self, source, config, **options):
        super().__init__(source, config, **options)
        self.stage = PrefetchStage(self.device, self.opts["depth"])
        self.depth = self.stage.depth
        if self.device.type == "cuda":
            helps, why = PrefetchStage.helps(batch_bytes(source, config))
            if not helps:
                log.warning("fastdata: backend 'prefetch' cannot help here: %s; backend 'torch' does the same "
                            "work with one thread less", why)

    def _reads_ahead(self) -> int:
        """The DataLoader's batches in flight, then the stage's queue of ``depth`` batches and the one its
        thread holds. Asked by TorchLoader's ``__init__``, before the stage is made: ``depth`` is read from
        the options, checked as the stage checks it."""
        return super()._reads_ahead() + check_integer("depth", self.opts["depth"], minimum=1) + 1

    def _epoch(self, epoch, batches, start):
        # The normalize is passed per epoch, not kept by the stage: a stage holding the loader's bound
        # method would form a cycle, and a dropped loader's workers would wait for the cyclic GC.
        return self.stage(self.host_batches(epoch, batches, start), self.normalize)

    def close(self):
        # The producer must be out of the DataLoader iterator before its workers are shut down.
        self.stage.close()
        super().close()
