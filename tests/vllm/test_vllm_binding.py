"""Params bound to their prompt, the tag checked first as bytes, request ids any client may send,
and the token kept out of every repr (issue 31). No engines: the connector's own halves and
vLLM's Request objects; tests/vllm/test_vllm_kvxfer.py runs the prompt swap through engines.
"""

from __future__ import annotations

import hmac
from types import SimpleNamespace

import pytest

from kvxfer.integrations.vllm import params as P
from kvxfer.integrations.vllm.binding import wire_id
from kvxfer.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata
from kvxfer.integrations.vllm.scheduler import SchedulerSide
from kvxfer.integrations.vllm.worker import WorkerSide

SECRET = "tok-" + "5e" * 16
BLOCK = 16


def _cfg() -> ConnectorConfig:
    return ConnectorConfig.from_extra({"token": SECRET, "port": 7000}, env={})


def _request(rid: str, prompt: list[int], params: object, computed: int = 0):
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    r = Request(rid, list(prompt), SamplingParams(max_tokens=1), None)
    r.kv_transfer_params = params
    r.num_computed_tokens = computed
    r.status = RequestStatus.FINISHED_STOPPED
    return r


def _issue(prefill: SchedulerSide, rid: str, prompt: list[int]) -> dict:
    blocks = list(range(-(-len(prompt) // BLOCK)))
    keep, params = prefill.request_finished(_request(rid, prompt, {"do_remote_decode": True}, len(prompt)), blocks)
    assert keep and params is not None
    return params


A = [7] * 40 + [1, 2, 3]
B = [7] * 40 + [1, 2, 4]  # the same length and prefix; only the last token differs


def test_params_for_another_prompt_are_refused_and_leave_the_nonce_unused(monkeypatch):
    prefill, decode = SchedulerSide(_cfg(), "p", BLOCK, 1), SchedulerSide(_cfg(), "d", BLOCK, 1, 2048)
    params = _issue(prefill, "a", A)
    assert params["kvxfer"]["p"] and len(params["kvxfer"]["p"]) == 64
    assert decode.get_num_new_matched_tokens(_request("b", B, params), 0) == (0, False)
    stats = decode.stats.data
    assert sum(stats["prompt_mismatches"]) == 1 and sum(stats["rejected_params"]) == 1
    # The client the params were issued to can still use them.
    assert decode.get_num_new_matched_tokens(_request("a2", A, params), 0) == (len(A), True)
    # A cache salt (another tenant) is part of what is bound.
    salted = _request("a3", A, _issue(prefill, "a-salt", A))
    salted.cache_salt = "other-tenant"
    assert decode.get_num_new_matched_tokens(salted, 0) == (0, False)
    # Control: with the check bypassed, B's request would load A's blocks.
    monkeypatch.setattr(SchedulerSide, "check_prompt", staticmethod(lambda request, remote: None))
    assert decode.get_num_new_matched_tokens(_request("b2", B, _issue(prefill, "a4", A)), 0) == (len(A), True)


def test_the_tag_is_checked_first_as_bytes_and_2_20_ids_cost_no_per_id_work(monkeypatch):
    remote = P.RemoteKV("e", "h", 1, "r", (4, 9, 2), 40, 1, prompt="0" * 64)
    token = SECRET.encode()
    huge, valid = remote.to_params(token), remote.to_params(token)
    huge["remote_block_ids"] = [0] * (1 << 20)
    calls = {"int": 0, "sig": 0}
    real_int, real_sig = P._wire.integer, P._signature  # ids are checked by the wire toolkit's integer rule
    monkeypatch.setattr(P._wire, "integer", lambda *a, **k: (calls.__setitem__("int", calls["int"] + 1),
                                                            real_int(*a, **k))[1])
    monkeypatch.setattr(P, "_signature", lambda *a: (calls.__setitem__("sig", calls["sig"] + 1), real_sig(*a))[1])
    with pytest.raises(P.ParamsError, match="1..129"):
        P.RemoteKV.from_params(huge, token, BLOCK, max_blocks=129)  # a decode of 2048 tokens: no HMAC at all
    assert calls == {"int": 0, "sig": 0}
    with pytest.raises(P.ParamsError, match="authentication"):
        P.RemoteKV.from_params(huge, token, BLOCK)  # without a model bound: one HMAC, no id looked at
    assert calls == {"int": 0, "sig": 1}
    P.RemoteKV.from_params(valid, token, BLOCK)  # control: a valid set checks every id
    assert calls["int"] >= 3
    for tag in ("\u00e9" * 64, "\ud800" * 64, "A" * 64, b"0" * 64):
        bad = remote.to_params(token)
        bad["kvxfer"]["tag"] = tag
        with pytest.raises(P.ParamsError, match="no valid tag"):
            P.RemoteKV.from_params(bad, token, BLOCK)
    with pytest.raises(TypeError):  # control: what such a tag did once it reached the comparison as str
        hmac.compare_digest("\u00e9" * 64, "0" * 64)


HOSTILE_IDS = ["a" * 513 + "-1234abcd", "tab\there-1234abcd", "\ud800-x", "", "kvxfer-sha256:" + "0" * 64, "\n"]


@pytest.mark.parametrize("rid", HOSTILE_IDS)
def test_request_ids_kvxfer_cannot_carry_get_a_hashed_form_end_to_end(monkeypatch, rid):
    assert wire_id("plain-id-1234abcd") == "plain-id-1234abcd"
    w = wire_id(rid)
    assert w != rid and len(w) <= P.MAX_ID and w.isprintable() and wire_id(rid) == w
    prefill = SchedulerSide(_cfg(), "p", BLOCK, 1)
    params = _issue(prefill, rid, A)
    assert params["remote_request_id"] == w
    P.RemoteKV.from_params(params, SECRET.encode(), BLOCK)
    meta = prefill.build_connector_meta()
    assert list(meta.sends) == [rid]  # vLLM's own id, which the worker reports back
    side = WorkerSide(_cfg(), "p", 0)
    notes = {"decode": [w.encode()]}
    side.owner = SimpleNamespace(notifications=lambda timeout: notes)
    side.start(meta)
    assert side.poll()[0] == {rid}  # the decode's notification (the wire form) releases vLLM's request
    if rid.startswith("kvxfer-sha256:"):
        return  # carryable, hashed only so that no client can name another request's hashed form
    # Control: the raw id is refused where the params are made, as it was before the fallback.
    monkeypatch.setattr("kvxfer.integrations.vllm.scheduler.wire_id", lambda r: r)
    with pytest.raises(P.ParamsError):
        _issue(SchedulerSide(_cfg(), "p", BLOCK, 1), rid, A)


def test_the_token_is_in_no_repr_and_no_message():
    cfg = _cfg()
    texts = [repr(cfg), str(cfg), repr(SchedulerSide(cfg, "p", BLOCK, 1)), repr(WorkerSide(cfg, "p", 0)),
             repr(KvxferConnectorMetadata())]
    for extra in ({"token": SECRET, "tokn": 1}, {"token": SECRET, "port": SECRET}, {"token": SECRET, "insecure": True},
                  {"token": SECRET, "token_env": "X"}, {"token": SECRET, "lease_seconds": 1}):
        with pytest.raises(ConnectorConfigError) as e:
            ConnectorConfig.from_extra(extra, env={})
        texts.append(str(e.value))
    params = P.RemoteKV("e", "h", 1, "r", (4, 9, 2), 40, 1).to_params(SECRET.encode())
    for token in (b"other", None):
        with pytest.raises(P.ParamsError) as e:
            P.RemoteKV.from_params(params, token, BLOCK)
        texts.append(str(e.value))
    assert not any(SECRET in t or SECRET.encode().hex() in t for t in texts), texts
    assert SECRET in repr(cfg.__dict__)  # control: the check sees the token where it is printed
