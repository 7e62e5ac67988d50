"""Everything a resume needs: ``TrainingState`` saves and restores one checkpoint, with the loader's
``state_dict`` as the one record of the position (``resumed_batch`` re-splits it under another layout),
and ``PeriodicSave`` saves every N batches on step boundaries."""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .. import checkpoint as ckpt
from .. import distributed as fdist
from ..errors import PositionMismatch
from .amp import user_stacklevel
from .schedule import check_same_peak_lr

if TYPE_CHECKING:
    from .meter import EpochMeter
    from .step import TrainStep

# Format 2 dropped format 1's ``global_step``: the loader's state is the one record of the position.
CHECKPOINT_FORMAT = "fastdata-checkpoint-2"


def _state_dict_mismatch(saved: dict, now: dict, shown: int = 3) -> str:
    """What differs between a saved model state_dict and this model's (names missing, unexpected, of
    another shape), the first few of each, or "" when they match."""
    missing = [k for k in now if k not in saved]
    unexpected = [k for k in saved if k not in now]
    shapes = [f"{k} {tuple(saved[k].shape)} saved, {tuple(now[k].shape)} here" for k in now
              if k in saved and hasattr(saved[k], "shape") and tuple(saved[k].shape) != tuple(now[k].shape)]
    parts = []
    for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)):
        if names:
            more = f", ... ({len(names)} in all)" if len(names) > shown else ""
            parts.append(f"{len(names)} {what} ({', '.join(names[:shown])}{more})")
    return "; ".join(parts)


