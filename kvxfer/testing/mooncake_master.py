"""A throwaway Mooncake Store master for tests and examples: loopback, free ports, stopped by PID.

The ``mooncake_master`` binary ships in the ``mooncake-transfer-engine-non-cuda`` wheel (the
Makefile's ``venv`` installs it). The master is started on 127.0.0.1 with ports from
:func:`~.ports.free_port` (optionally inside a network namespace, on that namespace's
address), and :meth:`MooncakeMaster.start` returns only once its RPC port accepts a
connection: a client's ``setup()`` against a master that is not listening blocks for about
90 s. It can be killed and started again on the same ports, to rehearse a master restart
(which loses every object: the master keeps its metadata in memory).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sysconfig

from ._server import ServerChild
from .ports import free_port

__all__ = ["MooncakeMaster", "master_binary", "require", "INSTALL_HINT"]

INSTALL_HINT = "install Mooncake Store with: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 " \
               "and apt-get install -y libibverbs1   (or: make venv deps)"


def master_binary() -> str | None:
    """Path of ``mooncake_master`` (in the wheel's package directory, or on PATH), or None.
    ``KVXFER_MOONCAKE_MASTER`` overrides the search."""
    env = os.environ.get("KVXFER_MOONCAKE_MASTER")
    if env:
        return env if os.access(env, os.X_OK) else None
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        p = os.path.join(base, "mooncake", "mooncake_master")
        if os.access(p, os.X_OK):
            return p
    return shutil.which("mooncake_master")


def unavailable_reason() -> str | None:
    """Why a master and its clients cannot run here, or None."""
    if master_binary() is None:
        return f"no mooncake_master binary; {INSTALL_HINT}"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake Store client does not load ({exc}); {INSTALL_HINT}"
    return None



def require() -> None:
    """Skip the calling test where Mooncake Store cannot run here; on CI (``CI=true``) fail
    instead, since CI installs everything it needs and a skip there would hide a gap."""
    import pytest

    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"Mooncake Store cannot run on this CI machine: {reason}", pytrace=False)
    pytest.skip(reason)

class MooncakeMaster(ServerChild):
    """One master. ``lease_ms``: how long a read leases an object (Mooncake's default is
    10 s; tests shorten it). ``client_ttl``: seconds before a silent client's segment is
    dropped. With ``netns``, it runs inside that namespace (``ip netns exec``) on ``host``."""

    what = "mooncake_master"
    log_name = "master.log"

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, lease_ms: int = 10000,
                 client_ttl: int = 10, netns: str | None = None, binary: str | None = None) -> None:
        self.binary = binary or master_binary()
        if self.binary is None:
            raise FileNotFoundError(f"no mooncake_master binary found; {INSTALL_HINT}")
        super().__init__(None, "kvxfer-mooncake-", netns)
        self.host = host
        self.port = port or free_port(host="127.0.0.1")
        self.metrics_port = free_port(host="127.0.0.1")
        self.lease_ms, self.client_ttl = lease_ms, client_ttl
        atexit.register(self.kill)  # a test process that ends without closing leaves no master behind

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        return self._wrap([self.binary or "mooncake_master", f"--rpc_address={self.host}", f"--rpc_port={self.port}",
                           f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
                           f"--default_kv_lease_ttl={self.lease_ms}", f"--client_ttl={self.client_ttl}",
                           "--rpc_thread_num=2", "--enable_http_metadata_server=false", f"--log_dir={self.base}"])

    def ready(self) -> bool:
        """Its RPC port accepts: a client's ``setup()`` against a master not listening blocks ~90 s."""
        if self.netns:
            return self.probe_in_netns(
                f"import socket;socket.create_connection(('{self.host}',{self.port}),timeout=1).close()")
        try:
            socket.create_connection((self.host, self.port), timeout=1).close()
            return True
        except OSError:
            return False
