"""Command line: ``python -m fastdata doctor``, ``python -m fastdata bench SOURCE`` and
``python -m fastdata pack SOURCE OUT``."""
import argparse
import os
import sys


def _prog() -> str:
    """How the user started the command, for usage lines: ``fastdata`` (the console script pyproject.toml
    installs; a pip user has no other) or ``python -m fastdata``. It said "python -m fastdata" to both."""
    return "fastdata" if os.path.basename(sys.argv[0] if sys.argv else "") == "fastdata" else "python -m fastdata"


def get_args_parser() -> argparse.ArgumentParser:
    # Not __doc__: its ``markup`` would show as it is in --help.
    parser = argparse.ArgumentParser(prog=_prog(), description="fastdata's commands: doctor, "
                                     "bench SOURCE and pack SOURCE OUT; each takes --help")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="torch/CUDA, Pillow-SIMD, DALI, cores and the usable backends")
    from .bench import get_args_parser as bench_parser
    from .cli import HelpFormatter

    bench_parser(sub.add_parser("bench", formatter_class=HelpFormatter,
                                help="which backend keeps the GPU busy on your data and model: "
                                     "measures each backend and the model's step, predicts the data wait"))
    from .packing.command import get_args_parser as pack_parser

    pack_parser(sub.add_parser("pack", formatter_class=HelpFormatter,
                               help="write a source as tar shards (WebDataset layout) with an index, "
                                    "for streaming and DALI"))
    return parser


#: What Ctrl-C leaves behind, per command: one line instead of a traceback from wherever it landed.
ON_INTERRUPT = {
    "doctor": "interrupted",
    "bench": "interrupted: nothing written (the reports are written once every backend is measured)",
    "pack": "interrupted: the same command finishes the pack, keeping the shards already written",
}


def main(argv=None) -> int:
    args = get_args_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        from .cli import say_line

        # One write: under torchrun every rank says it into one stderr, and print's two ran lines together.
        say_line(f"fastdata {args.command}: {ON_INTERRUPT[args.command]}")
        return 130   # 128 + SIGINT, what a shell reports for Ctrl-C


def _run(args) -> int:
    if args.command == "doctor":
        from .doctor import main as doctor

        return doctor()
    if args.command == "bench":
        from .bench import main as bench

        bench(args)
        return 0
    if args.command == "pack":
        from .packing.command import main as pack

        pack(args)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
