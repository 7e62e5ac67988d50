"""decode: ids → uint8 images and the ids kept; one counter (loader.skipped) and one warning."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from conftest import CONCRETE, indexed_source
from fastdata import Augmentation, make_loader
from fastdata.datasets import DatasetSource, ImageFolder, make_image_folder
from fastdata.decode import BatchDecoder, decode, warn_skipped
from fastdata.errors import DecodeError

EVAL = Augmentation(crop="center", size=16, resize=16)


@pytest.fixture(scope="module")
def folder_with_a_bad_file(tmp_path_factory):
    """2 classes x 3 small JPEGs plus one empty .jpg (id 3: it sorts first in class_001)."""
    root = make_image_folder(tmp_path_factory.mktemp("photos"), classes=2, per_class=3, seed=1,
                             size_range=((40, 50), (30, 40)))
    (root / "class_001" / "img_00000_bad.jpg").write_bytes(b"")
    return root


def test_files_skip_returns_the_kept_ids_in_order(folder_with_a_bad_file):
    src = ImageFolder(folder_with_a_bad_file)
    bad = [i for i, p in enumerate(src.paths) if p.endswith("_bad.jpg")]
    assert len(src) == 7 and len(bad) == 1
    d = decode(src, np.arange(7), EVAL, np.random.default_rng(0), on_error="skip")
    assert d.kept.tolist() == [i for i in range(7) if i != bad[0]]
    assert d.images.shape == (6, 16, 16, 3) and d.images.dtype == np.uint8
    assert np.array_equal(d.labels, src.labels[d.kept])
    with pytest.raises(DecodeError, match="_bad.jpg"):
        decode(src, np.arange(7), EVAL, np.random.default_rng(0), on_error="raise")


def test_arrays_and_datasets_keep_every_id():
    src = indexed_source(20, size=8)
    ids = np.array([5, 1, 7])
    d = decode(src, ids, Augmentation(), np.random.default_rng(0))
    assert d.kept.tolist() == [5, 1, 7] and np.array_equal(d.images, src.images[ids])
    chw = torch.from_numpy(src.images).permute(0, 3, 1, 2)    # a torch Dataset returns (C, H, W)
    ds = torch.utils.data.TensorDataset(chw, torch.from_numpy(src.labels))
    d2 = decode(DatasetSource(ds), ids, Augmentation(), np.random.default_rng(0))
    assert d2.kept.tolist() == [5, 1, 7] and np.array_equal(d2.images, d.images)
    assert np.array_equal(d2.labels, d.labels)


def test_a_skipped_file_does_not_change_the_other_files_pixels(folder_with_a_bad_file, tmp_path):
    """The decoder draws per file in order; a bad file without a header draws nothing, so the good
    files get the same random crops as in a folder without it."""
    src = ImageFolder(folder_with_a_bad_file)
    rrc = Augmentation(crop="random_resized", size=16, hflip=0.5)
    with_bad = decode(src, np.arange(7), rrc, np.random.default_rng(3), on_error="skip")
    good = with_bad.kept
    alone = decode(src, good, rrc, np.random.default_rng(3))
    assert np.array_equal(with_bad.images, alone.images)


def test_the_batch_decoder_refuses_a_bad_on_error_and_photos_without_a_fixed_size(folder_with_a_bad_file):
    src = ImageFolder(folder_with_a_bad_file)
    with pytest.raises(ValueError, match=r"unknown on_error 'ignore'; choose from \['raise', 'skip'\]"):
        BatchDecoder(src, EVAL, on_error="ignore")
    with pytest.raises(ValueError, match="crop that fixes the output size"):
        BatchDecoder(src, Augmentation(crop="translate", pad=2))
    images, labels, kept = BatchDecoder(src, EVAL, "skip")[(np.arange(7), 0)]
    assert len(images) == len(labels) == len(kept) == 6


def test_under_ddp_files_the_memory_cache_left_out_are_reported_by_rank_0_alone(folder_with_a_bad_file,
                                                                                monkeypatch):
    """Every rank's cache leaves the same broken file out: rank 1 (RANK/WORLD_SIZE, no process group)
    counts it in loader.skipped but does not warn, so a 2-rank job warns once per file, not twice."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = make_loader(ImageFolder(folder_with_a_bad_file), "memory", batch_size=2, train=False,
                             device="cpu", num_workers=0, augment=EVAL, on_error="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        n = sum(len(y) for _, y in loader)
    assert n == 3 and loader.skipped == 1


