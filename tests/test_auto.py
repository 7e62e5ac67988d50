"""auto: the memory backend's budget decides, and every rank of a job makes the same choice."""
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch

from conftest import indexed_source
from fastdata import Augmentation, registry
from fastdata.backends import auto, memory


def config(device, rank=None, world_size=None, batch_size=256):
    # Translation keeps a padded uint8 copy, so the cache costs memory on the CPU too.
    return SimpleNamespace(device=torch.device(device), augment=Augmentation(crop="translate", pad=2),
                           train=True, rank=rank, world_size=world_size, dtype=torch.float32,
                           batch_size=batch_size)


def photo_sized(n=1000):
    """Samples of 64x64x3: a batch of 256 is 3 MiB of uint8, large enough for the prefetch stage to
    help (fastdata.prefetch.MIN_BATCH_BYTES); indexed_source's 8x8 grey ones are 16 KiB a batch."""
    return indexed_source(n, size=64, channels=3)


def test_ranks_without_a_process_group_decide_on_equal_quantities(gpu_16g):
    src = indexed_source(1000)
    picks = []
    for rank, free in ((0, 15 * 2**30), (1, 1000)):   # rank 1's GPU is nearly full, rank 0's is not
        gpu_16g["free"] = free
        picks.append(registry.choose(src, config("cuda:0", rank, 2))[0])
    assert picks == ["memory", "memory"]
    # A single process has no one to agree with: free memory counts, so it does not pick a cache that
    # cannot be allocated.
    assert registry.choose(src, config("cuda:0", 0, 1))[0] != "memory"


