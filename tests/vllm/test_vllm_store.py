"""Prompt prefixes from a kvxfer.Store, end to end: engine A offloads, a new engine B restores.

Two real vLLM instances on CPU, one after the other, on one store directory
(``store_path``). A computes three prompts; the connector offloads their full prompt blocks
(2 of 128 tokens each). A stops; between the engines the test damages the files the way a
disk or an operator would: one byte of one stored row flipped, and one journal record that
points a fourth prompt's keys at another prompt's rows (with that row's genuine digest, so
only the tokens can tell). B, a new process, then:

* restores the first prompt instead of computing it (256 loaded tokens), token-equal to a
  plain instance's greedy tokens;
* finds the flipped byte (the row's digest), recomputes, and counts it; tokens equal;
* control: restores the redirected rows as a success and its tokens differ from the plain
  instance's, which shows the loaded KV is what B attends over (a connector that silently
  recomputed would pass the first case and fail this one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from e2e import BLOCK, FAULT_PROMPTS, MAX_TOKENS, PROMPTS, REFERENCE, TOKEN, flushed_metric, kvxfer_config
from harness import TOKEN_ENV, Engine, free_port, start_engine
import kvxfer
from kvxfer.errors import StoreCorruptError, StoreMissError
from kvxfer.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from kvxfer.integrations.vllm.registration import spec_from_vllm
from kvxfer.integrations.vllm.stats import KvxferConnectorStats
from kvxfer.integrations.vllm.store import SchedulerStore, StoreSave, WorkerStore, prefix_keys
from kvxfer.store import journal

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]

#: 300 tokens each: 2 full blocks stored and restored (256 tokens), 44 computed.
HIT, DAMAGED, DONOR = PROMPTS[2], FAULT_PROMPTS["out_of_range"], FAULT_PROMPTS["wrong_kv"]
VICTIM = FAULT_PROMPTS["wrong_kv_source"]
FULL = 2
ROW = 4 * 2 * 2 * 128 * 32 * 4  # 4 layers x (K and V of 2 heads x 128 tokens x 32 floats)
LOADED = "vllm:kvxfer_loaded_tokens"


# -- the two halves without an engine: a real Store under a vLLM-shaped cache ---------------
def _cache(fill: int | None, layout: str = "LBHNC") -> tuple[torch.Tensor, kvxfer.KVCacheSpec]:
    """A cache as vLLM lays it out (4 layers, 8 blocks of 128 tokens, 2 heads of 32): LBHNC is
    vLLM CPU's (a layer after another), BLHNC a GPU backend's (a block's layers in one row)."""
    L, B, H, N, C = 4, 8, 2, BLOCK, 2 * 32
    storage = torch.empty(L * B * H * N * C, dtype=torch.float32)
    if layout == "LBHNC":
        views = [storage[i * B * H * N * C:(i + 1) * B * H * N * C].view(B, H, N, C) for i in range(L)]
    else:
        views = [storage.view(B, L, H, N, C)[:, i] for i in range(L)]
    named = {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}
    u8 = storage.view(torch.uint8)
    if fill is None:
        u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    else:
        u8.fill_(fill)
    spec = spec_from_vllm(named, num_blocks=B, page_bytes={k: H * N * C * 4 for k in named}, layout=layout,
                          block_tokens=N)
    storage.kv_layout = layout  # type: ignore[attr-defined]  # for _pages
    return storage, spec


def _request(rid: str, tokens: list[int], computed: int) -> SimpleNamespace:
    """The fields of vLLM's Request the store half reads."""
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           num_computed_tokens=computed, cache_salt=None, mm_features=[], lora_request=None)


def _pages(storage: torch.Tensor, blocks: list[int]) -> np.ndarray:
    """Every layer's page of ``blocks``, by numpy indexing over the logical [layer, block, page] array."""
    u8 = storage.view(torch.uint8).numpy()
    logical = u8.reshape(4, 8, -1) if storage.kv_layout == "LBHNC" else u8.reshape(8, 4, -1).transpose(1, 0, 2)
    return logical[:, blocks]


def _drain(ws: WorkerStore, done: set, failed: dict) -> set:
    sent: set = set()
    for _ in range(20000):
        sent |= ws.poll(done.add, lambda rid, blocks, exc: failed.__setitem__(rid, exc))
        if not ws._loads and not ws._saves:
            return sent
        time.sleep(1e-3)
    raise AssertionError("store jobs did not end")


