"""Command line: ``python -m fastdata doctor``, ``python -m fastdata bench SOURCE`` and
``python -m fastdata pack SOURCE OUT``."""
import argparse
import sys


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastdata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="torch/CUDA, Pillow-SIMD, DALI, cores and the usable backends")
    from .bench import get_args_parser as bench_parser

    bench_parser(sub.add_parser("bench", help="which backend keeps the GPU busy on your data and model: "
                                              "measures each backend and the model's step, predicts the data wait"))
    from .packing.command import get_args_parser as pack_parser

    pack_parser(sub.add_parser("pack", help="write a source as tar shards (WebDataset layout) with an index, "
                                            "for streaming and DALI"))
    return parser


def main(argv=None) -> int:
    args = get_args_parser().parse_args(argv)
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
