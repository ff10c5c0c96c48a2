"""The prover blames bytes only for what the bytes did (:mod:`kvxfer.prove`).

Each case is a way a genuine peer was once refused, or every peer stalled, for a reason
outside its metadata: a helper that was stopped or starved, killed from outside, that would
not start, that was busy with another blob, or that inherited an engine's CPU pinning. Each
test has its control beside it: the same path with the bytes really at fault still fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import kvxfer.prove as prove
from kvxfer.errors import MetadataCrashError, ProverUnavailableError
from kvxfer.prove import Prover

pytestmark = pytest.mark.multiprocess
TARGET = "kvxfer._harness.probes:make_probe"


def seen(log: Path) -> list[bytes]:
    return [bytes.fromhex(line) for line in log.read_text().split()] if log.exists() else []


def until(cond: Callable[[], bool], what: str, tries: int = 6000) -> None:
    """Wait for a state (never a duration): the test fails only if it never comes."""
    for _ in range(tries):
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"never: {what}")


class Call(threading.Thread):
    """``prover.prove(data, **kw)`` on a thread of its own; ``error`` after it ends."""

    def __init__(self, p: Prover, data: bytes, **kw: Any) -> None:
        super().__init__(daemon=True)
        self.p, self.data, self.kw, self.error = p, data, kw, None

    def run(self) -> None:
        try:
            self.p.prove(self.data, **self.kw)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc


def test_a_stopped_helper_is_not_blamed_and_its_verdict_counts(tmp_path: Path) -> None:
    log = tmp_path / "probed"
    p = Prover(TARGET, {"log": str(log)}, timeout=1.0)
    try:
        p.start()
        pid = p.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        call = Call(p, b"genuine", deadline=time.monotonic() + 120)
        call.start()
        time.sleep(3.0)  # three probe timeouts of wall time pass while it cannot run
        os.kill(pid, signal.SIGCONT)
        call.join()
        assert call.error is None and p.stats["timed_out"] == 0 and p.stats["proven"] == 1
        # Stopped past the caller's deadline: a typed error naming the helper, not the bytes...
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(ProverUnavailableError, match="stopped") as info:
            p.prove(b"genuine later", deadline=time.monotonic() + 1.5)
        assert info.value.reason == "stopped" and not isinstance(info.value, MetadataCrashError)
        os.kill(pid, signal.SIGCONT)
        # ...and its answer, still awaited, is remembered: the next call needs no probe.
        until(lambda: p.stats["proven"] == 2, "the late answer was recorded")
        p.prove(b"genuine later")
        assert seen(log) == [b"genuine", b"genuine later"] and p.stats["cached"] == 1
    finally:
        p.close()


def test_control_bytes_that_hang_a_running_helper_are_still_refused(tmp_path: Path) -> None:
    p = Prover(TARGET, {"log": str(tmp_path / "probed")}, timeout=1.0)
    try:
        with pytest.raises(MetadataCrashError, match="given .* s of CPU time"):
            p.prove(b"hang forever", deadline=time.monotonic() + 120)
        assert p.stats["timed_out"] == 1
    finally:
        p.close()


def test_a_helper_killed_from_outside_does_not_poison_the_verdict(tmp_path: Path) -> None:
    log = tmp_path / "probed"
    p = Prover(TARGET, {"log": str(log)}, timeout=60.0)
    try:
        call = Call(p, b"slow 2 genuine")
        call.start()
        until(lambda: bool(seen(log)), "the probe reached the helper")
        os.kill(p.pids[0], signal.SIGKILL)  # the OOM killer, an operator, a watchdog
        call.join()
        assert call.error is None, call.error
        assert p.stats["ended_outside"] == 1 and p.stats["crashed"] == 0 and p.stats["proven"] == 1
        p.prove(b"slow 2 genuine")  # remembered as proven, not as a crash
        assert p.stats["cached"] == 1 and seen(log) == [b"slow 2 genuine"] * 2
    finally:
        p.close()


def test_control_a_native_fault_is_remembered(tmp_path: Path) -> None:
    p = Prover(TARGET, {"log": str(tmp_path / "probed")})
    try:
        with pytest.raises(MetadataCrashError, match="SIGSEGV"):
            p.prove(b"segv now")
        with pytest.raises(MetadataCrashError, match="seen before"):
            p.prove(b"segv now")
        assert p.stats["crashed"] == 1 and p.stats["ended_outside"] == 0
    finally:
        p.close()


def test_different_bytes_are_proven_side_by_side(tmp_path: Path) -> None:
    p = Prover(TARGET, {"log": str(tmp_path / "probed")}, helpers=2)
    try:
        p.start()
        slow = Call(p, b"slow 6 other peer")
        slow.start()
        until(lambda: len(p.pids) >= 1 and p.stats["started"] >= 1, "a helper runs")
        p.prove(b"genuine", deadline=time.monotonic() + 120)
        assert slow.is_alive(), "the genuine peer waited for the slow blob"
        slow.join()
        assert slow.error is None and p.stats["proven"] == 2
    finally:
        p.close()


def test_control_with_one_helper_a_busy_one_is_a_typed_wait(tmp_path: Path) -> None:
    p = Prover(TARGET, {"log": str(tmp_path / "probed")}, helpers=1)
    try:
        p.start()
        slow = Call(p, b"slow 4 other peer")
        slow.start()
        until(lambda: p.stats["proven"] == 0 and not p._idle, "the one helper is busy")
        with pytest.raises(ProverUnavailableError) as info:
            p.prove(b"genuine", deadline=time.monotonic() + 0.5)
        assert info.value.reason == "busy"
        slow.join()
    finally:
        p.close()


def test_callers_of_the_same_bytes_share_one_probe(tmp_path: Path) -> None:
    log = tmp_path / "probed"
    p = Prover(TARGET, {"log": str(log)}, helpers=2)
    try:
        calls = [Call(p, b"slow 1 same") for _ in range(3)]
        for c in calls:
            c.start()
        for c in calls:
            c.join()
        assert all(c.error is None for c in calls)
        assert seen(log) == [b"slow 1 same"] and p.stats["proven"] == 1
    finally:
        p.close()


def test_a_start_that_hangs_is_bounded_by_the_callers_deadline(tmp_path: Path) -> None:
    p = Prover(TARGET, {"log": str(tmp_path / "probed"), "hang_start": True}, start_timeout=120.0)
    try:
        with pytest.raises(ProverUnavailableError, match="still starting") as info:
            p.prove(b"genuine", deadline=time.monotonic() + 1.0)
        assert info.value.reason == "deadline" and p.stats["start_failures"] == 0
    finally:
        p.close()


def test_a_helper_that_failed_to_start_recovers_and_is_counted(tmp_path: Path) -> None:
    fails = tmp_path / "fails"
    fails.write_text("2")
    before = prove.health().get("start_failures", 0)
    p = Prover(TARGET, {"log": str(tmp_path / "probed"), "fail_starts": str(fails)}, start_backoff=(0.05, 0.2))
    try:
        errors = []
        for _ in range(200):
            try:
                p.prove(b"genuine")
                break
            except ProverUnavailableError as exc:
                errors.append(exc)
                time.sleep(0.05)
        assert errors and all(e.reason == "start_failed" for e in errors)
        assert "refuses to start" in str(errors[0])
        assert p.stats["start_failures"] == 2 and p.stats["started"] == 1 and p.last_start_error is None
        assert prove.health()["start_failures"] - before >= 2
    finally:
        p.close()


def test_a_helper_that_collects_descriptors_is_recycled(tmp_path: Path) -> None:
    p = Prover(TARGET, {"log": str(tmp_path / "probed")}, max_descriptors=64)
    try:
        p.prove(b"genuine")  # control: a probe that leaks nothing keeps its helper
        first = p.pid
        assert p.stats["recycled"] == 0
        p.prove(b"leak 100")
        assert p.stats["recycled"] == 1 and first not in p.pids
    finally:
        p.close()


def _mask(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin one")
def test_a_helper_is_not_pinned_to_its_parents_busy_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As vLLM's CPU worker leaves it: the engine thread pinned to one core, OpenMP told to bind."""
    cpus = os.sched_getaffinity(0)
    core = min(cpus)
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(core))
    spin = subprocess.Popen([sys.executable, "-c", "import os, time\n"
                             f"os.sched_setaffinity(0, {{{core}}})\nend = time.monotonic() + 120\n"
                             "while time.monotonic() < end: pass"])
    p = Prover(TARGET, {"log": str(tmp_path / "probed")})
    os.sched_setaffinity(0, {core})
    try:
        # Control: an ordinary child of this thread inherits the pinning.
        plain = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            assert _mask(plain.pid) == str(core)
        finally:
            plain.communicate(b"")
        p.prove(b"genuine", deadline=time.monotonic() + 300)
        pid = p.pid
        assert pid is not None and os.sched_getaffinity(pid) == cpus
        assert b"GOMP_CPU_AFFINITY=" not in Path(f"/proc/{pid}/environ").read_bytes()
    finally:
        os.sched_setaffinity(0, cpus)
        spin.kill()
        spin.wait()
        p.close()


