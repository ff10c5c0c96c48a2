"""NIXL metadata that crashes NIXL is refused, and the process that was sent it lives on.

A saved crash input of the fuzz campaign (``tests/fuzz_corpus/nixl/``) is a whole agent
metadata whose NIXL blob makes ``add_remote_agent`` dereference a bad pointer. Each scenario
runs in a child process, so that a crash is a failed test rather than a dead test session:

* with the prover (the default), ``add_peer`` refuses it with ``MetadataError``, the child
  survives, and a genuine peer then loads and moves bytes that are checked;
* without the prover, the same input kills the child by a signal: the input is a real crash,
  so the first test could fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("kvxfer_nixl.backend", reason="nixl is not installed: pip install -e '.[nixl]'")

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[3]
#: Crashes NIXL 1.5.1 in every one of 16 tries, in-process and in the prover's helper.
CRASHER = ROOT / "tests" / "fuzz_corpus" / "nixl" / "nixl-crash-d9e81c2ea618c156.bin"
SENTINEL = 0xAA


def scenario(crasher: str, prove: bool) -> dict[str, Any]:
    """In the child: the victim is sent the crasher, then reads from a genuine peer."""
    from kvxfer import Agent, KvxferError

    # The crasher names peer "seed" and pairs with this cache (the fuzz worker's victim).
    dst = np.full((8, 4096), SENTINEL, np.uint8)
    src = np.random.default_rng(7).integers(0, 256, (8, 4096), dtype=np.uint8)
    out: dict[str, Any] = {}
    with Agent("victim", backend="nixl", timeout=60, prove_metadata=prove) as victim, \
            Agent("seed", backend="nixl", timeout=60, prove_metadata=prove) as seed:
        victim.register({"kv": dst}, replicated=True)
        seed.register({"kv": src}, replicated=True)
        print(json.dumps({"sending": "crasher"}), flush=True)
        try:
            victim.add_peer(Path(crasher).read_bytes())
            out["crasher"] = "accepted"
        except KvxferError as exc:
            out["crasher"], out["message"] = type(exc).__name__, str(exc)
        out["peers_after"] = sorted(victim.peers)
        victim.add_peer(seed.metadata())
        before = dst.copy()
        d, s = [0, 3, 4, 7], [6, 6, 1, 0]
        victim.read("seed", d, s).wait()
        expected = before.copy()
        expected[d] = src[s]  # the reference: numpy indexing over the two arrays
        out["moved"] = bool(np.array_equal(dst[d], src[s]))
        out["rest_untouched"] = bool(np.array_equal(dst, expected)) and bool((dst[[1, 2, 5, 6]] == SENTINEL).all())
        out["prover"] = dict(victim.backend._prover.stats) if prove else None
    return out


def run(prove: bool) -> tuple[int, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins"),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(CRASHER), "1" if prove else "0"], capture_output=True,
                          text=True, env=env, timeout=600)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return proc.returncode, lines[-1] if lines else {}


@pytest.mark.timeout(900)
def test_a_blob_that_crashes_nixl_is_refused_and_the_genuine_peer_still_moves_bytes() -> None:
    rc, out = run(prove=True)
    assert rc == 0, f"the process that was sent the crasher died ({rc}): {out}"
    assert out["crasher"] in ("MetadataCrashError", "MetadataError"), out
    assert out["peers_after"] == [], out  # nothing of the crasher was kept
    assert out["moved"] and out["rest_untouched"], out
    # It never reached NIXL here: the helper crashed on it, or its NIXL refused it.
    assert out["prover"].get("crashed", 0) + out["prover"].get("refused", 0) >= 1, out


@pytest.mark.timeout(900)
def test_without_the_prover_the_saved_input_really_crashes_nixl() -> None:
    """What makes the test above meaningful. Up to three tries: NIXL's crash is a bad read."""
    outcomes = []
    for _ in range(3):
        rc, out = run(prove=False)
        outcomes.append((rc, out))
        if rc < 0:
            break
    rc, out = outcomes[-1]
    assert rc < 0 and signal.Signals(-rc) in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT), outcomes
    assert out == {"sending": "crasher"}, "it died while loading the crasher"


if __name__ == "__main__":
    print(json.dumps(scenario(sys.argv[1], sys.argv[2] == "1")), flush=True)


def test_the_helper_of_a_progress_thread_backend_runs_no_progress_thread() -> None:
    """NIXL's progress thread polls without pause: in an idle helper it would take a core for
    the helper's whole life (one did, for the rest of a test session). Proving only adds and
    removes peers, so the helper's backend never runs it, and both settings share one helper."""
    from kvxfer_nixl.backend import NixlBackend

    with_thread = NixlBackend("prove-pt-on", progress_thread=True, prove_metadata="auto")
    without = NixlBackend("prove-pt-off", progress_thread=False, prove_metadata="auto")
    try:
        assert with_thread._prover is not None
        assert json.loads(with_thread._prover.options)["progress_thread"] is False
        assert with_thread._prover is without._prover
    finally:
        with_thread.close()
        without.close()
