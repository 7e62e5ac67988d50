"""LoaderConfig and Augmentation check their values once, with errors that name them."""
import dataclasses

import numpy as np
import pytest
import torch

from fastdata import Augmentation, LoaderConfig, make_loader
from fastdata.datasets import ArraySource


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_batch_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match=rf"^batch_size must be an integer >= 1, got {bad!r}"):
        LoaderConfig(batch_size=bad)


def test_num_workers_must_not_be_negative():
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0"):
        LoaderConfig(num_workers=-1)


def test_choices_are_listed():
    with pytest.raises(ValueError, match=r"unknown on_error 'ignore'; choose from \['raise', 'skip'\]"):
        LoaderConfig(on_error="ignore")
    with pytest.raises(ValueError, match="unknown dtype 'int8'; choose from"):
        LoaderConfig(dtype="int8")
    with pytest.raises(ValueError, match="unknown crop 'random'; choose from"):
        Augmentation(crop="random")


def test_defaults_follow_train():
    train, evaluation = LoaderConfig(device="cpu"), LoaderConfig(train=False, device="cpu")
    assert train.shuffle and train.drop_last
    assert not evaluation.shuffle and not evaluation.drop_last
    assert LoaderConfig(dtype="bf16", device="cpu").dtype == torch.bfloat16
    assert LoaderConfig(device="cpu").num_workers >= 1


def test_config_is_frozen():
    cfg = LoaderConfig(device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(crop="random_resized"), "needs a positive size"),
    (dict(crop="translate"), "needs pad > 0"),
    (dict(crop="center", size=224, resize=200), "smaller than the center crop"),
    (dict(hflip=1.5), r"hflip must be a number in \[0, 1\], got 1.5"),
    (dict(crop="random_resized", size=8, scale=(0.5, 0.1)), "scale must satisfy"),
])
def test_augmentation_rejects_inconsistent_recipes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Augmentation(**kwargs)


# ---------------------------------------------------------------- every field checked, with its name
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, bad", [
    ("batch_size", 64.0), ("batch_size", "64"), ("batch_size", True),
    ("num_workers", True), ("num_workers", 2.0), ("num_workers", "2"),
    ("train", 1), ("train", "yes"), ("shuffle", 1), ("shuffle", "False"), ("drop_last", 0),
    ("seed", -1), ("seed", 2 ** 32), ("seed", 1.5), ("seed", "0"), ("seed", True),
    ("channels_last", 1), ("channels_last", "true"),
    ("rank", 1.0), ("rank", "0"), ("rank", -1), ("rank", True),
    ("world_size", 2.0), ("world_size", "2"), ("world_size", 0), ("world_size", True),
    ("mean", "0.5"), ("mean", (0.5, "0.4")), ("mean", NAN), ("mean", (0.1, INF, 0.2)), ("mean", ()),
    ("std", "0.5"), ("std", NAN), ("std", INF), ("std", (0.2, -INF, 0.2)), ("std", 0.0), ("std", True),
    ("on_error", ["raise"]), ("on_error", None),
    ("augment", "digits"), ("device", 1.5), ("device", True), ("device", "tpu"), ("dtype", "int8"),
])
def test_every_loader_config_field_is_checked_and_named(field, bad):
    with pytest.raises((TypeError, ValueError), match=field):
        LoaderConfig(device="cpu", **{field: bad}) if field != "device" else LoaderConfig(device=bad)


@pytest.mark.parametrize("kwargs, name", [
    (dict(crop="random_resized", size=224.0), "size"), (dict(crop="random_resized", size="224"), "size"),
    (dict(crop="random_resized", size=True), "size"), (dict(crop="random_resized", size=-1), "size"),
    (dict(crop="translate", pad=2.0), "pad"), (dict(crop="translate", pad="2"), "pad"),
    (dict(crop="translate", pad=True), "pad"), (dict(pad=-1), "pad"),
    (dict(crop="center", size=224, resize=256.0), "resize"), (dict(crop="center", size=224, resize=0), "resize"),
    (dict(hflip=True), "hflip"), (dict(hflip="0.5"), "hflip"), (dict(hflip=NAN), "hflip"),
    (dict(scale=0.5), "scale"), (dict(scale=(0.1, 0.5, 1.0)), "scale"), (dict(scale=(0.1, NAN)), "scale"),
    (dict(scale=("0.1", 1.0)), "scale"), (dict(ratio=(0.75, INF)), "ratio"), (dict(ratio=None), "ratio"),
    (dict(crop=["none"]), "crop"), (dict(crop=None), "crop"),
])
def test_every_augmentation_field_is_checked_and_named(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name):
        Augmentation(**kwargs)


