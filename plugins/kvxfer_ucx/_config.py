"""Which UCX transports an agent may use, and the settings every agent needs.

UCX serves remote memory access to any process that reaches a worker, and checks nothing
on two of its paths: software RMA (used when a transport has no hardware RMA) writes and
reads wherever the request says, and the TCP transport's own PUT handler copies to any
address a connected peer names. So the transports decide who can touch this process's
memory. Shared memory through POSIX files created with mode 0600 (``posix``) and loopback
(``self``) reach only processes of the same user on this host; anything else (``tcp``,
``sysv`` whose segments are group-writable, RDMA transports) needs the user to declare the
network trusted. The reasoning is in ``plugins/kvxfer_ucx/README.md``.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from kvxfer import BackendError

from kvxfer.plugin.ucxabi import mmqueue

__all__ = ["NETWORK_TLS", "SAME_HOST_TLS", "transport_config", "warn_if_ptrace_is_narrower"]

#: Transports that only same-user processes of this host can reach (the default).
SAME_HOST_TLS = "self,posix"
#: The default with ``trusted_network=True``: adds TCP, reachable from the network.
NETWORK_TLS = "self,tcp,posix"
_LOCAL_TLS = frozenset(SAME_HOST_TLS.split(","))
#: Shared memory reports dead peers only with this on; keepalive rounds bound detection time.
#: The receive queue's layout is pinned: ``kvxfer.ucxabi.mmqueue`` reads it.
_BASE_CONFIG = {"POSIX_ERROR_HANDLING": "y", "KEEPALIVE_INTERVAL": "100ms", **mmqueue.CONFIG}


def transport_config(tls: str | None, trusted_network: bool, extra: Mapping[str, Any] | None) -> dict[str, str]:
    """The UCX configuration for these options; refuses network transports unless trusted."""
    config = {**_BASE_CONFIG, **{str(k).removeprefix("UCX_"): str(v) for k, v in dict(extra or {}).items()}}
    chosen = tls or config.get("TLS") or (NETWORK_TLS if trusted_network else SAME_HOST_TLS)
    names = {t.strip() for t in chosen.split(",") if t.strip()}
    if not trusted_network and not names <= _LOCAL_TLS:
        raise BackendError(
            f"ucx backend: transports {sorted(names - _LOCAL_TLS)} are reachable beyond this user on this host, "
            "and UCX lets any process that reaches a worker read and write all of its memory (its TCP and "
            "software RMA paths do not check registrations). Pass trusted_network=True only where everyone who "
            "can reach this worker is trusted; see plugins/kvxfer_ucx/README.md")
    config["TLS"] = chosen
    return config


def warn_if_ptrace_is_narrower() -> None:
    """Once per process: under Yama ``ptrace_scope`` 2 or 3 ptrace forbids what posix allows."""
    global _warned_scope
    if _warned_scope:
        return
    _warned_scope = True
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    if scope >= 2:
        logging.getLogger("kvxfer").warning(
            "kvxfer ucx: ptrace_scope is %d, yet UCX's posix transport lets processes of this uid reach this "
            "process's memory: trust the uid, or do not run the UCX backend (docs/design.md, section 8.1)", scope)


_warned_scope = False
