"""A throwaway etcd server for tests and examples: free ports, a temporary data directory.

It runs the ``etcd`` binary (Debian: ``apt-get install etcd-server``; the Makefile's ``deps``
target installs it), optionally inside a network namespace, and can be stopped, killed and
started again on the same ports and data, to rehearse a store that goes away and comes back.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from .ports import free_port
from .wait import wait_for_server

__all__ = ["EtcdServer", "etcd_binary", "free_port", "INSTALL_HINT"]

INSTALL_HINT = "install etcd with: apt-get install -y etcd-server   (or: make deps)"


def etcd_binary() -> str | None:
    """Path of the etcd binary, or None. ``KVXFER_ETCD`` overrides the search."""
    env = os.environ.get("KVXFER_ETCD")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)),
                                        None)


class EtcdServer:
    """One etcd member. ``hosts``: client addresses to listen on (the first is advertised).

    With ``netns``, the process runs inside that network namespace (``ip netns exec``) and the
    ports are chosen by the caller's ``client_port``/``peer_port`` (defaults are fine there:
    nothing else listens in a fresh namespace).
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, hosts: tuple[str, ...] = ("127.0.0.1",),
                 client_port: int | None = None, peer_port: int | None = None, netns: str | None = None,
                 binary: str | None = None) -> None:
        self.binary = binary or etcd_binary()
        if self.binary is None:
            raise FileNotFoundError(f"no etcd binary found; {INSTALL_HINT}")
        self._own_dir = data_dir is None
        self.base = Path(tempfile.mkdtemp(prefix="kvxfer-etcd-")) if data_dir is None else Path(data_dir)
        self.data_dir = self.base / "data"
        self.hosts = hosts
        self.netns = netns
        self.client_port = client_port or (2379 if netns else free_port(host=hosts[0]))
        self.peer_port = peer_port or (2380 if netns else free_port(host=hosts[0]))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.base / "etcd.log"

    @property
    def url(self) -> str:
        return f"http://{self.hosts[0]}:{self.client_port}"

    def _argv(self) -> list[str]:
        clients = ",".join(f"http://{h}:{self.client_port}" for h in self.hosts)
        peer = f"http://{self.hosts[0]}:{self.peer_port}"
        argv = [self.binary or "etcd", "--name", "kvxfer-test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", clients, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvxfer-test={peer}", "--logger", "zap", "--log-level", "warn"]
        return (["ip", "netns", "exec", self.netns] + argv) if self.netns else argv

    def start(self, timeout: float = 30.0) -> "EtcdServer":
        """Start (or start again, on the same ports and data) and wait until it serves."""
        if self.running:
            return self
        self.base.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for_server(self.proc, self.healthy, "etcd", timeout, self.log_tail, 0.1)
        except (RuntimeError, TimeoutError):
            self.kill()
            raise
        return self

    def healthy(self) -> bool:
        probe = (f"import urllib.request,json,sys;"
                 f"d=json.load(urllib.request.urlopen('{self.url}/health',timeout=1));"
                 f"sys.exit(0 if d.get('health')=='true' else 1)")
        if self.netns:
            r = subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c", probe],
                               capture_output=True, timeout=10)
            return r.returncode == 0
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError):
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), data kept."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL, data kept (as far as etcd had synced it)."""
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

    def wipe(self) -> None:
        """Delete the data directory (stopped servers only): the next start is a new cluster."""
        if self.running:
            raise RuntimeError("stop etcd before wiping its data")
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
