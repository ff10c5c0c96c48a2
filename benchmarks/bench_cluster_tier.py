"""The cluster tier against raw Mooncake Store, and against a per-layer object layout.

    python benchmarks/bench_cluster_tier.py [--blocks 64] [--layers 16] [--repeat 5]

One throwaway ``mooncake_master`` on 127.0.0.1 and a holder process that lends the only
segment; this process lends none, so every byte crosses the transfer engine (TCP) between
two processes. The same request (``--blocks`` blocks of a per-layer cache: ``--layers``
layers of K and V pages) is moved three ways, put then get, fresh keys each repeat:

* ``kvxfer tier``: :class:`kvxfer.tiers.MooncakeTier` (gather into rows in the bounce,
  header and digest, one object per row; a get checks every object before the scatter);
* ``raw whole rows``: ``batch_put_from``/``batch_get_into`` of the same rows from one
  registered contiguous buffer (what the tier's bytes cost with no gather, digest or check);
* ``raw per-layer``: one object per layer and K/V page, straight from the per-layer arrays
  (what a layer-wise store writes).

Prints a Markdown table: median GB/s over the repeats, objects and client calls per request,
and checks every restored byte against the source (numpy over the logical array).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvxfer  # noqa: E402
from kvxfer.testing.lines import Channel  # noqa: E402
from kvxfer.testing.mooncake_master import MooncakeMaster  # noqa: E402
from kvxfer.tiers import MooncakeTier  # noqa: E402

TOKENS, HEADS, DIM = 16, 8, 128  # fp16 pages of 32 KiB

HOLD = ("import sys;from mooncake.store import MooncakeDistributedStore as S;s=S();"
        "r=s.setup('127.0.0.1','P2PHANDSHAKE',{seg},16<<20,'tcp','','{master}');print(r,flush=True);"
        "sys.stdin.read();s.close()")


def cache(blocks: int, layers: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {f"layer.{l}": tuple(rng.integers(0, 255, (blocks, TOKENS, HEADS, DIM * 2), dtype=np.uint8)
                                for _ in range(2)) for l in range(layers)}


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    n, layers = a.blocks, a.layers
    page = TOKENS * HEADS * DIM * 2
    row = 2 * layers * page
    nbytes = n * row
    src = cache(n, layers, 1)
    seg = max(256 << 20, 6 * nbytes)
    out: list[tuple[str, int, int, float, float, bool]] = []
    with MooncakeMaster(lease_ms=1000) as m:  # a read's lease must outlast its transfer (-707)
        hold = subprocess.Popen([sys.executable, "-c", HOLD.format(seg=seg, master=m.address)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert Channel(hold).line(120).strip() == "0"
        try:
            spec = kvxfer.spec_from_arrays(src)
            tier = MooncakeTier(m.address, layout=spec, buffer=nbytes + (1 << 20), timeout=60)
            st = tier._store
            dst = cache(n, layers, 2)
            dspec = kvxfer.spec_from_arrays(dst)

            def clear(names: list[str]) -> None:
                """Remove a repeat's objects (retried past the reads' lease): no eviction mid-run."""
                while names:
                    time.sleep(0.1)
                    names = [x for x, rc in zip(names, st.batch_remove(names)) if rc == -706]

            # kvxfer's tier
            put_s, get_s, ok = [], [], True
            for r in range(a.repeat):
                ks = [f"t{r}-{i}".encode() for i in range(n)]
                t0 = time.perf_counter()
                tier.offload(spec, list(range(n)), ks).wait()
                put_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                tr = tier.restore(ks, dspec, list(range(n))).wait()
                get_s.append(time.perf_counter() - t0)
                ok &= all(np.array_equal(dst[k][i], src[k][i]) for k in src for i in (0, 1))
                for k in dst:
                    for x in dst[k]:
                        x[...] = 0xAA
                clear(tier.names(ks))
            out.append(("kvxfer tier (whole rows, checked)", n, tr.stats.telemetry[0]["ios"], gbps(nbytes, put_s),
                        gbps(nbytes, get_s), ok))

            # raw whole rows, from one registered contiguous buffer
            rows = np.empty((n, row), dtype=np.uint8)
            for i in range(n):
                rows[i] = np.concatenate([src[f"layer.{l}"][kv][i].ravel() for l in range(layers) for kv in (0, 1)])
            back = np.full_like(rows, 0xAA)
            for buf in (rows, back):
                assert st.register_buffer(buf.ctypes.data, buf.nbytes) == 0
            put_s, get_s = [], []
            for r in range(a.repeat):
                names = [f"raw{r}-{i}" for i in range(n)]
                t0 = time.perf_counter()
                assert st.batch_put_from(names, [rows.ctypes.data + i * row for i in range(n)], [row] * n) == [0] * n
                put_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = st.batch_get_into(names, [back.ctypes.data + i * row for i in range(n)], [row] * n)
                get_s.append(time.perf_counter() - t0)
                assert got == [row] * n
                clear(names)
            out.append(("raw Mooncake, whole rows", n, 1, gbps(nbytes, put_s), gbps(nbytes, get_s),
                        bool(np.array_equal(rows, back))))

            # raw per-layer objects, straight from the per-layer arrays
            arrs = [(l, kv, src[f"layer.{l}"][kv], dst[f"layer.{l}"][kv]) for l in range(layers) for kv in (0, 1)]
            for _, _, s_, d_ in arrs:
                assert st.register_buffer(s_.ctypes.data, s_.nbytes) == 0
                assert st.register_buffer(d_.ctypes.data, d_.nbytes) == 0
            put_s, get_s = [], []
            for r in range(a.repeat):
                names = [f"pl{r}-{i}-{l}-{kv}" for i in range(n) for l, kv, _, _ in arrs]
                sp = [s_.ctypes.data + i * page for i in range(n) for _, _, s_, _ in arrs]
                dp = [d_.ctypes.data + i * page for i in range(n) for _, _, _, d_ in arrs]
                t0 = time.perf_counter()
                assert st.batch_put_from(names, sp, [page] * len(names)) == [0] * len(names)
                put_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert st.batch_get_into(names, dp, [page] * len(names)) == [page] * len(names)
                get_s.append(time.perf_counter() - t0)
                clear(names)
            ok = all(np.array_equal(dst[k][i], src[k][i]) for k in src for i in (0, 1))
            out.append(("raw Mooncake, per-layer objects", len(names), 1, gbps(nbytes, put_s), gbps(nbytes, get_s),
                        ok))
            tier.close()
        finally:
            hold.stdin.close()
            hold.wait(30)
    print(f"{n} blocks x {layers} layers x K,V pages of {page // 1024} KiB = {nbytes / 2**20:.0f} MiB per request, "
          f"median of {a.repeat}, two processes over TCP (127.0.0.1)\n")
    print("| layout | objects / request | client calls / request | put GB/s | get GB/s | bytes exact |")
    print("|---|---|---|---|---|---|")
    for name, objs, calls, p, g, ok in out:
        print(f"| {name} | {objs} | {calls} | {p:.2f} | {g:.2f} | {ok} |")


if __name__ == "__main__":
    main()
