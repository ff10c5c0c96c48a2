"""Two-process soak: thousands of transfers with every byte checked, memory and descriptors flat.

``python -m kvxfer.testing.soak --backend ucx --count 10000`` starts a prefill peer
(:mod:`kvxfer.testing.peer`, a packed cache of seeded random bytes) and, in this process, a
decode agent with per-layer caches, so every transfer is a split plan. Each step READs a
random set of blocks (or, one step in ten, WRITEs decode blocks into prefill) and checks the
result against a model kept with plain numpy indexing: the moved pages hold the expected
bytes and every other page still holds what it held (the 0xAA sentinel on decode). Every
``--verify-every`` steps, and at the end, the peer's whole cache is fetched through its own
stdin/stdout channel, not the transport, and compared with the model.

Resident memory and open descriptors of both processes are sampled after a warm-up and at
the end; the report gives their growth.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .. import Agent
from .buffers import make_cache
from .peer import PeerProcess

__all__ = ["SoakResult", "soak", "main"]


@dataclass
class SoakResult:
    backend: str
    transfers: int
    reads: int
    writes: int
    bytes_moved: int
    wrong_bytes: int
    peer_checks: int
    seconds: float
    rss_growth_mb: float  # this process, end minus after warm-up
    peer_rss_growth_mb: float
    fd_growth: int
    peer_fd_growth: int


def _rss_mb(pid: int | str = "self") -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(text.split("VmRSS:")[1].split()[0]) / 1024


def _fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def soak(backend: str, count: int, *, blocks: int = 32, layers: int = 4, page: int = 256, seed: int = 7,
         verify_every: int = 1000, timeout: float = 30.0, progress: bool = False) -> SoakResult:
    rng = np.random.default_rng(seed)
    model = make_cache("packed", num_blocks=blocks, num_layers=layers, page=page, seed=seed).layer_pages()
    dst = make_cache("layers", num_blocks=blocks, num_layers=layers, page=page)
    peer = PeerProcess.spawn(backend, name="prefill", cache="packed", blocks=blocks, layers=layers, page=page,
                             seed=seed, replicated=True, timeout=max(60.0, timeout))
    reads = writes = moved = wrong = checks = 0
    warm = max(1, count // 10)
    base: tuple[float, float, int, int] | None = None
    t0 = time.monotonic()
    try:
        with Agent("decode", backend=backend, timeout=timeout) as agent:
            agent.register(dst.views, replicated=True)
            name = agent.add_peer(peer.metadata)
            peer.call({"cmd": "add_peer", "metadata": base64.b64encode(agent.metadata()).decode()})
            ours = dst.layer_pages()  # what decode holds, as the model sees it
            for step in range(count):
                if step == warm:
                    base = (_rss_mb(), _rss_mb(peer.proc.pid), _fds(), _fds(peer.proc.pid))
                k = int(rng.integers(1, 9))
                remote = rng.choice(blocks, size=k, replace=False)
                local = rng.choice(blocks, size=k, replace=False)
                if step % 10 == 9:  # WRITE decode's blocks into prefill
                    agent.write(name, local, remote).wait(timeout)
                    model[:, remote] = ours[:, local]
                    writes += 1
                else:
                    agent.read(name, local, remote).wait(timeout)
                    ours[:, local] = model[:, remote]
                    reads += 1
                moved += k * layers * page
                wrong += int((dst.layer_pages() != ours).sum())
                if (step + 1) % verify_every == 0 or step == count - 1:
                    pages = np.frombuffer(base64.b64decode(peer.call({"cmd": "pages"})["pages"]), np.uint8)
                    wrong += int((pages.reshape(model.shape) != model).sum())
                    checks += 1
                    if progress:
                        print(f"{step + 1:>8,} transfers, {wrong} wrong bytes", file=sys.stderr, flush=True)
            end = (_rss_mb(), _rss_mb(peer.proc.pid), _fds(), _fds(peer.proc.pid))
    finally:
        peer.close()
    b = base or end
    return SoakResult(backend, reads + writes, reads, writes, moved, wrong, checks, time.monotonic() - t0,
                      end[0] - b[0], end[1] - b[1], end[2] - b[2], end[3] - b[3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.testing.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="ucx", help="a cross-process backend: ucx or nixl")
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--verify-every", type=int, default=1000)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    r = soak(args.backend, args.count, blocks=args.blocks, seed=args.seed, verify_every=args.verify_every,
             progress=True)
    from ..table import Column, count, print_table

    row = {**asdict(r), "rw": f"{r.reads:,}/{r.writes:,}", "mb": r.bytes_moved / 1e6,
           "rss": f"{r.rss_growth_mb:+.1f} / {r.peer_rss_growth_mb:+.1f}",
           "fds": f"{r.fd_growth:+d} / {r.peer_fd_growth:+d}"}
    print_table([row], [Column("transfers", fmt=count), Column("rw", "READ/WRITE"), Column("mb", "MB moved", "{:,.1f}"),
                        Column("wrong_bytes", "wrong bytes"), Column("peer_checks", "peer checks"),
                        Column("seconds", fmt="{:.1f}"), Column("rss", "RSS +MB (us / peer)"),
                        Column("fds", "fds + (us / peer)")], title=f"two-process soak over {r.backend}")
    if args.json:
        args.json.write_text(json.dumps(asdict(r), indent=2))
    return 1 if r.wrong_bytes else 0


if __name__ == "__main__":
    sys.exit(main())
