"""Argument types and flags the subcommands share.

Apart from :mod:`kvxfer.cli.app` (which imports every subcommand to build the parser) so a
subcommand (the demo included) can use them without importing the parser back.
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "int_list", "rank_of", "plain", "add_json"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1; ``_`` and ``,`` group digits, a ``k`` suffix means x1024."""
    part = text.strip().lower().replace("_", "").replace(",", "")
    mult = 1024 if part.endswith("k") else 1
    try:
        v = int(part[:-1] if mult > 1 else part) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer such as 4096 or 4k, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``1024,4k``); ``k`` means x1024."""
    out = [positive_int(part) for part in text.split(",") if part.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected at least one value")
    return out


def rank_of(text: str) -> tuple[int, int]:
    """argparse type: ``RANK/SIZE`` for tensor or pipeline parallelism (``1/8``)."""
    rank, sep, size = text.partition("/")
    try:
        r, s = int(rank), int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK/SIZE such as 0/8, got {text!r}") from None
    if not sep or s < 1 or not 0 <= r < s:
        raise argparse.ArgumentTypeError(f"expected RANK/SIZE with 0 <= RANK < SIZE, got {text!r}")
    return r, s


def plain(doc: str | None, paragraph: int = 1) -> str:
    """One paragraph of a module docstring as plain text for ``--help`` (no reST markup)."""
    import re

    text = (doc or "").split("\n\n")[paragraph].replace("\n", " ")
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the data as JSON instead of a table")


