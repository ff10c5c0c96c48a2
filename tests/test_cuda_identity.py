"""The device path opens only exports their exporter vouches for (issue 19, items 2 and 3), on CPU.

CUDA is :class:`kvxfer.testing.fake_cuda.FakeCuda` (host memory posing as VRAM); the proof is
the real one (:func:`kvxfer.peers.prove` reads each fake's page from this process). Each
attack has a control that bypasses the check and shows the attack moving bytes, so the
refusal is what keeps them still. ``tests/test_cuda_security_gpu.py`` runs them on GPUs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvxfer import Allocation, DescriptorList, MemoryKind, Op
from kvxfer.cuda import CUDA_IPC, DevicePath, blob
from kvxfer.cuda.ipc import handle_key
from kvxfer.errors import IdentityError
from kvxfer.testing.fake_cuda import FakeCuda

SENTINEL, SECRET = 0xAA, 0x5C
ROWS, ROW = 16, 64


class Exporter:
    """Process P: registers the first ``ROWS`` rows of its buffer; the next ``ROWS`` are its secret."""

    def __init__(self, seed: int = 1) -> None:
        self.cap = FakeCuda()
        self.mem = np.random.default_rng(seed).integers(0, 256, (2 * ROWS, ROW), dtype=np.uint8)
        self.mem[ROWS:] = SECRET
        self.path = DevicePath(capability=self.cap)
        self.path.register([Allocation(self.mem.ctypes.data, ROWS * ROW, MemoryKind.VRAM, 0)])

    def rows(self, first: int, n: int) -> DescriptorList:
        return DescriptorList([[self.mem.ctypes.data + (first + i) * ROW, ROW, 0] for i in range(n)], MemoryKind.VRAM)


class Importer:
    def __init__(self) -> None:
        self.cap = FakeCuda()
        self.mem = np.full((ROWS, ROW), SENTINEL, np.uint8)
        self.path = DevicePath(capability=self.cap)
        self.path.register([Allocation(self.mem.ctypes.data, self.mem.nbytes, MemoryKind.VRAM, 0)])
        self.lp = self.path.prepare(None, DescriptorList(
            [[self.mem.ctypes.data + i * ROW, ROW, 0] for i in range(ROWS)], MemoryKind.VRAM))

    def move(self, op: Op, peer: str, remote: DescriptorList) -> None:
        rp = self.path.prepare(peer, remote)
        assert rp is not None and self.lp is not None
        idx = np.arange(len(remote), dtype=np.int32)
        assert self.path.poll(self.path.post(op, self.lp, idx, rp, idx))


def _widened(raw: bytes) -> bytes:
    """P's export as a forwarder would present it: the handle and the allocation grown to 2x."""
    e = blob.decode(raw)
    handles, allocs = e.handles.copy(), e.allocs.copy()
    handles["size"] *= 2
    chunks = e.chunks.copy()
    chunks["size"] *= 2
    allocs["nbytes"] *= 2
    return blob.encode(dataclasses.replace(e, handles=handles, chunks=chunks, allocs=allocs))


def _bypass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DevicePath, "_vouched", lambda self, key, exp, raw: "")


