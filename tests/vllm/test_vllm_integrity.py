"""Integrity end to end: corrupted loads, replayed and expired params all recompute, tokens stay right.

One pair of real vLLM instances on CPU, both on kvxfer's corrupting fault backend around
NIXL (``faults_site`` makes it exist in the engines; it damages nothing until the test's
trigger file names a kind). Prefix caching is off so every decode loads the whole prompt
and a freed prefill block is reused by the next request. The prefill's lease (36 s, with
12 s + 6 s for a load) makes its params expire 18 s after they are handed out: the last case
waits for that.

Each case checks decode's tokens against a plain instance and the counter that names why
it recomputed. The controls run the same damage without digests: the load then passes as
loaded, which shows the checks are what catches it.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest

from e2e import (BLOCK, FAULT_PROMPTS, MAX_TOKENS, PROMPTS, REFERENCE, TOKEN, WARMUP, Pair, Pairs, _prompt, decode,
                 kvxfer_config, prefill)
from harness import HERE, TOKEN_ENV, free_port, pair_cpus, start_engine
from kvxfer.integrations.vllm.params import RemoteKV

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]

TRIGGER: Path | None = None
NO_PREFIX = {"enable_prefix_caching": False}


def _start(model: Path, logdir: Path, layout: str) -> Pair:
    global TRIGGER
    TRIGGER = logdir / f"corrupt-{secrets.token_hex(4)}"
    # Before the inherited path, not instead of it: the engines must import this checkout's kvxfer.
    env = {TOKEN_ENV: TOKEN, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "faults_site"),
                                                                         os.environ.get("PYTHONPATH")]))}
    port = free_port(2)
    p_cpus, d_cpus = pair_cpus()
    opts = {"backend": "corrupting", "backend_options": {"inner": "nixl"}}
    dec = {"backend": "corrupting",
           "backend_options": {"inner": "nixl", "corruption": {"trigger": str(TRIGGER), "page": 4096}}}
    lease = {"lease_seconds": 36, "transfer_timeout": 12, "handshake_timeout": 6}
    return Pair("kvxfer", layout,
                start_engine("integrity-prefill", model, logdir, env=env, cpus=p_cpus, num_blocks=24,
                             llm_args=NO_PREFIX, kv_transfer_config=kvxfer_config("kv_producer", port, **opts, **lease)),
                start_engine("integrity-decode", model, logdir, env=env, cpus=d_cpus, llm_args=NO_PREFIX,
                             kv_transfer_config=kvxfer_config("kv_consumer", port + 1, **dec)))


@pytest.fixture(scope="module")
def pair(model_dir: Path, workdir: Path, reference):
    with Pairs(model_dir, workdir, {"LBHNC": _start}) as pairs:
        yield pairs["LBHNC"]


def _corrupt(kind: str | None) -> None:
    assert TRIGGER is not None
    if kind is None:
        TRIGGER.unlink(missing_ok=True)
    else:
        TRIGGER.write_text(kind)


def _resign(params: dict, **fields) -> dict:
    """What a replay at another decode looks like (its nonce unseen there), or a prefill without digests."""
    r = RemoteKV.from_params(params, TOKEN.encode(), BLOCK)
    return RemoteKV(**{**r.__dict__, **fields}).to_params(TOKEN.encode())


def _damaged(pair: Pair) -> int:
    """READs the decode's backend damaged so far (it appends a line per damage)."""
    assert TRIGGER is not None
    done = Path(str(TRIGGER) + ".done")
    return len(done.read_text().splitlines()) if done.exists() else 0


#: Whole blocks only: a partly filled last block's bytes behind the prompt are not the request's,
#: so the digests leave them out and damage there would rightly pass (tests/vllm/test_vllm_params_replay.py).
CASES = {k: _prompt(300 + i, (2 + i % 2) * BLOCK) for i, k in enumerate(("flip", "zero", "swap", "stale"))}


@pytest.fixture(scope="module")
def plain(pair):
    """Greedy tokens of a single engine for the prompts above: the prefill instance, without params
    (checked first against the session's plain instance on a prompt both know)."""
    assert pair.prefill.generate([PROMPTS[1]], MAX_TOKENS)["tokens"][0] == REFERENCE[tuple(PROMPTS[1])]
    return {k: pair.prefill.generate([p], MAX_TOKENS)["tokens"][0] for k, p in CASES.items()}


