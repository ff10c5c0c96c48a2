"""Discovery and resharding fail closed: no verdict depends on listing order, nothing untyped escapes.

Transfers move real bytes through the loopback backend: the source holds a pattern, the
destination the 0xAA sentinel, and the result is compared with numpy indexing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer.errors import BlockTokensMismatchError, KvxferError, LayoutMismatchError, MetadataError, SpecError

SENT = 0xAA
LB, RB = np.array([3, 0]), np.array([1, 2])


def _filled(shape: tuple[int, ...], dtype: Any, seed: int | None) -> np.ndarray:
    a = np.empty(shape, dtype=dtype)
    if seed is None:
        a.view(np.uint8)[...] = SENT
    else:
        a.view(np.uint8)[...] = np.random.default_rng(seed).integers(0, 256, size=a.nbytes, dtype=np.uint8
                                                                     ).reshape(a.view(np.uint8).shape)
    return a


# -- 3. block_tokens does not depend on listing order ---------------------------------------
def _groups(seed: int | None, order: list[str]) -> dict[str, np.ndarray]:
    """DeepSeek-style groups of one byte size per block but different token extents."""
    shapes = {"g0": (4, 16, 36), "g1": (4, 8, 72)}
    return {n: _filled(shapes[n], np.int16, None if seed is None else seed + i) for i, n in enumerate(order)}


@pytest.mark.parametrize("order", [["g0", "g1"], ["g1", "g0"]])
def test_mixed_token_extents_are_refused_at_register_in_any_order(order: list[str]) -> None:
    with kvxfer.Agent("a") as a:
        with pytest.raises(SpecError, match=r"(?s)8 tokens: g1.*16 tokens: g0.*block_tokens="):
            a.register(_groups(None, order), replicated=True)
        assert a.spec is None, "a refused register leaves nothing registered"


@pytest.mark.parametrize("src,dst", [(["g0", "g1"], ["g1", "g0"]), (["g1", "g0"], ["g0", "g1"]),
                                     (["g0", "g1"], ["g0", "g1"])])
def test_mixed_token_extents_pair_in_any_order_with_block_tokens(src: list[str], dst: list[str]) -> None:
    pre, dec = _groups(7, src), _groups(None, dst)
    with kvxfer.Agent("p") as pa, kvxfer.Agent("d") as da:
        pa.register(pre, replicated=True, block_tokens=16)
        da.register(dec, replicated=True, block_tokens=16)
        da.add_peer(pa.metadata())
        da.read("p", LB, RB).wait(10)
        for n in ("g0", "g1"):
            assert (dec[n][LB] == pre[n][RB]).all()
            rest = np.setdiff1d(np.arange(4), LB)
            assert (dec[n][rest].view(np.uint8) == SENT).all()


def test_control_different_block_tokens_are_still_refused_at_add_peer() -> None:
    with kvxfer.Agent("p") as pa, kvxfer.Agent("d") as da:
        pa.register(_groups(1, ["g0", "g1"]), replicated=True, block_tokens=8)
        da.register(_groups(None, ["g0", "g1"]), replicated=True, block_tokens=16)
        with pytest.raises(BlockTokensMismatchError):
            da.add_peer(pa.metadata())


# -- 4. hybrid attention + Mamba through add_source ----------------------------------------
def _hybrid(nb: int, tokens: int, seed: int | None, *, heads: int = 2, dim: int = 4,
            conv: tuple[int, int] = (8, 3), ssm: tuple[int, int, int] = (2, 4, 5), order: str = "NHD",
            state_dtype: Any = np.float32) -> dict[str, Any]:
    att = (nb, tokens, heads, dim) if order == "NHD" else (nb, heads, tokens, dim)

    def kv(i: int) -> np.ndarray:
        a = _filled(att, np.int16, None if seed is None else seed + i)
        return a if order == "NHD" else a.transpose(0, 2, 1, 3)

    return {"layers.0": (kv(0), kv(1)),
            "layers.1": (_filled((nb, *conv), state_dtype, None if seed is None else seed + 2),
                         _filled((nb, *ssm), state_dtype, None if seed is None else seed + 3))}


def test_hybrid_peer_with_half_size_blocks_is_refused_naming_the_state_member() -> None:
    with kvxfer.Agent("p") as pa, kvxfer.Agent("d") as da:
        pa.register(_hybrid(8, 16, 1))
        da.register(_hybrid(4, 32, None))
        with pytest.raises(BlockTokensMismatchError, match=r"layers\.1\.conv.*no token axis") as err:
            da.add_source(pa.metadata())
        assert not isinstance(err.value, MetadataError), "a pairing refusal, not the backend's fault"
        assert not da.peers


def test_control_hybrid_peer_with_the_same_blocks_moves_every_member() -> None:
    pre, dec = _hybrid(4, 16, 1), _hybrid(4, 16, None)
    with kvxfer.Agent("p") as pa, kvxfer.Agent("d") as da:
        pa.register(pre)
        da.register(dec)
        da.add_source(pa.metadata())
        da.read("p", LB, RB).wait(10)
        rest = np.setdiff1d(np.arange(4), LB)
        for n in ("layers.0", "layers.1"):
            for got, want in zip(dec[n], pre[n]):
                assert (np.ascontiguousarray(got[LB]).view(np.uint8) == np.ascontiguousarray(want[RB]).view(np.uint8)
                        ).all()  # bytewise: random bytes include NaNs
                assert (np.ascontiguousarray(got[rest]).view(np.uint8) == SENT).all()


def test_control_attention_only_half_size_blocks_still_pair() -> None:
    with kvxfer.Agent("p") as pa, kvxfer.Agent("d") as da:
        pa.register({"layers.0": _hybrid(8, 16, 1)["layers.0"]})
        da.register({"layers.0": _hybrid(4, 32, None)["layers.0"]})
        da.add_source(pa.metadata())  # k=2 along tokens: accepted


hybrids = st.fixed_dictionaries({
    "nb": st.sampled_from([2, 4]), "tokens": st.sampled_from([4, 8, 16]),
    "dim": st.sampled_from([2, 4]),
    "conv": st.tuples(st.sampled_from([1, 4, 8]), st.sampled_from([1, 3])),
    "ssm": st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 4]), st.sampled_from([1, 5])),
    "order": st.sampled_from(["NHD", "HND"]), "state_dtype": st.sampled_from([np.float32, np.float16]),
})
#: (TP size, TP rank, the model's KV heads); each rank holds its share (one head when TP exceeds them)
parallel = st.tuples(st.sampled_from([1, 2, 4]), st.integers(0, 3), st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(local=hybrids, remote=hybrids, ltp=parallel, rtp=parallel)
def test_add_source_of_any_hybrid_geometry_is_accepted_or_refused_typed(local: dict[str, Any],
                                                                        remote: dict[str, Any],
                                                                        ltp: tuple[int, int, int],
                                                                        rtp: tuple[int, int, int]) -> None:
    sides = []
    for g, (size, rank, kvh) in ((local, ltp), (remote, rtp)):
        opts: dict[str, Any] = {"tp_size": size, "tp_rank": rank % size, "kv_heads": kvh}
        sides.append((_hybrid(**g, heads=max(1, kvh // size), seed=None), opts))
    with kvxfer.Agent("p") as pa, kvxfer.Agent("d") as da:
        try:
            da.register(sides[0][0], **sides[0][1])
            pa.register(sides[1][0], **sides[1][1])
        except SpecError:
            return  # the geometry is not one a rank can hold (heads over TP size): refused typed
        try:
            da.add_source(pa.metadata())
        except LayoutMismatchError as exc:
            assert str(exc).strip()
            assert not da.peers
        except KvxferError as exc:  # anything else blames the backend or the bytes: not a pairing verdict
            pytest.fail(f"untyped failure surfaced as {type(exc).__name__}: {exc}")
        else:
            assert "p" in da.peers
