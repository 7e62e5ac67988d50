"""QA pass over distributed training as users run it (torchrun, torch.multiprocessing.spawn, a shell's
leftover variables): a rank the launcher's variables place outside the world is named, a loader built
before the process group is refused by fit instead of reading every sample on every rank, and one-channel
batches have NCHW's strides (DDP warned about its gradient buckets on every rank)."""
from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import indexed_source
from fastdata import Augmentation, evaluate, fit, make_loader
from fastdata import distributed as fdist
from fastdata.datasets import SyntheticDigits
from fastdata.normalize import Normalizer
from test_sampling import no_launcher_env  # noqa: F401  (a fixture: this module's tests use it by name)


# ------------------------------------------------------------------ a leftover launcher variable
@pytest.mark.parametrize("env, world_size, message", [
    ({"RANK": "1"}, None, r"^RANK=1 but WORLD_SIZE is not set \(one process\): rank 1 is outside \[0, 1\); launch "
                          r"with torchrun \(it sets both\), set WORLD_SIZE too, unset RANK to run one process"),
    ({"LOCAL_RANK": "1"}, None, r"^LOCAL_RANK=1 but WORLD_SIZE is not set .* unset LOCAL_RANK to run one process"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, None, r"^RANK=2 but WORLD_SIZE=2: rank 2 is outside \[0, 2\); the "
                                             r"launcher's variables disagree"),
    ({"WORLD_SIZE": "8", "NODE_RANK": "3", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}, None,
     r"^NODE_RANK=3 x LOCAL_WORLD_SIZE=4 \+ LOCAL_RANK=1 but WORLD_SIZE=8: rank 13 is outside \[0, 8\)"),
    ({"RANK": "3"}, 2, r"^RANK=3 but world_size=2 was passed: rank 3 is outside \[0, 2\)"),
])
def test_a_rank_the_launchers_variables_put_outside_the_world_names_them(no_launcher_env, env, world_size,  # noqa: F811
                                                                         message):
    """``RANK=1`` left in a shell, no WORLD_SIZE: make_loader failed with "rank 1 is outside [0,
    world_size=1)", naming no variable; and rank() said 1, so fit neither printed nor saved."""
    for name, value in env.items():
        no_launcher_env.setenv(name, value)
    with pytest.raises(RuntimeError, match=message):
        make_loader(indexed_source(32), "memory", batch_size=4, device="cpu", world_size=world_size)
    if world_size is None and "WORLD_SIZE" not in env:
        assert fdist.rank() == 0 and fdist.is_main()   # one process: it prints and saves
    assert len(make_loader(indexed_source(32), "memory", batch_size=4, device="cpu", rank=0, world_size=1)) == 8


# ------------------------------------------------------------------ a loader built before the group
@pytest.fixture
def group_of_one(tmp_path):
    """Starts a real gloo process group of one rank in this process when called, as a script's own
    init_process_group does, and ends it after the test."""
    def start():
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _digits_loader(**kw):
    return make_loader(indexed_source(64), "memory", batch_size=8, device="cpu", augment=Augmentation.none(), **kw)


def test_fit_refuses_a_loader_sharded_for_another_world_than_its_process_group(no_launcher_env,  # noqa: F811
                                                                               group_of_one):
    """Built as rank 1 of 2 (the launcher's variables then) and trained in a group of one: refused before
    any batch, naming both and the way out. The same refusal is the torch.multiprocessing.spawn case of
    test_a_loader_built_before_a_spawned_process_group_is_refused, where every rank was rank 0 of 1."""
    no_launcher_env.setenv("WORLD_SIZE", "2")
    no_launcher_env.setenv("RANK", "1")
    stale = _digits_loader()
    no_launcher_env.delenv("WORLD_SIZE")
    no_launcher_env.delenv("RANK")
    group_of_one()
    model = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(64, 10))
    message = (r"train_loader was built as rank 1 of 2, but the process that holds it is rank 0 of 1 in the "
               r"process group: the ranks' shards would overlap and leave samples out\. Build the loaders after "
               r"the process group exists")
    with pytest.raises(RuntimeError, match=message):
        fit(model, stale, epochs=1, progress=False)
    with pytest.raises(RuntimeError, match=r"^eval_loader was built as rank 1 of 2"):
        fit(model, _digits_loader(), epochs=1, progress=False, eval_loader=stale)
    with pytest.raises(RuntimeError, match=r"^the evaluation loader was built as rank 1 of 2"):
        evaluate(model, stale)
    # A shard the caller chose (rank=, world_size=) is the caller's business: it trains.
    chosen = _digits_loader(rank=1, world_size=2)
    assert fit(model, chosen, epochs=1, progress=False)[0]["images"] == 32