@pytest.mark.parametrize("bypass", [False, True], ids=["checked", "control-bypassed"])
def test_widened_export_cannot_reach_the_exporters_unregistered_memory(bypass: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    p, d = Exporter(), Importer()
    before = p.mem.copy()
    if bypass:
        _bypass(monkeypatch)
        assert d.path.add_peer("P", _widened(p.path.blob())).kind == CUDA_IPC
        d.move(Op.READ, "P", p.rows(ROWS, ROWS))  # the secret, past P's registration
        assert (d.mem == SECRET).all()  # the attack works without the check
        d.mem[:] = 0x11
        d.move(Op.WRITE, "P", p.rows(ROWS, 4))
        assert (p.mem[ROWS:ROWS + 4] == 0x11).all()  # and overwrites P's unregistered canary
        return
    with pytest.raises(IdentityError, match="does not vouch"):
        d.path.add_peer("P", _widened(p.path.blob()))
    assert d.path.prepare("P", p.rows(ROWS, ROWS)) is None  # no route: nothing can be posted
    assert (d.mem == SENTINEL).all() and np.array_equal(p.mem, before)
    assert d.cap.opened == []
    # the genuine export, forwarded unchanged, still opens and moves exactly P's registered rows
    assert d.path.add_peer("P", p.path.blob()).kind == CUDA_IPC
    d.move(Op.READ, "P", p.rows(0, ROWS))
    np.testing.assert_array_equal(d.mem, before[:ROWS])
    assert d.path.prepare("P", p.rows(ROWS, 1)) is None


@pytest.mark.parametrize("bypass", [False, True], ids=["checked", "control-bypassed"])
def test_second_claimant_of_an_identity_never_gets_its_traffic(bypass: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker presents P's identity (pid, token and page, copied) with a handle of its own."""
    p, d = Exporter(seed=1), Importer()
    attacker = Exporter(seed=2)
    attacker.mem[:] = 0x33
    genuine = blob.decode(p.path.blob())
    mine = blob.decode(attacker.path.blob())
    forged = blob.encode(dataclasses.replace(mine, identity=genuine.identity))
    if bypass:
        _bypass(monkeypatch)
        assert d.path.add_peer("P", forged).kind == CUDA_IPC
        d.move(Op.READ, "P", attacker.rows(0, ROWS))
        assert (d.mem == 0x33).all()  # reads of "P" return the attacker's bytes without the check
        return
    with pytest.raises(IdentityError):
        d.path.add_peer("P", forged)
    assert d.cap.opened == [] and (d.mem == SENTINEL).all()
    assert d.path.add_peer("P", p.path.blob()).kind == CUDA_IPC
    d.move(Op.READ, "P", p.rows(0, ROWS))
    np.testing.assert_array_equal(d.mem, p.mem[:ROWS])


def test_an_identity_whose_page_does_not_hold_its_secret_is_refused() -> None:
    p, d = Exporter(), Importer()
    e = blob.decode(p.path.blob())
    impostor = FakeCuda()  # its own page, P's token: it cannot know the secret behind it
    forged = blob.encode(dataclasses.replace(e, identity=dataclasses.replace(e.identity, page=impostor.proof.address)))
    with pytest.raises(IdentityError, match="secret"):
        d.path.add_peer("P", forged)
    assert d.cap.opened == [] and (d.mem == SENTINEL).all()


def test_an_export_from_before_a_deregistration_no_longer_opens() -> None:
    p, d = Exporter(), Importer()
    old = p.path.blob()
    extra = np.zeros(ROW, np.uint8)
    tok = p.path.register([Allocation(extra.ctypes.data, extra.nbytes, MemoryKind.VRAM, 0)])
    p.path.deregister(tok)
    assert d.path.add_peer("P", old).kind == CUDA_IPC  # same registrations again: same bytes, vouched
    p.path.deregister(1)
    with pytest.raises(IdentityError):
        d.path.add_peer("P2", old)


def test_opened_handles_are_shared_by_their_bytes_not_by_the_claimed_identity() -> None:
    e = blob.decode(Exporter().path.blob())
    other = e.chunks.copy()
    other["payload"] = b"another-handle".ljust(64, b"\0")
    twin = dataclasses.replace(e, chunks=other)  # same identity, kind, base, size, device
    rec = (int(e.handles[0]["kind"]), int(e.handles[0]["base"]), int(e.handles[0]["size"]))
    assert rec == (int(twin.handles[0]["kind"]), int(twin.handles[0]["base"]), int(twin.handles[0]["size"]))
    assert handle_key(e, 0, 0) != handle_key(twin, 0, 0)
    assert handle_key(e, 0, 0) == handle_key(blob.decode(blob.encode(e)), 0, 0)


def test_an_exporter_that_ptrace_rules_hide_falls_back_to_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the page cannot be read (Yama, another uid), nothing is opened: the transport carries the bytes."""
    import errno

    from kvxfer.peers import ProofUnavailable

    p, d = Exporter(), Importer()

    def hidden(claim: object, what: str) -> None:
        raise ProofUnavailable(errno.EPERM, f"{what}: ptrace rules forbid reading it")

    monkeypatch.setattr(d.cap, "prove", hidden)
    route = d.path.add_peer("P", p.path.blob())
    assert route.kind is None and "cannot be proven" in route.reason
    assert d.cap.opened == [] and d.path.prepare("P", p.rows(0, 1)) is None
