"""The same P/D runs with a block-outermost (BLHNC) cache: all layers of a block in one row.

vLLM CPU declares only LBHNC; these engines get BLHNC through the test-only override in
``blhnc_site/sitecustomize.py`` (see there). The decode tokens are compared with the plain
LBHNC instance's, and kvxfer must move each block as **one** descriptor, while the same
bytes move.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import (LAYERS, PAGE, PROMPTS, REFERENCE, all_prompts, blocks, decode, fill_reference, prefill, record,
                 start_pairs, warm_up)
from harness import start_engine

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]


@pytest.fixture(scope="module")
def pairs(model_dir: Path, workdir: Path):
    need_ref = any(tuple(p) not in REFERENCE for p in all_prompts())
    ref = start_engine("reference", model_dir, workdir) if need_ref else None
    started = start_pairs(model_dir, workdir, "BLHNC")
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


def test_kvxfer_moves_a_block_as_one_descriptor(pairs):
    pair = pairs["kvxfer"]
    lines = pair.decode.log_lines("kvxfer registered")
    assert lines and "BLHNC" in lines[0] and "1 descriptor(s) per block" in lines[0], lines
    for prompt in PROMPTS:
        out = decode(pair, prompt, prefill(pair, prompt))
        assert out["tokens"][0] == REFERENCE[tuple(prompt)], f"prompt {len(prompt)} tokens"
        row = record(pair, prompt, out)
        assert row["transfers"] == 1
        assert row["bytes"] == blocks(len(prompt)) * LAYERS * PAGE
        assert row["descriptors"] == blocks(len(prompt))
        assert out["delta"]["vllm:kvxfer_loaded_tokens"] == len(prompt)


def test_nixl_connector_reference(pairs):
    pair = pairs["nixl"]
    for prompt in PROMPTS:
        out = decode(pair, prompt, prefill(pair, prompt))
        assert out["tokens"][0] == REFERENCE[tuple(prompt)], f"prompt {len(prompt)} tokens"
        row = record(pair, prompt, out)
        assert row["transfers"] == 1 and row["bytes"] == blocks(len(prompt)) * LAYERS * PAGE, row