class TrainingState:
    """Everything a resumed run needs, saved to and restored from one checkpoint.

    The position has ONE record: the loader's ``state_dict()`` (epoch, the global sample offset and
    batches done, plus what the position is valid for: seed and dataset, checked by the loader when it
    is restored; the world size and batch size may differ, and the rest of the epoch is then re-split,
    see ``resumed_batch``). Format 1 also kept a ``global_step`` beside it, which restore no longer needs: the
    periodic-save count is ``epoch × len(loader) + batch``. Format 1 files still load (that key is
    ignored); any other format is refused with the formats this version reads.

    A checkpoint also holds the model, optimizer, GradScaler and scheduler states, the RNG states,
    the finished epochs' records (``history``), a half-done epoch's global sums (``partial``) and gradient
    norms (``grad_norms``), the precision, the world size and the weight average (``ema``, None without
    one). Rank 0 writes it (atomically: ``checkpoint.save``) and holds its path from ``start`` to
    ``release`` (``checkpoint.claim``: a second run on the same file is refused). Under ``accumulate``
    every save falls on an optimizer step's boundary (``PeriodicSave``): no checkpoint holds
    half-accumulated gradients.
    """

    FORMAT = CHECKPOINT_FORMAT
    READS = ("fastdata-checkpoint-1", CHECKPOINT_FORMAT)

    def __init__(self, step: TrainStep, loader, storage=None):
        self.step, self.loader, self.storage = step, loader, storage
        self.history: list[dict] = []
        self.epoch, self.batch = 0, 0         # where training starts
        self.samples = 0                      # the global sample offset into the start epoch's order
        self.partial = [0.0, 0.0, 0.0]        # the sums the half-done start epoch carries
        self.grad_norms = [0.0, 0.0]          # and its clipped steps' norm sum and count (every rank's)
        self.claim: ckpt.Claim | None = None   # rank 0's hold on the checkpoint path (start to release)

    def start(self, path, resume: bool, epochs: int | None = None) -> None:
        """Check ``path`` before any training, then restore from it when ``resume`` and it exists.
        ``epochs``: the run's total, to say so when the checkpoint has finished them all already.

        Both are decided once, by rank 0, and shared: an unusable path fails on every rank (naming
        rank 0's error), and a checkpoint only rank 0 can see (its own disk) resumes every rank."""
        # An unusable path fails now, not after an epoch of training; so does a state a checkpoint
        # could not hold (a scheduler keeping a Fraction): it would fail at the first save.
        # Rank 0 also holds the path until release(): a second run started on it is refused now.
        fdist.decide_on_main(self._prepare, path, resume, what=f"checking checkpoint path '{path}'")
        ckpt.loadable(self.state_dict(self.loader.state_dict(), self.partial), f"checkpoint '{path}'")
        if not resume:
            return
        main = fdist.is_main()
        state = ckpt.load_shared(path, storage=self.storage)
        if state is None:
            if main:
                print(f"no checkpoint at '{path}' yet: starting from scratch", flush=True)
            return
        self.load_state_dict(state, path)
        if main:
            saved, now = state.get("loader", {}), self.loader.state_dict()
            layout = [(d.get("world_size"), d.get("batch_size")) for d in (saved, now)]
            resplit = f" (saved by {layout[0][0]} rank(s) x batch {layout[0][1]}: the rest of the epoch is " \
                      f"re-split over {layout[1][0]} x {layout[1][1]})" if layout[0] != layout[1] else ""
            if epochs is not None and self.epoch >= epochs:
                # Not "resumed at epoch 4" of a 3-epoch run: nothing trains, and fit returns the history.
                print(f"'{path}' holds a finished run ({self.epoch} epoch(s), epochs={epochs}): nothing left to "
                      f"train; its figures are the result", flush=True)
            else:
                print(f"resumed from '{path}': epoch {self.epoch + 1}, batch {self.batch}/{len(self.loader)}"
                      f"{resplit}", flush=True)

    def _prepare(self, path, resume: bool) -> None:
        ckpt.prepare(path, self.storage)
        self.release()
        self.claim = ckpt.claim(path, self.storage)
        ckpt.check_room(path, _tensor_bytes(self.step.raw.state_dict(),
                                            self.step.ema.state_dict() if self.step.ema is not None else {}),
                        self.storage)
        if not resume and ckpt.exists(path, self.storage):
            # A restart without --resume replaced days of training at its first save, without a word.
            warnings.warn(f"'{path}' holds a checkpoint and resume=False: this run starts from scratch and its "
                          f"first save replaces it. resume=True (the examples' --resume) goes on from it; give "
                          f"another checkpoint path to keep both", RuntimeWarning, stacklevel=user_stacklevel())

    def release(self) -> None:
        """Give up the checkpoint path ``start`` held (``fit`` calls it when the run ends, however it ends)."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    def state_dict(self, position: dict, partial: list[float], rng_ranks: list[dict] | None = None,
                   grad_norms: list[float] | None = None) -> dict:
        """The checkpoint's contents at ``position`` (the loader's state_dict) with ``partial`` sums and
        ``grad_norms`` (the half-done epoch's sum and count of gradient norms, ``EpochMeter.norms``).
        ``rng_ranks``: every rank's ``ckpt.rng_state()`` in rank order (default: this process's alone).
        ``"rng"`` is rank 0's (what a checkpoint before ``"rng_ranks"`` held, and what a resume on
        another world size restores on every rank)."""
        step = self.step
        rng_ranks = rng_ranks or [ckpt.rng_state()]
        return {
            "format": self.FORMAT, "model": step.raw.state_dict(), "optimizer": step.optimizer.state_dict(),
            "scaler": step.scaler.state_dict(),
            "scheduler": step.scheduler.state_dict() if step.scheduler is not None else None,
            "loader": position, "rng": rng_ranks[0], "rng_ranks": rng_ranks, "partial": list(partial),
            # Apart from "partial": every rank holds the same norms (see EpochMeter.grad_norm). Without them
            # a resumed epoch's grad_norm was the mean of the steps after the resume alone.
            "grad_norms": list(grad_norms or [0.0, 0.0]),
            "history": list(self.history), "amp": step.mode, "world_size": fdist.world_size(),
            # Class names, checked on resume: an optimizer's or scheduler's state loads into any other
            # class without complaint and fails (or silently misbehaves) later.
            "optimizer_class": type(step.optimizer).__name__,
            "scheduler_class": type(step.scheduler).__name__ if step.scheduler is not None else None,
            # The moving average of the weights (fit(ema=...)), or None: a resume continues the average.
            "ema": step.ema.state_dict() if step.ema is not None else None,
        }

    #: What every checkpoint this version reads holds (format 1 as well as 2).
    KEYS = ("model", "optimizer", "scaler", "scheduler", "loader", "rng", "partial", "history", "amp")

    def check_restorable(self, state: dict, path="checkpoint") -> None:
        """Refuse, before anything is restored, a checkpoint this run cannot take: another format, keys
        missing, another model (names or shapes), another optimizer class or parameter layout, another
        scheduler class. ``CheckpointError`` for a file that is not a whole fastdata checkpoint,
        ``ResumeError`` for one of another run. Without these checks torch's own errors came after the
        model was overwritten (hundreds of key names, no path), or not at all (an AdamW state loaded
        into SGD failed at its first step with KeyError: 'momentum')."""
        if state.get("format") not in self.READS:
            raise ckpt.CheckpointError(f"'{path}' is not a fastdata checkpoint this version reads (format "
                                       f"{state.get('format')!r}; reads {list(self.READS)}){_format_hint(state)}")
        missing = [k for k in self.KEYS if k not in state]
        if missing:
            raise ckpt.CheckpointError(f"'{path}' is a {state['format']} checkpoint without {missing}: it was "
                                       f"not written whole by fit")
        _check_entries(state, path)
        step = self.step
        problems = _state_dict_mismatch(state["model"], step.raw.state_dict())
        if problems:
            raise ckpt.ResumeError(f"'{path}' holds the weights of another model than "
                                   f"{type(step.raw).__name__}: {problems}")
        _check_same_schedule(state, step.scheduler, path)
        for part, now in (("optimizer", step.optimizer), ("scheduler", step.scheduler)):
            saved = state.get(f"{part}_class")
            if saved is not None and now is not None and saved != type(now).__name__:
                raise ckpt.ResumeError(f"'{path}' was trained with a {saved} {part}; this run's is "
                                       f"{type(now).__name__}: its state does not fit it. Resume with the "
                                       f"{part} of that run, or start a new run (resume=False)")
        saved_ema = state.get("ema")
        problems = _state_dict_mismatch(saved_ema, step.ema.state_dict()) if saved_ema and step.ema else ""
        if problems:
            raise ckpt.ResumeError(f"'{path}' holds a weight average (ema) of another model: {problems}")
        layout = [len(g["params"]) for g in state["optimizer"].get("param_groups", [])]
        here = [len(g["params"]) for g in step.optimizer.param_groups]
        if layout != here:
            raise ckpt.ResumeError(f"'{path}' has an optimizer of {len(layout)} parameter group(s) of "
                                   f"{layout} parameters; this run's has {len(here)} of {here}")
        check_same_peak_lr(state, step.optimizer, path)

    def load_state_dict(self, state: dict, path="checkpoint") -> None:
        """Restore a checkpoint's contents, all or nothing: ``check_restorable`` first, then the loader
        (it checks the position against its dataset and order before taking it), and only then the
        model, optimizer and the rest, so a refused checkpoint leaves every object as it was."""
        self.check_restorable(state, path)
        try:
            self.loader.load_state_dict(state["loader"])
        except PositionMismatch as e:   # set_epoch(), the loader's own advice, is not fit's to take
            raise ckpt.ResumeError(f"'{path}' cannot resume this run: {e.detail}; the samples left in its "
                                   f"epoch would not be the interrupted run's. Resume with that run's seed, "
                                   f"data and order, or start a new run (resume=False)") from e
        except (ValueError, TypeError) as e:   # another dataset, order or loader kind: not this run's
            raise ckpt.ResumeError(f"'{path}' cannot resume this run: {e}") from e
        step = self.step
        step.raw.load_state_dict(state["model"])
        step.optimizer.load_state_dict(state["optimizer"])
        if state["amp"] != step.mode:
            warnings.warn(f"checkpoint was trained with amp={state['amp']!r}, resuming with {step.mode!r}",
                          stacklevel=user_stacklevel())
        if state["scaler"]:
            step.scaler.load_state_dict(state["scaler"])
        if step.scheduler is not None and state["scheduler"] is not None:
            step.scheduler.load_state_dict(state["scheduler"])
        self._restore_ema(state.get("ema"), path)
        # Each rank its own generators (dropout and a model's other random ops draw from them; under DDP
        # rank r's GPU generator is cuda:r's, which only rank r's process ever advanced). Resumed on
        # another world size, every rank takes rank 0's, as before "rng_ranks" existed.
        ranks = state.get("rng_ranks") or []
        ckpt.set_rng_state(ranks[fdist.rank()] if len(ranks) == fdist.world_size() else state["rng"])
        # Read back from the loader, which has validated it: the one record of the position, in this
        # run's layout (a checkpoint of another world size or batch size re-splits the epoch's rest).
        position = self.loader.state_dict()
        self.epoch = position["epoch"]
        self.samples = position.get("samples", position["batch"])
        self.batch = resumed_batch(position, len(self.loader))
        self.history = list(state["history"])
        # The figures of a half-done epoch are global sums, whatever the world size that summed them;
        # one rank carries them on.
        self.partial = list(state["partial"]) if fdist.is_main() else [0.0, 0.0, 0.0]
        self.grad_norms = list(state.get("grad_norms") or [0.0, 0.0])   # not in checkpoints before it

    def _restore_ema(self, saved: dict | None, path) -> None:
        """The checkpoint's weight average, or, when it kept none (saved without ``ema``), a new one from
        the restored weights, said in a warning: the average starts again from here."""
        ema = self.step.ema
        if ema is None:
            return
        if saved is not None:
            ema.load_state_dict(saved)
            return
        warnings.warn(f"'{path}' holds no weight average (saved without ema): the average starts again from "
                      f"its weights", RuntimeWarning, stacklevel=user_stacklevel())
        if callable(getattr(ema, "set", None)):   # ModelEma and timm's ModelEmaV3 have it
            ema.set(self.step.raw)

    def save(self, path, position: dict, partial: list[float] | None = None, *, every_rank: bool = False,
             grad_norms: list[float] | None = None) -> None:
        """Save at ``position`` (rank 0 writes one file for the run). ``every_rank`` (what ``fit`` does):
        a collective under DDP, every rank calls it at the same batch and sends rank 0 its RNG states, so
        a resume gives each rank its own; without it only rank 0 needs to call it (a loop of your own
        that saves ``if is_main()``), and the checkpoint holds rank 0's RNG states alone.

        Weights holding a NaN or an inf are refused (FloatingPointError), whatever the loss said: the
        file keeps the last good save, which a resume can go on from; NaN weights can only train on NaN."""
        bad = nonfinite_tensors(self.step.raw)
        if bad:
            raise FloatingPointError(f"not saving '{path}': the model's weights are not finite ({_some(bad)}); it "
                                     f"keeps the last save before them")
        state = ckpt.rng_state()
        rng_ranks = fdist.gather_on_cpu(state) if every_rank else [state]
        if fdist.is_main():
            ckpt.save(self.state_dict(position, partial or [0.0, 0.0, 0.0], rng_ranks, grad_norms), path,
                      storage=self.storage)

    def mid_epoch(self, epoch: int) -> bool:
        """Whether ``epoch`` is a resumed half-done epoch (its loader must not be ``set_epoch``'d: that
        would restart it). Decided on the sample offset: under a re-split layout with ``drop_last`` a
        few samples read can leave a whole epoch's batches still to run."""
        return epoch == self.epoch and (self.samples > 0 or self.batch > 0)

    def first_batch(self, epoch: int) -> int:
        """The batch number ``epoch`` starts at: for the resumed epoch, ``len(loader)`` minus the
        batches left (``resumed_batch``), so the epoch's count ends at ``len(loader)`` as a whole epoch
        does; else 0."""
        return self.batch if epoch == self.epoch else 0

    def carried(self, epoch: int) -> list[float] | None:
        """The sums ``epoch`` starts from: a resumed half-done epoch's, else None (zeros)."""
        return self.partial if self.mid_epoch(epoch) else None

    def carried_grad_norms(self, epoch: int) -> list[float] | None:
        """The gradient-norm sum and count ``epoch`` starts from: a resumed half-done epoch's, else None."""
        return self.grad_norms if self.mid_epoch(epoch) else None


