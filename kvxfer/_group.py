"""Several transfers that make one request: done when all are, failed when any fails.

A decode rank of a smaller TP size gathers its heads from several prefill ranks, and a
decode rank of a smaller PP size gathers layers from several stages; each peer is its own
:class:`~kvxfer.transfer.Transfer`. The caller wants one handle, so the request is neither
half-used nor leaked: a failure or timeout of one part cancels the others.
"""

from __future__ import annotations

import time
from typing import Mapping

from .deadlines import Deadline
from .errors import TransferTimeoutError
from .transfer import Status, Transfer, TransferStats

__all__ = ["TransferGroup"]


class TransferGroup:
    """One request over several peers: ``parts`` maps each peer read to its transfer.

    ``unread`` lists the peers given that hold nothing this rank needs (they were told at
    once when a notification was asked for, so they can free their blocks).
    """

    def __init__(self, parts: Mapping[str, Transfer], unread: list[str], default_timeout: float, *,
                 started: float | None = None):
        self.parts = dict(parts)
        self.unread = unread
        self._default_timeout = default_timeout
        self._started = time.perf_counter() if started is None else started
        self._wall: float | None = 0.0 if not self.parts else None
        self._error: BaseException | None = None
        self.status = Status.DONE if not self.parts else Status.PENDING

    def __repr__(self) -> str:
        return f"<TransferGroup {self.status.value} {len(self.parts)} parts {self.stats.nbytes} bytes>"

    @property
    def stats(self) -> TransferStats:
        """The request's cost, with its three times kept apart so none hides in another.

        ``plan_seconds``: planning and list preparation, summed over parts (each part counts
        only its own); ``post_seconds``: handing posts to the backend, summed; ``seconds``:
        the slowest part's, first post to DONE; ``wall_seconds``: from the call to DONE
        observed (None while pending). Field names are those of a single transfer's stats,
        so the Prometheus histograms and the vLLM stats read a group like a transfer.
        """
        ts = [t.stats for t in self.parts.values()]
        secs = [s.seconds for s in ts]
        return TransferStats(sum(s.descriptors for s in ts), sum(s.nbytes for s in ts), sum(s.posts for s in ts),
                             sum(s.plan_seconds for s in ts),
                             max(secs) if ts and all(s is not None for s in secs) else None,  # type: ignore[type-var]
                             ts[0].path if ts else None, post_seconds=sum(s.post_seconds for s in ts),
                             backend=ts[0].backend if ts else "", op=ts[0].op if ts else "",
                             mode=ts[0].mode if len(ts) == 1 else "gather", wall_seconds=self._wall)

    def done(self) -> bool:
        """Poll every pending part once; raises the first part's error (the others are cancelled)."""
        if self.status is Status.DONE:
            return True
        if self._error is not None:
            raise self._error
        pending = False
        for t in self.parts.values():
            try:
                pending |= not t.done()
            except BaseException as exc:
                self._abort(exc, Status.CANCELLED if t.status is Status.CANCELLED else Status.FAILED)
        if not pending:
            self.status = Status.DONE
            self._wall = time.perf_counter() - self._started
        return not pending

    def wait(self, timeout: float | None = None) -> "TransferGroup":
        """Block until every part is done, at most ``timeout`` seconds for all of them together."""
        limit = self._default_timeout if timeout is None else timeout
        deadline = Deadline.within(limit)
        spins = 0
        while not self.done():
            if time.monotonic() >= deadline:
                self._abort(TransferTimeoutError(
                    f"{len(self.parts)}-peer transfer did not finish within {limit:g} s; every part was cancelled. "
                    "Check that the peers are alive and progressing."), Status.FAILED)
            spins += 1
            if spins > 64:
                time.sleep(min(1e-3, 1e-6 * (spins - 64)))
        return self

    def cancel(self) -> None:
        """Cancel every part still pending. A finished group stays DONE."""
        if self.status is Status.PENDING:
            for t in self.parts.values():
                t.cancel()
            self.status = Status.CANCELLED

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _abort(self, exc: BaseException, status: Status) -> None:
        for t in self.parts.values():
            t.cancel()
        self._error = exc
        self.status = status
        raise exc
