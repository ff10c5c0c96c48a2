"""The decode connector never blocks a step on the network.

Prefills are real connector workers in their own processes (``idle_prefill.py``: a vLLM-shaped
cache filled from a seed, metadata served on the side channel, NIXL); the decode is a
:class:`WorkerSide` driven here as vLLM's engine loop drives it (``start`` then ``poll``
each step). Every load is checked byte for byte against torch indexing over the views.

* ``start`` (what ``start_load_kv`` calls) makes no socket call on the engine's thread: the
  socket layer is patched to record the thread of every call (the control shows the patch
  sees a fetch made on the engine's thread);
* with one prefill SIGSTOPped, a second prefill's loads through the same decode still
  complete, before the stopped one's load fails (its requests recompute, within
  ``transfer_timeout``), and the steps keep running; the step times of both cases are
  written to ``build/no-stall.json`` (BENCHMARKS.md, "A stopped prefill").
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from idle_prefill import B, N, REQUEST, cache, register, start_idle_prefill

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess, pytest.mark.nixl]

_CALLS = ("connect", "connect_ex", "send", "sendall", "recv", "recv_into", "sendto", "recvfrom")


@contextmanager
def socket_calls() -> Iterator[list[tuple[str, str]]]:
    """Record ``(thread name, call)`` for every socket call made in this process meanwhile."""
    seen: list[tuple[str, str]] = []
    saved = {name: getattr(socket.socket, name) for name in _CALLS}

    def wrap(name: str, fn: Any) -> Any:
        def call(self: socket.socket, *a: Any, **kw: Any) -> Any:
            seen.append((threading.current_thread().name, name))
            return fn(self, *a, **kw)
        return call

    for name, fn in saved.items():
        setattr(socket.socket, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(socket.socket, name, fn)


def _decode(transfer_timeout: float = 60.0, handshake_timeout: float = 30.0) -> Any:
    from kvxfer.integrations.vllm.config import ConnectorConfig
    from kvxfer.integrations.vllm.worker import WorkerSide

    cfg = ConnectorConfig.from_extra({"insecure": True, "port": 1, "transfer_timeout": transfer_timeout,
                                      "handshake_timeout": handshake_timeout,
                                      "lease_seconds": 4 * (transfer_timeout + handshake_timeout)}, env={})
    side = WorkerSide(cfg, "decode", 0)
    store, views = cache(0xAA)
    register(side, views, serve=False)
    return side, store, views


def _task(rid: str, engine: str, port: int, local: list[int], remote: list[int]) -> Any:
    from kvxfer.integrations.vllm.metadata import LoadTask
    from kvxfer.integrations.vllm.params import RemoteKV

    return LoadTask(rid, RemoteKV(engine, "127.0.0.1", port, REQUEST, tuple(remote), len(remote) * N, 1),
                    local, remote, len(remote) * N)


def _meta(*tasks: Any) -> Any:
    from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata

    return KvxferConnectorMetadata(loads=list(tasks))


def _check(views: dict[str, torch.Tensor], local: list[int], remote: list[int]) -> None:
    _, src = cache(None)  # the prefill's contents, made again from its seed
    for name, v in views.items():
        assert torch.equal(v[local].view(torch.uint8), src[name][remote].view(torch.uint8)), name


@contextmanager
def prefills(*engines: str) -> Iterator[list[tuple[Any, int]]]:
    procs = [start_idle_prefill({}, engine=e) for e in engines]
    try:
        yield procs
    finally:
        for proc, _ in procs:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=60)


def _steps(side: Any, until: Any, limit: float) -> tuple[list[float], list[tuple[str, set[str], set[str]]]]:
    """Step as vLLM does (start with nothing new, then poll) until ``until(events)``; returns the
    step times and, in order, what each step reported."""
    times: list[float] = []
    events: list[tuple[str, set[str], set[str]]] = []
    deadline = time.monotonic() + limit
    while not until(events) and time.monotonic() < deadline:
        t0 = time.perf_counter()
        side.start(_meta())
        _, recv, failed = side.poll()
        times.append(time.perf_counter() - t0)
        if recv or failed:
            events.append((f"step {len(times)}", recv, failed))
        time.sleep(0.002)  # a model step's compute
    return times, events


def _finished(events: list[tuple[str, set[str], set[str]]], rid: str) -> int | None:
    for i, (_, recv, _) in enumerate(events):
        if rid in recv:
            return i
    return None


def test_start_load_kv_does_no_network_io() -> None:
    side, store, views = _decode()
    try:
        with prefills("prefill-a") as [(_, port)]:
            me = threading.current_thread().name
            with socket_calls() as seen:
                t0 = time.perf_counter()
                side.start(_meta(_task("d-1", "prefill-a", port, [1, 7, 2], [5, 0, 6])))
                start_seconds = time.perf_counter() - t0
                in_start = [c for c in seen if c[0] == me]
                times, events = _steps(side, lambda ev: _finished(ev, "d-1") is not None, 120)
            assert not in_start, f"start() made socket calls on the engine's thread: {in_start}"
            assert any(name.startswith("kvxfer-fetch") for name, _ in seen), "the fetch was not seen at all"
            assert events and events[-1][1] == {"d-1"} and not events[-1][2], events
            _check(views, [1, 7, 2], [5, 0, 6])
            untouched = [b for b in range(B) if b not in (1, 7, 2)]
            assert (store.view(3, B, -1)[:, untouched].view(torch.uint8) == 0xAA).all()
            # A second load from the same prefill fetches nothing: the metadata is the route's.
            with socket_calls() as again:
                side.start(_meta(_task("d-2", "prefill-a", port, [3], [4])))
                _steps(side, lambda ev: _finished(ev, "d-2") is not None, 120)
            assert not [c for c in again if c[0].startswith("kvxfer-fetch")], again
            _check(views, [3], [4])
            print(f"start() with a new prefill: {1e6 * start_seconds:.0f} us")
    finally:
        side.close()


def test_control_the_socket_patch_sees_a_fetch_on_the_engine_thread() -> None:
    from kvxfer.sidechannel import NO_AUTH, fetch

    with prefills("prefill-c") as [(_, port)]:
        with socket_calls() as seen:
            fetch("127.0.0.1", port, token=NO_AUTH, timeout=30)
        assert any(c[0] == threading.current_thread().name and c[1] in ("connect", "connect_ex") for c in seen), seen


def test_a_stopped_prefill_fails_only_its_own_requests() -> None:
    """Prefill A is stopped; B's requests load through the same decode, and steps keep running.

    A's next load (its route already connected) may still complete (a same-host READ needs no
    CPU of A) or fail at ``transfer_timeout``; either way B's loads do not wait for it. Then A's
    metadata is fetched again (as after any failure a restart explains): that fetch hangs, A's
    load fails at ``handshake_timeout``, and B's loads meanwhile complete.
    """
    from kvxfer.integrations.vllm.worker import _route

    side, store, views = _decode(transfer_timeout=8.0, handshake_timeout=4.0)
    report: dict[str, Any] = {}
    try:
        with prefills("prefill-a", "prefill-b") as [(proc_a, port_a), (_, port_b)]:
            # Healthy: one load from each, every step timed.
            side.start(_meta(_task("a-1", "prefill-a", port_a, [0], [1]), _task("b-1", "prefill-b", port_b, [1], [2])))
            times, events = _steps(side, lambda ev: {"a-1", "b-1"} <= {r for e in ev for r in e[1]}, 120)
            assert not any(e[2] for e in events), events
            report["healthy"] = _summary(times)
            _check(views, [0, 1], [1, 2])
            os.kill(proc_a.pid, signal.SIGSTOP)
            # A connected, then stopped.
            side.start(_meta(_task("a-2", "prefill-a", port_a, [2], [3]), _task("b-2", "prefill-b", port_b, [3], [4])))
            # Both outcomes are awaited: a-2 may load first (a same-host READ needs no CPU of A),
            # and b-2 a step later (CI, 2026-12-02); only when a-2 waits out its timeout does the
            # order say whether B waited for A.
            first, events = _steps(side, lambda ev: all(any(r in e[1] | e[2] for e in ev) for r in ("a-2", "b-2")), 60)
            b2 = _finished(events, "b-2")
            assert b2 is not None, events  # b-2 loaded, not failed
            a2_failed = any("a-2" in e[2] for e in events)
            if a2_failed:
                assert b2 < min(i for i, e in enumerate(events) if "a-2" in e[2]), events  # B did not wait for A
            report["a_connected_then_stopped"] = {"a_load": "failed" if a2_failed else "loaded", **_summary(first)}
            # A's metadata fetched again from the stopped process: the fetch hangs.
            a3 = _task("a-3", "prefill-a", port_a, [6], [0])
            side.owner.refresh(_route(a3, 0))
            side.start(_meta(a3, _task("b-3", "prefill-b", port_b, [4, 5], [5, 6])))
            rest, more = _steps(side, lambda ev: any("a-3" in e[2] for e in ev), 60)
            failed_a = [i for i, e in enumerate(more) if "a-3" in e[2]]
            b3 = _finished(more, "b-3")
            assert failed_a and b3 is not None and b3 < failed_a[0], more  # B did not wait for A
            assert side.take_failed_blocks() == ({2, 6} if a2_failed else {6})
            _check(views, [3, 4, 5], [4, 5, 6])
            if not a2_failed:
                _check(views, [2], [3])
            assert (store.view(3, B, -1)[:, 6].view(torch.uint8) == 0xAA).all()  # a-3 wrote nothing
            report["a_fetch_hangs"] = _summary(rest)
    finally:
        side.close()
    out = Path(__file__).resolve().parents[2] / "build" / "no-stall.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


def _summary(times: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * t for t in times)
    return {"steps": len(ms), "median_ms": round(statistics.median(ms), 3), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 3),
            "max_ms": round(ms[-1], 3)}
