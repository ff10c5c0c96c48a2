"""A prefill worker as deployed: it serves its KV cache to a decode worker in another process.

Run it in one terminal, then ``examples/decode.py`` in another (README, "Two processes")::

    export KVXFER_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")   # both terminals
    python examples/prefill.py --port 5720
    python examples/decode.py --connect 127.0.0.1:5720

What it does, in deployment order:

1. registers its cache (``{layer: [K/V, blocks, tokens, heads, dim]}``, as engines hold it) and
   serves its signed metadata on the side channel; decode exchanges metadata with it, so each
   can reach the other (decode reads, prefill notifies);
2. "computes" ``--requests`` requests: seeded bytes in the blocks of each (:func:`block_bytes`),
   then tells decode in a notification which blocks hold the request and their digests
   (``Digests.to_text()``), so decode can verify what it reads;
3. does nothing for decode's reads to move: the NIXL agent progresses by itself
   (``background_progress``, docs/backends.md); it looks at notifications only to learn
   which requests decode has finished with (an engine frees those blocks then);
4. once every request is done, says ``bye``, lets that notification leave, and closes.

Messages are JSON in notifications (from a token holder, still bounded and checked):
``{"request": n, "blocks": [...], "digests": text}`` to decode, ``{"done": n}`` back, ``{"bye": true}``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from typing import Any

import numpy as np

from kvxfer.deadlines import Deadline
import kvxfer
from kvxfer.sidechannel import MetadataServer

#: The cache both sides hold: 4 layers of [K/V, blocks, 16 tokens, 2 KV heads, 64 dims], fp16.
LAYERS, TOKENS, HEADS, DIM = 4, 16, 2, 64
#: Largest message either side accepts in a notification.
MAX_MESSAGE = 64 << 10


def kv_caches(blocks: int) -> dict[str, np.ndarray]:
    """Zeroed per-layer caches, shaped as an engine holds them."""
    return {f"layer.{i}": np.zeros((2, blocks, TOKENS, HEADS, DIM), np.float16) for i in range(LAYERS)}


def block_bytes(seed: int, layer: int, block: int) -> np.ndarray:
    """What prefill "computed" for ``block`` of ``layer``: seeded bytes, ``[K/V, tokens, heads, dim]``."""
    rng = np.random.default_rng([seed, layer, block])
    return rng.integers(0, 256, (2, TOKENS, HEADS, DIM * 2), dtype=np.uint8).view(np.float16)


def token() -> str:
    secret = os.environ.get("KVXFER_TOKEN")
    if not secret:
        sys.exit("set KVXFER_TOKEN to the same secret in both terminals (see this file's docstring)")
    return secret


def parse_message(raw: bytes) -> dict[str, Any]:
    """A notification as a JSON object, bounded: anything else is refused with ValueError."""
    if len(raw) > MAX_MESSAGE:
        raise ValueError(f"message of {len(raw)} bytes")
    msg = json.loads(raw)
    if not isinstance(msg, dict):
        raise ValueError("message is not a JSON object")
    return msg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="address decode workers reach (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=5720, help="side-channel port (0: any free port, printed)")
    ap.add_argument("--backend", default="nixl")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--blocks-per-request", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    args = ap.parse_args()
    secret = token()
    if args.requests * args.blocks_per_request > args.blocks:
        sys.exit("--requests x --blocks-per-request must fit in --blocks")

    agent = kvxfer.Agent("prefill", backend=args.backend, token=secret)
    caches = kv_caches(args.blocks)
    agent.register(caches, tp_rank=0, tp_size=1, kv_heads=HEADS)
    arrivals: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # on_peer runs on the server's thread
    deadline = Deadline.within(args.timeout)
    try:
        with MetadataServer(agent.metadata(), args.host, args.port, token=secret, on_peer=arrivals.put) as server:
            host, port = server.address
            print(f"prefill: serving on {host}:{port}", flush=True)
            decode = agent.add_peer(arrivals.get(timeout=args.timeout))  # decode exchanged its metadata
            print(f"prefill: {decode!r} connected", flush=True)
            order = np.random.default_rng(args.seed).permutation(args.blocks)
            pending = set()
            for r in range(args.requests):  # "compute" each request, then announce it with its digests
                blocks = order[r * args.blocks_per_request:(r + 1) * args.blocks_per_request]
                for layer in range(LAYERS):
                    for b in blocks:
                        caches[f"layer.{layer}"][:, b] = block_bytes(args.seed, layer, int(b))
                digests = agent.digest(blocks)
                agent.notify(decode, json.dumps({"request": r, "blocks": blocks.tolist(),
                                                 "digests": digests.to_text()}).encode())
                pending.add(r)
            while pending:  # decode reads on its own; we only learn what it has finished with
                if time.monotonic() > deadline:
                    print(f"prefill: requests {sorted(pending)} were never done", file=sys.stderr)
                    return 1
                for raw in agent.notifications().get(decode, []):
                    done = parse_message(raw).get("done")
                    if done in pending:
                        pending.discard(done)
                        print(f"prefill: request {done} done; its blocks are free", flush=True)
                time.sleep(0.01)
            agent.notify(decode, json.dumps({"bye": True}).encode())
            linger = Deadline.within(1.0)
            while time.monotonic() < linger:  # a notification leaves while the worker progresses
                agent.notifications()
                time.sleep(0.01)
    except KeyboardInterrupt:
        print("prefill: interrupted", file=sys.stderr)
        return 130
    finally:
        agent.close()
    print("prefill: closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
