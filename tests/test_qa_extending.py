"""Extending fastdata as a user does: a Source of one's own, a backend of one's own, a batch transform of
one's own. Each either works on every backend that claims to take it, with the contract held, or is
refused when the loader (or the registry row) is made, naming the problem and the fix."""
from __future__ import annotations

import io
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import BACKENDS as INSTALLED
from fastdata import Augmentation, make_loader, registry
from fastdata.backends.base import Loader
from fastdata.batch_transforms import BatchTransform
from fastdata.datasets import IMAGENET_MEAN, IMAGENET_STD, Source, SourceKind, SyntheticDigits
from fastdata.decode import decode

CPU_BACKENDS = [b for b in INSTALLED if b != "prefetch"]   # prefetch is torch's on the CPU


def _jpeg(seed: int, size=(40, 52)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


class Blobs(Source):
    """What a user writes after docs/sources.md's table: photos held in a dict of name -> bytes."""

    kind = SourceKind.FILES

    def __init__(self, blobs: dict, labels):
        self.keys = sorted(blobs)
        self.blobs = blobs
        self.labels = labels
        self.num_classes, self.channels, self.name = 3, 3, "blobs"
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD

    def read_stamped(self, i):
        data = self.blobs[self.keys[i]]
        return data, len(data)

    def sample_name(self, i):
        return f"blobs:{self.keys[i]}"


@pytest.fixture(scope="module")
def blobs():
    return {f"{i:02d}.jpg": _jpeg(i) for i in range(12)}


SMALL = Augmentation.imagenet_eval(size=32)   # a recipe of its own: these tests are not about the default


def _batches(source, backend, **kwargs):
    kwargs = {"batch_size": 4, "device": "cpu", "num_workers": 0, "quiet": True, "augment": SMALL, **kwargs}
    loader = make_loader(source, backend, **kwargs)
    return loader, list(loader)


# ------------------------------------------------------------------------------------------ sources
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_photo_source_without_a_recipe_of_its_own_gets_the_photo_recipe(blobs, backend):
    # Source.default_augmentation was none for every kind: a FILES source following the docs' table was
    # refused by every backend ("holds photos of different sizes ... needs a crop").
    _, out = _batches(Blobs(blobs, np.arange(12) % 3), backend, augment=None)
    assert [tuple(x.shape) for x, _ in out] == [(4, 3, 224, 224)] * 3


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float64])
def test_labels_of_another_integer_dtype_come_out_int64(blobs, backend, dtype):
    # int32 labels came out int32 (torch, memory) and whole floats float64: the contract says int64.
    _, out = _batches(Blobs(blobs, (np.arange(12) % 3).astype(dtype)), backend)
    assert all(y.dtype == torch.int64 for _, y in out)
    assert torch.cat([y for _, y in out]).sort().values.tolist() == sorted((np.arange(12) % 3).tolist())


@pytest.mark.parametrize("labels, error, message", [
    (np.array(["cat", "dog", "cow"] * 4), TypeError, r"Blobs.labels holds names .*'cat'.*classes.index"),
    (np.arange(12) % 3 + 0.5, ValueError, r"Blobs.labels must be integers >= 0; Blobs.labels\[0\] is 0.5"),
    (np.arange(12), ValueError, r"Blobs.labels must be integers in \[0, 3\).*Blobs.labels\[3\] is 3"),
    (list(np.arange(12) % 3), None, None),
])
def test_labels_that_are_names_fractions_or_out_of_range_are_refused_when_the_loader_is_made(blobs, labels, error,
                                                                                             message):
    source = Blobs(blobs, labels)
    if error is None:   # a list of ints is labels
        loader, out = _batches(source, "torch")
        assert len(out) == 3
        return
    with pytest.raises(error, match=message):
        make_loader(source, "torch", batch_size=4, device="cpu", num_workers=0, augment=SMALL)


@pytest.mark.parametrize("length", [16, 8])
def test_a_len_that_disagrees_with_the_labels_is_refused(blobs, length):
    # 16: an IndexError from inside a batch; 8: a third of the samples silently never read.
    class Lying(Blobs):
        def __len__(self):
            return length

    with pytest.raises(ValueError, match=rf"len\(Lying\) is {length} but Lying.labels has 12"):
        make_loader(Lying(blobs, np.arange(12) % 3), "torch", batch_size=4, device="cpu", num_workers=0,
                    augment=SMALL)


