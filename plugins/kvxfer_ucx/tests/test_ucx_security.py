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
import tempfile

import numpy as np
import pytest
from ucx_helpers import SENT, descs, pattern

from kvxfer.deadlines import Deadline
from kvxfer import Allocation
from kvxfer.testing.lines import Channel
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
    and forges allocations covering the victim's unregistered secret (and a header that says
    the victim is elsewhere, so that its own kvxfer does not refuse the forgery): it cannot
    even connect."""
    secret = pattern(4096, 3)
    kept = secret.copy()
    victim = UcxBackend("victim")
    attacker = UcxBackend("attacker", trusted_network=True, tls="self,tcp", same_host_copy=False)
    try:
        shared = np.full(4096, SENT, dtype=np.uint8)
        victim.register([Allocation(shared.ctypes.data, shared.nbytes)])
        doc = json.loads(victim.local_metadata())
        doc["allocations"][0][:2] = [secret.ctypes.data, secret.nbytes]
        doc["host"] = None
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


# ---------------------------------------------------------------------------------------------
# Another uid on the same host (docs/design.md, section 8, "Who may reach an agent's memory")

def _attacker_user() -> str:
    """The unprivileged user the attacker runs as (kvxfer.testing.other_uid: created once, root only)."""
    from kvxfer.testing.other_uid import attacker

    return attacker().pw_name


def _attack(victim: UcxBackend, path: str, secret: np.ndarray, canary: np.ndarray, user: str | None) -> dict:
    """Run ucx_attacker.py (as ``user``, or as us) against ``victim``, progressing the victim
    meanwhile (software RMA is served by the target's worker)."""
    import base64
    import time

    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "ucx_attacker.py"), "--path", path] + (["--user", user] if user else [])
    order = {"blob": base64.b64encode(victim.local_metadata()).decode(), "pid": os.getpid(),
             "secret": [secret.ctypes.data, secret.nbytes], "canary": [canary.ctypes.data, canary.nbytes]}
    with tempfile.TemporaryFile("w+") as fin, tempfile.TemporaryFile("w+") as fout, \
            tempfile.TemporaryFile("w+") as ferr:
        fin.write(json.dumps(order) + "\n")
        fin.seek(0)
        proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, text=True)
        deadline = Deadline.within(120)
        while proc.poll() is None and time.monotonic() < deadline:
            victim.progress()
            time.sleep(0.0005)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    assert proc.returncode == 0, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    res["read_back"] = np.frombuffer(base64.b64decode(res["read_back"]), dtype=np.uint8)
    return res


@pytest.mark.parametrize("path", ["rma", "copy"])
@pytest.mark.parametrize("victim_options", [{}, {"same_host_copy": False}], ids=["defaults", "rma-only"])
def test_another_uid_cannot_reach_memory_it_was_not_given(path: str, victim_options: dict) -> None:
    """A raw UCX client (or raw process_vm_readv/writev) of another uid holds the victim's
    genuine metadata and goes for unregistered memory: nothing is read, nothing changes.
    Control: the same attacker as the victim's uid, which the threat model lets do what
    ptrace does, reads the secret and writes the canary, so the test can fail."""
    user = _attacker_user()
    victim = UcxBackend("victim", **victim_options)
    try:
        shared = np.full(4096, SENT, dtype=np.uint8)
        victim.register([Allocation(shared.ctypes.data, shared.nbytes)])
        secret = pattern(512, 21)
        canary = pattern(4096, 22)
        kept_secret, kept_canary = secret.copy(), canary.copy()

        res = _attack(victim, path, secret, canary, user)
        assert res["uid"] != 0
        if path == "rma":  # it works as that user: a GET from its own worker moved the right bytes
            assert res["selftest"]["ok"] and res["selftest"]["bytes_right"], res["selftest"]
        else:
            assert res["readv"] != 512 and res["writev"] != 4096, res
        np.testing.assert_array_equal(secret, kept_secret)
        np.testing.assert_array_equal(canary, kept_canary)
        assert (res["read_back"] == 0x5A).all(), "the attacker read bytes of the victim's secret"
        assert (shared == SENT).all()

        control = _attack(victim, path, secret, canary, None)  # same uid as the victim (root)
        assert np.array_equal(control["read_back"], kept_secret), control
        assert not np.array_equal(canary, kept_canary), "the control did not write the canary"
    finally:
        victim.close()


@pytest.mark.parametrize("path", ["rma", "copy"])
def test_control_an_unprivileged_same_uid_attacker_reaches_what_ptrace_would(path: str) -> None:
    """The control without root: victim and attacker are both the unprivileged user, so
    nothing but the same uid lets the attacker in (the model allows it: ptrace would). It
    reads the secret and writes the canary; against a victim of another uid (above) it
    moves nothing."""
    import base64

    user = _attacker_user()
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "ucx_attacker.py")
    victim = subprocess.Popen([sys.executable, script, "--victim", json.dumps({"same_host_copy": path == "copy"}),
                               "--user", user], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ch = Channel(victim)
        order = ch.line(120)  # EOFError: the victim did not start
        attacker = subprocess.run([sys.executable, script, "--path", path, "--user", user], input=order + "\n",
                                  capture_output=True, text=True, timeout=120)
        assert attacker.returncode == 0, attacker.stderr[-2000:]
        res = json.loads(attacker.stdout.strip().splitlines()[-1])
        ch.send_line("dump")
        after = ch.read(60)
    finally:
        victim.kill()
        victim.wait()
    secret = np.random.default_rng(21).integers(0, 256, 512, dtype=np.uint8)  # the victim's, recomputed
    canary = np.random.default_rng(22).integers(0, 256, 4096, dtype=np.uint8)
    assert res["uid"] == after["uid"] != 0
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(res["read_back"]), np.uint8), secret)
    assert np.frombuffer(base64.b64decode(after["canary"]), np.uint8).tolist() != canary.tolist()
    assert after["shared_untouched"]
