"""Tar shards: ``pack`` writes a source as WebDataset-layout tars with an ``index.json`` and DALI
``.idx`` files; ``index`` reads and validates that index; ``order`` derives an epoch's order over
shards from ``(seed, epoch)`` alone."""
from .index import ShardIndex, parse_index, read_index, write_dali_index
from .order import epoch_order, epoch_windows
from .pack import PackReport, pack

__all__ = ["PackReport", "ShardIndex", "epoch_order", "epoch_windows", "pack", "parse_index", "read_index",
           "write_dali_index"]
