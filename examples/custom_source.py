"""Writing a source: photos read straight out of a ZIP archive, in one file, by every backend.

    python examples/custom_source.py            # zips a small photo folder, reads it with each backend

A source of encoded images (``SourceKind.FILES``) owns its bytes: it answers ``len``, the labels and
class names, and ``read_stamped(i) -> (bytes, stamp)`` with ``sample_name(i)`` for errors. Every backend
decodes what it returns (crop boxes, region decode, the photo cache, DALI's reader threads, skipping
with ``on_error``), so none of them knows that the photos live in a ZIP. No registration: pass the
source to ``make_loader`` as it is. ``fastdata.datasets.Shards`` is the full-sized example of the same
interface (a remote stream, with its own epoch order).
"""
from __future__ import annotations

import argparse
import os
import threading
import zipfile
import zlib

import numpy as np

from fastdata import cli
from fastdata.datasets import IMAGE_EXTENSIONS, IMAGENET_MEAN, IMAGENET_STD, ImageFolder, Source, SourceKind
from fastdata.errors import DecodeError


class ZipImages(Source):
    """An image folder zipped: ``class/.../photo.jpg`` members, the class being the first folder of the
    member's path (classes sorted by name, as ``ImageFolder``'s). Members are read in place, never
    extracted.

    Args:
        path: the ``.zip`` file.
        mean, std: normalization statistics in [0, 1] units (ImageNet's by default).
    """

    kind = SourceKind.FILES     # encoded photos of mixed sizes: every backend reads this kind
    hwc_samples = True          # source[i] is an (H, W, 3) uint8 tensor, as ImageFolder's
    transform = None            # no per-sample callable (ImageFolder's __getitem__, borrowed below, asks)

    def __init__(self, path, *, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.path = os.fspath(path)
        with zipfile.ZipFile(self.path) as zf:   # a missing or damaged archive is refused here, named
            members = sorted((m for m in zf.infolist() if self._is_image(m.filename)), key=lambda m: m.filename)
        if not members:
            raise FileNotFoundError(f"zip archive '{self.path}' holds no images under a class folder "
                                    f"(expected class/<name>{IMAGE_EXTENSIONS[0]})")
        self.classes = sorted({m.filename.split("/", 1)[0] for m in members})
        index = {c: k for k, c in enumerate(self.classes)}
        self.members = [m.filename for m in members]
        # The central directory's CRC-32 and size of each member: the stamp a backend that keeps headers
        # compares, and the fingerprint's content, read once with the directory (no member is opened).
        self.crcs = np.array([m.CRC for m in members], dtype=np.int64)
        self.sizes = np.array([m.file_size for m in members], dtype=np.int64)
        self.labels = np.array([index[m.split("/", 1)[0]] for m in self.members], dtype=np.int64)
        self.num_classes, self.channels = len(self.classes), 3
        self.mean, self.std = tuple(mean), tuple(std)
        self.name = f"zip:{os.path.basename(self.path)}"
        self._zip, self._pid, self._lock = None, None, threading.Lock()

    @staticmethod
    def _is_image(name: str) -> bool:
        # A member under a class folder, with an image ending; macOS's "__MACOSX/" and "._" entries are not.
        parts = name.split("/")
        return (len(parts) >= 2 and not name.endswith("/") and not any(p.startswith((".", "__MACOSX")) for p in parts)
                and name.lower().endswith(IMAGE_EXTENSIONS))

    # ------------------------------------------------------------------ the bytes
    def read_stamped(self, i: int) -> tuple[bytes, int]:
        """Member ``i``'s bytes and a stamp (its CRC-32 and size); an unreadable member is a DecodeError
        naming it, so ``on_error="skip"`` skips it as it skips a broken file."""
        try:
            with self._lock:
                # One handle per process, opened on first use: a DataLoader worker or a forked process
                # opens its own. zipfile's member handles share the archive's file object and count
                # their users without a lock, so the threads that read (DALI's readers, the photo cache
                # build) take turns here; decoding, the costly part, runs after, in parallel.
                if self._zip is None or self._pid != os.getpid():
                    self._zip, self._pid = zipfile.ZipFile(self.path), os.getpid()
                data = self._zip.read(self.members[i])
        except (OSError, zipfile.BadZipFile, zlib.error) as e:   # zipfile checks each member's CRC-32
            raise DecodeError(self.sample_name(i), f"cannot read it from the archive ({type(e).__name__}: {e})") \
                from None
        return data, self.stamp(i)[1]

    def stamp(self, i: int) -> tuple[int, int]:
        """Member ``i``'s size and stamp from the central directory, read once in ``__init__``: ``pack``
        plans its shards with this instead of reading every member twice (to plan, then to write)."""
        # Backends keep stamps in int64 arrays: CRC and size folded into 63 bits.
        return int(self.sizes[i]), (int(self.crcs[i]) << 31 ^ int(self.sizes[i])) & 0x7FFF_FFFF_FFFF_FFFF

    def sample_name(self, i: int) -> str:
        """``archive.zip:class/photo.jpg``: decoders check the bytes against the ending, errors show it."""
        return f"{self.path}:{self.members[i]}"

    # ------------------------------------------------------------------ the rest of a Source
    def fingerprint(self) -> str:
        # Member names, labels and CRCs: a position saved on this archive is refused on another one, and
        # a copy of the archive elsewhere still resumes.
        crc = zlib.crc32("\n".join(self.classes).encode())
        for name, label, c in zip(self.members, self.labels, self.crcs):
            crc = zlib.crc32(f"{name}\0{label}\0{c}\n".encode(), crc)
        return f"ZipImages n={len(self)} classes={self.num_classes} members={crc:08x}{self._subset_tag()}"

    def _take(self, idx: np.ndarray) -> None:
        self.members = [self.members[i] for i in idx]
        self.labels, self.crcs, self.sizes = self.labels[idx], self.crcs[idx], self.sizes[idx]
        self._lock = threading.Lock()   # subset() copies the source: the copy reads on its own

    def __getstate__(self):
        # A copy sent to a worker process carries no open archive or lock; it opens its own.
        state = self.__dict__.copy()
        state["_zip"], state["_pid"], state["_lock"] = None, None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ``source[i]`` is an image folder's: it only needs ``read`` and ``sample_name``. The recipe needs no
    # line: a FILES source's default is an image folder's (RandomResizedCrop for training, center crop
    # for evaluation), since photos of mixed sizes need a crop that fixes the size.
    __getitem__ = ImageFolder.__getitem__


def zip_folder(folder, path) -> str:
    """Zip an image folder (``root/class/photo.jpg``) as ``class/photo.jpg`` members, stored: JPEGs
    do not compress, and a stored member is read without inflating it."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for root, _, files in sorted(os.walk(folder)):
            for f in sorted(files):
                zf.write(os.path.join(root, f), os.path.relpath(os.path.join(root, f), folder))
    return os.fspath(path)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """No options: the parser answers ``--help`` and refuses a flag it does not know, instead of running
    the demo."""
    return argparse.ArgumentParser(description="Zip a small photo folder (in a temporary folder) and read it "
                                               "with every backend through ZipImages, a one-file Source",
                                   add_help=add_help)


def main(args: argparse.Namespace | None = None) -> None:
    """Zip a small photo folder and read one training epoch from it with every available backend."""
    import tempfile

    from fastdata import available_backends, make_loader
    from fastdata.datasets import make_image_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_image_folder(os.path.join(tmp, "photos"), classes=2, per_class=8)
        source = ZipImages(zip_folder(folder, os.path.join(tmp, "photos.zip")))
        print(f"{source!r}: classes {source.classes}")
        for backend in available_backends():
            loader = make_loader(source, backend, batch_size=8, device="cpu", num_workers=0)
            shapes = [tuple(images.shape) for images, _ in loader]
            print(f"{backend:>8}: {len(shapes)} batches of {shapes[0]}")


if __name__ == "__main__":
    with cli.on_ctrl_c():   # Ctrl-C: one line, "interrupted", and exit status 130, not a traceback
        main(get_args_parser().parse_args())
