"""The UCX worker address, read exactly (issue 19, item 1, round 2).

The self-target check used to scan every 4-byte window of a peer's worker address for this
process's pid: a genuine peer whose address held those 4 bytes by chance (its uuid, its
system id, a port) was refused, and an address naming a *third* local process passed. Now
the address is parsed as UCX 1.23 parses it (:mod:`kvxfer.ucxabi.address`). These tests:

* parse the real addresses of real NIXL agents, in this process and in child processes, and
  find in each exactly the process that made it; every child's genuine blob loads;
* rewrite the pid fields of a real address with synthetic pids (every 4-byte value found
  elsewhere in the address, small and large pids, random ones) and find exactly that pid;
  this process's pid planted in the uuid is never read as a pid (control: the old window
  scan refuses it);
* forge a child's blob to name a third local process and see it refused, while the control
  (the check bypassed) reads the third process's unregistered secret through it.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import random
import struct
import subprocess
import sys
from typing import Any, Iterator

import numpy as np
import pytest

from kvxfer import DescriptorList, Op
from kvxfer.errors import IdentityError
from kvxfer.memory import Allocation
from kvxfer.testing import lines
from kvxfer.testing.wait import wait_until

nb = pytest.importorskip("kvxfer_nixl.backend", reason="nixl is not installed: pip install 'kvxfer[nixl]'")
from kvxfer.ucxabi import address as _ucxaddr  # noqa: E402
from kvxfer_nixl import _blob, _identity  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]

ROW = 512
_CHILD = r"""
import base64, os, sys
import numpy as np
from kvxfer import Agent
from kvxfer.testing import lines
buf = np.full((8, 512), 0x11, np.uint8)
secret = np.random.default_rng(os.getpid()).integers(0, 256, (2, 512), dtype=np.uint8)  # never registered
agents = [Agent(f"child{i}", backend="nixl") for i in range(int(sys.argv[1]))]
for a in agents:
    a.register({"layer.0": buf})
lines.say(sys.stdout, {"pid": os.getpid(), "secret": secret.ctypes.data, "secret_bytes": secret.tobytes().hex(),
                      "blobs": [base64.b64encode(a.backend.local_metadata()).decode() for a in agents]})

def handle(cmd):
    raise ValueError(f"no commands here, only progress until stdin closes: {cmd!r}")

