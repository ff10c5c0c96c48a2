"""What verification costs: transfer time with digests off and on, side by side in one run.

Two agents in this process move the same request between the same buffers, verification
off then on, alternating per iteration so drift hits both alike; every verified run must
pass and every run is checked byte for byte against the source (numpy / torch.equal on
the moved blocks). Shapes: whole rows (one block-outermost storage) and per-layer regions.
Also the digest alone (source side, GB/s) against a plain copy of the same bytes on the
same memory (numpy copy on DRAM, ``torch.Tensor.copy_`` on VRAM).

    python benchmarks/bench_integrity.py --memory DRAM --backends loopback,nixl [--rows] [--threads 2] [--parts 16]
    python benchmarks/bench_integrity.py --memory VRAM --backends loopback,nixl --blocks 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

import kvxfer
from kvxfer.plugin.registry import get_backend_class

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import Column, print_table  # noqa: E402


def _buffers(memory: str, shape: str, blocks: int, layers: int, page: int, fill: int | None, seed: int = 0) -> Any:
    """``(tensors to register, logical [layers, blocks, page] accessor)``."""
    rng = np.random.default_rng(seed)
    if memory == "VRAM":
        import torch

        def make(*s: int) -> Any:
            if fill is not None:
                return torch.full(s, fill, dtype=torch.uint8, device="cuda")
            return torch.randint(0, 256, s, dtype=torch.uint8, device="cuda")
    else:
        def make(*s: int) -> Any:
            return np.full(s, fill, np.uint8) if fill is not None else rng.integers(0, 256, s, dtype=np.uint8)
    if shape == "rows":
        st = make(blocks, layers * page)
        return {f"layer.{i}": st[:, i * page:(i + 1) * page] for i in range(layers)}, [st]
    sts = [make(blocks, page) for _ in range(layers)]
    return {f"layer.{i}": s for i, s in enumerate(sts)}, sts


def _sync(memory: str) -> None:
    if memory == "VRAM":
        import torch

        torch.cuda.synchronize()


def _equal(memory: str, shape: str, src: list[Any], dst: list[Any], lb: np.ndarray, rb: np.ndarray) -> bool:
    if memory == "VRAM":
        import torch

        li, ri = torch.from_numpy(lb).cuda(), torch.from_numpy(rb).cuda()
        return all(bool(torch.equal(d.index_select(0, li), s.index_select(0, ri))) for s, d in zip(src, dst))
    return all(bool((d[lb] == s[rb]).all()) for s, d in zip(src, dst))


def _copy_gbps(memory: str, nbytes: int, iters: int) -> float:
    if memory == "VRAM":
        import torch

        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        b.copy_(a)
        torch.cuda.synchronize()
        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            b.copy_(a)
            torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
    else:
        a = np.ones(nbytes, np.uint8)
        b = np.empty_like(a)
        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            np.copyto(b, a)
            t.append(time.perf_counter() - t0)
    return nbytes / statistics.median(t) / 1e9


def run(backend: str, memory: str, shape: str, args: argparse.Namespace) -> dict[str, Any]:
    src_t, src = _buffers(memory, shape, args.blocks, args.layers, args.page, None, 1)
    dst_t, dst = _buffers(memory, shape, args.blocks, args.layers, args.page, 0xAA)
    rng = np.random.default_rng(2)
    n = args.request
    rb = rng.permutation(args.blocks)[:n].astype(np.int64)
    lb = rng.permutation(args.blocks)[:n].astype(np.int64)
    with kvxfer.Agent("src", backend=backend, timeout=120) as p, kvxfer.Agent("dst", backend=backend, timeout=120) as d:
        p.register(src_t)
        d.register(dst_t)
        d.add_peer(p.metadata())
        mode = d.plan("src", lb, rb).mode
        expect = p.digest(rb, rows=args.rows)
        d.read("src", lb, rb, expect=expect).wait()  # warm-up both ways
        d.read("src", lb, rb).wait()
        off, on, dig = [], [], []
        for _ in range(args.iters):
            _sync(memory)
            t0 = time.perf_counter()
            d.read("src", lb, rb).wait()
            _sync(memory)
            off.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            d.read("src", lb, rb, expect=expect).wait()
            on.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            p.digest(rb, rows=args.rows)
            dig.append(time.perf_counter() - t0)
        seq = np.arange(n)
        p.digest(seq, rows=args.rows)
        contig = []
        for _ in range(args.iters):  # ascending blocks: dense rows are digested in place
            t0 = time.perf_counter()
            p.digest(seq, rows=args.rows)
            contig.append(time.perf_counter() - t0)
        ok = _equal(memory, shape, src, dst, lb, rb)
        algo = expect.algorithm
    nbytes = n * args.layers * args.page
    m_off, m_on, m_dig = (statistics.median(x) for x in (off, on, dig))
    return {"backend": backend, "memory": memory, "shape": shape, "mode": mode, "algorithm": algo, "MB": nbytes / 1e6,
            "off_ms": 1e3 * m_off, "on_ms": 1e3 * m_on, "added": (m_on - m_off) / m_off,
            "xfer_GBps": nbytes / m_off / 1e9, "digest_GBps": nbytes / m_dig / 1e9, "bytes_ok": ok,
            "digest_seq_GBps": nbytes / statistics.median(contig) / 1e9,
            "threads": args.threads, "rows": args.rows, "digest": args.digest, "parts_MiB": args.parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memory", choices=["DRAM", "VRAM"], default="DRAM")
    ap.add_argument("--backends", default="loopback,nixl")
    ap.add_argument("--shapes", default="rows,layers")
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--request", type=int, default=64, help="blocks per transfer")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=32768, help="bytes per layer page")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="kvxfer.integrity.digests.THREADS")
    ap.add_argument("--rows", action="store_true", help="row digests (one per block, what vLLM params carry)")
    ap.add_argument("--digest", choices=("kernel", "torch"), default="kernel",
                    help="VRAM mm8: the device path's one-pass kernel, or the torch ops it replaced")
    ap.add_argument("--parts", type=int, default=None,
                    help="MiB per part of a verified READ hashed on a worker as parts land "
                         "(0: off; default: kvxfer.integrity.overlap.PART_BYTES)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kvxfer.integrity import digests, set_mm8_kernel

    if args.digest == "torch":
        set_mm8_kernel(None)  # VRAM mm8 through the torch ops, not the device path's kernel

    digests.THREADS = args.threads
    from kvxfer.integrity import overlap

    if args.parts is not None:
        overlap.PART_BYTES = args.parts << 20
    args.parts = overlap.PART_BYTES >> 20
    rows = []
    for b in args.backends.split(","):
        try:
            get_backend_class(b)
        except kvxfer.KvxferError as exc:
            print(f"skipping {b}: {exc}", file=sys.stderr)
            continue
        for s in args.shapes.split(","):
            rows.append(run(b, args.memory, s, args))
    copy = _copy_gbps(args.memory, args.request * args.layers * args.page, args.iters)
    print_table(rows, [Column("backend"), Column("memory"), Column("shape"), Column("mode"), Column("algorithm"), Column("digest"),
                       Column("MB", "MB", "{:.1f}"), Column("off_ms", "off ms", "{:.3f}"), Column("on_ms", "on ms", "{:.3f}"),
                       Column("added", "added", "{:+.1%}"), Column("xfer_GBps", "xfer GB/s", "{:.1f}"),
                       Column("digest_GBps", "digest GB/s", "{:.1f}"),
                       Column("digest_seq_GBps", "digest GB/s (blocks 0..n-1)", "{:.1f}"),
                       Column("parts_MiB", "parts MiB"), Column("bytes_ok")])
    print(f"plain copy of the same bytes on {args.memory}: {copy:.1f} GB/s")
    from kvxfer.integrity import gpu_product

    if gpu_product():
        print(f"mm8 product: {gpu_product()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "copy_GBps": copy, "args": vars(args), "product": [gpu_product()] if gpu_product() else []}, f, indent=1)


if __name__ == "__main__":
    main()
