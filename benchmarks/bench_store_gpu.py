"""The store with a VRAM cache (GPU machine): offload and restore GB/s through the path that
loads (the pinned host stage when GDS does not), beside a plain device-to-pinned-host copy of
the same bytes (the stage's ceiling) and the same request from a host cache, in one run.

    python benchmarks/bench_store_gpu.py [--dir /tmp] [--tokens 16384] [--repeat 5]

The cache: bench_store.py's shape (80 layers, 4 KiB pages, 640 KiB rows), as one row-shaped
CUDA tensor and as 160 per-layer tensors. Bytes are checked once per layout against the
source on the host (pattern in the source, sentinel in the destination).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch

from _timing import Column, print_table

import kvxfer

LAYERS, TOKENS, DIM = 80, 16, 128


def _tensors(pool: int, per_layer: bool, fill: torch.Tensor | None, device: str) -> tuple[dict[str, Any], list]:
    row = torch.empty((pool, LAYERS, 2, TOKENS, DIM), dtype=torch.float16, device=device)
    row.view(torch.uint8).fill_(0xAA)
    if fill is not None:
        row.copy_(fill)
    if not per_layer:
        return {f"layer.{l}": (row[:, l, 0], row[:, l, 1]) for l in range(LAYERS)}, [row]
    keep = [row[:, l, kv].contiguous() for l in range(LAYERS) for kv in (0, 1)]
    return {f"layer.{l}": (keep[2 * l], keep[2 * l + 1]) for l in range(LAYERS)}, keep


def _rates(nbytes: int, secs: list[float]) -> dict[str, float]:
    return {"gbps": nbytes / statistics.median(secs) / 1e9, "best": nbytes / min(secs) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = -(-args.tokens // TOKENS)
    work = tempfile.mkdtemp(dir=args.dir, prefix="kvxfer-bench-store-gpu-")
    out: list[dict[str, Any]] = []
    try:
        seed = torch.randint(-30000, 30000, (n, LAYERS, 2, TOKENS, DIM), dtype=torch.int16).view(torch.float16)
        keys = [b"%d" % i for i in range(n)]
        local = np.random.default_rng(1).permutation(n)
        for memory, device in (("VRAM", "cuda:0"), ("DRAM", "cpu")):
            for per_layer in (False, True):
                src, keep_s = _tensors(n, per_layer, seed.to(device), device)
                dst, keep_d = _tensors(n, per_layer, None, device)
                sspec, dspec = kvxfer.spec_from_tensors(src), kvxfer.spec_from_tensors(dst)
                nbytes = n * sspec.row_bytes
                with kvxfer.Store(os.path.join(work, f"{memory}{per_layer}"), capacity=nbytes, layout=sspec,
                                  timeout=600) as st:
                    def off() -> Any:
                        st.discard(keys)
                        return st.offload(sspec, local, keys).wait()

                    def res() -> Any:
                        return st.restore(keys, dspec, local).wait()

                    for what, fn in (("offload", off), ("restore", res)):
                        t = fn()
                        secs = []
                        for _ in range(args.repeat):
                            secs.append(fn().stats.seconds)
                        out.append({"run": f"store {what} ({t.stats.path})", "memory": memory,
                                    "cache": "layers" if per_layer else "rows", **_rates(nbytes, secs)})
                if device != "cpu":
                    torch.cuda.synchronize()
                ok = all(torch.equal(a.cpu().view(torch.int16)[local], b.cpu().view(torch.int16)[local])
                         for a, b in zip(keep_s, keep_d))
                out[-1]["verified"] = out[-2]["verified"] = "yes" if ok else "NO: bytes differ"
                del src, dst, keep_s, keep_d
        x = seed.to("cuda:0")
        pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        secs = []
        for _ in range(args.repeat + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pinned.copy_(x, non_blocking=True)
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
        out.append({"run": "plain copy VRAM -> pinned host (the stage's ceiling)", "memory": "VRAM", "cache": "rows",
                    **_rates(x.numel() * 2, secs[1:])})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{n} blocks of {LAYERS * 2 * TOKENS * DIM * 2} bytes per request; median and best of {args.repeat}")
    print_table(out, [Column("run"), Column("memory"), Column("cache"), Column("gbps", "GB/s median", "{:.2f}"),
                      Column("best", "GB/s best", "{:.2f}"), Column("verified")])


if __name__ == "__main__":
    main()
