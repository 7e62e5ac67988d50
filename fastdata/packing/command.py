"""``python -m fastdata pack SOURCE OUT``: the command line of ``fastdata.pack``."""
from __future__ import annotations

import argparse

from .. import cli
from ..datasets.spec import SOURCE_HELP, SPLITS
from .writer import OutputError, PackReport, pack, parse_size


def get_args_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``fastdata pack`` argument parser (added to ``parser`` when given, for the CLI's subcommand)."""
    p = parser or argparse.ArgumentParser(prog="python -m fastdata pack", description=__doc__.split("\n\n")[0])
    p.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    p.add_argument("out", metavar="OUT", help="folder for the shards, their .idx files and index.json")
    p.add_argument("--split", choices=SPLITS, default=None,
                   help="MNIST or digits: which half (default train)")
    p.add_argument("--shard-size", default="256MB", type=_size_arg, metavar="SIZE",
                   help="target bytes per shard: 256MB, 1GB, 512MiB (default 256MB)")
    p.add_argument("--max-side", type=cli.positive_int, default=None, metavar="N",
                   help="re-encode photos whose longer side exceeds N as JPEG (quality 90) with that longer side")
    p.add_argument("--workers", type=cli.nonnegative_int, default=None, metavar="N",
                   help="processes writing shards (default: the usable cores, shared between the ranks of a node "
                        "under torchrun)")
    p.add_argument("--timeout", type=cli.positive_float, default=None, metavar="SECONDS",
                   help="under torchrun: how long rank 0 waits for the other ranks' parts and they wait for "
                        "the index (default: as long as it takes)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (for logs and CI; where the index was written is still printed)")
    return p


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(args) -> PackReport:
    """Run ``fastdata pack`` for parsed ``args``; prints where the index is."""
    cli.check_output(get_args_parser(), "OUT", args.out, folder=True)
    with cli.input_errors(f"fastdata pack: SOURCE '{args.source}'"):
        try:
            report = pack(args.source, args.out, shard_size=args.shard_size, max_side=args.max_side,
                          workers=args.workers, split=args.split, progress=args.progress, timeout=args.timeout)
        except OutputError as e:   # OUT's disk, not the source: named as OUT
            raise cli.exit_with(f"error: fastdata pack: OUT '{args.out}': {e.strerror}") from None
    what = f"{report.samples} samples in {report.shards} shards ({report.written} written, {report.skipped} kept)"
    print(f"{what}: {report.index or report.out}", flush=True)
    return report
