"""Prove untrusted bytes on native code in a helper process before this process loads them.

A backend hands some of a peer's bytes to native code that trusts them (a transport's
connection info, remote keys). No Python parser can check the inside of those payloads, and
a corrupt one can crash the process that loads it. A :class:`Prover` keeps helper processes
that run the same native call first; only bytes a helper survived are loaded here:

* a helper dies of a native fault (SIGSEGV, SIGABRT, ...) while loading the bytes:
  :class:`~kvxfer.errors.MetadataCrashError`, and the verdict is remembered;
* it was *given* ``timeout`` seconds of CPU time and did not answer: the bytes hang native
  code, :class:`~kvxfer.errors.MetadataCrashError` (not remembered);
* native code refuses the bytes with an exception: :class:`~kvxfer.errors.MetadataError`;
* it returns: the bytes are proven, and identical bytes are not proven again.

Anything that is not the bytes' doing is :class:`~kvxfer.errors.ProverUnavailableError` and
blames nobody: a helper starved of CPU or stopped past the caller's deadline (its answer is
still awaited in the background and remembered), a helper killed from outside (the probe is
retried once in another helper), a helper that does not start (retried with backoff,
counted in :func:`health`). How the helper's time and end are read is in
:mod:`kvxfer._childproc`.

Different bytes are proven in different helpers (``helpers`` at most, started on demand);
callers of the same bytes share one probe. Every wait is bounded by the caller's deadline
(``deadline=``, else :func:`kvxfer.deadlines.current_deadline`, else ``start_timeout + 2 *
timeout``). Helpers are recycled every ``recycle_after`` probes or past ``max_descriptors``
descriptors. What runs is ``"package.module:factory"`` (the helper's side, and the request
format of a backend probe, are in :mod:`kvxfer._probeside`); ``factory(**options)`` (JSON
options) returns a callable taking the bytes. What needs proving: docs/design.md, section 8.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from typing import Any, Mapping

from ._childproc import MAX_INPUT, Child, Clock, ask, read_exact
from ._childproc import serve_frames as serve
from ._probeside import backend_probe, named, unnamed
from . import errors
from .deadlines import Backoff, Deadline, check_timeout, current_deadline
from .errors import KvxferError, MetadataCrashError, MetadataError, ProverUnavailableError

__all__ = ["Prover", "DEFAULT_TIMEOUT", "DEFAULT_START_TIMEOUT", "MAX_INPUT", "ask", "backend_probe", "health",
           "main", "named", "read_exact", "shared", "unnamed"]

#: Seconds of CPU time a probe may be given before the bytes count as hanging native code.
DEFAULT_TIMEOUT = 30.0
#: Seconds of CPU time the helper may be given to start (import, create its native agent).
DEFAULT_START_TIMEOUT = 120.0
_live: "weakref.WeakSet[Prover]" = weakref.WeakSet()
_shared: dict[tuple[str, str, float], "Prover"] = {}
_shared_lock = threading.Lock()
_log = logging.getLogger("kvxfer.prove")
_announced: set[str] = set()  # targets whose first helper start was logged (once per process)
_retired: Counter[str] = Counter()  # collected provers' counters: health() never goes down
_totals_lock = threading.Lock()


def _keep_totals(stats: Counter[str], lock: threading.Lock) -> None:
    with lock, _totals_lock:
        _retired.update(stats)


class _Pending:
    """One probe in flight; callers proving the same bytes wait for its outcome."""

    def __init__(self) -> None:
        self.error: BaseException | None = None  # a verdict others may share (refusal, hang)
        self.handed_off = False  # a background finisher awaits the answer and settles it


class Prover:
    """Helper processes running ``target``'s probe; thread-safe, different bytes in parallel."""

    def __init__(self, target: str, options: Mapping[str, Any] | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 start_timeout: float = DEFAULT_START_TIMEOUT, max_input: int = MAX_INPUT, cache_size: int = 4096,
                 recycle_after: int = 1000, max_descriptors: int = 512, helpers: int = 2,
                 start_backoff: tuple[float, float] = (1.0, 60.0), log: str | None = None) -> None:
        if ":" not in target:
            raise ValueError(f"target must be 'module:factory', got {target!r}")
        self.target = target
        self.options = json.dumps(dict(options or {}), sort_keys=True).encode()
        self.timeout = check_timeout(timeout, "prove timeout")
        self.start_timeout = check_timeout(start_timeout, "prove start timeout")
        self.max_input = int(max_input)
        self.cache_size = int(cache_size)
        self.recycle_after = max(1, int(recycle_after))
        self.max_descriptors = max(16, int(max_descriptors))
        self.helpers = max(1, int(helpers))
        self.start_backoff = (check_timeout(start_backoff[0], "start backoff"),
                              check_timeout(start_backoff[1], "start backoff"))
        self.log = log
        #: started, start_failures, proven, cached, refused, crashed, timed_out, late,
        #: ended_outside, died_idle, recycled, unavailable
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()  # counters move from callers, starters and finishers
        weakref.finalize(self, _keep_totals, self.stats, self._stats_lock)
        #: Why the last start failed (None once a helper started again).
        self.last_start_error: str | None = None
        self._cond = threading.Condition()
        self._cache: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> None (proven) or crash
        self._inflight: dict[bytes, _Pending] = {}
        self._idle: list[Child] = []
        self._busy: set[Child] = set()
        self._starting = 0
        self._waiting = 0  # callers in _checkout
        self._started: set[Child] = set()  # helpers still starting (close() ends them too)
        self._epoch = 0  # close() ends every helper of earlier epochs as it comes back
        # Between failed starts: from the first pause, doubling, to the last (start_backoff).
        self._backoff = Backoff(self.start_backoff[0], self.start_backoff[1])
        self._retry_at = 0.0
        _live.add(self)

    def __repr__(self) -> str:
        return f"<Prover {self.target} helpers={self.pids} {self.counters()}>"

    def _count(self, what: str) -> None:
        with self._stats_lock:
            self.stats[what] += 1

    def counters(self) -> dict[str, int]:
        """A consistent copy of :attr:`stats` (another thread may be counting)."""
        with self._stats_lock:
            return dict(self.stats)

    # -- the one call ------------------------------------------------------------------
    def prove(self, data: bytes, what: str = "peer metadata", key: bytes | None = None, *,
              deadline: float | None = None) -> None:
        """Return once native code survived ``data`` in a helper; raise otherwise.

        ``key``: what the cache remembers instead of ``data`` (for bytes that differ only in
        a part that cannot matter, such as a local name). ``what`` names the bytes in errors.
        ``deadline``: a :func:`time.monotonic` time by which this call returns.
        """
        if not isinstance(data, (bytes, bytearray)) or len(data) > self.max_input:
            raise MetadataError(f"{what}: {len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__}"
                                f" bytes cannot be proven (at most {self.max_input})")
        digest = hashlib.sha256(bytes(data if key is None else key)).digest()
        if deadline is None:
            deadline = current_deadline()
        if deadline is None:
            deadline = Deadline.within(self.start_timeout + 2 * self.timeout)
        with self._cond:
            pending = self._await_same(digest, what, deadline)
            if pending is None:
                return
        try:
            self._probe(bytes(data), digest, what, deadline, pending)
        except MetadataError as exc:
            pending.error = exc
            raise
        finally:
            if not pending.handed_off:
                self._settle(digest, pending)

    def _await_same(self, digest: bytes, what: str, deadline: float) -> _Pending | None:
        """Under the lock: None if the verdict is known (raising it if bad), else our pending entry."""
        while True:
            if digest in self._cache:
                self._cache.move_to_end(digest)
                self._count("cached")
                crash = self._cache[digest]
                if crash is None:
                    return None
                raise MetadataCrashError(f"{what} {crash} (seen before; not loaded)")
            other = self._inflight.get(digest)
            if other is None:
                mine = self._inflight[digest] = _Pending()
                return mine
            left = deadline - time.monotonic()
            if left <= 0:
                self._count("unavailable")
                raise ProverUnavailableError(f"{what}: the same bytes are still being proven for another caller; "
                                             "not loaded yet", "busy")
            self._cond.wait(left)
            if other.error is not None and self._inflight.get(digest) is not other:
                raise copy.copy(other.error)

    def _settle(self, digest: bytes, pending: _Pending) -> None:
        with self._cond:
            if self._inflight.get(digest) is pending:
                del self._inflight[digest]
            self._cond.notify_all()

    def _probe(self, data: bytes, digest: bytes, what: str, deadline: float, pending: _Pending) -> None:
        """Prove ``data`` (a late probe is handed to a background finisher, then raises)."""
        for attempt in (1, 2):
            child = self._checkout(what, deadline)
            clock = Clock(child.pid)
            sent = child.send(b"P", data, deadline)
            got = child.reply(self.timeout, deadline, clock=clock) if sent is True else "late" if sent == "late" \
                else "crash"
            if got == "late":
                clock.tick()  # a helper that never read the frame was never asked to answer either
                self._count("late")
                self._count("unavailable")
                pending.handed_off = True
                threading.Thread(target=self._finish, args=(child, clock, digest, what, pending),
                                 name="kvxfer-prover-finish", daemon=True).start()
                reason = "stopped" if clock.stopped >= clock.starved else "starved"
                raise ProverUnavailableError(
                    f"{what}: the helper process proving it (pid {child.pid}) was {clock.why_late()} and given only "
                    f"{clock.given:.1f} of {self.timeout:g} s before the caller's deadline; not loaded yet (its "
                    "answer is still awaited and remembered)", reason)
            if self._judge(child, clock, got, digest, what) != "ended":
                return
            if attempt == 2 or deadline - time.monotonic() <= 0:
                self._count("unavailable")
                raise ProverUnavailableError(f"{what}: the helper process proving it was ended from outside "
                                             f"({child.ended}), twice; not loaded", "ended")

    def _judge(self, child: Child, clock: Clock, got: tuple[bytes, bytes] | str, digest: bytes, what: str) -> str:
        """Act on one answer: record it, return the helper, raise for bad bytes; ``"ended"`` to retry."""
        if isinstance(got, tuple) and got[0] == b"K":
            self._count("proven")
            with self._cond:
                self._remember(digest, None)
            self._checkin(child)
            return "proven"
        if isinstance(got, tuple):
            self._count("refused")
            self._checkin(child)
            raise _refusal(what, got[1].decode("utf-8", "replace"))
        how = child.end()
        self._retire(child)
        if got == "hang":
            self._count("timed_out")
            raise MetadataCrashError(f"{what} hung the native code that loads it: a helper process (pid {child.pid}) "
                                     f"was given {clock.given:.1f} s of CPU time and did not answer; not loaded here")
        if child.faulted():
            self._count("crashed")
            crash = f"crashed the native code that loads it, in a helper process (pid {child.pid}, {how})"
            with self._cond:
                self._remember(digest, crash)
            raise MetadataCrashError(f"{what} {crash}; not loaded here")
        self._count("ended_outside")  # SIGKILL, SIGTERM, an exit: not the bytes' doing
        return "ended"

    def _finish(self, child: Child, clock: Clock, digest: bytes, what: str, pending: _Pending) -> None:
        """Wait on for a late probe's answer, so that its verdict is remembered for the next caller."""
        try:
            until = Deadline.within(4 * self.timeout)
            sent = child.send_rest(until)  # the part of the frame the caller's deadline left unwritten
            got = child.reply(self.timeout, until, clock=clock) if sent is True else "late" if sent == "late" \
                else "crash"
            if got == "late":
                child.end()
                self._retire(child)
            elif self._judge(child, clock, got, digest, what) == "ended":
                pass
        except MetadataError as exc:
            pending.error = exc
        except Exception:  # pragma: no cover - a finisher must never raise into nothing
            pass
        finally:
            self._settle(digest, pending)

    def start(self, deadline: float | None = None) -> None:
        """Have a helper ready now rather than at the first :meth:`prove`."""
        d = deadline if deadline is not None else Deadline.within(2 * self.start_timeout)
        self._checkin(self._checkout("peer metadata", d), used=False)

    def start_soon(self) -> None:
        """Start a helper in the background, so that the next probe finds it ready."""
        with self._cond:
            if not self._idle and not self._starting and len(self._busy) < self.helpers \
                    and time.monotonic() >= self._retry_at:
                self._spawn()

    def close(self) -> None:
        """Stop the helpers; a later :meth:`prove` starts new ones."""
        with self._cond:
            self._epoch += 1
            idle, self._idle = [*self._idle, *self._started], []
        for c in idle:
            c.end()

    @property
    def pids(self) -> list[int]:
        """Process ids of the running helpers, idle and busy."""
        with self._cond:
            return [c.pid for c in [*self._idle, *self._busy] if c.alive()]

    @property
    def pid(self) -> int | None:
        """A running helper's process id (the first), or None."""
        pids = self.pids
        return pids[0] if pids else None

    # -- the helpers' lifetime ---------------------------------------------------------
    def _remember(self, digest: bytes, verdict: str | None) -> None:
        self._cache[digest] = verdict
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _checkout(self, what: str, deadline: float) -> Child:
        with self._cond:
            self._waiting += 1
            try:
                return self._checkout_locked(what, deadline)
            finally:
                self._waiting -= 1

    def _checkout_locked(self, what: str, deadline: float) -> Child:
        """A free helper; a new one only if fewer are starting than callers wait."""
        while True:
            while self._idle:
                c = self._idle.pop()
                if c.alive():
                    self._busy.add(c)
                    return c
                self._count("died_idle")  # not blamed on anyone: it died between probes
                c.end()
            now = time.monotonic()
            if len(self._busy) + self._starting < self.helpers:
                if now >= self._retry_at:
                    if self._starting < self._waiting:
                        self._spawn()
                elif not self._starting and not self._busy:
                    self._count("unavailable")
                    raise ProverUnavailableError(
                        f"{what}: the helper process that proves it ({self.target}) did not start "
                        f"({self.last_start_error}); tried again in {self._retry_at - now:.1f} s; not loaded",
                        "start_failed")
            left = deadline - now
            if left <= 0:
                self._count("unavailable")
                why = "still starting" if self._starting else f"all {self.helpers} busy proving other bytes"
                raise ProverUnavailableError(f"{what}: no helper process free before the caller's deadline "
                                             f"(helpers {why}); not loaded", "busy" if self._busy else "deadline")
            self._cond.wait(min(left, max(0.01, self._retry_at - now)) if now < self._retry_at else left)

    def _checkin(self, child: Child, used: bool = True) -> None:
        """A helper that answered goes back to the pool, or is recycled."""
        child.uses += int(used)
        with self._cond:
            self._busy.discard(child)
            keep = (child.epoch == self._epoch and child.uses < self.recycle_after
                    and child.descriptors() < self.max_descriptors)
            if keep:
                self._idle.append(child)
            self._cond.notify_all()
        if not keep:
            self._count("recycled")
            child.end()
            self.start_soon()

    def _retire(self, child: Child) -> None:
        with self._cond:
            self._busy.discard(child)
            self._cond.notify_all()
        self.start_soon()

    def _spawn(self) -> None:
        """Under the lock: start one helper from a background thread (its start outlives callers)."""
        self._starting += 1
        threading.Thread(target=self._start_one, args=(self._epoch,), name="kvxfer-prover-start", daemon=True).start()

    def _start_one(self, epoch: int) -> None:
        child: Child | None = None
        why = ""
        began = time.monotonic()
        try:
            child = Child("kvxfer.prove", [self.target], log=self.log)
            child.epoch = epoch
            with self._cond:
                self._started.add(child)
            got = child.reply(self.start_timeout, Deadline.within(4 * self.start_timeout)) \
                if child.send(b"I", self.options) else "crash"
            if isinstance(got, tuple) and got[0] == b"K":
                with self._cond:
                    self._started.discard(child)
                    self._starting -= 1
                    current = child.epoch == self._epoch
                    if current:
                        self._idle.append(child)
                        self._count("started")
                        self.last_start_error = None
                        self._backoff.reset()
                    self._cond.notify_all()
                if current:
                    _announce(self.target, child.pid, time.monotonic() - began)
                else:  # close() was called while it started
                    child.end()
                return
            why = got[1].decode("utf-8", "replace") if isinstance(got, tuple) else \
                {"crash": "it died", "hang": f"no answer after {self.start_timeout:g} s of CPU time",
                 "late": "no answer (starved or stopped)"}[got]
        except Exception as exc:  # OSError from Popen, or anything else: counted, never lost
            why = f"{type(exc).__name__}: {exc}"
        if child is not None:
            why = f"{why} ({child.end()})"
        with self._cond:
            if child is not None:
                self._started.discard(child)
            self._starting -= 1
            self._count("start_failures")
            self.last_start_error = why
            self._retry_at = Deadline.within(self._backoff.next())
            self._cond.notify_all()


