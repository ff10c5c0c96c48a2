"""A worker of its own for each same-host RMA peer, and when it may go.

Without hardware RMA, UCX emulates a GET over the ``posix`` transport's active messages: the
peer writes the reply into the reader's receive queue, one queue per worker shared by every
peer. A writer claims a slot, fills it, then marks it ready, and the reader takes slots in
order only. A peer killed between claim and mark leaves a slot that never becomes ready, and
every later message, from every peer, waits behind it for good: one kill wedged the agent for
all its peers (RELIABILITY.md, "Peer killed mid-transfer"). So each same-host RMA peer gets a
worker of its own (same context, so the same registrations and remote keys; its own receive
queue), and a dead peer's worker is destroyed with whatever it blocked.

A *live* peer's worker is not destroyed when the peer is removed: the peer may still be
wiring up to it, and UCX crashed such a peer (SIGSEGV) when the worker it wired up to was
gone (``test_ucx_processes.py::test_release_of_a_stuck_transfer_stops_it``). It is kept,
progressed, reused if that process is added again, and destroyed once the process is gone:
at most one per live peer process and agent.

Except a worker *fenced* off: its endpoint was forced closed because a cancelled GET did not
settle (the peer stopped answering). UCX can still complete that GET into our memory when the
worker is progressed and the peer answers at last (seen: a stopped peer resumed, was added
again, and its stale reply landed through the reused worker after the READ had ended). A
fenced worker is therefore never progressed nor reused; it is destroyed once its process is
gone (the fence, issue 30).
"""

from __future__ import annotations

from ._hostpage import ProcessWatch
from ._worker import Worker

__all__ = ["PeerWorkers"]


class PeerWorkers:
    """The agent's main worker's companions: one per same-host RMA peer, plus retired ones."""

    def __init__(self, main: Worker) -> None:
        self.main = main
        self._retired: list[tuple[ProcessWatch, Worker]] = []
        self._fenced: list[tuple[ProcessWatch, Worker]] = []  # never progressed, never reused

    def for_peer(self, watch: ProcessWatch) -> Worker:
        """The worker kept for this process, if any, else a new one."""
        for i, (old, w) in enumerate(self._retired):
            if (old.pid, old.start) == (watch.pid, watch.start) and old.alive(force=True):
                del self._retired[i]
                return w
        return self.main.spawn()

    def retire(self, w: Worker, watch: ProcessWatch | None, fenced: bool = False) -> None:
        """``w``'s endpoint is closed and no request on it is ours any more: destroy it if the
        peer's process is gone, else keep it until it is (``fenced``: without progressing it)."""
        if w is self.main:
            return
        if watch is None or not watch.alive(force=True):
            w.close()
        else:
            (self._fenced if fenced else self._retired).append((watch, w))

    def progress(self) -> None:
        """Serve what live removed peers still send; destroy the workers of dead ones."""
        if self._fenced:
            for _, w in [f for f in self._fenced if not f[0].alive()]:
                w.close()
            self._fenced = [f for f in self._fenced if f[0].alive()]
        if not self._retired:
            return
        kept = []
        for watch, w in self._retired:
            if watch.alive():
                w.progress()
                kept.append((watch, w))
            else:
                w.close()
        self._retired = kept

    def fifos(self) -> list[tuple[int, str, str] | None]:
        """The receive queues of the retired workers still kept."""
        return [w.fifo for _, w in self._retired]

    def close(self) -> None:
        for _, w in self._retired + self._fenced:
            w.close()
        self._retired.clear()
        self._fenced.clear()
