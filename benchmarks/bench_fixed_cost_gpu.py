"""The device path's own fixed cost on one GPU, beside a bare copy of the same bytes (issue 38).

One process, two :class:`kvxfer.cuda.DevicePath` instances (the same-process route: the same
copier and kernels as between two processes, without the Agent). For each block size
(``--sizes``) it prints the median of ``--iters`` one-block READs, in microseconds:

* ``torch``: ``dst.copy_(src)`` and ``torch.cuda.synchronize()`` (the bare copy);
* ``copier``: ``Copier.copy`` then ``Copier.wait`` on its event (kernel and event, no path);
* ``path wait``: ``DevicePath.post`` then ``DevicePath.wait`` (the event with a Deadline, no naps);
* ``path poll``: ``DevicePath.post`` then ``poll`` with the rhythm of ``Transfer.wait``
  (64 looks, then naps of 1, 2, 3... us): what the Agent's caller waited with last run;
* ``verified``: ``post(expect=...)`` + ``wait``: the fused copy and mm8, digests compared;
* ``copy+digest``: ``path wait`` then a separate mm8 pass over the destination (the old way);
* ``agent``: ``Agent.read`` + ``Transfer.wait`` between two agents of this process (loopback
  backend, the core's device path): the wait blocks on the post's event through
  ``Backend.wait``, so it should sit near ``path wait``, not ``path poll``;
* ``agent verified``: the same with ``expect=`` (the source's mm8 digests): the core hands them to
  the device path, so it should sit near ``verified``, not ``copy+digest``.

Columns ``+torch`` are each variant minus the bare copy. Before timing, every variant's moved
row is checked byte for byte against the source and an untouched row against the sentinel.

    python benchmarks/bench_fixed_cost_gpu.py --sizes 4096,65536,4718592 --iters 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np


def _median(fn: Callable[[], Any], iters: int) -> float:
    for _ in range(20):
        fn()
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(t)


def one(size: int, iters: int) -> dict[str, Any]:
    import torch

    from kvxfer import Allocation, DescriptorList, MemoryKind, Op
    from kvxfer.cuda import DevicePath
    from kvxfer.cuda.capability import cuda_capability
    from kvxfer.cuda.digest import mm8
    from kvxfer.deadlines import Backoff, Deadline
    from kvxfer.integrity.digests import mm8_rows

    rows = 4
    src = torch.randint(0, 256, (rows, size), dtype=torch.uint8, device="cuda")
    dst = torch.full((rows, size), 0xAA, dtype=torch.uint8, device="cuda")
    dev = src.device.index or 0
    a, b = DevicePath(), DevicePath()
    a.register([Allocation(src.data_ptr(), src.numel(), MemoryKind.VRAM, dev)])
    b.register([Allocation(dst.data_ptr(), dst.numel(), MemoryKind.VRAM, dev)])
    route = b.add_peer("a", a.blob())
    descs = lambda t: DescriptorList([[t.data_ptr() + i * size, size, dev] for i in range(rows)], MemoryKind.VRAM)
    lp, rp = b.prepare(None, descs(dst)), b.prepare("a", descs(src))
    assert lp is not None and rp is not None, route.reason
    li, ri = np.array([1]), np.array([2])
    cap = cuda_capability()
    cp = cap._copier
    assert cp is not None
    d_addr, s_addr = np.array([dst.data_ptr() + size], np.uint64), np.array([src.data_ptr() + 2 * size], np.uint64)
    n = np.array([size], np.uint64)
    expect = mm8_rows(src[2:3].cpu().numpy()).view(np.uint64)

    def path_wait() -> None:
        x = b.post(Op.READ, lp, li, rp, ri)
        b.wait(x, Deadline.within(5.0))
        b.release(x)

    def path_poll() -> None:
        x = b.post(Op.READ, lp, li, rp, ri)
        off = Backoff(1e-6, 1e-3, factor=1.0, step=1e-6, spins=64)
        while not b.poll(x):
            d = off.next()
            if d:
                time.sleep(d)
        b.release(x)

    def verified() -> None:
        x = b.post(Op.READ, lp, li, rp, ri, expect=expect)
        assert x.verified
        b.wait(x, Deadline.within(5.0))
        b.release(x)

    def separate() -> None:
        path_wait()
        mm8(cp, dev, d_addr, n)

    import kvxfer

    ka, kb = kvxfer.Agent("fixed-src"), kvxfer.Agent("fixed-dst")
    for k, t in ((ka, src), (kb, dst)):
        k.register(kvxfer.spec_from_pointers((t.data_ptr(), t.numel(), dev), num_blocks=rows, members=[("a", size)],
                                             kind="VRAM"))
    kb.add_peer(ka.metadata())
    digests = ka.digest([2], algorithm="mm8")

    def agent() -> None:
        kb.read("fixed-src", [1], [2]).wait(5.0)

    def agent_verified() -> None:
        kb.read("fixed-src", [1], [2], expect=digests).wait(5.0)

    variants = {"torch": lambda: (dst[1].copy_(src[2]), torch.cuda.synchronize()),
                "copier": lambda: cp.wait(cp.copy(d_addr, s_addr, n, dev), Deadline.within(5.0)),
                "path_wait": path_wait, "path_poll": path_poll, "verified": verified, "copy_digest": separate,
                "agent": agent, "agent_verified": agent_verified}
    ok = {}
    for name, fn in variants.items():  # each variant must land the row, and only it
        dst.fill_(0xAA)
        torch.cuda.synchronize()  # the copier's stream is not torch's: the sentinel is in place first
        fn()
        torch.cuda.synchronize()
        ok[name] = bool(torch.equal(dst[1], src[2])) and bool((dst[0] == 0xAA).all()) and bool((dst[3] == 0xAA).all())
    row: dict[str, Any] = {"size": size, "route": route.kind, "bytes_ok": ok}
    for name, fn in variants.items():
        row[name] = _median(fn, iters)
    kb.close()
    ka.close()
    a.close()
    b.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,65536,4718592")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [one(int(s), args.iters) for s in args.sizes.split(",")]
    names = ["torch", "copier", "path_wait", "path_poll", "verified", "copy_digest", "agent", "agent_verified"]
    print(f"{'size':>8s} " + " ".join(f"{k:>14s}" for k in names) + "  (us, median; +torch below)  bytes ok")
    for r in rows:
        print(f"{r['size']:>8d} " + " ".join(f"{r[k]:14.1f}" for k in names) + f"  {all(r['bytes_ok'].values())}")
        print(f"{'':>8s} " + " ".join(f"{r[k] - r['torch']:+14.1f}" for k in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
