"""``kvxfer demo`` (``make demo``): prefill and decode move a real KV request and verify it.

Prefill, in its own process (:mod:`kvxfer._peer`), registers a block-outermost cache of
a model preset (default: 61-layer MLA, 64-token blocks, 4.5 MB rows) whose blocks hold
seeded random bytes, and serves its metadata over the TCP side channel with a token. Decode
fetches that metadata and pulls one request twice: into a packed cache (whole rows: one
descriptor per block) and into per-layer regions (one descriptor per layer and block). It
checks every byte of the request against the seeded bytes and that every other byte still
holds the 0xAA sentinel, then prints what each way cost and where the time went.

The backend is NIXL when installed, otherwise the in-process loopback (then prefill runs in
the same process, and the demo says so). VRAM is used where torch sees a GPU.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from typing import Any

import numpy as np

from ..errors import VerificationError
from .args import add_json, plain, positive_int
from .output import check_memory, cuda_devices, emit_json, require_cuda
from .progress import Steps

__all__ = ["add_parser", "add_arguments", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="prefill and decode move a real KV request, verify it and show the costs",
                       description=plain(__doc__))
    add_arguments(p)
    p.set_defaults(fn=run)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--backend", default="auto", help="auto (nixl if it runs here, else loopback), or any "
                                                      "backend `kvxfer backends` lists")
    ap.add_argument("--tokens", type=positive_int, default=16384, help="request length in tokens (default 16384, "
                                                                        "sized for a small machine)")
    ap.add_argument("--preset", default="mla-61", metavar="NAME|FILE", help="model geometry: a preset or a "
                                                                            "spec file (default mla-61)")
    ap.add_argument("--memory", choices=("auto", "DRAM", "VRAM"), default="auto",
                    help="where both caches live (auto: VRAM when torch sees a GPU)")
    ap.add_argument("--seed", type=int, default=2026, help="seed of the bytes prefill holds and of the block ids")
    ap.add_argument("--token", default=None, help="shared secret for the metadata side channel (default: a "
                                                  "random one per run)")
    add_json(ap)


def _pick_backend(requested: str, notes: list[str]) -> str:
    from ..extras import install_hint
    from ..plugin.registry import BLOCK_ENV, available_backends, blocked_plugins

    status = {s.name: s for s in available_backends()}
    if requested != "auto":
        return requested
    if "nixl" in status and status["nixl"].available:
        return "nixl"
    if "nixl" in blocked_plugins():
        notes.append(f"NOTE: the nixl plugin is blocked ({BLOCK_ENV}={os.environ.get(BLOCK_ENV, '')}); "
                     "falling back to the loopback backend, in one process")
        return "loopback"
    why = status["nixl"].reason if "nixl" in status else "the nixl plugin is not installed"
    notes.append(f"NOTE: nixl is unavailable ({why}); falling back to the loopback backend, in one process. "
                 f"Install it with: {install_hint('nixl')}")
    return "loopback"


def _process_age() -> float:
    """Seconds since this process started (Linux; 0 elsewhere): the interpreter and imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class _Clock:
    """Seconds spent per phase, in the order phases first appear."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.steps: Steps | None = None

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def time(self, phase: str, what: str | None = None) -> "_Lap":
        """Time ``phase``; ``what``, when given, is shown as progress while it runs."""
        return _Lap(self, phase, what)


class _Lap:
    def __init__(self, clock: _Clock, phase: str, what: str | None):
        self.clock, self.phase = clock, phase
        self.step = clock.steps.step(what) if what and clock.steps is not None else None

    def __enter__(self) -> None:
        if self.step is not None:
            self.step.__enter__()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.clock.add(self.phase, time.perf_counter() - self.t0)
        if self.step is not None:
            self.step.__exit__(*exc)


PHASES = {
    "start-up": "processes, imports and backend initialisation",
    "cache fill": "prefill writes the seeded bytes of every block",
    "decode caches": "decode allocates its two caches, filled with the sentinel",
    "registration": "registering memory with the backend, both sides",
    "handshake": "side-channel fetch, add_peer and the first connection",
    "transfers": "the two timed reads, posted and waited for",
    "verification": "checking every byte, and the sentinel around the request",
    "shutdown": "closing the agents and the prefill process",
}


def run(args: argparse.Namespace) -> int:
    from ..agent import Agent
    from ..plugin.registry import get_backend_class
    from ..geometry import resolve
    from .._buffers import allocate
    from .._peer import InProcessPeer, PeerProcess

    age = _process_age()
    wall0 = time.perf_counter() - age
    clock = _Clock()
    clock.add("start-up", age)
    notes: list[str] = []
    geometry = resolve(args.preset)
    with clock.time("start-up"):
        backend = _pick_backend(args.backend, notes)
        cross = get_backend_class(backend).capabilities.cross_process
    gpus = cuda_devices() if args.memory != "DRAM" else 0
    memory = args.memory if args.memory != "auto" else ("VRAM" if gpus else "DRAM")
    if memory == "VRAM":
        gpus = require_cuda("--memory VRAM")
    token = args.token or secrets.token_hex(16)
    n = geometry.blocks_for(args.tokens)
    pool = n + max(8, n // 8)
    decode_dev = 1 if memory == "VRAM" and gpus > 1 else 0
    if memory == "DRAM":  # prefill's cache and decode's two, one after the other
        check_memory(3 * pool * geometry.row, "this demo")
    for note in notes:
        print(note)

    with Steps("kvxfer demo") as steps:
        clock.steps = steps
        peer: Any
        if cross:
            from ..sidechannel import fetch

            with steps.step(f"starting prefill and filling its {pool:,} blocks"):
                peer = PeerProcess.spawn(backend, name="prefill", preset=args.preset, layout="packed", blocks=pool,
                                         seed=args.seed, memory=memory, device=0, serve="127.0.0.1:0", timeout=300,
                                         token=token)
            t = peer.ready["timings"]
            clock.add("start-up", peer.startup_seconds - t["cache"] - t["register"])
            clock.add("cache fill", t["cache"])
            clock.add("registration", t["register"])
            assert peer.address is not None
            with clock.time("handshake"):
                metadata = fetch(*peer.address, token=token, timeout=30)
            mode = f"two processes (prefill pid {peer.pid}, decode pid {os.getpid()})"
        else:
            with clock.time("cache fill", f"filling prefill's {pool:,} blocks"):
                cache = allocate(geometry, pool, packed=True, memory=memory)
                cache.fill_blocks(args.seed)
            with clock.time("registration"):
                peer = InProcessPeer(backend, cache, name="prefill")
                metadata = peer.metadata
            mode = "one process (this backend cannot cross processes)"
        rng_p, rng_d = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
        pb, db = rng_p.permutation(pool)[:n], rng_d.permutation(pool)[:n]
        results = []
        try:
            for label, packed in (("whole rows", True), ("per-layer regions", False)):
                with clock.time("decode caches", f"allocating the decode cache ({label})"):
                    dst = allocate(geometry, pool, packed=packed, memory=memory, device=decode_dev)
                with clock.time("start-up"):
                    agent = Agent(f"decode-{'rows' if packed else 'layers'}", backend=backend, timeout=300)
                try:
                    with clock.time("registration"):
                        dst.register(agent)
                    with clock.time("handshake"):
                        name = agent.add_peer(metadata)
                        agent.read(name, [], []).wait()  # connect before timing
                    with clock.time("transfers", f"reading {n:,} blocks into {label}"):
                        tr = agent.read(name, db, pb).wait()
                    with clock.time("verification", f"verifying every byte ({label})"):
                        problem = dst.verify(db, pb, args.seed)
                    if problem:
                        raise VerificationError(f"VERIFY FAILED ({label}): {problem}")
                    s = tr.stats
                    results.append({"layout": label, "descriptors": s.descriptors, "posts": s.posts, "bytes": s.nbytes,
                                    "seconds": s.seconds, "gbps": s.gbps, "mode": s.mode, "path": s.path,
                                    "verified": "every byte"})
                finally:
                    with clock.time("shutdown"):
                        agent.close()
                        del dst
        finally:
            with clock.time("shutdown", "stopping prefill"):
                peer.close()
    total = time.perf_counter() - wall0
    timings = [{"phase": k, "seconds": v, "share": v / total, "what": PHASES[k]} for k, v in clock.phases.items()]
    other = total - sum(clock.phases.values())
    timings.append({"phase": "other", "seconds": other, "share": other / total, "what": "the rest of this process"})
    report = {"backend": backend, "memory": memory, "mode": mode, "preset": geometry.name, "tokens": args.tokens,
              "blocks": n, "row_bytes": geometry.row, "results": results, "timings": timings,
              "total_seconds": total}
    if args.json:
        emit_json(report)
    else:
        _print(report, geometry)
    return 0


def _print(r: dict[str, Any], geometry: Any) -> None:
    from ..table import Column, count, print_table

    print(f"kvxfer demo: decode pulled {r['blocks']} blocks ({r['tokens']} tokens) of {geometry.description}; "
          f"{geometry.row / 1e6:.2f} MB rows")
    print(f"backend={r['backend']} memory={r['memory']} {r['mode']}")
    print_table(r["results"], [Column("layout", "decode layout"), Column("descriptors", fmt=count),
                               Column("posts"), Column("bytes", "GB", lambda v: f"{v / 1e9:.3f}"),
                               Column("seconds", fmt="{:.4f}"), Column("gbps", "GB/s", "{:.2f}"),
                               Column("verified")])
    print("sentinel (0xAA) intact outside the request in both decode caches")
    print_table(r["timings"], [Column("phase", "where the time went"), Column("seconds", fmt="{:.3f}"),
                               Column("share", fmt=lambda v: f"{v:.0%}"), Column("what")],
                caption=f"total {r['total_seconds']:.2f} s")