def test_one_warning_text():
    with pytest.warns(RuntimeWarning, match=r"^torch: skipped 2 undecodable sample\(s\) in epoch 4 "
                                            r"\(on_error='skip'; loader.skipped_ids names them\)$"):
        warn_skipped("torch", 2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_skipped("torch", 0, 3)   # nothing skipped: no warning


@pytest.mark.parametrize("backend", CONCRETE)
def test_every_backend_counts_skips_in_loader_skipped_and_warns_once_per_epoch(backend,
                                                                              folder_with_a_bad_file):
    """memory included: its cache-time skips are missing from every epoch, so every epoch reports them."""
    for epoch in range(2):
        if epoch == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                loader = make_loader(ImageFolder(folder_with_a_bad_file), backend, batch_size=4, train=False,
                                     device="cpu", num_workers=0, augment=EVAL, on_error="skip")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            n = sum(len(y) for _, y in loader)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert n == 6 and loader.skipped == 1, (backend, epoch, n, loader.skipped)
        assert messages == [f"{backend}: skipped 1 undecodable sample(s) in epoch {epoch + 1} (on_error='skip'; "
                        f"loader.skipped_ids names them)"]
    loader.close()


# ---------------------------------------------------------------- per-sample transforms (ImageFolder(transform=))
def _crop_corner(image):
    """A deterministic transform: the top-left 12x12 of the decoded RGB PIL image."""
    return image.crop((0, 0, 12, 12))


def test_a_files_transform_sees_the_full_rgb_decode_and_may_return_pil_tensor_or_array(folder_with_a_bad_file):
    from PIL import Image

    full = ImageFolder(folder_with_a_bad_file)
    good = np.array([i for i, p in enumerate(full.paths) if not p.endswith("_bad.jpg")])
    outputs = {
        "pil": _crop_corner,
        "tensor": lambda im: torch.from_numpy(np.array(_crop_corner(im))).permute(2, 0, 1),
        "array": lambda im: np.array(_crop_corner(im)),
        "grey": lambda im: _crop_corner(im).convert("L"),
    }
    seen = []
    for kind, tf in outputs.items():
        src = ImageFolder(folder_with_a_bad_file, transform=tf)
        assert src.sample_transform is tf and src.default_augmentation(True) == Augmentation.none()
        d = decode(src, good, Augmentation.none(), np.random.default_rng(0))
        assert d.images.shape == (6, 12, 12, 3) and d.images.dtype == np.uint8, kind
        if kind == "grey":
            assert (d.images[..., 0] == d.images[..., 2]).all()
            continue
        seen.append(d.images)
    for p, img in zip(np.asarray(full.paths)[good], seen[0]):
        with Image.open(p) as im:
            np.testing.assert_array_equal(img, np.asarray(im.convert("RGB"))[:12, :12])
    assert all(np.array_equal(seen[0], s) for s in seen[1:])


def test_a_random_transform_repeats_by_seed_and_leaves_the_callers_generators_alone(folder_with_a_bad_file):
    import random

    from torchvision import transforms as T

    src = ImageFolder(folder_with_a_bad_file, transform=T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip()]))
    ids = np.array([i for i, p in enumerate(src.paths) if not p.endswith("_bad.jpg")])
    state = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    a = decode(src, ids, None, np.random.default_rng(1))
    assert torch.equal(torch.get_rng_state(), state[0]) and random.getstate() == state[1]
    assert np.array_equal(np.random.get_state()[1], state[2])
    torch.manual_seed(99)                      # what the caller's generator holds does not matter
    b = decode(src, ids, None, np.random.default_rng(1))
    assert np.array_equal(a.images, b.images)
    assert not np.array_equal(a.images, decode(src, ids, None, np.random.default_rng(2)).images)
    # A skipped file does not change the draws of the samples before it nor after it: each position's seed
    # is drawn up front, as if the file had decoded.
    with_bad = decode(src, np.arange(7), None, np.random.default_rng(1), on_error="skip")
    alone = decode(src, np.arange(7)[with_bad.kept], None, np.random.default_rng(1))
    assert len(with_bad.kept) == 6 and with_bad.images.shape == (6, 16, 16, 3)
    first_bad = int(np.flatnonzero(~np.isin(np.arange(7), with_bad.kept))[0])
    np.testing.assert_array_equal(with_bad.images[:first_bad], alone.images[:first_bad])


def test_a_transform_output_that_cannot_stack_or_is_float_is_an_error_naming_the_fix(folder_with_a_bad_file):
    ids = np.array([0, 1, 2])
    floats = ImageFolder(folder_with_a_bad_file, transform=lambda im: torch.zeros(3, 4, 4))
    with pytest.raises(TypeError, match=r"returned a torch.float32 tensor for '.*img_00000.jpg': drop "
                                        r"ToDtype/Normalize/ToTensor from the transform and pass mean=/std="):
        decode(floats, ids, None, np.random.default_rng(0))
    mixed = ImageFolder(folder_with_a_bad_file, transform=lambda im: im)   # photos of different sizes
    with pytest.raises(ValueError, match=r"different sizes in one batch: \d+x\d+ for '.*' and \d+x\d+ for "
                                         r"'.*'; end the transform with a fixed-size crop or resize"):
        decode(mixed, ids, None, np.random.default_rng(0))
    with pytest.raises(TypeError, match="returned a str for"):
        decode(ImageFolder(folder_with_a_bad_file, transform=lambda im: "x"), ids, None, np.random.default_rng(0))


