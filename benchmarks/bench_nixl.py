"""kvxfer over NIXL against raw NIXL, on the same buffers and the same block ids.

The request is decode pulling (READ) one long request of a 61-layer MLA model from prefill:
by default 1,563 blocks of 64 tokens, 576 bf16 channels, so a 73,728-byte page per layer and
a 4.5 MB row per block (7.0 GB). Prefill holds a block-outermost (packed) cache. Decode holds
either the same packed layout (**rows**: one descriptor per block) or one region per layer
(**layers**: 61 descriptors per block).

Each process holds kvxfer agents *and* a raw ``nixl_agent`` registered on the same memory.
Raw NIXL gets the best it can do by hand: strided lists prepared once, int32 indices computed
with numpy, one ``make_prepped_xfer`` + ``transfer`` + polling per request. kvxfer goes
through ``Agent.read(...).wait()``: planning, bounds checks and the backend seam included.
``--variants`` adds kvxfer agents with other options to the same run (``kvxfer``: defaults,
i.e. the device path for VRAM peers of one host; ``kvxfer-nixl``: device path off;
``kvxfer-ce`` / ``kvxfer-sm``: copy engines / copy kernel; ``kvxfer-peer``: copy on the
peer's GPU). Every run is verified byte for byte: the checking side regenerates the seeded
source and compares every moved byte, and destination blocks outside the request must
still hold the 0xAA sentinel. Posting cost (the ``read``/``write`` call alone, or
``make_prepped_xfer`` + ``transfer`` for raw NIXL) is reported per transfer and per descriptor.

Usage (the exact commands used for the results are in BENCHMARKS.md (NIXL section))::

    python benchmarks/bench_nixl.py --memory DRAM --blocks 128            # CPU box
    python benchmarks/bench_nixl.py --memory VRAM --local-gpu 0 --remote-gpu 1   # NVLink
    python benchmarks/bench_nixl.py --memory VRAM --same-process           # both agents here

Prefill runs in a child process (``--role target``) unless ``--same-process``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _nixl_buffers import SENTINEL, Buffers  # noqa: E402

from kvxfer.deadlines import Backoff, Deadline
from kvxfer.testing import lines  # noqa: E402

EXTRA = 8  # destination blocks never written: must keep the sentinel
SRC_SEED, WRITE_SEED = 1234, 99
VARIANTS: dict[str, dict[str, Any]] = {
    "kvxfer": {}, "kvxfer-nixl": {"device_copy": False}, "kvxfer-ce": {"device_engine": "ce"},
    "kvxfer-sm": {"device_engine": "sm"}, "kvxfer-peer": {"device_copy_on": "peer"},
    "kvxfer-sm-peer": {"device_engine": "sm", "device_copy_on": "peer"},
}


def nixl_agent(name: str, progress_thread: bool, num_threads: int = 0) -> Any:
    import kvxfer_nixl.backend  # noqa: F401  (quiets NIXL's stdout logging the same way)
    from nixl._api import nixl_agent as _agent, nixl_agent_config

    return _agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                          num_threads=num_threads))


def kx_options(args: argparse.Namespace, variant: str = "kvxfer") -> dict[str, Any]:
    base = {"progress_thread": args.progress_thread, "num_threads": args.num_threads,
            "device_copy": args.device_copy, "device_engine": args.device_engine,
            "device_copy_on": args.device_copy_on, "timeout": args.timeout}
    return {**base, **VARIANTS[variant]}


def strided(base: int, length: int, dev: int, stride: int, count: int) -> list[int]:
    return [base, length, dev, stride, count]


# ------------------------------------------------------------------------------------------
# prefill (target)
# ------------------------------------------------------------------------------------------
class Prefill:
    """Source cache: packed rows, random bytes, one kvxfer agent and one raw NIXL agent."""

    def __init__(self, args: argparse.Namespace, device: int) -> None:
        import kvxfer

        self.args = args
        self.buf = Buffers(args.memory, device)
        B, L, P = args.blocks, args.layers, args.page
        self.rows = self.buf.random(B, L * P, SRC_SEED)
        self.buf.sync()
        self.agent = kvxfer.Agent("prefill", backend="nixl", **kx_options(args))
        self.agent.register({f"layer.{i}": self.rows[:, i * P:(i + 1) * P] for i in range(L)}, replicated=True)
        self.raw = nixl_agent("prefill-raw", args.progress_thread, args.num_threads)
        base, dev = self.buf.ptr(self.rows), self.buf.dev()
        self.raw.register_memory(np.array([[base, B * L * P, dev]], dtype=np.uint64), args.memory)

    def metadata(self) -> dict[str, str]:
        return {"kvxfer": base64.b64encode(self.agent.metadata()).decode(),
                "raw": base64.b64encode(self.raw.get_agent_metadata()).decode()}

    def add(self, md: dict[str, str]) -> None:
        for m in md.get("kvxfer", []):
            self.agent.add_peer(base64.b64decode(m))
        if md.get("raw"):
            self.raw.add_remote_agent(base64.b64decode(md["raw"]))

    def progress(self) -> None:
        self.agent.progress()
        self.raw.get_new_notifs()

    def check_write(self, ids: list[int], src_ids: list[int], nb: int) -> bool:
        """After a WRITE: rows ``ids`` hold the writer's seeded rows ``src_ids`` (every byte), the
        other rows still hold the original source. Restores the original for the next run."""
        B, R = self.args.blocks, self.args.layers * self.args.page
        orig = self.buf.random(B, R, SRC_SEED)
        wsrc = self.buf.random(nb, R, WRITE_SEED)
        ok = self.buf.check_rows(self.rows, np.asarray(ids), wsrc, np.asarray(src_ids))
        rest = np.setdiff1d(np.arange(B), ids)
        ok = ok and self.buf.check_rows(self.rows, rest, orig, rest)
        self.buf.copy(self.rows, orig)
        return bool(ok)

    def close(self) -> None:
        self.agent.close()


def target_main(args: argparse.Namespace) -> int:
    p = Prefill(args, args.remote_gpu)
    lines.say(sys.stdout, {"metadata": p.metadata()})

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "add":
            p.add(cmd)
            return {"ok": True}
        if cmd["cmd"] == "check_write":
            return {"ok": p.check_write(cmd["ids"], cmd["src_ids"], cmd["nb"])}
        raise ValueError(f"unknown command {cmd['cmd']!r}")

    lines.serve(handle, p.progress, poll_s=args.target_poll_s)
    p.close()
    return 0


class RemoteTarget:
    #: A hang guard on each reply (a check of a large cache takes seconds), not a speed claim.
    REPLY_S = 600.0

    def __init__(self, args: argparse.Namespace) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--role", "target"] + _forward(args)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._ch = lines.Channel(self.proc)
        self.metadata = self._read()["metadata"]

    def _read(self) -> dict[str, Any]:
        try:
            reply = self._ch.read(self.REPLY_S)
        except EOFError:
            raise RuntimeError(f"target exited with {self.proc.wait()}") from None
        if "error" in reply:
            raise RuntimeError(f"target failed: {reply['error']}: {reply['message']}")
        return reply

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self._ch.send(cmd)
        return self._read()

    def close(self) -> None:
        if not self._ch.stop(30):
            self.proc.kill()


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--memory", args.memory, "--blocks", str(args.blocks), "--layers", str(args.layers), "--page",
            str(args.page), "--remote-gpu", str(args.remote_gpu), "--progress-thread",
            "on" if args.progress_thread else "off", "--target-poll-s", str(args.target_poll_s),
            "--timeout", str(args.timeout), "--num-threads", str(args.num_threads), "--device-copy",
            "on" if args.device_copy else "off"]


class LocalTarget:
    """Prefill in this process (the same-process fast path)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.p = Prefill(args, args.remote_gpu)
        md = self.p.metadata()
        self.metadata = md

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "add":
            self.p.add(cmd)
        if cmd["cmd"] == "check_write":
            return {"ok": self.p.check_write(cmd["ids"], cmd["src_ids"], cmd["nb"])}
        return {"ok": True}

    def close(self) -> None:
        self.p.close()


