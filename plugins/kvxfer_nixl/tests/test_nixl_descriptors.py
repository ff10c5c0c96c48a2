"""Re-adding an unchanged peer reuses its NIXL load: descriptors stay flat (:mod:`kvxfer_nixl._parking`).

NIXL 1.5.1 keeps two descriptors of every ``add_remote_agent`` for the process's life,
``remove_remote_agent`` or not, so a decode that removes and re-adds a peer used to run into
its descriptor limit (RELIABILITY.md, "Descriptors").
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer import Agent

nb = pytest.importorskip("kvxfer_nixl.backend", reason="nixl is not installed: pip install 'kvxfer[nixl]'")

pytestmark = pytest.mark.nixl
SENT = 0xAA


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _cycles(n: int) -> tuple[int, np.ndarray, np.ndarray]:
    """``n`` remove + re-add cycles of one unchanged peer; then a READ. Returns the
    descriptors gained, the destination and the source."""
    with Agent("dec", backend="nixl", timeout=30, prove_metadata=False) as dec, \
            Agent("pre", backend="nixl", timeout=30, prove_metadata=False) as pre:
        dst = np.full((8, 4096), SENT, np.uint8)
        src = np.random.default_rng(5).integers(0, 256, (8, 4096), dtype=np.uint8)
        dec.register({"kv": dst}, tp_rank=0, tp_size=1)
        pre.register({"kv": src}, tp_rank=0, tp_size=1)
        md = pre.metadata()
        name = dec.add_peer(md)
        dec.read(name, [0], [0]).wait()
        dst[:] = SENT
        before = _fds()
        for _ in range(n):
            dec.remove_peer(name)
            name = dec.add_peer(md)
        gained = _fds() - before
        dec.read(name, [1, 6], [3, 0]).wait()
        return gained, dst.copy(), src.copy()


def test_200_remove_and_add_cycles_keep_descriptors_flat() -> None:
    gained, dst, src = _cycles(200)
    expected = np.full_like(dst, SENT)
    expected[[1, 6]] = src[[3, 0]]
    np.testing.assert_array_equal(dst, expected)  # the reused load moves the right bytes
    assert gained < 8, f"{gained} descriptors gained over 200 cycles"


def test_control_without_reuse_the_cycles_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same cycles with reuse turned off: NIXL's leak is there and the count sees it."""
    monkeypatch.setattr(nb.NixlBackend, "_reusable", lambda self, peer, blob: None)
    gained, _, _ = _cycles(40)
    assert gained >= 40, gained


def test_a_changed_peer_is_loaded_afresh() -> None:
    """A peer whose metadata changed (it registered more memory) is not served by its parked
    load: the new registration is readable, so the blob really was loaded again."""
    with Agent("dec", backend="nixl", timeout=30, prove_metadata=False) as dec, \
            Agent("pre", backend="nixl", timeout=30, prove_metadata=False) as pre:
        dst = np.full((4, 4096), SENT, np.uint8)
        a = np.random.default_rng(1).integers(0, 256, (4, 4096), dtype=np.uint8)
        b = np.random.default_rng(2).integers(0, 256, (4, 4096), dtype=np.uint8)
        dec.register({"kv": dst}, tp_rank=0, tp_size=1)
        pre.register({"kv": a}, tp_rank=0, tp_size=1)
        name = dec.add_peer(pre.metadata())
        dec.read(name, [0], [1]).wait()
        np.testing.assert_array_equal(dst[0], a[1])
        dec.remove_peer(name)
        pre.deregister()
        pre.register({"kv": b}, tp_rank=0, tp_size=1)
        name = dec.add_peer(pre.metadata())
        dec.read(name, [2], [3]).wait()
        np.testing.assert_array_equal(dst[2], b[3])
        assert (dst[[1, 3]] == SENT).all()