@pytest.mark.parametrize("src_layout,dst_layout", [("LBHNC", "LBHNC"), ("LBHNC", "BLHNC"), ("BLHNC", "LBHNC")])
def test_offload_then_a_new_opener_restores_byte_exact_and_a_flipped_byte_is_a_failure(tmp_path, src_layout,
                                                                                         dst_layout):
    """Engines with either cache layout share one slab: its rows are always row-shaped."""
    src, sspec = _cache(None, src_layout)
    prompt = list(range(1, 301))
    stats = KvxferConnectorStats()
    ws = WorkerStore.open(str(tmp_path), 64 * ROW, sspec, "m", stats, contextlib.nullcontext)
    assert ws is not None
    # A second opener of the same slab (another engine, or the scheduler) is refused, not served.
    assert WorkerStore.open(str(tmp_path), 64 * ROW, sspec, "m", stats, contextlib.nullcontext) is None
    assert sum(stats.data["store_busy"]) == 1
    sched = SchedulerStore(BLOCK, 1)
    sched.attach({0: ws.handshake()})
    assert sched.matched(_request("a", prompt, 0), 0) == 0  # empty store
    assert sched.finished(_request("a", prompt, 300), [5, 2, 7], True)  # 2 full blocks: 5 and 2
    (save,) = sched.saves
    assert save.block_ids == [5, 2] and save.keys == prefix_keys(prompt, BLOCK)
    ws.start([], sched.saves, lambda *a: None)
    assert _drain(ws, set(), {}) == {"a"} and sum(stats.data["store_saved_blocks"]) == 2
    assert not sched.finished(_request("a2", prompt, 300), [1, 3, 4], True)  # stored already: nothing held
    ws.close()

    dst, dspec = _cache(0xAA, dst_layout)
    ws2 = WorkerStore.open(str(tmp_path), 64 * ROW, dspec, "m", stats, contextlib.nullcontext)
    assert ws2 is not None
    fresh = SchedulerStore(BLOCK, 1)  # a new engine's scheduler, through the read-only view
    fresh.attach({0: ws2.handshake()})
    req = _request("b", prompt, 0)
    assert fresh.matched(req, 0) == 2 * BLOCK
    assert fresh.allocated(req, [3, 6, 1], 2 * BLOCK)
    (load,) = fresh.loads
    assert load.block_ids == [3, 6] and load.tokens == 2 * BLOCK
    done: set = set()
    ws2.start(fresh.loads, [], lambda *a: None)
    fresh.loads.clear()
    _drain(ws2, done, {})
    assert done == {"b"}
    np.testing.assert_array_equal(_pages(dst, [3, 6]), _pages(src, [5, 2]))
    assert (_pages(dst, [0, 1, 2, 4, 5, 7]) == 0xAA).all()  # nothing else written
    assert stats.data["tokens"] == [2 * BLOCK]

    slab, _, head = _slab(tmp_path)
    at = 4096 + _entries(tmp_path)[load.keys[1]].slot * head["stride"] + 77
    with open(slab, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    dst.view(torch.uint8).fill_(0xAA)
    failed: dict = {}
    req = _request("c", prompt, 0)
    assert fresh.matched(req, 0) == 2 * BLOCK and fresh.allocated(req, [0, 4], 2 * BLOCK)
    ws2.start(fresh.loads, [], lambda rid, blocks, exc: failed.__setitem__(rid, exc))
    _drain(ws2, done, failed)
    assert isinstance(failed.get("c"), StoreCorruptError) and "c" not in done
    assert sum(stats.data["store_corrupt"]) == 1 and sum(stats.data["store_failures"]) == 1
    assert (_pages(dst, list(range(8))) == 0xAA).all()  # one group: nothing copied
    assert fresh.matched(_request("d", prompt, 0), 0) == BLOCK  # the damaged row was dropped
    ws2.close()


def test_a_key_gone_since_the_scheduler_looked_and_a_truncated_or_missing_slab_mean_recompute(tmp_path):
    src, spec = _cache(None)
    prompt = list(range(1, 301))
    stats = KvxferConnectorStats()
    ws = WorkerStore.open(str(tmp_path), 64 * ROW, spec, "m", stats, contextlib.nullcontext)
    assert ws is not None
    sched = SchedulerStore(BLOCK, 1)
    sched.attach({0: ws.handshake()})
    assert sched.finished(_request("a", prompt, 300), [5, 2], True)
    ws.start([], sched.saves, lambda *a: None)
    _drain(ws, set(), {})

    def load(rid: str, blocks: list[int]) -> dict:
        req, failed = _request(rid, prompt, 0), {}
        assert sched.matched(req, 0) == 2 * BLOCK and sched.allocated(req, blocks, 2 * BLOCK)
        ws.start(sched.loads, [], lambda rid, blocks, exc: failed.__setitem__(rid, exc))
        sched.loads.clear()
        _drain(ws, set(), failed)
        return failed

    before = src.clone()
    keys = prefix_keys(prompt, BLOCK)
    req = _request("b", prompt, 0)
    assert sched.matched(req, 0) == 2 * BLOCK and sched.allocated(req, [0, 1], 2 * BLOCK)
    ws.store.discard(keys[1:])  # evicted after the scheduler looked
    failed: dict = {}
    ws.start(sched.loads, [], lambda rid, blocks, exc: failed.__setitem__(rid, exc))
    sched.loads.clear()
    assert isinstance(failed.get("b"), StoreMissError)
    assert torch.equal(src.view(torch.uint8), before.view(torch.uint8))  # a miss moves no byte
    assert sched.matched(_request("c", prompt, 0), 0) == BLOCK  # the view follows the journal
    assert sched.finished(_request("c", prompt, 300), [5, 2], True)
    ws.start([], sched.saves, lambda *a: None)
    sched.saves.clear()
    _drain(ws, set(), {})
    slab, _, _ = _slab(tmp_path)
    os.truncate(slab, 8192)  # the slab cut short under the running store
    assert isinstance(load("d", [0, 1]).get("d"), StoreCorruptError)
    assert torch.equal(src.view(torch.uint8), before.view(torch.uint8))
    assert sum(stats.data["store_failures"]) == 2 and sum(stats.data["store_corrupt"]) == 1
    ws.close()
    slab.unlink()  # and gone before the next engine: recreated empty, every key a miss
    ws = WorkerStore.open(str(tmp_path), 64 * ROW, spec, "m", stats, contextlib.nullcontext)
    assert ws is not None
    fresh = SchedulerStore(BLOCK, 1)
    fresh.attach({0: ws.handshake()})
    assert fresh.matched(_request("e", prompt, 0), 0) == 0
    ws.close()


def test_tensor_parallel_ranks_each_hold_a_slab_and_a_prefix_counts_only_where_all_hold_it(tmp_path):
    prompt = list(range(1, 301))
    stats, ranks = KvxferConnectorStats(), []
    for r in range(2):  # the TP slice is in the layout fingerprint: a slab per rank in one directory
        storage, spec = _cache(None)
        spec = dataclasses.replace(spec, tp_rank=r, tp_size=2)
        ranks.append((storage, spec, WorkerStore.open(str(tmp_path), 64 * ROW, spec, "m", stats,
                                                      contextlib.nullcontext)))
    assert all(ws is not None for *_, ws in ranks) and len(list(tmp_path.glob("slab-*.kv"))) == 2
    sched = SchedulerStore(BLOCK, 1)
    sched.attach({r: ws.handshake() for r, (*_, ws) in enumerate(ranks)})
    ranks[0][2].start([], [StoreSave("x", prefix_keys(prompt, BLOCK), [5, 2])], lambda *a: None)
    _drain(ranks[0][2], set(), {})
    assert sched.matched(_request("a", prompt, 0), 0) == 0  # rank 1 lacks it
    assert sched.finished(_request("a", prompt, 300), [1, 4], True)
    (save,) = sched.saves
    assert save.block_ids == [1, 4]  # every rank writes it (rank 0 replaces its entries)
    for *_, ws in ranks:
        ws.start([], [save], lambda *a: None)
        _drain(ws, set(), {})
    assert sched.matched(_request("b", prompt, 0), 0) == 2 * BLOCK
    for *_, ws in ranks:
        ws.close()


@pytest.mark.parametrize("extra", [{"store_path": ""}, {"store_path": 3}, {"store_path": "/s", "store_capacity": 0},
                                   {"store_path": "/s", "store_capacity": True}, {"store_capacity": "1G"}])
def test_store_settings_are_checked(extra):
    with pytest.raises(ConnectorConfigError):
        ConnectorConfig.from_extra({"insecure": True, **extra})
    assert ConnectorConfig.from_extra({"insecure": True}).store_path is None  # off by default


def test_keys_are_a_prefix_chain_independent_of_the_process():
    a, b = list(range(1, 301)), list(range(1, 200)) + [7] * 101
    ka, kb = prefix_keys(a, BLOCK), prefix_keys(b, BLOCK)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]
    assert prefix_keys(a, BLOCK, "salt")[0] != ka[0]
    # Fixed bytes: the same in every process and engine, whatever PYTHONHASHSEED is.
    assert ka[0].hex()[:16] == "6ff501ad66084543"


