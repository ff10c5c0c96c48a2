"""Prompt prefixes from the cluster tier (``tier``), end to end across two hosts.

The connector's prefix store on :class:`kvxfer.tiers.MooncakeTier` instead of a local slab
(``store_path``). First the two halves without an engine (a real master on loopback, a
vLLM-shaped cache): the worker offloads, the scheduler's lookup-only client sees the prefix,
a second client restores byte-exact, a flipped object byte is a typed failure that copies
nothing. Then two real vLLM instances on CPU, each in its own network namespace (another
"host", kvxfer._harness.netns), one master on host a: A computes four prompts and offloads
their full blocks into its segment; the test damages objects as another writer could
(cluster_site.py); B, on host b, then:

* restores the first prompt (256 loaded tokens) token-equal to A's own greedy tokens;
* finds the flipped byte (the object's digest), recomputes, counts it; tokens equal;
* control: restores rows written under another prompt's names (with genuine digests) as a
  success, and its tokens differ from A's: the loaded KV is what B attends over.

Cost: one engine pair, started together, shared by the cases (``--durations`` in the report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from e2e import BLOCK, FAULT_PROMPTS, MAX_TOKENS, PROMPTS, TOKEN, flushed_metric, kvxfer_config
from harness import HERE, ROOT, TOKEN_ENV, Engine, free_port, start_engine
from kvxfer.errors import StoreCorruptError
from kvxfer.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from kvxfer.integrations.vllm.stats import KvxferConnectorStats
from kvxfer.integrations.vllm.store import ClusterHandle, SchedulerStore, StoreSave, WorkerStore, prefix_keys
from kvxfer.testing.mooncake_master import MooncakeMaster, require
from kvxfer._harness.netns import NetLab, unavailable_reason as netns_reason
from kvxfer.tiers import MooncakeTier
from kvxfer.tiers.objects import HEADER

from test_vllm_store import ROW, _cache, _drain, _pages, _request

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]

HIT, DAMAGED, DONOR = PROMPTS[2], FAULT_PROMPTS["out_of_range"], FAULT_PROMPTS["wrong_kv"]
VICTIM = FAULT_PROMPTS["wrong_kv_source"]
FULL = 2
LOADED = "vllm:kvxfer_loaded_tokens"




# -- the two halves without an engine -------------------------------------------------------
@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    require()
    with MooncakeMaster(lease_ms=1500, client_ttl=2) as m:
        yield m


def _tier(m: MooncakeMaster, **kw: object) -> dict:
    return {"type": "mooncake", "master": m.address, "buffer": 4 * ROW, "timeout": 10.0, **kw}


def test_offload_then_another_client_restores_byte_exact_and_a_flipped_byte_copies_nothing(master) -> None:
    src, sspec = _cache(None)
    prompt = list(range(1, 301))
    stats = KvxferConnectorStats()
    ws = WorkerStore.open(None, 0, sspec, "m", stats, contextlib.nullcontext, _tier(master, segment=16 << 20))
    assert ws is not None and isinstance(ws.store, MooncakeTier)
    hs = ws.handshake()
    assert hs.handle == ClusterHandle(ws.store.geometry.fingerprint, "kvxfer")
    sched = SchedulerStore(BLOCK, 1, _tier(master))
    sched.attach({0: hs})
    assert sched.matched(_request("a", prompt, 0), 0) == 0  # nothing stored yet
    assert sched.finished(_request("a", prompt, 300), [5, 2, 7], True)
    (save,) = sched.saves
    assert save.block_ids == [5, 2] and save.keys == prefix_keys(prompt, BLOCK)
    ws.start([], sched.saves, lambda *a: None)
    sched.saves.clear()
    assert _drain(ws, set(), {}) == {"a"} and sum(stats.data["store_saved_blocks"]) == 2
    assert not sched.finished(_request("a2", prompt, 300), [1, 3, 4], True)  # stored already

    dst, dspec = _cache(0xAA, "BLHNC")  # another engine, the other cache layout
    ws2 = WorkerStore.open(None, 0, dspec, "m", stats, contextlib.nullcontext, _tier(master))
    assert ws2 is not None and ws2.handshake().handle == hs.handle  # the same objects' names
    req = _request("b", prompt, 0)
    assert sched.matched(req, 0) == 2 * BLOCK and sched.allocated(req, [3, 6, 1], 2 * BLOCK)
    done: set = set()
    ws2.start(sched.loads, [], lambda *a: None)
    (load,) = sched.loads
    sched.loads.clear()
    _drain(ws2, done, {})
    assert done == {"b"}
    np.testing.assert_array_equal(_pages(dst, [3, 6]), _pages(src, [5, 2]))
    assert (_pages(dst, [0, 1, 2, 4, 5, 7]) == 0xAA).all()

    # One row byte of the second object flipped by another writer; the control reads it back.
    t = ws.store
    (name,) = t.names([load.keys[1]])
    before = bytearray(t._store.get(name))
    flipped = bytearray(before)
    flipped[HEADER + 77] ^= 1
    assert t._store.upsert(name, bytes(flipped)) == 0
    after = t._store.get(name)
    assert len(after) == len(before) and sum(a != b for a, b in zip(before, after)) == 1
    dst.view(torch.uint8).fill_(0xAA)
    failed: dict = {}
    req = _request("c", prompt, 0)
    assert sched.matched(req, 0) == 2 * BLOCK and sched.allocated(req, [0, 4], 2 * BLOCK)
    ws2.start(sched.loads, [], lambda rid, blocks, exc: failed.__setitem__(rid, exc))
    sched.loads.clear()
    _drain(ws2, done, failed)
    assert isinstance(failed.get("c"), StoreCorruptError) and "c" not in done
    assert sum(stats.data["store_corrupt"]) == 1
    assert (_pages(dst, list(range(8))) == 0xAA).all()  # one round: nothing copied
    # The request is not offered the store again (vLLM asks again after a failed load), and the
    # damaged object is removed once the failed read's lease ends: later prompts compute it.
    assert sched.matched(req, 0) == 0
    (drop,) = ws2.drops
    drop.join(30)  # no lookup meanwhile: Mooncake renews a read's lease on every lookup of it
    assert not ws2.store.lookup([load.keys[1]])[0]
    assert sched.matched(_request("d", prompt, 0), 0) == BLOCK
    ws2.close()
    ws.close()
    for v in sched.views or []:
        v.close()


@pytest.mark.parametrize("other", ["model", "tp-rank"])
def test_another_models_or_ranks_objects_never_meet(master, other: str) -> None:
    """Objects are named by the layout fingerprint: an engine of another model (or another TP
    slice) on the same master sees none of them. Control: the storing engine's own scheduler
    does see them."""
    _, spec = _cache(None)
    prompt = list(range(1, 301))
    keys = prefix_keys(prompt, BLOCK)
    ws = WorkerStore.open(None, 0, spec, "m", KvxferConnectorStats(), contextlib.nullcontext,
                          _tier(master, segment=16 << 20))
    assert ws is not None
    ws.start([], [StoreSave("s", keys, [5, 2])], lambda *a: None)
    _drain(ws, set(), {})
    model, ospec = ("other-model", spec) if other == "model" else ("m", dataclasses.replace(spec, tp_rank=1, tp_size=2))
    ws2 = WorkerStore.open(None, 0, ospec, model, KvxferConnectorStats(), contextlib.nullcontext, _tier(master))
    assert ws2 is not None
    scheds = []
    for w in (ws, ws2):
        sched = SchedulerStore(BLOCK, 1, _tier(master))
        sched.attach({0: w.handshake()})
        scheds.append(sched)
    assert scheds[0].matched(_request("own", prompt, 0), 0) == 2 * BLOCK  # control
    assert scheds[1].matched(_request("other", prompt, 0), 0) == 0
    assert not ws2.store.lookup(keys).any()
    for sched in scheds:
        for v in sched.views or []:
            v.close()
    ws2.close()
    ws.close()


def test_the_master_absent_means_no_store_and_lookups_compute(master) -> None:
    """A worker that cannot reach the master runs without a store (logged), and a scheduler
    whose master went away computes every prompt: neither waits Mooncake's 90 s setup."""
    require()
    port = free_port()  # reserved, nothing listens
    _, spec = _cache(0)
    gone = {"type": "mooncake", "master": f"127.0.0.1:{port}", "timeout": 2.0}
    assert WorkerStore.open(None, 0, spec, "m", KvxferConnectorStats(), contextlib.nullcontext, gone) is None
    sched = SchedulerStore(BLOCK, 1, gone)
    sched.attach({0: _handshake("0" * 20)})
    assert sched.views is None  # the lookup client could not start: prompts are computed
    live = SchedulerStore(BLOCK, 1, _tier(master, timeout=2.0))
    live.attach({0: _handshake("0" * 20)})
    assert live.views is not None
    master.kill()
    try:
        assert live.matched(_request("x", list(range(1, 301)), 0), 0) == 0  # a typed miss, computed
        assert not live.finished(_request("x", list(range(1, 301)), 300), [1, 2], True)
    finally:
        master.start()
        for v in live.views:
            v.close()


