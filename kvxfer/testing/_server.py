"""One home for the throwaway servers tests start (etcd, a Mooncake master).

Each used to write its own start, readiness probe inside a network namespace, stop, kill,
log tail and clean-up; what differs is only the command line and what "ready" means. A
server child gets no pipe to read (its output goes to a log file in its own directory), so
a chatty server never blocks on a full pipe, and a failed start reports the log's tail.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TypeVar

from .wait import wait_for_server

__all__ = ["ServerChild"]

S = TypeVar("S", bound="ServerChild")


class ServerChild:
    """A server process with a log file under ``base``; subclasses give ``_argv`` and ``ready``.

    ``what`` names it in errors; ``poll_interval`` is how often ``start`` probes readiness.
    With ``netns`` set, the subclass's ``_argv`` wraps the command in ``ip netns exec`` and
    readiness probes run there too (:meth:`probe_in_netns`).
    """

    what = "server"
    poll_interval = 0.05
    log_name = "server.log"

    def __init__(self, base: Path | None, prefix: str, netns: str | None) -> None:
        self._own_dir = base is None
        # Absolute: the server runs with its directory as cwd, where a relative path would resolve twice.
        self.base = Path(tempfile.mkdtemp(prefix=prefix)) if base is None else Path(base).resolve()
        self.netns = netns
        self.log_path = self.base / self.log_name
        self.proc: subprocess.Popen[bytes] | None = None

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def _wrap(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def probe_in_netns(self, code: str) -> bool:
        """Run a Python one-liner inside the namespace; ready when it exits 0."""
        assert self.netns is not None
        return subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c", code],
                              capture_output=True, timeout=10).returncode == 0

    def start(self: S, timeout: float = 30.0) -> S:
        """Start (or start again, on the same ports and data) and return once it is ready."""
        if self.running:
            return self
        self.base.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.base)
        try:
            wait_for_server(self.proc, self.ready, self.what, timeout, self.log_tail, self.poll_interval)
        except (RuntimeError, TimeoutError):
            self.kill()
            raise
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM); what the server keeps on disk stays."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL by PID: what the server had not written down is lost."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: int, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