@pytest.fixture(scope="module")
def early(pair):
    """Params handed out first and used last, once expired (genuine, never re-signed)."""
    return prefill(pair, FAULT_PROMPTS["killed"]), time.time()


def _decode_damaged(pair, prompt, params, kind):
    """Decode with the decode-side wrapper damaging exactly one load of ``kind``."""
    before = _damaged(pair)
    _corrupt(kind)
    try:
        out = decode(pair, prompt, params)
    finally:
        _corrupt(None)
    assert _damaged(pair) == before + 1
    return out


@pytest.mark.parametrize("kind", list(CASES))
def test_corrupted_load_recomputes_and_matches(pair, early, plain, kind):
    prompt = CASES[kind]
    params = prefill(pair, prompt)
    assert params["kvxfer"]["dig"], "the prefill put no digests in its params"
    out = _decode_damaged(pair, prompt, params, kind)
    d = out["delta"]
    assert d.get("vllm:kvxfer_integrity_failures") == 1 and d.get("vllm:kvxfer_failed_loads") == 1, d
    assert "vllm:kvxfer_loaded_tokens" not in d
    assert out["tokens"][0] == plain[kind]


def test_control_the_same_damage_without_digests_passes_as_loaded(pair):
    prompt = PROMPTS[1]  # whole blocks, like the cases above
    params = _resign(prefill(pair, prompt), digests=None, nonce=secrets.token_hex(16))
    out = _decode_damaged(pair, prompt, params, "zero")
    d = out["delta"]
    assert d.get("vllm:kvxfer_loaded_tokens") == len(prompt) and "vllm:kvxfer_integrity_failures" not in d, d


def test_replay_at_the_same_decode_is_refused(pair):
    prompt = WARMUP[1]
    params = prefill(pair, prompt)
    first = decode(pair, prompt, params)
    assert first["delta"].get("vllm:kvxfer_loaded_tokens") == len(prompt)
    again = decode(pair, prompt, params)
    assert again["delta"].get("vllm:kvxfer_replayed_params") == 1, again["delta"]
    assert "vllm:kvxfer_loaded_tokens" not in again["delta"]
    assert again["tokens"][0] == first["tokens"][0] == REFERENCE[tuple(prompt)]


def test_replay_after_the_blocks_were_reused_fails_verification(pair):
    """A's params replayed where their nonce is unseen, after prefill freed and reused A's blocks."""
    prompt = FAULT_PROMPTS["wrong_kv"]
    params = prefill(pair, prompt)
    _corrupt("flip")  # this first use fails, and its failure tells prefill to free A's blocks now
    try:
        decode(pair, prompt, params)
    finally:
        _corrupt(None)
    fillers = [[(7 * i + j) % 500 + 1 for j in range(len(prompt))] for i in range(12)]
    for f in fillers:  # plain requests: each takes blocks from the free queue and frees them at once
        pair.prefill.generate([f], 1)
    replay = _resign(params, nonce=secrets.token_hex(16))
    out = decode(pair, prompt, replay)
    d = out["delta"]
    assert d.get("vllm:kvxfer_integrity_failures") == 1, d
    assert out["tokens"][0] == REFERENCE[tuple(prompt)]
    # The control: the same replay without digests loads another request's KV as a success.
    bare = _resign(params, nonce=secrets.token_hex(16), digests=None)
    wrong = decode(pair, prompt, bare)
    assert wrong["delta"].get("vllm:kvxfer_loaded_tokens") == len(prompt), wrong["delta"]
    assert wrong["tokens"][0] != REFERENCE[tuple(prompt)]


def test_expired_params_recompute(pair, early):
    """Last: the params handed out first, used after their expiry (18 s after they were issued)."""
    params, issued = early
    wait = params["kvxfer"]["exp"] - time.time() + 1.0
    assert params["kvxfer"]["exp"] - issued <= 19
    if wait > 0:
        time.sleep(wait)
    out = decode(pair, FAULT_PROMPTS["killed"], params)
    d = out["delta"]
    assert d.get("vllm:kvxfer_expired_params") == 1 and d.get("vllm:kvxfer_rejected_params") == 1, d
    assert "vllm:kvxfer_loaded_tokens" not in d
    assert out["tokens"][0] == REFERENCE[tuple(FAULT_PROMPTS["killed"])]
