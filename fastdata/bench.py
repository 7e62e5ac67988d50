"""``python -m fastdata bench SOURCE``: which backend keeps *your* GPU busy on *your* data and model.

It measures two things on this machine, apart:

1. every available backend's delivery rate on SOURCE (normalized batches on the device, the training
   recipe on), for a few hundred batches after a warm-up;
2. the model's training step alone (forward, backward, optimizer step, the precision ``fit`` would use)
   on ready tensors of the same shape: the rate the model could train at with free data.

From the two it predicts, per backend, the fraction of training time spent waiting for data and the
training rate, and recommends the backend with the highest predicted rate (within 5% of it, the one
that costs the host least: see ``recommend``). The prediction is a model of how the two overlap:

- ``serial``: the loader's work runs on the training thread, or on the GPU stream the model uses
  (``memory``), or on the same CPU cores as the model (any backend on a CPU device). Per batch the
  time is ``load + step``, and the data share is ``load / (load + step)``.
- ``overlapped``: on CUDA, worker processes, DALI's threads and side streams (``torch``, ``prefetch``,
  ``dali``) prepare the next batch while the GPU runs the step. Per batch the time is
  ``max(load, step)``, and the model waits ``max(0, load - step)`` of it.

This ignores contention between the loader and the model for the GPU or the host (DALI's kernels
and the model share the GPU; a loader's workers share the host with the Python that launches kernels),
so overlapped predictions are a lower bound on the wait. On a CPU the serial model holds within a few
points of the wait ``fit`` measures (tested).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass

from . import cli
from .config import ON_ERROR
from .datasets.spec import SOURCE_HELP, open_source
from .engine.amp import AMP_CHOICES
from .engine.meter import shows_live

TIE = 0.05


@dataclass
class Measurement:
    backend: str
    status: str = "ok"              # "ok", or why it was not measured
    images_per_second: float | None = None
    spread: tuple[float, float] | None = None   # slowest and fastest stretch of the timed batches
    # make_loader's seconds (workers, memory's cache build): paid once per run, outside the rate, so
    # reported beside it; a cache built in minutes is not free because its epochs are fast.
    setup_seconds: float | None = None
    overlap: str = "serial"
    predicted_wait: float | None = None
    predicted_images_per_second: float | None = None


def predict(load_rate: float, step_rate: float, overlapped: bool) -> tuple[float, float]:
    """(data-wait fraction, training images/s) for a loader delivering ``load_rate`` images/s and a
    model training at ``step_rate`` images/s on ready tensors; see the module docstring."""
    load, step = 1.0 / load_rate, 1.0 / step_rate  # seconds per image
    if overlapped:
        per_image = max(load, step)
        return max(0.0, load - step) / per_image, 1.0 / per_image
    return load / (load + step), 1.0 / (load + step)


def recommend(rows: list[Measurement]) -> Measurement:
    """The backend with the highest predicted training rate. Rates within ``TIE`` of the best are a tie
    (the data is not what limits training, and the measurements are that noisy): among those, the
    first in ``auto``'s preference (the registry's ``order``), which puts first the backend that uses
    the least host CPU per epoch (``memory`` decodes nothing after its cache is built; the others decode
    every epoch)."""
    from .registry import by_preference

    preference = [s.name for s in by_preference()]
    def rate(r: Measurement) -> float:
        if r.predicted_images_per_second is None:
            raise ValueError(f"recommend: backend {r.backend!r} has no predicted rate yet (see predict)")
        return r.predicted_images_per_second

    top = max(rate(r) for r in rows)
    tied = [r for r in rows if rate(r) >= (1 - TIE) * top]
    return min(tied, key=lambda r: preference.index(r.backend) if r.backend in preference else len(preference))


def overlaps(backend: str, device) -> bool:
    """Whether ``backend`` prepares batches while a step runs on ``device`` (the registry's
    ``overlaps_on_cuda``; on a CPU every loader shares the cores with the model)."""
    from .registry import spec

    return device.type == "cuda" and spec(backend).overlaps_on_cuda


def make_model(name: str, source):
    """The untrained model ``name`` for ``source``'s classes and channels (``fastdata.models.create_model``:
    smallcnn, a torchvision classifier, or a timm model; never pretrained weights, so nothing is
    downloaded). A name it cannot build ends the program with one line."""
    from .models import create_model

    try:
        return create_model(name, num_classes=max(source.num_classes, 2), in_channels=source.channels)
    except ValueError as e:
        raise SystemExit(f"fastdata bench: --model {name}: {e}") from None


def check_model(name: str, source):
    """The model ``name`` for ``source`` (``make_model``), refused before any measuring when it cannot
    train on the source's images: one training step (forward, loss, backward) on two blank images of
    the source's shape on the CPU. In training mode, as the bench measures it: a torchvision model
    expects 3 channels (digits have 1), and inception_v3's auxiliary head, which runs only in
    training, needs 299x299 images."""
    import torch

    model = make_model(name, source).train()
    shape = _image_shape(source)
    try:
        logits = _logits(model(torch.zeros((2, *shape))))
        torch.nn.functional.cross_entropy(logits, torch.zeros(2, dtype=torch.long)).backward()
    except Exception as e:   # the model's own code: shape errors, ViT's size assert, a TypeError of its own
        hint = (" (it takes 3-channel images: use --model smallcnn, or a folder of colour photos)"
                if shape[0] != 3 else "")
        raise SystemExit(f"fastdata bench: --model {name} cannot take this source's {shape[0]}x{shape[1]}x"
                         f"{shape[2]} images{hint}: {_one_line(e)}") from None
    model.zero_grad(set_to_none=True)
    return model


def _logits(output):
    """The logits of a model's training output: torchvision's googlenet and inception_v3 return a
    named tuple (logits, aux_logits) in training mode."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned a {type(output).__name__}, not a logits tensor")


