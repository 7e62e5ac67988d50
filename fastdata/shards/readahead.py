"""The read-ahead of a ``Shards`` source over a remote location: a thread of the loader's process that
fetches the shards a pass reads next into the per-node cache (``shards.cache``), and retires there the
shards the pass is done with.

Why it counts the batches in flight: a loader's readers run ahead of the position it tells the source
(DataLoader workers by ``num_workers x prefetch_factor`` batches, dali's feeder and DALI's queue by about
twice its depth), and the loader says how far (``Shards.plan_in_flight``). Keyed to the training step's
position alone, the read-ahead fetched shards the readers had read and released already (downloading
them again once evicted); and the cache, evicting the least recently used, took shards fetched ahead
and not read yet (stamped when fetched) before shards the pass had finished (stamped at their last
read). Either way a shard was downloaded twice in one pass. So:

- the shards with a sample in ``[position, position + in flight)`` and not yet handed out are the ones
  the readers may be reading; the next ``window`` shards after them are fetched ahead, but only as far
  as the cache's budget holds them together with the readers' ones, never further;
- a shard all of whose samples are handed out is retired (``ShardCache.retire``): the next download
  evicts it before any other, whichever process downloads (a DataLoader worker knows no position);
  but for the shards of even_batches' padding (``Shards.reading``'s ``padding``): the pass's last step
  reads the epoch's first samples again, and, retired, their shards were downloaded again at the end
  of every pass. They stay cached as released shards (least recently used first), and are fetched
  again as the last step comes within the readers' reach if evicted meanwhile. Not counted in the
  room the readers need (``_room_needed``): nobody reads them in between.

Together: at any moment the shards the pass still needs and has touched fit in the budget, and room is
made from finished shards, so no shard is downloaded twice in a pass, as long as the readers' shards
alone fit. Where they do not (the readers many shards ahead of a small cache), shards are downloaded
again whatever is evicted: that is said once, with the bytes it takes.
"""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np

from fastdata.errors import user_stacklevel
from fastdata.shards.cache import ShardCache, human_bytes

__all__ = ["ReadAhead"]

_NONE = np.zeros(0, dtype=np.int64)
#: The tag of a padding shard in the read-ahead's list (besides this pass's False and the next epoch's
#: True): fetched at the pass's start, it is tried once more for its last step.
_PADDING = "padding"


