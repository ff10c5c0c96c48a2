"""NIXL self-target (issue 19, item 1): a blob may not point the victim's UCX at the victim.

The attacker is a genuine NIXL agent in another process. It sends its own metadata with two
edits: the victim's pid wherever its worker address holds the attacker's, and its memory
section moved over the victim's unregistered secret and canary. Without the identity check
UCX's cross-memory-attach copies from and to the victim's own pid: a READ fills the victim's
KV with its secret, a WRITE overwrites its canary (the control below shows both, so the test
can fail). With the check the blob is an :class:`~kvxfer.errors.IdentityError` and no byte
moves. Every buffer is compared against copies taken before the attack.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import struct
import subprocess
import sys
from typing import Any, Iterator

import numpy as np
import pytest

from kvxfer import DescriptorList, Op, peers
from kvxfer.errors import IdentityError
from kvxfer.memory import Allocation
from kvxfer.testing import lines
from kvxfer.testing.wait import wait_until

nb = pytest.importorskip("kvxfer_nixl.backend", reason="nixl is not installed: pip install 'kvxfer[nixl]'")
from kvxfer.ucxabi import address as _ucxaddr  # noqa: E402
from kvxfer_nixl import _blob, _identity  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]

ROW, KV_ROWS, SECRET_ROWS, CANARY_ROWS = 512, 4, 2, 2
SENTINEL, CANARY = 0xAA, 0x77

_ATTACKER = r"""
import base64, os, sys
import numpy as np
from kvxfer import Agent
from kvxfer.testing import lines
buf = np.full((8, 512), 0x11, np.uint8)

def handle(cmd):
    raise ValueError(f"no commands here, only progress until stdin closes: {cmd!r}")

with Agent("attacker", backend="nixl") as agent:
    agent.register({"layer.0": buf})
    lines.say(sys.stdout, {"pid": os.getpid(), "metadata": base64.b64encode(agent.backend.local_metadata()).decode()})
    lines.serve(handle, agent.progress)
"""


@pytest.fixture(scope="module")
def attacker() -> Iterator[tuple[int, bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", _ATTACKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "NIXL_LOG_LEVEL": "ERROR"})
    assert proc.stdin is not None and proc.stdout is not None
    try:
        hello = lines.Channel(proc).read(60)
        yield int(hello["pid"]), base64.b64decode(hello["metadata"])
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


class Victim:
    """KV (registered, sentinel), then its secret (pattern) and canary, both unregistered."""

    def __init__(self, **options: Any) -> None:
        self.mem = np.full((KV_ROWS + SECRET_ROWS + CANARY_ROWS, ROW), SENTINEL, np.uint8)
        self.mem[KV_ROWS:KV_ROWS + SECRET_ROWS] = np.random.default_rng(19).integers(0, 256, (SECRET_ROWS, ROW))
        self.mem[KV_ROWS + SECRET_ROWS:] = CANARY
        self.be = nb.NixlBackend("victim", **options)
        self.be.register([Allocation(self.mem.ctypes.data, KV_ROWS * ROW)])
        self.before = self.mem.copy()

    def rows(self, first: int, n: int) -> DescriptorList:
        return DescriptorList([[self.mem.ctypes.data + (first + i) * ROW, ROW, 0] for i in range(n)])

    def move(self, op: Op, peer: str, local: int, remote: int, n: int) -> None:
        lp, rp = self.be.prepare(None, self.rows(local, n)), self.be.prepare(peer, self.rows(remote, n))
        idx = np.arange(n, dtype=np.int32)
        x = self.be.post(op, lp, idx, rp, idx, None)
        wait_until(lambda: self.be.poll(x), timeout=60, what="the transfer", interval=0)
        self.be.release(x)


def _retarget(address: bytes, old: int, new: int) -> bytes:
    """The attacker's edit: ``new`` wherever the worker address holds pid ``old`` (flag kept)."""
    out, i = bytearray(address), 0
    while i + 4 <= len(out):
        (v,) = struct.unpack_from("<I", out, i)
        if v & 0x7FFFFFFF == old:
            struct.pack_into("<I", out, i, new | (v & 0x80000000))
            i += 4
        else:
            i += 1
    return bytes(out)


