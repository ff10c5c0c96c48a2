"""Loopback's posts go through :class:`kvxfer.plugin.PathBackend`'s loop, its rows only copy.

The proof is a hook of the loop: a ``landed`` that refuses DONE must be honoured by a loopback
READ. Control: a loopback whose ``poll`` bypasses the loop (the hand-written poll it had before,
True for a finished host copy) reports DONE with the same refusing hook in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvxfer import Agent, StalePeerError
from kvxfer.plugin import Post
from kvxfer_loopback.backend import LoopbackBackend

SENTINEL = 0xAA
ROWS, ROW = 8, 4096


def _refuse(self: LoopbackBackend, x: Post) -> None:
    raise StalePeerError("refused by the test's landed hook")


@pytest.mark.parametrize("bypass", [False, True], ids=["landed-refuses", "control-loop-bypassed"])
def test_a_landed_hook_refusing_done_is_honoured(monkeypatch: pytest.MonkeyPatch, bypass: bool) -> None:
    monkeypatch.setattr(LoopbackBackend, "landed", _refuse, raising=False)
    if bypass:
        def own_poll(self: LoopbackBackend, xfer: Any) -> bool:
            return bool(xfer.path.poll(xfer.h))  # the row's answer, without the loop's hooks

        monkeypatch.setattr(LoopbackBackend, "poll", own_poll)
    src = np.random.default_rng(7).integers(0, 256, (ROWS, ROW), dtype=np.uint8)
    dst = np.full((ROWS, ROW), SENTINEL, np.uint8)
    ref = dst.copy()
    ref[[1, 6]] = src[[3, 2]]  # what a READ of remote [3, 2] into local [1, 6] leaves, by indexing
    with Agent("p", backend="loopback") as a, Agent("d", backend="loopback") as b:
        a.register({"layer.0": src})
        b.register({"layer.0": dst})
        peer = b.add_peer(a.metadata())
        t = b.read(peer, [1, 6], [3, 2])
        if bypass:
            t.wait(10)  # the bad outcome: DONE although the hook refused it
        else:
            with pytest.raises(StalePeerError, match="refused by the test's landed hook"):
                t.wait(10)
    # The host row copies inside post, before the loop asks the hook: the bytes are there either
    # way, and nothing else was touched.
    np.testing.assert_array_equal(dst, ref)
    assert (np.delete(dst, [1, 6], axis=0) == SENTINEL).all()
