"""The dali backend's own options (validated once, in one frozen object) and the decoder arguments they
become. The GPU decoder's defaults are the fastest values of ``benchmarks/bench_dali_gpu.py`` on an H200
(``benchmarks/results/dali-gpu-cuda-h200.md``; docs/backends.md has the table)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..checks import check_choice, check_flag, check_integer, check_number
from ..config import Padding
from ..host_memory import fmt_bytes
from .dali_outputs import DRIVER_CHOICES, HANDOVER_CHOICES

#: The ``decode`` option's values (see DaliLoader).
DECODE_CHOICES = ("auto", "host", "dali")

#: ``Augmentation.padding`` → ``fn.slice``'s out_of_bounds_policy for a translation. Not DALI's "reflect":
#: that one repeats the edge pixel (numpy's "symmetric"); numpy's, torch's and torchvision's "reflect"
#: does not, which is DALI's "reflect_101".
SLICE_POLICY = {Padding.CONSTANT: "pad", Padding.REFLECT: "reflect_101", Padding.EDGE: "edge"}

#: ``prefetch_queue_depth`` when none is given: on a GPU, 4 keeps nvJPEG and the kernels a few batches
#: ahead of a step that varies in length; on the CPU, DALI's threads share the cores with the training
#: step, and 2 (DALI's own default) hides the jitter already.
GPU_DEPTH, CPU_DEPTH = 4, 2

#: The share of free GPU memory the prefetched output batches may take before the default depth falls
#: back to CPU_DEPTH.
DEPTH_MEMORY_SHARE = 0.125

#: Per-buffer cap of the nvJPEG preallocation hints: ``host_memory_padding`` is two pinned buffers per
#: thread, so one 8000x6000 panorama must not pin gigabytes.
MAX_PADDING = 64 << 20


@dataclasses.dataclass(frozen=True)
class DaliOptions:
    """The dali backend's options, checked (``DaliLoader`` documents each). ``None`` for
    ``num_threads``, ``read_threads`` and ``prefetch_queue_depth`` means "derive it" (see ``resolve``)."""

    num_threads: int | None = None
    prefetch_queue_depth: int | None = None
    read_threads: int | None = None
    validate: bool = True
    decode: str = "auto"
    # 1.0, not DALI's 0.65: on an H200 (1,500 ImageNet-sized JPEGs, RandomResizedCrop 224, batch 64, 16
    # threads) all JPEGs on the hardware decoder gave 23.0k img/s on 4.6 cores against 16.3k on 10.7 at
    # 0.65, 1.41x (1.22x-1.52x): the CUDA/CPU half of nvJPEG's hybrid decode was the bottleneck. A GPU
    # without the hardware decoder ignores the share.
    hw_decoder_load: float = 1.0
    preallocate: bool = True
    fancy_upsampling: bool = True
    affine: bool = False
    # "stream": the consumer's CUDA stream waits for each batch, the host does not (decode.dali_outputs).
    handover: str = "stream"
    # "caller": DALI's iteration runs in the training thread's next(); "thread": in a thread of its own
    # (decode.dali_outputs.DrivenOutputs). Not yet measured on a GPU: the caller stays the default.
    driver: str = "caller"

    def __post_init__(self):
        for name in ("num_threads", "prefetch_queue_depth", "read_threads"):
            object.__setattr__(self, name, check_integer(name, getattr(self, name), minimum=1, optional=True))
        for name in ("validate", "preallocate", "fancy_upsampling", "affine"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        check_choice("decode", self.decode, DECODE_CHOICES)
        check_choice("handover", self.handover, HANDOVER_CHOICES)
        check_choice("driver", self.driver, DRIVER_CHOICES)
        # hw_decoder_load: the share of JPEG work nvJPEG's hardware decoder takes.
        object.__setattr__(self, "hw_decoder_load", check_number("hw_decoder_load", self.hw_decoder_load,
                                                                 minimum=0, maximum=1))

    def resolve(self, num_workers: int, gpu: bool, batch_bytes: int = 0, free_bytes: int | None = None):
        """The options with every derived value filled in: ``num_threads`` from the usable cores,
        ``read_threads`` from it, ``prefetch_queue_depth`` from the device (``default_depth``)."""
        threads = self.num_threads if self.num_threads is not None else max(1, num_workers)
        depth = self.prefetch_queue_depth
        if depth is None:
            depth = default_depth(gpu, batch_bytes, free_bytes)
        else:
            check_depth(depth, batch_bytes, free_bytes, "the GPU" if gpu else "the host")
        readers = self.read_threads if self.read_threads is not None else threads
        return dataclasses.replace(self, num_threads=threads, prefetch_queue_depth=depth, read_threads=readers)


def default_depth(gpu: bool, batch_bytes: int, free_bytes: int | None) -> int:
    """GPU_DEPTH batches ahead on a GPU where their outputs (``batch_bytes`` each) fit in
    DEPTH_MEMORY_SHARE of the free memory (unknown free memory: assumed to fit), else CPU_DEPTH."""
    if not gpu:
        return CPU_DEPTH
    if free_bytes is not None and GPU_DEPTH * batch_bytes > DEPTH_MEMORY_SHARE * free_bytes:
        return CPU_DEPTH
    return GPU_DEPTH


def check_depth(depth: int, batch_bytes: int, free_bytes: int | None, where: str) -> None:
    """Refuse a ``prefetch_queue_depth`` whose output batches alone (``batch_bytes`` each) cannot fit in
    ``where``'s free memory (None: unknown, not checked).

    Why: DALI fills its whole queue before it hands out the first batch, allocating every slot's
    buffers as it goes. Measured on the CPU (64 digits a batch, 200 KB of outputs): a depth of 10,000
    took 49 s and 3.9 GB before the first batch (a slot holds more than its outputs); 100,000 and 10**9
    had given nothing after a minute, with no error. Only what cannot fit is refused: the outputs are
    a lower bound of a slot's memory."""
    if free_bytes is None or batch_bytes <= 0 or depth * batch_bytes <= free_bytes:
        return
    most = free_bytes // batch_bytes
    fits = f"at most {most} fit" if most else "not one fits: make the batches smaller"
    raise ValueError(f"prefetch_queue_depth={depth} keeps {depth} output batches of {fmt_bytes(batch_bytes)} each "
                     f"({fmt_bytes(depth * batch_bytes)}) ahead, more than the {fmt_bytes(free_bytes)} free on "
                     f"{where}: {fits}. DALI prepares every one before the first batch; a few hide the step's "
                     f"jitter (unset, the depth is {GPU_DEPTH} on a GPU, {CPU_DEPTH} on the CPU)")


