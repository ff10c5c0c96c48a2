"""The connector's pieces without an engine: version pin, settings, transfer parameters, and
the registration of vLLM-shaped caches (checked by moving real bytes between two agents).

vLLM-shaped means built exactly as vLLM 0.32 lays out its per-layer views (``[B, H, N, C]``
with K and V inside ``C``): LBHNC is one storage with the layers one after another,
BLHNC is one storage whose row holds every layer's page of a block.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvxfer
from kvxfer.extras import install_hint
from kvxfer.integrations.vllm._compat import SUPPORTED, VllmVersionError, check_vllm, parse_version
from kvxfer.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from kvxfer.integrations.vllm.params import ParamsError, RemoteKV
from kvxfer.integrations.vllm.registration import discovered_spec, spec_from_vllm

SENTINEL = 0xAA


# -- version pin ----------------------------------------------------------------------------
def test_installed_vllm_is_in_the_supported_range():
    assert parse_version(check_vllm()) >= SUPPORTED[0]


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.4.3"])
def test_unsupported_vllm_is_refused_with_the_install_command(version):
    with pytest.raises(VllmVersionError) as err:
        check_vllm(version)
    assert install_hint("vllm") in str(err.value) and version in str(err.value)  # pip install 'vllm...'



@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1rc1+cpu"])
def test_supported_versions(version):
    assert check_vllm(version) == version


# -- settings -------------------------------------------------------------------------------
def test_config_needs_a_token_or_an_explicit_insecure():
    with pytest.raises(ConnectorConfigError, match="token"):
        ConnectorConfig.from_extra({}, env={})
    assert ConnectorConfig.from_extra({"insecure": True}, env={}).token is None
    assert ConnectorConfig.from_extra({"token_env": "T"}, env={"T": "s3" * 8}).token == b"s3" * 8
    with pytest.raises(ConnectorConfigError, match="at least 16 bytes"):  # kvxfer.tokens.check_token's rule
        ConnectorConfig.from_extra({"token_env": "T"}, env={"T": "s3"})


@pytest.mark.parametrize("extra", [
    {"tokn": "x", "insecure": True},            # misspelt key
    {"token": "a", "insecure": True},           # contradiction
    {"token": "a", "token_env": "T"},           # two sources
    {"token_env": "MISSING"},                   # unset variable
    {"insecure": True, "port": 0},              # not a port
    {"insecure": True, "port": True},           # bool is not an int here
    {"insecure": True, "transfer_timeout": -1},
    {"insecure": True, "backend_options": []},
    {"insecure": 1},
    {"insecure": True, "lease_seconds": 60, "transfer_timeout": 30},  # a load could outlive the lease
])
def test_config_refuses_bad_settings(extra):
    with pytest.raises(ConnectorConfigError):
        ConnectorConfig.from_extra(extra, env={})


# -- transfer parameters --------------------------------------------------------------------
TOKEN = b"secret"
REMOTE = RemoteKV("engine-1", "10.0.0.7", 5720, "req-17", (4, 9, 2), 300, 1)


def test_params_round_trip_through_json():
    params = json.loads(json.dumps(REMOTE.to_params(TOKEN)))
    assert RemoteKV.from_params(params, TOKEN, 128) == REMOTE


@pytest.mark.parametrize("field,value", [
    ("remote_block_ids", [4, 9, 3]), ("remote_num_tokens", 299), ("remote_request_id", "req-18"),
    ("remote_host", "10.0.0.8"), ("remote_port", 5721), ("remote_engine_id", "engine-2"), ("remote_tp_size", 2),
])
def test_any_altered_field_fails_authentication(field, value):
    params = REMOTE.to_params(TOKEN)
    params[field] = value
    with pytest.raises(ParamsError):
        RemoteKV.from_params(params, TOKEN, 128)


def test_other_token_or_no_token_fails():
    with pytest.raises(ParamsError, match="authentication"):
        RemoteKV.from_params(REMOTE.to_params(TOKEN), b"other", 128)
    with pytest.raises(ParamsError, match="authentication"):
        RemoteKV.from_params(REMOTE.to_params(TOKEN), None, 128)


def test_block_count_must_match_the_tokens():
    with pytest.raises(ParamsError, match="blocks"):
        RemoteKV.from_params(REMOTE.to_params(TOKEN), TOKEN, 64)  # 300 tokens need 5 blocks of 64


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(REMOTE.to_params(TOKEN))), JSON, max_size=12))
def test_arbitrary_params_raise_only_params_error(junk):
    params = {**REMOTE.to_params(TOKEN), **junk}
    try:
        RemoteKV.from_params(params, TOKEN, 128)
    except ParamsError:
        pass


# -- registration ---------------------------------------------------------------------------
def vllm_cache(layout: str, L: int, B: int, H: int, N: int, C: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One storage and per-layer ``[B, H, N, C]`` float32 views laid out as vLLM does."""
    storage = torch.empty(L * B * H * N * C, dtype=torch.float32)
    if layout == "LBHNC":
        views = [storage[i * B * H * N * C:(i + 1) * B * H * N * C].view(B, H, N, C) for i in range(L)]
    elif layout == "BLHNC":
        views = [storage.view(B, L, H, N, C)[:, i] for i in range(L)]
    elif layout == "LHBNC":  # a layer's block is split across heads: not block-compact
        views = [storage.view(L, H, B, N, C)[i].permute(1, 0, 2, 3) for i in range(L)]
    else:
        raise ValueError(layout)
    return storage, {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}


