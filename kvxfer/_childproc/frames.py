"""The frames codec of child processes: a helper behind framed pipes, unpinned, asked within a CPU budget.

:mod:`kvxfer.prove` runs untrusted bytes through native code in such a helper. Three facts
decide whether a verdict about those bytes is fair, and each is measured here, not assumed:

* **Scheduling.** A helper that did not answer within ``timeout`` seconds of wall time may
  have been starved (an engine pinning every core) or stopped (SIGSTOP, a debugger), not
  hung by its input. :class:`Clock` counts only the time the helper was *given*: wall time
  minus what its threads spent waiting on a run queue (``/proc/PID/task/*/schedstat``)
  minus time it was stopped. A probe "hangs" only once it was given ``timeout`` seconds.
* **How it ended.** Only a native fault (:data:`NATIVE_FAULTS`: SIGSEGV, SIGABRT, ...) while
  loading the input is the input's doing. SIGKILL, SIGTERM or an exit status come from
  outside (the OOM killer, an operator, a watchdog) and say nothing about the bytes.
* **Inheritance.** A serving engine pins its threads (``sched_setaffinity``) and sets
  OpenMP's binding (``GOMP_CPU_AFFINITY``, applied by a preloaded libgomp before Python
  starts). A child inherits both and would share the engine's busiest core. The helper is
  started without the binding variables and widens its own affinity first thing.

Frames are ``kind (1 byte) | length (4 bytes, network order) | payload``; no pickle.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from typing import Any, Callable, Mapping

from ..deadlines import Deadline, readable, writable

__all__ = ["Child", "Clock", "MAX_INPUT", "NATIVE_FAULTS", "PINNING_ENV", "ask", "end", "read_exact", "serve",
           "unpin_self"]

FRAME = struct.Struct("!cI")
MAX_REPLY = 1 << 16
#: The largest request a helper reads (a prover refuses larger input before sending it).
MAX_INPUT = 16 << 20
#: Signals by which native code reports a fault of its own while loading its input.
NATIVE_FAULTS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT,
                           signal.SIGSYS, signal.SIGTRAP})
#: Thread-binding settings of OpenMP runtimes; an engine's values would pin the helper.
PINNING_ENV = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")
_TICK = 0.05


def _run_delay(pid: int) -> float | None:
    """Seconds the most-delayed of ``pid``'s threads has spent runnable but not running.

    The most-delayed thread, not the sum: a probe waits on whichever thread does its work,
    and a sum over several runnable threads would outgrow the wall clock. None if unknown.
    """
    total, seen = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total = max(total, int(f.read().split()[1]))
                seen = True
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9 if seen else None


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"T", b"t")


class Clock:
    """The time a process was given since :meth:`start`: wall, less run-queue waits and stops.

    Without ``/proc`` (another OS) every second of wall time counts as given, which is the
    verdict the wall clock alone would reach.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.given = self.starved = self.stopped = 0.0
        self._wall = time.monotonic()
        self._delay = _run_delay(pid)

    def tick(self) -> None:
        now, delay = time.monotonic(), _run_delay(self.pid)
        dw = now - self._wall
        if _stopped(self.pid):
            self.stopped += dw
        else:
            waited = min(dw, max(0.0, delay - self._delay)) if delay is not None and self._delay is not None else 0.0
            self.starved += waited
            self.given += dw - waited
        self._wall, self._delay = now, delay if delay is not None else self._delay

    def why_late(self) -> str:
        """Why the process did not use its budget: the larger of stopped and starved time."""
        if self.stopped >= self.starved:
            return f"stopped for {self.stopped:.1f} s"
        return f"waiting for a CPU for {self.starved:.1f} s"


def unpin_self() -> None:
    """Let this process run on every CPU its cpuset allows (undo an inherited pinning)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or a cpuset that refuses: leave as it is
        pass


def child_env(extra_path: list[str] | None = None) -> dict[str, str]:
    """This process's environment for a helper: its import path, without thread bindings."""
    env = {k: v for k, v in os.environ.items() if k not in PINNING_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path if extra_path is not None else sys.path)
                                        if p and os.path.isdir(p))
    return env


