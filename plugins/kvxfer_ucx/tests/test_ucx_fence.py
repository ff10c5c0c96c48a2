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


def test_control_a_reused_fenced_worker_lands_the_stale_get(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer_ucx._peerworkers import PeerWorkers

    retire = PeerWorkers.retire
    monkeypatch.setattr(PeerWorkers, "retire", lambda self, w, watch, fenced=False: retire(self, w, watch))
    with pytest.raises(AssertionError, match="written after it reported"):
        _Rma().test_stopped_peer_writes_nothing_after_the_end("timeout")