def forge(v: Victim, attacker_pid: int, blob: bytes, header: str) -> bytes:
    parsed = _blob.parse(blob, "attacker", ("UCX",))
    reached = _ucxaddr.reach(parsed.worker_address(), _identity.here(nb.instances, ("UCX",)))
    assert reached.pids == {attacker_pid}  # the edit below has something to change
    conns = tuple((b, _retarget(info, attacker_pid, os.getpid()) if b == "UCX" else info) for b, info in parsed.conns)
    sec = parsed.sections[0]
    (_, _, dev, key), = sec.descs
    over = (v.mem.ctypes.data + KV_ROWS * ROW, (SECRET_ROWS + CANARY_ROWS) * ROW, dev, key)
    md = dataclasses.replace(parsed, conns=conns, sections=(dataclasses.replace(sec, descs=(over,)),))
    ident, instance = (parsed.identity, parsed.instance) if header == "own" else (peers.here(), v.be._id)
    return _blob.encode(ident, instance, parsed.reg_epoch, md.nixl_metadata("attacker"))


@pytest.mark.parametrize("header", ["own", "victim"], ids=["attacker-identity", "victim-identity"])
@pytest.mark.parametrize("options", [{}, {"prove_metadata": False}], ids=["defaults", "no-prover"])
def test_self_target_is_refused_and_nothing_moves(attacker: tuple[int, bytes], header: str,
                                                  options: dict[str, Any]) -> None:
    pid, blob = attacker
    v = Victim(**options)
    try:
        with pytest.raises(IdentityError):
            v.be.add_remote("attacker", forge(v, pid, blob, header))
        assert "attacker" not in v.be._remotes
        np.testing.assert_array_equal(v.mem, v.before)
        # the genuine attacker blob still loads: the check refuses the edit, not the peer
        v.be.add_remote("attacker", blob)
    finally:
        v.be.close()


@pytest.mark.parametrize("header", ["own", "victim"], ids=["attacker-identity", "victim-identity"])
def test_control_without_the_check_the_secret_moves(attacker: tuple[int, bytes], header: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pid, blob = attacker
    monkeypatch.setattr(_identity, "check", lambda *a, **k: None)
    v = Victim(prove_metadata=False)
    try:
        v.be.add_remote("attacker", forge(v, pid, blob, header))
        v.move(Op.READ, "attacker", 0, KV_ROWS, SECRET_ROWS)  # READ of "the attacker's" memory
        np.testing.assert_array_equal(v.mem[:SECRET_ROWS], v.before[KV_ROWS:KV_ROWS + SECRET_ROWS])
        v.mem[:CANARY_ROWS] = 0x3C
        v.move(Op.WRITE, "attacker", 0, KV_ROWS + SECRET_ROWS, CANARY_ROWS)
        assert (v.mem[KV_ROWS + SECRET_ROWS:] == 0x3C).all()  # the canary was overwritten
    finally:
        v.be.close()


def _edited(blob: bytes, *, identity: Any = None, grow: int = 0) -> bytes:
    parsed = _blob.parse(blob, "attacker", ("UCX",))
    sec = parsed.sections[0]
    (addr, n, dev, key), = sec.descs
    md = dataclasses.replace(parsed, sections=(dataclasses.replace(sec, descs=((addr, n + grow, dev, key),)),))
    return _blob.encode(identity or parsed.identity, parsed.instance, parsed.reg_epoch,
                        md.nixl_metadata("attacker"))


def test_same_host_sender_is_held_to_what_it_registered_itself(attacker: tuple[int, bytes]) -> None:
    """Bounds come from the owner's proof page: a section grown past the sender's registration
    is refused, though the blob says it is registered."""
    pid, blob = attacker
    v = Victim(prove_metadata=False)
    try:
        with pytest.raises(IdentityError, match="did not register"):
            v.be.add_remote("attacker", _edited(blob, grow=ROW))
        claim = _blob.parse(blob, "attacker", ("UCX",)).identity
        with pytest.raises(IdentityError, match="secret"):  # a token that process does not hold
            v.be.add_remote("attacker", _edited(blob, identity=dataclasses.replace(claim, token=os.urandom(16))))
        with pytest.raises(IdentityError, match="start time"):  # the pid, but another incarnation
            v.be.add_remote("attacker", _edited(blob, identity=dataclasses.replace(claim, start_time=1)))
        v.be.add_remote("attacker", _edited(blob))  # unedited, re-encoded: loads
    finally:
        v.be.close()
