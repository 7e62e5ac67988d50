"""fastdata.errors: DecodeError's fields, as raised and as rebuilt from a worker's text."""
from __future__ import annotations

from fastdata.errors import DecodeError


def test_why_is_the_reason_or_the_whole_message():
    """DecodeError.why (what the dali backend records for a file it refuses): the reason given; for an
    error rebuilt from a message with no recoverable reason, the message itself, never None."""
    e = DecodeError("/data/a.jpg", "image file is truncated")
    assert e.why == "image file is truncated" and e.reason == e.why
    text = "Caught DecodeError in DataLoader worker process 0. Original Traceback: something else"
    rebuilt = DecodeError(text)
    assert rebuilt.reason is None and rebuilt.why == text


def _broken_folder(tmp_path):
    import os

    from fastdata.datasets import make_image_folder

    root = make_image_folder(tmp_path / "photos", classes=2, per_class=3, seed=0, size_range=((40, 60), (40, 60)))
    first = sorted(os.listdir(root / "class_000"))[0]
    (root / "class_001" / "broken.jpg").write_bytes((root / "class_000" / first).read_bytes()[:300])
    return root


def _skip_warnings(backend, root):
    import warnings

    from fastdata import make_loader
    from fastdata.config import Augmentation
    from fastdata.datasets import ImageFolder

    loader = make_loader(ImageFolder(root), backend, device="cpu", batch_size=7, num_workers=1, on_error="skip",
                         augment=Augmentation.imagenet_eval(size=32, resize=36), train=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in loader:                                        # the line the warning must name
                pass
    finally:
        loader.close()
    return [w for w in caught if "undecodable" in str(w.message)]


def test_the_skipped_files_warning_names_the_users_line(tmp_path):
    """``on_error="skip"``'s warning named a line inside fastdata (backends/base.py's
    ``self._end_pass(epoch, offset)``, printed under it), whatever the user's code: a fixed stacklevel
    from a generator several frames below the user's loop. It now names the first frame outside
    fastdata and torch: the loop over the loader (``user_stacklevel``)."""
    from fastdata import available_backends

    root = _broken_folder(tmp_path)
    for backend in [b for b in ("torch", "memory", "dali") if b in available_backends()]:
        found = _skip_warnings(backend, root)
        assert len(found) == 1, (backend, [str(w.message) for w in found])
        assert found[0].filename == __file__, (backend, found[0].filename, found[0].lineno)


def test_fits_warnings_name_the_users_line(tmp_path):
    """fit's warnings (a resume under another amp, the schedule, the profiler, the run log) named a line
    inside fastdata's engine with a fixed stacklevel; they name the caller's fit(...) line now."""
    import warnings

    from fastdata import SmallCNN, fit, make_loader
    from fastdata.datasets import SyntheticDigits

    loader = make_loader(SyntheticDigits(64), "memory", batch_size=32, device="cpu", quiet=True)
    path = tmp_path / "cnn.pt"
    fit(SmallCNN(), loader, epochs=1, checkpoint=path, amp="off", progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(SmallCNN(), loader, epochs=1, checkpoint=path, resume=True, amp="bf16", progress=False)  # this line
    found = [w for w in caught if "was trained with amp" in str(w.message)]
    assert len(found) == 1 and found[0].filename == __file__, [(w.filename, w.lineno, str(w.message)) for w in caught]