def test_a_missing_attribute_is_named_with_what_a_source_sets(blobs):
    source = Blobs(blobs, np.arange(12) % 3)
    del source.mean
    with pytest.raises(TypeError, match=r"Blobs has no mean: a Source sets labels.*docs/sources.md"):
        make_loader(source, "torch", batch_size=4, device="cpu", num_workers=0, augment=SMALL)


def test_a_photo_source_declaring_one_channel_is_refused(blobs):
    # Photos decode to RGB: a FILES source saying channels=1 got 3-channel batches under a 1-value mean.
    source = Blobs(blobs, np.arange(12) % 3)
    source.channels, source.mean, source.std = 1, (0.5,), (0.25,)
    with pytest.raises(ValueError, match=r"Blobs has channels=1.*decodes to RGB.*channels = 3"):
        make_loader(source, "torch", batch_size=4, device="cpu", num_workers=0, augment=SMALL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_source_that_overrides_read_alone_is_read(blobs, backend):
    # docs/sources.md names read(i) first; a source giving only read() was told it "holds decoded
    # pixels ... not encoded files" at the first batch.
    class ReadOnly(Blobs):
        read_stamped = Source.read_stamped

        def read(self, i):
            return self.blobs[self.keys[i]]

    _, out = _batches(ReadOnly(blobs, np.arange(12) % 3), backend)
    assert len(out) == 3


# ----------------------------------------------------------------------------------------- registry
class Mine(Loader):
    """A backend of one's own, as examples/custom_backend.py writes it."""

    name = "mine"
    reads = frozenset({SourceKind.ARRAY, SourceKind.FILES})

    def _epoch(self, epoch, batches, start):
        for k, ids in enumerate(batches):
            d = decode(self.source, ids, self.augment, self.batch_rng(epoch, start + k), self.config.on_error)
            self.skipped += len(ids) - len(d.kept)
            yield self.normalize(torch.from_numpy(d.images)), torch.from_numpy(d.labels)


@pytest.fixture
def table():
    """The registry as it was before the test, put back after it whatever happens (a built-in row
    replaced by a failing test must not stay replaced for the tests after it)."""
    saved = dict(registry.BACKENDS)
    yield
    registry.BACKENDS.clear()
    registry.BACKENDS.update(saved)


@pytest.mark.parametrize("name, message", [
    ("torch", r"backend 'torch' is registered already \(fastdata.backends.torch_loader:TorchLoader\).*"
              r"another name.*replace=True"),
    ("Torch", r"backend 'Torch' differs from 'torch' only in case"),
    ("MEMORY", r"backend 'MEMORY' differs from 'memory' only in case"),
])
def test_a_name_that_clashes_with_a_backend_is_refused(name, message, table):
    # registering "torch" silently replaced the built-in for the whole process (and unregister then
    # removed it for good); "MEMORY" stood beside "memory".
    with pytest.raises(ValueError, match=message):
        registry.register(name, Mine)
    assert registry.spec("torch").target == "fastdata.backends.torch_loader:TorchLoader"
    assert name == "torch" or name not in registry.BACKENDS


def test_a_backend_registered_again_or_replaced_on_purpose(table):
    first = registry.register("mine", Mine)
    again = registry.register("mine", Mine)          # a script's register() run twice: the same row
    assert again == first and list(registry.BACKENDS).count("mine") == 1

    class Other(Mine):
        pass

    with pytest.raises(ValueError, match="registered already"):
        registry.register("mine", Other)
    assert registry.register("mine", Other, replace=True).target is Other


def test_devices_given_as_one_string_is_that_device(table):
    # devices="cuda" was read letter by letter: "unknown device type(s) ['a', 'c', 'd', 'u']".
    assert registry.register("mine", Mine, devices="cuda").devices == ("cuda",)


def test_a_target_that_is_no_backend_is_refused_naming_it(table):
    with pytest.raises(TypeError, match=r"backend 'plain': target object is not a subclass of "
                                        r"fastdata.backends.base.Loader"):
        registry.register("plain", object)     # was "object() takes no arguments" from make_loader
    registry.register("nomodule", "no_such_pkg.loader:Cls")
    registry.register("noclass", "fastdata.registry:NoSuchLoader")
    source = SyntheticDigits(32)
    with pytest.raises(ImportError, match=r"backend 'nomodule': cannot import 'no_such_pkg.loader:Cls' "
                                          r"\(ModuleNotFoundError: No module named 'no_such_pkg'\)"):
        make_loader(source, "nomodule", batch_size=8, device="cpu")
    with pytest.raises(ImportError, match=r"backend 'noclass': cannot import 'fastdata.registry:NoSuchLoader' "
                                          r"\(module 'fastdata.registry' has no attribute 'NoSuchLoader'\)"):
        make_loader(source, "noclass", batch_size=8, device="cpu")
    # auto still picks among the others, the broken rows being after them
    loader = make_loader(source, "auto", batch_size=8, device="cpu", quiet=True)
    assert loader.name == "memory"


def test_auto_with_a_preferred_backend_of_ones_own_holds_the_contract(table):
    registry.register("mine", Mine, order=0)
    assert "mine" in registry.available_backends()

    def loader():
        return make_loader(SyntheticDigits(40), "auto", batch_size=8, device="cpu", quiet=True, seed=3)

    whole = loader()
    assert isinstance(whole, Mine) and len(whole) == 5
    uninterrupted = [(x, y) for x, y in whole]
    assert all(x.dtype == torch.float32 and x.shape == (8, 1, 28, 28) and y.dtype == torch.int64
               for x, y in uninterrupted)
    cut = loader()
    it = iter(cut)
    head = [next(it) for _ in range(2)]
    resumed = loader()
    resumed.load_state_dict(cut.state_dict())
    got = head + list(resumed)
    assert all(torch.equal(a, b) and torch.equal(p, q) for (a, p), (b, q) in zip(got, uninterrupted))
    assert len(got) == 5


# ------------------------------------------------------------------------------- batch transforms
class NoGenerator(BatchTransform):
    def __call__(self, images, labels):   # the generator forgotten
        return images, labels


class GlobalDraws(BatchTransform):
    """Draws from the global generators, as a user's transform does before reading the docs' rule."""

    def __call__(self, images, labels, generator):
        return images + torch.rand(()) + float(np.random.rand()), labels


class HoldsTensor(BatchTransform):
    def __init__(self, device):
        self.shift = torch.zeros(1, device=device)

    def __call__(self, images, labels, generator):
        return images + self.shift, labels


class Raises(BatchTransform):
    def __call__(self, images, labels, generator):
        raise RuntimeError("Expected all tensors to be on the same device")


def _digits(**kwargs):
    kwargs = {"batch_size": 8, "device": "cpu", "num_workers": 0, "seed": 5, **kwargs}
    return make_loader(SyntheticDigits(32), "torch", **kwargs)


def test_a_batch_transform_whose_call_cannot_take_the_generator_is_refused_when_the_loader_is_made():
    with pytest.raises(TypeError, match=r"batch_transforms\[0\] \(<.*NoGenerator object.*\) cannot be called as "
                                        r"__call__\(images, labels, generator\).*\(images, labels\)"):
        _digits(batch_transforms=[NoGenerator()])


@pytest.mark.parametrize("backend", ["torch", "memory"])
def test_a_batch_transform_drawing_from_the_global_generators_repeats_and_resumes(backend):
    def run(**kw):
        return make_loader(SyntheticDigits(32), backend, batch_size=8, device="cpu", num_workers=0, seed=5,
                           batch_transforms=[GlobalDraws()], **kw)

    torch.manual_seed(0)
    first = [x for x, _ in run()]
    torch.manual_seed(1)
    np.random.seed(1)
    second = [x for x, _ in run()]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    cut = run()
    it = iter(cut)
    head = [next(it)[0] for _ in range(2)]
    resumed = run()
    resumed.load_state_dict(cut.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(head + [x for x, _ in resumed], first))
    state = torch.random.get_rng_state()
    next(iter(run()))
    assert torch.equal(torch.random.get_rng_state(), state)   # the caller's generator is left alone


def test_a_batch_transform_drawing_globally_inside_a_oneof_repeats():
    """Seeded at the top level only, the same transform under OneOf drew other numbers each run."""
    from fastdata.batch_transforms import OneOf

    def run():
        return [x for x, _ in _digits(batch_transforms=[OneOf([GlobalDraws(), GlobalDraws()])])]

    torch.manual_seed(0)
    first = run()
    torch.manual_seed(1)
    np.random.seed(1)
    assert all(torch.equal(a, b) for a, b in zip(first, run()))


def test_a_batch_transform_holding_a_tensor_on_another_device_is_refused_when_the_loader_is_made():
    # a CUDA tensor in a transform of a CPU loader (meta stands in for the other device here)
    with pytest.raises(ValueError, match=r"batch_transforms\[0\] \(<.*HoldsTensor object.*\) holds a tensor on meta "
                                         r"\(its shift\) but the batches are on cpu.*bind"):
        _digits(batch_transforms=[HoldsTensor("meta")])
    assert len(list(_digits(batch_transforms=[HoldsTensor("cpu")]))) == 4


def test_an_error_inside_a_batch_transform_names_it():
    with pytest.raises(RuntimeError, match="same device") as info:
        next(iter(_digits(batch_transforms=[Raises()])))
    if sys.version_info >= (3, 11):   # exception notes exist from Python 3.11
        assert any("batch_transforms[0] (<" in note and "Raises object" in note for note in info.value.__notes__)


class GlobalCudaDraws(BatchTransform):
    def __call__(self, images, labels, generator):
        return images * torch.rand(images.shape[0], 1, 1, 1, device=images.device) + float(np.random.rand()), labels


@pytest.mark.cuda
def test_a_users_batch_transform_on_cuda_repeats_without_a_host_sync_and_a_cuda_tensor_is_refused_on_the_cpu():
    """A user's transform drawing from the global CUDA generator runs under the seeded generators
    without a host sync and repeats by seed, leaving the caller's CUDA generator where it was; one
    holding a CUDA tensor is refused by a CPU loader's pipeline."""
    from conftest import sync_debug_error
    from fastdata.batch_transforms import BatchPipeline

    pipeline = BatchPipeline([GlobalCudaDraws()], num_classes=10, device="cuda")
    images, labels = torch.randn(8, 3, 16, 16, device="cuda"), torch.arange(8, device="cuda")
    torch.cuda.synchronize()
    state = torch.cuda.get_rng_state()
    with sync_debug_error():
        first, _ = pipeline(images, labels, 7)
        again, _ = pipeline(images, labels, 7)
        other, _ = pipeline(images, labels, 8)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    with pytest.raises(ValueError, match=r"holds a tensor on cuda:0 \(its shift\) but the batches are on cpu"):
        BatchPipeline([HoldsTensor("cuda:0")], num_classes=10, device="cpu")


# --------------------------------------------------------------------------- worker processes
class Held(Blobs):
    """A source holding what cannot be pickled: an open file, a lock or a lambda."""

    def __init__(self, blobs, what, path):
        super().__init__(blobs, np.arange(len(blobs)) % 3)
        self.extra = {"handle": lambda: open(path, "rb"), "lock": threading.Lock,
                      "fn": lambda: (lambda b: b)}[what]()


class Reopens(Held):
    """The same, with the __getstate__ docs/sources.md asks for: the worker makes its own."""

    def __getstate__(self):
        return {**self.__dict__, "extra": None}


@pytest.mark.parametrize("what, kind", [("handle", "BufferedReader"), ("lock", "lock"), ("fn", "function")])
def test_a_source_that_cannot_be_pickled_is_refused_for_spawned_workers_when_the_loader_is_made(
        blobs, tmp_path, what, kind):
    # It was TypeError: cannot pickle '_thread.lock' object at the first batch, naming no attribute.
    (tmp_path / "f").write_bytes(b"x")
    source = Held(blobs, what, tmp_path / "f")
    for backend in ("torch", "prefetch"):
        with pytest.raises(TypeError, match=rf"Held cannot be sent to the DataLoader workers.*"
                                            rf"multiprocessing_context='spawn'.*attribute 'extra' \(.*{kind}.*\).*"
                                            rf"__getstate__.*multiprocessing_context='fork' or num_workers=0"):
            make_loader(source, backend, batch_size=4, device="cpu", num_workers=1,
                        multiprocessing_context="spawn", augment=SMALL)
    # forked workers inherit it as it is; none at all need no pickling
    for workers, context in ((1, "fork"), (0, "spawn")):
        loader = make_loader(source, "torch", batch_size=4, device="cpu", num_workers=workers,
                             multiprocessing_context=context, augment=SMALL)
        assert len(list(loader)) == 3
        loader.close()
    if what == "handle":
        source.extra.close()


def test_a_source_with_a_getstate_reads_in_spawned_workers_as_in_the_process(blobs, tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    source = Reopens(blobs, "lock", tmp_path / "f")
    with make_loader(source, "torch", batch_size=4, device="cpu", num_workers=1, multiprocessing_context="spawn",
                     augment=SMALL, seed=2) as spawned:
        got = [(x, y) for x, y in spawned]
    expected = list(make_loader(source, "torch", batch_size=4, device="cpu", num_workers=0, augment=SMALL, seed=2))
    assert len(got) == 3 and all(torch.equal(a, b) and torch.equal(p, q) for (a, p), (b, q) in zip(got, expected))


class Unreadable(Blobs):
    """A source whose read fails on sample 5 as reads fail: an OSError (a file gone, a network error)."""

    def read_stamped(self, i):
        if i == 5:
            open("/nonexistent/fastdata-qa/5.jpg", "rb")
        return super().read_stamped(i)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_os_error_from_a_sources_read_is_a_decode_error_naming_the_sample_that_skip_skips(blobs, backend):
    # It ended the epoch on every backend, on_error="skip" or not: only a DecodeError was skipped.
    source = Unreadable(blobs, np.arange(12) % 3)
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        _, out = _batches(source, backend, on_error="skip", drop_last=False)
    assert sum(len(y) for _, y in out) == 11
    from fastdata.errors import DecodeError

    with pytest.raises(DecodeError, match=r"blobs:05.jpg.*FileNotFoundError"):
        _batches(source, backend)


def test_a_bug_in_a_sources_read_still_raises_with_skip(blobs):
    class Buggy(Blobs):
        def read_stamped(self, i):
            return self.blobs[i]   # KeyError: a bug, not an unreadable sample

    with pytest.raises(KeyError):
        _batches(Buggy(blobs, np.arange(12) % 3), "torch", on_error="skip")


def test_a_subset_of_a_source_without_take_says_what_to_implement(blobs):
    with pytest.raises(NotImplementedError, match=r"Blobs does not implement subset\(\): give it _take\(idx\)"):
        make_loader(Blobs(blobs, np.arange(12) % 3), "torch", indices=[1, 2, 3], batch_size=2, device="cpu")


class Arrays(Source):
    """A source of kind ARRAY of one's own: every image in one uint8 (N, H, W, C) array."""

    kind = SourceKind.ARRAY

    def __init__(self, images, labels, channels=3):
        self.images, self.labels, self.num_classes, self.channels = images, labels, 3, channels
        self.mean, self.std, self.name = (0.5,) * channels, (0.25,) * channels, "arrays"

    @property
    def image_shape(self):
        return tuple(self.images.shape[1:])


PIXELS = np.random.default_rng(0).integers(0, 255, (12, 8, 8, 3), dtype=np.uint8)


@pytest.mark.parametrize("images, labels, channels, error, message", [
    (PIXELS.astype(np.float32), np.arange(12) % 3, 3, TypeError,
     r"Arrays.images is float32 of shape \(12, 8, 8, 3\): .*uint8 \(N, H, W, C\)"),   # was taken as pixels
    (PIXELS[..., 0], np.arange(12) % 3, 1, TypeError, r"Arrays.images is uint8 of shape \(12, 8, 8\)"),
    (PIXELS, np.arange(12) % 3, 1, ValueError, r"Arrays has channels=1 but its images have 3"),
    (PIXELS, np.arange(13) % 3, 3, ValueError, r"Arrays.images holds 12 images but Arrays.labels has 13"),
])
def test_an_array_source_whose_images_break_the_kind_is_refused(images, labels, channels, error, message):
    with pytest.raises(error, match=message):
        make_loader(Arrays(images, labels, channels), "torch", batch_size=4, device="cpu", num_workers=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_array_source_of_ones_own_holds_the_contract(backend):
    loader, out = _batches(Arrays(PIXELS, np.arange(12) % 3), backend, augment=None, shuffle=False)
    assert len(loader) == 3 and all(x.shape == (4, 3, 8, 8) and y.dtype == torch.int64 for x, y in out)
    expected = (torch.from_numpy(PIXELS).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(torch.cat([x for x, _ in out]), expected, atol=1e-5, rtol=0)


class Breaks(Mine):
    """A backend of one's own that breaks the contract in one way (``how``)."""

    how = ""

    def _epoch(self, epoch, batches, start):
        last = None
        for images, labels in super()._epoch(epoch, batches, start):
            last = (images, labels)
            if self.how == "uint8":
                yield (images * 0).to(torch.uint8), labels
            elif self.how == "int32":
                yield images, labels.int()
            elif self.how == "short":
                yield images, labels[:-1]
            else:
                yield images, labels
        if self.how == "extra":
            yield last


@pytest.mark.parametrize("how, message", [
    ("uint8", r"images torch.uint8 of shape \(8, 1, 28, 28\) on cpu; the contract is normalized torch.float32 "
              r"\(N, C, H, W\) on cpu.*self.normalize"),
    ("int32", r"labels torch.int32 of shape \(8,\) on cpu; the contract is int64 \(8,\)"),
    ("short", r"labels torch.int64 of shape \(7,\) on cpu; the contract is int64 \(8,\)"),
    ("extra", r"more than len\(loader\) = 4 batches"),
])
def test_a_backend_of_ones_own_that_breaks_the_contract_is_named_at_the_batch(how, message, table):
    # Each went through without a word: uint8 images, int32 labels, labels short of the images, a fifth
    # batch in an epoch of len 4.
    Breaks.name, Breaks.how = "breaks", how
    registry.register("breaks", Breaks)
    loader = make_loader(SyntheticDigits(32), "breaks", batch_size=8, device="cpu")
    with pytest.raises(RuntimeError, match=r"backend 'breaks' \(Breaks._epoch\) yielded " + message):
        list(loader)


def test_a_list_of_path_label_pairs_without_class_names_is_read(tmp_path):
    # from_samples(pairs, None) was "'NoneType' object is not iterable"
    from fastdata.datasets import ImageFolder, make_image_folder

    root = make_image_folder(tmp_path / "p", classes=2, per_class=3)
    paths = sorted(str(p) for p in root.rglob("*.jpg"))
    source = ImageFolder.from_samples([(p, 2 * (i % 2)) for i, p in enumerate(paths)], None)
    assert source.num_classes == 3 and source.classes == [0, 1, 2]
    _, out = _batches(source, "torch", batch_size=3)
    assert sorted(torch.cat([y for _, y in out]).tolist()) == [0, 0, 0, 2, 2, 2]


def test_a_source_that_sets_no_kind_is_told_which_to_set(blobs):
    # It was each backend's "cannot read ... (kind 'abstract')", listing fastdata's sources.
    class NoKind(Blobs):
        kind = Source.kind

    with pytest.raises(TypeError, match=r"NoKind sets no kind: .*kind = SourceKind.FILES.*kind = SourceKind.ARRAY"):
        make_loader(NoKind(blobs, np.arange(12) % 3), "torch", batch_size=4, device="cpu", augment=SMALL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_photo_source_of_ones_own_resumes_exactly_with_its_default_recipe(blobs, backend):
    def loader():
        return make_loader(Blobs(blobs, np.arange(12) % 3), backend, batch_size=4, device="cpu", num_workers=0,
                           quiet=True, seed=9, augment=Augmentation.imagenet_train(size=32))

    whole = list(loader())
    cut = loader()
    it = iter(cut)
    head = [next(it)]
    resumed = loader()
    resumed.load_state_dict(cut.state_dict())
    got = head + list(resumed)
    assert len(got) == len(whole) == 3
    assert all(torch.equal(a, b) and torch.equal(p, q) for (a, p), (b, q) in zip(got, whole))
