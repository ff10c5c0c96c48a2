"""Helpers more than one test file needs, written once (fixtures built on them: conftest.py)."""

from __future__ import annotations

import queue
from contextlib import contextmanager
from typing import Iterator

import numpy as np

import kvxfer
from kvxfer import Op
from kvxfer.errors import HandshakeError
from kvxfer.testing.buffers import SENTINEL, Cache, make_cache

__all__ = ["GEOM", "SENTINEL", "Errors", "agent_pair", "assert_rows_moved", "has_nixl", "pattern_rows"]

#: The small caches of the agent tests: 3 layers of 128-byte pages.
GEOM = {"num_layers": 3, "page": 128}


class Errors:
    """Collects what a side-channel server reports through ``on_error``, with a blocking ``get``."""

    def __init__(self) -> None:
        self.q: queue.Queue[HandshakeError] = queue.Queue()

    def __call__(self, error: HandshakeError) -> None:
        self.q.put(error)

    def get(self) -> HandshakeError:
        return self.q.get(timeout=30)


def has_nixl() -> bool:
    """Whether the nixl package imports here (its tests are skipped, with the reason, if not)."""
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


def pattern_rows(count: int, row: int, seed: int | None) -> np.ndarray:
    """``(count, row)`` bytes: a seeded pattern (a source), or :data:`SENTINEL` where ``seed`` is None."""
    if seed is None:
        return np.full((count, row), SENTINEL, np.uint8)
    return np.random.default_rng(seed).integers(0, 256, (count, row), dtype=np.uint8)


def assert_rows_moved(op: Op, local: np.ndarray, remote: np.ndarray, local_before: np.ndarray,
                      remote_before: np.ndarray, li: np.ndarray, ri: np.ndarray) -> None:
    """After ``op`` between row-indexed arrays: the paired rows moved, every other byte of both
    sides stayed. The reference is plain numpy indexing over the arrays as they were."""
    want_l, want_r = local_before.copy(), remote_before.copy()
    if op is Op.READ:
        want_l[li] = remote_before[ri]
    else:
        want_r[ri] = local_before[li]
    np.testing.assert_array_equal(local, want_l)
    np.testing.assert_array_equal(remote, want_r)


@contextmanager
def agent_pair(blocks: int, seed: int, **options: object) -> Iterator[tuple[kvxfer.Agent, kvxfer.Agent, Cache, Cache]]:
    """Prefill ``p`` holding a ``seed``-filled packed cache and decode ``d`` holding a sentinel
    one (``blocks`` blocks of :data:`GEOM`), both registered, on ``options``' backend
    (loopback by default); ``d`` has not added ``p`` yet: ``(p, d, p's cache, d's cache)``."""
    src = make_cache("packed", num_blocks=blocks, seed=seed, **GEOM)
    dst = make_cache("packed", num_blocks=blocks, **GEOM)
    with kvxfer.Agent("p", **options) as a, kvxfer.Agent("d", **options) as b:  # type: ignore[arg-type]
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        yield a, b, src, dst
