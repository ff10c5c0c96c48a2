"""Whose memory a Mooncake blob reaches: the process that owns its session's port, exactly.

A session id is ``host:port``; Mooncake reads and writes whatever the process listening on
that port registered. The blob also says which process sent it (``kvxfer.plugin.identity``).
A blob can be genuine metadata edited to name another process, or this one, so before the
blob is kept each of these is an :class:`~kvxfer.errors.IdentityError`:

1. A session served by a live backend of this process, or a claim naming this process, is
   refused unless the blob is genuinely that backend's: the same session, and regions inside
   what it registered. Otherwise we would move bytes within our own memory at addresses a
   peer chose.
2. A session on this host (loopback, or this backend's own host) under a claim of another
   host: what runs here is proven, never taken on a peer's word.
3. A claim of another process of this host is proven: that process must hold the secret
   behind its token, every region must lie inside the spans it published, and it must own a
   TCP socket listening on the session's port (``/proc/<pid>/net/tcp*`` and its fds). A blob
   carrying a real process's public identity with a session of another process is refused
   by the last check. Where ptrace rules or ``/proc`` forbid a read here, that part is
   skipped (the others still hold), as for NIXL (docs/design.md section 8).

Peers on other hosts are not proven: Mooncake's ports authenticate nobody, which is why the
agent runs only with ``trusted_network=True`` (README).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import numpy as np

from kvxfer import IdentityError, PeerDisconnectedError
from kvxfer.plugin import Live, identity as ident

from ._blob import Blob

__all__ = ["check", "forget", "listens", "publish", "serving"]

#: session id -> the live backend of this process serving it.
_serving: "Live[Any]" = Live()


def serving(session: str, backend: Any) -> None:
    _serving[session] = backend


def publish(backend: Any, handle: Any, regions: tuple[tuple[int, int], ...]) -> None:
    """Put a registration on this process's proof page, where a same-host receiver reads it."""
    ident.process_page().set((id(backend), handle), [(a, a + n) for a, n in regions])


def forget(backend: Any, handle: Any) -> None:
    ident.process_page().drop((id(backend), handle))


def _host_port(session: str) -> tuple[str, int]:
    host, _, port = session.rpartition(":")
    return host.strip("[]"), int(port)


def _this_host(host: str, own_host: str) -> bool:
    if host in ("localhost", own_host):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (None: /proc does not say)."""
    inodes: set[str] = set()
    try:
        for name in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{name}", encoding="ascii") as f:
                    lines = f.read().splitlines()[1:]
            except FileNotFoundError:
                continue
            for ln in lines:
                fields = ln.split()
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
        if not inodes:
            return False
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return True
            except OSError:
                continue
    except PermissionError:
        return None
    except (FileNotFoundError, ProcessLookupError):
        raise PeerDisconnectedError(f"process {pid} no longer exists") from None
    return False


def check(blob: Blob, claim: ident.Identity, peer: str, own_host: str) -> None:
    """Raise :class:`IdentityError` unless the blob's session belongs to the process it names."""
    what = f"mooncake blob of {peer!r}"
    served = blob.session in _serving
    if served or ident.names_this_process(claim):
        why = "its session is served by this process" if served else f"it names this process ({claim.pid})"
        ours = _serving.find(blob.session, claim.token, ident.here().token)
        if ours is None or ours._closed or claim != ident.here():
            raise IdentityError(f"{what}: {why}, but no live Mooncake agent here sent it")
        if not ours.owns(blob.regions):
            raise IdentityError(f"{what}: {why}, but it advertises memory that agent did not register")
        return
    host, port = _host_port(blob.session)
    local = _this_host(host, own_host)
    if local and not claim.same_host():
        raise IdentityError(f"{what}: its session {blob.session} is on this host, but it claims another host")
    if not claim.same_host():
        return
    try:
        proven = ident.prove(claim, what)
    except ident.ProofUnavailable:
        proven = None
    if proven is not None and blob.regions:
        rows = np.array(blob.regions, dtype=np.uint64)
        if not proven.covers(rows[:, 0], rows[:, 1]).all():
            raise IdentityError(f"{what} advertises memory that process {claim.pid} did not register")
    if listens(claim.pid, port) is False:
        raise IdentityError(f"{what}: process {claim.pid} does not listen on its session's port {port}: the "
                            "session belongs to another process")
