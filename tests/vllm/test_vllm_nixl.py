"""vLLM's own NixlConnector on the same prompts, as the reference for kvxfer's numbers.

Started after the kvxfer engines have stopped: NixlConnector runs NIXL's progress thread,
which keeps a core busy, and this machine has two. Same checks of the tokens; its
descriptor counts and transfer times come from its own metrics (``vllm:nixl_*``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import LAYERS, PAGE, PROMPTS, REFERENCE, blocks, decode, prefill, record, start_fleet, start_nixl_pair

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]


@pytest.fixture(scope="module")
def pairs(model_dir: Path, workdir: Path):
    started, engines = start_fleet(model_dir, workdir, {"LBHNC": (start_nixl_pair, "LBHNC"),
                                                        "BLHNC": (start_nixl_pair, "BLHNC")})
    try:
        yield started
    finally:
        for e in engines:
            e.stop()


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