def test_the_ranks_figures_travel_over_the_host(no_launcher_env, group_of_one, monkeypatch):  # noqa: F811
    """Under nccl, all_gather_object goes through the current GPU, which is every rank's cuda:0 where
    the caller never set it: fit's check gathers through fastdata's gloo path instead."""
    gathered = []
    real = fdist.gather_on_cpu
    monkeypatch.setattr(fdist, "gather_on_cpu", lambda obj: gathered.append(obj) or real(obj))
    group_of_one()
    model = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(64, 10))
    fit(model, _digits_loader(), epochs=1, progress=False)
    assert gathered == [(0, 1, 8, 64, 8)]


def _spawned(rank: int, store: str, case: str) -> None:
    """A process of torch.multiprocessing.spawn that trains one epoch in its own 2-rank gloo group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        os.environ.pop(name, None)
    if case == "before":
        loader = _digits_loader()   # before the group: rank 0 of 1 on both processes
    # A short timeout: a regression that lets the ranks fall out of step fails here instead of hanging.
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    if case == "stale copy":
        loader = make_loader(indexed_source(96 if rank == 0 else 128), "memory", batch_size=8, device="cpu",
                             augment=Augmentation.none())
    try:
        model = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(64, 10))
        fit(model, loader, epochs=1, progress=False)
    finally:
        dist.destroy_process_group()


def test_a_loader_built_before_a_spawned_process_group_is_refused(tmp_path):
    """A script that starts its own group (torch.multiprocessing.spawn, no launcher variables) and built
    its loader first: every rank was rank 0 of 1 and read all 64 samples (fit counted 128 images an
    epoch), DDP averaging two copies of one gradient, without a word. Now fit refuses it on each rank."""
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match=r"train_loader was built as rank 0 of 1, but the process "
                                                        r"that holds it is rank 0 of 2 .* every rank would "
                                                        r"read every sample of each epoch, in the same order"):
        mp.spawn(_spawned, args=(str(tmp_path / "store"), "before"), nprocs=2, join=True)


def test_ranks_whose_data_differ_are_refused_instead_of_hanging(tmp_path):
    """Each node with its own copy of the data, one of them stale (96 samples on rank 0, 128 on rank 1):
    rank 0 ended its epoch after 6 steps and waited for rank 1's 7th gradient all-reduce until gloo's
    30-minute timeout, saying nothing. fit refuses it on every rank before the first batch."""
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match=r"train_loader differs between ranks \(rank 0: 6 batches "
                                                        r"of 8 from 96 samples; rank 1: 8 batches of 8 from 128 "
                                                        r"samples\): the ranks would fall out of step"):
        mp.spawn(_spawned, args=(str(tmp_path / "store"), "stale copy"), nprocs=2, join=True)


# ------------------------------------------------------------------ one-channel batches under DDP
@pytest.mark.parametrize("backend", ["torch", "prefetch", "memory"])
def test_one_channel_batches_have_nchw_strides_and_so_do_their_gradients(backend):
    """MNIST through torch or prefetch came out with strides (784, 1, 28, 1): contiguous, and channels-last
    as well, so the convolution took the channels-last path, its weight gradient came out channels-last,
    and DDP warned on every rank ("Grad strides do not match bucket view strides ... may impair
    performance"). memory and dali gave NCHW's (784, 784, 28, 1) all along."""
    options = {"num_workers": 0} if backend == "torch" else {}
    with make_loader(SyntheticDigits(32, seed=1), backend, batch_size=8, device="cpu", **options) as loader:
        images, _ = next(iter(loader))
    assert images.stride() == (784, 784, 28, 1)
    conv = torch.nn.Conv2d(1, 4, 3)
    conv(images).sum().backward()
    assert conv.weight.grad.stride() == conv.weight.stride()   # what DDP's bucket views compare


def test_the_normalizer_keeps_nchw_strides_for_one_channel_and_channels_last_when_asked():
    nhwc = torch.from_numpy(np.arange(2 * 5 * 6, dtype=np.uint8).reshape(2, 5, 6, 1))
    plain = Normalizer((0.5,), (0.25,), torch.device("cpu"), torch.float32, False)(nhwc)
    assert plain.shape == (2, 1, 5, 6) and plain.stride() == (30, 30, 6, 1)
    last = Normalizer((0.5,), (0.25,), torch.device("cpu"), torch.float32, True)(nhwc)
    assert last.stride() == (30, 1, 6, 1)
    torch.testing.assert_close(plain, last)
    torch.testing.assert_close(plain[0, 0], (nhwc[0, ..., 0].float() / 255 - 0.5) / 0.25)


# ------------------------------------------------------------------ a warning every rank would print
@pytest.mark.parametrize("rank, warns", [("0", True), ("1", False)])
def test_a_one_cycle_schedule_resumed_short_is_warned_about_by_rank_0_alone(no_launcher_env, rank, warns):  # noqa: F811
    """Resumed on 3 ranks from a save of 2 (tried with train_mnist.py under torchrun): every rank printed
    the same 'stops before annealing' warning; rank 0 alone says it now."""
    import warnings

    from fastdata.engine import check_schedule_length

    no_launcher_env.setenv("WORLD_SIZE", "3")
    no_launcher_env.setenv("RANK", rank)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=312)
    for _ in range(60):
        opt.step()
        sched.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_schedule_length(sched, "step", epochs=2, start_epoch=0, start_batch=40, batches=104)
    assert [str(w.message) for w in caught if "stops before annealing" in str(w.message)] == (
        ["resuming: the checkpoint's OneCycleLR has total_steps=312 but this run ends it at step 228 (the steps per "
         "epoch changed: another world size, batch size or accumulate than the saved run's, or fewer epochs), so "
         "its learning rate stops before annealing to its end"] if warns else [])


