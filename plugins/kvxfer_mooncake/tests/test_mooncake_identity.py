"""Same-host identity: a Mooncake blob reaches the process it names, or is refused.

One peer process (``mooncake_peer.py``) serves a known pattern. Its genuine blob is proven
and read (the control of every attack); edited copies are refused with ``IdentityError``
before anything is kept or sent: another process's session under its identity, a session of
this process under its identity, a forged token, memory it did not publish, a claim of
another host on a loopback session. Each attack that a single check stops has a control with
that check switched off, showing the blob is then accepted.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from kvxfer import Allocation, DescriptorList, Op  # noqa: E402
from kvxfer.testing.lines import Channel  # noqa: E402
from kvxfer.errors import IdentityError  # noqa: E402
from kvxfer_mooncake import _blob, _identity, backend as mb  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from mooncake_peer import pattern  # noqa: E402

SENT = 0xAA
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[subprocess.Popen[str], bytes]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    p = subprocess.Popen([sys.executable, str(HERE / "mooncake_peer.py"), "1"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        yield p, bytes.fromhex(Channel(p).line(60).strip())
    finally:
        p.kill()
        p.wait()


@pytest.fixture
def me() -> Iterator[mb.MooncakeBackend]:
    be = mb.MooncakeBackend("decode", trusted_network=True, progress_timeout=2)
    try:
        yield be
    finally:
        be.close()


def _edit(blob: bytes, *, session: str | None = None, regions: Any = None, **claim: Any) -> bytes:
    b = _blob.decode(blob, "peer")
    who = dataclasses.replace(b.identity, **claim)
    return _blob.encode(b.session if session is None else session, b.regions if regions is None else regions, who)


def test_genuine_peer_is_proven_and_read(peer: Any, me: mb.MooncakeBackend) -> None:
    """The control of every attack below: the peer's own blob is proven and its bytes read."""
    p, blob = peer
    assert _blob.decode(blob, "peer").identity.pid == p.pid
    dst = np.full(8192, SENT, np.uint8)
    me.register([Allocation(dst.ctypes.data, dst.nbytes)])
    me.add_remote("peer", blob)
    base = _blob.decode(blob, "peer").regions[0][0]
    local = me.prepare(None, DescriptorList(np.array([[dst.ctypes.data, 4096, 0]], dtype=np.uint64)))
    remote = me.prepare("peer", DescriptorList(np.array([[base + 4096, 4096, 0]], dtype=np.uint64)))
    x = me.post(Op.READ, local, np.arange(1), remote, np.arange(1), None)
    while not me.poll(x):
        pass
    np.testing.assert_array_equal(dst[:4096], pattern(1 << 20)[4096:8192])
    assert (dst[4096:] == SENT).all()


@pytest.mark.parametrize("checked", [True, False], ids=["refused", "control-port-check-off"])
def test_identity_of_another_process_on_a_foreign_session_is_refused(
        peer: Any, me: mb.MooncakeBackend, checked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's genuine public identity over a session another process (a plain listening
    socket here) serves: the claimed process holds its secret, but not the port. Control:
    without the port check, the blob is accepted."""
    _, blob = peer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        forged = _edit(blob, session=f"127.0.0.1:{s.getsockname()[1]}", regions=[])
        if not checked:
            monkeypatch.setattr(_identity, "listens", lambda pid, port: True)
            me.add_remote("peer", forged)
            return
        with pytest.raises(IdentityError, match="does not listen"):
            me.add_remote("peer", forged)
    assert "peer" not in me._peers


def test_identity_of_another_process_on_our_own_session_is_refused(peer: Any, me: mb.MooncakeBackend) -> None:
    """The peer's identity with this process's session: we would move bytes within our own
    memory at addresses a peer chose. Control: our own genuine blob is accepted."""
    _, blob = peer
    buf = np.zeros(4096, np.uint8)
    me.register([Allocation(buf.ctypes.data, buf.nbytes)])
    with pytest.raises(IdentityError, match="served by this process"):
        me.add_remote("peer", _edit(blob, session=me.session, regions=[(buf.ctypes.data, 4096)]))
    me.add_remote("self", me.local_metadata())  # control


def test_forged_token_is_refused(peer: Any, me: mb.MooncakeBackend) -> None:
    _, blob = peer
    with pytest.raises(IdentityError, match="secret"):
        me.add_remote("peer", _edit(blob, token=os.urandom(16)))


def test_memory_the_peer_did_not_publish_is_refused(peer: Any, me: mb.MooncakeBackend) -> None:
    """A region past what the peer registered (and published on its proof page)."""
    _, blob = peer
    (base, n), = _blob.decode(blob, "peer").regions
    with pytest.raises(IdentityError, match="did not register"):
        me.add_remote("peer", _edit(blob, regions=[(base, n + 4096)]))


@pytest.mark.parametrize("checked", [True, False], ids=["refused", "control-host-rule-off"])
def test_other_host_claim_on_a_loopback_session_is_refused(peer: Any, me: mb.MooncakeBackend, checked: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim of another boot (so nothing would be proven) over a session on this host.
    Control: with the session taken for a remote one, the unproven blob is accepted."""
    _, blob = peer
    forged = _edit(blob, boot_id=os.urandom(16))
    if not checked:
        monkeypatch.setattr(_identity, "_this_host", lambda host, own: False)
        me.add_remote("peer", forged)
        return
    with pytest.raises(IdentityError, match="claims another host"):
        me.add_remote("peer", forged)


def test_claim_of_this_process_without_a_live_agent_is_refused(peer: Any, me: mb.MooncakeBackend) -> None:
    """Our own identity over the peer's session: refused, nothing here sent it."""
    from kvxfer.plugin import identity as ident

    _, blob = peer
    b = _blob.decode(blob, "peer")
    with pytest.raises(IdentityError, match="names this process"):
        me.add_remote("peer", _blob.encode(b.session, b.regions, ident.here()))