_NONE = type(None)
#: The types of a checkpoint's entries, as ``TrainingState.state_dict`` writes them (a tuple: any of
#: them), and of their items where a list holds more than numbers.
_Types = type | tuple[type, ...]
_ENTRY_TYPES: dict[str, _Types] = {
    "model": dict, "optimizer": dict, "loader": dict, "rng": dict, "history": list, "partial": list,
    "scaler": (dict, _NONE), "scheduler": (dict, _NONE), "ema": (dict, _NONE), "rng_ranks": (list, _NONE),
    "grad_norms": (list, _NONE)}
_ITEM_TYPES: dict[str, _Types] = {"history": dict, "rng_ranks": dict, "partial": (int, float),
                                  "grad_norms": (int, float)}


def _check_entries(state: dict, path) -> None:
    """Refuse a checkpoint whose entries are not of the types fit writes, naming the entry: a damaged or
    crafted file (weights_only loads any dict of plain types) failed deep inside the restore with a bare
    "TypeError: 'int' object is not iterable" or "AttributeError: 'list' object has no attribute 'get'",
    naming neither the file nor the entry."""
    def kind(types) -> str:
        return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))

    for key, types in _ENTRY_TYPES.items():
        if key not in state:   # grad_norms, rng_ranks, ema: not in older checkpoints
            continue
        value: Any = state[key]   # Any, not the object isinstance narrows a union of types to
        if not isinstance(state[key], types):
            bad = f"'{key}' is a {type(value).__name__}, where fit writes a {kind(types)}"
        elif key in _ITEM_TYPES and value is not None and not all(
                isinstance(v, _ITEM_TYPES[key]) and not isinstance(v, bool) for v in value):
            bad = f"'{key}' holds items that are not {kind(_ITEM_TYPES[key])}"
        elif key == "optimizer" and not (isinstance(value.get("param_groups"), list) and all(
                isinstance(g, dict) and isinstance(g.get("params"), list) for g in value["param_groups"])):
            bad = "'optimizer' has no list of param_groups, each with its list of params"
        else:
            continue
        raise ckpt.CheckpointError(f"checkpoint '{path}' is damaged or was not written by fit: its entry {bad}; "
                                   f"nothing was restored from it")