# -- end to end -----------------------------------------------------------------------------
def _start(name: str, model: Path, logdir: Path, store: Path) -> Engine:
    cfg = kvxfer_config("kv_both", free_port(), store_path=str(store), store_capacity=64 * ROW)
    e = start_engine(name, model, logdir, env={TOKEN_ENV: TOKEN}, kv_transfer_config=cfg)
    e.wait_ready()
    return e


def _slab(store: Path) -> tuple[Path, Path, dict[str, Any]]:
    """The one slab and index in ``store``, and the slab's header (docs/storage.md: magic,
    version, JSON length, JSON)."""
    (slab,) = store.glob("slab-*.kv")
    raw = slab.read_bytes()[:4096]
    (n,) = struct.unpack_from("<I", raw, 12)
    return slab, slab.with_suffix(".idx"), json.loads(raw[16:16 + n])


def _entries(store: Path) -> dict[bytes, journal.Record]:
    """key -> its live put record, replayed from the journal as an opening store would."""
    _, idx, head = _slab(store)
    live: dict[bytes, journal.Record] = {}
    for r in journal.load(str(idx), head["fingerprint"], head["slots"]):
        live.pop(r.key, None)
        if r.kind == "P":
            for k in [k for k, v in live.items() if v.slot == r.slot]:
                del live[k]
            live[r.key] = r
    return live


