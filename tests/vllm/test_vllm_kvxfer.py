"""Prefill and decode as real vLLM instances on CPU, talking through KvxferConnector.

Two pairs, one after the other, prefill and decode on a core each (the reference tokens
come from a plain instance run once before them): one with a block-outermost cache (BLHNC,
through the test-only override in ``blhnc_site``), then one with vLLM CPU's own
layer-outermost cache (LBHNC). For every prompt prefill computes the KV and returns
transfer parameters; decode loads it and generates greedily. The tokens must equal
the plain instance's, and decode's metrics must show the KV was loaded (tokens, bytes and
descriptors, computed here from the model's geometry) instead of recomputed.

Then the faults, on the LBHNC pair: parameters altered in transit, parameters naming blocks
the prefill does not have, and a prefill killed before decode pulls: decode recomputes and
still answers correctly. A control loads the wrong request's KV on purpose: the answer must
change, which shows the token comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import (BLOCK, FAULT_PROMPTS, LAYERS, PAGE, PROMPTS, REFERENCE, TOKEN, Pairs, blocks, decode,
                 flushed_metric, prefill, record, start_kvxfer_pair)

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]


@pytest.fixture(scope="module")
def pairs(model_dir: Path, workdir: Path, reference):
    with Pairs(model_dir, workdir, {"LBHNC": start_kvxfer_pair, "BLHNC": start_kvxfer_pair}) as pairs:
        yield pairs


# BLHNC first: the LBHNC pair then stays up for the fault cases below.
@pytest.mark.parametrize("layout,per_block", [("BLHNC", 1), ("LBHNC", LAYERS)])
def test_decode_loads_the_prompt_and_matches_a_single_instance(pairs, layout, per_block):
    pair = pairs[layout]
    lines = pair.decode.log_lines("kvxfer registered")
    assert lines and layout in lines[0] and f" {per_block} descriptor(s) per block" in lines[0], lines
    assert pair.decode.log_lines("generic discovery agrees")
    released = flushed_metric(pair.prefill, "vllm:kvxfer_sends_done", 0)
    for prompt in PROMPTS:
        out = decode(pair, prompt, prefill(pair, prompt))
        assert out["tokens"][0] == REFERENCE[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        d = out["delta"]
        assert d["vllm:kvxfer_loaded_tokens"] == len(prompt)
        assert d["vllm:kvxfer_num_descriptors:count"] == 1
        assert d["vllm:kvxfer_bytes_transferred:sum"] == blocks(len(prompt)) * LAYERS * PAGE
        assert d["vllm:kvxfer_num_descriptors:sum"] == blocks(len(prompt)) * per_block
        assert "vllm:kvxfer_failed_loads" not in d
        record(pair, prompt, out)
    # Decode's notifications let prefill free each request's blocks (not the lease running out).
    n = released + len(PROMPTS)
    assert flushed_metric(pair.prefill, "vllm:kvxfer_sends_done", n) == n


def test_tampered_params_recompute(pairs):
    pair = pairs["LBHNC"]
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

    import secrets

    r = RemoteKV.from_params(params, TOKEN.encode(), BLOCK)
    # Altered blocks would no longer match the digests, and a fresh nonce keeps the set single-use.
    fresh = {"digests": None, "nonce": secrets.token_hex(16)}
    return RemoteKV(**{**r.__dict__, **fresh, **fields}).to_params(TOKEN.encode())


def test_blocks_outside_prefill_cache_recompute(pairs):
    pair = pairs["LBHNC"]
    prompt = FAULT_PROMPTS["out_of_range"]
    params = _forge(prefill(pair, prompt), block_ids=(0, 1, 10**6))  # the prefill holds 256 blocks
    out = decode(pair, prompt, params)
    assert out["tokens"][0] == REFERENCE[tuple(prompt)]
    assert out["delta"].get("vllm:kvxfer_failed_loads") == 1
    assert "vllm:kvxfer_loaded_tokens" not in out["delta"]


def test_control_wrong_kv_changes_the_answer(pairs):
    """Load another prompt's KV on purpose: if the answer did not change, token equality proved nothing."""
    pair = pairs["LBHNC"]
    source, prompt = FAULT_PROMPTS["wrong_kv_source"], FAULT_PROMPTS["wrong_kv"]
    assert len(source) == len(prompt) and REFERENCE[tuple(source)] != REFERENCE[tuple(prompt)]
    wrong = _forge(prefill(pair, prompt), block_ids=tuple(prefill(pair, source)["remote_block_ids"]))
    out = decode(pair, prompt, wrong)
    assert out["delta"].get("vllm:kvxfer_loaded_tokens") == len(prompt)
    assert out["tokens"][0] != REFERENCE[tuple(prompt)]


def test_killed_prefill_recompute(pairs):
    """Last: the prefill dies after handing out parameters and before decode pulls."""
    pair = pairs["LBHNC"]
    prompt = FAULT_PROMPTS["killed"]
    params = prefill(pair, prompt)
    pair.prefill.kill()
    try:
        out = decode(pair, prompt, params)
    finally:
        pairs.stop()  # a pair with a dead prefill is not handed to another test
    assert out["tokens"][0] == REFERENCE[tuple(prompt)]
    # The prefill's metadata was fetched once, before: the READ itself fails (or its metadata
    # fetched again after a first failure), not a fetch made for this load.
    assert out["delta"].get("vllm:kvxfer_failed_loads") == 1
