"""kvxfer over NIXL against raw NIXL, on the same buffers and the same block ids.

The request is decode pulling (READ) one long request of a 61-layer MLA model from prefill:
by default 1,563 blocks of 64 tokens, 576 bf16 channels, so a 73,728-byte page per layer and
a 4.5 MB row per block (7.0 GB). Prefill holds a block-outermost (packed) cache. Decode holds
either the same packed layout (**rows**: one descriptor per block) or one region per layer
(**layers**: 61 descriptors per block).

Each process holds a kvxfer agent *and* a raw ``nixl_agent`` registered on the same memory.
Raw NIXL gets the best it can do by hand: strided lists prepared once, int32 indices computed
with numpy, one ``make_prepped_xfer`` + ``transfer`` + polling per request. kvxfer goes
through ``Agent.read(...).wait()``: planning, bounds checks and the backend seam included.
Every run is verified: per-block checksums of the destination against the source's, and the
destination blocks outside the request must still hold the 0xAA sentinel.

Usage (the exact commands used for the results are in BENCHMARKS.md (NIXL section))::

    python benchmarks/bench_nixl.py --memory DRAM --blocks 128            # CPU box
    python benchmarks/bench_nixl.py --memory VRAM --local-gpu 0 --remote-gpu 1   # NVLink
    python benchmarks/bench_nixl.py --memory VRAM --same-process           # fast path

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

SENTINEL = 0xAA
EXTRA = 8  # destination blocks never written: must keep the sentinel


# ------------------------------------------------------------------------------------------
# buffers (numpy for DRAM, torch for VRAM) and checksums computed the same way on both sides
# ------------------------------------------------------------------------------------------
class Buffers:
    def __init__(self, memory: str, device: int) -> None:
        self.memory = memory
        self.device = device
        if memory == "VRAM":
            import torch

            self.torch = torch

    def empty(self, rows: int, cols: int, fill: int | None) -> Any:
        if self.memory == "VRAM":
            t = self.torch
            dev = f"cuda:{self.device}"
            if fill is None:
                return t.randint(0, 256, (rows, cols), dtype=t.uint8, device=dev)
            return t.full((rows, cols), fill, dtype=t.uint8, device=dev)
        if fill is None:
            rng = np.random.default_rng(1234)
            return rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
        return np.full((rows, cols), fill, dtype=np.uint8)

    def ptr(self, a: Any) -> int:
        return int(a.data_ptr()) if self.memory == "VRAM" else int(a.ctypes.data)

    def dev(self) -> int:
        return self.device if self.memory == "VRAM" else 0

    def sums(self, rows: Any) -> np.ndarray:
        """Position-weighted wrapping sums of each row's int64 words (order-sensitive)."""
        if self.memory == "VRAM":
            t = self.torch
            w = rows.contiguous().view(t.int64)
            weights = t.arange(1, w.shape[1] + 1, dtype=t.int64, device=w.device)
            return (w * weights).sum(dim=1).cpu().numpy().astype(np.uint64)
        w = np.ascontiguousarray(rows).view(np.uint64)
        weights = np.arange(1, w.shape[1] + 1, dtype=np.uint64)
        return (w * weights).sum(axis=1, dtype=np.uint64)

    def all_equal(self, rows: Any, value: int) -> bool:
        if self.memory == "VRAM":
            return bool((rows == value).all().item())
        return bool((rows == value).all())

    def fill(self, a: Any, value: int) -> None:
        if self.memory == "VRAM":
            a.fill_(value)
            self.torch.cuda.synchronize(self.device)
        else:
            a.fill(value)

    def sync(self) -> None:
        if self.memory == "VRAM":
            self.torch.cuda.synchronize(self.device)


def nixl_agent(name: str, progress_thread: bool, num_threads: int = 0) -> Any:
    import kvxfer_nixl.backend  # noqa: F401  (quiets NIXL's stdout logging the same way)
    from nixl._api import nixl_agent as _agent, nixl_agent_config

    return _agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                          num_threads=num_threads))


