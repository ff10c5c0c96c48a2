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
from kvxfer.integrations.vllm.digests import DigestMeta, SchedulerDigests, worker_digests
from kvxfer.integrations.vllm.params import (NonceBook, ParamsError, ParamsExpiredError, ParamsReplayError,
                                             RemoteKV, expiry, failure_count, load_digests, refuse_late)

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
    """Prefill and decode caches shaped as vLLM CPU's: per layer ``[B, H, N, C]`` (heads outside tokens)."""
    rng = np.random.default_rng(0)
    src = {f"layer.{i}": rng.integers(-9999, 9999, (16, 2, 128, 4), dtype=np.int16) for i in range(3)}
    dst = {k: np.full_like(v, 0x2A2A) for k, v in src.items()}
    p, d = kvxfer.Agent("p"), kvxfer.Agent("d")
    p.register(src, dims="BHND")
    d.register(dst, dims="BHND")
    d.add_peer(p.metadata())
    return src, dst, p, d


def _issue(p: kvxfer.Agent, blocks: tuple[int, ...], step_blocks: list[int], tp: int = 1) -> dict:
    """What the connector does in one step: plan, worker digests (each rank), attach to the params."""
    from types import SimpleNamespace

    sched = SchedulerDigests(TOKEN, tp)
    sched.want(SimpleNamespace(request_id="r", num_computed_tokens=200, num_prompt_tokens=300))
    sched.want(SimpleNamespace(request_id="chunk", num_computed_tokens=0, num_prompt_tokens=900))
    todo = sched.plan({"r": 100, "chunk": 512, "other": 3}, lambda rid: step_blocks)
    assert todo == {"r": (step_blocks, 300)}  # 300 tokens: two full blocks and 44 tokens of the third
    params = _remote(block_ids=blocks, tp_size=tp).to_params(TOKEN)
    sched.issue("r", params, RemoteKV.from_params(params, TOKEN, 128))
    meta = DigestMeta()
    for rank in range(tp):
        meta.aggregate(worker_digests(p, rank, todo))
    sched.attach(meta)
    return params


def test_params_digests_catch_a_replay_after_the_blocks_were_reused() -> None:
    src, dst, p, d = _pair()
    try:
        params = _issue(p, (4, 9, 2), [4, 9, 2, 7])  # the step digested one block more than the params name
        remote = RemoteKV.from_params(params, TOKEN, 128)  # signed again, with the digests
        assert remote.digests is not None and [d.blocks.tolist() for d in remote.parsed_digests()] == [[4, 9], [2]]
        src["layer.0"][2, :, 44:] = 5  # bytes behind the request's tokens (the next step's KV) are not covered
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
        src["layer.2"][2, 1, 43, 0] += 1  # the last token of the partly filled last block is covered
        with pytest.raises(IntegrityError) as e:
            d.read("p", [3, 5, 6], [4, 9, 2], expect=load_digests(remote, [4, 9, 2])).wait(10)
        assert e.value.remote_block in (9, 2)
        two = RemoteKV.from_params(_issue(p, (4, 9, 2), [4, 9, 2], tp=2), TOKEN, 128)
        with pytest.raises(ParamsError):  # two ranks' sets in params of a TP=1 prefill
            RemoteKV.from_params(RemoteKV(**{**two.__dict__, "tp_size": 1}).to_params(TOKEN), TOKEN, 128)
    finally:
        d.close()
        p.close()


def test_params_without_this_steps_digests_go_out_as_they_are() -> None:
    sched = SchedulerDigests(TOKEN, 1)
    params = _remote().to_params(TOKEN)
    before = dict(params)
    sched.issue("r", params, RemoteKV.from_params(params, TOKEN, 128))
    sched.attach(DigestMeta({0: {"someone-else": "x"}}))
    assert params == before and not sched.issued


def test_digests_for_other_blocks_are_refused_at_parsing() -> None:
    src, dst, p, d = _pair()
    try:
        dig = p.digest([4, 9, 3], rows=True).to_text()
    finally:
        d.close()
        p.close()
    with pytest.raises(ParamsError, match="do not cover"):
        RemoteKV.from_params(_remote(digests=dig + ";").to_params(TOKEN), TOKEN, 128)
    with pytest.raises(ParamsError, match="malformed"):
        RemoteKV.from_params(_remote(digests="bm90IGRpZ2VzdHM=;").to_params(TOKEN), TOKEN, 128)
    with pytest.raises(ParamsError, match="per rank"):
        RemoteKV.from_params(_remote(digests=dig).to_params(TOKEN), TOKEN, 128)
