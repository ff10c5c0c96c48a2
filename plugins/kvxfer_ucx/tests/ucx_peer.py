"""A UCX backend peer in its own process, driven by JSON lines on stdin/stdout.

Used by the two-process tests beside it (test_ucx_processes.py).
It registers one host buffer, prints its backend metadata, then keeps driving the worker
(the backend needs progress on both sides for some transports) while answering commands:

    {"cmd": "add", "name": ..., "blob": b64}  -> {"ok": true}
    {"cmd": "dump", "offset": o, "nbytes": n} -> {"data": b64}
    {"cmd": "fill", "byte": v}                 -> {"ok": true}
    {"cmd": "notifs"}                          -> {"notifs": {peer: [b64, ...]}}
    {"cmd": "write", "peer": p, "pairs": [[local_off, remote_addr, n], ...], "notify": b64|null}
                                                -> {"ok": true} once the transfer is done
    {"cmd": "exit"}

Usage: python plugins/kvxfer_ucx/tests/ucx_peer.py NAME NBYTES PATTERN_SEED|aa [option=value ...]
"""

from __future__ import annotations

import base64
import os
import sys
import time

import numpy as np

from kvxfer.deadlines import Deadline
from kvxfer import Allocation, DescriptorList, MemoryKind, Op
from kvxfer.testing import lines


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic bytes both sides can recompute."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> None:
    name, nbytes, fill = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    bools = {"same_host_copy", "trusted_network"}
    options: dict = {k: (v == "1" if k in bools else v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
    from kvxfer_ucx.backend import UcxBackend

    # UCX may print diagnostics on fd 1 (UCX_PROTO_INFO, warnings): keep the command channel
    # on a private copy of stdout and point fd 1 at stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    buf = np.full(nbytes, 0xAA, dtype=np.uint8) if fill == "aa" else pattern(nbytes, int(fill))
    be = UcxBackend(name, **options)
    addr = buf.ctypes.data
    be.register([Allocation(addr, nbytes, MemoryKind.DRAM)])

    lines.say(out, {"meta": base64.b64encode(be.local_metadata()).decode(), "address": addr, "pid": os.getpid()})
    def exit_() -> dict:
        be.close()
        return {"ok": True}

    def handle(msg: dict) -> dict:
        cmd = msg["cmd"]
        if cmd == "add":
            be.add_remote(msg["name"], base64.b64decode(msg["blob"]))
            return {"ok": True}
        if cmd == "dump":
            o, n = msg.get("offset", 0), msg.get("nbytes", nbytes)
            return {"data": base64.b64encode(buf[o:o + n].tobytes()).decode()}
        if cmd == "fill":
            buf[:] = msg["byte"]
            return {"ok": True}
        if cmd == "notifs":
            got = be.drain_notifications()
            return {"notifs": {k: [base64.b64encode(m).decode() for m in v] for k, v in got.items()}}
        if cmd == "write":
            pairs = np.array(msg["pairs"], dtype=np.uint64).reshape(-1, 3)
            local = be.prepare(None, DescriptorList(np.stack([addr + pairs[:, 0], pairs[:, 2],
                                                              np.zeros(len(pairs), np.uint64)], 1)))
            remote = be.prepare(msg["peer"], DescriptorList(np.stack([pairs[:, 1], pairs[:, 2],
                                                                      np.zeros(len(pairs), np.uint64)], 1)))
            idx = np.arange(len(pairs), dtype=np.int64)
            note = base64.b64decode(msg["notify"]) if msg.get("notify") else None
            x = be.post(Op.WRITE, local, idx, remote, idx, note)
            deadline = Deadline.within(30)
            while not be.poll(x):
                if time.monotonic() > deadline:
                    raise TimeoutError("write did not finish")
            be.release(x)
            return {"ok": True}
        raise ValueError(f"unknown command {cmd!r}")

    lines.serve(handle, be.progress, out, poll_s=0.0005, on_exit=exit_)

if __name__ == "__main__":
    main()
