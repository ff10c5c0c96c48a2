"""The fence over NIXL (issue 30): nothing lands after a transfer's end, over UCX's TCP transport too.

Over ``UCX_TLS=tcp`` a GET is answered by the target's process and cannot be recalled, so a
READ from a peer that stops (SIGSTOP) and resumes used to land after its timeout. The kit's
stopped-peer case runs here over TCP, directly and through an Owner; the control runs the
same case with the fence off (``fence_reads=False``) and shows the late bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvxfer.testing import BackendConformance, TwoProcessConformance

pytestmark = pytest.mark.nixl
nixl = pytest.importorskip("nixl", reason="nixl is not installed: pip install -e '.[nixl]'")

from kvxfer_nixl._bounce import expand, needs_fence  # noqa: E402


class _OverTcp:
    """Both processes restricted to UCX's TCP transport (this one set before its agent exists)."""

    peer_env = {"UCX_TLS": "tcp"}

    @pytest.fixture(autouse=True)
    def _tcp(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("UCX_TLS", "tcp")

    @pytest.mark.parametrize("remote_kind,local_kind", [("packed", "layers")])
    def test_read_from_other_process(self, remote_kind: str, local_kind: str) -> None:
        """One layout pair over TCP, the one whose rows split (each case starts a NIXL peer, about
        5 s on CI): layouts are the planner's, run in every pairing by test_nixl_backend.py and,
        fenced, by TestNixlFencedEverywhere below."""
        super().test_read_from_other_process(remote_kind, local_kind)  # type: ignore[misc]


class TestNixlTwoProcessTcp(_OverTcp, TwoProcessConformance):
    backend = "nixl"
    options: dict[str, Any] = {}


class TestNixlTwoProcessTcpOwner(_OverTcp, TwoProcessConformance):
    """Through an Owner over TCP, only the READs the fence bounces: the kit's other cases run
    through an Owner in test_nixl_backend.py (TestNixlTwoProcessOwner) and over TCP above
    (TestNixlTwoProcessTcp); repeating them here cost CI about 20 s."""

    backend = "nixl"
    options: dict[str, Any] = {}
    owned = True
    test_write_with_notification = None  # type: ignore[assignment]
    test_standalone_notify_reaches_a_busy_peer = None  # type: ignore[assignment]
    test_dead_peer_is_reported_not_waited_on = None  # type: ignore[assignment]
    test_peer_killed_mid_write = None  # type: ignore[assignment]


class TestNixlFencedEverywhere(BackendConformance):
    """The one-process kit with every READ fenced and cut into pieces of two descriptors:
    the bounce area under split posts, strided lists, notifications and cancel."""

    backend = "nixl"
    options: dict[str, Any] = {"fence_reads": True, "request_descriptors": 2}


class _Unfenced(_OverTcp, TwoProcessConformance):
    backend = "nixl"
    options: dict[str, Any] = {"fence_reads": False}
    # The control waits for the late bytes and stops once they land: a longer watch costs
    # nothing then, and CI's loaded end of suite delivered them later than 1 s after the resume.
    stop_watch = 5.0


@pytest.mark.parametrize("end", ["timeout", "cancel"])
def test_control_unfenced_reads_over_tcp_land_after_the_end(end: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the kit's case with the fence off fails: the resumed peer's bytes land late."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    for _ in range(3):  # the late bytes race the resume: up to three tries to see them land
        try:
            _Unfenced().test_stopped_peer_writes_nothing_after_the_end(end)
        except AssertionError as exc:
            assert "written after it reported" in str(exc), exc
            return
    pytest.fail("with the fence off, no late byte landed in three tries")


def test_which_peers_are_fenced(monkeypatch: pytest.MonkeyPatch) -> None:
    """TCP alone is fenced; a transport that completes GETs without the target is not."""
    import kvxfer_nixl._bounce as bounce

    monkeypatch.setattr(bounce, "_rdma_here", lambda: False)
    assert needs_fence(True, "tcp") and needs_fence(False, "tcp") and needs_fence(True, "self,tcp")
    assert not needs_fence(True, "tcp,sm") and not needs_fence(True, "cma,tcp") and not needs_fence(True, "")
    assert needs_fence(False, "") and needs_fence(False, "^cuda") and needs_fence(False, "rc,tcp")
    monkeypatch.setattr(bounce, "_rdma_here", lambda: True)
    assert not needs_fence(False, "") and not needs_fence(False, "rc,tcp") and needs_fence(False, "tcp")


def test_strided_rows_expand_as_nixl_indexes_them() -> None:
    rows = np.array([[1000, 8, 0, 100, 3], [5000, 4, 0, 4, 1]], dtype=np.uint64)
    want = np.array([[1000, 8, 0], [1100, 8, 0], [1200, 8, 0], [5000, 4, 0]], dtype=np.uint64)
    np.testing.assert_array_equal(expand(rows), want)
    np.testing.assert_array_equal(expand(want), want)


def _cancel_while_copying_out(monkeypatch: pytest.MonkeyPatch, fenced: bool) -> bool:
    """A fenced READ whose every piece is DONE, cancelled while another thread holds the path's
    lock (as a poll does while it copies the landing area out): whether the cancel returned
    before that thread let go of the lock."""
    import threading
    from types import SimpleNamespace

    from kvxfer import Op
    from kvxfer_nixl import _xfer
    from kvxfer_nixl._bounce import Bounce

    if not fenced:  # the control: the fast path's Bounce check bypassed
        monkeypatch.setattr(_xfer, "Bounce", type("NotBounce", (), {}))
    lock = threading.RLock()
    path = _xfer.NixlPath(SimpleNamespace(), lock, 16)
    one = np.zeros(1, np.int32)
    x = _xfer.NixlXfer(Op.READ, Bounce.__new__(Bounce), one, SimpleNamespace(nixl=1), one, b"", "p")
    x.next = 1  # posted and DONE, its landing area taken by the copy-out (bounce None, nothing live)
    holding, copied = threading.Event(), threading.Event()

    def copy_out() -> None:
        with lock:
            holding.set()
            copied.wait(30)

    holder = threading.Thread(target=copy_out)
    holder.start()
    holding.wait(30)
    canceller = threading.Thread(target=path.cancel, args=(x,))
    canceller.start()
    canceller.join(0.3 if fenced else 30)  # not a timing: the cancel either waits for the lock or it does not
    returned_early = not canceller.is_alive()
    copied.set()
    holder.join(30)
    canceller.join(30)
    assert x.released
    return returned_early


def test_cancel_of_a_fenced_read_waits_for_its_copy_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """NixlPath.cancel skips the lock for a finished post (the hot path), never for a fenced READ:
    its release must not return while the landing area is still being copied to the destination."""
    assert not _cancel_while_copying_out(monkeypatch, fenced=True)


def test_control_cancel_without_the_fence_check_returns_mid_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _cancel_while_copying_out(monkeypatch, fenced=False)
