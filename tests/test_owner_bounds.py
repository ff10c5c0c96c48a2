"""What an :class:`kvxfer.Owner` keeps: nothing for names that held nothing, no fetched blob.

An engine's owner lives as long as the engine. A route per name ever submitted (every one a
typo, a stale name, a hostile request id) and the last fetched metadata blob held by the
loop would both grow or stay without bound. Each test has its control: the same steps with
the forgetting (or the dropping) undone keep what the fix frees. Transfers move real bytes
(loopback), checked against numpy indexing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import numpy as np
import pytest

from kvxfer import Agent, Owner
from kvxfer.errors import InvalidArgumentError, MetadataError, UnknownPeerError

pytestmark = pytest.mark.timeout(120)
NAMES = 2000


def until(cond: Callable[[], bool], tries: int = 3000) -> bool:
    """Whether a state comes (never a duration): polled every 10 ms, ``tries`` times."""
    for _ in range(tries):
        if cond():
            return True
        time.sleep(0.01)
    return False


def _owner() -> tuple[Agent, Owner, np.ndarray, np.ndarray]:
    src = np.arange(8 * 64, dtype=np.uint32).astype(np.uint8).reshape(8, 64)
    dst = np.full((8, 64), 0xAA, np.uint8)
    a, b = Agent("prefill"), Agent("decode")
    a.register({"kv": src})
    b.register({"kv": dst})
    owner = Owner(b)
    owner.add_peer(a.metadata()).result(10)
    return a, owner, src, dst


def _unknown_names(monkeypatch: pytest.MonkeyPatch, control: bool) -> int:
    if control:
        monkeypatch.setattr(Owner, "_forget_idle", lambda self, route: None)
    a, owner, src, dst = _owner()
    try:
        for i in range(NAMES):
            with pytest.raises(UnknownPeerError):
                owner.read(f"nobody-{i}", [0], [1]).wait(10)
        # The known peer still works, and only the blocks asked for changed.
        owner.read("prefill", [2, 5], [7, 0]).wait(10)
        want = np.full_like(dst, 0xAA)
        want[[2, 5]] = src[[7, 0]]
        assert (dst == want).all()
        return owner.call(lambda _a: sum(k.startswith("nobody-") for k in owner._routes)).result(10)
    finally:
        owner.close()
        a.close()


def test_unknown_peer_names_leave_no_route(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _unknown_names(monkeypatch, False) == 0


def test_control_without_forgetting_every_name_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _unknown_names(monkeypatch, True) == NAMES


def _fetched_blob_kept(monkeypatch: pytest.MonkeyPatch, control: bool) -> bool:
    if control:  # the loop as it was: the last op it applied stayed in a variable while it waited
        def keep_last(self: Owner, ops: Any) -> None:
            while ops:
                op = ops.popleft()
                self._apply(op)
                self._last_op = op
        monkeypatch.setattr(Owner, "_apply_all", keep_last)
    blob = b"\x00not metadata" * (1 << 20)  # 13 MiB a peer's directory entry returned
    fetch = lambda: blob  # noqa: E731
    baseline = sys.getrefcount(blob)
    a, owner, _, dst = _owner()
    try:
        owner.route("far", fetch)
        t = owner.read("far", [0], [1])
        with pytest.raises(MetadataError):
            t.wait(10)
        assert (dst == 0xAA).all()  # nothing moved
        del t  # the caller's failed transfer (its error's traceback) is the caller's to keep
        return not until(lambda: sys.getrefcount(blob) == baseline, tries=300)
    finally:
        owner.close()
        a.close()


def test_the_loop_keeps_no_fetched_blob(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _fetched_blob_kept(monkeypatch, False)


def test_control_a_loop_that_keeps_its_last_op_keeps_the_blob(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _fetched_blob_kept(monkeypatch, True)


def test_owner_arguments_are_typed() -> None:
    a, owner, src, dst = _owner()
    try:
        for call in (lambda: owner.read("prefill", [0], [1], notify="x"),  # type: ignore[arg-type]
                     lambda: owner.write("prefill", [0], [1], notify=5),  # type: ignore[arg-type]
                     lambda: owner.read(None, [0], [1]),  # type: ignore[arg-type]
                     lambda: owner.read(["x"], [0], [1]),  # type: ignore[arg-type]
                     lambda: owner.notify("prefill", 10**12),  # type: ignore[arg-type]
                     lambda: owner.route("k", b"not callable"),  # type: ignore[arg-type]
                     lambda: Owner(a, burst=0),
                     lambda: Owner("not an agent")):  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError):
                call()
        assert (dst == 0xAA).all()
        owner.read("prefill", [3], [4], notify=b"x").wait(10)  # control: the right types go through
        assert (dst[3] == src[4]).all() and (np.delete(dst, 3, axis=0) == 0xAA).all()
    finally:
        owner.close()
        a.close()