def _spec(views: dict[str, torch.Tensor], layout: str, B: int, page: int, N: int) -> kvxfer.KVCacheSpec:
    return spec_from_vllm(views, num_blocks=B, page_bytes={k: page for k in views}, layout=layout, block_tokens=N)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_generic_discovery_reads_the_same_memory_and_names_the_axes(layout):
    _, views = vllm_cache(layout, 4, 16, 2, 8, 16)
    explicit = _spec(views, layout, 16, 2 * 8 * 16 * 4, 8)
    found = discovered_spec(views, explicit)
    assert len(found.regions) == len(explicit.regions) and found.allocations == explicit.allocations
    m = found.members[0]
    assert m.page.axes == "HND" and m.page.shape == (2, 8, 16) and m.shard.heads == (0, 2)


def test_layer_outermost_is_one_region_per_layer():
    storage, views = vllm_cache("LBHNC", 4, 16, 2, 8, 16)
    spec = _spec(views, "LBHNC", 16, 2 * 8 * 16 * 4, 8)
    assert len(spec.allocations) == 1 and spec.allocations[0].nbytes == storage.numel() * 4
    assert len(spec.regions) == 4 and all(len(r.members) == 1 for r in spec.regions)


def test_block_outermost_is_one_region_holding_every_layer():
    storage, views = vllm_cache("BLHNC", 4, 16, 2, 8, 16)
    spec = _spec(views, "BLHNC", 16, 2 * 8 * 16 * 4, 8)
    assert len(spec.allocations) == 1 and len(spec.regions) == 1
    assert [m.offset for m in spec.regions[0].members] == [i * 2 * 8 * 16 * 4 for i in range(4)]


def test_kv_planes_outermost_become_k_and_v_members():
    B, H, N, D = 8, 2, 4, 8
    views = {f"l{i}": torch.empty(2, B, N, H, D) for i in range(3)}
    spec = spec_from_vllm(views, num_blocks=B, page_bytes={k: 2 * N * H * D * 4 for k in views}, layout=None,
                          block_tokens=N)
    assert sorted(m.name for m in spec.members) == sorted(f"l{i}.{kv}" for i in range(3) for kv in "kv")