def _image_shape(source) -> tuple[int, int, int]:
    """(C, H, W) of the batches a loader makes of ``source`` in training (its recipe's crop size for photos)."""
    from .config import SourceKind

    if source.kind is SourceKind.FILES:
        size = source.default_augmentation(True).size
        h, w = (size, size) if isinstance(size, int) else size
        return 3, h, w
    return source.channels, source.images.shape[1], source.images.shape[2]


def _bar(total: int, desc: str, enabled: bool):
    # Where fit's bar draws (``shows_live``: a terminal or a notebook, never a pipe or a log file).
    if not enabled or not shows_live(sys.stderr):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_loader(loader, batches: int, warmup: int, progress: bool) -> float:
    """Images/s over ``batches`` batches after ``warmup`` (epochs restart as needed)."""
    return measure_loader_spread(loader, batches, warmup, progress)[0]


def measure_loader_spread(loader, batches: int, warmup: int, progress: bool,
                          pieces: int = 5) -> tuple[float, list[float]]:
    """(images/s over ``batches`` batches after ``warmup``, the rate of each of ``pieces`` consecutive
    stretches of them). The stretches are the same run read at a few points, so the report can show how
    much the rate moved without measuring anything else; on CUDA each reading synchronizes first."""
    bar = _bar(warmup + batches, f"{loader.name:>8}", progress)
    marks = {warmup + round(batches * k / pieces) for k in range(1, pieces + 1)}
    done, images, stamps = 0, 0, []

    def start():
        # The clock starts before the first timed batch is fetched, not when it arrives: a rate of
        # N batches' images over N - 1 loads would be N / (N - 1) too high.
        _sync(loader.device)
        stamps.append((time.perf_counter(), 0))

    if warmup == 0:
        start()
    while done < warmup + batches:
        before = done
        for x, _ in loader:
            done += 1
            if done > warmup:
                images += x.shape[0]
            elif done == warmup:
                start()
            if bar is not None:
                bar.update(1)
            if done in marks and done < warmup + batches:
                _sync(loader.device)
                stamps.append((time.perf_counter(), images))
            if done == warmup + batches:
                break
        if done == before:   # an empty epoch would repeat forever
            raise ValueError(f"the {loader.name} loader yielded no batches in an epoch")
    _sync(loader.device)
    stamps.append((time.perf_counter(), images))
    if bar is not None:
        bar.close()
    rates = [(n1 - n0) / (t1 - s0) for (s0, n0), (t1, n1) in zip(stamps, stamps[1:]) if t1 > s0 and n1 > n0]
    return images / (stamps[-1][0] - stamps[0][0]), rates