lines.serve(handle, lambda: [a.progress() for a in agents])
"""


def _window_scan(address: bytes, pid: int) -> bool:
    """The old check, kept as the control: ``pid`` in any 4-byte window, namespace flag or not."""
    return any(struct.unpack_from("<I", address, i)[0] & 0x7FFFFFFF == pid for i in range(len(address) - 3))


@pytest.fixture(scope="module")
def children() -> Iterator[list[dict[str, Any]]]:
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "NIXL_LOG_LEVEL": "ERROR"}) for _ in range(4)]
    try:
        hellos = []
        for p in procs:
            h = lines.Channel(p).read(60)
            h["blobs"] = [base64.b64decode(b) for b in h["blobs"]]
            hellos.append(h)
        yield hellos
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            p.wait(timeout=60)


@pytest.fixture(scope="module")
def local() -> Iterator[list[Any]]:
    bes = [nb.NixlBackend(f"local{i}") for i in range(4)]
    yield bes
    for be in bes:
        be.close()


def _address(blob: bytes, name: str) -> bytes:
    return _blob.parse(blob, name, ("UCX",)).worker_address()


def _here(local: list[Any]) -> _ucxaddr.Here:
    return _identity.here(nb.instances, ("UCX",))


def test_real_addresses_name_exactly_their_process(children: list[dict[str, Any]], local: list[Any]) -> None:
    here = _here(local)
    assert set(here.entries) >= {"cma", "posix", "sysv", "self"}, here.entries.keys()
    assert not here.unknown  # every transport of this UCX is in the table
    for h in children:
        for i, blob in enumerate(h["blobs"]):
            reached = _ucxaddr.reach(_address(blob, f"child{i}"), here)
            assert reached == _ucxaddr.Reach(frozenset({h["pid"]}), False), (h["pid"], reached)
    for be in local:
        reached = _ucxaddr.reach(_address(be.local_metadata(), be.agent_name), here)
        assert reached.this_process and reached.pids == {os.getpid()}


def test_every_genuine_child_loads(children: list[dict[str, Any]], local: list[Any]) -> None:
    be = local[0]
    for h in children:
        for i, blob in enumerate(h["blobs"]):
            be.add_remote(f"child{i}", blob)
            be.remove_remote(f"child{i}")


def _pid_fields(address: bytes) -> list[tuple[str, int]]:
    return [(e.transport, e.at) for e in _ucxaddr.parse(address).entries if e.transport in ("cma", "posix")]


def _with_pid(address: bytes, pid: int, uuid: bytes | None = None) -> bytes:
    """``address`` as the process ``pid`` would have packed it (flags kept), uuid optionally replaced."""
    out = bytearray(address)
    for name, at in _pid_fields(address):
        (v,) = struct.unpack_from("<I", out, at)
        mask = 0x3FFFFFFF if name == "posix" else 0x7FFFFFFF
        struct.pack_into("<I", out, at, (v & ~mask & 0xFFFFFFFF) | pid)
    if uuid is not None:
        out[1:9] = uuid
    return bytes(out)


def test_synthetic_pids_are_read_exactly_and_this_pid_in_other_bytes_is_not(
        children: list[dict[str, Any]], local: list[Any]) -> None:
    here = _here(local)
    genuine = _address(children[0]["blobs"][0], "child0")
    (sysv,) = [e for e in _ucxaddr.parse(genuine).entries if e.transport == "sysv"]
    shmid = struct.unpack_from("<Q", sysv.iface)[0]
    windows = {struct.unpack_from("<I", genuine, i)[0] & m for i in range(len(genuine) - 3)
               for m in (0x3FFFFFFF, 0x7FFFFFFF)}
    rng = random.Random(19)
    pid_max = 1 << 22  # Linux's PID_MAX_LIMIT: every pid is below it
    pids = {p for p in windows if 0 < p < pid_max} | set(range(1, 4097)) \
        | {rng.randrange(1, pid_max) for _ in range(4000)} | {pid_max - 1}
    me = os.getpid()
    planted = struct.pack("<I", me) * 2  # this process's pid, twice, in the uuid
    false_refusals = 0
    for pid in sorted(pids):
        if pid == 0 or pid == me:
            continue
        addr = _with_pid(genuine, pid, planted)
        reached = _ucxaddr.reach(addr, here, owner_of_shm={shmid: pid})
        assert reached == _ucxaddr.Reach(frozenset({pid}), False), pid
        false_refusals += _window_scan(addr, me)
    # control: the old scan refused every one of these genuine-looking peers
    assert false_refusals == len(pids - {me}) and false_refusals > 8000


def test_this_pid_planted_in_a_genuine_blob_loads(children: list[dict[str, Any]], local: list[Any]) -> None:
    """A real child's blob whose uuid holds this process's pid: the old check refused it."""
    h = children[1]
    parsed = _blob.parse(h["blobs"][0], "child0", ("UCX",))
    addr = _with_pid(parsed.worker_address(), h["pid"], struct.pack("<I", os.getpid()) * 2)
    assert _window_scan(addr, os.getpid())  # control: deterministic false refusal of the old check
    conns = tuple((b, addr if b == "UCX" else info) for b, info in parsed.conns)
    md = dataclasses.replace(parsed, conns=conns)
    blob = _blob.encode(parsed.identity, parsed.instance, parsed.reg_epoch, md.nixl_metadata("child0"))
    local[1].add_remote("child0", blob)
    local[1].remove_remote("child0")


def _third_party_blob(sender: dict[str, Any], third: dict[str, Any]) -> bytes:
    """The sender's genuine blob, its cma pid set to the third process, its memory over that one's secret."""
    parsed = _blob.parse(sender["blobs"][0], "child0", ("UCX",))
    addr = bytearray(parsed.worker_address())
    for name, at in _pid_fields(bytes(addr)):
        if name == "cma":
            struct.pack_into("<I", addr, at, third["pid"])
    sec = parsed.sections[0]
    (_, _, dev, key), = sec.descs
    md = dataclasses.replace(parsed, conns=tuple((b, bytes(addr) if b == "UCX" else i) for b, i in parsed.conns),
                             sections=(dataclasses.replace(sec, descs=((third["secret"], 2 * ROW, dev, key),)),))
    return _blob.encode(parsed.identity, parsed.instance, parsed.reg_epoch, md.nixl_metadata("child0"))


def _read(be: Any, peer: str, remote: int, n: int) -> np.ndarray:
    dst = np.full((n, ROW), 0xAA, np.uint8)
    be.register([Allocation(dst.ctypes.data, dst.nbytes)])
    lp = be.prepare(None, DescriptorList([[dst.ctypes.data + i * ROW, ROW, 0] for i in range(n)]))
    rp = be.prepare(peer, DescriptorList([[remote + i * ROW, ROW, 0] for i in range(n)]))
    idx = np.arange(n, dtype=np.int32)
    x = be.post(Op.READ, lp, idx, rp, idx, None)
    wait_until(lambda: be.poll(x), timeout=60, what="the transfer", interval=0)
    be.release(x)
    return dst


def test_an_address_naming_a_third_process_is_refused(children: list[dict[str, Any]]) -> None:
    sender, third = children[2], children[3]
    be = nb.NixlBackend("victim", prove_metadata=False)
    try:
        with pytest.raises(IdentityError, match=f"names process\\(es\\) \\[{third['pid']}\\]"):
            be.add_remote("child0", _third_party_blob(sender, third))
        assert "child0" not in be._remotes
        be.add_remote("child0", sender["blobs"][0])  # the sender itself still loads
    finally:
        be.close()


def test_control_without_the_check_the_third_process_secret_is_read(children: list[dict[str, Any]],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    sender, third = children[2], children[3]
    assert not _window_scan(_address(_third_party_blob(sender, third), "child0"), os.getpid())  # old check: passes
    monkeypatch.setattr(_identity, "check", lambda *a, **k: None)
    be = nb.NixlBackend("victim", prove_metadata=False)
    try:
        be.add_remote("child0", _third_party_blob(sender, third))
        got = _read(be, "child0", third["secret"], 2)
        assert got.tobytes().hex() == third["secret_bytes"]  # the third process's unregistered memory
    finally:
        be.close()


def test_unreadable_addresses_are_refused_with_the_typed_error(children: list[dict[str, Any]],
                                                               local: list[Any]) -> None:
    here = _here(local)
    genuine = _address(children[0]["blobs"][0], "child0")
    for bad in (genuine + b"\0", genuine[:-1], b"\x02" + genuine[1:], genuine[:20]):
        with pytest.raises(IdentityError, match="cannot be read"):
            _identity.named(bad, nb.instances, ("UCX",), "test")
    (posix,) = [e for e in _ucxaddr.parse(genuine).entries if e.transport == "posix"]
    no_proc = bytearray(genuine)
    no_proc[posix.at + 7] &= 0x7F  # a FIFO named by a file: its owner cannot be told
    with pytest.raises(IdentityError, match="PROC_LINK"):
        _identity.named(bytes(no_proc), nb.instances, ("UCX",), "test")
    other_host = bytearray(genuine)  # every shared-memory device of another host: names no local process
    for e in _ucxaddr.parse(genuine).entries:
        if e.transport in _ucxaddr.SM_DEVICE:
            start = e.at - 1 - 16 - 2 - len(e.device)  # device address, checksum, attributes, length byte
            assert other_host[start:start + len(e.device)] == e.device
            other_host[start] ^= 0x5A
    assert _ucxaddr.reach(bytes(other_host), here) == _ucxaddr.Reach(frozenset(), False)
