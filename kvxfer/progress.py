"""Delivery of notifications when nobody polls: one helper thread, written once, for any backend.

Some transports send a transfer's notification only while the initiator looks at the
transfer (NIXL sends it from inside its status call; a progress-driven transport needs its
worker driven). A prefill worker that posts a WRITE and goes back to computing would then
leave the decode worker waiting forever. The seam's contract (see :mod:`kvxfer.plugin`)
is that a notification reaches the peer once the data is there *without* the initiator
polling; a backend that cannot promise that by itself hands such transfers to a
:class:`Pump`, which polls them from a short-lived thread (sleeping between polls, never
spinning) until they finish. The thread exists only while such a transfer is pending.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

from .deadlines import Backoff
from .errors import KvxferError

__all__ = ["Pump"]

T = TypeVar("T")


class Pump(Generic[T]):
    """Polls pending handles with ``poll(handle) -> bool`` until each one finishes or fails.

    ``poll`` is called from the pump's thread: it must be safe to call concurrently with
    the owner's own calls (a backend guards its transport with a lock). An error raised by
    ``poll`` ends the handle's pumping; the error stays for the owner's next poll.
    """

    def __init__(self, poll: Callable[[T], bool], name: str = "kvxfer-pump", *, min_sleep: float = 20e-6,
                 max_sleep: float = 1e-3) -> None:
        self._poll = poll
        self._name = name
        self._pending: set[T] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._min, self._max = min_sleep, max_sleep  # the Backoff of each run of the thread
        #: Rounds of the thread so far (each a wake-up and a poll of every handle): what a test
        #: counts to show an idle owner's thread does not run, without timing anything.
        self.steps = 0

    def add(self, handle: T) -> None:
        with self._cond:
            if self._stopped:
                return
            self._pending.add(handle)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def discard(self, handle: T) -> None:
        with self._cond:
            self._pending.discard(handle)

    def __len__(self) -> int:
        with self._cond:
            return len(self._pending)

    def stop(self, timeout: float = 5.0) -> None:
        """Forget every handle and end the thread (idempotent)."""
        with self._cond:
            self._stopped = True
            self._pending.clear()
            self._cond.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=timeout)

    def _run(self) -> None:
        backoff = Backoff(self._min, self._max)
        while True:
            with self._cond:
                if not self._pending and not self._stopped:
                    self._cond.wait(timeout=1.0)
                if self._stopped or not self._pending:
                    self._thread = None
                    return
                batch = list(self._pending)
                self.steps += 1
            for h in batch:
                try:
                    finished = self._poll(h)
                except KvxferError:
                    finished = True
                except Exception:  # a backend bug must not kill the thread silently for others
                    finished = True
                if finished:
                    self.discard(h)
            backoff.pause()
