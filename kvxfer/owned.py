"""What an :class:`~kvxfer.owner.Owner` hands its callers: future-like, safe from any thread.

A caller on an engine's model thread must never wait for the network, so it gets a handle
at once and asks later: :meth:`OwnedFuture.done` (never blocks), :meth:`~OwnedFuture.wait`,
:meth:`~OwnedFuture.add_done_callback` and ``await`` in asyncio. The owner's thread is the
only one that finishes a handle; every other thread only reads it or asks the owner to act.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Any, Callable, Generator, Generic, Protocol, TypeVar

from . import _direct
from .deadlines import Deadline, check_timeout
from .errors import KvxferError, TransferTimeoutError
from .transfer import Status, TransferStats

__all__ = ["OwnedFuture", "OwnedTransfer"]


class HandleOwner(Protocol):
    """What a handle asks of the :class:`~kvxfer.owner.Owner` it came from (a Protocol here,
    so this module needs nothing from the one that imports it)."""

    def _check_not_loop(self, what: str) -> None: ...

    def _cancel(self, t: "OwnedTransfer") -> None: ...

    def _kick(self) -> None: ...

log = logging.getLogger("kvxfer.owner")
T = TypeVar("T")
F = TypeVar("F", bound="OwnedFuture[Any]")


class _Flag:
    """A one-shot event, cheaper than :class:`threading.Event` (one lock, no condition)."""

    __slots__ = ("_set", "_lock")

    def __init__(self) -> None:
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        """A second set is a no-op (the owner's thread and a ``wait_posted`` may both set one)."""
        if not self._set:
            self._set = True
            try:
                self._lock.release()
            except RuntimeError:  # two threads set it at once: it is set either way
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """No spinning first: a waiter polling beside the owner's thread only fights it for the
        GIL (one-block owned READs took twice as long that way)."""
        if self._set:
            return True
        got = self._lock.acquire() if timeout is None else self._lock.acquire(timeout=max(0.0, timeout))
        if got:
            try:
                self._lock.release()  # the next waiter passes too
            except RuntimeError:  # released meanwhile by a second set(): still set
                pass
        return got or self._set


#: Guards every handle's callback list against its finish: held for a list append or swap
#: only, so one lock for all handles costs no waiting, and a handle builds one lock, not two.
_CALLBACKS = threading.Lock()


class OwnedFuture(Generic[T]):
    """The result of one call run on the owner's thread (``add_peer``, ``notify``, ``call``)."""

    _lock = _CALLBACKS

    def __init__(self, owner: "HandleOwner") -> None:
        self._owner = owner
        self._event = _Flag()
        self._callbacks: list[Callable[[Any], None]] = []
        self._value: T | None = None
        self._error: BaseException | None = None
        self._status = Status.PENDING

    @property
    def status(self) -> Status:
        return self._status

    @status.setter
    def status(self, value: Status) -> None:
        self._status = value

    # -- asking ---------------------------------------------------------------------------
    def done(self) -> bool:
        """True once finished; raises the error if it failed. Never blocks."""
        if not self._event.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    @property
    def error(self) -> BaseException | None:
        return self._error

    def result(self, timeout: float | None = None) -> T:
        """Wait (see :meth:`wait`) and return the value."""
        self.wait(timeout)
        return self._value  # type: ignore[return-value]

    def wait(self: F, timeout: float | None = None) -> F:
        """Block until finished, at most ``timeout`` seconds (None: until the owner finishes it,
        which it does by the transfer's deadline). Raises the error if it failed.

        A handle the waiter's own polling finished (:meth:`_help`) waits on nothing."""
        self._owner._check_not_loop("wait")
        limit = None if timeout is None else check_timeout(timeout, "wait timeout")
        event = self._event
        if not event._set:
            until = None if limit is None else Deadline.within(limit)
            self._help(until)
            if not event._set and not event.wait(None if until is None else until.left()):
                self._timed_out(limit)  # type: ignore[arg-type]
        if self._error is not None:  # what done() raises, once finished
            raise self._error
        return self

    def _help(self, until: float | None) -> None:
        """Before waiting: what the waiting thread may do itself (see :class:`OwnedTransfer`)."""

    def _timed_out(self, timeout: float) -> None:
        raise TransferTimeoutError(f"not finished within {timeout:g} s")

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(self)`` once finished: on the owner's thread, or at once on the calling
        thread when already finished. Keep it short; it must not wait on another handle."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        _call(fn, self)

    def __await__(self) -> Generator[Any, None, T]:
        """``await handle`` in asyncio: resumes on the awaiting loop, never blocks it."""
        import asyncio

        if not self._event.is_set():
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def wake(_: Any) -> None:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

            self.add_done_callback(wake)
            yield from fut.__await__()
        self.done()
        return self._value  # type: ignore[return-value]

    # -- finishing (the owner's thread only) ----------------------------------------------
    def _finish(self, status: Status, value: T | None = None, error: BaseException | None = None) -> None:
        if error is not None:
            _detach(error)
        event = self._event
        with _CALLBACKS:
            if event._set:
                return
            self._value, self._error, self._status = value, error, status
            callbacks, self._callbacks = self._callbacks, []
            event.set()
        for fn in callbacks:
            _call(fn, self)


def _detach(exc: BaseException) -> None:
    """Drop the locals of the finished frames an error carries (its cause and context too).

    The error crosses from the owner's thread to a caller, who may keep it (``pytest.raises``,
    a log record) long after the owner closed. Its traceback would keep the loop's frames, and
    through them the transport's native objects (a NIXL transfer handle, its agent), alive in
    a reference cycle; the garbage collector then frees them on whatever thread, in any
    order, after the agent is gone. Cleared here, they are freed by the owner as usual; the
    file and line of every frame stay for the reader.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 16:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips frames still running
        todo += [e.__cause__, e.__context__]


def _call(fn: Callable[[Any], None], arg: Any) -> None:
    try:
        fn(arg)
    except Exception:  # a caller's callback must not stop the owner's loop
        log.exception("kvxfer: a done callback raised")


class OwnedTransfer(OwnedFuture["OwnedTransfer"]):
    """A READ or WRITE submitted to an owner; ``status``, ``error`` and ``stats`` as on a
    :class:`~kvxfer.transfer.Transfer` (``stats`` is None until it was posted)."""

    def __init__(self, owner: "HandleOwner", op: Any, route: str, local_blocks: Any, remote_blocks: Any,
                 notify: bytes | None, deadline: float, timeout: float) -> None:
        OwnedFuture.__init__(self, owner)
        self.op, self.route = op, route
        self.local_blocks, self.remote_blocks, self.notify = local_blocks, remote_blocks, notify
        self.deadline, self.timeout = deadline, timeout
        self.expect: Any = None  # a READ's source digests (kvxfer.integrity), checked after DONE
        self.submitted = time.perf_counter()
        self._inner: Any = None  # the agent's Transfer, once posted: under the owner's engine lock only
        self._ended = False  # claimed by whoever ends it, under the engine lock (kvxfer._direct)
        # Posted (or finished without being posted): a flag made only for wait_posted(), which few
        # callers use; the owner sets ``posted`` and then the flag if one exists (see _mark_posted).
        self.posted = False
        self._posted: _Flag | None = None

    def __repr__(self) -> str:
        return f"<OwnedTransfer {self.status.value} {self.op.value} from {self.route!r}>"

    def _timed_out(self, timeout: float) -> None:
        self.cancel()  # as Transfer.wait: a wait that gives up cancels, so nothing writes later
        if self.status is Status.DONE:
            return
        from .transfer import stall_advice

        raise TransferTimeoutError(f"{self.op.value} from {self.route!r} did not finish within {timeout:g} s; "
                                   f"it was cancelled. {stall_advice(self._owner.agent.backend, None)}")

    @property
    def stats(self) -> TransferStats | None:
        """The posted transfer's stats (None until posted), read from it when asked."""
        inner = self._inner
        return None if inner is None else inner.stats

    @property
    def plan(self) -> Any:
        """The plan the agent posted (None until posted)."""
        inner = self._inner
        return None if inner is None else inner.plan

    def done(self) -> bool:
        """True once finished; raises the error if it failed. Never blocks: while the owner's
        loop sleeps, it polls the posted transfer once on this thread (kvxfer._direct)."""
        if not self._event._set and self._inner is not None:
            _direct.drive(self._owner, self, None, once=True)
        return super().done()

    @property
    def status(self) -> Status:
        """As on a Transfer; read while pending, it looks once as :meth:`done` does: a transfer a
        caller posted itself is finished by whoever looks first (kvxfer._direct)."""
        if self._status is Status.PENDING and self._inner is not None and not self._event._set:
            _direct.drive(self._owner, self, None, once=True)
        return self._status

    @status.setter
    def status(self, value: Status) -> None:
        self._status = value

    def _help(self, until: float | None) -> None:
        """A waiter polls its posted transfer itself while the owner's loop sleeps, instead of
        being woken by it (kvxfer._direct.drive): one thread wake-up less per small READ."""
        if self._inner is not None:
            _direct.drive(self._owner, self, until)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """As :meth:`OwnedFuture.add_done_callback`; the owner's loop is woken to poll a posted
        transfer that a caller posted itself (kvxfer._direct), so ``fn`` runs there, soon."""
        super().add_done_callback(fn)
        if self._inner is not None and not self._event.is_set():
            self._owner._kick()

    def wait_posted(self, timeout: float | None = None) -> "OwnedTransfer":
        """Block until the owner posted it (or it ended first; its error, planning's included,
        raises here): what :meth:`kvxfer.Agent.read` returning means, for callers who want that."""
        self._owner._check_not_loop("wait_posted")
        with _CALLBACKS:  # one flag, however many threads wait
            flag = self._posted
            if flag is None:
                flag = self._posted = _Flag()
        if self.posted:  # the owner marked it before it saw the flag: set it here
            flag.set()
        if not flag.wait(None if timeout is None else check_timeout(timeout, "wait timeout")):
            raise TransferTimeoutError(f"{self.op.value} from {self.route!r} was not posted within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self

    def cancel(self) -> None:
        """Abort if still pending; once this returns nothing more is written. Safe from any
        thread: the owner's thread releases the transfer, this call waits for it to have."""
        if self._event.is_set():
            return
        self._owner._cancel(self)

    def _fail(self, error: BaseException) -> None:
        from .errors import TransferCancelledError

        status = Status.CANCELLED if isinstance(error, TransferCancelledError) else Status.FAILED
        self._finish(status, None, error if isinstance(error, BaseException) else KvxferError(str(error)))

    def _done(self) -> None:
        self._finish(Status.DONE, self)

    def _mark_posted(self) -> None:
        """The owner's thread: posted. Either this sees the waiter's flag or the waiter sees ``posted``."""
        self.posted = True
        flag = self._posted
        if flag is not None:
            flag.set()

    def _finish(self, status: Status, value: Any = None, error: BaseException | None = None) -> None:
        """:meth:`OwnedFuture._finish`, then :meth:`_mark_posted`: a finished transfer was posted."""
        OwnedFuture._finish(self, status, value, error)
        self._mark_posted()