def _announce(target: str, pid: int, seconds: float) -> None:
    """Say once per process and target, at INFO, what the first add_peer waited seconds for
    (issue 33); later helpers start in the background, off any caller's path."""
    with _totals_lock:
        if target in _announced:
            return
        _announced.add(target)
    _log.info("metadata prover started for %s in %.1f s (helper pid %d): new peers' metadata is loaded there "
              "first (prove_metadata); this cost is paid once per process", target, seconds, pid)


def _refusal(what: str, text: str) -> KvxferError:
    """The helper's refusal as the error this process would have raised: the same kvxfer
    error class where the helper named one (a typed refusal stays typed), else MetadataError."""
    name, _, message = text.partition(": ")
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    wording = f"{what} refused by native code (tried in a helper process, not loaded here): {text}"
    if isinstance(cls, type) and issubclass(cls, KvxferError) and cls not in (MetadataCrashError,
                                                                               ProverUnavailableError):
        try:
            return cls(wording)
        except Exception:  # a class whose constructor wants more than a message
            pass
    return MetadataError(wording)


def shared(target: str, options: Mapping[str, Any], timeout: float, **kw: Any) -> Prover:
    """The process's prover for ``target`` built with ``options`` (JSON), created on first use.

    Backends of one process with one configuration share helpers: a helper costs a process
    and a native agent, and what it proves for one backend holds for the others.
    """
    key = (target, json.dumps(dict(options), sort_keys=True), check_timeout(timeout, "prove_timeout"))
    with _shared_lock:
        p = _shared.get(key)
        if p is None:
            p = _shared[key] = Prover(target, options, timeout=key[2], log=os.environ.get("KVXFER_PROVE_LOG") or None,
                                      **kw)
        return p


def health() -> dict[str, Any]:
    """Counters of every live prover in this process, summed, and the helpers running.

    What an operator watches (``kvxfer doctor``, the vLLM connector's metrics): a non-zero
    ``start_failures`` or ``unavailable`` means peers were refused for want of a helper.
    """
    with _totals_lock:
        total: Counter[str] = Counter(_retired)
    out: dict[str, Any] = {"helpers": 0, "last_start_error": None}
    for p in list(_live):
        total.update(p.counters())
        out["helpers"] += len(p.pids)
        out["last_start_error"] = out["last_start_error"] or p.last_start_error
    out.update(total)
    return out


@atexit.register
def _stop_all() -> None:
    for p in list(_live):
        with contextlib.suppress(Exception):
            p.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1 and ":" in args[0]:
        return serve(args[0])
    print("usage: python -m kvxfer.prove MODULE:FACTORY (started by kvxfer.prove.Prover)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # see kvxfer._childproc.frames.serve: no native teardown
