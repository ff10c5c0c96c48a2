"""Wall-clock sampling shared by the benchmark scripts (run as ``python benchmarks/x.py``)."""

from __future__ import annotations

import time
from typing import Callable


def samples(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds taken by each of ``repeat`` calls of ``fn`` (warm it up first yourself)."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