def test_valid_values_are_normalized_once():
    import numpy as np

    cfg = LoaderConfig(device="cpu", batch_size=np.int64(8), seed=np.int32(3), mean=[0.5], std=0.25,
                       shuffle=np.bool_(True), rank=0, world_size=1)
    assert type(cfg.batch_size) is int and type(cfg.seed) is int and cfg.shuffle is True
    assert cfg.mean == (0.5,) and cfg.std == (0.25,)
    aug = Augmentation(crop="random_resized", size=np.int64(32), scale=[0.5, 1], ratio=(1, 1), hflip=1)
    assert aug.size == 32 and aug.scale == (0.5, 1.0) and aug.ratio == (1.0, 1.0) and aug.hflip == 1.0


# ---------------------------------------------------------------- derived defaults follow the final values
def test_replace_rederives_what_the_user_did_not_set():
    train = LoaderConfig(device="cpu", num_workers=0)
    evaluation = train.replace(train=False)
    assert not evaluation.shuffle and not evaluation.drop_last and evaluation.num_workers == 0
    explicit = LoaderConfig(device="cpu", shuffle=True).replace(train=False)
    assert explicit.shuffle and not explicit.drop_last  # given explicitly: kept
    cfg, rest = LoaderConfig.from_kwargs(train, {"train": False, "depth": 3})
    assert not cfg.shuffle and not cfg.drop_last and rest == {"depth": 3}
    with pytest.raises(TypeError, match=r"no field\(s\) \['shufle'\]"):
        train.replace(shufle=False)


def test_make_loader_with_a_training_config_and_train_false_reads_every_sample_in_order():
    import numpy as np

    from conftest import decode_ids, indexed_source
    from fastdata import make_loader

    cfg = LoaderConfig(device="cpu", batch_size=32, num_workers=0)
    loader = make_loader(indexed_source(100), "torch", config=cfg, train=False)
    assert len(loader) == 4
    ids = np.concatenate([decode_ids(x) for x, _ in loader])
    np.testing.assert_array_equal(ids, np.arange(100))


# ---------------------------------------------------------------- torchrun: devices and cores per rank
@pytest.fixture
def four_gpus(monkeypatch):
    """torch.cuda stubbed as a machine with 4 GPUs whose current device is 0 (no process group yet)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_under_torchrun_the_default_cuda_device_is_local_rank(monkeypatch, four_gpus):
    from fastdata.config import resolve_device

    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device(None) == torch.device("cuda", 2)
    assert resolve_device("cuda") == torch.device("cuda", 2)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # explicit: kept
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=5 .* 4 CUDA device\(s\)"):
        resolve_device(None)
    for bad in ("x", "-1"):
        monkeypatch.setenv("LOCAL_RANK", bad)
        with pytest.raises(ValueError, match=f"^the LOCAL_RANK environment variable must be an integer >= 0, "
                                             f"got '{bad}'"):
            resolve_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", " ")   # empty: unset, as a launcher that forwards nothing leaves it
    assert resolve_device(None) == torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device(None) == torch.device("cuda", 0)


def test_under_torchrun_a_process_that_sees_only_its_own_gpu_trains_on_cuda_0(monkeypatch, four_gpus):
    """SLURM's --gpus-per-task (CUDA_VISIBLE_DEVICES per rank): rank 3 sees one GPU, cuda:0."""
    from fastdata.config import resolve_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert resolve_device(None) == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    # One GPU and no per-rank CUDA_VISIBLE_DEVICES: more processes than GPUs, refused as before.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3 .* sees 1 CUDA device\(s\).*CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda")
    # Two GPUs seen by a rank 3: no rule says which is its own.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3 .* sees 2 CUDA device\(s\)"):
        resolve_device("cuda")


@pytest.mark.cuda
def test_under_torchrun_the_default_cuda_device_is_local_rank_on_a_gpu(monkeypatch):
    from fastdata.config import resolve_device

    torch.cuda.init()  # fixes the visible-GPU count: until CUDA is up, device_count() re-reads CUDA_VISIBLE_DEVICES
    last = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(last))
    assert resolve_device(None) == torch.device("cuda", last)
    assert LoaderConfig(device="cuda").device == torch.device("cuda", last)
    monkeypatch.setenv("LOCAL_RANK", str(last + 1))
    # An exported CUDA_VISIBLE_DEVICES naming one GPU (SLURM, containers) reads as "each rank sees its own
    # GPU" (rank_gpu gives cuda:0; that rule has its own stubbed test): this test is about the other rule.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RuntimeError, match=f"LOCAL_RANK={last + 1}"):
        resolve_device("cuda")


def test_under_torchrun_each_rank_gets_its_share_of_the_cores(monkeypatch):
    import fastdata.config as config

    monkeypatch.setattr(config, "usable_cores", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert LoaderConfig(device="cpu").num_workers == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert LoaderConfig(device="cpu").num_workers == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert LoaderConfig(device="cpu").num_workers == 1  # at least one
    assert LoaderConfig(device="cpu", num_workers=5).num_workers == 5  # explicit: kept
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "")
    assert LoaderConfig(device="cpu").num_workers == 16  # empty: unset
    for bad in ("eight", "0", "-2"):   # no processes on the node: a broken launch, not "take every core"
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=f"^the LOCAL_WORLD_SIZE environment variable must be an integer >= 1, "
                                             f"got '{bad}'"):
            LoaderConfig(device="cpu")