class ReadAhead:
    """Fetches the shards a pass reads next into ``cache``, ahead of the readers, on its own thread.

    Each shard is taken and released at once (``get`` then ``release``): held by nobody, it stays in the
    cache until the readers (worker processes) take it. ``want`` is told where the pass is.

    Args:
        cache: the source's ``ShardCache``.
        index: the source's ``ShardIndex``.
        ids: the source's sample ids into the index (a subset's own).
        window: shards fetched ahead of the readers' (the source's window).
        where: the source's location, as its messages show it.
    """

    def __init__(self, cache: ShardCache, index, ids: np.ndarray, window: int, where: str = ""):
        self.cache, self.index, self.ids, self.ahead, self.where = cache, index, ids, window, where
        self.names = [s.name for s in index.shards]
        self.sizes = np.array([int(s.size) for s in index.shards], dtype=np.int64)
        self._cond = threading.Condition()
        # (shard name, for the next epoch?): a shard this pass fetched early on and has since evicted
        # is fetched again when the next epoch starts with it.
        self._wanted: list[tuple[str, bool | str]] = []   # or _PADDING: a padding shard for the last step
        self._window: set[str] = set()   # every shard the last want() asked for, fetched or not
        self._done: set[tuple[str, bool | str]] = set()
        # The pass's order, held: compared by id() alone, a freed order's id was taken by the next
        # epoch's (same size, same address), which then read as the same pass. And where it is.
        self._order: np.ndarray | None = None
        self._position = 0
        # The pass's shards in the order it first reads them, the position of each one's first and last
        # sample, and whether it is retired.
        self._sequence, self._first, self._last = _NONE, _NONE, _NONE
        self._retired = np.zeros(0, dtype=bool)
        self._next: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None   # the next epoch's, likewise
        self._stop = False
        self.warned = False   # said once that shards are downloaded twice in a pass
        self._need = 0        # the most bytes of shards the readers may read at once in this pass
        self._seen: dict[str, int] = {}   # the downloads of each shard the pass's readers need, at most
        self._claimed: set[str] = set()   # the shards this pass has wanted (un-retired once each)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fastdata-shards", daemon=True)
        self._thread.start()

    def want(self, order: np.ndarray, position: int, next_order=None, reach: tuple[int, int] = (0, 0),
             lag: int = 0, padding: int = 0) -> None:
        """The pass reads ``order`` and has handed out ``position`` samples; its readers may be reading the
        samples from ``reach[0]`` to ``reach[1]`` past it (at least the next one; see
        ``Shards.plan_in_flight``). ``next_order``: a callable giving the next epoch's order, whose first
        shards are fetched while this pass ends. ``lag``: samples before the position that other ranks'
        readers may still be reading (one global batch: a rank tells its position once it has handed out
        its own share of a batch, when another rank's workers may still read theirs); shards are retired
        only past it. ``padding``: the pass's last step reads ``order[:padding]`` again, as if at the
        positions after the order's end (even_batches); their shards are never retired in the pass."""
        new_pass = order is not self._order or position < self._position   # a new pass, or one started again
        self._position = position
        # The first ``reach[0]`` samples count as read (dali's decoded queue) once the pass runs, not as it
        # starts: a fresh pipeline (the first pass, a resume, set_epoch, ranks starting together) has read
        # nothing yet, and its first shards, cached already, were retired unread and evicted first.
        lo, hi = position + (0 if new_pass else reach[0]), position + max(reach[1], reach[0] + 1)
        n = len(order)
        if new_pass:
            self._sequence, self._first, self._last = self._shard_sequence(order)
            self._retired = np.zeros(len(self._sequence), dtype=bool)
            self._order, self._next = order, None
            self._need, self._seen, self._claimed = self._room_needed(n, reach), {}, set()
        started = int(np.searchsorted(self._first, min(hi, n)))   # first read before hi
        # Being read: by this process's readers, or by another rank's, up to ``lag`` behind (not retired
        # until past it). Counted in the window's room: the read-ahead fetched past another rank's shard,
        # which was then evicted under it (two ranks at the smallest cache: 9-11 of 17 shards twice a pass).
        reading = [(self.names[int(s)], False) for s in self._sequence[:started][self._last[:started] >= lo - lag]]
        ahead = [(self.names[int(s)], False) for s in self._sequence[started: started + self.ahead]]
        self._watch([name for name, _ in reading], reach)
        if padding:   # not watched: at a small cache they may be evicted while nobody reads them
            reading, ahead = self._padding_shards(order, (lo - n, hi - n), min(padding, n), reading, ahead)
        if next_order is not None and (hi > n or len(ahead) < self.ahead):
            more_reading, more_ahead = self._next_start(next_order, (lo - n, hi - n), self.ahead - len(ahead),
                                                        {name for name, _ in reading + ahead})
            reading, ahead = reading + more_reading, ahead + more_ahead
        kept = int(np.searchsorted(self._first, min(padding, n)))   # the padding's shards: the pass's first
        wanted, keep = self._within_budget(reading, ahead, self._kept_bytes(kept, {n for n, _ in reading + ahead}))
        self._claim(reading + wanted)
        # Finished: read, as far as the loader knows (before reach[0]; handed out, for readers whose batches
        # may come back in any order). Retired, they make room before any shard fetched ahead, which,
        # fetched before their last read, was less recently used than they.
        finished = self._last[:started] < lo - lag
        if keep:
            finished[:kept] = False
        self._retire(started, finished, {name for name, _ in wanted})
        with self._cond:   # the thread takes the pass's set with its shard, under this lock
            if new_pass:
                self._done = set()
            self._wanted = [n for n in wanted if n not in self._done]
            self._window = {name for name, _ in wanted}
            self._cond.notify()

    def _shard_sequence(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shards in the order ``order`` first reads them, the position of each one's first sample, and
        of its last)."""
        shards = self.index.shard[self.ids[np.asarray(order, dtype=np.int64)]]
        _, first = np.unique(shards, return_index=True)
        _, from_end = np.unique(shards[::-1], return_index=True)   # the same shards, in the same order
        keep = np.argsort(first, kind="stable")
        return shards[first[keep]], first[keep], (len(shards) - 1 - from_end)[keep]

    def _next_start(self, next_order, reach: tuple[int, int], room: int, have: set) -> tuple[list, list]:
        """The next epoch's shards the readers may be reading already (its samples ``reach[0]`` to
        ``reach[1]``: a stream that runs on into the next epoch, as dali's does) and the ``room`` after
        them, fetched while this pass ends; none already in ``have``."""
        if self._next is None:
            upcoming = next_order()
            self._next = self._shard_sequence(upcoming) if upcoming is not None else (_NONE, _NONE, _NONE)
        sequence, first, last = self._next
        k = int(np.searchsorted(first, reach[1])) if reach[1] > 0 else 0
        reading = [(self.names[int(s)], True) for s in sequence[:k][last[:k] >= reach[0]]
                   if self.names[int(s)] not in have]
        ahead: list[tuple[str, bool]] = []
        for s in sequence[k:]:
            if len(ahead) >= room:
                break
            if self.names[int(s)] not in have:
                ahead.append((self.names[int(s)], True))
        return reading, ahead

    def _padding_shards(self, order: np.ndarray, reach: tuple[int, int], padding: int, reading: list,
                        ahead: list) -> tuple[list, list]:
        """``reading`` and ``ahead`` with the shards of the padding ``order[:padding]``, which the last step
        reads as if at the positions after the order's end: those the readers may be reading (samples
        ``reach[0]`` to ``reach[1]`` past the end), or all of them ahead once the pass is in its last
        window of shards; none twice."""
        have = {name for name, _ in reading + ahead}
        if reach[1] > 0:
            part, into = order[max(reach[0], 0):min(reach[1], padding)], reading
        elif len(ahead) < self.ahead:
            part, into = order[:padding], ahead
        else:
            return reading, ahead
        more = [(self.names[int(s)], _PADDING) for s in self._shard_sequence(part)[0]
                if self.names[int(s)] not in have]
        return (reading + more, ahead) if into is reading else (reading, ahead + more)

    def _kept_bytes(self, kept: int, wanted: set) -> int:
        """The bytes the padding's shards (the pass's first ``kept``) take in the cache, kept for the last
        step: those cached, not retired, and not among the shards ``wanted`` now (counted there)."""
        names = [self.names[int(s)] for j, s in enumerate(self._sequence[:kept]) if not self._retired[j]]
        return sum(self.cache.expected_sizes[name] for name in names
                   if name not in wanted and os.path.exists(self.cache.path(name)))

    def _within_budget(self, reading: list, ahead: list, kept: int = 0) -> tuple[list, bool]:
        """(``reading``, then as much of ``ahead`` as the cache holds with them: a shard fetched past that
        evicts one the readers have not finished; whether the ``kept`` bytes of the padding's shards fit
        with ``reading`` too, and are kept). Nothing where ``reading`` alone is more than the cache
        holds: the readers then fetch what they read, and any shard fetched
        for them early evicted the one they were on (more downloads than none). The padding's shards,
        more recently used than shards fetched ahead, would be evicted after them: they take the
        window's room while they fit with ``reading``; where they do not, they are retired (evicted
        first) and fetched again for the last step."""
        limit, size = self.cache.limit_bytes, self.cache.expected_sizes
        total = sum(size[name] for name, _ in reading)
        if total > limit:
            return [], False
        keep = total + kept <= limit
        total += kept if keep else 0
        wanted = list(reading)
        for name, upcoming in ahead:
            if total + size[name] > limit:
                break
            total += size[name]
            wanted.append((name, upcoming))
        return wanted, keep

    def _claim(self, wanted: list) -> None:
        """Once a pass, each shard it wants is claimed (``ShardCache.claim``): a copy an earlier pass
        retired, cached still, is stamped used now (``shards.stamps``)."""
        for name, _ in wanted:
            if name not in self._claimed:
                self._claimed.add(name)
                self.cache.claim(name)

    def _retire(self, started: int, finished: np.ndarray, keep: set) -> None:
        """Retire the ``finished`` ones of the pass's first ``started`` shards, once a pass, but for those
        wanted again (the next epoch's first ones)."""
        finished = np.flatnonzero(finished & ~self._retired[:started])
        for j in finished.tolist():
            name = self.names[int(self._sequence[j])]
            if name in keep:
                continue
            try:
                # Not stamped while this process holds it (its release stamps it used): tried again later.
                self._retired[j] = self.cache.retire(name)
            except OSError:   # only an eviction hint: the cache works without it
                self._retired[j] = True

    def _room_needed(self, n: int, reach: tuple[int, int]) -> int:
        """The most bytes of shards the readers may be reading at once over this pass's order: shard j
        is one of them at every position from its first sample less ``reach[1]`` to its last less
        ``reach[0]``."""
        if not len(self._sequence):
            return 0
        sizes = self.sizes[self._sequence]
        change = np.zeros(n + 1, dtype=np.int64)
        np.add.at(change, np.clip(self._first - max(reach[1], reach[0] + 1) + 1, 0, n), sizes)
        np.add.at(change, np.clip(self._last - reach[0] + 1, 0, n), -sizes)
        return int(np.cumsum(change[:n]).max())

    def _watch(self, names: list, reach: tuple[int, int]) -> None:
        """Say once that shards are downloaded twice in a pass: one the readers may be reading is
        downloaded again after it was in the cache for them (``ShardCache.downloads``, counted by any
        process). Seen, not predicted: dali's readers read one batch at a time somewhere in their reach,
        and a cache smaller than all of it serves them without a second download."""
        if self.warned:
            return
        for name in names:
            if name not in self._seen:
                # Cached already: any download from now on is a second one; not yet: its first is next.
                cached = os.path.exists(self.cache.path(name))
                self._seen[name] = self.cache.downloads(name) + (not cached)
            elif self.cache.downloads(name) > self._seen[name]:
                self.warned = True
                self._warn(self._need, reach)
                return

    def _warn(self, need: int, reach: tuple[int, int]) -> None:
        limit, window = self.cache.limit_bytes, int(np.sort(self.sizes)[::-1][:self.ahead].sum())
        said = f"Shards '{self.where}': shards are downloaded again within a pass, with cache_limit={limit} " \
               f"({human_bytes(limit)})"
        told = (f"the samples {reach[0]} to {reach[1]} past the batch the training step takes (plan_in_flight)"
                if reach[1] else "the next sample (the loader did not say how far its readers run ahead: "
                                 "plan_in_flight)")
        if need > limit:
            said += (f": the loader's readers may be reading {told}, which in this epoch's order lie in shards "
                     f"of up to {need} bytes ({human_bytes(need)}) at once. Give cache_limit at least {need} "
                     f"bytes, {need + window} ({human_bytes(need + window)}) to fetch the next window="
                     f"{self.ahead} ahead too; or read fewer batches ahead (num_workers x prefetch_factor, "
                     f"dali's prefetch_queue_depth), smaller batches or a smaller window")
        else:
            said += (f", which holds the shards of {told}: the readers run further ahead than the loader said, "
                     f"or other processes read other shards through the same cache_dir. Give cache_limit room "
                     f"for more shards ({limit + window} bytes, {human_bytes(limit + window)}, holds a window "
                     f"more)")
        warnings.warn(said, RuntimeWarning, stacklevel=user_stacklevel())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._wanted:
                    self._cond.wait()
                if self._stop:
                    return
                name, upcoming = self._wanted.pop(0)
                # The pass this shard was asked for: a new pass may start while it is fetched (set_epoch,
                # load_state_dict, iter() mid-pass), and it has its own set, which this shard must not
                # enter (a shard given up here would never be fetched ahead in the new pass).
                done = self._done
            try:
                # Given up once the pass has gone past it: waiting on another process (downloading it,
                # or holding it shared), this thread downloaded it again after the readers had read it
                # and it was evicted, evicting the shards they were about to read in its place. And at
                # stop(): close() (or exit) waited up to a minute for another rank's download.
                if self.cache.get(name, remember_failure=False,
                                  wanted=lambda n=name: not self._stop and n in self._window) is not None:
                    self.cache.release(name)
            except Exception as e:   # the reader's own get() retries and raises it, naming the shard
                self.error = e
            # Tried once a pass, fetched or not: a shard that failed is not tried again at every batch,
            # which kept this thread on it instead of fetching the shards after it.
            done.add((name, upcoming))

    def stop(self) -> None:
        """End the thread: it finishes a download of its own in progress (bounded by the storage's timeout),
        gives up a wait for another process's, and returns. Not joined from the thread itself: a source
        collected there stops it from there."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
