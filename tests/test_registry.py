"""make_loader's dispatch: names, missing packages, devices, options, auto's choice."""
import logging
import re

import numpy as np
import pytest
import torch

from conftest import indexed_source
from fastdata import MissingDependency, available_backends, make_loader, registry
from fastdata.backends.base import Loader
from fastdata.datasets import ArraySource, ImageFolder, SyntheticDigits


def test_unknown_backend_lists_the_choices():
    # The choices are the table's rows (installed or not), so a new row needs no edit here.
    assert registry.choices()[:5] == ["auto", "torch", "memory", "prefetch", "dali"]
    with pytest.raises(ValueError, match=re.escape(f"unknown backend 'tf'; choose from {registry.choices()}")):
        make_loader(indexed_source(10), backend="tf")


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(registry.BACKENDS, "dali", registry.BackendSpec(
        "dali", "fastdata.backends.dali:DaliLoader", needs="nvidia_dali_not_here.plugin",
        install="pip install nvidia-dali-cuda120", devices=("cuda",)))
    registry.clear_import_cache()
    try:
        assert "dali" not in available_backends()
        assert "dali" in registry.choices()          # still listed, so the doctor can say how to install it
        with pytest.raises(MissingDependency, match="pip install nvidia-dali-cuda120"):
            make_loader(indexed_source(10), backend="dali", batch_size=5)
    finally:
        registry.clear_import_cache()


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
    assert "picked 'memory'" in caplog.text and "fits in half the free RAM" in caplog.text


def test_auto_falls_back_to_torch_when_the_cache_does_not_fit(monkeypatch, caplog):
    import fastdata.backends.memory as memory

    monkeypatch.setattr(memory.budgeting, "free_bytes", lambda device: 1000)
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


class _Mine(Loader):
    """A stand-in backend class: the registry only stores and returns it (a Loader subclass, which the
    registry checks)."""


def test_register_adds_a_backend_as_one_row_and_unregister_removes_it():
    spec = registry.register("mine", _Mine)
    try:
        assert registry.BACKENDS["mine"] is spec and spec.order > max(
            s.order for s in registry.specs() if s.name != "mine")       # after every built-in by default
        assert "mine" in available_backends() and registry.backend_class("mine") is _Mine
    finally:
        registry.unregister("mine")
    assert "mine" not in available_backends()
    with pytest.raises(ValueError, match=r"unknown backend 'mine'; choose from \['auto', 'torch'"):
        registry.backend_class("mine")


def test_a_registered_backend_whose_package_is_missing_stays_listed_with_its_install_hint():
    registry.register("ghost", "ghost_pkg.loader:GhostLoader", needs="ghost_pkg", install="pip install ghost")
    try:
        assert "ghost" in registry.choices() and "ghost" not in available_backends()
        assert not registry.spec("ghost").available and registry.spec("torch").unavailable_reason is None
        assert registry.spec("ghost").unavailable_reason == ("backend 'ghost' needs ghost_pkg, which does not "
                                                             "import here; install: pip install ghost")
        with pytest.raises(MissingDependency, match=r"needs ghost_pkg.*install it with: pip install ghost"):
            make_loader(indexed_source(10), backend="ghost", batch_size=5)
    finally:
        registry.unregister("ghost")


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "auto", "target": "a:B"}, "other than 'auto'"),
    ({"name": "x", "target": "no_colon"}, "package.module:Class"),
    ({"name": "x", "target": "a:B", "devices": ("tpu",)}, r"unknown device type\(s\) \['tpu'\]"),
])
def test_a_bad_row_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        registry.register(**kwargs)


def test_auto_follows_the_tables_preference_order(monkeypatch, caplog):
    from fastdata.backends.torch_loader import TorchLoader

    class Preferred(TorchLoader):
        name = "preferred"

    monkeypatch.setitem(registry.BACKENDS, "preferred", registry.BackendSpec("preferred", Preferred, order=0))
    with caplog.at_level(logging.INFO, logger="fastdata"):
        loader = make_loader(SyntheticDigits(200), batch_size=50, device="cpu", num_workers=0)
    try:
        assert type(loader) is Preferred and "picked 'preferred'" in caplog.text
    finally:
        loader.close()


def test_the_built_in_rows_keep_autos_measured_order():
    # memory first (no decoding after its cache), then DALI and prefetch on CUDA only, torch last.
    order = [s.name for s in registry.by_preference()]
    assert [n for n in order if n in ("memory", "dali", "prefetch", "torch")] == ["memory", "dali", "prefetch", "torch"]
    assert registry.spec("dali").devices == registry.spec("prefetch").devices == ("cuda",)


