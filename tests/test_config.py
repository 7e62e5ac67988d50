"""LoaderConfig and Augmentation check their values once, with errors that name them."""
import pytest
import torch

from fastdata import Augmentation, LoaderConfig


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_batch_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
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
    with pytest.raises(Exception):
        cfg.batch_size = 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(crop="random_resized"), "needs a positive size"),
    (dict(crop="translate"), "needs pad > 0"),
    (dict(crop="center", size=224, resize=200), "smaller than the center crop"),
    (dict(hflip=1.5), "probability"),
    (dict(crop="random_resized", size=8, scale=(0.5, 0.1)), "scale must satisfy"),
])
def test_augmentation_rejects_inconsistent_recipes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Augmentation(**kwargs)
