"""The dali backend's outputs: a built pipeline driven through DALI's public scheduling API
(``schedule_run`` / ``share_outputs`` / ``release_outputs``), each batch handed to torch without a copy.

Why not ``DALIGenericIterator``: it calls ``Pipeline.share_outputs()`` with no stream, which DALI 2.4
documents as "the outputs are synchronized with the host" (``nvidia/dali/pipeline.py``): the training
thread waits for the GPU to finish every batch before it may even queue the step that uses it. Given the
consumer's stream instead, DALI's ``ShareOutputs`` sets the workspace's output order to that stream
(``backend_impl.cc``: ``ws.set_output_order(cuda_stream)``) and returns once the iteration's host work is
done: the GPU work is ordered before whatever the consumer queues next on that stream, with no host wait.
A stream handle of 0 (torch's default stream) is a device order in DALI (``AccessOrder``: only the
sentinels 4321, host, and -1, none, are not), i.e. the legacy default stream torch's default stream is.
``torch.from_dlpack`` then passes the same current stream to ``TensorGPU.__dlpack__``, which inserts a
wait only if the buffer's order is another stream.

A buffer outlives ``release_outputs``: under DALI 2.4's default executor (``exec_dynamic``) outputs are
reference counted and ``release_outputs`` does not invalidate them (its docstring), and the DLPack capsule
holds a reference until torch frees the tensor. The pipelines here always run that executor; where one
does not (``Pipeline.exec_dynamic`` false), the batch is copied out before its buffers are released,
as DALI's own iterator does.
"""
from __future__ import annotations

import contextlib

import torch

#: ``handover`` values: "stream" binds each batch to the consumer's current CUDA stream (no host wait);
#: "host" waits on the host for each batch, as ``DALIGenericIterator`` does (kept for measurement).
HANDOVER_CHOICES = ("stream", "host")


def output_stream(device: torch.device, handover: str):
    """The stream ``share_outputs`` binds a batch to: the consumer's current stream on ``device`` for
    ``"stream"`` on a GPU; None (DALI synchronizes the host) for ``"host"`` and on the CPU."""
    if device.type != "cuda" or handover == "host":
        return None
    return torch.cuda.current_stream(device)


class Outputs:
    """Iterator over a built pipeline's first output as torch tensors on ``device``. ``StopIteration``
    when the pipeline's input ended (its external source raised it) and every scheduled batch was taken.

    The first ``next`` schedules ``prefetch_queue_depth`` iterations (DALI's ``schedule_run`` prefetches
    on its first call); each batch taken schedules one more, after its buffers were handed over: the
    order ``DALIGenericIterator`` keeps, so DALI's queue stays full."""

    def __init__(self, pipe, device: torch.device, handover: str = "stream"):
        self.pipe, self.device, self.handover = pipe, device, handover
        self._started = False

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        pipe = self.pipe
        if not self._started:
            self._started = True
            pipe.schedule_run()
        stream = output_stream(self.device, self.handover)
        (out, *_rest) = pipe.share_outputs(cuda_stream=stream)   # StopIteration once drained
        images = to_torch(out.as_tensor(), self.device, copy=not pipe.exec_dynamic)
        pipe.release_outputs()
        pipe.schedule_run()
        return images


def to_torch(tensor, device: torch.device, copy: bool) -> torch.Tensor:
    """A DALI tensor (CPU or GPU, dense) as a torch tensor on ``device``: a DLPack view, or a copy where
    DALI may reuse the buffer once released (``copy``: an executor other than ``exec_dynamic``)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        view = torch.from_dlpack(tensor)   # passes torch's current stream to __dlpack__ (see module doc)
        return view.clone() if copy else view

