"""One cache per node: under a process group, the ranks of a node build a photo cache together.

``NodeCache`` is the part of ``MemoryLoader`` that shares the work: local rank j of k decodes the j-th
k-th of the files, so each file is decoded once per node. On the CPU they share ONE copy in a /dev/shm
file every rank maps (the budget counts it once for the node); on CUDA an all-gather inside the node
gives each GPU its full copy. Undecodable files are exchanged first, so every rank keeps the same ones,
or every rank raises, naming the file.
"""
from __future__ import annotations

import contextlib
import os
import warnings
import zlib
from collections.abc import Callable

import numpy as np
import torch

from ...checks import check_flag
from ...datasets import SourceKind
from ...errors import CacheDoesNotFit, DecodeError, user_stacklevel
from .budgeting import LoaderFields, check_fits, fmt_bytes


class NodeCache(LoaderFields):
    """The memory loader's node sharing (a mixin of ``MemoryLoader``): one cache per node in /dev/shm,
    built by the node's ranks together and mapped by each of them."""

    # Set by MemoryLoader (_node) and CacheBuild (_decode_into), like the fields LoaderFields declares.
    _node: tuple | None
    _decode_into: Callable[..., tuple[np.ndarray, np.ndarray]]

    # ------------------------------------------------------------------ one cache per node
    def _node_ranks(self):
        """(gloo group, local rank, local world size, data group) when this node's ranks build the cache
        together: files, ``node_cache=True``, a process group with more than one rank on this node.
        Else None.

        The exchanges (budget, skips, errors) and the waits for the slowest rank's decoding run on a
        gloo group of the node, on the host: under nccl such a wait would sit in a GPU collective under
        NCCL's watchdog, and small objects would travel through a GPU. The data group moves the cache:
        the gloo group for a host cache, the job's default backend for a CUDA cache (nccl: the
        all-gather runs GPU to GPU, entered only once every rank is known to be ready)."""
        node_cache = check_flag("memory backend: node_cache", self.opts["node_cache"])
        if not node_cache or self.source.kind is not SourceKind.FILES:
            return None
        from ... import distributed as fdist

        if not fdist.is_distributed():
            return None
        with self._collective_device():   # node_group's first call gathers over the default group
            group, local, k = fdist.node_group("gloo")
            data = fdist.node_group()[0] if self.device.type == "cuda" else group
        return (group, local, k, data) if k > 1 else None

    def _collective_device(self):
        """Object collectives on an nccl group travel through the current GPU: make it the loader's."""

        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _agree(self, step):
        """Run ``step`` on every rank of the node, then raise on every rank if it failed on any: a rank
        that raised alone would leave its peers waiting in the next collective until the process group's
        timeout (30 minutes). Returns ``step``'s result."""
        from ... import distributed as fdist

        result, mine, failure = None, None, None
        try:
            result = step()
        except Exception as e:   # noqa: BLE001 (sent to the peers, then raised again below)
            mine = e
            failure = (type(e).__name__, getattr(e, "path", None), getattr(e, "reason", None), str(e))
        failures = fdist.gather_objects(failure, self._node[0])
        if mine is not None:
            raise mine
        for j, f in enumerate(failures):
            if f is None:
                continue
            kind, path, reason, text = f
            if kind == "DecodeError" and path is not None:
                raise DecodeError(path, f"{reason} (found by local rank {j} while the node's ranks built "
                                        f"the memory cache together)")
            if kind == "CacheDoesNotFit":
                raise CacheDoesNotFit(f"on local rank {j} of this node: {text}")
            raise RuntimeError(f"local rank {j} of this node failed while the node's ranks built the "
                               f"memory cache together: {kind}: {text}")
        return result

    def _decode_node(self, decoder, n: int, s: int):
        """The node's ranks decode the cache together: local rank j of k decodes samples
        ``[j*m, (j+1)*m)`` (m = ceil(n / k)), each sample once per node, then they share the result.

        CPU: into ONE shared-memory file (``fdist.node_shared_tensor``), each rank writing its block;
        every rank maps the whole. CUDA (or no room in /dev/shm): each rank decodes its block into its
        own full-size cache, then an all-gather inside the node fills in the others' blocks (one decode
        per sample per node, one copy per GPU). Skips and errors are exchanged before anything is
        shared: every rank keeps the same files, or every rank raises, naming the file.
        """
        from ... import distributed as fdist

        if self._node is None:
            raise RuntimeError("memory backend: the node's ranks are not building the cache together (_node_ranks)")
        group, local, k, data = self._node
        m = -(-n // k)
        lo, hi = min(local * m, n), min((local + 1) * m, n)
        slot = s * s * 3
        cache: torch.Tensor | None = None
        if self.device.type == "cpu":
            tag = f"memory-{zlib.crc32(self._cache_key().encode()):08x}"
            flat, path, why = fdist.node_shared_tensor(n * slot, group, tag=tag)
            if flat is not None:
                cache, self.shared_path = flat.view(n, s, s, 3), path
            else:
                warnings.warn(f"memory backend: no shared-memory cache for this node ({why}); every rank "
                              f"keeps its own copy of the cache (still decoded once per node). Give "
                              f"/dev/shm room for {fmt_bytes(n * slot)} (docker: --shm-size) to share one",
                              RuntimeWarning, stacklevel=user_stacklevel())
                self._agree(lambda: check_fits(self.source, self.config, self.opts["memory_reserve"], copies=k,
                                                      cache_size=self.cache_size))
        shared = cache is not None
        if cache is None:
            # k blocks of m rows: all_gather's equal blocks; the last one's unused rows go with the tail.
            cache = torch.empty((k * m, s, s, 3), dtype=torch.uint8, device=self.device)
        kept, sizes = self._agree(lambda: self._decode_into(decoder, cache[local * m:local * m + hi - lo], lo, hi))
        parts = fdist.gather_objects((kept, sizes), group)
        counts = [len(p[0]) for p in parts]
        if shared:
            # Local rank 0 closes the gaps skipped files left (a no-op without skips); the others wait,
            # so that no rank reads the cache while it moves.
            if local == 0:
                fdist.compact_blocks(cache, [j * m for j in range(k)], counts)
            fdist.gather_objects(None, group)   # a barrier
        else:
            fdist.gather_blocks(cache, m, data)
            fdist.compact_blocks(cache, [j * m for j in range(k)], counts)
        kept = np.concatenate([p[0] for p in parts])
        sizes = np.concatenate([p[1] for p in parts])
        total = len(kept)
        return cache[:total] if total < cache.shape[0] else cache, kept, sizes

    def _cache_key(self) -> str:
        """The job, the source and the recipe: part of the shared file's name (tells whose it is)."""
        job = os.environ.get("TORCHELASTIC_RUN_ID") or \
            f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        return f"{job}|{self.source.fingerprint()}|{self.augment!r}|{self.cache_size}|{self.config.on_error}"

