"""Prefill and decode as two real vLLM instances on CPU, kvxfer against vLLM's NixlConnector.

A layer-outermost cache (vLLM CPU's own ``LBHNC``). For every prompt: prefill computes it
and returns transfer parameters, decode loads the KV and generates greedily; the tokens
must equal a plain instance's, and decode's metrics must show the KV was loaded (tokens,
bytes and descriptors, computed here from the model's geometry) instead of recomputed.
Then the faults: parameters altered in transit, parameters naming blocks the prefill does
not have, and a prefill killed before decode pulls: each time decode recomputes and still
answers correctly. A control loads the wrong request's KV on purpose: the answer must
change, which shows the token comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import (BLOCK, FAULT_PROMPTS, LAYERS, PAGE, PROMPTS, REFERENCE, TOKEN, all_prompts, blocks, decode,
                 fill_reference, flushed_metric, prefill, record, start_pairs, warm_up)
from harness import start_engine

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]


@pytest.fixture(scope="module")
def pairs(model_dir: Path, workdir: Path):
    need_ref = any(tuple(p) not in REFERENCE for p in all_prompts())
    ref = start_engine("reference", model_dir, workdir) if need_ref else None
    started = start_pairs(model_dir, workdir, "LBHNC")
    engines = ([ref] if ref else []) + [e for p in started.values() for e in p.engines]
    try:
        if ref is not None:
            ref.wait_ready()
            fill_reference(ref)
            ref.stop()
        for e in engines:
            e.wait_ready()
        warm_up(started)
        yield started
    finally:
        for e in engines:
            e.stop()


def _expect_loaded(row: dict, n_tokens: int, per_block: int) -> None:
    assert row["transfers"] == 1
    assert row["bytes"] == blocks(n_tokens) * LAYERS * PAGE
    assert row["descriptors"] == blocks(n_tokens) * per_block


def test_kvxfer_decode_matches_single_instance(pairs):
    pair = pairs["kvxfer"]
    released = flushed_metric(pair.prefill, "vllm:kvxfer_sends_done", 0)
    for prompt in PROMPTS:
        out = decode(pair, prompt, prefill(pair, prompt))
        assert out["tokens"][0] == REFERENCE[tuple(prompt)], f"prompt {len(prompt)} tokens"
        row = record(pair, prompt, out)
        # Layer-outermost: one descriptor per (layer, block).
        _expect_loaded(row, len(prompt), LAYERS)
        assert out["delta"]["vllm:kvxfer_loaded_tokens"] == len(prompt)
        assert "vllm:kvxfer_failed_loads" not in out["delta"]
    # Decode's notifications let prefill free each request's blocks (not the lease running out).
    n = released + len(PROMPTS)
    assert flushed_metric(pair.prefill, "vllm:kvxfer_sends_done", n) == n
    lines = pair.decode.log_lines("kvxfer registered")
    assert lines and "LBHNC" in lines[0] and f"{LAYERS} descriptor(s) per block" in lines[0], lines
    assert pair.decode.log_lines("generic discovery agrees")


def test_nixl_connector_reference(pairs):
    pair = pairs["nixl"]
    for prompt in PROMPTS:
        out = decode(pair, prompt, prefill(pair, prompt))
        assert out["tokens"][0] == REFERENCE[tuple(prompt)], f"prompt {len(prompt)} tokens"
        row = record(pair, prompt, out)
        assert row["transfers"] == 1 and row["bytes"] == blocks(len(prompt)) * LAYERS * PAGE, row
    assert pair.decode.log_lines("Transfer plan")


def test_tampered_params_recompute(pairs):
    pair = pairs["kvxfer"]
    prompt = FAULT_PROMPTS["tampered"]
    params = prefill(pair, prompt)
    params["remote_block_ids"] = list(reversed(params["remote_block_ids"]))  # altered, not re-signed
    out = decode(pair, prompt, params)
    assert out["tokens"][0] == REFERENCE[tuple(prompt)]
    assert out["delta"].get("vllm:kvxfer_rejected_params") == 1
    assert "vllm:kvxfer_loaded_tokens" not in out["delta"] and "vllm:kvxfer_num_descriptors:count" not in out["delta"]


def _forge(params: dict, **fields) -> dict:
    """Re-sign altered parameters with the shared token, as a buggy (not a hostile) prefill would."""
    from kvxfer.integrations.vllm.params import RemoteKV

    r = RemoteKV.from_params(params, TOKEN.encode(), BLOCK)
    values = {**r.__dict__, **fields}
    return RemoteKV(**values).to_params(TOKEN.encode())


def test_blocks_outside_prefill_cache_recompute(pairs):
    pair = pairs["kvxfer"]
    prompt = FAULT_PROMPTS["out_of_range"]
    params = _forge(prefill(pair, prompt), block_ids=(0, 1, 10**6))  # the prefill holds 256 blocks
    out = decode(pair, prompt, params)
    assert out["tokens"][0] == REFERENCE[tuple(prompt)]
    assert out["delta"].get("vllm:kvxfer_failed_loads") == 1
    assert "vllm:kvxfer_loaded_tokens" not in out["delta"]


def test_control_wrong_kv_changes_the_answer(pairs):
    """Load another prompt's KV on purpose: if the answer did not change, token equality proved nothing."""
    pair = pairs["kvxfer"]
    source, prompt = FAULT_PROMPTS["wrong_kv_source"], FAULT_PROMPTS["wrong_kv"]
    assert len(source) == len(prompt) and REFERENCE[tuple(source)] != REFERENCE[tuple(prompt)]
    wrong = _forge(prefill(pair, prompt), block_ids=tuple(prefill(pair, source)["remote_block_ids"]))
    out = decode(pair, prompt, wrong)
    assert out["delta"].get("vllm:kvxfer_loaded_tokens") == len(prompt)
    assert out["tokens"][0] != REFERENCE[tuple(prompt)]


def test_killed_prefill_recompute(pairs):
    """Last: the kvxfer prefill dies after handing out parameters and before decode pulls."""
    pair = pairs["kvxfer"]
    prompt = FAULT_PROMPTS["killed"]
    params = prefill(pair, prompt)
    pair.prefill.kill()
    out = decode(pair, prompt, params)
    assert out["tokens"][0] == REFERENCE[tuple(prompt)]
    assert out["delta"].get("vllm:kvxfer_failed_loads") == 1
    assert out["delta"].get("vllm:kvxfer_handshake_failures") == 1
