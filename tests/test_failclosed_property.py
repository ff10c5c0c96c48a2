"""Every pairing of engine-shaped caches either moves the right values or is refused.

Random engine layouts (FlashAttention, FlashInfer, cross-layer, separate K/V, MLA), element
types, NHD/HND page orders, tensor-parallel sizes and ranks, block sizes. The verdict comes
from :func:`engine_pairs.verdict`; the expected destination from numpy indexing over the
logical ``[block, layer, kv, token, head, dim]`` arrays. Real bytes move through the
loopback backend; the NIXL two-process subset lives in test_failclosed_nixl.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from engine_pairs import block_ids, engine_pairs, verdict
from kvxfer import Agent
from kvxfer.errors import LayoutMismatchError
from kvxfer._harness.engines import EngineCache, build

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.ascontiguousarray(a).view(np.uint8).tobytes() == \
        np.ascontiguousarray(b).view(np.uint8).tobytes()


def _gqa(style: str, order: str, tp: int, rank: int, *, dtype: str = "float16", heads: int = 8,
         tokens: int = 4) -> EngineCache:
    return EngineCache(style, order, dtype, 2, 6, tokens, heads, 4, tp, rank)


@PROPS
@given(pair=engine_pairs(), data=st.data(), write=st.booleans(), seed=st.integers(0, 2**32 - 1))
# The cases, always run: another TP size and rank, HND against NHD, fp16 against int16.
@example(pair=(_gqa("flash", "NHD", 2, 0), _gqa("flash", "NHD", 4, 2)), data=None, write=False, seed=1)
@example(pair=(_gqa("cross", "HND", 2, 1), _gqa("flash", "NHD", 2, 1)), data=None, write=False, seed=2)
@example(pair=(_gqa("kv_tuple", "NHD", 1, 0), _gqa("flashinfer", "NHD", 1, 0, dtype="int16")), data=None,
         write=True, seed=3)
@example(pair=(_gqa("flash", "HND", 4, 1, heads=2), _gqa("cross", "HND", 2, 0, heads=2)), data=None, write=False,
         seed=4)
def test_pairing_moves_right_or_is_refused(pair: tuple[EngineCache, EngineCache], data: st.DataObject | None,
                                           write: bool, seed: int) -> None:
    dec, pre = pair  # decode pulls from (or prefill pushes into) decode's cache
    if data is not None:
        dst_ids, src_ids = data.draw(block_ids(dec.blocks, pre.blocks))
    else:
        dst_ids, src_ids = np.array([0, 3, 1]), np.array([2, 2, 5])
    src, dst = build(pre, seed=seed), build(dec)
    src_before, dst_before = src.logical(), dst.logical()
    raw_before = dst.raw()
    expected_error = verdict(dec, pre)
    event(f"refused: {expected_error.__name__}" if expected_error else "moved")
    with Agent("prefill") as p, Agent("decode") as d:
        p.register(src.views, **pre.register_options())
        d.register(dst.views, **dec.register_options())
        if expected_error is not None:
            with pytest.raises(expected_error) as info:
                d.add_peer(p.metadata())
            assert isinstance(info.value, LayoutMismatchError) and info.value.diff
            with pytest.raises(expected_error):
                p.add_peer(d.metadata())
            assert [r.tobytes() for r in dst.raw()] == [r.tobytes() for r in raw_before], "bytes moved"
            return
        if write:
            peer = p.add_peer(d.metadata())
            p.write(peer, src_ids, dst_ids).wait(10)
        else:
            peer = d.add_peer(p.metadata())
            d.read(peer, dst_ids, src_ids).wait(10)
    want = dst_before.copy()
    want[dst_ids] = src_before[src_ids]
    got = dst.logical()
    assert same_bytes(got, want), "destination differs from numpy indexing over the logical arrays"
    assert same_bytes(src.logical(), src_before), "the source changed"
    # Bytes outside every page (none in these layouts) and blocks not named keep the sentinel.
    untouched = np.setdiff1d(np.arange(dec.blocks), dst_ids)
    assert same_bytes(got[untouched], dst_before[untouched])