class Child:
    """One helper process running ``python -m MODULE ARGS...``, spoken to in frames."""

    def __init__(self, module: str, args: list[str], *, log: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        err: Any = open(log, "ab") if log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=dict(env or child_env()))
        finally:
            if log:
                err.close()
        self.pid = self.proc.pid
        assert self.proc.stdin is not None
        # Writes never block: a stopped helper that reads nothing must not hold a caller past
        # its deadline (a frame larger than the pipe would otherwise block in write()).
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.unsent = memoryview(b"")  # what send() had not written when its deadline passed
        self.uses = 0
        self.epoch = 0  # whose generation of helpers it belongs to (the owner's business)
        self.ended: str | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def descriptors(self) -> int:
        """Open file descriptors in the helper (0 where ``/proc`` cannot tell)."""
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return 0

    def send(self, op: bytes, payload: bytes, deadline: float | None = None) -> bool | str:
        """Write one frame: True once written, False if the helper is gone, ``"late"`` when
        ``deadline`` (monotonic) passed first; the rest is then in :attr:`unsent`, for
        :meth:`send_rest` (the helper has read part of a frame and expects the remainder)."""
        self.unsent = memoryview(FRAME.pack(op, len(payload)) + payload)
        return self.send_rest(deadline)

    def send_rest(self, deadline: float | None = None) -> bool | str:
        """Write what :meth:`send` left unsent; the same answers."""
        assert self.proc.stdin is not None
        try:
            fd = self.proc.stdin.fileno()
        except ValueError:  # closed by end()
            return False
        while self.unsent:
            left = _TICK if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return "late"
            if not writable(fd, min(left, _TICK)):
                continue
            try:
                n = os.write(fd, self.unsent)
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError, ValueError):
                self.unsent = memoryview(b"")
                return False
            self.unsent = self.unsent[n:]
        return True

    def reply(self, budget: float, deadline: float, kinds: tuple[bytes, ...] = (b"K", b"R"),
              clock: Clock | None = None) -> tuple[bytes, bytes] | str:
        """The answer, or ``"crash"`` (EOF, a wrong frame), ``"hang"`` (``budget`` s of given
        time spent) or ``"late"`` (``deadline`` passed before the budget was spent)."""
        clock = clock or Clock(self.pid)
        return _read_frame(self.proc, kinds, MAX_REPLY, lambda: _wait_turn(clock, budget, deadline))

    def end(self) -> str:
        """Stop the helper (EOF, then a kill) and say how it ended; idempotent."""
        if self.ended is None:
            self.ended = end(self.proc)
        return self.ended

    def faulted(self) -> bool:
        """Whether it ended by a native fault (not a kill from outside, not an exit)."""
        rc = self.proc.poll()
        return rc is not None and rc < 0 and -rc in {int(s) for s in NATIVE_FAULTS}


def _wait_turn(clock: Clock, budget: float, deadline: float) -> float | str:
    """How long to wait for the next bytes, or ``"hang"`` / ``"late"``."""
    clock.tick()
    if clock.given >= budget:
        return "hang"
    left = deadline - time.monotonic()
    if left <= 0:
        return "late"
    return min(_TICK, left, budget - clock.given)


def _read_frame(proc: subprocess.Popen[bytes], kinds: tuple[bytes, ...], max_reply: int,
                turn: Any) -> tuple[bytes, bytes] | str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf, need, kind = b"", FRAME.size, b""
    while True:
        wait = turn()
        if isinstance(wait, str):
            return wait
        if not readable(fd, wait):
            continue
        chunk = os.read(fd, need - len(buf))
        if not chunk:
            return "crash"
        buf += chunk
        if len(buf) < need:
            continue
        if kind:
            return kind, buf
        kind, n = FRAME.unpack(buf)
        if kind not in kinds or n > max_reply:
            return "crash"
        if n == 0:
            return kind, b""
        buf, need = b"", n


def ask(proc: subprocess.Popen[bytes], op: bytes, payload: bytes, timeout: float, *,
        kinds: tuple[bytes, ...] = (b"K", b"R"), max_reply: int = MAX_REPLY) -> tuple[bytes, bytes] | str:
    """One framed request by wall time alone: ``(kind, payload)``, ``"crash"`` or ``"hang"``.

    For children whose answer time is not a verdict on anyone (the fuzz harness's worker).
    An answer of another kind, or longer than ``max_reply``, counts as a crash.
    """
    assert proc.stdin is not None
    try:
        proc.stdin.write(FRAME.pack(op, len(payload)) + payload)
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        return "crash"
    deadline = Deadline.within(timeout)

    def turn() -> float | str:
        left = deadline - time.monotonic()
        return "hang" if left <= 0 else left

    return _read_frame(proc, kinds, max_reply, turn)


def end(proc: subprocess.Popen[bytes]) -> str:
    """Stop ``proc`` (EOF first, then a kill) and say how it ended."""
    if proc.poll() is None:
        try:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=2.0)
        except Exception:
            proc.kill()
    rc = proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            if f:
                f.close()
        except OSError:
            pass
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def read_exact(f: Any, n: int) -> bytes | None:
    """``n`` bytes from a pipe, or None at EOF (the other side ended or died)."""
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def serve(target: str) -> int:
    """Answer probe requests until stdin closes; native output goes to stderr, never the pipe.

    Stdin closes when the parent ends it or dies; the caller then leaves with ``os._exit``,
    since native teardown of what a probe loaded can hang and would leave the helper behind.
    """
    unpin_self()  # before any native thread exists: they inherit this thread's affinity
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inbox = os.fdopen(os.dup(0), "rb", buffering=0)

    def send(kind: bytes, text: str = "") -> None:
        raw = text.encode("utf-8", "replace")[:MAX_REPLY]
        proto.write(FRAME.pack(kind, len(raw)) + raw)

    probe: Callable[[bytes], object] | None = None
    while True:
        head = read_exact(inbox, FRAME.size)
        if head is None:
            return 0
        op, n = FRAME.unpack(head)
        if n > MAX_INPUT:
            return 2
        data = read_exact(inbox, n)
        if data is None:
            return 0
        try:
            if op == b"I":
                module, _, name = target.partition(":")
                probe = getattr(importlib.import_module(module), name)(**json.loads(data))
            elif op == b"P" and probe is not None:
                probe(data)
            else:
                send(b"R", f"unexpected request {op!r}")
                continue
            send(b"K")
        except BaseException as exc:  # noqa: BLE001 - a refusal, reported to the parent
            send(b"R", f"{type(exc).__name__}: {exc}")