def test_auto_accepts_an_option_of_a_backend_not_installed_here(monkeypatch):
    # DALI missing: its read_threads is still a real option (not a typo), so auto takes it and drops it.
    monkeypatch.setitem(registry.BACKENDS, "dali", registry.BackendSpec(
        "dali", "fastdata.backends.dali:DaliLoader", needs="nvidia_dali_not_here.plugin", devices=("cuda",)))
    registry.clear_import_cache()
    try:
        loader = make_loader(SyntheticDigits(200), batch_size=50, device="cpu", read_threads=2)
        assert loader.name == "memory"
        with pytest.raises(TypeError, match=r"unknown option\(s\) \['read_thread'\].*'read_threads'"):
            make_loader(SyntheticDigits(200), batch_size=50, device="cpu", read_thread=2)
    finally:
        registry.clear_import_cache()


# ---------------------------------------------------------------- auto says its choice; like=; indices=
def test_auto_reports_its_choice_in_one_line_without_any_logging_setup():
    # A fresh interpreter: no handler configured, as in a user's script. The line reaches stderr.
    import subprocess
    import sys

    code = ("import numpy as np; from fastdata import make_loader\n"
            "x = np.zeros((64, 8, 8), np.uint8); y = np.arange(64) % 4\n"
            "make_loader((x, y), batch_size=16, device='cpu', num_workers=0)\n"
            "make_loader((x, y), batch_size=16, device='cpu', num_workers=0, quiet=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "picked" in line]
    assert len(lines) == 1 and "backend 'auto' picked 'memory'" in lines[0]  # quiet=True said nothing


def test_an_eval_loader_like_the_training_loader_takes_its_statistics():
    rng = np.random.default_rng(0)
    train = ArraySource(rng.integers(0, 100, (64, 8, 8, 3), dtype=np.uint8), np.arange(64) % 4)
    test = ArraySource(rng.integers(150, 256, (32, 8, 8, 3), dtype=np.uint8), np.arange(32) % 4)
    tl = make_loader(train, "memory", batch_size=16, device="cpu", num_workers=0, quiet=True)
    el = make_loader(test, "memory", like=tl)
    assert el.mean == tl.mean and el.std == tl.std and el.mean != tuple(test.mean)
    assert not el.config.train and not el.config.shuffle and not el.config.drop_last
    assert el.config.batch_size == 16 and el.device == tl.device
    # The batch is the test pixels normalized with the TRAINING statistics.
    images, _ = next(iter(el))
    mean, std = torch.tensor(tl.mean).view(1, 3, 1, 1), torch.tensor(tl.std).view(1, 3, 1, 1)
    want = torch.from_numpy(test.images[:16]).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(images, (want - mean) / std)
    # keyword arguments still override
    assert make_loader(test, "memory", like=tl, batch_size=8).config.batch_size == 8


def _train_and_eval_batches(train_loader, source, **kwargs):
    """The training loader's normalization of ``source``'s first 16 images, and an eval loader's batch."""
    want = train_loader.normalize(torch.from_numpy(source.images[:16]))
    return want, next(iter(make_loader(source, "memory", like=train_loader, **kwargs)))[0]


def test_like_under_scale_255_does_not_divide_the_inherited_statistics_again():
    """The inherited mean/std are already in [0, 1] units; a scale=255 said again (with the config, or
    with statistics of the caller's own) divided them by 255 a second time."""
    from fastdata import LoaderConfig

    rng = np.random.default_rng(0)
    src = ArraySource(rng.integers(0, 256, (32, 8, 8, 3), dtype=np.uint8), np.arange(32) % 4)
    pixel_units = dict(mean=(125.0, 120.0, 110.0), std=(60.0, 61.0, 62.0), scale=255)
    cfg = LoaderConfig(batch_size=16, device="cpu", num_workers=0, **pixel_units)
    tl = make_loader(src, "memory", config=cfg, quiet=True)
    assert tl.mean == (125 / 255, 120 / 255, 110 / 255)
    for kwargs in (dict(scale=255), dict(config=LoaderConfig(batch_size=16, device="cpu", scale=255)),
                   dict(config=cfg), dict(scale=255, std=pixel_units["std"])):
        want, got = _train_and_eval_batches(tl, src, **kwargs)
        assert torch.equal(got, want), kwargs
    # mean in pixel units of the caller's own, std inherited: still one division.
    want, got = _train_and_eval_batches(tl, src, scale=255, mean=(125.0, 120.0, 110.0))
    assert torch.equal(got, want)


def test_like_with_a_config_evaluates_unless_train_is_said():
    """config= with like= gave a training loader (shuffled, partial batches dropped, the training recipe)."""
    from fastdata import LoaderConfig

    rng = np.random.default_rng(0)
    src = ArraySource(rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8), np.arange(20) % 4)
    tl = make_loader(src, "memory", batch_size=8, device="cpu", num_workers=0, quiet=True)
    el = make_loader(src, "memory", like=tl, config=LoaderConfig(batch_size=8, device="cpu", num_workers=0))
    assert not el.config.train and not el.config.shuffle and not el.config.drop_last
    assert [len(y) for _, y in el] == [8, 8, 4]
    assert torch.equal(torch.cat([y for _, y in el]), torch.arange(20) % 4)   # in order
    told = make_loader(src, "memory", like=tl, config=LoaderConfig(batch_size=8, device="cpu"), train=True)
    assert told.config.train and told.config.shuffle