def _handshake(fp: str):  # type: ignore[no-untyped-def]
    from kvxfer.integrations.vllm.store import StoreHandshake

    return StoreHandshake(ClusterHandle(fp, "kvxfer"))


@pytest.mark.parametrize("handle", [None, "not-a-handle", ClusterHandle("../../etc", "kvxfer"),
                                    ClusterHandle("ab" * 100, "kvxfer"), ClusterHandle("abcd", "a/b")],
                         ids=["none", "str", "path-fingerprint", "long-fingerprint", "slash-namespace"])
def test_a_hostile_handshake_attaches_nothing(master, handle) -> None:
    from kvxfer.integrations.vllm.store import StoreHandshake

    sched = SchedulerStore(BLOCK, 1, _tier(master))
    sched.attach({0: StoreHandshake(handle)})  # type: ignore[arg-type]
    assert sched.views is None and sched.matched(_request("h", list(range(1, 301)), 0), 0) == 0


BAD_TIER = {
    "both": {"store_path": "/s", "tier": {"type": "mooncake", "master": "127.0.0.1:1"}},
    "not-a-dict": {"tier": "mooncake://127.0.0.1:1"},
    "no-type": {"tier": {"master": "127.0.0.1:1"}},
    "other-type": {"tier": {"type": "redis", "master": "127.0.0.1:1"}},
    "no-master": {"tier": {"type": "mooncake"}},
    "master-no-port": {"tier": {"type": "mooncake", "master": "127.0.0.1"}},
    "master-huge": {"tier": {"type": "mooncake", "master": "h" * 100_000 + ":1"}},
    "master-int": {"tier": {"type": "mooncake", "master": 50051}},
    "unknown-key": {"tier": {"type": "mooncake", "master": "127.0.0.1:1", "tokn": "x"}},
    "segment-negative": {"tier": {"type": "mooncake", "master": "127.0.0.1:1", "segment": -1}},
    "segment-bool": {"tier": {"type": "mooncake", "master": "127.0.0.1:1", "segment": True}},
    "timeout-nan": {"tier": {"type": "mooncake", "master": "127.0.0.1:1", "timeout": float("nan")}},
    "timeout-zero": {"tier": {"type": "mooncake", "master": "127.0.0.1:1", "timeout": 0}},
    "hostname-empty": {"tier": {"type": "mooncake", "master": "127.0.0.1:1", "hostname": ""}},
}