def _format_hint(state: dict) -> str:
    """What to do with a file of another format: a newer fastdata's checkpoint, or a model's own weights
    (``torch.save(model.state_dict(), path)``, the file users most often pass as ``--checkpoint``)."""
    number = str(state.get("format", "")).removeprefix("fastdata-checkpoint-")
    # A bounded count of digits: int() of a crafted 5000-digit format was a ValueError naming nothing.
    if number.isdigit() and len(number) < 10 and int(number) > int(CHECKPOINT_FORMAT.rsplit("-", 1)[1]):
        return ": it was written by a newer fastdata; resume it with that version"
    if state and "format" not in state and all(torch.is_tensor(v) for v in state.values()):
        return (": it holds tensors alone, like a model's state_dict (torch.save(model.state_dict())). To start "
                "from those weights, load them (model.load_state_dict(torch.load(path, weights_only=True))) "
                "and give fit a new checkpoint path without resume")
    return ""


def _tensor_bytes(*states: dict) -> int:
    """The bytes of the tensors in ``states`` (state_dicts): what a checkpoint of them holds at least."""
    return sum(t.numel() * t.element_size() for state in states for t in state.values() if torch.is_tensor(t))


def _check_same_schedule(state: dict, scheduler, path) -> None:
    """A scheduler on one side only is another run. A run resumed without the checkpoint's scheduler went on
    at the rate its schedule had reached, without a word; one resumed with a scheduler the checkpoint lacks
    restored the optimizer over the scheduler's ``initial_lr`` and failed at its first step with
    ``KeyError: 'initial_lr'``, the model already overwritten."""
    saved = state.get("scheduler") is not None
    if saved == (scheduler is not None):
        return
    if saved:
        name = state.get("scheduler_class") or "learning-rate"
        raise ckpt.ResumeError(f"'{path}' was trained with a {name} scheduler and this run has none, so its "
                               f"schedule would stop where it was: pass that scheduler (built as for the "
                               f"saved run) with its optimizer, or start a new run (resume=False)")
    raise ckpt.ResumeError(f"'{path}' was trained without a scheduler and this run has a "
                           f"{type(scheduler).__name__}, which cannot start mid-run: resume without "
                           f"scheduler=, or start a new run (resume=False) with it")


