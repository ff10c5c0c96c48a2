"""Params that cannot be replayed: one-time nonce, expiry inside the lease, digests bound to the blocks.

No engines here: the decode's checks on real kvxfer agents (loopback), whose bytes are
compared against the source arrays. tests/vllm/test_vllm_integrity.py runs the same cases
through real vLLM instances.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import IntegrityError
from kvxfer.integrations.vllm.config import ConnectorConfig
from kvxfer.integrations.vllm.params import (NonceBook, ParamsError, ParamsExpiredError, ParamsReplayError,
                                             RemoteKV, digests_for, expiry, failure_count, load_digests,
                                             offer_digests, refuse_late, withdraw_digests)

TOKEN = b"secret"


def _remote(**kw) -> RemoteKV:
    base = dict(engine_id="e", host="h", port=1, request_id="r", block_ids=(4, 9, 2), num_tokens=300, tp_size=1)
    return RemoteKV(**{**base, **kw})


def test_nonce_is_refused_the_second_time_and_expiry_first() -> None:
    book, r = NonceBook(), _remote()
    book.claim(r)
    with pytest.raises(ParamsReplayError):
        book.claim(RemoteKV.from_params(r.to_params(TOKEN), TOKEN, 128))
    book.claim(_remote())  # another set: another nonce
    with pytest.raises(ParamsExpiredError):
        book.claim(_remote(expires=time.time() - 1))


def test_nonce_expiry_and_digests_are_signed() -> None:
    for key, value in (("nonce", "0" * 32), ("exp", time.time() + 3600), ("dig", None)):
        p = _remote(digests="x").to_params(TOKEN)
        p["kvxfer"][key] = value
        with pytest.raises(ParamsError, match="authentication|digests"):
            RemoteKV.from_params(p, TOKEN, 128)


def test_expiry_leaves_a_whole_load_inside_the_lease() -> None:
    cfg = ConnectorConfig.from_extra({"insecure": True})
    now = 1000.0
    e = expiry(now, cfg.lease_seconds, cfg.transfer_timeout, cfg.handshake_timeout)
    assert now < e and e + cfg.transfer_timeout + cfg.handshake_timeout <= now + cfg.lease_seconds
    refuse_late(_remote(expires=e), now=e - 0.001)
    with pytest.raises(ParamsExpiredError, match="nothing was read"):
        refuse_late(_remote(expires=e), now=e)
    assert failure_count(ParamsExpiredError("x")) == "expired_params"
    assert failure_count(IntegrityError("x")) == "integrity_failures"


def _pair():
    rng = np.random.default_rng(0)
    src = {f"layer.{i}": rng.integers(0, 256, (16, 512), dtype=np.uint8) for i in range(3)}
    dst = {k: np.full_like(v, 0xAA) for k, v in src.items()}
    p, d = kvxfer.Agent("p"), kvxfer.Agent("d")
    p.register(src)
    d.register(dst)
    d.add_peer(p.metadata())
    return src, dst, p, d


def test_params_digests_catch_a_replay_after_the_blocks_were_reused() -> None:
    src, dst, p, d = _pair()
    try:
        offer_digests("e", p, tp_size=1)
        params = _remote(digests=digests_for("e", [4, 9, 2])).to_params(TOKEN)
        remote = RemoteKV.from_params(params, TOKEN, 128)
        # A first use that reads only the last two blocks (the first was a local prefix hit).
        d.read("p", [0, 1], [9, 2], expect=load_digests(remote, [9, 2])).wait(10)
        assert all((dst[k][[0, 1]] == src[k][[9, 2]]).all() for k in src)
        src["layer.1"][9] = 7  # the prefill freed block 9 and another request wrote it
        with pytest.raises(IntegrityError) as e:
            d.read("p", [3, 5, 6], [4, 9, 2], expect=load_digests(remote, [4, 9, 2])).wait(10)
        assert e.value.block == 5 and e.value.remote_block == 9
        # The control: without the digests the replay "succeeds" with the other request's bytes.
        d.read("p", [3, 5, 6], [4, 9, 2]).wait(10)
        assert (dst["layer.1"][5] == 7).all()
    finally:
        withdraw_digests("e")
        d.close()
        p.close()
    assert digests_for("e", [1]) is None


def test_digests_for_other_blocks_are_refused_at_parsing() -> None:
    src, dst, p, d = _pair()
    try:
        dig = p.digest([4, 9, 3], rows=True).to_text()
    finally:
        d.close()
        p.close()
    with pytest.raises(ParamsError, match="do not cover"):
        RemoteKV.from_params(_remote(digests=dig).to_params(TOKEN), TOKEN, 128)
    with pytest.raises(ParamsError, match="malformed"):
        RemoteKV.from_params(_remote(digests="bm90IGRpZ2VzdHM=").to_params(TOKEN), TOKEN, 128)
