"""The JSON-lines codec of kvxfer's child processes: a JSON command per line, a JSON reply per line.

A test drives a peer in another process by writing ``{"cmd": ...}`` lines to its stdin and
reading one reply line per command from its stdout (or a private copy of it, where transport
libraries print on fd 1). The child keeps its agent progressing between commands, answers
an exception as ``{"error": TYPE, "message": TEXT}`` and keeps serving, and stops on
``{"cmd": "exit"}`` or end of input. :func:`serve` is the child's loop and :class:`Channel`
the parent's end, so each program only says what its commands do. A child that only
announces itself (a port, ``READY``, its metadata) is read through a :class:`Channel` too:
every read has a deadline, so a child that hangs or dies fails the caller in time instead of
blocking it in ``readline``. Both ends wait with :func:`kvxfer.deadlines.readable`
(``poll``): a parent holding more than 1,024 descriptors gets pipes numbered past what
``select`` accepts.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import IO, Any, Callable

from ..deadlines import Deadline, readable

__all__ = ["Channel", "Inbox", "say", "serve"]

Reply = dict[str, Any]
_CHUNK = 1 << 20


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

    def rest(self) -> bytes:
        """What arrived after the last whole line (a line cut short by a kill)."""
        tail = bytes(self._buf)
        self._buf.clear()
        self._searched = 0
        return tail


class Inbox:
    """Lines arriving on a descriptor, each read with a deadline: the one reader both ends use.

    Reads the descriptor itself (never a buffered file object), so two lines in one read are
    both kept, and a caller that polls between other work (a child progressing its agent)
    never blocks in ``readline``.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lines = _Lines()
        self.eof = False

    def line(self, timeout: float, idle: Callable[[], None] | None = None, idle_s: float = 0.001) -> bytes:
        """The next line; :class:`TimeoutError` if none came within ``timeout`` s,
        :class:`EOFError` once the writer is gone. ``idle`` runs about every ``idle_s`` s
        while waiting (a process whose transport moves only while progressed drives it there)."""
        deadline = Deadline.within(timeout)
        while (line := self._lines.next()) is None:
            if self.eof:
                raise EOFError("the other end exited")
            if deadline.expired():
                raise TimeoutError(f"no line within {timeout:g} s")
            left = deadline.left()
            if not readable(self.fd, left if idle is None else min(left, idle_s)):
                if idle is not None:
                    idle()
                continue
            self._fill()
        return line

    def poll(self) -> bytes | None:
        """A line if one is here now, else None at once (:class:`EOFError` once the writer is gone)."""
        while (line := self._lines.next()) is None:
            if self.eof:
                raise EOFError("the other end exited")
            if not readable(self.fd, 0):
                return None
            self._fill()
        return line

    def rest(self, timeout: float) -> tuple[list[bytes], bytes]:
        """Every line until the writer is gone, and what came after the last newline (a line
        a kill cut short); :class:`TimeoutError` if the writer is still there at ``timeout``."""
        got, deadline = [], Deadline.within(timeout)
        while True:
            try:
                got.append(self.line(max(deadline.left(), 1e-3)))
            except EOFError:
                return got, self._lines.rest()

    def _fill(self) -> None:
        chunk = os.read(self.fd, _CHUNK)
        if chunk:
            self._lines.add(chunk)
        else:
            self.eof = True


def serve(handle: Callable[[Reply], Reply], idle: Callable[[], None], out: IO[str] | None = None,
          stdin: IO[str] | None = None, poll_s: float = 0.001, on_exit: Callable[[], Reply] | None = None) -> int:
    """Answer commands until ``exit`` (or a reply holding ``"exit"``) or end of input; returns 0.

    ``idle`` runs whenever no command waited for ``poll_s`` seconds (progress the agent there);
    ``on_exit``, if given, answers the ``exit`` command (after closing what it must).
    """
    out = sys.stdout if out is None else out
    inbox = Inbox((sys.stdin if stdin is None else stdin).fileno())
    while True:
        try:
            line = inbox.line(poll_s)
        except TimeoutError:
            idle()
            continue
        except EOFError:
            return 0
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
        print on stdout answers on a descriptor of its own, passed to it by number). A child
        started without a stdin pipe can still be read (it only announces itself)."""
        out = proc.stdout if replies is None else replies
        assert out is not None
        self.proc = proc
        self._in = proc.stdin
        self._text = isinstance(proc.stdin, io.TextIOBase)
        self.inbox = Inbox(out.fileno())  # replies are read from the fd itself: bytes past one line wait there
        self._fd = self.inbox.fd

    def send(self, doc: Reply) -> None:
        self.send_line(json.dumps(doc))

    def send_line(self, text: str) -> None:
        """Write one raw line (a child reading a value, not a command)."""
        assert self._in is not None, "the child was started without a stdin pipe"
        data = text + "\n"
        self._in.write(data if self._text else data.encode())  # type: ignore[arg-type]
        self._in.flush()

    def read(self, timeout: float, idle: Callable[[], None] | None = None, idle_s: float = 0.001) -> Reply:
        """The next reply; :class:`TimeoutError` if none came in time, :class:`EOFError` if the child exited.

        ``idle`` runs about every ``idle_s`` seconds while waiting (a parent whose transport
        moves only while it is progressed drives it there; one that waits minutes for an
        engine looks at its health there, less often)."""
        try:
            return dict(json.loads(self.inbox.line(timeout, idle, idle_s)))
        except TimeoutError:
            raise TimeoutError(f"no reply within {timeout:g} s") from None
        except EOFError:
            raise EOFError("the child exited") from None

    def line(self, timeout: float, idle: Callable[[], None] | None = None) -> str:
        """The next line as text (a child announcing a port, ``READY``, a hex blob); the same errors."""
        return self.inbox.line(timeout, idle).decode("utf-8", "replace")

    def until(self, words: tuple[str, ...], timeout: float) -> str:
        """Read lines until one (stripped) is among ``words``; :class:`EOFError` if the child
        exited first, :class:`TimeoutError` if none came within ``timeout`` s."""
        deadline = Deadline.within(timeout)
        while True:
            got = self.line(max(deadline.left(), 1e-3)).strip()
            if got in words:
                return got
            if deadline.expired():
                raise TimeoutError(f"none of {words} within {timeout:g} s")

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