def resumed_batch(position: dict, batches: int) -> int:
    """Where a resumed epoch's batch count starts so that it ends at ``batches`` (``len(loader)``).

    Under the layout that saved ``position`` this is its ``batch``. Under another world size or batch
    size (elastic resume) the rest of the epoch, ``num_samples - samples`` samples, is re-split into
    steps of ``batch_size x world_size`` (the loader's, as ``state_dict()`` reports them after the
    restore), and ``ceil(samples / global batch)`` can be one more than the batches already run: the
    step count, the periodic saves and a per-step schedule would run past the epoch's end. A position
    without the sample keys (a loader of another kind) gives its ``batch`` as it is.
    """
    keys = ("samples", "num_samples", "batch_size", "world_size", "drop_last")
    if any(k not in position for k in keys):
        return position["batch"]
    rest = max(0, position["num_samples"] - position["samples"])
    step = position["batch_size"] * position["world_size"]
    left = rest // step if position["drop_last"] else -(-rest // step)
    return max(0, batches - left)


class PeriodicSave:
    """``train_one_epoch``'s ``after_batch`` in ``fit``: saves every ``every`` batches of the run.

    The batch count of the run is ``epoch × len(loader) + batch``, computed from the position, so a
    resumed run saves at the same batches as an uninterrupted one. No save at the epoch's last batch:
    the end-of-epoch save follows. A mid-epoch save carries the sums so far (a collective under DDP:
    every rank reaches the same batch).

    With ``accumulate`` > 1 a save falls only on an optimizer step's boundary (the first at or after
    each ``every`` batches): the gradients of a half-accumulated step live only in memory, and a
    checkpoint without them would resume to other weights than the uninterrupted run's.

    A save after the loss went NaN or inf checks the weights first (``check_diverged``): non-finite ones
    stop the run instead of replacing the last good checkpoint."""

    def __init__(self, state: TrainingState, path, every: int | None, epoch: int, meter: EpochMeter,
                 first_batch: int = 0):
        self.state, self.path, self.every, self.meter = state, path, every, meter
        self.epoch, self.first_batch = epoch, first_batch   # where the meter's pass started
        self.length = len(state.loader)
        self.offset = epoch * self.length
        self.accumulate = state.step.accumulate
        self.due = False

    def __call__(self, batch: int) -> None:
        if self.path is None or not self.every:
            return
        self.due = self.due or (self.offset + batch) % self.every == 0
        if not self.due or batch % self.accumulate or batch >= self.length:
            return
        self.due = False
        sums = self.meter.global_sums()
        if not math.isfinite(sums[0]):   # before the save: NaN weights must not replace the last good ones
            check_diverged(self.state.step, self.meter, self.epoch, self.first_batch, self.length, self.path,
                           warn=False)
        self.state.save(self.path, self.state.loader.state_dict(), sums, every_rank=True,
                        grad_norms=self.meter.norms.tolist())


