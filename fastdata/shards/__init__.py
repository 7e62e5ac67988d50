"""Tar shards, the format: ``index`` reads and validates ``index.json`` and writes DALI ``.idx`` files;
``storage`` reads shards from a folder or a URL; ``cache`` keeps whole shards on a node; ``order``
derives an epoch's order over shards from ``(seed, epoch)`` alone. ``fastdata.pack`` (the
``fastdata.packing`` room, above this one) writes them, and ``fastdata.datasets.Shards`` reads them."""
from .index import ShardIndex, load_index, parse_index, read_index, write_dali_index
from .order import epoch_order, epoch_windows

__all__ = ["ShardIndex", "epoch_order", "epoch_windows", "load_index", "parse_index", "read_index", "write_dali_index"]
