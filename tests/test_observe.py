"""Per-transfer stats, observers, logging and the Prometheus exporter, on real transfers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from typing import Any, Iterator

import numpy as np
import pytest

import kvxfer
from kvxfer.observe import add_observer, remove_observer
from kvxfer.plugin import registry as plugins
from kvxfer._harness import faults

ROWS, ROW = 8, 96


@pytest.fixture
def pair() -> Iterator[tuple[kvxfer.Agent, str, np.ndarray, np.ndarray]]:
    """decode pulls from prefill; prefill rows hold a pattern, decode rows the sentinel."""
    src = np.random.default_rng(1).integers(0, 256, (ROWS, ROW), dtype=np.uint8)
    dst = np.full((ROWS, ROW), 0xAA, np.uint8)
    with kvxfer.Agent("prefill") as a, kvxfer.Agent("decode") as b:
        a.register({"l0": src[:, :48], "l1": src[:, 48:]}, replicated=True)
        b.register({"l0": dst[:, :48], "l1": dst[:, 48:]}, replicated=True)
        yield b, b.add_peer(a.metadata()), src, dst


def _moved(src: np.ndarray, dst_before: np.ndarray, d: list[int], s: list[int]) -> np.ndarray:
    want = dst_before.copy()
    want[d] = src[s]
    return want


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    @kvxfer.hookimpl
    def kvxfer_transfer_finished(self, agent: kvxfer.Agent, transfer: kvxfer.Transfer,
                                 stats: kvxfer.TransferStats) -> None:
        self.calls.append((agent.name, transfer.status.value, stats))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    add_observer(r)
    yield r
    remove_observer(r)


def test_stats_describe_the_transfer(pair: Any, recorder: Recorder) -> None:
    agent, peer, src, dst = pair
    before = dst.copy()
    t = agent.read(peer, [2, 5, 7], [7, 0, 3]).wait(10)  # no two runs adjacent on both sides
    np.testing.assert_array_equal(dst, _moved(src, before, [2, 5, 7], [7, 0, 3]))
    s = t.stats
    assert (s.descriptors, s.nbytes, s.posts) == (3, 3 * ROW, 1)
    assert (s.backend, s.op, s.peer, s.mode) == ("loopback", "READ", "prefill", "whole-row")
    # Each phase was recorded (how long they took is for benchmarks/, not tests).
    assert all(isinstance(v, float) and math.isfinite(v)
               for v in (s.plan_seconds, s.post_seconds, s.seconds, s.completion_seconds))
    assert s.telemetry is None  # loopback reports no telemetry of its own
    assert recorder.calls == [("decode", "DONE", s)]


def test_observer_sees_cancelled_and_failed_transfers() -> None:
    faults.install()
    rec = Recorder()
    add_observer(rec)
    try:
        f = faults.Faults(hang_posts=True)
        src = np.zeros((4, 16), np.uint8)
        dst = np.full((4, 16), 0xAA, np.uint8)
        with kvxfer.Agent("a", backend="faulty", inner="loopback") as a, \
                kvxfer.Agent("b", backend="faulty", inner="loopback", faults=f) as b:
            a.register({"kv": src})
            b.register({"kv": dst})
            peer = b.add_peer(a.metadata())
            with pytest.raises(kvxfer.TransferTimeoutError):
                b.read(peer, [0], [1]).wait(0.05)
            t = b.read(peer, [1], [2])
            t.cancel()
        assert [(n, st) for n, st, _ in rec.calls] == [("b", "CANCELLED"), ("b", "CANCELLED")]
        assert (dst == 0xAA).all()  # hung posts moved nothing
    finally:
        remove_observer(rec)
        faults.uninstall()


class Raising:
    @kvxfer.hookimpl
    def kvxfer_transfer_finished(self, stats: kvxfer.TransferStats) -> None:
        raise RuntimeError("observer bug")


def test_a_raising_observer_never_breaks_the_transfer(pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    agent, peer, src, dst = pair
    obs = Raising()
    add_observer(obs)
    try:
        before = dst.copy()
        agent.read(peer, [0], [3]).wait(10)
        np.testing.assert_array_equal(dst, _moved(src, before, [0], [3]))
    finally:
        remove_observer(obs)
    assert "observer raised" in caplog.text and "observer bug" in caplog.text


def test_backend_telemetry_reaches_stats() -> None:
    from kvxfer_loopback.backend import LoopbackBackend

    class Telling(LoopbackBackend):
        name = "telling"

        def post(self, *args: Any) -> Any:
            return ("post", super().post(*args))

        def poll(self, xfer: Any) -> bool:
            return bool(super().poll(xfer[1]))

        def release(self, xfer: Any) -> None:
            super().release(xfer[1])

        def telemetry(self, xfer: Any) -> dict[str, Any]:
            return {"path": "memmove", "handle": xfer[0]}

    class Plugin:
        @kvxfer.hookimpl
        def kvxfer_register_backends(self, register: Any) -> None:
            register("telling", Telling)

    plugins.reset_plugins()
    plugins.plugin_manager().register(Plugin(), name="telling")
    try:
        src = np.arange(64, dtype=np.uint8).reshape(4, 16)
        dst = np.full((4, 16), 0xAA, np.uint8)
        with kvxfer.Agent("a", backend="telling") as a, kvxfer.Agent("b", backend="telling") as b:
            a.register({"kv": src})
            b.register({"kv": dst})
            t = b.read(b.add_peer(a.metadata()), [3], [1]).wait(10)
        assert t.stats.telemetry == [{"path": "memmove", "handle": "post"}]
        assert (dst[3] == src[1]).all() and (dst[:3] == 0xAA).all()
    finally:
        plugins.reset_plugins()


_TRANSFER = """
import numpy as np, kvxfer
a, b = kvxfer.Agent("a"), kvxfer.Agent("b")
a.register({"kv": np.ones((4, 8), np.uint8)}); b.register({"kv": np.zeros((4, 8), np.uint8)})
b.read(b.add_peer(a.metadata()), [0, 2], [3, 1]).wait(5)
"""


def _py(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVXFER_LOG")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**base, **env})


def test_logging_is_quiet_by_default_and_structured_on_request() -> None:
    r = _py(_TRANSFER)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == ""
    r = _py(_TRANSFER, KVXFER_LOG="debug", KVXFER_LOG_FORMAT="json")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stderr.splitlines()]
    done = [x for x in records if x["logger"] == "kvxfer.transfer"]
    assert len(done) == 1
    assert (done[0]["descriptors"], done[0]["nbytes"], done[0]["status"], done[0]["agent"]) == (2, 16, "DONE", "b")


def test_prometheus_exporter_is_scraped_over_http(pair: Any) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from kvxfer.metrics import start_exporter

    agent, peer, src, dst = pair
    exporter = start_exporter(0, registry=CollectorRegistry())
    try:
        before = dst.copy()
        agent.read(peer, [0, 2], [4, 1]).wait(10)
        agent.read(peer, [3, 5, 7], [6, 2, 0]).wait(10)
        np.testing.assert_array_equal(dst, _moved(src, _moved(src, before, [0, 2], [4, 1]), [3, 5, 7], [6, 2, 0]))
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:
            text = resp.read().decode()
    finally:
        exporter.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    labels = (("backend", "loopback"), ("mode", "whole-row"), ("op", "READ"), ("path", ""))
    assert samples[("kvxfer_transfers_total", tuple(sorted(labels + (("status", "done"),))))] == 2
    assert samples[("kvxfer_transfer_bytes_total", labels)] == 5 * ROW
    assert samples[("kvxfer_transfer_descriptors_total", labels)] == 5
    assert samples[("kvxfer_descriptors_per_transfer_count", labels)] == 2
    assert samples[("kvxfer_transfer_seconds_count", labels)] == 2
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(exporter.url, timeout=2)  # closed with the exporter
    agent.read(peer, [0], [1]).wait(10)  # and no longer observing


def test_metrics_without_prometheus_client_give_the_install_command() -> None:
    r = _py("""
        import sys
        sys.modules["prometheus_client"] = None
        from kvxfer.metrics import start_exporter
        try:
            start_exporter(0)
        except ImportError as e:
            print(type(e).__name__, e)
    """)
    assert "MissingDependencyError" in r.stdout and "pip install 'prometheus-client>=0.17'" in r.stdout


def test_stats_print_as_one_readable_line() -> None:
    from kvxfer._stats import TransferStats

    s = TransferStats(descriptors=1563, nbytes=7_030_000_000, posts=2, plan_seconds=0.000352, seconds=0.5,
                      path="nixl", backend="nixl", op="READ", peer="prefill", mode="whole-row")
    assert str(s) == ("READ with 'prefill': 1,563 descriptors, 7,030,000,000 bytes in 2 posts, 500.000 ms "
                      "(14.06 GB/s); plan 0.352 ms; whole-row, path nixl, backend nixl")
    assert "\n" not in str(TransferStats(1, 2, 1, 0.0)) and repr(s).startswith("TransferStats(descriptors=1563,")
