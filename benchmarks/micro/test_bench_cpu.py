"""Micro-benchmarks of kvxfer's CPU work: planning, row digests, slab I/O, metadata encode/decode.

Each body also checks what it computed (bytes against numpy indexing, digests against an
independent xxhash of the logical row), so the quick run (``--benchmark-disable``) is a test.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from kvxfer.integrity import Digests, compute
from kvxfer.memory import Op
from kvxfer.metadata import AgentMetadata
from kvxfer.planner import plan

from _caches import caches, sentinel_like, spec

xxhash = pytest.importorskip("xxhash")
BLOCKS = 16  # 10 MiB of 640 KiB rows


@pytest.mark.parametrize("layout", ["rows", "layers"])
def test_plan(benchmark, layout: str) -> None:
    """Planning 16 shuffled blocks: one descriptor per row, or one per page (2,560)."""
    benchmark.group = "plan"
    packed, per, _ = caches(BLOCKS)
    local = spec(packed if layout == "rows" else per)
    remote = spec(packed)
    lb, rb = np.random.default_rng(1).permutation(BLOCKS), np.arange(BLOCKS)
    p = benchmark(plan, local, remote, lb, rb, Op.READ)
    assert p.nbytes == BLOCKS * remote.row_bytes


@pytest.mark.parametrize("layout", ["rows", "layers"])
def test_row_digests(benchmark, layout: str) -> None:
    """xxh3 row digests of 16 blocks: in place (packed rows) or pages gathered (per layer)."""
    benchmark.group = "row digests"
    packed, per, arrays = caches(BLOCKS)
    blocks = np.arange(BLOCKS)[::-1].copy()
    d = benchmark(compute, spec(packed if layout == "rows" else per), blocks, algorithm="xxh3", rows=True)
    assert d.values[:, 0].tolist() == [xxhash.xxh3_64_intdigest(arrays[0][b].tobytes()) for b in blocks.tolist()]


@pytest.mark.parametrize("op", ["offload", "restore"])
def test_slab_io(benchmark, tmp_path, op: str) -> None:
    """The store's own path (pwritev/preadv), digests on: 16 rows of 640 KiB."""
    benchmark.group = "slab io"
    packed, _, arrays = caches(BLOCKS)
    src = spec(packed)
    dst_arrays = sentinel_like(arrays[:1])
    dst = spec({k: (dst_arrays[0][:, l, 0], dst_arrays[0][:, l, 1]) for l, k in enumerate(packed)})
    keys = [b"%d" % i for i in range(BLOCKS)]
    lb = np.random.default_rng(2).permutation(BLOCKS)
    with kvxfer.Store(tmp_path / "s", capacity=BLOCKS * src.row_bytes, layout=src) as st:
        st.offload(src, lb, keys).wait()
        if op == "offload":
            benchmark(lambda: (st.discard(keys), st.offload(src, lb, keys).wait()))
        else:
            benchmark(lambda: st.restore(keys, dst, lb).wait())
            assert np.array_equal(dst_arrays[0].view(np.uint16), arrays[0].view(np.uint16))
        assert st.lookup(keys).all()


def test_metadata_encode_decode(benchmark) -> None:
    """An agent's metadata (its 160-member spec) encoded and decoded, as add_peer does."""
    benchmark.group = "metadata"
    _, per, _ = caches(2)
    with kvxfer.Agent("bench-md") as a:
        a.register(spec(per))
        raw = a.metadata()
    back = benchmark(lambda: AgentMetadata.decode(AgentMetadata.decode(raw).encode()))
    assert back.encode() == AgentMetadata.decode(raw).encode()


def test_digests_wire(benchmark) -> None:
    """Row digests of 16 blocks to their wire text and back (what request parameters carry)."""
    benchmark.group = "metadata"
    packed, _, _ = caches(BLOCKS)
    d = compute(spec(packed), np.arange(BLOCKS), rows=True)
    assert benchmark(lambda: Digests.from_text(d.to_text())) == d