def nonfinite_tensors(module) -> list[str]:
    """The names of ``module``'s parameters and floating-point buffers holding a NaN or an inf."""
    named = [*module.named_parameters(), *module.named_buffers()]
    named = [(name, t) for name, t in named if t.is_floating_point()]
    if not named:
        return []
    device = named[0][1].device   # fit keeps them on one; a tensor elsewhere costs its own copy
    finite = torch.stack([torch.isfinite(t).all().to(device) for _, t in named]).tolist()   # one host read
    return [name for (name, _), ok in zip(named, finite) if not ok]


def _some(names: list[str], shown: int = 3) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_diverged(step: TrainStep, meter: EpochMeter, epoch: int, first_batch: int, batches: int, path,
                   *, warn: bool = True) -> None:
    """Whether ``epoch`` (0-based) diverged: where its loss first went NaN or inf (``meter.nonfinite_batch``),
    and whether the weights did (parameters and buffers: BatchNorm's running variance overflows while the
    loss, computed on the batch's own statistics, stays finite). Non-finite weights raise
    FloatingPointError before anything saves them, so ``path``, the checkpoint, keeps the last good
    weights; training on them would only spend the rest of the run on NaN. Finite weights after a
    non-finite loss (fp16's scaler skipped the step) are a RuntimeWarning when ``warn``, and training goes
    on. Under DDP every rank raises alike: the replicas' weights are equal. Reads the device twice: ``fit``
    calls it once an epoch and before a save after a non-finite loss."""
    at = meter.nonfinite_batch()
    where = (f"the training loss went non-finite at epoch {epoch + 1}, batch {first_batch + at + 1}/{batches}"
             if at is not None else f"in epoch {epoch + 1} (this rank's training loss stayed finite)")
    bad = nonfinite_tensors(step.raw)
    if not bad:
        if warn and at is not None:
            warnings.warn(f"{where}; the weights are finite (fp16's loss scaler skipped that step, or the loss "
                          f"alone was NaN), so training goes on", RuntimeWarning, stacklevel=user_stacklevel())
        return
    kept = f"'{path}' keeps the last save before it" if path is not None else "no checkpoint was asked for"
    raise FloatingPointError(f"{where}, and the model's weights are not finite ({_some(bad)}): stopping before "
                             f"they are saved or trained on; {kept}. Resume from there with a lower learning "
                             f"rate or clip_grad_norm, or look for a bad batch at that point")
