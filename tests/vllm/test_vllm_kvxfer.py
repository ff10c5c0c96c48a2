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

Issue 31, on the same pair (its decode offloads finished prompts to a store): one prompt's
params sent with another prompt are refused, and neither the decode's prefix cache nor its
store ends up holding one prompt's KV under the other's keys (control: the binding switched
off in the decode, binding_site); and a hostile client (a request id kvxfer cannot carry, a
non-ASCII tag) leaves both engines serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import (BLOCK, BOUND, DECODE_STORE, FAULT_PROMPTS, HOSTILE, LAYERS, MAX_TOKENS, PAGE, PROMPTS, REFERENCE,
                 TOKEN, UNBOUND, Pairs, blocks, decode, flushed_metric, prefill, record, start_kvxfer_pair)
from kvxfer.integrations.vllm.store import prefix_keys

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


def _rows(prompt: list[int]) -> list[bytes | None]:
    """The decode store's rows under ``prompt``'s two full-block keys (None: not stored)."""
    from test_vllm_store import _entries, _slab

    store = DECODE_STORE["store"]
    slab, _, head = _slab(store)
    live, raw = _entries(store), slab.read_bytes()
    out: list[bytes | None] = []
    for k in prefix_keys(prompt, BLOCK)[:2]:
        at = 4096 + live[k].slot * head["stride"] if k in live else None
        out.append(None if at is None else raw[at:at + head["row_len"]])
    return out


def _swap(pair, p: dict[str, list[int]]) -> dict:
    """A's params with prompt B; then C, which shares B's two full blocks; then A with its own params."""
    saved = flushed_metric(pair.decode, "vllm:kvxfer_store_saved_blocks", 0)
    params = prefill(pair, p["a"])
    swapped = decode(pair, p["b"], params)
    third = pair.decode.generate([p["c"]], MAX_TOKENS)
    rightful = decode(pair, p["a"], params if "vllm:kvxfer_loaded_tokens" not in swapped["delta"]
                      else prefill(pair, p["a"]))  # the nonce is spent when the swap loaded
    # B's two full blocks and A's (C's are B's): every offload published before the store is read
    assert flushed_metric(pair.decode, "vllm:kvxfer_store_saved_blocks", saved + 4) == saved + 4
    return {"swapped": swapped, "third": third, "rightful": rightful, "rows_a": _rows(p["a"]), "rows_b": _rows(p["b"])}


def test_params_of_another_prompt_recompute_and_poison_neither_cache_nor_store(pairs):
    pair = pairs["LBHNC"]
    r = _swap(pair, BOUND)
    d = r["swapped"]["delta"]
    assert d.get("vllm:kvxfer_prompt_mismatches") == 1 and d.get("vllm:kvxfer_rejected_params") == 1, d
    assert "vllm:kvxfer_loaded_tokens" not in d and "vllm:kvxfer_num_descriptors:count" not in d, d
    assert r["swapped"]["tokens"][0] == REFERENCE[tuple(BOUND["b"])]
    assert r["third"]["delta"].get("vllm:prefix_cache_hits", 0) >= 2 * BLOCK, r["third"]["delta"]  # B's blocks
    assert r["third"]["tokens"][0] == REFERENCE[tuple(BOUND["c"])]
    assert r["rightful"]["delta"].get("vllm:kvxfer_loaded_tokens") == len(BOUND["a"])  # its nonce was not spent
    assert r["rightful"]["tokens"][0] == REFERENCE[tuple(BOUND["a"])]
    assert None not in r["rows_a"] + r["rows_b"], "the decode did not offload both prompts"
    assert all(rb != ra for ra, rb in zip(r["rows_a"], r["rows_b"]))  # B's keys hold B's own KV


def test_control_without_the_binding_the_swap_poisons_cache_and_store(pairs):
    pair = pairs["LBHNC"]
    DECODE_STORE["unbound"].write_text("off")  # binding_site: the decode's check does nothing meanwhile
    try:
        r = _swap(pair, UNBOUND)
    finally:
        DECODE_STORE["unbound"].unlink()
    assert r["swapped"]["delta"].get("vllm:kvxfer_loaded_tokens") == len(UNBOUND["b"]), r["swapped"]["delta"]
    assert r["third"]["delta"].get("vllm:prefix_cache_hits", 0) >= 2 * BLOCK, r["third"]["delta"]
    assert r["third"]["tokens"][0] != REFERENCE[tuple(UNBOUND["c"])]  # another user served A's KV
    assert r["rows_b"] == r["rows_a"] and None not in r["rows_b"]  # A's KV offloaded under B's keys


def test_hostile_requests_leave_both_engines_serving(pairs):
    """The issue's two crashes: an id kvxfer cannot carry at the prefill, a non-ASCII tag at the decode."""
    pair = pairs["LBHNC"]
    rid = "x" * 600 + "\tend"
    out = pair.prefill.call({"cmd": "generate", "prompts": [HOSTILE], "max_tokens": 1,
                             "params": [{"do_remote_decode": True}], "request_ids": [rid]})
    params = out["params"][0]
    assert params and params["remote_request_id"].startswith("kvxfer-sha256:"), params
    bad = {**params, "kvxfer": {**params["kvxfer"], "tag": "\u00e9" * 64}}
    out = pair.decode.call({"cmd": "generate", "prompts": [HOSTILE], "max_tokens": MAX_TOKENS, "params": [bad],
                            "request_ids": ["\u00e9\t" * 300]})
    assert out["delta"].get("vllm:kvxfer_rejected_params") == 1 and "vllm:kvxfer_loaded_tokens" not in out["delta"]
    assert out["tokens"][0] == REFERENCE[tuple(HOSTILE)]
    released = flushed_metric(pair.prefill, "vllm:kvxfer_sends_done", 0)
    out = decode(pair, HOSTILE, params)  # the next request, with the genuine params: both engines answer
    # (the recompute above left the first block in the decode's prefix cache: the load is the rest)
    assert out["delta"].get("vllm:kvxfer_loaded_tokens", 0) > 0, out["delta"]
    assert out["tokens"][0] == REFERENCE[tuple(HOSTILE)]
    # The decode's release names the hashed id; the prefill maps it back to vLLM's request and frees it.
    assert flushed_metric(pair.prefill, "vllm:kvxfer_sends_done", released + 1) == released + 1


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
