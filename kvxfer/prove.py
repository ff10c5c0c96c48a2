"""Prove untrusted bytes on native code in a helper process before this process loads them.

A backend hands some of a peer's bytes to native code that trusts them (a transport's
connection info, remote keys). No Python parser can check the inside of those payloads, and
a corrupt one can crash the process that loads it. A :class:`Prover` keeps a helper process
that runs the same native call first; only bytes the helper survived are loaded here:

* the helper dies (a signal, an abort) or does not answer within ``timeout``:
  :class:`~kvxfer.errors.MetadataCrashError`, and the bytes never reach native code here;
* the native call refuses the bytes with an exception: :class:`~kvxfer.errors.MetadataError`
  (loading them here would only fail, possibly half-way);
* it returns: the bytes are proven, and identical bytes are not proven again.

The helper is started on first use or ahead of it (:meth:`Prover.start_soon`), restarted in
the background after it dies (``python -m kvxfer.prove``, a fresh interpreter, never a
fork of this process), and recycled every ``recycle_after`` probes so
that whatever refused loads leave behind in it stays bounded. What it runs is named by an
import path, ``"package.module:factory"``: ``factory(**options)`` returns a callable taking
the bytes; options are JSON. Requests and answers are length-prefixed bytes on pipes, no
pickle, each bounded. Verdicts are cached by SHA-256 digest (crashes too, so that a peer
repeating a crashing blob does not cost a helper restart each time; timeouts are not cached).

The cost and the numbers behind the defaults are in BENCHMARKS.md; why a helper process and
not only authentication is in docs/design.md (section 8, Trust).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from typing import Any, Callable, Mapping

from .deadlines import check_timeout, readable
from .errors import BackendError, MetadataCrashError, MetadataError

__all__ = ["Prover", "DEFAULT_TIMEOUT", "DEFAULT_START_TIMEOUT", "MAX_INPUT", "ask", "main", "read_exact"]

#: Seconds one probe may take before the bytes count as hanging native code.
DEFAULT_TIMEOUT = 30.0
#: Seconds the helper may take to start (import, create its native agent).
DEFAULT_START_TIMEOUT = 120.0
#: The largest input a prover accepts (larger metadata is refused before it is sent).
MAX_INPUT = 16 << 20
_MAX_REPLY = 1 << 16
_FRAME = struct.Struct("!cI")
_live: "weakref.WeakSet[Prover]" = weakref.WeakSet()


class Prover:
    """One helper process running ``target``'s probe; thread-safe, one probe at a time."""

    def __init__(self, target: str, options: Mapping[str, Any] | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 start_timeout: float = DEFAULT_START_TIMEOUT, max_input: int = MAX_INPUT, cache_size: int = 4096,
                 recycle_after: int = 1000, log: str | None = None) -> None:
        if ":" not in target:
            raise ValueError(f"target must be 'module:factory', got {target!r}")
        self.target = target
        self.options = json.dumps(dict(options or {}), sort_keys=True).encode()
        self.timeout = check_timeout(timeout, "prove timeout")
        self.start_timeout = check_timeout(start_timeout, "prove start timeout")
        self.max_input = int(max_input)
        self.cache_size = int(cache_size)
        self.recycle_after = max(1, int(recycle_after))
        self.log = log
        #: started, proven, cached, refused, crashed, timed_out, died_idle
        self.stats: Counter[str] = Counter()
        self._cache: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> None (proven) or crash
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._probes = 0
        _live.add(self)

    def __repr__(self) -> str:
        return f"<Prover {self.target} pid={self._proc.pid if self._proc else None} {dict(self.stats)}>"

    # -- the one call ------------------------------------------------------------------
    def prove(self, data: bytes, what: str = "peer metadata", key: bytes | None = None) -> None:
        """Return once native code survived ``data`` in the helper; raise otherwise.

        ``key``: what the cache remembers instead of ``data`` (for bytes that differ only in
        a part that cannot matter, such as a local name). ``what`` names the bytes in errors.
        """
        if not isinstance(data, (bytes, bytearray)) or len(data) > self.max_input:
            raise MetadataError(f"{what}: {len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__}"
                                f" bytes cannot be proven (at most {self.max_input})")
        digest = hashlib.sha256(bytes(data if key is None else key)).digest()
        with self._lock:
            if digest in self._cache:
                self._cache.move_to_end(digest)
                self.stats["cached"] += 1
                crash = self._cache[digest]
                if crash is None:
                    return
                raise MetadataCrashError(f"{what} {crash} (seen before; not loaded)")
            self._ensure()
            assert self._proc is not None
            self._probes += 1
            got = ask(self._proc, b"P", bytes(data), self.timeout)
            if isinstance(got, tuple) and got[0] == b"K":
                self.stats["proven"] += 1
                self._remember(digest, None)
                if self._probes >= self.recycle_after:
                    self._stop()
                    self.start_soon()
                return
            if isinstance(got, tuple) and got[0] == b"R":
                self.stats["refused"] += 1
                raise MetadataError(f"{what} refused by native code (tried in a helper process, not loaded "
                                    f"here): {got[1].decode('utf-8', 'replace')}")
            ended = self._stop()
            if got == "hang":
                self.stats["timed_out"] += 1
                self.start_soon()
                raise MetadataCrashError(f"{what} hung the native code that loads it for {self.timeout:g} s in "
                                         f"a helper process (pid {ended[0]}); not loaded here")
            self.stats["crashed"] += 1
            crash = f"crashed the native code that loads it, in a helper process (pid {ended[0]}, {ended[1]})"
            self._remember(digest, crash)
            self.start_soon()
            raise MetadataCrashError(f"{what} {crash}; not loaded here")

    def start(self) -> None:
        """Start the helper now rather than at the first :meth:`prove`."""
        with self._lock:
            self._ensure()

    def start_soon(self) -> None:
        """Start the helper from a background thread, so that the next probe finds it ready.

        A failure to start is not lost: the next :meth:`prove` tries again and raises it.
        """
        def run() -> None:
            try:
                self.start()
            except Exception:
                pass

        threading.Thread(target=run, name="kvxfer-prover-start", daemon=True).start()

    def close(self) -> None:
        """Stop the helper; a later :meth:`prove` starts a new one."""
        with self._lock:
            self._stop()

    @property
    def pid(self) -> int | None:
        """The helper's process id, while it runs."""
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    # -- the helper's lifetime -----------------------------------------------------------
    def _remember(self, digest: bytes, verdict: str | None) -> None:
        self._cache[digest] = verdict
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self.stats["died_idle"] += 1  # not blamed on anyone: it died between probes
            self._stop()
        if self._proc is not None:
            return
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        err = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen([sys.executable, "-m", "kvxfer.prove", self.target], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, env=env)
        except OSError as exc:
            raise BackendError(f"could not start the helper process that proves peer metadata: {exc}") from exc
        finally:
            if self.log:
                err.close()  # type: ignore[union-attr]
        try:
            got = ask(proc, b"I", self.options, self.start_timeout)
        except BaseException:
            _end(proc)  # never leave a helper behind that nothing refers to
            raise
        if not (isinstance(got, tuple) and got[0] == b"K"):
            why = got[1].decode("utf-8", "replace") if isinstance(got, tuple) else {"crash": "it died", "hang": "no answer"}[got]
            _end(proc)
            raise BackendError(f"the helper process that proves peer metadata ({self.target}) did not start: {why}")
        self._proc, self._probes = proc, 0
        self.stats["started"] += 1

    def _stop(self) -> tuple[int | None, str]:
        proc, self._proc = self._proc, None
        return (proc.pid, _end(proc)) if proc is not None else (None, "not running")