# ------------------------------------------------------------------ evaluation with even_batches
@pytest.mark.parametrize("n, world", [(97, 2), (101, 3), (96, 2)])
def test_evaluate_counts_each_sample_once_with_even_batches(n, world):
    """even_batches pads the last step with samples from the epoch's start (as DistributedSampler does, for
    accelerate's gather): evaluate summed the padding too, so under DDP 97 samples were counted as 98,
    and loss and accuracy were off. Each rank evaluated alone here (no group: its own sums); together
    they must be the single process's figures."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(64, 10))
    opts = dict(batch_size=8, device="cpu", train=False, augment=Augmentation.none())
    whole = evaluate(model, make_loader(indexed_source(n), "memory", **opts))
    parts = [evaluate(model, make_loader(indexed_source(n), "memory", rank=r, world_size=world, even_batches=True,
                                         **opts)) for r in range(world)]
    assert sum(p["samples"] for p in parts) == whole["samples"] == n
    seen = [p for p in parts if p["samples"]]
    assert sum(p["loss"] * p["samples"] for p in seen) / n == pytest.approx(whole["loss"], rel=1e-6)
    assert sum(p["accuracy"] * p["samples"] for p in seen) / n == pytest.approx(whole["accuracy"], abs=1e-9)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "memory"])
def test_one_channel_batches_on_cuda_have_nchw_strides(backend):
    """The Normalizer's one-channel path on the GPU (where cuDNN would pick channels-last kernels for
    (HW, 1, W, 1) strides and DDP's buckets would not match the weight gradients)."""
    options = {"num_workers": 0} if backend == "torch" else {}
    with make_loader(SyntheticDigits(32, seed=1), backend, batch_size=8, device="cuda", **options) as loader:
        images, _ = next(iter(loader))
    assert images.is_cuda and images.stride() == (784, 784, 28, 1)
    conv = torch.nn.Conv2d(1, 4, 3).cuda()
    conv(images).sum().backward()
    assert conv.weight.grad.stride() == conv.weight.stride()


def test_init_distributed_on_cuda_without_cuda_says_so(monkeypatch):
    """torchrun on a machine without CUDA, a script asking for 'cuda': the error said 'this process
    sees 0 CUDA device(s); run at most 0 processes per node'. It names CUDA's absence and device='cpu'."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("process group started"))
    with pytest.raises(RuntimeError, match=r"^device 'cuda' was requested but CUDA is not available here .*; "
                                           r"use device='cpu'$"):
        fdist.init_distributed("cuda")
