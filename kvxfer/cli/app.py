"""Argument parsing and the one place where errors become a single line and an exit code."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from ..errors import KvxferError
from .output import CliError, json_stdout

__all__ = ["main", "build_parser", "CliError"]

#: Exit codes: 1 = kvxfer refused or failed (typed error), 2 = bad command-line input.
EXIT_FAILED, EXIT_USAGE = 1, 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> Parser:
    from .. import __version__
    from . import backends, bench, demo, doctor, plan

    ap = Parser(prog="kvxfer", description="Move KV-cache blocks between inference workers.")
    ap.add_argument("--version", action="version", version=f"kvxfer {__version__}")
    _verbose(ap, 0)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for mod in (backends, plan, bench, demo, doctor):
        mod.add_parser(sub)
    for p in sub.choices.values():  # global options work after the subcommand too
        _verbose(p, argparse.SUPPRESS)
    return ap


def _verbose(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="log to stderr through the 'kvxfer' logger (-v: info, -vv: debug); before or after "
                        "the command")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``kvxfer`` command; returns its exit status."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.verbose:
        from ..observe import enable_logging

        enable_logging("DEBUG" if args.verbose > 1 else "INFO")
    prog = f"kvxfer {args.command}"
    try:
        with json_stdout(bool(getattr(args, "json", False))):
            return int(args.fn(args) or 0)
    except CliError as exc:
        return _fail(prog, str(exc), EXIT_USAGE)
    except KvxferError as exc:
        return _fail(prog, f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    except OSError as exc:
        return _fail(prog, str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130)


def _fail(prog: str, message: str, code: int) -> int:
    one_line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"{prog}: error: {one_line}", file=sys.stderr)
    return code
