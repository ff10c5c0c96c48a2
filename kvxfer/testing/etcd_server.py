"""A throwaway etcd server for tests and examples: free ports, a temporary data directory.

It runs the ``etcd`` binary (Debian: ``apt-get install etcd-server``; the Makefile's ``deps``
target installs it), optionally inside a network namespace, and can be stopped, killed and
started again on the same ports and data, to rehearse a store that goes away and comes back.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

from ._server import ServerChild
from .ports import free_port

__all__ = ["EtcdServer", "etcd_binary", "free_port", "INSTALL_HINT"]

INSTALL_HINT = "install etcd with: apt-get install -y etcd-server   (or: make deps)"


def etcd_binary() -> str | None:
    """Path of the etcd binary, or None. ``KVXFER_ETCD`` overrides the search."""
    env = os.environ.get("KVXFER_ETCD")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)),
                                        None)


class EtcdServer(ServerChild):
    """One etcd member. ``hosts``: client addresses to listen on (the first is advertised).

    With ``netns``, the process runs inside that network namespace (``ip netns exec``) and the
    ports are chosen by the caller's ``client_port``/``peer_port`` (defaults are fine there:
    nothing else listens in a fresh namespace).
    """

    what = "etcd"
    poll_interval = 0.1
    log_name = "etcd.log"

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, hosts: tuple[str, ...] = ("127.0.0.1",),
                 client_port: int | None = None, peer_port: int | None = None, netns: str | None = None,
                 binary: str | None = None) -> None:
        self.binary = binary or etcd_binary()
        if self.binary is None:
            raise FileNotFoundError(f"no etcd binary found; {INSTALL_HINT}")
        super().__init__(None if data_dir is None else Path(data_dir), "kvxfer-etcd-", netns)
        self.data_dir = self.base / "data"
        self.hosts = hosts
        self.client_port = client_port or (2379 if netns else free_port(host=hosts[0]))
        self.peer_port = peer_port or (2380 if netns else free_port(host=hosts[0]))

    @property
    def url(self) -> str:
        return f"http://{self.hosts[0]}:{self.client_port}"

    def _argv(self) -> list[str]:
        clients = ",".join(f"http://{h}:{self.client_port}" for h in self.hosts)
        peer = f"http://{self.hosts[0]}:{self.peer_port}"
        return self._wrap([self.binary or "etcd", "--name", "kvxfer-test", "--data-dir", str(self.data_dir),
                           "--listen-client-urls", clients, "--advertise-client-urls", self.url,
                           "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                           "--initial-cluster", f"kvxfer-test={peer}", "--logger", "zap", "--log-level", "warn"])

    def ready(self) -> bool:
        if self.netns:
            return self.probe_in_netns(
                f"import urllib.request,json,sys;"
                f"d=json.load(urllib.request.urlopen('{self.url}/health',timeout=1));"
                f"sys.exit(0 if d.get('health')=='true' else 1)")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wipe(self) -> None:
        """Delete the data directory (stopped servers only): the next start is a new cluster."""
        if self.running:
            raise RuntimeError("stop etcd before wiping its data")
        shutil.rmtree(self.data_dir, ignore_errors=True)