def kx_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"progress_thread": args.progress_thread, "num_threads": args.num_threads,
            "device_copy": args.device_copy, "timeout": args.timeout}


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
        self.rows = self.buf.empty(B, L * P, None)
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

    def sums(self) -> np.ndarray:
        return self.buf.sums(self.rows)

    def close(self) -> None:
        self.agent.close()


def target_main(args: argparse.Namespace) -> int:
    import select

    p = Prefill(args, args.remote_gpu)
    out = sys.stdout
    out.write(json.dumps({"metadata": p.metadata()}) + "\n")
    out.flush()
    idle = args.target_poll_s
    while True:
        r, _, _ = select.select([sys.stdin], [], [], 0 if idle == 0 else idle)
        if not r:
            p.progress()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        if cmd["cmd"] == "add":
            p.add(cmd)
            reply: dict[str, Any] = {"ok": True}
        elif cmd["cmd"] == "sums":
            reply = {"sums": p.sums().tolist()}
        elif cmd["cmd"] == "exit":
            break
        else:
            reply = {"error": cmd["cmd"]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    p.close()
    return 0


class RemoteTarget:
    def __init__(self, args: argparse.Namespace) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--role", "target"] + _forward(args)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.metadata = self._read()["metadata"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target exited with {self.proc.wait()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def sums(self) -> np.ndarray:
        return np.array(self.call({"cmd": "sums"})["sums"], dtype=np.uint64)

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--memory", args.memory, "--blocks", str(args.blocks), "--layers", str(args.layers), "--page",
            str(args.page), "--remote-gpu", str(args.remote_gpu), "--progress-thread",
            "on" if args.progress_thread else "off", "--target-poll-s", str(args.target_poll_s),
            "--timeout", str(args.timeout), "--num-threads", str(args.num_threads)]