def _end(proc: subprocess.Popen[bytes]) -> str:
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


def ask(proc: subprocess.Popen[bytes], op: bytes, payload: bytes, timeout: float, *,
        kinds: tuple[bytes, ...] = (b"K", b"R"), max_reply: int = _MAX_REPLY) -> tuple[bytes, bytes] | str:
    """One framed request to a child process; ``(kind, payload)``, or ``"crash"`` / ``"hang"``.

    An answer of another kind, or longer than ``max_reply``, counts as a crash: a child that
    says something else is broken, whatever it runs.
    """
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(_FRAME.pack(op, len(payload)) + payload)
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        return "crash"
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf, need, kind = b"", _FRAME.size, b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not readable(fd, left):
            return "hang"
        chunk = os.read(fd, need - len(buf))
        if not chunk:
            return "crash"
        buf += chunk
        if len(buf) < need:
            continue
        if kind:
            return kind, buf
        kind, n = _FRAME.unpack(buf)
        if kind not in kinds or n > max_reply:
            return "crash"
        if n == 0:
            return kind, b""
        buf, need = b"", n


@atexit.register
def _stop_all() -> None:
    for p in list(_live):
        try:
            p.close()
        except Exception:
            pass


# -- the helper (runs in the child) ---------------------------------------------------------------
def read_exact(f: Any, n: int) -> bytes | None:
    """``n`` bytes from a pipe, or None at EOF (the other side ended or died)."""
    buf = b""
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _serve(target: str) -> int:
    """Answer probe requests until stdin closes; native output goes to stderr, never the pipe.

    Stdin closes when the parent ends it or dies; the caller then leaves with ``os._exit``,
    since native teardown of what a probe loaded can hang and would leave the helper behind.
    """
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inbox = os.fdopen(os.dup(0), "rb", buffering=0)

    def send(kind: bytes, text: str = "") -> None:
        raw = text.encode("utf-8", "replace")[:_MAX_REPLY]
        proto.write(_FRAME.pack(kind, len(raw)) + raw)

    probe: Callable[[bytes], object] | None = None
    while True:
        head = read_exact(inbox, _FRAME.size)
        if head is None:
            return 0
        op, n = _FRAME.unpack(head)
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or ":" not in args[0]:
        print("usage: python -m kvxfer.prove MODULE:FACTORY (started by kvxfer.prove.Prover)", file=sys.stderr)
        return 2
    return _serve(args[0])


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # see _serve: no native teardown
