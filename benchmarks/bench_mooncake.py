"""Raw Mooncake Transfer Engine against kvxfer on Mooncake: same buffers, same block ids.

One READ request per iteration, decode pulling blocks from prefill over Mooncake's TCP
transport (two engines in this process; the bytes cross the loopback interface). Raw
Mooncake is done as well as its API allows: one ``batch_transfer_sync_read`` per request,
address lists built once outside the timed loop. kvxfer does ``Agent.read(...).wait()``:
planning, bounds checks, the worker thread and the same batch call, landing in the plugin's
arena and copied out once done (its fence, ``plugins/kvxfer_mooncake/_bounce.py``). For the same request,
kvxfer on NIXL and on raw UCX, both over UCX's TCP transport (``UCX_TLS=tcp``, set here before
either loads; UCX with ``trusted_network``), so every column crosses loopback TCP. Each runs in a
child process of its own (NIXL's bundled UCX and the libucx wheel never share a process), both
agents in that child: NIXL with its progress thread, UCX with a thread progressing the serving
agent (its target is progressed only by its owner). NIXL over TCP fences its READs through a
bounce area (docs/design.md section 7); that copy is in its column.

Shapes: ``packed`` rows (every layer of a block contiguous: one descriptor per block),
``layers`` (one array per layer on both sides: one descriptor per layer and block),
``layers:packed`` (per-layer arrays here, packed rows on the peer: raw Mooncake, which has no
scatter, sends one descriptor per page; kvxfer on Mooncake reads one span per remote row into
its arena and scatters the pages locally), and ``one-block`` (one 4 KiB block, the added cost
per small transfer). ``layers:packed`` is DeepSeek-V3's MLA latent cache, the ``mla-61``
geometry of ``kvxfer bench``: 61 layers of 18 KiB pages (16 tokens x 576 values x 2 bytes),
many layers of small pages, where a per-page descriptor costs most. Raw and kvxfer samples
alternate (raw, kvxfer, raw, ...) so that drift on a shared machine reaches both alike.
Every mode's destination is checked once against a numpy reference (pattern source,
sentinel destination).

    python benchmarks/bench_mooncake.py [--iters 20] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import statistics
from typing import Any, Callable, Iterator

import numpy as np

from kvxfer import Agent
from kvxfer.testing.buffers import make_cache

try:
    from _timing import Column, print_table, samples
except ImportError:  # run as a module
    from benchmarks._timing import Column, print_table, samples

os.environ.setdefault("UCX_TLS", "tcp")  # read when UCX loads: NIXL and raw UCX over TCP, like Mooncake here

OPTS: dict[str, Any] = {"trusted_network": True}
#: kvxfer on the other real backends for the same request: (column, backend, options).
OTHERS: list[tuple[str, str, dict[str, Any]]] = [
    ("nixl", "nixl", {"progress_thread": True}),
    ("ucx", "ucx", {"trusted_network": True, "same_host_copy": False, "tls": "self,tcp"})]
#: name: (local layout, remote layout, layers, page bytes, blocks per cache, blocks moved)
SHAPES = {"packed": ("packed", "packed", 16, 64 << 10, 64, 32), "layers": ("layers", "layers", 16, 64 << 10, 64, 32),
          "layers:packed": ("layers", "packed", 61, 18 << 10, 64, 32),
          "one-block": ("packed", "packed", 1, 4096, 64, 1)}


def _page(cache: Any, layer: int, block: int) -> int:
    if cache.kind == "packed":
        return int(cache.storages[0][block].ctypes.data) + layer * cache.page
    return int(cache.storages[layer][block].ctypes.data)


def _rows(dst: Any, src: Any, dst_ids: list[int], src_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Local and remote addresses and lengths raw Mooncake moves: one span per block where
    both sides are packed rows, else one per page (its API has no scatter)."""
    if dst.kind == src.kind == "packed":
        row = dst.num_layers * dst.page
        return ([_page(dst, 0, b) for b in dst_ids], [_page(src, 0, b) for b in src_ids], [row] * len(dst_ids))
    pairs = [(layer, d, s) for layer in range(dst.num_layers) for d, s in zip(dst_ids, src_ids)]
    return ([_page(dst, layer, d) for layer, d, _ in pairs], [_page(src, layer, s) for layer, _, s in pairs],
            [dst.page] * len(pairs))


def _kvxfer(backend: str, opts: dict[str, Any], src: Any, dst: Any, src_ids: list[int], dst_ids: list[int],
            want: np.ndarray, iters: int) -> float:
    """Median seconds of ``Agent.read(...).wait()`` on ``backend``, after a verified warm-up."""
    with _agents(backend, opts, src, dst, src_ids, dst_ids, want) as kv:
        return statistics.median(samples(kv, iters))