def test_like_refuses_a_test_folder_whose_classes_differ(tmp_path):
    from fastdata.datasets import make_image_folder

    make_image_folder(tmp_path / "train", classes=3, per_class=2, size_range=((40, 48), (40, 48)))
    make_image_folder(tmp_path / "test", classes=3, per_class=1, size_range=((40, 48), (40, 48)))
    (tmp_path / "test" / "class_000").rename(tmp_path / "test" / "class_00x")
    tl = make_loader(ImageFolder(tmp_path / "train"), "torch", batch_size=2, device="cpu", num_workers=0)
    with pytest.raises(ValueError, match="classes of .* differ from the training loader's: class 0"):
        make_loader(ImageFolder(tmp_path / "test"), "torch", like=tl)


def test_like_takes_a_fastdata_loader():
    with pytest.raises(TypeError, match="like= takes a fastdata loader"):
        make_loader(indexed_source(64), "memory", like=object(), device="cpu")


def test_auto_says_what_memory_allocates_for_an_array(caplog, monkeypatch):
    """An array normalized ahead (float32, 4x the uint8 bytes) was reported as "no copy to make";
    one read in place, as a 0.0 MiB cache."""
    import fastdata.backends.memory as memory

    with caplog.at_level(logging.INFO, logger="fastdata"):
        loader = make_loader(SyntheticDigits(2000), batch_size=50, device="cpu", train=False)
    assert loader.name == "memory" and loader.ready is not None
    assert f"normalized ahead in float32 ({loader.footprint / 2**20:.1f} MiB" in caplog.text, caplog.text
    caplog.clear()
    monkeypatch.setattr(memory.loader, "uses_ready", lambda *a: False)    # too large to normalize ahead
    with caplog.at_level(logging.INFO, logger="fastdata"):
        loader = make_loader(SyntheticDigits(2000), batch_size=50, device="cpu", train=False)
    assert loader.ready is None and loader.footprint < 2000 * 28 * 28   # its labels only, no image copy
    assert "reads the source's array in RAM as it is (no copy to make)" in caplog.text
    assert "0.0 MiB" not in caplog.text


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_dataloader_keywords_say_where_their_job_went(backend):
    """A user moving from DataLoader passes pin_memory=, sampler=, collate_fn= out of habit: the refusal
    says, for each, what fastdata does instead (it listed the backend's options only)."""
    with pytest.raises(TypeError) as e:
        make_loader(SyntheticDigits(64), backend, batch_size=8, pin_memory=True, sampler=None, collate_fn=None)
    said = str(e.value)
    assert "unknown option(s) ['collate_fn', 'pin_memory', 'sampler']" in said
    for hint in ("pin_memory: drop it", "sampler: the order is the loader's", "collate_fn: batches are collated",
                 "batch_transforms=", "Subset(dataset, ids)"):
        assert hint in said, said


def test_an_image_size_keyword_says_where_the_size_is_set():
    """make_loader(src, image_size=64): the refusal listed the backend's options, none of which is a size;
    the size is the augmentation recipe's, and the refusal now says so."""
    with pytest.raises(TypeError) as e:
        make_loader(SyntheticDigits(64), "torch", batch_size=8, image_size=64)
    assert "image_size: the size is the augmentation recipe's: augment=Augmentation.imagenet_train(size=S)" \
        in str(e.value)
