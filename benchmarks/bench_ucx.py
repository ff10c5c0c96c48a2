"""UCX backend vs NIXL vs raw ucxx: one DRAM READ request, two processes, same bytes.

The decode side (initiator) pulls ``--rows`` rows of ``--row-bytes`` from the prefill side
(target) in one request, ``--iters`` times; the first iteration is a warm-up and is not
counted. Every mode verifies the bytes it received against the target's pattern once.

Modes (each runs in fresh processes, so nixl's bundled UCX and the libucx wheel never share
an address space). Seam level (the backend object, one descriptor per row):

``ucx``        kvxfer_ucx.backend.UcxBackend, default options: the same-host copy path
``ucx-rma``    UcxBackend(same_host_copy=False): UCX RMA over the default (same-host) transports
``ucx-tcp``    UcxBackend(same_host_copy=False, trusted_network=True, tls="self,tcp"): UCX RMA
               over TCP, the path between hosts
``nixl-raw``   raw nixl (UCX backend, no progress thread, prepped lists + numpy indices)
``ucxx``       raw ucxx, two-sided: one tag message asks for the rows, the target answers with
               one tag send per row into pre-posted receives

Agent level (``kvxfer.Agent(...).read(peer, blocks, blocks).wait()``: planner, bounds checks
and the seam included; the rows are registered as a packed cache of 73,728-byte layer pages):
``agent-ucx``, ``agent-ucx-rma``, ``agent-ucx-tcp`` (the same options) and ``agent-nixl``.

``--set NAME=JSON`` adds or redefines a mode's backend options (a name starting with
``agent-`` is agent level), so that one script measures two trees: run it with
``PYTHONPATH`` pointing at the other tree and options that tree understands.

    python benchmarks/bench_ucx.py                                   # every mode
    python benchmarks/bench_ucx.py --modes ucx,agent-ucx --rows 200 --iters 5
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

from kvxfer.testing import lines

ROW_BYTES = 4_718_592  # 4.5 MiB: one packed MLA row of a 61-layer model
PAGE = 73_728  # one MLA layer page: 64 tokens x 576 bf16 channels
TCP = {"same_host_copy": False, "trusted_network": True, "tls": "self,tcp"}
UCX_OPTIONS: dict[str, dict[str, Any]] = {
    "ucx": {},
    "ucx-rma": {"same_host_copy": False},
    "ucx-tcp": TCP,
}
AGENT_MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "agent-ucx": ("ucx", {}),
    "agent-ucx-rma": ("ucx", {"same_host_copy": False}),
    "agent-ucx-tcp": ("ucx", TCP),
    "agent-nixl": ("nixl", {}),
}


def _define(spec: str) -> None:
    """``NAME=JSON``: backend options for a (new or redefined) mode."""
    name, _, options = spec.partition("=")
    opts = json.loads(options)
    if name.startswith("agent-"):
        AGENT_MODES[name] = ("ucx", opts)
    else:
        UCX_OPTIONS[name] = opts


def _agent_cache(buf: np.ndarray, rows: int, row_bytes: int) -> dict[str, np.ndarray]:
    """The rows as a packed cache: ``row_bytes // PAGE`` layer views of ``(rows, PAGE)``."""
    if row_bytes % PAGE:
        raise SystemExit(f"agent modes need --row-bytes to be a multiple of {PAGE}")
    r = buf.reshape(rows, row_bytes)
    return {f"layer.{i}": r[:, i * PAGE:(i + 1) * PAGE] for i in range(row_bytes // PAGE)}


def pattern(nbytes: int) -> np.ndarray:
    # A cheap, position-dependent pattern (uint64 counter) so misplaced rows are caught.
    return np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)


def _out() -> Any:
    """Command channel on a private stdout copy; fd 1 goes to stderr (UCX may print on it)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


#: How long the target waits for a command before it progresses its worker again.
POLL_S = 0.0002
#: A hang guard on each reply from the target, not a speed claim.
REPLY_S = 120.0


def _until_exit(out: Any, idle: Callable[[], None], handle: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Answer commands (kvxfer.testing.lines) until ``exit``, progressing with ``idle`` between them."""

    def refuse(msg: dict[str, Any]) -> dict[str, Any]:
        raise ValueError(f"unknown command {msg['cmd']!r}")

    lines.serve(handle or refuse, idle, out=out, poll_s=POLL_S)


# ---------------------------------------------------------------------------------------------
# target side

def serve(mode: str, rows: int, row_bytes: int) -> None:
    out = _out()
    buf = pattern(rows * row_bytes)
    addr = buf.ctypes.data
    if mode in AGENT_MODES:
        import kvxfer

        backend, opts = AGENT_MODES[mode]
        agent = kvxfer.Agent("target", backend=backend, **opts)
        agent.register(_agent_cache(buf, rows, row_bytes), replicated=True)
        lines.say(out, {"meta": base64.b64encode(agent.metadata()).decode(), "addr": addr})
        _until_exit(out, agent.progress)
        agent.close()
    elif mode in UCX_OPTIONS:
        from kvxfer import Allocation
        from kvxfer_ucx.backend import UcxBackend

        be = UcxBackend("target", **UCX_OPTIONS[mode])
        be.register([Allocation(addr, buf.nbytes)])
        lines.say(out, {"meta": base64.b64encode(be.local_metadata()).decode(), "addr": addr})
        _until_exit(out, be.progress)
        be.close()
    elif mode == "nixl-raw":
        agent = _nixl_agent("target")
        agent.register_memory([(addr, buf.nbytes, 0, "")], "DRAM")
        lines.say(out, {"meta": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": addr})
        _until_exit(out, lambda: agent.get_new_notifs())
    elif mode == "ucxx":
        import ucxx._lib.libucxx as u
        from ucxx._lib.arr import Array

        ctx = u.UCXContext(feature_flags=(u.Feature.TAG,))
        worker = u.UCXWorker(ctx)
        lines.say(out, {"meta": base64.b64encode(bytes(worker.address.tobytes())).decode(), "addr": addr})
        req_buf = np.zeros(2, dtype=np.int64)
        views = [Array(buf[i * row_bytes:(i + 1) * row_bytes]) for i in range(rows)]
        eps: list[Any] = []

        def handle(msg: dict[str, Any]) -> dict[str, Any]:
            if msg["cmd"] == "connect":
                peer = u.UCXAddress.create_from_buffer(base64.b64decode(msg["addr"]))
                eps[:] = [u.UCXEndpoint.create_from_worker_address(worker, peer, endpoint_error_handling=False)]
                return {"ok": True}
            if msg["cmd"] == "serve":  # serve one request: wait for it, answer, report
                (ep,) = eps
                recv = ep.tag_recv(Array(req_buf), tag=u.UCXXTag(0), tag_mask=u.UCXXTagMaskFull)
                while not recv.completed:
                    worker.progress()
                recv.check_error()
                first, count = int(req_buf[0]), int(req_buf[1])
                pending = [ep.tag_send(views[first + i], tag=u.UCXXTag(1 + i)) for i in range(count)]
                while not all(r.completed for r in pending):
                    worker.progress()
                for r in pending:
                    r.check_error()
                return {"ok": True}
            raise ValueError(f"unknown command {msg['cmd']!r}")

        _until_exit(out, worker.progress, handle)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


def _nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    # No progress thread: its busy spin competes with the copy for the cores.
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


# ---------------------------------------------------------------------------------------------
# initiator side

def initiate(mode: str, rows: int, row_bytes: int, iters: int, sets: list[str]) -> dict[str, Any]:
    child = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--rows", str(rows),
                              "--row-bytes", str(row_bytes), *[f"--set={x}" for x in sets]], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    ch = lines.Channel(child)

    def cmd(obj: dict[str, Any], reply: bool = True) -> dict[str, Any]:
        ch.send(obj)
        return ch.read(REPLY_S) if reply else {}

    hello = ch.read(REPLY_S)
    blob, raddr = base64.b64decode(hello["meta"]), int(hello["addr"])
    buf = np.full(rows * row_bytes, 0xAA, dtype=np.uint8)
    laddr = buf.ctypes.data
    idx = np.arange(rows, dtype=np.int64)
    offs = idx.astype(np.uint64) * np.uint64(row_bytes)
    times: list[float] = []
    cpu: list[float] = []  # this process's CPU seconds per iteration: steadier than wall time on a busy host
    post_times: list[float] = []
    path = ""
    try:
        if mode in AGENT_MODES:
            import kvxfer

            backend, opts = AGENT_MODES[mode]
            agent = kvxfer.Agent("initiator", backend=backend, **opts)
            agent.register(_agent_cache(buf, rows, row_bytes), replicated=True)
            name = agent.add_peer(blob)
            if backend == "ucx":
                path = agent.backend.peer_path(name)[0]  # type: ignore[attr-defined]
            blocks = np.arange(rows, dtype=np.int64)
            for _ in range(iters):
                c0, t0 = time.process_time(), time.perf_counter()
                t = agent.read(name, blocks, blocks)
                t1 = time.perf_counter()
                t.wait(120)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                post_times.append(t1 - t0)
            agent.close()
        elif mode in UCX_OPTIONS:
            from kvxfer import Allocation, DescriptorList, Op
            from kvxfer_ucx.backend import UcxBackend

            be = UcxBackend("initiator", **UCX_OPTIONS[mode])
            be.register([Allocation(laddr, buf.nbytes)])
            be.add_remote("target", blob)
            z, n = np.zeros(rows, np.uint64), np.full(rows, row_bytes, np.uint64)
            lp = be.prepare(None, DescriptorList(np.stack([laddr + offs, n, z], 1)))
            rp = be.prepare("target", DescriptorList(np.stack([raddr + offs, n, z], 1)))
            path = be.peer_path("target")[0]
            for _ in range(iters):
                c0, t0 = time.process_time(), time.perf_counter()
                x = be.post(Op.READ, lp, idx, rp, idx, None)
                t1 = time.perf_counter()
                while not be.poll(x):
                    pass
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                post_times.append(t1 - t0)
                be.release(x)
            be.close()
        elif mode == "nixl-raw":
            agent = _nixl_agent("initiator")
            agent.register_memory([(laddr, buf.nbytes, 0, "")], "DRAM")
            peer = agent.add_remote_agent(blob)
            peer = peer.decode() if isinstance(peer, bytes) else peer
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(laddr + int(o), row_bytes, 0) for o in offs], "DRAM")
            remote = agent.prep_xfer_dlist(peer, [(raddr + int(o), row_bytes, 0) for o in offs], "DRAM")
            i32 = idx.astype(np.int32)
            for _ in range(iters):
                c0, t0 = time.process_time(), time.perf_counter()
                h = agent.make_prepped_xfer("READ", local, i32, remote, i32)
                state = agent.transfer(h)
                t1 = time.perf_counter()
                while state != "DONE":
                    state = agent.check_xfer_state(h)
                    if state == "ERR":
                        raise RuntimeError("nixl transfer failed")
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                post_times.append(t1 - t0)
                agent.release_xfer_handle(h)
        elif mode == "ucxx":
            import ucxx._lib.libucxx as u
            from ucxx._lib.arr import Array

            ctx = u.UCXContext(feature_flags=(u.Feature.TAG,))
            worker = u.UCXWorker(ctx)
            ep = u.UCXEndpoint.create_from_worker_address(worker, u.UCXAddress.create_from_buffer(blob),
                                                          endpoint_error_handling=False)
            cmd({"cmd": "connect", "addr": base64.b64encode(bytes(worker.address.tobytes())).decode()})
            views = [Array(buf[i * row_bytes:(i + 1) * row_bytes]) for i in range(rows)]
            ask = np.array([0, rows], dtype=np.int64)
            for _ in range(iters):
                cmd({"cmd": "serve"}, reply=False)
                c0, t0 = time.process_time(), time.perf_counter()
                recvs = [ep.tag_recv(views[i], tag=u.UCXXTag(1 + i), tag_mask=u.UCXXTagMaskFull)
                         for i in range(rows)]
                s = ep.tag_send(Array(ask), tag=u.UCXXTag(0))
                t1 = time.perf_counter()
                while not (s.completed and all(r.completed for r in recvs)):
                    worker.progress()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                post_times.append(t1 - t0)
                for r in recvs:
                    r.check_error()
                ch.read(REPLY_S)
        ok = bool(np.array_equal(buf, pattern(buf.nbytes)))
    finally:
        try:
            cmd({"cmd": "exit"}, reply=False)
            child.wait(timeout=30)
        except Exception:
            child.kill()
    counted = times[1:] if len(times) > 1 else times
    med = statistics.median(counted)
    return {"mode": mode, "path": path, "rows": rows, "row_bytes": row_bytes, "bytes": rows * row_bytes, "ok": ok,
            "median_s": med, "gbps": rows * row_bytes / med / 1e9, "best_gbps": rows * row_bytes / min(counted) / 1e9,
            "post_ms": 1e3 * statistics.median(post_times[1:] or post_times), "iters": len(counted),
            "cpu_ms": 1e3 * statistics.median(cpu[1:] or cpu),
            "samples_gbps": [round(rows * row_bytes / t / 1e9, 3) for t in counted]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="ucx,ucx-rma,ucx-tcp,nixl-raw,ucxx,agent-ucx,agent-ucx-rma,agent-ucx-tcp,agent-nixl")
    ap.add_argument("--set", action="append", default=[], help="NAME=JSON backend options of a mode")
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--row-bytes", type=int, default=ROW_BYTES)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--serve")
    ap.add_argument("--initiate")
    ap.add_argument("--json", action="store_true", help="print one JSON object per mode")
    a = ap.parse_args()
    for spec in a.set:
        _define(spec)
    if a.serve:
        return serve(a.serve, a.rows, a.row_bytes)
    if a.initiate:
        out = _out()
        lines.say(out, initiate(a.initiate, a.rows, a.row_bytes, a.iters, a.set))
        return
    results = []
    for mode in a.modes.split(","):
        p = subprocess.run([sys.executable, __file__, "--initiate", mode, "--rows", str(a.rows), "--row-bytes",
                            str(a.row_bytes), "--iters", str(a.iters), *[f"--set={x}" for x in a.set]],
                           capture_output=True, text=True, timeout=600)
        docs = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode or not docs:
            results.append({"mode": mode, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]})
        else:
            results.append(json.loads(docs[-1]))
        print(json.dumps(results[-1]) if a.json else _row(results[-1]), flush=True)
    ref = next((r for r in results if r["mode"] == "agent-nixl" and "gbps" in r), None)
    raw = next((r for r in results if r["mode"] == "nixl-raw" and "gbps" in r), None)
    if (ref or raw) and not a.json:
        for r in results:
            if "gbps" in r:
                vs = [f"{r['gbps'] / x['gbps']:.2f}x {x['mode']}" for x in (ref, raw) if x]
                print(f"{r['mode']:>14}: {', '.join(vs)}")


def _row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['mode']:>14}  FAILED: {r['error']}"
    return (f"{r['mode']:>14}  {r['path'] or '-':>14}  {r['rows']} x {r['row_bytes'] / 2**20:.1f} MiB  median {r['gbps']:.2f} GB/s  "
            f"best {r['best_gbps']:.2f} GB/s  post {r['post_ms']:.2f} ms  CPU {r['cpu_ms']:.0f} ms  bytes ok={r['ok']}")


if __name__ == "__main__":
    main()
