"""Who is proven: a signed peer never waits on the prover, an unauthenticated one always does.

The vLLM suite once saw a genuine peer called hostile because the prover's helper was
starved of CPU. Metadata signed with the agent's token comes from a token holder and is
loaded without proving (``prove_metadata="auto"``, the default). Here the process's helper is
stopped outright (SIGSTOP, the worst starvation): a signed peer still loads and moves bytes
checked against numpy indexing; an unauthenticated peer is refused with a typed error that
blames the helper, not the bytes (the control: the stall is real), and once the helper runs
again the same metadata loads.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import numpy as np
import pytest

pytest.importorskip("kvxfer_nixl.backend", reason="nixl is not installed: pip install -e '.[nixl]'")

from kvxfer import Agent  # noqa: E402
from kvxfer.tokens import NO_AUTH  # noqa: E402
from kvxfer.errors import ProverUnavailableError  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]
SENTINEL = 0xAA
TOKEN = "a shared secret of the test"


def pair(token: Any, tag: str) -> tuple[Agent, Agent, np.ndarray, np.ndarray]:
    dec = Agent(f"decode-{tag}", backend="nixl", timeout=60, token=token, prove_metadata="auto")
    pre = Agent(f"prefill-{tag}", backend="nixl", timeout=60, token=token, prove_metadata="auto")
    dst = np.full((8, 4096), SENTINEL, np.uint8)
    src = np.random.default_rng(11).integers(0, 256, (8, 4096), dtype=np.uint8)
    dec.register({"kv": dst}, tp_rank=0, tp_size=1)
    pre.register({"kv": src}, tp_rank=0, tp_size=1)
    return dec, pre, dst, src


def read_and_check(dec: Agent, peer: str, dst: np.ndarray, src: np.ndarray) -> None:
    before = dst.copy()
    d, s = [0, 3, 4, 7], [6, 6, 1, 0]
    dec.read(peer, d, s).wait()
    expected = before.copy()
    expected[d] = src[s]
    assert np.array_equal(dst, expected)
    assert (dst[[1, 2, 5, 6]] == SENTINEL).all()


@pytest.fixture
def stopped_helper() -> Iterator[Any]:
    """The prover the agents below use, with its helper started and then SIGSTOPped."""
    probe = Agent("probe-owner", backend="nixl", timeout=60, prove_metadata="auto")
    prover = probe.backend._prover
    prover.start()
    pid = prover.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield prover
    finally:
        os.kill(pid, signal.SIGCONT)
        probe.close()


def test_a_signed_peer_loads_while_the_prover_is_stopped(stopped_helper: Any) -> None:
    prover = stopped_helper
    dec, pre, dst, src = pair(TOKEN, "signed")
    try:
        assert dec.backend._prover is prover and dec.backend.peers_authenticated
        before = dict(prover.stats)
        dec.add_peer(pre.metadata(), timeout=5)
        read_and_check(dec, pre.name, dst, src)
        assert dict(prover.stats) == before, "a signed blob went through the prover"
    finally:
        dec.close()
        pre.close()


def test_control_an_unauthenticated_peer_waits_for_the_prover(stopped_helper: Any) -> None:
    prover = stopped_helper
    dec, pre, dst, src = pair(NO_AUTH, "open")
    try:
        assert dec.backend._prover is prover and not dec.backend.peers_authenticated
        with pytest.raises(ProverUnavailableError) as info:
            dec.add_peer(pre.metadata(), timeout=3)
        assert info.value.reason == "stopped", info.value
        assert pre.name not in dec.peers
        os.kill(prover.pid, signal.SIGCONT)  # the helper runs again: its verdict arrives, then loads
        for _ in range(600):
            try:
                dec.add_peer(pre.metadata(), timeout=30)
                break
            except ProverUnavailableError:
                time.sleep(0.1)
        read_and_check(dec, pre.name, dst, src)
    finally:
        dec.close()
        pre.close()
