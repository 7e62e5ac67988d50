"""make_loader's dispatch: names, missing packages, devices, options, auto's choice."""
import logging

import pytest
import torch

from conftest import indexed_source
from fastdata import MissingDependency, available_backends, make_loader, registry
from fastdata.datasets import ImageFolder, SyntheticDigits


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'tf'; choose from \['auto', 'torch', 'memory', "
                                         r"'prefetch', 'dali'\]"):
        make_loader(indexed_source(10), backend="tf")


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(registry.BACKENDS, "dali", ("fastdata.backends.dali", "DaliLoader",
                                                    "nvidia_dali_not_here.plugin", "pip install nvidia-dali-cuda120"))
    registry._importable.cache_clear()
    try:
        assert "dali" not in available_backends()
        with pytest.raises(MissingDependency, match="pip install nvidia-dali-cuda120"):
            make_loader(indexed_source(10), backend="dali", batch_size=5)
    finally:
        registry._importable.cache_clear()


def test_available_backends_lists_the_core_ones():
    names = available_backends()
    assert names[0] == "auto" and {"torch", "memory", "prefetch"} <= set(names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="'cuda' was requested but CUDA is not available"):
        make_loader(indexed_source(10), backend="torch", device="cuda")


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['prefetch_depth'\].*'prefetch_factor'"):
        make_loader(indexed_source(10), backend="torch", batch_size=5, prefetch_depth=3)


def test_auto_picks_memory_when_the_cache_fits_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="fastdata"):
        loader = make_loader(SyntheticDigits(200), batch_size=50, device="cpu")
    assert loader.name == "memory"
    assert "picked 'memory'" in caplog.text and "fits in the free RAM" in caplog.text


def test_auto_falls_back_to_torch_when_the_cache_does_not_fit(monkeypatch, caplog):
    import fastdata.backends.memory as memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
    with caplog.at_level(logging.INFO, logger="fastdata"):
        loader = make_loader(SyntheticDigits(200), batch_size=50, device="cpu", num_workers=0)
    assert loader.name == "torch"
    assert "does not fit" in caplog.text


def test_auto_caches_a_small_photo_folder(photo_folder, caplog):
    with caplog.at_level(logging.INFO, logger="fastdata"):
        loader = make_loader(ImageFolder(photo_folder), batch_size=6, device="cpu", num_workers=0)
    assert loader.name == "memory" and "fits in the free" in caplog.text


def test_auto_refuses_an_option_no_backend_knows_instead_of_dropping_it():
    with pytest.raises(TypeError, match=r"backend 'auto' got unknown option\(s\) \['prefetch_factr'\].*"
                                        r"'prefetch_factor'"):
        make_loader(SyntheticDigits(200), batch_size=50, device="cpu", prefetch_factr=4)
    # An option of a backend auto did not pick is still fine: auto passes each backend its own.
    loader = make_loader(SyntheticDigits(200), batch_size=50, device="cpu", prefetch_factor=4, depth=3)
    assert loader.name == "memory"


def test_auto_weighs_the_memory_reserve_the_user_passes(photo_folder, caplog):
    # A reserve of all but one byte of RAM leaves no room for the cache: auto must see it, not only the
    # memory backend it would then hand the option to.
    with caplog.at_level(logging.INFO, logger="fastdata"):
        loader = make_loader(ImageFolder(photo_folder), batch_size=6, device="cpu", num_workers=0,
                             memory_reserve=0.999999)
    assert loader.name == "torch" and "does not fit" in caplog.text
