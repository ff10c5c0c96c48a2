"""The ``kvxfer`` command: list backends, print plan tables, run the demo."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

import numpy as np

__all__ = ["main"]


def _backends(_: argparse.Namespace) -> int:
    from .plugin.registry import available_backends

    rows = available_backends()
    print(f"{'backend':<14} {'plugin':<16} {'status':<12} detail")
    for s in rows:
        detail = s.summary if s.available else f"{s.reason}; install: {s.install or '-'}"
        print(f"{s.name:<14} {s.plugin:<16} {'available' if s.available else 'unavailable':<12} {detail}")
    return 0


def plan_table(tokens: int, presets: Sequence[str] | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Descriptors for one request, whole rows against per-layer regions, per preset."""
    from .planner import plan
    from .presets import PRESETS

    rows = []
    rng = np.random.default_rng(seed)
    for name in presets or list(PRESETS):
        p = PRESETS[name]
        n = p.blocks_for(tokens)
        pool = n * 2
        packed, layers = p.spec(pool), p.spec(pool, packed=False)
        lb, rb = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
        for label, remote in (("whole rows", packed), ("per layer", layers)):
            t0 = time.perf_counter()
            pl = plan(packed, remote, lb, rb)
            dt = time.perf_counter() - t0
            rows.append({"preset": name, "peer": label, "blocks": n, "descriptors": pl.descriptors,
                         "bytes": pl.nbytes, "plan_ms": dt * 1e3})
    return rows


def _plan(args: argparse.Namespace) -> int:
    rows = plan_table(args.tokens, args.preset or None)
    print(f"{args.tokens}-token request, local cache block-outermost (packed rows)")
    print(f"{'preset':<8} {'remote':<11} {'blocks':>7} {'descriptors':>12} {'GB':>7} {'plan ms':>8}")
    for r in rows:
        print(f"{r['preset']:<8} {r['peer']:<11} {r['blocks']:>7} {r['descriptors']:>12,} "
              f"{r['bytes'] / 1e9:>7.2f} {r['plan_ms']:>8.3f}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args.rest)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer", description="Move KV-cache blocks between inference workers.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends and whether they can run here").set_defaults(fn=_backends)
    p = sub.add_parser("plan", help="descriptor counts for a request on the built-in model presets")
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--preset", action="append", help="limit to these presets (repeatable)")
    p.set_defaults(fn=_plan)
    d = sub.add_parser("demo", help="prefill and decode move a real KV request and verify it")
    d.add_argument("rest", nargs=argparse.REMAINDER)
    d.set_defaults(fn=_demo)
    args = ap.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
