"""Whole-photo decoders: each photo decoded whole, shrunk so that its longer side is at most ``side``.

What the memory backend's training cache holds (see ``fastdata.backends.memory``): ``load_whole`` (PIL,
``Image.draft`` for JPEGs that allow it), ``WholePhotos`` (files into cache rows, on the host, for
threads or DataLoader workers) and ``NvWholeDecoder`` (nvImageCodec in batches: nvJPEG on a GPU into
device memory, resized there by ``resize_whole``; its libjpeg-turbo backend on the CPU). Files that do
not decode go through the loader's ``OnError``: raised, or skipped and reported by the rows kept.
"""
from __future__ import annotations

import io
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..errors import DecodeError
from ..images.photo import (
    JPEG_FORMATS,
    check_scans,
    decode_upright,
    exif_orientation,
    may_hold_jpeg,
    open_image,
)
from .on_error import OnError
from .region import jpeg_orientation


def load_whole(data: bytes, path, side: int) -> tuple[np.ndarray, int, int]:
    """One photo, whole, as uint8 (h, w, 3) with its longer side at most ``side`` (aspect kept; a
    smaller photo is kept as it is), and its original (H, W) after EXIF orientation, the size the
    recipe's boxes are drawn from. ``data``: the file's bytes (``Source.read``); ``path`` names it.
    Errors are the DecodeErrors ``images.photo.load_photo`` raises.

    JPEGs decode at a reduced scale (``Image.draft``) when the target allows; the drafted image is
    resized from the exact region that covers the original (drafted sizes round up to whole blocks).
    """
    from PIL import Image

    img = open_image(path, io.BytesIO(data))
    try:
        orientation = exif_orientation(img, path)
        swap = orientation in (5, 6, 7, 8)
        stored_w = img.width
        W, H = (img.height, img.width) if swap else img.size
        h, w = whole_size(H, W, side)
        if (h, w) != (H, W) and img.format in JPEG_FORMATS:
            img.draft("RGB", (h, w) if swap else (w, h))   # draft works in stored orientation
        reduction = 2 ** round(math.log2(stored_w / img.width)) if img.width < stored_w else 1
        img = decode_upright(img, path, orientation)
        if img.size != (w, h):
            img = img.resize((w, h), Image.Resampling.BILINEAR, box=(0, 0, W / reduction, H / reduction))
        return np.asarray(img), H, W
    finally:
        img.close()


class WholePhotos(Dataset):
    """A DataLoader "dataset" of cache chunks: job ``ids`` → ``(uint8 (k, side, side, 3), each photo
    top-left and zero around it; int64 (k, 4) (H, W, h, w): original and cached sizes; kept ids)``.
    Files that fail are skipped with ``on_error="skip"`` (the ids kept say which)."""

    def __init__(self, source, side: int, on_error: str | OnError = "raise"):
        self.source, self.side, self.on_error = source, side, OnError(on_error)

    def __len__(self):  # jobs come from the sampler; a length keeps DataLoader's bookkeeping happy
        return len(self.source)

    def __getitem__(self, ids):
        s = self.side
        out = torch.empty((len(ids), s, s, 3), dtype=torch.uint8)
        sizes = np.zeros((len(ids), 4), dtype=np.int64)
        ok = self.decode_rows(ids, out, sizes)
        kept = [int(i) for i in np.asarray(ids)[ok]]
        # The kept photos first, in order (a no-op without skips): the chunk's rows are contiguous.
        good = torch.from_numpy(np.flatnonzero(ok))
        return out[good] if len(kept) < len(ids) else out, torch.from_numpy(sizes[ok]), kept

    def decode_rows(self, ids, rows: torch.Tensor, sizes: np.ndarray) -> np.ndarray:
        """Decode files ``ids`` straight into ``rows`` (uint8 (k, side, side, 3) on the CPU, e.g. the
        cache's own rows): each photo top-left, zeros around it, and its (H, W, h, w) into ``sizes``
        (int64 (k, 4)). Returns a bool (k,): which decoded; a skipped file's row is left as it was
        (on_error="skip"), a DecodeError propagates with on_error="raise"."""
        ok = np.zeros(len(ids), dtype=bool)
        out = rows.numpy()   # numpy's copies into a slot's sub-rectangle: far cheaper than torch's
        for j, i in enumerate(ids):
            got = self.on_error.attempt(self.photo, i)
            if got is None:
                continue
            arr, H, W = got
            h, w = arr.shape[:2]
            place(out[j], arr)
            sizes[j] = (H, W, h, w)
            ok[j] = True
        return ok


    def photo(self, i, data: bytes | None = None) -> tuple[np.ndarray, int, int]:
        """Sample ``i`` decoded whole (``load_whole``) from ``data``, its bytes already read, or else
        read here."""
        return load_whole(self.source.read(i) if data is None else data, self.source.sample_name(i), self.side)


