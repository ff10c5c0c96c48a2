"""Wall-clock sampling and the table printer shared by the benchmark scripts.

Run them as ``python benchmarks/x.py``. Tables go through kvxfer's one printer
(:mod:`kvxfer.table`): rows are dicts, columns say how to format them, and ``--json``
output can reuse the same rows.
"""

from __future__ import annotations

import time
from typing import Callable

from kvxfer.table import Column, count, print_table

__all__ = ["samples", "Column", "count", "print_table"]


def samples(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds taken by each of ``repeat`` calls of ``fn`` (warm it up first yourself);
    ``setup`` runs before each call, untimed."""
    out = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
