"""This NIXL backend against another checkout's, in one process, interleaved: the seam's cost.

Two-process bandwidth runs on a shared machine swing by tens of percent from run to run,
far more than any change to the backend's own code can move them. This script measures
what that code costs, with both versions loaded side by side (the other checkout's
``plugins/kvxfer_nixl`` is imported under another package name) and timed transfer by
transfer in alternation, so that load on the machine hits both alike. Each version gets its own pair of
agents with the same buffers; every transfer is verified once per round.

Measured per version: ``post`` + ``poll`` until done + ``release`` of a READ of one small
block (the per-transfer cost) and of 256 blocks of 64 KiB (a 16 MiB request), by default
in CPU time of the measuring thread (with shared memory the copy runs in that thread too),
which other jobs on the machine disturb far less than elapsed time.

Usage::

    git worktree add --detach /tmp/nixl-before main
    python plugins/kvxfer_nixl/tests/ab_seam.py --before /tmp/nixl-before --rounds 20
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from types import ModuleType
from typing import Any

import numpy as np

SENTINEL = 0xAA


def load(plugin_dir: str, name: str) -> ModuleType:
    """Import ``plugin_dir`` (a kvxfer_nixl package) as package ``name``; return its backend."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(plugin_dir, "__init__.py"),
                                                  submodule_search_locations=[plugin_dir])
    assert spec is not None and spec.loader is not None
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f"{name}.backend")


class Pair:
    """Two backends of one version: ``b`` reads from ``a``."""

    def __init__(self, mod: ModuleType, tag: str, rows: int, row: int) -> None:
        from kvxfer import DescriptorList
        from kvxfer.memory import Allocation

        self.src = np.random.default_rng(1).integers(0, 256, (rows, row), dtype=np.uint8)
        self.dst = np.full((rows, row), SENTINEL, np.uint8)
        self.a, self.b = mod.NixlBackend(f"{tag}-a"), mod.NixlBackend(f"{tag}-b")
        self.a.register([Allocation(self.src.ctypes.data, self.src.nbytes)])
        self.b.register([Allocation(self.dst.ctypes.data, self.dst.nbytes)])
        self.b.add_remote(f"{tag}-a", self.a.local_metadata())

        def rows_of(arr: np.ndarray) -> Any:
            return DescriptorList(np.array([[arr.ctypes.data, row, 0, row, rows]], dtype=np.uint64))

        self.lp, self.rp = self.b.prepare(None, rows_of(self.dst)), self.b.prepare(f"{tag}-a", rows_of(self.src))

    def read(self, li: np.ndarray, ri: np.ndarray) -> None:
        from kvxfer import Op

        x = self.b.post(Op.READ, self.lp, li, self.rp, ri, None)
        while not self.b.poll(x):
            pass
        self.b.release(x)

    def verify(self, li: np.ndarray, ri: np.ndarray) -> None:
        self.dst[...] = SENTINEL
        self.read(li, ri)
        if not np.array_equal(self.dst[li], self.src[ri]):
            raise AssertionError("wrong bytes")
        rest = np.setdiff1d(np.arange(self.dst.shape[0]), li)
        if not (self.dst[rest] == SENTINEL).all():
            raise AssertionError("bytes outside the request changed")

    def close(self) -> None:
        self.b.close()
        self.a.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="root of the checkout to compare against")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--small-iters", type=int, default=500)
    ap.add_argument("--big-iters", type=int, default=40)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: this thread's CPU time (robust to other load on the machine); wall: elapsed")
    args = ap.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    versions = {"before": load(os.path.join(args.before, "plugins", "kvxfer_nixl"), "kvxfer_nixl_before"),
                "after": load(here, "kvxfer_nixl_after")}
    cases = {"one 64 B block": (256, 64, 1, args.small_iters), "256 x 64 KiB": (256, 64 << 10, 256, args.big_iters)}
    rng = np.random.default_rng(0)
    results: dict[tuple[str, str], list[float]] = {}
    for case, (rows, row, n, iters) in cases.items():
        pairs = {v: Pair(m, f"{v}{row}", rows, row) for v, m in versions.items()}
        try:
            for r in range(args.rounds):
                li = rng.permutation(rows)[:n].astype(np.int32)
                ri = rng.permutation(rows)[:n].astype(np.int32)
                for p in pairs.values():
                    p.verify(li, ri)
                spent = dict.fromkeys(pairs, 0.0)
                order = list(pairs)
                for i in range(iters):  # alternate every transfer, so noise hits both alike
                    for v in order if i % 2 == 0 else order[::-1]:
                        t0 = clock()
                        pairs[v].read(li, ri)
                        spent[v] += clock() - t0
                for v, t in spent.items():
                    results.setdefault((case, v), []).append(t / iters * 1e6)
        finally:
            for p in pairs.values():
                p.close()
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"post + poll + release, {args.clock} us per READ (median of {args.rounds} rounds)")
    for c in ("request", "before", "after", "after / before"):
        table.add_column(c, justify="left" if c == "request" else "right")
    for case in cases:
        b, a = statistics.median(results[(case, "before")]), statistics.median(results[(case, "after")])
        table.add_row(case, f"{b:.1f}", f"{a:.1f}", f"{a / b:.3f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
