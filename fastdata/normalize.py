"""Normalization: uint8 (N, H, W, C) batches → normalized float (N, C, H, W) on the device.

Every backend keeps its batches uint8 until here: a quarter of float's bytes through collate, pinning
and the host-to-device copy. ``(x / 255 - mean) / std`` is folded into one multiply-add,
``x * scale + shift``, with ``scale``/``shift`` kept on the device.
"""
from __future__ import annotations

import torch


def new_buffer(shape, fmt) -> torch.Tensor:
    """A new float32 CPU tensor (the only place the CPU path allocates its output)."""
    return torch.empty(shape, dtype=torch.float32, memory_format=fmt)


class Normalizer:
    """Holds ``scale``/``shift`` on ``device`` and converts batches to ``dtype`` in the chosen layout.

    Args:
        mean, std: per-channel statistics in [0, 1] units (already validated by the loader).
        device: where the batches are (and the constants live).
        dtype: the output dtype (float32, bfloat16 or float16).
        channels_last: output in channels_last memory format instead of contiguous NCHW.
    """

    # On the CPU a whole-batch conversion streams the float batch through memory three times (layout
    # copy, multiply, add: 38 MB each for 64 photos of 224²). Pieces of at most 32,768 elements (torch's
    # intra-op grain size) stay in the core's cache and run on the calling thread: a larger op starts an
    # OpenMP region whose threads spin against the DataLoader workers on the same cores (measured on
    # 2 cores with 2 workers, the JPEG workload's torch backend went from 790 images/s to the rate in
    # benchmarks/results/loaders-cpu-2c.md).
    GRAIN = 32768
    # A CPU batch of photos is tens of MB (38.5 MB for 64 of 224²), which glibc serves with a fresh mmap
    # every time: the kernel then faults in and zeroes its 9,400 pages as the batch is written, which
    # cost more than the normalization itself (measured here: 0.33 ms per image of page faults, 0.25
    # of arithmetic). So the CPU path recycles up to POOL output buffers: one is handed out again only
    # when nothing refers to its memory any more (no tensor, view, numpy array, autograd record or
    # other thread holds the previous batch: the storage's use count is back to the pool's own).
    # Buffers are made only when every pooled one is in use, so a plain loop circulates 2 (the batch
    # the loop variable still holds while the next is made); POOL bounds how many batches may be out
    # at once and still be recycled: a prefetch stage of depth d has d + 2 out (queued, the
    # consumer's, the one being made), so 6 covers depths up to 4. It costs no memory beyond that.
    POOL = 6

    def __init__(self, mean, std, device: torch.device, dtype: torch.dtype = torch.float32,
                 channels_last: bool = False):
        mean_t = torch.tensor(mean, dtype=torch.float32)
        std_t = torch.tensor(std, dtype=torch.float32)
        self.device, self.dtype, self.channels_last = torch.device(device), dtype, channels_last
        self.scale = (1.0 / (255.0 * std_t)).view(1, -1, 1, 1).to(self.device)
        self.shift = (-mean_t / std_t).view(1, -1, 1, 1).to(self.device)
        self._pool: list[tuple[torch.Tensor, int]] = []   # (buffer, its use count when nothing else holds it)
        #: (H, W) of the loader's batches where known before any batch (``augment.output_size``, set
        #: by the loader); the (H, W) of the last batch normalized replaces it. An empty batch comes out
        #: (0, C, H, W) with it (see ``empty_shape``).
        self.size: tuple[int, int] | None = None

    @property
    def channels(self) -> int:
        """C of every batch: one scale per channel."""
        return self.scale.shape[1]

    def empty_shape(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` (uint8 (N, H, W, C)) as it is, or, when it is an empty batch that lost its shape, a
        (0, H, W, C) one of the loader's (H, W) and C.

        A decode of no samples (a rank's share of a short last step with ``drop_last=False``, or a batch
        whose files were all skipped) knows neither the height nor the width: it stacks nothing into
        (0, 0, 0, C). Every other batch of the loader is (N, C, H, W), and a batch transform, a model
        or a gather (``torch.cat`` of every rank's predictions) needs the same (C, H, W) on an empty one.
        """
        if images.shape[0] == 0 and self.size is not None and \
                (tuple(images.shape[1:3]) != self.size or images.shape[3] != self.channels):
            return images.new_empty((0, *self.size, self.channels))
        return images

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, H, W, C) on the device → normalized (N, C, H, W) in the configured dtype/layout.

        ``permute`` of an NHWC tensor already has channels-last strides, so the channels_last layout
        costs no copy; the contiguous (NCHW) layout costs one. An empty batch keeps the loader's
        (C, H, W) (``empty_shape``).
        """
        if images.shape[0]:
            self.size = (images.shape[1], images.shape[2])
        else:
            images = self.empty_shape(images)
        if images.shape[3] == 1 and not self.channels_last:
            # One channel: permute's strides (HW, 1, W, 1) are channels-last ones as well, and contiguous()
            # keeps them (a size-1 dim's stride is free), so convolutions took the channels-last path and
            # DDP warned on every rank that the gradients' strides differ from its buckets'. unsqueeze
            # gives NCHW's own strides (HW, HW, W, 1).
            x = images.squeeze(3).unsqueeze(1)
        else:
            x = images.permute(0, 3, 1, 2)
        if self.device.type == "cpu" and x.numel() > self.GRAIN:
            return self._chunked(x)
        if not self.channels_last:
            x = x.contiguous()  # the layout change is cheapest on uint8, before the float conversion
        return self.floats(x)

    def floats(self, x: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """(N, C, H, W) in 0..255 (uint8 or float) → normalized, in the configured dtype and layout.

        ``inplace``: ``x`` is a float32 temporary of the caller's, normalized in its own memory (on the
        CPU a new 38 MB batch costs more in page faults than the arithmetic: 0.35 against 0.1 ms an image).
        """
        if inplace and x.dtype == torch.float32 and x.numel():
            x = x.mul_(self.scale).add_(self.shift)
        else:
            # uint8 * float32 promotes inside the multiply: one pass writes the float batch, one adds.
            x = x.mul(self.scale).add_(self.shift) if x.numel() else x.float()
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x if self.dtype == torch.float32 else x.to(self.dtype)

    def _chunked(self, x: torch.Tensor) -> torch.Tensor:
        """The CPU path: cache-sized pieces on the calling thread (see GRAIN)."""
        n, c, h, w = x.shape
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = self._buffer((n, c, h, w), fmt)
        # mul(out=) converts and transposes in one vectorized pass; copy_() with a dtype change and a
        # layout change takes a slow element-wise path (measured 100x slower).
        if c * h * w <= self.GRAIN:  # small images (digits): groups of whole images
            step = self.GRAIN // (c * h * w)
            for i in range(0, n, step):
                o = out[i:i + step]
                torch.mul(x[i:i + step], self.scale, out=o)
                o.add_(self.shift)
        else:  # photos: bands of rows within each image
            rows = max(1, self.GRAIN // (c * w))
            scale, shift = self.scale[0], self.shift[0]
            for i in range(n):
                xi, oi = x[i], out[i]
                for r in range(0, h, rows):
                    o = oi[:, r:r + rows]
                    torch.mul(xi[:, r:r + rows], scale, out=o)
                    o.add_(shift)
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def _buffer(self, shape, fmt) -> torch.Tensor:
        """A float32 CPU tensor of ``shape`` in layout ``fmt``: a pooled buffer nothing refers to any
        more, or a new one (see POOL). Handed out as a new tensor on the buffer's memory, not as the
        pooled object: each batch is its own tensor, and every reference to it counts against reuse."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:   # a torch without it: no pooling, never a buffer in use
            return new_buffer(shape, fmt)
        found = None
        for k, (buf, idle) in enumerate(self._pool):
            if buf.shape == shape and buf.is_contiguous(memory_format=fmt) \
                    and use_count(buf.untyped_storage()._cdata) == idle:
                found = self._pool.pop(k)
                break
        if found is None:
            buf = new_buffer(shape, fmt)
            found = (buf, use_count(buf.untyped_storage()._cdata))
        self._pool.insert(0, found)   # most recently used first; the oldest drops out
        del self._pool[self.POOL:]
        buf = found[0]
        return torch.empty(0, dtype=torch.float32).set_(buf.untyped_storage(), 0, buf.shape, buf.stride())
