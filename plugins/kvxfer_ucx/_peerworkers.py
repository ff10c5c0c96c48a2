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

    def for_peer(self, watch: ProcessWatch) -> Worker:
        """The worker kept for this process, if any, else a new one."""
        for i, (old, w) in enumerate(self._retired):
            if (old.pid, old.start) == (watch.pid, watch.start) and old.alive(force=True):
                del self._retired[i]
                return w
        return self.main.spawn()

    def retire(self, w: Worker, watch: ProcessWatch | None) -> None:
        """``w``'s endpoint is closed and no request on it is ours any more: destroy it if the
        peer's process is gone, else keep it until it is."""
        if w is self.main:
            return
        if watch is None or not watch.alive(force=True):
            w.close()
        else:
            self._retired.append((watch, w))

    def progress(self) -> None:
        """Serve what live removed peers still send; destroy the workers of dead ones."""
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
        for _, w in self._retired:
            w.close()
        self._retired.clear()
