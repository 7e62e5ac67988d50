"""``memory`` backend: decode once, keep the whole dataset as one uint8 tensor, augment whole batches.

After the one-time cache, an epoch is a permutation, a gather and a few tensor ops per batch — no
processes, no per-sample Python, no host-to-device copy when the cache is on the GPU (airbench's
approach). uint8 keeps the cache at a quarter of float's size: MNIST is 47 MB, 10,000 photos at a
256-px maximum side are 2 GB.

Photos for training are cached whole, as FFCV does with ``max_resolution``: each resized (aspect kept,
never enlarged) so that its longer side is at most ``cache_size``, placed top-left in a fixed
(N, cache_size, cache_size, 3) tensor, the rest zero, with its original and cached (height, width)
recorded on the host. RandomResizedCrop boxes are drawn from the ORIGINAL size by the one
``draw_params`` (the torch backend's boxes and flips, for the same seed), scaled to the cached copy,
and resampled bilinearly on the device from inside the photo's own region (its edge pixels repeat
past a box's edge, never the zero fill). The evaluation recipe (center crop) is deterministic, so it
is cached already applied: exactly the torch backend's pixels, at ``size``², whatever ``cache_size``.

Translation pads by ``Augmentation.padding`` (zeros, reflection or the edge repeated, numpy's
``np.pad`` modes, so the torch backend's pixels exactly) once, when the cache is built: a shifted crop
of a padded image is then a gather, whatever the padding.

The random parameters are drawn on the host with the same numpy code and per-batch seed as the torch
backend, so for arrays the two backends produce identical batches. They are drawn for the whole epoch
while the previous epoch runs (on a thread) and uploaded once when it starts (see
MemoryLoader.prepare_epoch and epochs.py): a batch costs one gather (its samples' shifts folded into
the gather's index), no host→device copy and no host sync.

Building a photo cache (``cache_build``): threads decode with PIL straight into the cache's rows
("threads", the CPU default: PIL's decode and resize release the GIL, and threads need no worker start-up
and no shared-memory transfer of chunks); on a CUDA device nvImageCodec decodes batches of JPEGs on the
GPU into device memory, resized there ("nvimgcodec", the default where it is installed); the DataLoader
worker processes of before remain as "processes". Measured in benchmarks/results/cache-*.md.

Budget: a cache must fit in the device's total memory minus ``memory_reserve`` (default: a quarter of a
GPU, a fifth of the host's available RAM) minus the other live memory caches of this process, and on a
GPU also in its free memory.

One cache per node: under a process group, the k ranks of a node build a photo cache together (see
MemoryLoader._decode_node): local rank j decodes the j-th k-th of the files, so each file is decoded once
per node. On the CPU they share ONE copy in a /dev/shm file every rank maps (the budget counts it once
for the node: the need is one cache, not k); on CUDA an all-gather inside the node gives each GPU its
full copy. Undecodable files are exchanged first, so every rank keeps the same ones, or every rank
raises, naming the file. Arrays are not decoded: each rank's cache is its own array, as before.
"""
# The package's rooms: budgeting.py (what a cache needs and what the device gives it), cache.py (building
# it), node.py (one cache per node), loader.py (the loader and the device recipe), epochs.py (an epoch's
# tensors, drawn ahead); the whole-photo decoders are the decode layer's (fastdata.images.whole). The
# names below are what other modules, the benchmarks and the tests read from ``fastdata.backends.memory``.
from ...images.whole import (
    MAX_CUDA_SHRINK,
    NvWholeDecoder,
    WholePhotos,
    load_whole,
    nvimgcodec,
    place,
    resize_whole,
    shrink_steps,
    whole_size,
)
from .budgeting import (
    DEFAULT_RESERVE,
    LIVE,
    Budget,
    available_ram,
    budget,
    cache_bytes,
    check_fits,
    free_bytes,
    live_cache_bytes,
    photo_side,
    ready_bytes,
    recipe,
    reserve_bytes,
    total_bytes,
    uses_ready,
)
from .cache import CACHE_BUILDS, CacheBuild, pad_images, read_ahead
from .loader import MemoryLoader
from .node import NodeCache

__all__ = ["CACHE_BUILDS", "DEFAULT_RESERVE", "LIVE", "MAX_CUDA_SHRINK", "Budget", "CacheBuild", "MemoryLoader",
           "NodeCache", "NvWholeDecoder", "WholePhotos", "available_ram", "budget", "cache_bytes", "check_fits",
           "free_bytes", "live_cache_bytes", "load_whole", "nvimgcodec", "pad_images", "photo_side", "place",
           "read_ahead", "ready_bytes", "recipe", "reserve_bytes", "resize_whole", "shrink_steps", "total_bytes",
           "uses_ready", "whole_size"]