# ---------------------------------------------------------------- mean/std units; augment's hint
def test_mean_std_in_pixel_units_are_refused_unless_scale_255_is_said():
    with pytest.raises(ValueError, match=r"mean=\(125.3, 123.0, 113.9\) is above 1.*pass scale=255"):
        LoaderConfig(mean=(125.3, 123.0, 113.9), std=(0.25,), device="cpu")
    with pytest.raises(ValueError, match="std=.*is above 1"):
        LoaderConfig(std=(63.0,), device="cpu")
    cfg = LoaderConfig(mean=(127.5,), std=(51.0,), scale=255, device="cpu")
    assert cfg.mean == (0.5,) and cfg.std == (0.2,)
    with pytest.raises(ValueError, match="scale .* must be 1 or 255"):
        LoaderConfig(scale=100, device="cpu")


def test_fractions_under_scale_255_are_refused_with_the_units_of_each_convention():
    """Accepted, mean=(0.5,), std=(0.25,), scale=255 normalized with a std of 0.25/255: batches in the thousands."""
    with pytest.raises(ValueError, match=r"mean=\(0.5,\) is at most 1 with scale=255: scale=255 means mean/std in "
                                         r"0-255 pixel units.*for \[0, 1\] units .* drop scale=255"):
        LoaderConfig(mean=(0.5,), std=(0.25,), scale=255, device="cpu")
    with pytest.raises(ValueError, match=r"std=\(0.25, 0.24, 0.26\) is at most 1 with scale=255"):
        LoaderConfig(std=(0.25, 0.24, 0.26), scale=255, device="cpu")
    src = ArraySource(np.zeros((16, 4, 4), np.uint8), np.arange(16) % 2)
    with pytest.raises(ValueError, match="std=.* is at most 1 with scale=255"):
        make_loader(src, "memory", batch_size=4, device="cpu", mean=(127.0,), std=(0.25,), scale=255)
    # A mean of zeros is no shift in either unit; a pixel-unit std above 1 says the units.
    assert LoaderConfig(mean=(0.0,), std=(255.0,), scale=255, device="cpu").std == (1.0,)


def test_a_sources_own_statistics_in_pixel_units_are_refused_by_the_loader():
    src = ArraySource(np.zeros((16, 4, 4), np.uint8), np.arange(16) % 2, mean=(33.3,), std=(78.0,))
    with pytest.raises(ValueError, match=r"mean=\(33.3,\) \(the statistics of ArraySource.*is above 1"):
        make_loader(src, "memory", batch_size=4, device="cpu")


def test_a_torchvision_transform_as_augment_says_where_transforms_go():
    from torchvision.transforms import v2

    with pytest.raises(TypeError, match=r"got Compose.*batch_transforms=\[\.\.\.\].*transform=\.\.\."):
        LoaderConfig(augment=v2.Compose([v2.RandomHorizontalFlip()]), device="cpu")


@pytest.mark.parametrize("fields, words", [
    (dict(crop="none", pad=4), "pad=4 only applies to crop='translate'"),
    (dict(crop="random_resized", size=32, resize=40), "resize=40 only applies to crop='center'"),
    (dict(crop="center", size=32, scale=(0.5, 1.0)), r"scale=\(0.5, 1.0\) only applies to crop='random_resized'"),
    (dict(crop="translate", pad=2, ratio=(1.0, 1.0)), "ratio=.* only applies to crop='random_resized'"),
    (dict(crop="none", size=32), "size=32 only applies to crop='random_resized' or 'center'"),
])
def test_a_field_the_crop_would_ignore_is_refused(fields, words):
    """Silently ignored, it would make a recipe other than the one written (pad=4 with no crop: no shift)."""
    with pytest.raises(ValueError, match=words):
        Augmentation(**fields)


def test_padding_applies_to_translate_only_and_names_the_choices():
    assert Augmentation.cifar_train() == Augmentation(crop="translate", pad=4, padding="reflect", hflip=0.5)
    with pytest.raises(ValueError, match=r"unknown padding 'mirror'; choose from \['constant', 'reflect', 'edge'\]"):
        Augmentation(crop="translate", pad=2, padding="mirror")
    with pytest.raises(ValueError, match="only applies to crop='translate'"):
        Augmentation(crop="center", size=8, padding="reflect")


def test_imagenet_eval_resizes_in_proportion_to_its_crop():
    """The evaluation recipe's shorter side is the crop's in the standard 256/224 proportion: with a fixed
    256, imagenet_eval(size=64) evaluated a 64-pixel patch of the middle of each photo."""
    from fastdata import Augmentation

    assert Augmentation.imagenet_eval().resize == 256
    assert Augmentation.imagenet_eval(size=64).resize == 73
    assert Augmentation.imagenet_eval(size=32, resize=40).resize == 40
    assert Augmentation.imagenet_eval(size=1).resize == 1
