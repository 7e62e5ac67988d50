"""Command line: ``python -m fastdata doctor`` and ``python -m fastdata bench SOURCE``."""
import argparse
import sys


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastdata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="torch/CUDA, Pillow-SIMD, DALI, cores and the usable backends")
    from .bench import get_args_parser as bench_parser

    bench_parser(sub.add_parser("bench", help="which backend keeps the GPU busy on your data and model: "
                                              "measures each backend and the model's step, predicts the data wait"))
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
    return 2


if __name__ == "__main__":
    sys.exit(main())
