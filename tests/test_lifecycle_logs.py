"""A fleet operator's log: INFO lines for register, add_peer (path and pairing mode), a peer's
restart and its removal; warm-up transfers (0 descriptors) are not logged, real ones are."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import kvxfer


def _cache() -> dict[str, np.ndarray]:
    return {"kv": np.zeros((8, 64), np.uint8)}


def _lines(caplog: pytest.LogCaptureFixture, logger: str, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]


def test_lifecycle_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvxfer")
    prefill, decode = kvxfer.Agent("prefill"), kvxfer.Agent("decode")
    prefill.register(_cache())
    decode.register(_cache())
    peer = decode.add_peer(prefill.metadata())
    old = prefill.generation
    prefill.deregister()
    prefill.register(_cache())  # new memory: a new generation, as after a restart
    decode.add_peer(prefill.metadata())
    decode.remove_peer(peer)
    lines = _lines(caplog, "kvxfer.agent")
    assert any(ln.startswith("agent 'prefill' registered 1 region(s), 1 allocation(s)") for ln in lines), lines
    added = [ln for ln in lines if "added peer 'prefill'" in ln]
    assert len(added) == 2 and all("over loopback; pairing whole-row" in ln for ln in added), added
    assert any(f"peer 'prefill' restarted (generation {old} -> {prefill.generation})" in ln for ln in lines), lines
    assert lines[-1] == "agent 'decode' removed peer 'prefill'"
    record = next(r for r in caplog.records if r.getMessage() in added)
    assert record.kvxfer["event"] == "add_peer" and record.kvxfer["pairing"] == "whole-row"  # type: ignore[attr-defined]


def test_nothing_is_logged_when_logging_is_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvxfer")
    a = kvxfer.Agent("a")
    a.register(_cache())
    assert not _lines(caplog, "kvxfer.agent")


def test_warm_up_posts_are_not_logged_but_transfers_are(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvxfer")
    prefill, decode = kvxfer.Agent("prefill"), kvxfer.Agent("decode")
    src = np.arange(8 * 64, dtype=np.uint8).reshape(8, 64)
    dst = np.full((8, 64), 0xAA, np.uint8)
    prefill.register({"kv": src})
    decode.register({"kv": dst})
    peer = decode.add_peer(prefill.metadata())
    decode.read(peer, [], []).wait(timeout=5)  # the warm-up engines and the CLI post
    assert not _lines(caplog, "kvxfer.transfer", logging.DEBUG)
    decode.read(peer, [1], [2]).wait(timeout=5)  # control: a real transfer is logged
    (line,) = _lines(caplog, "kvxfer.transfer", logging.DEBUG)
    assert line.startswith("decode READ DONE: 1 descriptors, 64 bytes")
    assert (dst[1] == src[2]).all() and (dst[2] == 0xAA).all()


def test_ucx_add_peer_names_its_path(caplog: pytest.LogCaptureFixture) -> None:
    status = {s.name: s for s in kvxfer.available_backends()}
    if "ucx" not in status or not status["ucx"].available:
        pytest.skip("ucx is not available here")
    caplog.set_level(logging.INFO, logger="kvxfer")
    with kvxfer.Agent("p", backend="ucx") as p, kvxfer.Agent("d", backend="ucx") as d:
        p.register(_cache())
        d.register(_cache())
        d.add_peer(p.metadata())
    (line,) = [ln for ln in _lines(caplog, "kvxfer.agent") if "added peer 'p'" in ln]
    assert "over ucx (" in line and ("same-host-copy" in line or "ucx-rma" in line), line