def _blocking_send(child: Any, op: bytes, payload: bytes, deadline: float | None = None) -> bool:
    """What ``Child.send`` did before: the whole frame into a blocking pipe, no deadline."""
    fd = child.proc.stdin.fileno()
    os.set_blocking(fd, True)
    os.write(fd, prove_frame(op, payload))  # a blocking pipe write returns once all is written
    return True


def prove_frame(op: bytes, payload: bytes) -> bytes:
    from kvxfer._childproc import FRAME
    return FRAME.pack(op, len(payload)) + payload


def _stopped_helper_big_blob(tmp_path: Path, control: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blob 4x a pipe's capacity, offered to a SIGSTOPped helper with a 1 s deadline."""
    if control:
        monkeypatch.setattr(prove.Child, "send", _blocking_send)
    log = tmp_path / "probed"
    p = Prover(TARGET, {"log": str(log)}, timeout=1.0)
    blob = b"genuine " + bytes(range(256)) * 1024  # 256 KiB: 4,000 regions' worth of unsigned metadata
    try:
        p.start()
        pid = p.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        call = Call(p, blob, deadline=time.monotonic() + 1.0)
        call.start()
        try:
            if control:
                # Past its deadline (by 3 s) the caller is still inside write(): the defect.
                call.join(4.0)
                assert call.is_alive() and p.stats["unavailable"] == 0
                return
            until(lambda: not call.is_alive(), "the call returned while the helper stays stopped")
            assert _state(pid) == "T"  # it never ran: the call ended on its own deadline
            assert isinstance(call.error, ProverUnavailableError) and call.error.reason == "stopped", call.error
        finally:
            os.kill(pid, signal.SIGCONT)
            call.join()
        # The rest of the frame is written in the background; the verdict is remembered.
        until(lambda: p.stats["proven"] == 1, "the late answer was recorded")
        p.prove(blob)
        assert seen(log) == [blob] and p.stats["cached"] == 1
    finally:
        p.close()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def test_a_stopped_helper_cannot_hold_a_large_blobs_caller_past_its_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stopped_helper_big_blob(tmp_path, False, monkeypatch)


def test_control_a_blocking_write_holds_the_caller_past_its_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stopped_helper_big_blob(tmp_path, True, monkeypatch)
