"""The fence on the UCX RMA route (issue 30): the control of the kit's stopped-peer case.

The kit's case runs in every two-process class of ``test_ucx_backend.py``. Here the fix is
switched off: a worker fenced off by a forced close is again progressed and reused like any
retired one, and the stale GET of the timed-out READ lands once the peer resumes.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvxfer.testing import TwoProcessConformance

pytest.importorskip("kvxfer_ucx._libucp")


class _Rma(TwoProcessConformance):
    backend = "ucx"
    options: dict[str, Any] = {"same_host_copy": False}
    # The control waits for the stale GET to land, and stops waiting once it has: a longer watch
    # costs nothing when it lands, and a loaded machine (CI's 2 cores at the end of the suite)
    # delivers it later than 1 s after the resume.
    stop_watch = 5.0


def test_control_a_reused_fenced_worker_lands_the_stale_get(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer_ucx._peerworkers import PeerWorkers

    retire = PeerWorkers.retire
    monkeypatch.setattr(PeerWorkers, "retire", lambda self, w, watch, fenced=False: retire(self, w, watch))
    for _ in range(3):  # the stale GET is a race with the resume: up to three tries to see it land
        try:
            _Rma().test_stopped_peer_writes_nothing_after_the_end("timeout")
        except AssertionError as exc:
            assert "written after it reported" in str(exc), exc
            return
    pytest.fail("with the fenced worker reused, the stale GET never landed in three tries")