def test_the_reserve_option_moves_the_decision(gpu_16g, monkeypatch):
    src = indexed_source(1000)
    need = memory.cache_bytes(src, config("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=4 * need))
    gpu_16g["free"] = 4 * need
    assert registry.choose(src, config("cuda:0"))[0] == "memory"                       # 4x - 25% fits
    name, why = registry.choose(src, config("cuda:0"), {"memory_reserve": 0.9})
    assert name != "memory" and "does not fit" in why


def _rank(rank, path, q):
    import torch.distributed as dist

    from fastdata import registry as r
    from fastdata.backends import auto as a
    from fastdata.backends import memory as m

    if rank == 1:
        m.budgeting.free_bytes = lambda device: 1000                   # alone, rank 1 would not cache
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        q.put((rank, r.choose(indexed_source(1000), config("cpu")),
               a.choose_locally(indexed_source(1000), config("cpu"), None, r.by_preference())[0]))
    finally:
        from fastdata import distributed as fdist

        fdist.cleanup(barrier=False)   # gloo's threads finish before exit


def test_with_a_process_group_every_rank_takes_the_same_choice(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, tmp_path / "pg", q)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (choice, alone) for r, choice, alone in (q.get(timeout=60) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    assert results[1][1] == "torch", "the test needs ranks that disagree on their own"
    for rank in (0, 1):
        name, why = results[rank][0]
        # The first row that fits on both (rank 0 deciding alone picked memory, which rank 1 cannot build).
        assert name == "torch" and "fits on all 2 ranks" in why and "not memory on rank 1" in why


def test_on_cuda_the_tables_order_decides_when_the_cache_does_not_fit(gpu_16g, monkeypatch):
    from fastdata import registry

    src = photo_sized()
    gpu_16g["free"] = 1000                                     # no room for the cache on this GPU
    name, why = registry.choose(src, config("cuda:0"))
    assert name == ("dali" if registry.spec("dali").available else "prefetch")
    assert "not memory: the cache" in why and "does not fit" in why
    if name == "dali":   # why dali: what it does on the GPU, not only that it reads the source's kind
        assert why.startswith("DALI crops and normalizes the batches on the GPU"), why   # an array source
    # Without DALI the next row, prefetch, is picked, and the reason says what DALI lacked.
    monkeypatch.setitem(registry.BACKENDS, "dali", registry.BackendSpec(
        "dali", "x.y:Z", needs="no_dali_here", install="pip install nvidia-dali-cuda120", order=20, devices=("cuda",)))
    registry.clear_import_cache()
    try:
        name, why = registry.choose(src, config("cuda:0"))
    finally:
        registry.clear_import_cache()
    assert name == "prefetch" and "not dali: backend 'dali' needs no_dali_here, which does not import" in why


def test_a_torch_dataset_goes_to_the_first_row_that_reads_it(gpu_16g):
    from fastdata import registry
    from fastdata.datasets import as_source

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.zeros(1, 4, 4, dtype=torch.uint8), i % 2

    src = as_source(Squares())
    cpu_name, why = registry.choose(src, config("cpu"))
    assert cpu_name == "torch" and "not memory: backend 'memory' cannot read" in why
    # 4x4 grey samples: a batch too small for prefetch to help, so on CUDA too the torch backend.
    assert registry.choose(src, config("cuda:0"))[0] == "torch"

    class Photos(Squares):
        def __getitem__(self, i):
            return torch.zeros(3, 256, 256, dtype=torch.uint8), i % 2

    assert registry.choose(as_source(Photos()), config("cuda:0", batch_size=8))[0] == "prefetch"  # 1.5 MiB


@pytest.mark.parametrize("size, batch, picked", [(28, 256, "torch"), (32, 256, "torch"), (64, 256, "prefetch"),
                                                 (224, 64, "prefetch"), (224, 4, "torch")])
def test_on_cuda_prefetch_is_picked_only_for_batches_it_can_speed_up(gpu_16g, size, batch, picked):
    """Issue 30.5: on an H200 the prefetch stage hid nothing for batches of 256 digits (200 KB of uint8):
    their copy takes microseconds. auto's rule: prefetch over torch only for batches of at least
    MIN_BATCH_BYTES (digits and CIFAR-sized batches go to torch, photo batches to prefetch), and the
    reason says why prefetch was passed over."""
    from fastdata import registry
    from fastdata.prefetch import MIN_BATCH_BYTES

    gpu_16g["free"] = 1000                                     # no room for memory's cache
    src = indexed_source(300, size=size, channels=1 if size == 28 else 3)
    without_dali = [s for s in registry.by_preference() if s.name != "dali"]
    name, why = auto.choose_locally(src, config("cuda:0", batch_size=batch), None, without_dali)
    assert name == picked, why
    bytes_ = batch * size * size * (1 if size == 28 else 3)
    assert (bytes_ >= MIN_BATCH_BYTES) == (picked == "prefetch")
    if picked == "torch":
        assert f"not prefetch: a batch is {bytes_ / 1024:,.0f} KiB of uint8" in why and "no faster" in why


@pytest.mark.cuda
def test_on_a_real_gpu_the_cache_decides_between_memory_and_the_next_cuda_row():
    from fastdata import registry

    device = f"cuda:{torch.cuda.current_device()}"
    src = photo_sized()                             # 12 MB of uint8: fits any GPU's budget
    name, why = registry.choose(src, config(device))
    # A translation of an array is cached normalized ahead, which takes at most half the budget.
    assert name == "memory" and "normalized ahead in float32" in why and f"fits in half the free GPU {device}" in why
    # A reserve of the whole GPU (in bytes): the next row on CUDA (dali if it imports, else prefetch).
    whole = torch.cuda.get_device_properties(device).total_memory
    name, why = registry.choose(src, config(device), {"memory_reserve": whole})
    assert name == ("dali" if registry.spec("dali").available else "prefetch")
    assert "not memory: the cache" in why and "does not fit" in why
    if name == "dali":   # why dali: what it does on the GPU, not only that it reads the source's kind
        assert why.startswith("DALI crops and normalizes the batches on the GPU"), why   # an array source


@pytest.mark.parametrize("crop", ["translate", "random_resized"])
def test_the_reason_says_which_cache_fits_on_a_gpu(gpu_16g, crop):
    """auto's reason on a GPU (a 16 GiB one, stubbed): an array translated is cached normalized ahead,
    held to half the budget; a resampling crop keeps uint8. The real-GPU test above asserted the uint8
    wording ("fits in the free GPU") for a translated array, whose reason says "fits in half the free
    GPU": it could only fail where it runs."""
    cfg = config("cuda:0")
    cfg.augment = Augmentation(crop="translate", pad=2) if crop == "translate" else Augmentation(crop=crop, size=8)
    name, why = registry.choose(indexed_source(1000), cfg)
    assert name == "memory"
    if crop == "translate":
        assert "its cache, normalized ahead in float32" in why and "fits in half the free GPU cuda:0" in why
    else:
        assert "its uint8 cache" in why and "fits in the free GPU cuda:0" in why and "half" not in why


def test_when_no_row_fits_the_error_names_each_reason(monkeypatch):
    from fastdata import registry

    monkeypatch.setattr(memory.budgeting, "free_bytes", lambda device: 1000)
    specs = [registry.spec("memory"), registry.spec("prefetch")]          # prefetch is CUDA-only
    with pytest.raises(ValueError, match=r"no backend fits .* not memory: the cache .* does not fit.*"
                                         r"backends allowed on cpu: \['memory'\]"):
        auto.choose_locally(indexed_source(1000), config("cpu"), None, specs)


def test_dalis_reason_on_a_gpu_says_what_it_does_there(tmp_path):
    """auto's line said "dali reads files sources" when it picked dali on a GPU: not why it was
    preferred to the torch path. It now says what DALI does there."""
    if not registry.spec("dali").available:
        pytest.skip("DALI is not installed here")
    from fastdata.datasets import ImageFolder, make_image_folder

    folder = ImageFolder(make_image_folder(tmp_path, classes=2, per_class=1, size_range=((40, 50), (40, 50))))
    dali = registry.backend_class("dali")
    assert dali.fits(folder, config("cuda:0"))[1] == \
        "nvJPEG decodes the photos and DALI crops and normalizes them on the GPU"
    assert dali.fits(photo_sized(), config("cuda:0"))[1] == "DALI crops and normalizes the batches on the GPU"
    assert dali.fits(folder, config("cpu")) == (True, "dali reads files sources")
