"""Who can reach an agent's memory: transports, crafted metadata, stale registrations.

The reasoning is in plugins/kvxfer_ucx/README.md: UCX itself checks no address on its
software RMA and TCP paths, so by default a worker listens only on transports that same-user
processes of this host can reach, and everything kvxfer moves is checked against
registrations before UCX or the kernel sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from ucx_helpers import SENT, descs, pattern

from kvxfer import Allocation
from kvxfer.errors import BackendError, OutOfRegistrationError, PeerDisconnectedError
from kvxfer_ucx.backend import UcxBackend

pytestmark = pytest.mark.ucx

_LISTENERS = r"""
import os, sys
def inodes():
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:["):
            out.add(t[8:-1])
    return out
def listening(socks):
    n = 0
    for f in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = open(f).read().splitlines()[1:]
        except OSError:
            continue
        n += sum(1 for r in rows if r.split()[3] == "0A" and r.split()[9] in socks)
    return n
import json
from kvxfer_ucx.backend import UcxBackend
b = UcxBackend("probe", **json.loads(sys.argv[1]))
print(listening(inodes()))
b.close()
"""


def _listeners(options: dict, env: dict | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", _LISTENERS, json.dumps(options)], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, check=True).stdout
    return int(out.split()[-1])


def test_default_agent_listens_on_no_network_port() -> None:
    """No TCP listener by default, not even when the environment asks UCX for TCP; one
    appears only when the user declares the network trusted (which shows the probe works)."""
    assert _listeners({}) == 0
    assert _listeners({"same_host_copy": False}) == 0
    assert _listeners({}, env={"UCX_TLS": "tcp,self,posix"}) == 0
    assert _listeners({"trusted_network": True}) > 0


@pytest.mark.parametrize("options", [{"tls": "tcp"}, {"tls": "self,posix,tcp"}, {"tls": "sysv"}, {"tls": "^cma"},
                                     {"tls": "all"}, {"ucx_config": {"TLS": "rc,ud"}},
                                     {"ucx_config": {"UCX_TLS": "tcp"}}])
def test_network_transports_need_trusted_network(options: dict) -> None:
    with pytest.raises(BackendError, match="trusted_network=True"):
        UcxBackend("x", **options)


def test_network_attacker_cannot_reach_a_default_agent() -> None:
    """An attacker that speaks only network transports gets the victim's genuine metadata,
    and forges allocations covering the victim's unregistered secret: it cannot even connect."""
    secret = pattern(4096, 3)
    kept = secret.copy()
    victim = UcxBackend("victim")
    attacker = UcxBackend("attacker", trusted_network=True, tls="self,tcp", same_host_copy=False)
    try:
        shared = np.full(4096, SENT, dtype=np.uint8)
        victim.register([Allocation(shared.ctypes.data, shared.nbytes)])
        doc = json.loads(victim.local_metadata())
        doc["allocations"][0][:2] = [secret.ctypes.data, secret.nbytes]
        with pytest.raises(PeerDisconnectedError, match="cannot reach"):
            attacker.add_remote("victim", json.dumps(doc).encode())
        np.testing.assert_array_equal(secret, kept)
        assert (shared == SENT).all()
    finally:
        attacker.close()
        victim.close()


@pytest.mark.parametrize("path", ["copy", "rma"])
def test_descriptors_outside_the_advertised_memory_never_reach_the_transport(path: str) -> None:
    """Whatever the transport would do with them, descriptors outside what the peer
    advertises (or outside our own registrations) are refused before any byte moves."""
    src, dst = pattern(1 << 16, 4), np.full(1 << 16, SENT, dtype=np.uint8)
    a = UcxBackend("prefill", same_host_copy=None if path == "copy" else False)
    b = UcxBackend("decode", same_host_copy=None if path == "copy" else False)
    try:
        a.register([Allocation(src.ctypes.data, src.nbytes)])
        b.register([Allocation(dst.ctypes.data, dst.nbytes)])
        b.add_remote("prefill", a.local_metadata())
        for base, offs, sizes in ((src.ctypes.data, [src.nbytes], [1]), (src.ctypes.data - 4096, [0], [8192]),
                                  (src.ctypes.data, [0], [src.nbytes + 1])):
            with pytest.raises(OutOfRegistrationError):
                b.prepare("prefill", descs(base, offs, sizes))
        with pytest.raises(OutOfRegistrationError):
            b.prepare(None, descs(dst.ctypes.data, [dst.nbytes - 4], [8]))
        assert (dst == SENT).all()
    finally:
        b.close()
        a.close()
