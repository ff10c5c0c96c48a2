"""A decode worker as deployed: it reads each request's KV blocks from ``examples/prefill.py``, verified.

Start ``examples/prefill.py`` first (its docstring and README, "Two processes", show both
terminals), with the same ``KVXFER_TOKEN``::

    python examples/decode.py --connect 127.0.0.1:5720

It exchanges metadata with prefill over the side channel (prefill learns how to notify it),
then for each request prefill announces (a notification with block ids and
``Digests.to_text()``) it reads the blocks into free blocks of its own cache with
``expect=Digests.from_text(...)``: the read is DONE only once every arrived block matches
prefill's digests (``IntegrityError`` otherwise). It tells prefill each request is done, waits
for its ``bye`` and closes. ``--dump FILE.npz`` saves its caches and which of its blocks got
which of prefill's, for a byte-for-byte check by someone else (``tests/test_examples.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kvxfer.deadlines import Deadline
import kvxfer
from kvxfer.integrity import Digests
from kvxfer.sidechannel import exchange

from prefill import HEADS, kv_caches, parse_message, token  # the same cache shape and messages

SENTINEL = 0xAA


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connect", default="127.0.0.1:5720", metavar="HOST:PORT", help="prefill's side channel")
    ap.add_argument("--backend", default="nixl")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="how many requests to read before stopping")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--dump", default=None, metavar="FILE.npz", help="save the caches and the block map")
    args = ap.parse_args()
    secret = token()
    host, _, port = args.connect.rpartition(":")

    agent = kvxfer.Agent("decode", backend=args.backend, token=secret, timeout=30)
    caches = kv_caches(args.blocks)
    for c in caches.values():
        c.view(np.uint8)[...] = SENTINEL  # so a block nobody wrote is visible in a dump
    agent.register(caches, tp_rank=0, tp_size=1, kv_heads=HEADS)
    deadline = Deadline.within(args.timeout)
    local_of: dict[int, int] = {}  # our block -> prefill's block
    free = list(range(args.blocks - 1, -1, -1))  # an engine's free list: blocks in another order than prefill's
    try:
        prefill = agent.add_peer(exchange(host, int(port), agent.metadata(), token=secret, timeout=30))
        print(f"decode: connected to {prefill!r} at {args.connect}", flush=True)
        done = 0
        bye = False
        while not bye:
            if time.monotonic() > deadline:
                print(f"decode: prefill went quiet after {done} requests", file=sys.stderr)
                return 1
            for raw in agent.notifications().get(prefill, []):
                msg = parse_message(raw)
                if msg.get("bye"):
                    bye = True
                    continue
                theirs = [int(b) for b in msg["blocks"]]
                ours = [free.pop() for _ in theirs]
                expect = Digests.from_text(msg["digests"])  # typed MetadataError if malformed
                t = agent.read(prefill, ours, theirs, expect=expect).wait()  # IntegrityError on a bad byte
                local_of.update(zip(ours, theirs))
                print(f"decode: request {msg['request']}: {len(theirs)} blocks verified "
                      f"({t.stats.nbytes:,} bytes, {t.stats.seconds * 1e3:.2f} ms)", flush=True)
                agent.notify(prefill, json.dumps({"done": msg["request"]}).encode())
                done += 1
            time.sleep(0.01)
        if done != args.requests:
            print(f"decode: expected {args.requests} requests, prefill sent {done}", file=sys.stderr)
            return 1
        if args.dump:
            np.savez(args.dump, local=np.array(list(local_of)), remote=np.array(list(local_of.values())),
                     **{name: c.view(np.uint8) for name, c in caches.items()})
    except KeyboardInterrupt:
        print("decode: interrupted", file=sys.stderr)
        return 130
    finally:
        agent.close()
    print("decode: closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
