"""The ``coda-cute`` command line: ``report`` (compile table, GPU check), ``sol`` (roofline) and
``train`` (plain HF against apply_coda on a small Llama)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="coda-cute", description="coda_cute kernels: build report and speed-of-light")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import report

    report.add_arguments(sub.add_parser("report", help="compile every kernel config; with a GPU, also run and time every op"))
    try:
        from .sol import cli as sol_cli
    except ImportError:  # the reporter is optional until it lands
        sol_cli = None
    if sol_cli is not None:
        sol_cli.add_arguments(sub.add_parser("sol", help="speed-of-light (roofline) report per op"))

    from . import train

    train.add_arguments(sub.add_parser("train", help="train a small Llama as plain HF and through apply_coda"))
    args = parser.parse_args(argv)
    if args.command == "report":
        return report.run(args)
    if args.command == "train":
        return train.run(args)
    return sol_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
