"""Command line: ``python -m fastdata doctor``."""
import argparse
import sys


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastdata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="torch/CUDA, Pillow-SIMD, DALI, cores and the usable backends")
    return parser


def main(argv=None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.command == "doctor":
        from .doctor import main as doctor

        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