@pytest.mark.parametrize("extra", list(BAD_TIER.values()), ids=list(BAD_TIER))
def test_tier_settings_are_checked(extra: dict) -> None:
    with pytest.raises(ConnectorConfigError):
        ConnectorConfig.from_extra({"insecure": True, **extra})
    ok = ConnectorConfig.from_extra({"insecure": True, "tier": {"type": "mooncake", "master": "127.0.0.1:1"}})
    assert ok.tier == {"type": "mooncake", "master": "127.0.0.1:1"} and ok.store_path is None


# -- end to end, two hosts --------------------------------------------------------------------
@pytest.fixture(scope="module")
def hosts(model_dir: Path, workdir: Path) -> Iterator[dict]:
    """Host a: the master and engine A (lending a segment); host b: engine B (lending none).
    Both engines start together; A computes and offloads the four prompts; then the damage."""
    require()
    reason = netns_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(NetLab(["a", "b"], [("a", "b")]))
        a_ip, b_ip = lab.address("a", "b"), lab.address("b", "a")
        m = stack.enter_context(MooncakeMaster(host=a_ip, netns=lab.ns("a"), client_ttl=2))
        engines: dict[str, Engine] = {}
        for name, ip, seg in (("a", a_ip, 64 << 20), ("b", b_ip, 0)):
            tier = {"type": "mooncake", "master": m.address, "hostname": ip, "segment": seg, "timeout": 60.0}
            cfg = kvxfer_config("kv_both", free_port(), tier=tier)
            engines[name] = start_engine(f"cluster-{name}", model_dir, workdir, env={TOKEN_ENV: TOKEN},
                                         kv_transfer_config=cfg, netns=lab.ns(name))
            stack.callback(engines[name].stop)
        a, b = engines["a"], engines["b"]
        a.wait_ready()
        b.wait_ready()
        ref = {}
        for p in (HIT, DAMAGED, DONOR, VICTIM):
            out = a.generate([p], MAX_TOKENS)
            assert LOADED not in out["delta"], out["delta"]  # an empty cluster serves nothing
            ref[tuple(p)] = out["tokens"][0]
        saved = flushed_metric(a, "vllm:kvxfer_store_saved_blocks", 4 * FULL)
        assert saved == 4 * FULL, a.log_tail()
        (fp,) = {m_.group(1) for m_ in re.finditer(r"<MooncakeTier \S+ ([0-9a-f]+) rows", a.log_path.read_text())}
        hexes = {k: [h.hex() for h in prefix_keys(p, BLOCK)[:FULL]] for k, p in
                 (("damaged", DAMAGED), ("donor", DONOR), ("victim", VICTIM))}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "plugins"), *sys.path]),
                   GLOG_minloglevel="2")
        r = lab.run("a", [sys.executable, str(HERE / "cluster_site.py"), m.address, a_ip, "kvxfer", fp,
                          hexes["damaged"][0], ",".join(hexes["donor"]), ",".join(hexes["victim"])],
                    env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        damage = json.loads(r.stdout.strip().splitlines()[-1])
        yield {"b": b, "ref": ref, "damage": damage}


def test_another_host_restores_the_prefix_token_equal(hosts) -> None:
    out = hosts["b"].generate([HIT], MAX_TOKENS)
    d = out["delta"]
    assert d.get(LOADED) == FULL * BLOCK, (d, hosts["b"].log_tail())
    assert "vllm:kvxfer_failed_loads" not in d and "vllm:kvxfer_store_failures" not in d, d
    assert out["tokens"][0] == hosts["ref"][tuple(HIT)]


def test_a_corrupted_object_is_recomputed_and_counted(hosts) -> None:
    assert hosts["damage"]["flipped_bytes"] == 1  # control: the flip reached the object, read back
    out = hosts["b"].generate([DAMAGED], MAX_TOKENS)
    d = out["delta"]
    assert d.get("vllm:kvxfer_store_corrupt") == 1 and d.get("vllm:kvxfer_failed_loads") == 1, d
    assert LOADED not in d, d
    assert out["tokens"][0] == hosts["ref"][tuple(DAMAGED)]


def test_control_another_prompts_rows_are_used_and_change_the_tokens(hosts) -> None:
    out = hosts["b"].generate([VICTIM], MAX_TOKENS)
    d = out["delta"]
    assert d.get(LOADED) == FULL * BLOCK and "vllm:kvxfer_store_failures" not in d, d
    assert out["tokens"][0] != hosts["ref"][tuple(VICTIM)]
