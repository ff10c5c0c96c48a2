"""Fuzz and soak campaigns, sized for CI on a 2-core machine (the big runs are scripts).

* 10,000 mutated agent metadata blobs in total through ``Agent.add_peer``, in subprocess
  workers so that a crash is caught and counted: zero crashes, hangs and untyped errors.
  ``python -m kvxfer.testing.fuzz --count 100000`` is the large run.
* A two-process soak per cross-process backend: every byte checked against a numpy model,
  resident memory and open descriptors flat. ``python -m kvxfer.testing.soak --count 10000``
  is the large run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvxfer.testing.fuzz import available, run_backend
from kvxfer.testing.soak import soak

# 10,000 in total: loopback is the cheapest per input, UCX the dearest (it connects).
FUZZ_COUNTS = {"loopback": 4000, "nixl": 3000, "ucx": 3000}
HAVE = set(available())


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", list(FUZZ_COUNTS))
def test_mutated_metadata_never_crashes_add_peer(backend: str, tmp_path: Path) -> None:
    if backend not in HAVE:
        pytest.skip(f"backend {backend} cannot run here")
    # A generous deadline per input: after a crash of its helper, NIXL's next input waits for a new one.
    r = run_backend(backend, FUZZ_COUNTS[backend], seed=0, timeout=120.0, save=tmp_path)
    assert r.inputs == FUZZ_COUNTS[backend]
    assert r.outcomes["typed"] > 0 and sum(r.mutations.values()) == r.inputs
    report = f"{backend}: {dict(r.outcomes)}; saved inputs:\n" + "\n".join(r.bad)
    # The core's guarantees hold for every backend: nothing but KvxferError, and no hang.
    assert r.outcomes["untyped"] == 0 and r.outcomes["hang"] == 0, report
    # No crash either: a blob that would crash NIXL's native parser crashes its prover's helper
    # process instead (kvxfer.prove) and is refused with MetadataCrashError.
    assert r.outcomes["crash"] == 0, report


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc for memory and descriptors")
@pytest.mark.parametrize("backend", ["ucx", "nixl"])
def test_two_process_soak_moves_every_byte_with_flat_memory(backend: str) -> None:
    if backend not in HAVE:
        pytest.skip(f"backend {backend} cannot run here")
    r = soak(backend, 2000, verify_every=500)
    assert r.transfers == 2000 and r.writes == 200 and r.peer_checks == 4
    assert r.wrong_bytes == 0
    assert r.rss_growth_mb < 16 and r.peer_rss_growth_mb < 16, r
    assert r.fd_growth <= 0 and r.peer_fd_growth <= 0, r
