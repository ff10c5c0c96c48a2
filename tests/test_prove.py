"""The prover (:mod:`kvxfer.prove`): a helper process loads untrusted bytes first.

The probe (:mod:`kvxfer._harness.probes`) crashes, hangs or refuses on request and logs what
reached it, so each test sees both the verdict here and what the helper was given.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path
from typing import Iterator

import pytest

from kvxfer.errors import InvalidTimeoutError, MetadataCrashError, MetadataError, ProverUnavailableError
from kvxfer.prove import Prover

pytestmark = pytest.mark.multiprocess
TARGET = "kvxfer._harness.probes:make_probe"


def seen(log: Path) -> list[bytes]:
    return [bytes.fromhex(line) for line in log.read_text().split()] if log.exists() else []


@pytest.fixture
def prover(tmp_path: Path) -> Iterator[tuple[Prover, Path]]:
    log = tmp_path / "probed"
    p = Prover(TARGET, {"log": str(log)}, timeout=20.0, start_timeout=120.0)
    try:
        yield p, log
    finally:
        p.close()


def test_proven_bytes_are_not_proven_again(prover: tuple[Prover, Path]) -> None:
    p, log = prover
    p.prove(b"genuine one")
    p.prove(b"genuine two")
    p.prove(b"genuine one")
    assert seen(log) == [b"genuine one", b"genuine two"]
    assert p.stats["proven"] == 2 and p.stats["cached"] == 1 and p.stats["started"] == 1


@pytest.mark.parametrize("how, sig", [("segv", signal.SIGSEGV), ("abort", signal.SIGABRT)])
def test_bytes_that_kill_the_helper_are_refused_and_the_next_ones_load(prover: tuple[Prover, Path], how: str,
                                                                        sig: signal.Signals) -> None:
    p, log = prover
    p.prove(b"genuine")
    first = p.pid
    with pytest.raises(MetadataCrashError, match=sig.name):
        p.prove(how.encode() + b" hostile")
    assert p.stats["crashed"] == 1
    p.prove(b"genuine after")  # a new helper
    assert p.pid not in (None, first) and p.stats["started"] == 2
    # The same bytes again: refused from the cache, without killing another helper.
    with pytest.raises(MetadataCrashError, match="seen before"):
        p.prove(how.encode() + b" hostile")
    assert seen(log) == [b"genuine", how.encode() + b" hostile", b"genuine after"]
    assert p.stats["crashed"] == 1 and p.stats["started"] == 2


def test_bytes_that_hang_the_helper_are_refused_and_not_cached(tmp_path: Path) -> None:
    log = tmp_path / "probed"
    p = Prover(TARGET, {"log": str(log)}, timeout=2.0, start_timeout=120.0)
    try:
        with pytest.raises(MetadataCrashError, match="hung"):
            p.prove(b"hang here")
        p.prove(b"genuine")
        assert p.stats["timed_out"] == 1 and p.stats["started"] == 2
        assert seen(log) == [b"hang here", b"genuine"]
    finally:
        p.close()


def test_bytes_native_code_refuses_are_a_metadata_error_not_a_crash(prover: tuple[Prover, Path]) -> None:
    p, log = prover
    with pytest.raises(MetadataError, match="this probe refuses it") as info:
        p.prove(b"refuse this")
    assert not isinstance(info.value, MetadataCrashError)
    pid = p.pid
    p.prove(b"genuine")
    assert p.pid == pid and p.stats["refused"] == 1 and p.stats["started"] == 1


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="watches the helper through /proc")
def test_a_helper_that_died_between_probes_is_replaced_without_blame(prover: tuple[Prover, Path]) -> None:
    p, log = prover
    p.prove(b"genuine")
    pid = p.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    while p.pid is not None:  # until the prover sees it dead (it reaps it then)
        os.sched_yield()
    p.prove(b"genuine two")
    assert p.stats["crashed"] == 0 and p.stats["started"] == 2
    assert seen(log) == [b"genuine", b"genuine two"]


def test_oversized_and_non_bytes_inputs_never_reach_the_helper(tmp_path: Path) -> None:
    log = tmp_path / "probed"
    p = Prover(TARGET, {"log": str(log)}, max_input=16)
    try:
        for bad in (b"x" * 17, "text", None):
            with pytest.raises(MetadataError):
                p.prove(bad)  # type: ignore[arg-type]
        assert p.pid is None and not seen(log)
    finally:
        p.close()


def test_a_helper_that_cannot_start_is_a_typed_error(tmp_path: Path) -> None:
    p = Prover("kvxfer.testing.no_such_module:factory", start_timeout=120.0)
    with pytest.raises(ProverUnavailableError, match="did not start.*no_such_module") as info:
        p.prove(b"genuine")
    assert info.value.reason == "start_failed" and p.stats["start_failures"] == 1
    for bad in (float("nan"), 0, -1.0):
        with pytest.raises(InvalidTimeoutError):
            Prover(TARGET, timeout=bad)


def test_health_keeps_a_collected_provers_counts(tmp_path: Path) -> None:
    """What an operator reads from health() never goes down when a prover is garbage-collected."""
    import gc

    from kvxfer import prove

    p = Prover(TARGET, {"log": str(tmp_path / "probed")}, timeout=20.0, start_timeout=120.0)
    try:
        p.prove(b"counted once")
        p.prove(b"counted once")
    finally:
        p.close()
    assert p.counters()["proven"] == 1 and p.counters()["cached"] == 1
    before = prove.health()
    del p
    gc.collect()
    after = prove.health()
    assert after.get("proven", 0) >= before.get("proven", 0) >= 1
    assert after.get("cached", 0) >= before.get("cached", 0) >= 1


def test_the_first_helper_start_is_announced_once_at_info_with_its_cost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: the first unauthenticated add_peer waits seconds for the helper; one INFO line says
    so and how long. Control: with the once-per-process memory emptied, the next start is logged too,
    so the count below can see a second line."""
    from kvxfer import prove

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "kvxfer.prove" and r.levelno == logging.INFO]

    monkeypatch.setattr(prove, "_announced", set())
    caplog.set_level(logging.INFO, logger="kvxfer.prove")
    first, second, third = (Prover(TARGET, {"log": str(tmp_path / n)}, timeout=20.0, helpers=1) for n in "abc")
    try:
        first.prove(b"genuine one")
        second.prove(b"genuine two")
        assert seen(tmp_path / "a") == [b"genuine one"] and seen(tmp_path / "b") == [b"genuine two"]
        (line,) = lines()
        assert re.search(rf"started for {re.escape(TARGET)} in \d+\.\d s \(helper pid {first.pid}\)", line), line
        assert "prove_metadata" in line
        monkeypatch.setattr(prove, "_announced", set())  # the control
        third.prove(b"genuine three")
        assert len(lines()) == 2
    finally:
        for p in (first, second, third):
            p.close()