@contextlib.contextmanager
def _agents(backend: str, opts: dict[str, Any], src: Any, dst: Any, src_ids: list[int], dst_ids: list[int],
            want: np.ndarray) -> Iterator[Callable[[], None]]:
    """``Agent.read(...).wait()`` on ``backend`` as a callable, after a verified warm-up."""
    for s in dst.storages:
        s[...] = 0xAA
    with Agent("prefill", backend=backend, **opts) as a, Agent("decode", backend=backend, **opts) as d:
        a.register(src.views, replicated=True)
        d.register(dst.views, replicated=True)
        peer = d.add_peer(a.metadata())
        stop = threading.Event()

        def serve() -> None:  # what the serving process's own loop would do
            while not stop.is_set():
                a.progress()
                time.sleep(0)

        server = threading.Thread(target=serve, daemon=True)
        if a.backend.capabilities.needs_progress:
            server.start()

        def kv() -> None:
            d.read(peer, dst_ids, src_ids).wait()

        try:
            kv()
            assert np.array_equal(dst.layer_pages(), want), f"kvxfer on {backend} moved the wrong bytes"
            yield kv
        finally:
            stop.set()
            if server.is_alive():
                server.join()


def _setup(name: str) -> tuple[Any, Any, list[int], list[int], np.ndarray]:
    """The shape's caches, block ids and the numpy reference of the destination after the READ."""
    local, remote, layers, page, nblocks, n = SHAPES[name]
    rng = np.random.default_rng(1)
    src_ids = [int(x) for x in rng.permutation(nblocks)[:n]]
    dst_ids = [int(x) for x in rng.permutation(nblocks)[:n]]
    src = make_cache(remote, num_blocks=nblocks, num_layers=layers, page=page, seed=5)
    dst = make_cache(local, num_blocks=nblocks, num_layers=layers, page=page)
    want = dst.layer_pages().copy()
    want[:, dst_ids] = src.layer_pages()[:, src_ids]  # the independent reference
    return src, dst, src_ids, dst_ids, want


def column(col: str, shapes: list[str], iters: int) -> dict[str, float]:
    """One other backend's medians per shape (run in a child process of its own)."""
    _, backend, opts = next(o for o in OTHERS if o[0] == col)
    out = {}
    for name in shapes:
        src, dst, src_ids, dst_ids, want = _setup(name)
        out[name] = _kvxfer(backend, opts, src, dst, src_ids, dst_ids, want, iters)
    return out


def run_shape(name: str, iters: int) -> dict[str, Any]:
    from mooncake.engine import TransferEngine

    src, dst, src_ids, dst_ids, want = _setup(name)

    raw_t, raw_d = TransferEngine(), TransferEngine()
    for e in (raw_t, raw_d):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    for e, c in ((raw_t, src), (raw_d, dst)):
        for s in c.storages:
            assert e.register_memory(s.ctypes.data, s.nbytes) == 0
    session = f"127.0.0.1:{raw_t.get_rpc_port()}"
    local, remote, lengths = _rows(dst, src, dst_ids, src_ids)

    def raw() -> None:
        assert raw_d.batch_transfer_sync_read(session, local, remote, lengths) == 0

    out: dict[str, Any] = {"shape": name, "descriptors": len(lengths), "bytes": sum(lengths)}
    raw()
    assert np.array_equal(dst.layer_pages(), want), "raw Mooncake moved the wrong bytes"
    raws, kvs = [], []
    with _agents("mooncake", OPTS, src, dst, src_ids, dst_ids, want) as kv:
        for _ in range(iters):  # alternating: drift on a shared machine reaches both alike
            raws += samples(raw, 1)
            kvs += samples(kv, 1)
    out["raw_s"], out["kvxfer_s"] = statistics.median(raws), statistics.median(kvs)
    out["ratio"] = out["raw_s"] / out["kvxfer_s"]
    out["added_us"] = (out["kvxfer_s"] - out["raw_s"]) * 1e6
    out["raw_gbs"] = out["bytes"] / out["raw_s"] / 1e9
    out["kvxfer_gbs"] = out["bytes"] / out["kvxfer_s"] / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-others", action="store_true", help="skip the NIXL and UCX columns")
    ap.add_argument("--column", help=argparse.SUPPRESS)  # child mode: one other backend, JSON out
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if args.column:
        print(json.dumps(column(args.column, shapes, args.iters)))
        return 0
    rows = [run_shape(s, args.iters) for s in shapes]
    for col, _, _ in OTHERS:
        got: dict[str, float] = {}
        if not args.no_others:
            r = subprocess.run([sys.executable, __file__, "--column", col, "--shapes", args.shapes, "--iters",
                                str(args.iters)], capture_output=True, text=True, check=True)
            got = json.loads(r.stdout.strip().splitlines()[-1])
        for row in rows:
            row[f"{col}_s"] = got.get(row["shape"])
    if args.json:
        print(json.dumps(rows))
        return 0
    print_table(rows, [Column("shape"), Column("descriptors"), Column("bytes"),
                       Column("raw_s", "raw median s", fmt=lambda v: f"{v * 1e3:.3f} ms"),
                       Column("kvxfer_s", "kvxfer median", fmt=lambda v: f"{v * 1e3:.3f} ms"),
                       Column("raw_gbs", "raw GB/s", fmt=lambda v: f"{v:.2f}"),
                       Column("kvxfer_gbs", "kvxfer GB/s", fmt=lambda v: f"{v:.2f}"),
                       Column("ratio", "kvxfer/raw speed", fmt=lambda v: f"{v:.3f}x"),
                       Column("added_us", "added per request", fmt=lambda v: f"{v:+.0f} us"),
                       *[Column(f"{c}_s", f"kvxfer on {c} (TCP)",
                                fmt=lambda v: "-" if v is None else f"{v * 1e3:.3f} ms") for c, _, _ in OTHERS]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
