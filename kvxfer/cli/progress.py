"""What a long command is doing right now, on stderr, so ``--json`` output stays clean.

On a terminal, a rich progress bar over the command's steps, with the current step named
(starting the remote process, filling, transferring, verifying, per point). Elsewhere (a
pipe, a log file, CI), one line per step that took at least :data:`AFTER` seconds, when it
ends: a reader of the log sees where the time went without a line per millisecond step.
``KVXFER_PROGRESS_AFTER`` sets that threshold (``0``: every step).
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import Any

__all__ = ["Steps", "AFTER"]

#: Seconds a step must last before a non-terminal run reports it.
AFTER = 1.0


class Steps:
    """``with Steps("kvxfer bench", total) as steps: with steps.step("filling"): ...``."""

    def __init__(self, prog: str, total: int | None = None) -> None:
        self.prog = prog
        self.total = total
        try:
            self.after = float(os.environ.get("KVXFER_PROGRESS_AFTER", AFTER))
        except ValueError:
            self.after = AFTER
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> "Steps":
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
            from rich.progress import TimeElapsedColumn

            from ..table import console

            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if self.total:
                columns += [BarColumn(), MofNCompleteColumn()]
            self._bar = Progress(*columns, TimeElapsedColumn(), console=console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.prog, total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def step(self, what: str) -> "_Step":
        """A step, named as the user should read it: ``"verifying 256 blocks"``."""
        return _Step(self, what)

    def advance(self, n: int = 1) -> None:
        """One unit of the ``total`` done (a timed run of a point)."""
        if self._bar is not None:
            self._bar.advance(self._task, n)


class _Step:
    def __init__(self, steps: Steps, what: str) -> None:
        self.steps, self.what = steps, what

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        if self.steps._bar is not None:
            self.steps._bar.update(self.steps._task, description=f"{self.steps.prog}: {self.what}")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        seconds = time.perf_counter() - self.t0
        if self.steps._bar is None and kind is None and seconds >= self.steps.after:
            print(f"{self.steps.prog}: {self.what} ({seconds:.1f} s)", file=sys.stderr, flush=True)