@pytest.fixture(scope="module")
def offloaded(model_dir: Path, workdir: Path, reference) -> Path:
    """A computes and offloads three prompts, stops; then the damage described above."""
    store = workdir / "store"
    a = _start("store-a", model_dir, workdir, store)
    try:
        for p in (HIT, DAMAGED, DONOR):
            out = a.generate([p], MAX_TOKENS)
            assert out["tokens"][0] == REFERENCE[tuple(p)]
            assert LOADED not in out["delta"], out["delta"]  # an empty store serves nothing
        saved = flushed_metric(a, "vllm:kvxfer_store_saved_blocks", 3 * FULL)
        assert saved == 3 * FULL, a.log_tail()
    finally:
        a.stop()
    entries = _entries(store)
    keys = {name: prefix_keys(p, BLOCK)[:FULL] for name, p in
            (("hit", HIT), ("damaged", DAMAGED), ("donor", DONOR), ("victim", VICTIM))}
    assert all(k in entries for n in ("hit", "damaged", "donor") for k in keys[n]), "A did not offload its prompts"
    assert not any(k in entries for k in keys["victim"])
    slab, idx, head = _slab(store)
    assert head["stride"] == ROW and head["row_len"] == ROW
    # One byte of the damaged prompt's first row, flipped in place.
    at = 4096 + entries[keys["damaged"][0]].slot * head["stride"] + 1000
    fd = os.open(slab, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)
    # The victim's keys, pointed at the donor's rows with the donor's genuine digests.
    gen = max(r.generation for r in entries.values())
    with open(idx, "ab") as f:
        for i, (vk, dk) in enumerate(zip(keys["victim"], keys["donor"])):
            d = entries[dk]
            f.write(journal.encode_put(vk, gen + 1 + i, d.slot, d.digest))
    return store


@pytest.fixture(scope="module")
def engine_b(offloaded: Path, model_dir: Path, workdir: Path):
    b = _start("store-b", model_dir, workdir, offloaded)
    try:
        yield b
    finally:
        b.stop()


def test_a_new_engine_restores_the_prefix_and_matches(engine_b):
    out = engine_b.generate([HIT], MAX_TOKENS)
    d = out["delta"]
    assert d.get(LOADED) == FULL * BLOCK, (d, engine_b.log_tail())
    assert "vllm:kvxfer_failed_loads" not in d and "vllm:kvxfer_store_failures" not in d, d
    assert out["tokens"][0] == REFERENCE[tuple(HIT)]


def test_a_corrupted_row_is_recomputed_and_counted(engine_b):
    out = engine_b.generate([DAMAGED], MAX_TOKENS)
    d = out["delta"]
    assert d.get("vllm:kvxfer_store_corrupt") == 1 and d.get("vllm:kvxfer_store_failures") == 1, d
    assert d.get("vllm:kvxfer_failed_loads") == 1 and LOADED not in d, d
    assert out["tokens"][0] == REFERENCE[tuple(DAMAGED)]


def test_control_rows_of_another_prompt_are_used_and_change_the_tokens(engine_b):
    out = engine_b.generate([VICTIM], MAX_TOKENS)
    d = out["delta"]
    assert d.get(LOADED) == FULL * BLOCK and "vllm:kvxfer_store_failures" not in d, d
    assert out["tokens"][0] != REFERENCE[tuple(VICTIM)]