class LocalTarget:
    """Prefill in this process (the same-process fast path)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.p = Prefill(args, args.remote_gpu)
        md = self.p.metadata()
        self.metadata = md

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "add":
            self.p.add(cmd)
        return {"ok": True}

    def sums(self) -> np.ndarray:
        return self.p.sums()

    def close(self) -> None:
        self.p.close()


# ------------------------------------------------------------------------------------------
# decode (initiator)
# ------------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], iters: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def raw_wait(agent: Any, handles: list[Any], timeout: float, backoff: bool = True) -> None:
    """Poll until DONE; with ``backoff`` exactly like ``kvxfer.Transfer.wait`` (spin 64, then sleep)."""
    deadline = time.monotonic() + timeout
    pending = list(handles)
    spins = 0
    while pending:
        pending = [h for h in pending if agent.check_xfer_state(h) != "DONE"]
        if pending and time.monotonic() > deadline:
            raise TimeoutError("raw NIXL transfer did not finish")
        spins += 1
        if pending and backoff and spins > 64:
            time.sleep(min(1e-3, 1e-6 * (spins - 64)))
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
    try:
        src_sums = target.sums()
        # destinations: packed rows and per-layer regions, both sentinel-filled
        rows = buf.empty(NB, R, SENTINEL)
        layers = [buf.empty(NB, P, SENTINEL) for _ in range(L)]
        kx_rows = kvxfer.Agent("decode-rows", backend="nixl", **kx_options(args))
        kx_rows.register({f"layer.{i}": rows[:, i * P:(i + 1) * P] for i in range(L)}, replicated=True)
        # Each agent may run a progress thread: create the per-layer one only when it is used.
        kx_layers = None
        if "layers" in args.modes.split(","):
            kx_layers = kvxfer.Agent("decode-layers", backend="nixl", **kx_options(args))
            kx_layers.register({f"layer.{i}": layers[i] for i in range(L)}, replicated=True)
        raw = nixl_agent("decode-raw", args.progress_thread, args.num_threads)
        raw.register_memory(np.array([[buf.ptr(rows), NB * R, dev]] + [[buf.ptr(t), NB * P, dev] for t in layers],
                                     dtype=np.uint64), args.memory)
        md = target.metadata
        peer_rows = kx_rows.add_peer(base64.b64decode(md["kvxfer"]))
        if kx_layers is not None:
            kx_layers.add_peer(base64.b64decode(md["kvxfer"]))
        raw_peer = raw.add_remote_agent(base64.b64decode(md["raw"]))
        target.call({"cmd": "add", "kvxfer": [base64.b64encode(a.metadata()).decode()
                                              for a in (kx_rows, kx_layers) if a is not None],
                     "raw": base64.b64encode(raw.get_agent_metadata()).decode()})
        # raw NIXL lists, prepared once, as strided rows (the fastest way to prepare)
        remote_base = kx_rows.peers[peer_rows].spec.allocations[0].address  # type: ignore[union-attr]
        rdev = args.remote_gpu if args.memory == "VRAM" else 0
        kind = args.memory
        t0 = time.perf_counter()
        raw_lrows = raw.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([strided(buf.ptr(rows), R, dev, R, NB)],
                                                                    dtype=np.uint64), kind)
        raw_rrows = raw.prep_xfer_dlist(raw_peer, np.array([strided(remote_base, R, rdev, R, B)], dtype=np.uint64),
                                        kind)
        raw_llayers = raw.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(
            [strided(buf.ptr(t), P, dev, P, NB) for t in layers], dtype=np.uint64), kind)
        raw_rlayers = raw.prep_xfer_dlist(raw_peer, np.array(
            [strided(remote_base + i * P, P, rdev, R, B) for i in range(L)], dtype=np.uint64), kind)
        results["raw_prepare_ms"] = (time.perf_counter() - t0) * 1e3
        lay = np.arange(L, dtype=np.int64)
        idx = {
            "rows": (dst_ids.astype(np.int32), src_ids.astype(np.int32)),
            "layers": ((dst_ids[:, None] + lay[None, :] * NB).reshape(-1).astype(np.int32),
                       (src_ids[:, None] + lay[None, :] * B).reshape(-1).astype(np.int32)),
        }
        handles = {"rows": (raw_lrows, raw_rrows), "layers": (raw_llayers, raw_rlayers)}
        agents: dict[str, Any] = {"rows": kx_rows, "layers": kx_layers}

        def reset() -> None:
            buf.fill(rows, SENTINEL)
            for t in layers:
                buf.fill(t, SENTINEL)

        def verify(mode: str) -> None:
            if mode == "rows":
                rest = np.setdiff1d(np.arange(NB), dst_ids)
                if args.memory == "DRAM":
                    got, untouched = buf.sums(rows[dst_ids]), rows[rest]
                else:
                    as_t = buf.torch.as_tensor
                    got = buf.sums(rows[as_t(dst_ids, device=rows.device)])
                    untouched = rows[as_t(rest, device=rows.device)]
            else:
                if args.memory == "DRAM":
                    stacked = np.concatenate([t[dst_ids] for t in layers], axis=1)
                    rest = np.setdiff1d(np.arange(NB), dst_ids)
                    untouched = np.concatenate([t[rest] for t in layers], axis=1)
                else:
                    ti = buf.torch.as_tensor(dst_ids, device=layers[0].device)
                    stacked = buf.torch.cat([t[ti] for t in layers], dim=1)
                    ri = buf.torch.as_tensor(np.setdiff1d(np.arange(NB), dst_ids), device=layers[0].device)
                    untouched = buf.torch.cat([t[ri] for t in layers], dim=1)
                got = buf.sums(stacked)
            if not np.array_equal(got, src_sums[src_ids]):
                raise AssertionError(f"{mode}: destination rows differ from the source")
            if not buf.all_equal(untouched, SENTINEL):
                raise AssertionError(f"{mode}: blocks outside the request changed")

        def kx_read(mode: str, splits: int) -> Callable[[], None]:
            a = agents[mode]

            def run() -> None:
                if splits == 1:
                    a.read(peer_rows, dst_ids, src_ids).wait(args.timeout)
                else:
                    ts = [a.read(peer_rows, d, s) for d, s in zip(np.array_split(dst_ids, splits),
                                                                   np.array_split(src_ids, splits))]
                    for t in ts:
                        t.wait(args.timeout)
            return run

        def raw_read(mode: str, splits: int, op: str = "READ") -> Callable[[], None]:
            li, ri = idx[mode]
            lh, rh = handles[mode]
            per = len(li) // len(src_ids)
            parts = [(a * per, b * per) for a, b in _bounds(len(src_ids), splits)]

            def run() -> None:
                hs = []
                for a, b in parts:
                    h = raw.make_prepped_xfer(op, lh, li[a:b], rh, ri[a:b], b"")
                    if raw.transfer(h) == "ERR":
                        raise RuntimeError("raw transfer failed")
                    hs.append(h)
                raw_wait(raw, hs, args.timeout, args.raw_wait == "backoff")
            return run

        modes = args.modes.split(",")
        for mode in modes:
            for splits in args.splits:
                for who in ("raw", "kvxfer"):
                    if who == "raw" and args.same_process and not args.raw_same_process:
                        continue
                    fn = raw_read(mode, splits) if who == "raw" else kx_read(mode, splits)
                    reset()
                    times = timed(fn, args.iters)
                    buf.sync()
                    verify(mode)
                    med = statistics.median(times)
                    descs = len(idx[mode][0])
                    rec = {"who": who, "mode": mode, "op": "READ", "splits": splits, "descriptors": descs,
                           "bytes": nbytes, "median_s": med, "best_s": min(times), "gbps": nbytes / med / 1e9,
                           "best_gbps": nbytes / min(times) / 1e9}
                    results["runs"].append(rec)
                    print(f"{who:7s} {mode:6s} READ splits={splits:<2d} {descs:7d} descs  {nbytes / 1e9:6.2f} GB  "
                          f"median {med * 1e3:8.2f} ms  {rec['gbps']:7.1f} GB/s  best {rec['best_gbps']:7.1f}",
                          flush=True)
        if args.write and not args.same_process:
            # WRITE: push our rows into prefill's buffer (raw, then kvxfer), verified by prefill's sums
            rows_src = buf.empty(NB, R, None)
            if args.memory == "VRAM":
                rows.copy_(rows_src)
            else:
                rows[...] = rows_src
            buf.sync()
            want = buf.sums(rows_src)
            for who in ("raw", "kvxfer"):
                wfn: Callable[[], Any] = (raw_read("rows", 1, "WRITE") if who == "raw" else
                                         (lambda: kx_rows.write(peer_rows, dst_ids, src_ids).wait(args.timeout)))
                times = timed(wfn, args.iters)
                got = target.sums()
                if not np.array_equal(got[src_ids], want[dst_ids]):
                    raise AssertionError(f"{who} WRITE: prefill rows differ")
                med = statistics.median(times)
                rec = {"who": who, "mode": "rows", "op": "WRITE", "splits": 1, "descriptors": len(src_ids),
                       "bytes": nbytes, "median_s": med, "best_s": min(times), "gbps": nbytes / med / 1e9,
                       "best_gbps": nbytes / min(times) / 1e9}
                results["runs"].append(rec)
                print(f"{who:7s} rows   WRITE splits=1  {len(src_ids):7d} descs  {nbytes / 1e9:6.2f} GB  median "
                      f"{med * 1e3:8.2f} ms  {rec['gbps']:7.1f} GB/s", flush=True)
        # Per-transfer cost: one whole-row block, many times. "spin" polls without sleeping on
        # both sides (raw check_xfer_state loop vs kvxfer Transfer.done() loop), so the
        # difference is what kvxfer adds (planning, checks, the seam); "wait" uses
        # Transfer.wait(), whose back-off sleeps are the core's policy, not the backend's.
        one_d, one_s = dst_ids[:1], src_ids[:1]
        li1, ri1 = one_d.astype(np.int32), one_s.astype(np.int32)

        def raw_small() -> None:
            h = raw.make_prepped_xfer("READ", raw_lrows, li1, raw_rrows, ri1, b"")
            raw.transfer(h)
            raw_wait(raw, [h], args.timeout, backoff=False)

        def kx_small_spin() -> None:
            t = kx_rows.read(peer_rows, one_d, one_s)
            while not t.done():
                pass

        def kx_small_wait() -> None:
            kx_rows.read(peer_rows, one_d, one_s).wait(args.timeout)

        over: dict[str, Any] = {"bytes": R}
        if not args.same_process or args.raw_same_process:
            over["raw_spin_us"] = statistics.median(timed(raw_small, args.small_iters, warmup=20)) * 1e6
        over["kvxfer_spin_us"] = statistics.median(timed(kx_small_spin, args.small_iters, warmup=20)) * 1e6
        over["kvxfer_wait_us"] = statistics.median(timed(kx_small_wait, args.small_iters, warmup=20)) * 1e6
        # pure CPU cost of posting: plan + checks + make_prepped_xfer + transfer, no waiting
        posts = []
        for _ in range(args.small_iters):
            t0 = time.perf_counter()
            t = kx_rows.read(peer_rows, one_d, one_s)
            posts.append(time.perf_counter() - t0)
            t.wait(args.timeout)
        rposts = []
        for _ in range(args.small_iters if "raw_spin_us" in over else 0):
            t0 = time.perf_counter()
            h = raw.make_prepped_xfer("READ", raw_lrows, li1, raw_rrows, ri1, b"")
            raw.transfer(h)
            rposts.append(time.perf_counter() - t0)
            raw_wait(raw, [h], args.timeout, backoff=False)
        over["kvxfer_post_us"] = statistics.median(posts) * 1e6
        if rposts:
            over["raw_post_us"] = statistics.median(rposts) * 1e6
        if "raw_spin_us" in over:
            over["added_us"] = over["kvxfer_spin_us"] - over["raw_spin_us"]
        # Where the added time goes: the core's planner alone, and the NIXL seam alone
        # (post + poll + release on the agent's own prepared lists; private attribute: a
        # benchmark may look inside).
        over["plan_only_us"] = statistics.median(
            timed(lambda: kx_rows.plan(peer_rows, one_d, one_s), args.small_iters, warmup=20)) * 1e6
        be = kx_rows.backend
        lp = next(iter(kx_rows._local_prepared.values()))
        rp = next(iter(kx_rows.peers[peer_rows].prepared.values()))

        def seam() -> None:
            x = be.post(kvxfer.Op.READ, lp, li1, rp, ri1, None)
            while not be.poll(x):
                pass
            be.release(x)

        over["seam_spin_us"] = statistics.median(timed(seam, args.small_iters, warmup=20)) * 1e6
        results["overhead"] = over
        summary = ", ".join(f"{k} {v:.1f}" for k, v in over.items() if k != "bytes")
        print(f"one block ({R} B): {summary}", flush=True)
        # device ceiling: a torch copy of the same number of bytes between the same devices
        if args.memory == "VRAM":
            torch = buf.torch
            a = torch.empty(len(src_ids), R, dtype=torch.uint8, device=f"cuda:{args.remote_gpu}")
            b = torch.empty(len(src_ids), R, dtype=torch.uint8, device=f"cuda:{args.local_gpu}")

            def ceil() -> None:
                b.copy_(a, non_blocking=True)
                torch.cuda.synchronize(args.local_gpu)
                torch.cuda.synchronize(args.remote_gpu)

            tc = timed(ceil, args.iters)
            results["ceiling"] = {"median_s": statistics.median(tc), "gbps": nbytes / statistics.median(tc) / 1e9}
            print(f"torch copy cuda:{args.remote_gpu} -> cuda:{args.local_gpu}: "
                  f"{results['ceiling']['gbps']:.1f} GB/s", flush=True)
            del a, b
        if kx_layers is not None:
            kx_layers.close()
        kx_rows.close()
    finally:
        target.close()
    return results


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
                    help="kvxfer same-process device copies (only matter with --same-process)")
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
