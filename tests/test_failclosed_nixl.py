"""The fail-closed property over NIXL in DRAM, the peer in another process (a subset).

Same random engine-shaped pairs and the same independent verdict as
test_failclosed_property.py, fewer examples: each one starts a peer process (about 4 s on
CI), so the three explicit ones (a refusal, a read, a write) and one drawn. The remote
cache is built in the peer process from the same description and read back as logical
``[block, layer, kv, token, head, dim]`` values to compute the expected destination.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from engine_pairs import block_ids, engine_pairs, verdict
from kvxfer import Agent
from kvxfer.errors import LayoutMismatchError
from kvxfer._harness.engines import EngineCache, build
from kvxfer.testing.peer import PeerError, PeerProcess

pytest.importorskip("kvxfer_nixl")
try:
    import nixl  # noqa: F401
except ImportError:
    pytest.skip("nixl is not installed: pip install -e '.[nixl]'", allow_module_level=True)

pytestmark = pytest.mark.nixl
TIMEOUT = 60.0


class EnginePeer(PeerProcess):
    """``python -m kvxfer.testing.peer --engine ...``: a prefill worker in its own process."""

    def __init__(self, cache: EngineCache, seed: int):
        super().__init__(["--backend", "nixl", "--name", "prefill", "--engine", cache.to_json(), "--seed", str(seed)],
                         timeout=TIMEOUT)

    def logical(self) -> np.ndarray:
        r = self.call({"cmd": "logical"})
        return np.frombuffer(base64.b64decode(r["logical"]), dtype=r["dtype"]).reshape(r["shape"])


def _gqa(style: str, order: str, tp: int, rank: int, dtype: str = "float16", heads: int = 8) -> EngineCache:
    return EngineCache(style, order, dtype, 2, 6, 4, heads, 4, tp, rank)


@pytest.mark.timeout(900)  # each example starts a NIXL peer process
@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(pair=engine_pairs(), data=st.data(), write=st.booleans())
@example(pair=(_gqa("flash", "NHD", 2, 1), _gqa("cross", "NHD", 2, 1)), data=None, write=False)
@example(pair=(_gqa("flash", "NHD", 2, 0), _gqa("flash", "NHD", 4, 2)), data=None, write=False)
@example(pair=(_gqa("kv_tuple", "HND", 1, 0), _gqa("flashinfer", "NHD", 1, 0)), data=None, write=True)
def test_pairing_moves_right_or_is_refused_across_processes(pair: tuple[EngineCache, EngineCache],
                                                             data: st.DataObject | None, write: bool) -> None:
    dec, pre = pair
    if data is not None:
        dst_ids, src_ids = data.draw(block_ids(dec.blocks, pre.blocks))
    else:
        dst_ids, src_ids = np.array([0, 3, 1]), np.array([2, 2, 5])
    expected_error = verdict(dec, pre)
    event(f"refused: {expected_error.__name__}" if expected_error else "written" if write else "read")
    dst = build(dec)
    before = dst.logical()
    peer = EnginePeer(pre, seed=11)
    try:
        with Agent("decode", backend="nixl", timeout=TIMEOUT) as d:
            d.register(dst.views, **dec.register_options())
            if expected_error is not None:
                with pytest.raises(expected_error) as info:
                    d.add_peer(peer.metadata)
                assert isinstance(info.value, LayoutMismatchError)
                with pytest.raises(PeerError, match=f"peer failed: {expected_error.__name__}:"):
                    peer.call({"cmd": "add_peer", "metadata": base64.b64encode(d.metadata()).decode()})
                assert dst.logical().tobytes() == before.tobytes()
                return
            name = d.add_peer(peer.metadata)
            src = peer.logical()
            if write:  # the peer pushes into us
                reply = peer.call({"cmd": "add_peer", "metadata": base64.b64encode(d.metadata()).decode()})
                assert reply.get("peer") == "decode", reply
                reply = peer.call({"cmd": "write", "peer": "decode", "local": src_ids.tolist(),
                                   "remote": dst_ids.tolist(), "timeout": TIMEOUT}, idle=d.progress)
                assert reply.get("done"), reply
            else:
                d.read(name, dst_ids, src_ids).wait(TIMEOUT)
        want = before.copy()
        want[dst_ids] = src[src_ids]
        assert np.ascontiguousarray(dst.logical()).view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
        assert peer.logical().tobytes() == src.tobytes(), "the source changed"
    finally:
        peer.close()


def test_registering_temporaries_does_not_crash_nixl() -> None:
    from test_failclosed import run_temporaries

    run_temporaries("nixl")