def measure_step(model, sample_batch, steps: int, warmup: int, amp: str = "auto") -> float:
    """Training images/s of ``model`` alone on one ready batch (forward, backward, optimizer step)."""
    import torch

    from .engine import resolve_amp

    images, labels = sample_batch
    device = images.device
    mode = resolve_amp(amp, device)
    model = model.to(device).train()
    if images.dtype != torch.float32 and mode == "off":
        images = images.float()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    t0 = time.perf_counter()   # again when the warm-up steps are done
    for i in range(warmup + steps):
        if i == warmup:
            _sync(device)
            t0 = time.perf_counter()
        dtype = torch.float16 if mode == "fp16" else torch.bfloat16
        with torch.autocast(device.type, dtype=dtype, enabled=mode != "off"):
            loss = loss_fn(_logits(model(images)), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    _sync(device)
    return steps * images.shape[0] / (time.perf_counter() - t0)


def _nonempty_batch(loader):
    """A batch of ``loader`` with images in it (``on_error="skip"`` can empty a batch), or None when a
    whole epoch has none."""
    return next(((x, y) for x, y in loader if x.shape[0]), None)


def _one_line(e: BaseException) -> str:
    """An error as one line that still names its file: a DataLoader worker's error is "Caught DecodeError
    in DataLoader worker process 0." then the traceback, and its last line is the one that says which
    file and why."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        name, _, message = lines[-1].partition(": ")   # "fastdata.errors.DecodeError: cannot decode ..."
        return f"{name.rsplit('.', 1)[-1]}: {message}" if message else lines[-1]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def run(source, *, model_name: str = "smallcnn", batch_size: int = 256, device=None, batches: int = 200,
        warmup: int = 10, num_workers=None, amp: str = "auto", progress: bool = True,
        backends=None, model=None, on_error: str = "raise") -> dict:
    """Measure every backend and the model on ``source``; returns the report's payload. ``model``: the
    one ``make_model(model_name, source)`` built already (``check_model``), else built here.
    ``on_error``: the loaders' (``"skip"`` measures past undecodable files, counting them)."""
    import torch

    from .config import resolve_device
    from .registry import available_backends

    device = resolve_device(device)
    # Once each: ``--backends torch torch`` measured torch twice, and both rows said "(recommended)".
    names = list(dict.fromkeys(b for b in (backends or available_backends()) if b != "auto"))
    kw = {} if num_workers is None else {"num_workers": num_workers}
    size = len(source) if hasattr(source, "__len__") else None
    if size is not None and batch_size > size:
        # A training loader drops a short last batch: a batch larger than the source yields nothing. And
        # keep the short one: with on_error="skip" fewer files than the source's count may decode.
        print(f"fastdata bench: batch size {size}, not {batch_size}: the source has only {size} images, "
              f"fewer than one batch", file=sys.stderr, flush=True)
        batch_size, kw["drop_last"] = size, False
    rows, sample = [], None
    for name in names:
        loader_kw = dict(batch_size=batch_size, device=device, train=True, on_error=on_error, **kw)
        row, batch = _measure_backend(source, name, loader_kw, batches, warmup, progress, sample is None)
        rows.append(row)
        sample = batch if sample is None else sample
    if sample is None:
        statuses = {r.status for r in rows}
        lines = ([f"  every backend: {statuses.pop()}"] if len(statuses) == 1
                 else [f"  {r.backend}: {r.status}" for r in rows])
        hint = ("\n  (--on-error skip measures past undecodable files, counting them)"
                if on_error == "raise" and any("DecodeError" in r.status for r in rows) else "")
        raise SystemExit(f"fastdata bench (batch size {batch_size}): no backend could read the source:\n"
                         + "\n".join(lines) + hint)
    model = make_model(model_name, source) if model is None else model
    try:
        step_rate = measure_step(model, sample, steps=max(5, batches // 10), warmup=3, amp=amp)
    except Exception as e:   # the model's own code (out of memory, a layer refusing the batch)
        raise SystemExit(f"fastdata bench: --model {model_name}: its training step failed on a batch of "
                         f"{tuple(sample[0].shape)} on {device} (amp={amp}): {_one_line(e)}") from None
    for row in rows:
        if row.status != "ok":
            continue
        row.overlap = "overlapped" if overlaps(row.backend, device) else "serial"
        row.predicted_wait, row.predicted_images_per_second = predict(
            row.images_per_second, step_rate, row.overlap == "overlapped")
    best = recommend([r for r in rows if r.status == "ok"])
    del sample
    if device.type == "cuda":
        torch.cuda.empty_cache()
    from .engine import resolve_amp

    # The precision the step ran at (auto resolved), not only the flag: the report says what was measured.
    return {"benchmark": "fastdata bench", "source": repr(source), "model": model_name,
            "batch_size": batch_size, "device": str(device), "amp": resolve_amp(amp, device, warn=False),
            "batches": batches,
            "model_images_per_second": step_rate, "recommended": best.backend,
            "rows": [asdict(r) for r in rows]}


def _measure_backend(source, name: str, loader_kw: dict, batches: int, warmup: int, progress: bool,
                     want_sample: bool):
    """(the backend's Measurement, one non-empty batch of it if ``want_sample`` and it delivered any)."""
    from .registry import make_loader

    row, sample = Measurement(name), None
    try:
        t0 = time.perf_counter()
        loader = make_loader(source, name, **loader_kw)
        row.setup_seconds = time.perf_counter() - t0
        try:
            row.images_per_second, pieces = measure_loader_spread(loader, batches, warmup, progress)
            row.spread = (min(pieces), max(pieces)) if len(pieces) > 1 else None
            if not row.images_per_second:
                # on_error="skip" emptied every batch: a rate of 0 would divide by zero in predict.
                row.status, row.images_per_second, row.spread = (
                    "delivered no images: every file it read was undecodable and skipped", None, None)
            elif want_sample:
                sample = _nonempty_batch(loader)
        finally:
            loader.close()
    except Exception as e:  # one backend that cannot read this source must not hide the others
        row.status = _one_line(e)
    return row, sample


def report_markdown(payload: dict) -> str:
    """The bench result as the markdown report (machine, per-backend table, recommendation)."""
    from .report import fmt_num, fmt_pct, markdown_table

    lines = []
    for r in payload["rows"]:
        if r["status"] != "ok":
            # The table's cell: a '|' would end it, and the whole error is in the JSON and on screen.
            note = r["status"].replace("|", "/")
            lines.append([r["backend"], "-", "-", "-", "-", "-", note if len(note) <= 300 else note[:297] + "..."])
            continue
        mark = " (recommended)" if r["backend"] == payload["recommended"] else ""
        spread = f" ({fmt_num(r['spread'][0])}–{fmt_num(r['spread'][1])})" if r.get("spread") else ""
        setup = r.get("setup_seconds")
        lines.append([r["backend"] + mark, fmt_num(r["images_per_second"]) + spread, r["overlap"],
                      fmt_pct(r["predicted_wait"]), fmt_num(r["predicted_images_per_second"]),
                      "-" if setup is None else f"{setup:.2f}", ""])
    table = markdown_table(["backend", "delivers images/s", "overlap", "predicted data wait",
                            "predicted training images/s", "setup s", "note"], lines)
    return (f"Source {payload['source']}, batch {payload['batch_size']}, device `{payload['device']}`; "
            f"delivery rates with the slowest–fastest fifth of the timed batches in brackets; setup s: "
            f"seconds until the loader was built (workers, the memory backend's cache), once per run. "
            f"The model ({payload['model']}, amp {payload.get('amp', '-')}) trains at "
            f"{fmt_num(payload['model_images_per_second'])} images/s on ready tensors.\n\n{table}\n\n"
            f"Use `backend=\"{payload['recommended']}\"`.")


def get_args_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``fastdata bench`` argument parser (added to ``parser`` when given, for the CLI's subcommand)."""
    p = parser or argparse.ArgumentParser(prog="python -m fastdata bench", description=__doc__.split("\n\n")[0])
    p.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    p.add_argument("--model", default="smallcnn",
                   help="smallcnn, a torchvision classifier (resnet18, ...), or a timm model when timm is "
                        "installed; untrained: no weights are downloaded")
    p.add_argument("--batch-size", type=cli.positive_int, default=256,
                   help="default 256; a source with fewer images is measured in one batch of all of them")
    p.add_argument("--device", default=None, type=cli.device,
                   help="cpu, cuda or cuda:N (default: CUDA when available)")
    p.add_argument("--workers", type=cli.nonnegative_int, default=None, help="loader workers (default: fastdata's)")
    p.add_argument("--batches", type=cli.positive_int, default=None,
                   help="timed batches per backend (default: 200; 30 with --quick)")
    p.add_argument("--amp", default="auto", choices=AMP_CHOICES,
                   help="the model step's precision (auto: bf16 or fp16 on CUDA, off on the CPU)")
    p.add_argument("--backends", nargs="+", default=None, type=cli.named_backend,
                   help="default: every available backend")
    p.add_argument("--on-error", default="raise", choices=ON_ERROR,
                   help="an undecodable file: stop naming it (raise), or skip it and count it (skip)")
    p.add_argument("--quick", action="store_true",
                   help="30 batches (unless --batches) on 6,000 digits: does it run, not how fast")
    p.add_argument("--out", default="fastdata-bench",
                   help="folder for bench-<tag>.{md,json,png} (default: fastdata-bench, in the current folder)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(args) -> dict:
    """Run the bench for parsed ``args``: measure, print the table and the recommendation, write the
    reports; returns the payload."""
    from .report import machine_info, machine_tag, write_reports

    cli.check_output(get_args_parser(), "--out", args.out, folder=True)   # before the measuring, not after
    batches = args.batches if args.batches is not None else 30 if args.quick else 200
    with cli.input_errors(f"fastdata bench: SOURCE '{args.source}'"):
        # The parser every command shares (pack too); --quick measures on 6,000 digits.
        source = open_source(args.source, digits=6_000 if args.quick else None)
    model = check_model(args.model, source)
    payload = run(source, model_name=args.model, model=model, batch_size=args.batch_size, device=args.device,
                  batches=batches, warmup=3 if args.quick else 10, num_workers=args.workers, amp=args.amp,
                  progress=args.progress, backends=args.backends, on_error=args.on_error)
    body = report_markdown(payload)
    print(body, flush=True)
    machine = machine_info()
    chart = {"predicted training images/s": [(r["backend"], r["predicted_images_per_second"], "fastdata")
                                             for r in payload["rows"] if r["status"] == "ok"],
             "delivered images/s": [(r["backend"], r["images_per_second"], "fastdata")
                                    for r in payload["rows"] if r["status"] == "ok"]}
    payload["paths"] = write_reports(args.out, f"bench-{machine_tag(machine)}", title="fastdata bench",
                                     machine=machine, command="python -m fastdata bench " + " ".join(sys.argv[2:]),
                                     body_md=body, payload=payload, chart_groups=chart,
                                     chart_xlabel="images/s", chart_log=True)
    return payload