def place(row: np.ndarray | torch.Tensor, arr: np.ndarray | torch.Tensor) -> None:
    """Write a (h, w, 3) photo top-left into a cache slot (s, s, 3) and zero the rest of it: the slot
    is written once, with no zeroed temporary (rows of a fresh cache are whatever memory held). Both
    numpy arrays (CPU rows) or both tensors (rows on the GPU)."""
    h, w = arr.shape[:2]
    # torch's stub types a tensor's item assignment as taking a Tensor or a number, yet torch copies an
    # ndarray in too; numpy takes a CPU tensor through __array__.
    row[:h, :w] = arr  # type: ignore[assignment]
    row[:h, w:] = 0
    row[h:] = 0



def upright(t: np.ndarray | torch.Tensor, orientation: int) -> np.ndarray | torch.Tensor:
    """A decoded (H, W, C) photo as stored → as displayed under EXIF ``orientation`` (1..8): Pillow's
    ``exif_transpose`` (2 mirror, 3 half turn, 4 flip, 5 transpose, 6 quarter turn clockwise, 7
    transverse, 8 counterclockwise) as a transpose then flips. numpy: a view; torch: a copy where it
    turns (exact either way: whole pixels move)."""
    if orientation in (5, 6, 7, 8):
        t = t.transpose(1, 0, 2) if isinstance(t, np.ndarray) else t.permute(1, 0, 2)
    dims = [d for d, flips in ((1, (2, 3, 6, 7)), (0, (3, 4, 7, 8))) if orientation in flips]
    if isinstance(t, np.ndarray):
        for d in dims:
            t = np.flip(t, d)
        return t
    return torch.flip(t, dims) if dims else t


def nvimgcodec():
    """nvImageCodec's module, or None where it is not installed (it comes with DALI)."""
    try:
        from nvidia import nvimgcodec  # optional
    except Exception:   # ImportError, or a broken install's missing shared library
        return None
    return nvimgcodec


def whole_size(H: int, W: int, side: int) -> tuple[int, int]:
    """(h, w) of a photo (H, W) cached whole: aspect kept, longer side at most ``side``, never enlarged."""
    r = min(1.0, side / max(H, W))
    return max(1, round(H * r)), max(1, round(W * r))


#: The largest shrink per axis one antialiased ``F.interpolate`` does on CUDA (``resize_whole``): its
#: kernel keeps each output pixel's filter weights in shared memory, and past ~94x per axis it fails
#: with "Too much shared memory required" (a 30,000-px panorama cached at 256). 16x leaves a wide margin.
MAX_CUDA_SHRINK = 16


