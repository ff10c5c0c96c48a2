"""The fixed cost of one small READ: raw NIXL beside kvxfer, one process, in one test.

Both pairs move one 4 KiB block between two agents of this process over NIXL (UCX), on the
same memory: ``raw`` is ``make_prepped_xfer`` + ``transfer`` + polling (lists prepared once),
``kvxfer`` is ``Agent.read`` + ``wait``. The difference is kvxfer's per-transfer Python work
(benchmarks/bench_fixed_cost.py measures it across two processes). Bytes are checked after.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

import kvxfer

BLOCK, NB = 4096, 8

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Any]]:
    import kvxfer_nixl.backend  # noqa: F401  (quiets NIXL's logging the same way)
    from nixl._api import nixl_agent, nixl_agent_config

    src = np.arange(NB * BLOCK, dtype=np.uint32).astype(np.uint8).reshape(NB, BLOCK)
    dst = np.full((NB, BLOCK), 0xAA, np.uint8)
    a, b = kvxfer.Agent("fc-src", backend="nixl"), kvxfer.Agent("fc-dst", backend="nixl")
    a.register({"kv": src})
    b.register({"kv": dst})
    b.add_peer(a.metadata())
    cfg = nixl_agent_config(backends=["UCX"])
    ra, rb = nixl_agent("fc-raw-src", cfg), nixl_agent("fc-raw-dst", cfg)
    regs = [ag.register_memory(np.array([[arr.ctypes.data, arr.nbytes, 0]], np.uint64), "DRAM")
            for ag, arr in ((ra, src), (rb, dst))]
    peer = rb.add_remote_agent(ra.get_agent_metadata())
    rows = lambda arr: np.array([[arr.ctypes.data + i * BLOCK, BLOCK, 0] for i in range(NB)], np.uint64)  # noqa: E731
    local = rb.prep_xfer_dlist("NIXL_INIT_AGENT", rows(dst), "DRAM")
    remote = rb.prep_xfer_dlist(peer, rows(src), "DRAM")
    try:
        yield {"src": src, "dst": dst, "kv": b, "peer": "fc-src", "raw": rb, "local": local, "remote": remote}
    finally:
        rb.release_dlist_handle(local)
        rb.release_dlist_handle(remote)
        rb.remove_remote_agent(peer)
        ra.deregister_memory(regs[0])
        rb.deregister_memory(regs[1])
        b.close()
        a.close()


@pytest.mark.parametrize("who", ["raw", "kvxfer"])
def test_fixed_cost_4kb_read(benchmark, pair: dict[str, Any], who: str) -> None:
    benchmark.group = "fixed cost, one 4 KiB READ"
    dst, src = pair["dst"], pair["src"]
    dst[...] = 0xAA
    li, ri = np.array([3], np.int32), np.array([5], np.int32)
    if who == "raw":
        raw, local, remote = pair["raw"], pair["local"], pair["remote"]

        def run() -> None:
            h = raw.make_prepped_xfer("READ", local, li, remote, ri, b"")
            state = raw.transfer(h)
            while state not in ("DONE", "ERR"):
                state = raw.check_xfer_state(h)
            raw.release_xfer_handle(h)
            assert state == "DONE"
    else:
        kv, peer = pair["kv"], pair["peer"]

        def run() -> None:
            kv.read(peer, [3], [5]).wait()
    benchmark(run)
    assert np.array_equal(dst[3], src[5])
    rest = np.delete(np.arange(NB), 3)
    assert (dst[rest] == 0xAA).all()
