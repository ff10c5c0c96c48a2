"""``make demo``: a prefill process and a decode process move a real KV request and verify it.

Prefill registers a block-outermost 61-layer MLA cache (64-token blocks, 576 bf16 channels,
4.5 MB rows) filled with seeded random bytes and serves its metadata over the TCP side
channel. Decode fetches that metadata and pulls one request twice: into a packed cache
(whole rows: one descriptor per block) and into per-layer regions (61 descriptors per
block). It checks every byte of the request against the seeded bytes, checks that every
other byte still holds the 0xAA sentinel, and prints what each way cost.

The backend is NIXL when installed, otherwise the in-process loopback (then prefill runs in
the same process, and the demo says so). VRAM is used where torch sees a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import Agent
from .plugin.registry import available_backends
from .presets import PRESETS

SENTINEL = 0xAA


@dataclass
class Geometry:
    layers: int
    page: int
    pool: int
    request: int
    seed: int

    @property
    def row(self) -> int:
        return self.layers * self.page

    def prefill_blocks(self) -> np.ndarray:
        return np.random.default_rng(self.seed).permutation(self.pool)[: self.request]

    def decode_blocks(self) -> np.ndarray:
        return np.random.default_rng(self.seed + 1).permutation(self.pool)[: self.request]

    def row_bytes(self, block: int) -> np.ndarray:
        """The bytes prefill stores in a block: reproducible from (seed, block) alone."""
        return np.random.default_rng((self.seed, block)).integers(0, 256, self.row, dtype=np.uint8)


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _alloc(shape: tuple[int, ...], memory: str, device: int) -> Any:
    if memory == "VRAM":
        import torch

        return torch.full(shape, SENTINEL, dtype=torch.uint8, device=f"cuda:{device}")
    return np.full(shape, SENTINEL, dtype=np.uint8)


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def _packed_views(storage: Any, g: Geometry) -> dict[str, Any]:
    return {f"layer.{i}": storage[:, i * g.page:(i + 1) * g.page] for i in range(g.layers)}


def prefill_cache(g: Geometry, memory: str, device: int) -> Any:
    storage = _alloc((g.pool, g.row), memory, device)
    for b in g.prefill_blocks().tolist():
        data = g.row_bytes(b)
        if memory == "VRAM":
            import torch

            storage[b].copy_(torch.from_numpy(data))
        else:
            storage[b] = data
    return storage


def run_prefill(args: argparse.Namespace) -> int:
    """Child process: register, serve metadata, keep the backend progressing until told to stop."""
    from .sidechannel import MetadataServer

    g = Geometry(**json.loads(args.geometry))
    storage = prefill_cache(g, args.memory, args.device)
    with Agent("prefill", backend=args.backend) as agent:
        agent.register(_packed_views(storage, g), replicated=True)
        with MetadataServer(agent.metadata(), "127.0.0.1", 0, token=args.token) as server:
            host, port = server.address
            print(json.dumps({"host": host, "port": port}), flush=True)
            import select

            while True:  # until decode closes our stdin
                ready, _, _ = select.select([sys.stdin], [], [], 0.001)
                if ready and not sys.stdin.readline():
                    break
                agent.progress()
    return 0


def _decode_side(backend: str, metadata: bytes, g: Geometry, memory: str, device: int) -> list[dict[str, Any]]:
    rows_store = _alloc((g.pool, g.row), memory, device)
    layer_stores = [_alloc((g.pool, g.page), memory, device) for _ in range(g.layers)]
    pb, db = g.prefill_blocks(), g.decode_blocks()
    results = []
    for label, views in (("whole rows", _packed_views(rows_store, g)),
                         ("per-layer regions", {f"layer.{i}": s for i, s in enumerate(layer_stores)})):
        with Agent(f"decode-{'rows' if label == 'whole rows' else 'layers'}", backend=backend, timeout=300) as agent:
            agent.register(views, replicated=True)
            peer = agent.add_peer(metadata)
            agent.read(peer, [], []).wait()  # connect before timing
            t = agent.read(peer, db, pb)
            t.wait()
            results.append({"how": label, "descriptors": t.stats.descriptors, "posts": t.stats.posts,
                            "bytes": t.stats.nbytes, "seconds": t.stats.seconds})
    # Verify every byte: requested blocks hold prefill's bytes, all others the sentinel.
    moved = np.zeros(g.pool, dtype=bool)
    moved[db] = True
    rows_h = _host(rows_store)
    layers_h = [_host(s) for s in layer_stores]
    for d, p in zip(db.tolist(), pb.tolist()):
        want = g.row_bytes(p)
        if not np.array_equal(rows_h[d], want):
            raise SystemExit(f"VERIFY FAILED: whole-row block {d} differs from prefill block {p}")
        for i, s in enumerate(layers_h):
            if not np.array_equal(s[d], want[i * g.page:(i + 1) * g.page]):
                raise SystemExit(f"VERIFY FAILED: layer {i} of block {d} differs from prefill block {p}")
    if not (rows_h[~moved] == SENTINEL).all() or not all((s[~moved] == SENTINEL).all() for s in layers_h):
        raise SystemExit("VERIFY FAILED: bytes outside the request changed")
    return results


def _print_table(results: list[dict[str, Any]], backend: str, memory: str, mode: str, g: Geometry) -> None:
    print(f"\nkvxfer demo: decode pulled {g.request} blocks ({g.request * 64} tokens) of a {g.layers}-layer MLA "
          f"cache, {g.row / 1e6:.2f} MB rows")
    print(f"backend={backend} memory={memory} {mode}")
    print(f"{'decode layout':<20} {'descriptors':>12} {'posts':>6} {'GB':>7} {'seconds':>9} {'GB/s':>8}  verified")
    for r in results:
        gbps = r["bytes"] / r["seconds"] / 1e9 if r["seconds"] else float("nan")
        print(f"{r['how']:<20} {r['descriptors']:>12,} {r['posts']:>6} {r['bytes'] / 1e9:>7.3f} "
              f"{r['seconds']:>9.4f} {gbps:>8.2f}  every byte")
    print("sentinel (0xAA) intact outside the request in both decode caches\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvxfer demo", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", help="auto (nixl, else loopback), nixl, ucx or loopback")
    ap.add_argument("--tokens", type=int, default=16384, help="request length (default sized for a small machine)")
    ap.add_argument("--memory", choices=("auto", "DRAM", "VRAM"), default="auto")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--token", default=None, help="shared secret for the metadata side channel")
    ap.add_argument("--role", choices=("main", "prefill"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--geometry", help=argparse.SUPPRESS)
    ap.add_argument("--device", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "prefill":
        return run_prefill(args)

    status = {s.name: s for s in available_backends()}
    backend = args.backend
    if backend == "auto":
        if "nixl" in status and status["nixl"].available:
            backend = "nixl"
        else:
            why = status["nixl"].reason if "nixl" in status else "the nixl plugin is not installed"
            print(f"NOTE: nixl is unavailable ({why}); falling back to the loopback backend, in one process. "
                  f"Install it with: pip install 'kvxfer[nixl]'")
            backend = "loopback"
    torch = _torch_cuda()
    memory = args.memory if args.memory != "auto" else ("VRAM" if torch is not None else "DRAM")
    p = PRESETS["mla-61"]
    n = p.blocks_for(args.tokens)
    g = Geometry(p.layers, p.page, pool=n + max(8, n // 8), request=n, seed=args.seed)
    decode_dev = 1 if (memory == "VRAM" and torch is not None and torch.cuda.device_count() > 1) else 0

    from .plugin.registry import get_backend_class

    if get_backend_class(backend).capabilities.cross_process:
        from .sidechannel import fetch

        cmd = [sys.executable, "-m", "kvxfer.demo", "--role", "prefill", "--backend", backend, "--memory", memory,
               "--geometry", json.dumps(g.__dict__), "--device", "0"]
        if args.token:
            cmd += ["--token", args.token]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"prefill process failed to start (exit {proc.wait()})")
            addr = json.loads(line)
            metadata = fetch(addr["host"], addr["port"], token=args.token, timeout=30)
            t0 = time.perf_counter()
            results = _decode_side(backend, metadata, g, memory, decode_dev)
            mode = f"two processes (prefill pid {proc.pid}, decode pid {os.getpid()}), took {time.perf_counter() - t0:.1f} s"
        finally:
            if proc.stdin:
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    else:
        storage = prefill_cache(g, memory, 0)
        with Agent("prefill", backend=backend) as prefill:
            prefill.register(_packed_views(storage, g), replicated=True)
            results = _decode_side(backend, prefill.metadata(), g, memory, decode_dev)
        mode = "one process (this backend cannot cross processes)"
    _print_table(results, backend, memory, mode, g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
