"""A fleet on one machine: N prefill and M decode workers that find each other through etcd.

Every worker is its own process with its own agent. Prefill workers fill their KV cache with
seeded random bytes and publish themselves under ``kvxfer/v1/<cluster>/prefill/...``;
decode workers publish under ``.../decode/...``, follow the prefill role with a
:class:`~kvxfer.directory.PeerTracker`, and pull a batch of requests (each from the prefill
worker that "computed" it). Every request is checked byte for byte against the prefill's
seeded bytes, and the untouched blocks against the 0xAA sentinel. The script prints what
the directory held and who read what from whom, with GB/s.

    python examples/fleet.py --prefill 3 --decode 2 --requests 24

Without ``--etcd URL`` it starts a throwaway etcd on loopback (the ``etcd`` binary must be
installed: ``apt-get install etcd-server``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvxfer import Agent
from kvxfer.directory import EtcdDirectory, PeerTracker
from kvxfer.testing.buffers import SENTINEL, make_cache


@dataclass(frozen=True)
class Shape:
    blocks: int = 64
    layers: int = 8
    page: int = 64 * 1024  # 64 KiB per layer per block: 512 KiB per block

    def cache(self, seed: int | None = None) -> Any:
        return make_cache("packed", num_blocks=self.blocks, num_layers=self.layers, page=self.page, seed=seed)


def prefill_worker(url: str, cluster: str, index: int, backend: str, shape: Shape, stop: Any) -> None:
    cache = shape.cache(seed=1000 + index)
    with Agent(f"prefill-{index}", backend=backend) as agent, EtcdDirectory(url, cluster, ttl=5) as directory:
        agent.register(cache.views)
        directory.publish(agent, "prefill", tp_rank=0)
        while not stop.is_set():  # serve reads: drive the backend for initiators that need it
            agent.progress()
            time.sleep(0.0005)


def decode_worker(url: str, cluster: str, index: int, backend: str, shape: Shape, n_prefill: int,
                  work: list[tuple[int, int, list[int], list[int]]], results: Any) -> None:
    cache = shape.cache()
    with Agent(f"decode-{index}", backend=backend, timeout=60) as agent, \
            EtcdDirectory(url, cluster, ttl=5) as directory:
        agent.register(cache.views)
        directory.publish(agent, "decode", tp_rank=0)
        directory.wait_for(role="prefill", count=n_prefill, timeout=60)
        tracker = PeerTracker(agent, directory, role="prefill")
        while len(agent.peers) < n_prefill:
            tracker.sync()
            tracker.wait_changed(0.5)
        for name in agent.peers:  # the first read of a pair opens the connection: not timed
            agent.read(name, [0], [0]).wait()
        for s in cache.storages:
            s[...] = SENTINEL
        sources = {}
        for req, src, remote, local in work:
            peer = f"prefill-{src}"
            if src not in sources:  # the prefill's bytes, rebuilt from its seed: the reference
                sources[src] = shape.cache(seed=1000 + src).layer_pages()
            t0 = time.perf_counter()
            t = agent.read(peer, local, remote).wait()
            seconds = time.perf_counter() - t0
            got = cache.layer_pages()
            ok = bool(np.array_equal(got[:, local], sources[src][:, remote]))
            untouched = np.setdiff1d(np.arange(shape.blocks), local)
            ok &= bool((got[:, untouched] == SENTINEL).all())
            results.put((agent.name, peer, req, len(local), t.stats.nbytes, seconds, ok))
            for s in cache.storages:  # back to the sentinel for the next request
                s[...] = SENTINEL


def plan_requests(n_prefill: int, n_decode: int, n_requests: int, per_request: int,
                  shape: Shape) -> list[list[tuple[int, int, list[int], list[int]]]]:
    """Request r was prefilled on worker r % N and is decoded on r % M, at random block ids."""
    rng = np.random.default_rng(7)
    work: list[list[tuple[int, int, list[int], list[int]]]] = [[] for _ in range(n_decode)]
    for r in range(n_requests):
        remote = rng.choice(shape.blocks, per_request, replace=False).tolist()
        local = rng.choice(shape.blocks, per_request, replace=False).tolist()
        work[r % n_decode].append((r, r % n_prefill, remote, local))
    return work


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=3)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--blocks-per-request", type=int, default=16)
    ap.add_argument("--backend", default="nixl")
    ap.add_argument("--etcd", default=None, help="etcd URL (default: start one on loopback)")
    ap.add_argument("--cluster", default="fleet")
    args = ap.parse_args(argv)
    console = Console()
    shape = Shape()
    server = None
    if args.etcd is None:
        from kvxfer.testing.etcd_server import EtcdServer

        server = EtcdServer().start()
        args.etcd = server.url
        console.print(f"etcd started at {server.url} (data in {server.base})")
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    work = plan_requests(args.prefill, args.decode, args.requests, args.blocks_per_request, shape)
    prefills = [ctx.Process(target=prefill_worker, args=(args.etcd, args.cluster, i, args.backend, shape, stop))
                for i in range(args.prefill)]
    decodes = [ctx.Process(target=decode_worker, args=(args.etcd, args.cluster, j, args.backend, shape,
                                                       args.prefill, work[j], results))
               for j in range(args.decode)]
    rows: list[tuple[str, str, int, int, int, float, bool]] = []
    try:
        with EtcdDirectory(args.etcd, args.cluster) as directory:
            for p in prefills + decodes:
                p.start()
            directory.wait_for(role="decode", count=args.decode, timeout=120)
            directory.wait_for(role="prefill", count=args.prefill, timeout=120)
            listing = directory.entries()
            t0 = time.perf_counter()
            while len(rows) < args.requests:
                try:
                    rows.append(results.get(timeout=5))
                except queue.Empty:
                    if not any(p.is_alive() for p in decodes):
                        raise SystemExit("a decode worker died before finishing its requests") from None
            wall = time.perf_counter() - t0
    finally:
        stop.set()
        for p in decodes + prefills:
            p.join(30)
            if p.is_alive():
                p.kill()
        if server is not None:
            server.close()

    t = Table(title=f"etcd directory: cluster {args.cluster!r}")
    for col in ("key", "role", "tp", "pp", "generation", "backend"):
        t.add_column(col)
    for e in listing:
        t.add_row(e.key, e.role, str(e.tp_rank), str(e.pp_rank), str(e.generation), e.backend)
    console.print(t)

    pairs: dict[tuple[str, str], list[Any]] = {}
    for dec, pre, _req, blocks, nbytes, seconds, ok in rows:
        acc = pairs.setdefault((dec, pre), [0, 0, 0, 0.0, True])
        acc[0] += 1
        acc[1] += blocks
        acc[2] += nbytes
        acc[3] += seconds
        acc[4] &= ok
    t = Table(title=f"{args.requests} requests, {args.prefill} prefill -> {args.decode} decode over {args.backend}")
    for col, just in (("decode", "left"), ("read from", "left"), ("requests", "right"), ("blocks", "right"),
                      ("MiB", "right"), ("seconds", "right"), ("GB/s", "right"), ("verified", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for (dec, pre), (n, blocks, nbytes, seconds, ok) in sorted(pairs.items()):
        t.add_row(dec, pre, str(n), str(blocks), f"{nbytes / 2**20:.0f}", f"{seconds:.3f}",
                  f"{nbytes / seconds / 1e9:.2f}", "yes" if ok else "NO")
    total, busy = sum(r[4] for r in rows), sum(r[5] for r in rows)
    t.add_row("all", "", str(len(rows)), str(sum(r[3] for r in rows)), f"{total / 2**20:.0f}", f"{busy:.3f}",
              f"{total / busy / 1e9:.2f}", "yes" if all(r[6] for r in rows) else "NO", style="bold")
    console.print(t)
    console.print(f"seconds: time inside read() and wait(), summed per row; GB/s = bytes / those seconds. "
                  f"The whole batch, checks of every byte included, took {wall:.2f} s of wall time.")
    return 0 if all(r[6] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
