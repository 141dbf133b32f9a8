"""argparse types the ``coda-cute`` subcommands share."""

from __future__ import annotations

import argparse


def positive_int(v: str) -> int:
    """An integer >= 1, else a usage error naming the value."""
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n
