"""The ``kvxfer`` command: backends, plan, bench, demo and doctor.

Each subcommand lives in its own module here and prints through :mod:`kvxfer.table`,
or JSON with ``--json``. Bad input is one line on stderr and a non-zero exit, never a
traceback: :func:`kvxfer.cli.app.main` turns kvxfer's typed errors into that line.
"""

from __future__ import annotations

from .app import main

__all__ = ["main"]