def files_decoder(gpu: bool) -> tuple[str, dict]:
    """The photo decoder of the in-pipeline files path (``decode="dali"``): the ``fn.decoders``
    operator's name and its keyword arguments (besides the inputs, ``output_type`` and the tuning
    options of ``decoder_tuning``).

    ``"image_slice"`` (the CPU) decodes a window around the crop box, given as (anchor, shape) inputs:
    libjpeg-turbo never reads the rows below it. ``"image"`` (a GPU) decodes whole photos, and the crop
    box is then ``fn.resize``'s ROI in the photo's own coordinates. Why not a region decode on the GPU:
    nvImageCodec 0.9's nvJPEG extension (with nvJPEG 12.x) refuses a region decode with
    ``jpeg_fancy_upsampling`` for chroma-subsampled JPEGs, nearly every photo ("ROI decode with fancy
    upsampling may produce wrong results on image edge ... with nvJPEG < 13.2", in libnvjpeg_ext.so),
    and DALI quietly decodes those on its CPU fallback: the pixels were right and every test passed,
    but the GPU's decoding speed was gone. Without fancy upsampling nvJPEG's chroma differs from
    libjpeg-turbo's (PIL, the other backends) by tens of levels along colour edges.
    """
    if gpu:
        return "image", {"device": "mixed", "jpeg_fancy_upsampling": True}
    # jpeg_fancy_upsampling: DALI 2.4 documents it for the mixed backend only; the CPU decoder
    # upsamples so already (measured: same pixels, same speed). Kept for symmetry with the GPU.
    return "image_slice", {"device": "cpu", "axis_names": "HW", "normalized_anchor": False,
                           "normalized_shape": False, "jpeg_fancy_upsampling": True}


def decoder_tuning(opts: DaliOptions, dims: np.ndarray | None) -> dict:
    """The decoder's tuning arguments from the options (DALI 2.4's ``fn.decoders.image`` schema; the
    CPU decoder accepts and ignores the mixed-only ones). ``dims``: (height, width[, EXIF orientation])
    of the photos known when the pipeline is built, for ``preallocate``'s hints (none known: DALI's
    defaults)."""
    kw = {"hw_decoder_load": opts.hw_decoder_load, "affine": opts.affine,
          "jpeg_fancy_upsampling": opts.fancy_upsampling}
    if opts.preallocate:
        kw.update(nvjpeg_hints(dims))
    return kw


def nvjpeg_hints(dims: np.ndarray | None) -> dict:
    """nvJPEG's buffer sizes from the largest known photo, so that it does not reallocate mid-epoch.

    ``device_memory_padding`` (one device buffer per thread) and ``host_memory_padding`` (two pinned
    host buffers per thread) hold a decoded photo (3 bytes a pixel; the host side's Huffman output for
    4:2:0 is 1.5 coefficients of 2 bytes a pixel, the same), rounded up to a MiB and capped at
    MAX_PADDING; ``preallocate_{height,width}_hint`` size the hardware decoder's buffers. Below DALI's
    defaults (16/8 MiB), the defaults are kept: they cost little and cover a photo read later.

    ``dims`` are (height, width) as the photos are shown, with their EXIF orientation as a third column
    where known (the loader's ``_dims``): the hardware decoder's buffers hold the picture as it is
    encoded, before DALI turns it, so a photo turned by 90 degrees (orientations 5-8) counts with its
    height and width swapped. Without that, a batch of portrait phone photos (encoded landscape, turned
    by their EXIF block) hinted buffers too narrow for every one of them.
    """
    if dims is None or not len(dims):
        return {}
    dims = np.asarray(dims)
    heights, widths = dims[:, 0], dims[:, 1]
    if dims.shape[1] > 2:
        turned = dims[:, 2] >= 5
        heights, widths = np.where(turned, widths, heights), np.where(turned, heights, widths)
    height, width = int(heights.max()), int(widths.max())
    need = min(MAX_PADDING, math.ceil(3 * height * width / (1 << 20)) << 20)
    return {"preallocate_height_hint": height, "preallocate_width_hint": width,
            "device_memory_padding": max(16 << 20, need), "host_memory_padding": max(8 << 20, need)}


def slice_has_policy(policy: str) -> bool:
    """Whether the installed DALI's ``fn.slice`` knows ``out_of_bounds_policy=policy``. "edge" and
    "reflect_101" came with DALI's slice border modes (2.4 has them); older releases know only
    error/pad/trim_to_shape and would refuse the pipeline. Read from the operator's schema, which lists
    the values it parses."""
    from nvidia.dali import backend

    # DALI's backend.pyi stub leaves out GetSchema, which backend_impl (the C++ module) exports.
    schema = backend.GetSchema("Slice")  # type: ignore[attr-defined]
    return f'"{policy}"' in schema.GetArgumentDox("out_of_bounds_policy")
