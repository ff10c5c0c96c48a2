"""vLLM's own NixlConnector on the same prompts, as the reference for kvxfer's numbers.

Started after the kvxfer engines have stopped, one pair at a time: NixlConnector runs
NIXL's progress thread, which keeps a core busy, and this machine has two. Same checks of the tokens; its
descriptor counts and transfer times come from its own metrics (``vllm:nixl_*``).

All four prompts, as for kvxfer: with a pair's prefill and decode on a core each a
NixlConnector decode call takes well under a second here (it took 14-50 s with both on
one core), so the pair's start is the cost, not the prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import LAYERS, PAGE, PROMPTS, REFERENCE, Pairs, blocks, decode, prefill, record, start_nixl_pair

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]


@pytest.fixture(scope="module")
def pairs(model_dir: Path, workdir: Path, reference):
    with Pairs(model_dir, workdir, {"LBHNC": start_nixl_pair, "BLHNC": start_nixl_pair}) as pairs:
        yield pairs


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_nixl_connector_reference(pairs, layout):
    pair = pairs[layout]
    for prompt in PROMPTS:
        out = decode(pair, prompt, prefill(pair, prompt))
        assert out["tokens"][0] == REFERENCE[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        d = out["delta"]
        assert d.get("vllm:nixl_num_descriptors:count") == 1, d
        assert d.get("vllm:nixl_bytes_transferred:sum") == blocks(len(prompt)) * LAYERS * PAGE, d
        record(pair, prompt, out)
    assert pair.decode.log_lines("Transfer plan")