def test_a_compose_ending_in_float_is_refused_when_the_source_is_made(folder_with_a_bad_file):
    from torchvision import transforms as T
    from torchvision.transforms import v2

    for tf in (T.Compose([T.Resize(16), T.ToTensor()]),
               T.Compose([T.CenterCrop(16), T.ToTensor(), T.Normalize((0.5,) * 3, (0.2,) * 3)]),
               v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]),
               T.Compose([T.Compose([T.CenterCrop(16), T.ToTensor()]), T.RandomErasing()])):
        with pytest.raises(TypeError, match="ends with float images .*drop ToDtype/Normalize/ToTensor"):
            ImageFolder(folder_with_a_bad_file, transform=tf)
    # uint8 at the end is fine: ToImage, or a float step converted back
    ImageFolder(folder_with_a_bad_file, transform=v2.Compose([v2.CenterCrop(16), v2.ToImage()]))
    ImageFolder(folder_with_a_bad_file, transform=T.Compose([T.PILToTensor(), T.ConvertImageDtype(torch.float32),
                                                             T.ConvertImageDtype(torch.uint8)]))
    with pytest.raises(TypeError, match="must be callable"):
        ImageFolder(folder_with_a_bad_file, transform="flip")


def test_a_transform_and_a_loader_recipe_together_are_refused(folder_with_a_bad_file):
    from fastdata.datasets import check_transform_and_augment

    src = ImageFolder(folder_with_a_bad_file, transform=_crop_corner)
    check_transform_and_augment(src, None)
    check_transform_and_augment(src, Augmentation.none())
    check_transform_and_augment(ImageFolder(folder_with_a_bad_file), Augmentation.imagenet_train())
    with pytest.raises(ValueError, match=r"has its own per-sample transform \(<function _crop_corner.*\), which "
                                         r"is its augmentation; augment=.* would apply a second recipe"):
        check_transform_and_augment(src, Augmentation.imagenet_eval(size=8, resize=8))
    with pytest.raises(ValueError, match="would apply a second recipe"):
        decode(src, np.array([0]), Augmentation(hflip=0.5), np.random.default_rng(0))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_torch_backend_runs_an_image_folder_transform(folder_with_a_bad_file, workers):
    from torchvision import transforms as T

    src = ImageFolder(folder_with_a_bad_file, transform=T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip()]))
    kw = dict(batch_size=3, device="cpu", seed=4, on_error="skip", drop_last=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # the skipped file's warning
        x = torch.cat([x for x, _ in make_loader(src, "torch", num_workers=workers, **kw)])
        ref = torch.cat([x for x, _ in make_loader(src, "torch", num_workers=0, **kw)])
    assert x.shape == (6, 3, 16, 16) and torch.equal(x, ref)


def test_a_dataset_transform_is_seeded_per_sample_too():
    from torchvision import transforms as T

    class Noisy(torch.utils.data.Dataset):
        transform = T.RandomCrop(4, padding=2)

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return self.transform(torch.full((1, 4, 4), 10 + i, dtype=torch.uint8)), 0

    src = DatasetSource(Noisy())
    assert src.sample_transform is Noisy.transform
    a = decode(src, np.arange(8), Augmentation(), np.random.default_rng(5))
    torch.manual_seed(1)
    b = decode(src, np.arange(8), Augmentation(), np.random.default_rng(5))
    assert np.array_equal(a.images, b.images) and (a.images == 0).any()   # padded: the crop ran


def test_on_error_raises_or_skips_decode_errors_only():
    """OnError is the one place that decides raise-or-skip: a DecodeError is re-raised under "raise" and
    turned into None under "skip"; any other error propagates under both; refuse() raises under "raise"
    (without the handled exception's context) and returns under "skip"."""
    from fastdata.errors import DecodeError
    from fastdata.images.on_error import OnError

    def broken():
        raise DecodeError("a.jpg", "truncated")

    def buggy():
        raise KeyError("not a decode failure")

    skip, strict = OnError("skip"), OnError("raise")
    assert skip.attempt(lambda x: x * 2, 21) == 42 and strict.attempt(lambda: 7) == 7
    assert skip.attempt(broken) is None
    with pytest.raises(DecodeError, match="a.jpg"):
        strict.attempt(broken)
    for policy in (skip, strict):
        with pytest.raises(KeyError):
            policy.attempt(buggy)
    assert skip.refuse("b.jpg", "no header") is None
    try:
        raise RuntimeError("DALI's own error")
    except RuntimeError:
        with pytest.raises(DecodeError, match="b.jpg.*no header") as e:
            strict.refuse("b.jpg", "no header")
    assert e.value.__suppress_context__
    assert OnError(skip).skips and not OnError("raise").skips
    with pytest.raises(ValueError, match=r"^unknown on_error 'ignore'; choose from \['raise', 'skip'\]$"):
        OnError("ignore")


def test_no_backend_decides_raise_or_skip_itself():
    """Every backend hands its per-file failures to OnError: none compares on_error itself."""
    from pathlib import Path

    import fastdata.backends

    root = Path(fastdata.backends.__file__).parent
    found = [f"{f.relative_to(root)}:{n}" for f in sorted(root.rglob("*.py"))
             for n, line in enumerate(f.read_text().splitlines(), 1)
             if "on_error ==" in line or "on_error !=" in line or "on_error in" in line]
    assert not found, f"backends that compare on_error themselves (use fastdata.images.on_error.OnError): {found}"