def shrink_steps(src: tuple[int, int], dst: tuple[int, int], max_shrink: int | None) -> list[tuple[int, int]]:
    """The sizes an antialiased resize from ``src`` (h, w) to ``dst`` passes through, ``dst`` last: each
    step shrinks an axis by at most ``max_shrink`` (None: one step). Intermediate sizes are the
    largest such shrinks (ceil(size / max_shrink)), so the last step does what is left."""
    if max_shrink is None or max_shrink < 2:
        return [(dst[0], dst[1])]
    target = (dst[0], dst[1])
    steps: list[tuple[int, int]] = []
    cur = (src[0], src[1])
    while True:
        nxt = (max(target[0], -(-cur[0] // max_shrink)), max(target[1], -(-cur[1] // max_shrink)))
        if nxt == target or nxt == cur:
            steps.append(target)
            return steps
        steps.append(nxt)
        cur = nxt


def resize_whole(t: torch.Tensor, side: int, *, via_float: bool | None = None,
                 max_shrink: int | None = None) -> torch.Tensor:
    """uint8 (H, W, 3) → uint8 (h, w, 3) at ``whole_size``, on t's device, bilinear with antialiasing:
    PIL's BILINEAR filter (a triangle widened by the reduction). On the CPU torch resizes uint8 directly,
    with PIL's integer arithmetic: PIL's pixels exactly (tested). On CUDA it resizes in float and rounds
    (``via_float``, its default there: the uint8 path measured here is the CPU kernel's), within 1 of
    PIL's pixels (tested on the CPU with via_float=True).

    ``max_shrink`` (default on CUDA: ``MAX_CUDA_SHRINK``; the CPU has no such limit) splits a larger
    shrink into steps (``shrink_steps``), in float without rounding between them: close to one step's
    pixels (a slightly wider filter), where one step would abort the whole cache build."""
    H, W = t.shape[:2]
    h, w = whole_size(H, W, side)
    if (h, w) == (H, W):
        return t
    via_float = t.is_cuda if via_float is None else via_float
    steps = shrink_steps((H, W), (h, w), MAX_CUDA_SHRINK if max_shrink is None and t.is_cuda else max_shrink)
    x = t.permute(2, 0, 1)[None]
    if not via_float and len(steps) == 1:
        return F.interpolate(x, size=(h, w), mode="bilinear", antialias=True, align_corners=False)[0].permute(1, 2, 0)
    y = x.float()
    for size in steps:
        y = F.interpolate(y, size=size, mode="bilinear", antialias=True, align_corners=False)
    return y[0].round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0)



class NvWholeDecoder:
    """Whole photos decoded by nvImageCodec in batches, written into cache rows (``WholePhotos``'s
    ``decode_rows``, for ``cache_build="nvimgcodec"``).

    On CUDA: one batch call decodes the JPEGs on the loader's GPU (hardware decoder or nvJPEG,
    whichever nvImageCodec picks) into device memory, where each photo is resized (``resize_whole``) and
    written into its row: no decoded pixel crosses PCIe. On the CPU: nvImageCodec's CPU (libjpeg-turbo)
    backend decodes the photos smaller than twice the cached side (the larger ones PIL decodes at a
    reduced scale, see ``load_whole``), PIL resizes: the "threads" build's pixels exactly (tested).
    EXIF orientation is fastdata's reading of the block (``region.jpeg_orientation``, Pillow's), applied
    to the photo decoded as stored (``upright``), not the decoder's own: on a malformed block the two
    disagree and the photo was cached turned otherwise than every other build caches it; a block the
    header walk cannot vouch for goes to PIL. Anything it does not take (not a JPEG, CMYK, 16-bit,
    beyond the decompression-bomb limit, unreadable, or failing to decode) goes through ``load_whole``
    instead: the "threads" build's pixels for those files, and the same DecodeError naming a broken one.

    Args:
        photos: the ``WholePhotos`` (source, side, on_error).
        device: where the rows are (the loader's device).
    """

    #: Files per job: enough to fill the GPU decoder's batch.
    batch = 64
    #: Decoded bytes per decode call at most: 64 ImageNet photos take ~35 MB, 64 12-megapixel photos
    #: would take 2.3 GB of the GPU the cache lives on, so calls are split by the headers' sizes.
    max_call_bytes = 256 * 2**20

    def _groups(self, streams) -> list[list[int]]:
        """Indices into ``streams`` in consecutive groups of at most ``max_call_bytes`` decoded (a photo
        larger than that alone)."""
        groups: list[list[int]] = []
        size = 0
        for k, cs in enumerate(streams):
            nbytes = cs.width * cs.height * 3
            if groups and size + nbytes <= self.max_call_bytes:
                groups[-1].append(k)
                size += nbytes
            else:
                groups.append([k])
                size = nbytes
        return groups

    def __init__(self, photos: WholePhotos, device: torch.device):
        nv = nvimgcodec()
        if nv is None:
            from ..images.region import INSTALL_HINT

            raise ImportError(f"memory backend: cache_build='nvimgcodec' needs nvImageCodec; {INSTALL_HINT}")
        self.nv, self.photos, self.device = nv, photos, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            # Every backend allowed: the hardware JPEG decoder (A100/H100), nvJPEG on CUDA, and the CPU
            # for what they refuse; output on this GPU.
            self.decoder = nv.Decoder(device_id=index)
        else:
            # fancy_upsampling: libjpeg's (and Pillow's) default chroma upsampling, set explicitly.
            self.decoder = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                      backends=[nv.Backend(nv.BackendKind.CPU_ONLY)],
                                      options="libjpeg_turbo_decoder:fancy_upsampling=1")
        self.params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB,
                                      sample_format=nv.SampleFormat.I_RGB)
        #: CUDA: the last group's decoded photos and the event after the GPU work that reads them (see
        #: _release), kept while the next group is decoded.
        self._held: tuple[list, torch.cuda.Event] | None = None

    def read(self, ids) -> list:
        """The files' bytes (None for one that cannot be read: ``load_whole`` then names the problem):
        the host's part of ``decode_rows``, which a caller may do ahead on another thread."""
        source, out = self.photos.source, []
        for i in ids:
            try:
                out.append(source.read(i))
            except DecodeError:
                out.append(None)
        return out

    def _stream(self, data, name=None):
        """(nvImageCodec's parsed header of a file's bytes, its EXIF orientation as Pillow reads it), or
        None when it is not one it should decode. ``name``: the file's, whose ending must allow JPEG
        data (``open_image`` refuses a JPEG named .png; ``load_whole`` names it); None: not checked."""
        from PIL import Image

        if data is None or (name is not None and not may_hold_jpeg(name)):
            return None
        orientation = jpeg_orientation(data)
        if orientation is None:   # not a JPEG, or a block only Pillow can read as Pillow does
            return None
        try:
            check_scans(name, data)   # a decoding pass per scan, in nvImageCodec as in libjpeg
        except DecodeError:
            return None           # load_whole's open_image names it
        try:
            cs = self.nv.CodeStream(data)
            limit = Image.MAX_IMAGE_PIXELS
            ok = (cs.codec_name == "jpeg" and cs.num_channels in (1, 3) and cs.precision == 8
                  and not (limit and cs.width * cs.height > limit))
            # On the CPU a photo at least twice the cached side goes to PIL: Image.draft decodes it at
            # 1/2, 1/4 or 1/8 scale, which nvImageCodec 0.9 cannot (no DCT scaling), for less work.
            ok = ok and (self.cuda or max(cs.width, cs.height) < 2 * self.photos.side)
        except (OSError, RuntimeError):   # unreadable, or not an image it parses: load_whole names why
            return None
        return (cs, orientation) if ok else None

    def _pixels(self, img):
        """(H, W, 3) uint8 of a decoded image: on the GPU a tensor viewing its device memory, else a
        numpy array; None where nvImageCodec gave up on the file."""
        if img is None:
            return None
        if self.cuda and img.buffer_kind == self.nv.ImageBufferKind.STRIDED_DEVICE:
            return torch.as_tensor(img, device=self.device)   # __cuda_array_interface__: no copy
        return np.asarray(img.cpu())

    def _release(self) -> None:
        """Drop the decoded photos held since the last group, once the GPU work reading them is done.

        Which stream nvImageCodec 0.9 frees an Image's buffer on is not documented (Image.cuda_stream
        is the decode's, torch's current one, but the Python binding does not say it frees there), so
        the photos go only after the event recorded behind their resizes and row copies. Waited for
        after the NEXT group's decode is queued: the host reads, parses and queues group k+1 while the
        GPU still works on group k (a stream synchronize per group serialized them), for at most two
        groups' photos (2 x ``max_call_bytes``) on the GPU at once."""
        if self._held is not None:
            images, done = self._held
            self._held = None
            done.synchronize()
            del images

    def flush(self) -> None:
        """Release what ``decode_rows(..., hold=True)`` kept (see ``_release``); call it at the end."""
        self._release()

    def decode_rows(self, ids, rows: torch.Tensor, sizes: np.ndarray, data: list | None = None, *,
                    hold: bool = False) -> np.ndarray:
        """As ``WholePhotos.decode_rows``, into torch rows on the decoder's device. ``data``: the files'
        bytes already read (``read``), else read here. ``hold`` (CUDA): keep the last group's decoded
        photos until the next call or ``flush()`` instead of waiting for its GPU work here."""
        from PIL import Image

        side = self.photos.side
        data = self.read(ids) if data is None else data
        streams, turns, where, fallback = [], [], [], []
        names = map(self.photos.source.sample_name, ids)
        for j, parsed in enumerate(map(self._stream, data, names)):
            if parsed is None:
                fallback.append(j)
            else:
                streams.append(parsed[0])
                turns.append(parsed[1])
                where.append(j)
        # The decode is ordered before the resizes on the current stream (the one torch's kernels use).
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.cuda else 0
        ok = np.zeros(len(ids), dtype=bool)
        # On the CPU the rows are written through numpy: torch's strided uint8 copies into a slot's
        # sub-rectangle measured ~20 ms a photo here, numpy's well under 1 ms.
        host: np.ndarray | torch.Tensor = rows if rows.is_cuda else rows.numpy()
        try:
            for group in self._groups(streams):
                images = self.decoder.decode([streams[k] for k in group], params=self.params, cuda_stream=stream)
                self._release()   # the previous group's photos: this decode is queued behind its work
                small: torch.Tensor | np.ndarray | None = None
                for k, img in zip(group, images, strict=True):
                    j, t = where[k], self._pixels(img)
                    if t is None or t.ndim != 3 or t.shape[2] != 3:
                        fallback.append(j)   # nvImageCodec gave up on it: PIL decodes it or names the problem
                        continue
                    t = upright(t, turns[k])
                    H, W = t.shape[:2]
                    if isinstance(t, torch.Tensor):
                        small = resize_whole(t, side)
                    else:   # PIL's resize: measured as fast as torch's uint8 one here, the same pixels
                        h, w = whole_size(H, W, side)
                        small = t if (h, w) == (H, W) else np.asarray(
                            Image.fromarray(np.ascontiguousarray(t)).resize((w, h), Image.Resampling.BILINEAR))
                    place(host[j], small)
                    sizes[j] = (H, W, *small.shape[:2])
                    ok[j] = True
                # No view of a decoded photo may outlive its group (a tensor keeps its Image alive): the
                # photos go in _release, after their event, and nowhere else.
                img = t = small = None
                if self.cuda:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(self.device))
                    self._held = (images, done)
                del images
        finally:
            if not hold:
                self._release()
        for j in sorted(fallback):
            # data[j] None: the file was unreadable; read again, to name why.
            got = self.photos.on_error.attempt(self.photos.photo, ids[j], data[j])
            if got is None:
                continue
            arr, H, W = got
            place(host[j], torch.from_numpy(arr.copy()).to(rows.device) if rows.is_cuda else arr)
            sizes[j] = (H, W, *arr.shape[:2])
            ok[j] = True
        return ok


