"""Python calls per small READ: how much interpreter work one 4 KB one-block READ costs.

A count, unlike a time, compares across machines (issue 37). One process holds two NIXL
agents over a packed 4 KB cache; after 200 warm-up READs, cProfile counts the calls of 100
more: ``Agent.read`` alone (until the transport's post returns), then ``read`` with ``done()``
polled until DONE, then ``Owner.read(...).wait()`` over the same agent (counted on the calling
thread only). Printed per READ: all calls, Python functions, and those in ``kvxfer/``.

    PYTHONPATH=$PWD:$PWD/plugins python benchmarks/count_calls.py [--backend nixl]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from typing import Any, Callable

import kvxfer
from kvxfer.testing.buffers import make_cache


def count(fn: Callable[[int], Any], n: int = 100) -> tuple[float, float, float]:
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        fn(i)
    pr.disable()
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    python = sum(v[1] for k, v in stats.items() if k[0] != "~")
    core = sum(v[1] for k, v in stats.items() if "/kvxfer/" in k[0])
    return sum(v[1] for v in stats.values()) / n, python / n, core / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="nixl")
    args = ap.parse_args()
    g = dict(num_layers=1, page=4096, num_blocks=64)
    src, dst = make_cache("packed", seed=1, **g), make_cache("packed", **g)
    with kvxfer.Agent("p", backend=args.backend) as a, kvxfer.Agent("d", backend=args.backend) as b:
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        b.add_peer(a.metadata())
        a.add_peer(b.metadata())
        for i in range(200):
            b.read("p", [i % 60], [(i * 7) % 60]).wait(5)
        posted: list[Any] = []
        r = count(lambda i: posted.append(b.read("p", [i % 60], [(i * 7) % 60])))
        print("read() until the post returns: %.0f calls, %.0f Python functions, %.0f in kvxfer/" % r)
        for t in posted:
            t.wait(5)

        def full(i: int) -> None:
            t = b.read("p", [i % 60], [(i * 7) % 60])
            while not t.done():
                pass

        print("read() + done() until DONE:    %.0f calls, %.0f Python functions, %.0f in kvxfer/" % count(full))
        owner = kvxfer.Owner(b, close_agent=False)
        try:
            for i in range(200):  # the first READ of the shape goes the general way, on the loop
                owner.read("p", [i % 60], [(i * 7) % 60]).wait(5)
            print("Owner.read().wait():           %.0f calls, %.0f Python functions, %.0f in kvxfer/"
                  % count(lambda i: owner.read("p", [i % 60], [(i * 7) % 60]).wait(5)))
        finally:
            owner.close()


if __name__ == "__main__":
    main()