# ------------------------------------------------------------------------------------------
# decode (initiator)
# ------------------------------------------------------------------------------------------
CPU: list[float] = []  # this process's CPU seconds per timed call (all threads), in call order


def timed(fn: Callable[[], Any], iters: int, warmup: int = 1) -> list[float]:
    """Wall seconds per call; the CPU seconds go to ``CPU``, which a shared machine disturbs less."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        CPU.append(time.process_time() - c0)
    return out


def raw_wait(agent: Any, handles: list[Any], timeout: float, backoff: bool = True) -> None:
    """Poll until DONE; with ``backoff`` exactly like ``kvxfer.Transfer.wait`` (spin 64, then sleep)."""
    deadline = Deadline.within(timeout)
    pending = list(handles)
    rhythm = Backoff(1e-6, 1e-3, factor=1.0, step=1e-6, spins=64) if backoff else None  # Transfer.wait's
    while pending:
        pending = [h for h in pending if agent.check_xfer_state(h) != "DONE"]
        if pending and deadline.expired():
            raise TimeoutError("raw NIXL transfer did not finish")
        if pending and rhythm is not None:
            d = rhythm.next()
            if d:
                time.sleep(d)
    for h in handles:
        agent.release_xfer_handle(h)


def main(args: argparse.Namespace) -> dict[str, Any]:
    import kvxfer

    B, L, P = args.blocks, args.layers, args.page
    R = L * P
    NB = B + EXTRA
    buf = Buffers(args.memory, args.local_gpu)
    target: Any = LocalTarget(args) if args.same_process else RemoteTarget(args)
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "role"},
                               "runs": [], "overhead": {}}
    rng = np.random.default_rng(7)
    src_ids = rng.permutation(B)[: args.request].astype(np.int64)
    dst_ids = rng.permutation(NB)[: args.request].astype(np.int64)
    nbytes = len(src_ids) * R
    dev = buf.dev()
    modes = args.modes.split(",")
    variants = args.variants.split(",")
    agents: dict[tuple[str, str], Any] = {}
    try:
        # destinations: packed rows and per-layer regions, both sentinel-filled
        rows = buf.full(NB, R, SENTINEL)
        layers = [buf.full(NB, P, SENTINEL) for _ in range(L)] if "layers" in modes else []
        views = {"rows": {f"layer.{i}": rows[:, i * P:(i + 1) * P] for i in range(L)},
                 "layers": {f"layer.{i}": t for i, t in enumerate(layers)}}
        for mode in ("rows",) + (("layers",) if layers else ()):
            for v in variants:
                a = kvxfer.Agent(f"decode-{mode}-{v}", backend="nixl", **kx_options(args, v))
                a.register(views[mode], replicated=True)
                agents[(mode, v)] = a
        raw = nixl_agent("decode-raw", args.progress_thread, args.num_threads)
        raw.register_memory(np.array([[buf.ptr(rows), NB * R, dev]] + [[buf.ptr(t), NB * P, dev] for t in layers],
                                     dtype=np.uint64), args.memory)
        md = target.metadata
        peer = "prefill"
        for a in agents.values():
            a.add_peer(base64.b64decode(md["kvxfer"]))
        raw_peer = raw.add_remote_agent(base64.b64decode(md["raw"]))
        target.call({"cmd": "add", "kvxfer": [base64.b64encode(a.metadata()).decode() for a in agents.values()],
                     "raw": base64.b64encode(raw.get_agent_metadata()).decode()})
        kx_rows = agents[("rows", variants[0])]
        results["routes"] = {f"{m}/{v}": str(a.device_path.route(peer)) for (m, v), a in agents.items()}
        for k, r in results["routes"].items():
            print(f"route {k}: {r}", flush=True)
        # raw NIXL lists, prepared once, as strided rows (the fastest way to prepare)
        remote_base = kx_rows.peers[peer].spec.allocations[0].address
        rdev = args.remote_gpu if args.memory == "VRAM" else 0
        kind = args.memory
        lrows = raw.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([strided(buf.ptr(rows), R, dev, R, NB)],
                                                                dtype=np.uint64), kind)
        rrows = raw.prep_xfer_dlist(raw_peer, np.array([strided(remote_base, R, rdev, R, B)], dtype=np.uint64), kind)
        handles = {"rows": (lrows, rrows)}
        if layers:
            handles["layers"] = (
                raw.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([strided(buf.ptr(t), P, dev, P, NB) for t in layers],
                                                                dtype=np.uint64), kind),
                raw.prep_xfer_dlist(raw_peer, np.array([strided(remote_base + i * P, P, rdev, R, B)
                                                        for i in range(L)], dtype=np.uint64), kind))
        lay = np.arange(L, dtype=np.int64)
        idx = {
            "rows": (dst_ids.astype(np.int32), src_ids.astype(np.int32)),
            "layers": ((dst_ids[:, None] + lay[None, :] * NB).reshape(-1).astype(np.int32),
                       (src_ids[:, None] + lay[None, :] * B).reshape(-1).astype(np.int32)),
        }

        def reset() -> None:
            buf.fill(rows, SENTINEL)
            for t in layers:
                buf.fill(t, SENTINEL)

        def verify(mode: str) -> None:
            """Every moved byte against the regenerated source; the rest still the sentinel."""
            src = buf.random(B, R, SRC_SEED)
            rest = np.setdiff1d(np.arange(NB), dst_ids)
            if mode == "rows":
                ok = buf.check_rows(rows, dst_ids, src, src_ids)
                untouched = rows[buf.index(rest, rows)]
            else:
                di = buf.index(dst_ids, layers[0])
                ok = buf.equal(buf.concat([t[di] for t in layers]), src[buf.index(src_ids, src)])
                ri = buf.index(rest, layers[0])
                untouched = buf.concat([t[ri] for t in layers])
            del src
            if not ok:
                raise AssertionError(f"{mode}: destination rows differ from the source")
            if not buf.all_equal(untouched, SENTINEL):
                raise AssertionError(f"{mode}: blocks outside the request changed")

        posts: list[float] = []

        def kx_run(a: Any, op: str, splits: int, last: dict[str, Any]) -> Callable[[], None]:
            fn = a.read if op == "READ" else a.write

            def run() -> None:
                t0 = time.perf_counter()
                ts = [fn(peer, d, s) for d, s in zip(np.array_split(dst_ids, splits), np.array_split(src_ids, splits))]
                posts.append(time.perf_counter() - t0)
                for t in ts:
                    t.wait(args.timeout)
                last["path"] = ts[0].stats.path
            return run

        def raw_run(mode: str, splits: int, op: str = "READ") -> Callable[[], None]:
            li, ri = idx[mode]
            lh, rh = handles[mode]
            per = len(li) // len(src_ids)
            parts = [(a * per, b * per) for a, b in _bounds(len(src_ids), splits)]

            def run() -> None:
                hs = []
                t0 = time.perf_counter()
                for a, b in parts:
                    h = raw.make_prepped_xfer(op, lh, li[a:b], rh, ri[a:b], b"")
                    if raw.transfer(h) == "ERR":
                        raise RuntimeError("raw transfer failed")
                    hs.append(h)
                posts.append(time.perf_counter() - t0)
                raw_wait(raw, hs, args.timeout, args.raw_wait == "backoff")
            return run

        def record(who: str, mode: str, op: str, splits: int, times: list[float], path: str | None) -> None:
            med = statistics.median(times)
            descs = len(idx[mode][0])
            post = statistics.median(posts[-len(times):])
            rec = {"who": who, "mode": mode, "op": op, "splits": splits, "descriptors": descs, "bytes": nbytes,
                   "median_s": med, "best_s": min(times), "gbps": nbytes / med / 1e9,
                   "best_gbps": nbytes / min(times) / 1e9, "post_us": post * 1e6,
                   "post_ns_per_desc": post * 1e9 / descs, "path": path,
                   "samples_s": times, "cpu_s": CPU[-len(times):]}
            results["runs"].append(rec)
            print(f"{who:12s} {mode:6s} {op:5s} splits={splits:<2d} {descs:6d} descs  {nbytes / 1e9:5.2f} GB  "
                  f"median {med * 1e3:8.2f} ms  {rec['gbps']:7.1f} GB/s  best {rec['best_gbps']:7.1f}  "
                  f"post {post * 1e6:9.1f} us ({rec['post_ns_per_desc']:7.1f} ns/desc)  path={path}", flush=True)

        for mode in modes:
            for splits in args.splits:
                for who in ["raw"] + variants:
                    if who == "raw" and args.same_process and not args.raw_same_process:
                        continue
                    last: dict[str, Any] = {"path": "nixl"}
                    fn = raw_run(mode, splits) if who == "raw" else kx_run(agents[(mode, who)], "READ", splits, last)
                    reset()
                    times = timed(fn, args.iters)
                    buf.sync()
                    verify(mode)
                    record(who, mode, "READ", splits, times, "raw" if who == "raw" else last["path"])
        if args.write and not args.same_process:
            # WRITE: push our (seeded) rows into prefill's buffer; prefill checks every byte
            buf.copy(rows, buf.random(NB, R, WRITE_SEED))
            for who in ["raw"] + variants:
                last = {"path": "nixl"}
                wfn = raw_run("rows", 1, "WRITE") if who == "raw" else kx_run(agents[("rows", who)], "WRITE", 1, last)
                times = timed(wfn, args.iters)
                if not target.call({"cmd": "check_write", "ids": src_ids.tolist(), "src_ids": dst_ids.tolist(),
                                    "nb": NB})["ok"]:
                    raise AssertionError(f"{who} WRITE: prefill rows differ")
                record(who, "rows", "WRITE", 1, times, "raw" if who == "raw" else last["path"])
        results["overhead"] = overhead(args, kx_rows, raw, handles["rows"], dst_ids, src_ids, R, peer)
        if args.memory == "VRAM":
            results["ceiling"] = ceiling(args, buf, len(src_ids), R, nbytes)
    finally:
        for a in agents.values():
            a.close()
        target.close()
    summary(results)
    return results


def overhead(args: argparse.Namespace, kx: Any, raw: Any, lists: tuple[Any, Any], dst_ids: np.ndarray,
             src_ids: np.ndarray, R: int, peer: str) -> dict[str, Any]:
    """Per-transfer cost: one whole-row block, many times. "spin" polls without sleeping on
    both sides, so the difference is what kvxfer adds (planning, checks, the seam)."""
    one_d, one_s = dst_ids[:1], src_ids[:1]
    li1, ri1 = one_d.astype(np.int32), one_s.astype(np.int32)
    lh, rh = lists

    def raw_small() -> None:
        h = raw.make_prepped_xfer("READ", lh, li1, rh, ri1, b"")
        raw.transfer(h)
        raw_wait(raw, [h], args.timeout, backoff=False)

    def kx_small_spin() -> None:
        t = kx.read(peer, one_d, one_s)
        while not t.done():
            pass

    over: dict[str, Any] = {"bytes": R}
    if not args.same_process or args.raw_same_process:
        over["raw_spin_us"] = statistics.median(timed(raw_small, args.small_iters, warmup=20)) * 1e6
    over["kvxfer_spin_us"] = statistics.median(timed(kx_small_spin, args.small_iters, warmup=20)) * 1e6
    over["plan_only_us"] = statistics.median(
        timed(lambda: kx.plan(peer, one_d, one_s), args.small_iters, warmup=20)) * 1e6
    if "raw_spin_us" in over:
        over["added_us"] = over["kvxfer_spin_us"] - over["raw_spin_us"]
    print("one block (%d B): %s" % (R, ", ".join(f"{k} {v:.1f}" for k, v in over.items() if k != "bytes")),
          flush=True)
    return over


def ceiling(args: argparse.Namespace, buf: Buffers, n: int, R: int, nbytes: int) -> dict[str, float]:
    """A torch copy of the same number of bytes between the same devices (one contiguous span)."""
    torch = buf.torch
    a = torch.empty(n, R, dtype=torch.uint8, device=f"cuda:{args.remote_gpu}")
    b = torch.empty(n, R, dtype=torch.uint8, device=f"cuda:{args.local_gpu}")

    def run() -> None:
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(args.local_gpu)
        torch.cuda.synchronize(args.remote_gpu)

    tc = timed(run, args.iters)
    out = {"median_s": statistics.median(tc), "gbps": nbytes / statistics.median(tc) / 1e9}
    print(f"torch copy cuda:{args.remote_gpu} -> cuda:{args.local_gpu}: {out['gbps']:.1f} GB/s", flush=True)
    return out


def summary(results: dict[str, Any]) -> None:
    """Ratios against raw NIXL and the torch copy, per mode and op."""
    raw = {(r["mode"], r["op"], r["splits"]): r["gbps"] for r in results["runs"] if r["who"] == "raw"}
    ceil = results.get("ceiling", {}).get("gbps")
    for r in results["runs"]:
        base = raw.get((r["mode"], r["op"], r["splits"]))
        r["vs_raw"] = r["gbps"] / base if base else None
        r["vs_ceiling"] = r["gbps"] / ceil if ceil else None
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return
    t = Table(title="bench_nixl summary")
    for col in ("who", "mode", "op", "splits", "descs", "GB/s", "x raw", "x torch copy", "post us", "ns/desc",
                "path"):
        t.add_column(col)
    for r in results["runs"]:
        t.add_row(r["who"], r["mode"], r["op"], str(r["splits"]), str(r["descriptors"]), f"{r['gbps']:.1f}",
                  f"{r['vs_raw']:.2f}" if r["vs_raw"] else "-", f"{r['vs_ceiling']:.2f}" if r["vs_ceiling"] else "-",
                  f"{r['post_us']:.1f}", f"{r['post_ns_per_desc']:.1f}", str(r["path"]))
    Console(width=160).print(t)


def _bounds(n: int, k: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, k + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("initiator", "target"), default="initiator")
    ap.add_argument("--memory", choices=("DRAM", "VRAM"), default="DRAM")
    ap.add_argument("--blocks", type=int, default=1563, help="blocks in prefill's cache")
    ap.add_argument("--request", type=int, default=None, help="blocks moved (default: all)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--page", type=int, default=73728, help="bytes per layer page (64 tok x 576 ch x bf16)")
    ap.add_argument("--local-gpu", type=int, default=0)
    ap.add_argument("--remote-gpu", type=int, default=0)
    ap.add_argument("--progress-thread", choices=("on", "off"), default="off")
    ap.add_argument("--target-poll-s", type=float, default=0.001,
                    help="prefill drives progress at least this often (0 = spin)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--small-iters", type=int, default=300)
    ap.add_argument("--modes", default="rows,layers")
    ap.add_argument("--splits", default="1", help="comma list: concurrent posts per request")
    ap.add_argument("--write", action="store_true", help="also measure WRITE (rows)")
    ap.add_argument("--same-process", action="store_true", help="prefill agents in this process")
    ap.add_argument("--raw-same-process", action="store_true", help="also time raw NIXL same-process (slow)")
    ap.add_argument("--raw-wait", choices=("backoff", "spin"), default="backoff",
                    help="raw NIXL polling: like Transfer.wait (default) or a hot loop")
    ap.add_argument("--num-threads", type=int, default=0, help="UCX worker threads (NIXL num_threads)")
    ap.add_argument("--device-copy", choices=("on", "off"), default="on",
                    help="kvxfer's device path for VRAM peers of one host (both processes)")
    ap.add_argument("--device-engine", choices=("auto", "sm", "ce"), default="auto")
    ap.add_argument("--device-copy-on", choices=("local", "peer"), default="local")
    ap.add_argument("--variants", default="kvxfer", help=f"comma list of kvxfer agents to time: {sorted(VARIANTS)}")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    args.progress_thread = args.progress_thread == "on"
    args.device_copy = args.device_copy == "on"
    args.splits = [int(s) for s in str(args.splits).split(",")]
    if args.request is None:
        args.request = args.blocks
    return args


if __name__ == "__main__":
    a = parse()
    if a.role == "target":
        sys.exit(target_main(a))
    res = main(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
