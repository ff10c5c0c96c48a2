"""The few-blocks fast path of the planner gives exactly the general path's plan.

``plan`` builds the index arrays of a request of at most ``FEW_BLOCKS`` ints straight from
the ints (no numpy round trips). Checked against the general path (numpy arrays in, the same
pairing) on every cache-shape pair, and the bytes it moves against numpy indexing.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer import Agent, Op
from kvxfer.errors import BlockIdOutOfRangeError, DuplicateBlockIdError
from kvxfer.planner import FEW_BLOCKS, _few_legs, plan
from kvxfer.testing import expected_after, make_cache

GEOM = {"num_layers": 3, "page": 128}


@pytest.mark.parametrize("src_kind,dst_kind", [("packed", "packed"), ("packed", "layers"), ("layers", "layers")])
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_few_blocks_plan_equals_the_general_plan(src_kind: str, dst_kind: str, op: Op) -> None:
    src = make_cache(src_kind, num_blocks=20, pad=16 if src_kind == "packed" else 0, seed=3, **GEOM)
    dst = make_cache(dst_kind, num_blocks=24, pad=48 if dst_kind == "packed" else 0, **GEOM)
    with Agent("p", backend="loopback", coalesce=False) as a, Agent("d", backend="loopback", coalesce=False) as b:
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        peer = b.add_peer(a.metadata())
        pairing = b.check(peer)
        rng = np.random.default_rng(11)
        hits = 0
        for n in list(range(1, FEW_BLOCKS + 1)) + [FEW_BLOCKS + 1]:
            local = [int(v) for v in rng.permutation(24)[:n]]
            remote = [int(v) for v in rng.permutation(20)[:n]]
            fast = plan(b.spec, b.peers[peer].spec, local, remote, op, pairing=pairing)
            slow = plan(b.spec, b.peers[peer].spec, np.array(local), np.array(remote), op, pairing=pairing)
            few = _few_legs(pairing.groups, local, remote, 24, 20, op)
            hits += few is not None
            assert (fast.descriptors, fast.nbytes, fast.mode) == (slow.descriptors, slow.nbytes, slow.mode)
            for f, s in zip(fast.legs, slow.legs, strict=True):
                np.testing.assert_array_equal(f.local_idx, s.local_idx)
                np.testing.assert_array_equal(f.remote_idx, s.remote_idx)
                assert f.local_idx.dtype == s.local_idx.dtype and f.lengths.tolist() == s.lengths.tolist()
        whole = src_kind == dst_kind == "packed"
        assert hits == (FEW_BLOCKS if whole else 0)  # split rows (several pieces a block) take the general path


def test_few_blocks_move_the_right_bytes_and_refuse_as_before() -> None:
    src = make_cache("packed", num_blocks=20, pad=16, seed=5, **GEOM)
    dst = make_cache("packed", num_blocks=24, pad=48, **GEOM)
    with Agent("p", backend="loopback", coalesce=False) as a, Agent("d", backend="loopback", coalesce=False) as b:
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        peer = b.add_peer(a.metadata())
        before, pages = dst.layer_pages(), src.layer_pages()
        b.read(peer, [3, 0, 23], [19, 4, 4]).wait(5)
        np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, pages, [3, 0, 23], [19, 4, 4]))
        with pytest.raises(BlockIdOutOfRangeError, match="remote block id 20"):
            b.read(peer, [1], [20])
        with pytest.raises(BlockIdOutOfRangeError, match="local block id -1"):
            b.read(peer, [-1], [2])
        with pytest.raises(DuplicateBlockIdError, match="local block id 5"):
            b.read(peer, [5, 5], [1, 2])
