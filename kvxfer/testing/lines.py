"""The one protocol of kvxfer's child-peer programs: a JSON command per line, a JSON reply per line.

A test drives a peer in another process by writing ``{"cmd": ...}`` lines to its stdin and
reading one reply line per command from its stdout (or a private copy of it, where transport
libraries print on fd 1). The child keeps its agent progressing between commands, answers
an exception as ``{"error": TYPE, "message": TEXT}`` and keeps serving, and stops on
``{"cmd": "exit"}`` or end of input. :func:`serve` is the child's loop and :class:`Channel`
the parent's end, so each program only says what its commands do. Both wait with
:func:`kvxfer.deadlines.readable` (``poll``): a parent holding more than 1,024 descriptors
gets pipes numbered past what ``select`` accepts.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from typing import IO, Any, Callable
from ..deadlines import Deadline

from kvxfer.deadlines import readable

__all__ = ["Channel", "say", "serve"]

Reply = dict[str, Any]


def say(out: IO[str], doc: Reply) -> None:
    """Write one reply line and flush it (the parent is waiting for it)."""
    out.write(json.dumps(doc) + "\n")
    out.flush()


class _Lines:
    """Bytes read so far, split at newlines. A reply can be tens of megabytes (a peer's pages
    in base64) arriving in 64 KiB reads: the buffer grows in place and each read is searched
    once, so a long line costs its length, not its length times the number of reads."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._searched = 0  # no newline before this offset

    def add(self, chunk: bytes) -> None:
        self._buf += chunk

    def next(self) -> bytes | None:
        """The next complete line (without its newline), or None until one has arrived."""
        i = self._buf.find(b"\n", self._searched)
        if i < 0:
            self._searched = len(self._buf)
            return None
        line = bytes(self._buf[:i])
        del self._buf[:i + 1]
        self._searched = 0
        return line


def serve(handle: Callable[[Reply], Reply], idle: Callable[[], None], out: IO[str] | None = None,
          stdin: IO[str] | None = None, poll_s: float = 0.001, on_exit: Callable[[], Reply] | None = None) -> int:
    """Answer commands until ``exit`` (or a reply holding ``"exit"``) or end of input; returns 0.

    ``idle`` runs whenever no command waited for ``poll_s`` seconds (progress the agent there);
    ``on_exit``, if given, answers the ``exit`` command (after closing what it must).
    """
    out = sys.stdout if out is None else out
    fd = (sys.stdin if stdin is None else stdin).fileno()
    lines = _Lines()  # read from the fd itself, so two commands in one read are both answered
    while True:
        line = lines.next()
        if line is None:
            if not readable(fd, poll_s):
                idle()
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return 0
            lines.add(chunk)
            continue
        cmd: Reply = json.loads(line)
        if cmd.get("cmd") == "exit":
            if on_exit is not None:
                say(out, on_exit())
            return 0
        try:
            reply = handle(cmd)
        except Exception as exc:  # report and keep serving: the test decides what it means
            reply = {"error": type(exc).__name__, "message": str(exc)}
        if reply.get("exit"):
            return 0
        say(out, reply)


class Channel:
    """The parent's end: send a command, read the reply line within a timeout."""

    def __init__(self, proc: "subprocess.Popen[Any]", replies: IO[Any] | None = None) -> None:
        """``replies``: where the child answers, if not its stdout (a program whose libraries
        print on stdout answers on a descriptor of its own, passed to it by number)."""
        out = proc.stdout if replies is None else replies
        assert proc.stdin is not None and out is not None
        self.proc = proc
        self._in, self._fd = proc.stdin, out.fileno()
        self._text = isinstance(proc.stdin, io.TextIOBase)
        self._lines = _Lines()  # replies are read from the fd itself: bytes past one line wait here

    def send(self, doc: Reply) -> None:
        data = json.dumps(doc) + "\n"
        self._in.write(data if self._text else data.encode())  # type: ignore[arg-type]
        self._in.flush()

    def read(self, timeout: float, idle: Callable[[], None] | None = None, idle_s: float = 0.001) -> Reply:
        """The next reply; :class:`TimeoutError` if none came in time, :class:`EOFError` if the child exited.

        ``idle`` runs about every ``idle_s`` seconds while waiting (a parent whose transport
        moves only while it is progressed drives it there; one that waits minutes for an
        engine looks at its health there, less often)."""
        deadline = Deadline.within(timeout)
        while (line := self._lines.next()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply within {timeout:g} s")
            if not readable(self._fd, left if idle is None else min(left, idle_s)):
                if idle is not None:
                    idle()
                continue
            chunk = os.read(self._fd, 1 << 20)
            if not chunk:
                raise EOFError("the child exited")
            self._lines.add(chunk)
        return dict(json.loads(line))

    def stop(self, timeout: float) -> bool:
        """Ask the child to exit and wait up to ``timeout`` seconds; False if it is still
        running (the caller kills it, its own way: a process or its whole group)."""
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                return False
        return True

    def close(self) -> None:
        """Close the parent's ends of the child's pipes. A child that died (or closed its
        stdin) leaves an unsent ``exit`` in the buffer, whose flush fails again on close: the
        pipe is closed all the same, and that failure is not the caller's."""
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except BrokenPipeError:
                    pass

    def ask(self, doc: Reply, timeout: float, idle: Callable[[], None] | None = None) -> Reply:
        self.send(doc)
        return self.read(timeout, idle)
