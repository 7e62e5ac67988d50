"""``fastdata.pack(source, out)`` and ``python -m fastdata pack SOURCE OUT``: write a source as tar shards.

The shards are plain tars in the WebDataset layout: per sample ``KEY.<image ext>`` (the file's original
bytes, or a PNG of an array) and ``KEY.cls`` (the label as decimal text), KEY the zero-padded sample
index. The real ``webdataset`` package reads them, and so does DALI's ``fn.readers.webdataset`` with the
``.idx`` file written beside each tar. ``index.json`` (``fastdata.shards.index``, the format) records,
per sample, its shard and the byte range of its image, so a reader fetches one sample with one range
read. Any source packs: encoded files (an image folder, ``Shards`` to reshard or resize, a source of
your own) are read through ``read_stamped`` and ``sample_name``, as every backend reads them, and
planned through ``stamp`` (size and stamp without reading) where the source has it.

Interruptions: an ``index.json`` of another pack (another plan) is removed before any shard is
written; each shard is written to ``NAME.tar.tmp-<pid>`` and renamed when complete, then its ``.idx``
and its record ``NAME.json`` are published the same way; the index is written last, atomically. So
an interrupted re-pack leaves no index that describes other shards. Shard boundaries are planned from
the input sizes alone (a source's ``stamp(i)``: a ``stat`` per file, an archive's directory, an index;
only a source without it is read once more to learn them), so a re-run plans the same shards and
skips each one whose record matches the plan and whose tar still has the recorded size and sha256.

Parallelism: ``workers`` processes each write whole shards. Under torchrun (``WORLD_SIZE`` > 1) rank
``r`` packs shards ``r, r + world, ...`` into the same OUT (a shared file system), writes
``index.rank<r>.json``, and rank 0 merges the parts into ``index.json`` once all are there (after a
``torch.distributed`` barrier when a process group exists, else by waiting for the files), as LitData's
writer does. Every rank returns only once that index exists: after a second barrier, or, without a
process group (``torchrun -m fastdata pack`` starts none), by waiting for an ``index.json`` of this
pack (its ``plan`` digest) that lists the rank's shards as it wrote them. Files a rank refuses travel
in its part: each rank writes all its other shards first, rank 0 lists every rank's refused files in
one ``pack-refused.txt``, writes no index and says so in ``pack-refused.json`` (naming this run's
parts, so that a re-run is not misled by it), and every rank raises the same ``RefusedFiles``.

Why a room of its own, above the ``shards`` format: ``pack`` is a command that reads any source (the
datasets), its arguments (the CLI's checks) and ``as_source`` (the registry), while ``Shards`` in the
datasets reads the format. Inside ``fastdata.shards`` it made the rooms import each other in a circle.
The folder is not called ``pack``: importing a submodule ``fastdata.pack`` would replace the function
``fastdata.pack`` with the module.

Modules: ``reader`` (what is read from a source), ``writer`` (the plan, the tars and the index), ``ranks``
(how the ranks of one pack share a folder), ``command`` (the command line), ``tars`` (WebDataset tars
written by another tool, read as a source: ``pack`` converts them).
"""
from .reader import RefusedFile
from .tars import TarImages
from .writer import PackReport, RefusedFiles, pack, parse_size

__all__ = ["PackReport", "RefusedFile", "RefusedFiles", "TarImages", "pack", "parse_size"]
