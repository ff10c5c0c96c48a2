"""Fixed cost per transfer: one-block READs, raw NIXL beside kvxfer (caller's thread and owner).

For each row size (default 4 KB, 64 KB and a 4.5 MB row of 61 x 73,728 bytes) a prefill child
process holds a packed source (``bench_nixl.py --role target``: a kvxfer agent and a raw
``nixl_agent`` on the same memory); this process holds the destination, a kvxfer agent, a raw
agent and a :class:`kvxfer.Owner` over a second kvxfer agent. Each sample is one block, READ and
waited for:

* ``raw``: ``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state`` in a hot loop
  (lists prepared once, int32 indices made once);
* ``kvxfer``: ``Agent.read(peer, [d], [s])`` then ``done()`` in a hot loop, on this thread;
* ``owner``: ``Owner.read(peer, [d], [s]).wait()``: the owner's thread plans, posts and polls.

``--contention`` repeats each with a Python thread busy in numpy (``np.add`` over 1M floats in a
loop, as a model thread is: the GIL is free inside each call, taken between them). Block ids
cycle over the cache so no sample reuses the previous one's destination; after each case every
moved block is checked byte for byte against the regenerated source, and blocks never moved
must still hold the sentinel. Results (medians, p90, added over raw) are printed and, with
``--json``, written. Commands and figures: BENCHMARKS.md ("Fixed cost per transfer").
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_nixl as bn  # noqa: E402
from _nixl_buffers import SENTINEL, Buffers  # noqa: E402

SIZES = {"4KB": (1, 4096), "64KB": (1, 65536), "4.5MB": (61, 73728)}


class Busy:
    """A Python thread busy in numpy until stopped (the model thread of the contention case).

    ``n`` floats per ``np.add``: 1M frees the GIL inside each call (as large array work does);
    64 keeps it nearly always held (tiny calls, Python between them), so every other thread
    waits for the interpreter's switch interval."""

    def __init__(self, n: int = 1 << 20) -> None:
        self.stop = threading.Event()
        self.calls = 0
        self.n = n
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a, b = np.ones(self.n), np.ones(self.n)
        out = np.empty_like(a)
        while not self.stop.is_set():
            np.add(a, b, out=out)
            self.calls += 1

    def __enter__(self) -> "Busy":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def one_size(label: str, layers: int, page: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import kvxfer

    R, B = layers * page, args.blocks
    targs = bn.parse(["--memory", args.memory, "--blocks", str(B), "--layers", str(layers), "--page", str(page),
                      "--remote-gpu", str(args.remote_gpu), "--local-gpu", str(args.local_gpu),
                      "--target-poll-s", "0.001", "--device-copy", args.device_copy])
    target = bn.RemoteTarget(targs)
    buf = Buffers(args.memory, args.local_gpu)
    dst = buf.full(B, R, SENTINEL)
    views = {f"layer.{i}": dst[:, i * page:(i + 1) * page] for i in range(layers)}
    opts = {"device_copy": args.device_copy == "on", "background_progress": args.background_progress == "on"}
    kx = kvxfer.Agent("decode-caller", backend="nixl", **opts)
    ko = kvxfer.Agent("decode-owned", backend="nixl", **opts)
    rows: list[dict[str, Any]] = []
    owner = None
    try:
        for a in (kx, ko):
            a.register(views, replicated=True)
        raw = bn.nixl_agent("decode-raw", False)
        dev = buf.dev()
        raw.register_memory(np.array([[buf.ptr(dst), B * R, dev]], dtype=np.uint64), args.memory)
        md = target.metadata
        peer = kx.add_peer(base64.b64decode(md["kvxfer"]))
        ko.add_peer(base64.b64decode(md["kvxfer"]))
        raw_peer = raw.add_remote_agent(base64.b64decode(md["raw"]))
        target.call({"cmd": "add", "kvxfer": [base64.b64encode(a.metadata()).decode() for a in (kx, ko)],
                     "raw": base64.b64encode(raw.get_agent_metadata()).decode()})
        rbase = kx.peers[peer].spec.allocations[0].address
        rdev = args.remote_gpu if args.memory == "VRAM" else 0
        lh = raw.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([bn.strided(buf.ptr(dst), R, dev, R, B)],
                                                             dtype=np.uint64), args.memory)
        rh = raw.prep_xfer_dlist(raw_peer, np.array([bn.strided(rbase, R, rdev, R, B)], dtype=np.uint64), args.memory)
        owner = kvxfer.Owner(ko, close_agent=False)
        moved: dict[int, int] = {}
        rng = np.random.default_rng(3)
        # Destination d always reads source perm[d]: every sample is checkable afterwards.
        perm = rng.permutation(B)
        counter = [0]

        def ids() -> tuple[int, int]:
            d = counter[0] % (B - 1)  # block B-1 is never written: it keeps the sentinel
            counter[0] += 1
            moved[d] = int(perm[d])
            return d, int(perm[d])

        idx32 = {d: (np.array([d], np.int32), np.array([perm[d]], np.int32)) for d in range(B)}

        def raw_one() -> None:
            d, _ = ids()
            li, ri = idx32[d]
            h = raw.make_prepped_xfer("READ", lh, li, rh, ri, b"")
            if raw.transfer(h) == "ERR":
                raise RuntimeError("raw transfer failed")
            while raw.check_xfer_state(h) != "DONE":
                pass
            raw.release_xfer_handle(h)

        def kx_one() -> None:
            d, s = ids()
            t = kx.read(peer, [d], [s])
            while not t.done():
                pass

        def owner_one() -> None:
            d, s = ids()
            owner.read(peer, [d], [s]).wait(args.timeout)

        cases: list[tuple[str, Callable[[], None]]] = [("raw", raw_one), ("kvxfer", kx_one), ("owner", owner_one)]
        if args.memory == "VRAM":
            # The bare copy: the same bytes, device to device on this GPU (what a copy through an
            # already-mapped CUDA-IPC handle costs), synchronised like a completed transfer.
            torch = buf.torch
            local_src = buf.random(B, R, bn.SRC_SEED)

            def copy_one() -> None:
                d, s = ids()
                dst[d].copy_(local_src[s], non_blocking=True)
                torch.cuda.synchronize(args.local_gpu)

            cases.insert(0, ("copy", copy_one))
        if args.profile:
            import cProfile
            import pstats

            for _ in range(args.warmup):
                kx_one()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile):
                kx_one()
            prof.disable()
            print(f"-- {label}: where the caller's thread spends {args.profile} one-block READs (tottime)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        modes: list[Any] = [False] + ([True] if args.contention else []) + (["small"] if args.contention_small else [])
        for contention in modes:
            for who, fn in cases:
                buf.fill(dst, SENTINEL)
                moved.clear()
                try:
                    with (Busy(64 if contention == "small" else 1 << 20) if contention else _Nothing()) as busy:
                        for _ in range(args.warmup):
                            fn()
                        times = []
                        for _ in range(args.iters):
                            t0 = time.perf_counter()
                            fn()
                            times.append(time.perf_counter() - t0)
                    buf.sync()
                    _verify(buf, dst, moved, B, R)
                except Exception as exc:  # keep the other cases' figures; say what failed
                    print(f"{label} {who} contention={contention}: {type(exc).__name__}: {exc}", flush=True)
                    rows.append({"size": label, "bytes": R, "who": who, "contention": contention,
                                 "error": f"{type(exc).__name__}: {exc}"})
                    continue
                times.sort()
                rows.append({"size": label, "bytes": R, "who": who, "contention": contention,
                             "median_us": 1e6 * statistics.median(times), "p90_us": 1e6 * times[int(0.9 * len(times))],
                             "busy_calls": getattr(busy, "calls", 0), "iters": len(times)})
                print(f"{label} {who} contention={contention}: median {rows[-1]['median_us']:.1f} us", flush=True)
        for c in modes:
            for ref in ("raw", "copy"):
                base = {r["size"]: r["median_us"] for r in rows
                        if r["who"] == ref and r["contention"] == c and "median_us" in r}
                for r in rows:
                    if r["contention"] == c and r["size"] in base and "median_us" in r:
                        r[f"added_vs_{ref}_us"] = r["median_us"] - base[r["size"]]
    finally:
        if owner is not None:
            owner.close()
        ko.close()
        kx.close()
        target.close()
    return rows


class _Nothing:
    def __enter__(self) -> "_Nothing":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _verify(buf: Buffers, dst: Any, moved: dict[int, int], B: int, R: int) -> None:
    src = buf.random(B, R, bn.SRC_SEED)
    d = np.array(sorted(moved), dtype=np.int64)
    s = np.array([moved[i] for i in sorted(moved)], dtype=np.int64)
    if not buf.check_rows(dst, d, src, s):
        raise AssertionError("a moved block differs from the source")
    rest = np.setdiff1d(np.arange(B), d)
    if not buf.all_equal(dst[buf.index(rest, dst)], SENTINEL):
        raise AssertionError("a block never moved changed")


def _busy(c: Any) -> str:
    return {False: "-", True: "busy 1M", "small": "busy 64"}[c]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", choices=("DRAM", "VRAM"), default="DRAM")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--contention", action="store_true", help="also with a thread in np.add over 1M floats")
    ap.add_argument("--contention-small", action="store_true",
                    help="also with a thread in np.add over 64 floats (holds the GIL nearly always)")
    ap.add_argument("--local-gpu", type=int, default=0)
    ap.add_argument("--remote-gpu", type=int, default=0)
    ap.add_argument("--device-copy", choices=("on", "off"), default="on")
    ap.add_argument("--background-progress", choices=("on", "off"), default="on",
                    help="the decode agents' background progress thread (the NIXL backend's option)")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--profile", type=int, default=0, help="also profile this many kvxfer READs (cProfile)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for label in args.sizes.split(","):
        rows += one_size(label, *SIZES[label], args)
    print(f"{'size':6s} {'who':7s} {'numpy thread':12s} {'median us':>10s} {'p90 us':>9s} {'+raw us':>8s} "
          f"{'+copy us':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:6s} {r['who']:7s} {_busy(r['contention']):12s} {r['error']}")
            continue
        extra = r.get("added_vs_copy_us")
        print(f"{r['size']:6s} {r['who']:7s} {_busy(r['contention']):12s} {r['median_us']:10.1f} "
              f"{r['p90_us']:9.1f} {r.get('added_vs_raw_us', 0.0):8.1f} {'' if extra is None else f'{extra:8.1f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