@pytest.mark.parametrize("case", ["blocks", "page", "split_page", "contradiction"])
def test_registration_refuses_to_guess(case):
    B, page = 16, 2 * 8 * 16 * 4
    layout = "LHBNC" if case == "split_page" else "BLHNC"
    _, views = vllm_cache(layout, 4, B, 2, 8, 16)
    kw = {"num_blocks": B, "page_bytes": {k: page for k in views}, "layout": "BLHNC", "block_tokens": 8}
    if case == "blocks":
        kw["num_blocks"] = 2  # the K/V-sized dim must never be taken for blocks
    elif case == "page":
        kw["page_bytes"] = {k: page // 2 for k in views}
    elif case == "split_page":
        kw["layout"] = None
    elif case == "contradiction":
        kw["layout"] = "LBHNC"
    with pytest.raises(kvxfer.SpecError):
        spec_from_vllm(views, **kw)


def test_loopback_is_refused_for_cross_process_pd():
    from kvxfer.integrations.vllm.worker import WorkerSide

    _, views = vllm_cache("LBHNC", 2, 4, 1, 4, 8)
    side = WorkerSide(ConnectorConfig.from_extra({"insecure": True, "backend": "loopback"}, env={}), "e", 0)
    with pytest.raises(kvxfer.UnsupportedError, match="other processes"):
        side.register(views, num_blocks=4, page_bytes={k: 4 * 8 * 4 for k in views}, layout="LBHNC",
                      block_tokens=4, tp_size=1, replicated=False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(L=st.integers(1, 4), B=st.integers(2, 12), H=st.integers(1, 3), N=st.integers(1, 4), C=st.integers(1, 6),
       prefill_layout=st.sampled_from(["LBHNC", "BLHNC"]), decode_layout=st.sampled_from(["LBHNC", "BLHNC"]),
       data=st.data())
def test_registered_caches_move_the_right_bytes(L, B, H, N, C, prefill_layout, decode_layout, data):
    """Pull random blocks between vLLM-shaped caches; compare with torch indexing over the views."""
    page = H * N * C * 4
    src_store, src = vllm_cache(prefill_layout, L, B, H, N, C)
    dst_store, dst = vllm_cache(decode_layout, L, B, H, N, C)
    src_store.view(torch.uint8).copy_(torch.from_numpy(np.random.default_rng(L * B).integers(0, 255, src_store.numel() * 4, dtype=np.uint8)))
    dst_store.view(torch.uint8).fill_(SENTINEL)
    n = data.draw(st.integers(1, B))
    remote = data.draw(st.lists(st.integers(0, B - 1), min_size=n, max_size=n))
    local = data.draw(st.lists(st.integers(0, B - 1), min_size=n, max_size=n, unique=True))
    expected = dst_store.clone()
    exp_views = vllm_cache(decode_layout, L, B, H, N, C)[1]  # same geometry over the expected copy
    exp_views = {k: expected.view(-1).as_strided(v.shape, v.stride(), v.storage_offset()) for k, v in exp_views.items()}
    for name in dst:
        for lb, rb in zip(local, remote):
            exp_views[name][lb] = src[name][rb]
    with kvxfer.Agent("prefill", backend="loopback", coalesce=False) as p, \
            kvxfer.Agent("decode", backend="loopback", coalesce=False) as d:
        p.register(discovered_spec(src, _spec(src, prefill_layout, B, page, N)))
        d.register(discovered_spec(dst, _spec(dst, decode_layout, B, page, N)))
        peer = d.add_peer(p.metadata())
        t = d.read(peer, local, remote).wait(timeout=10)
        whole_rows = prefill_layout == decode_layout == "BLHNC"
        assert t.stats.descriptors == n * (1 if whole_rows else L)
    assert torch.equal(dst_store.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity") or (__import__("os").cpu_count() or 1) < 2,
                    reason="needs Linux and two CPUs")
def test_helper_threads_are_not_pinned_to_the_engine_core():
    """vLLM pins a CPU worker's main thread; the connector's threads must not inherit that."""
    import os
    import threading

    from kvxfer.integrations.vllm.worker import _unpinned

    before = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def report(key: str) -> None:
        seen[key] = os.sched_getaffinity(0)

    try:
        os.sched_setaffinity(0, {0})
        for key, ctx in (("pinned", None), ("unpinned", _unpinned())):
            with ctx if ctx is not None else __import__("contextlib").nullcontext():
                t = threading.Thread(target=report, args=(key,))
                t.start()
            t.join()
        after = os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, before)
    assert seen["pinned"] == {0} and after == {0}
    assert len(seen["unpinned"]) > 1
