"""A peer agent in its own process, driven over stdin/stdout with JSON lines.

The conformance suite's two-process tests (and anyone debugging a backend by hand) start it
with ``python -m kvxfer.testing.peer --backend nixl --cache packed ...``. It prints
``{"metadata": <base64>}`` once registered, then answers one JSON command per line:

``{"cmd": "add_peer", "metadata": b64}`` -> ``{"peer": name}``
``{"cmd": "pages"}`` -> ``{"pages": b64 of (layers, blocks, page) bytes, "padding": b64}``
``{"cmd": "notifications", "timeout": s, "count": n}`` -> ``{"notifications": {peer: [b64]}}``
``{"cmd": "exit"}``

Between commands it keeps driving the backend's progress, so backends without a progress
thread still complete one-sided transfers that target this process.
"""

from __future__ import annotations

import argparse
import base64
import json
import select
import sys
import time
from typing import Any

from .. import Agent
from .buffers import make_cache


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--name", default="peer")
    ap.add_argument("--cache", choices=("packed", "layers"), default="packed")
    ap.add_argument("--memory", choices=("DRAM", "VRAM"), default="DRAM")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--pad", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None, help="fill with random bytes (else the sentinel)")
    ap.add_argument("--options", default="{}", help="backend options as JSON")
    ap.add_argument("--replicated", action="store_true")
    ap.add_argument("--cuda-device", type=int, default=None, help="GPU for VRAM caches (default: the current one)")
    args = ap.parse_args(argv)
    if args.cuda_device is not None:
        import torch

        torch.cuda.set_device(args.cuda_device)

    cache = make_cache(args.cache, num_blocks=args.blocks, num_layers=args.layers, page=args.page, pad=args.pad,
                       memory=args.memory, seed=args.seed)
    agent = Agent(args.name, backend=args.backend, **json.loads(args.options))
    agent.register(cache.views, replicated=args.replicated)
    out = sys.stdout
    out.write(json.dumps({"metadata": _b64(agent.metadata())}) + "\n")
    out.flush()
    pending_notes: dict[str, list[bytes]] = {}
    try:
        while True:
            ready, _, _ = select.select([sys.stdin], [], [], 0.001)
            if not ready:
                agent.progress()
                continue
            line = sys.stdin.readline()
            if not line:
                return 0
            cmd: dict[str, Any] = json.loads(line)
            reply: dict[str, Any]
            try:
                reply = _handle(agent, cache, cmd, pending_notes)
            except Exception as exc:  # report, keep serving: the test decides what it means
                reply = {"error": type(exc).__name__, "message": str(exc)}
            if reply.get("exit"):
                return 0
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        agent.close()


def _handle(agent: Agent, cache: Any, cmd: dict[str, Any], notes: dict[str, list[bytes]]) -> dict[str, Any]:
    c = cmd.get("cmd")
    if c == "add_peer":
        return {"peer": agent.add_peer(base64.b64decode(cmd["metadata"]))}
    if c == "pages":
        return {"pages": _b64(cache.layer_pages().tobytes()), "padding": _b64(cache.padding().tobytes())}
    if c == "notifications":
        deadline = time.monotonic() + float(cmd.get("timeout", 5.0))
        want = int(cmd.get("count", 1))
        while True:
            for k, v in agent.notifications().items():
                notes.setdefault(k, []).extend(v)
            if sum(map(len, notes.values())) >= want or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        got = {k: [_b64(m) for m in v] for k, v in notes.items()}
        notes.clear()
        return {"notifications": got}
    if c == "exit":
        return {"exit": True}
    raise ValueError(f"unknown command {c!r}")


if __name__ == "__main__":
    sys.exit(main())
