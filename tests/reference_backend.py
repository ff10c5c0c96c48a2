"""A small cross-process backend over TCP, written from CONTRIBUTING.md, with injectable bugs.

Why it exists: the conformance kit is only as good as the lies it catches. The in-process
loopback cannot die mid-transfer, so this backend streams bytes through sockets between
processes, and each bug in :data:`BUGS` is one plausible slip a plugin author could make
(``tests/test_conformance_mutants.py`` checks the kit fails each one and passes none).

Protocol: each agent listens on 127.0.0.1; a transfer opens one connection and sends one
length-prefixed JSON header (``read``/``write``/``notify`` with the server's token and the
remote spans); raw bytes follow. The owner of the memory checks every span against what it
registered, so bounds hold where the memory lives.
"""

from __future__ import annotations

import ctypes
import json
import secrets
import socket
import struct
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvxfer import Allocation, Backend, Capabilities, DescriptorList, MemoryKind, Op
from kvxfer.errors import (BackendError, KvxferError, MetadataError, OutOfRegistrationError,
                           PeerDisconnectedError, UnknownPeerError)
from kvxfer.spans import SpanIndex

#: Every bug a mutant may inject; each is caught by at least one conformance case.
BUGS = frozenset({"off-by-one", "remote-offset", "swap-direction", "early-done", "drop-descriptor",
                  "ignore-notify", "eof-done", "dead-done", "late-write"})
CHUNK = 1 << 20


def _send(sock: socket.socket, doc: dict[str, Any]) -> None:
    data = json.dumps(doc).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("connection closed")
        buf += got
    return bytes(buf)


def _recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > 64 << 20:
        raise ConnectionError("header too large")
    doc = json.loads(_recv_exact(sock, n))
    if not isinstance(doc, dict):
        raise ConnectionError("header is not an object")
    return doc


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


@dataclass
class _Prep:
    peer: str | None
    descs: np.ndarray  # N x 3 (address, nbytes, device)


@dataclass
class _Xfer:
    sock: socket.socket | None = None
    thread: threading.Thread | None = None
    sent: bool = False
    done: bool = False
    cancelled: bool = False
    error: KvxferError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReferenceBackend(Backend):
    """DRAM over TCP between processes; ``bugs`` is empty in the real thing."""

    name = "reference"
    bugs: frozenset[str] = frozenset()
    capabilities = Capabilities(memory_kinds=frozenset({MemoryKind.DRAM}), ops=frozenset({Op.READ, Op.WRITE}),
                                notifications=True, merges_runs=False, cheap_prepare=True, cross_process=True)

    def __init__(self, agent_name: str, **options: Any) -> None:
        super().__init__(agent_name, **options)
        if options:
            raise BackendError(f"{self.name} takes no options, got {sorted(options)}")
        self._token = secrets.token_hex(16)
        self._regs: dict[int, tuple[Allocation, ...]] = {}
        self._next = 1
        self._bounds = SpanIndex()
        self._peers: dict[str, tuple[str, int, str]] = {}
        self._inbox: dict[str, list[bytes]] = defaultdict(list)
        self._lock = threading.Lock()
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"{self.name}-accept").start()

    # -- memory and peers -------------------------------------------------------------------
    def register(self, allocations: Sequence[Allocation]) -> int:
        h, self._next = self._next, self._next + 1
        self._regs[h] = tuple(allocations)
        self._bounds = SpanIndex(a for regs in self._regs.values() for a in regs)
        return h

    def deregister(self, handle: Any) -> None:
        self._regs.pop(handle, None)
        self._bounds = SpanIndex(a for regs in self._regs.values() for a in regs)

    def local_metadata(self) -> bytes:
        return json.dumps({"port": self._port, "token": self._token}).encode()

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        try:
            doc = json.loads(blob) if len(blob) <= 256 else None
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict) or set(doc) != {"port", "token"} or type(doc["port"]) is not int \
                or not isinstance(doc["token"], str) or not 0 < doc["port"] < 65536:
            raise MetadataError(f"{self.name}: malformed connection blob")
        self._peers[peer_name] = ("127.0.0.1", doc["port"], doc["token"])

    def remove_remote(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def prepare(self, peer: str | None, descs: DescriptorList) -> _Prep:
        arr = descs.expand().array
        if peer is None:
            self._bounds.check(arr, descs.kind, f"agent {self.agent_name!r}")
        elif peer not in self._peers:
            raise UnknownPeerError(f"{self.name}: unknown peer {peer!r}")
        return _Prep(peer, arr)

    # -- transfers --------------------------------------------------------------------------
    def post(self, op: Op, local: _Prep, local_idx: np.ndarray, remote: _Prep, remote_idx: np.ndarray,
             notification: bytes | None) -> _Xfer:
        la, ra = local.descs[local_idx].copy(), remote.descs[remote_idx].copy()
        if not np.array_equal(la[:, 1], ra[:, 1]):
            raise BackendError("paired descriptors differ in length")
        if "swap-direction" in self.bugs:
            op = Op.WRITE if op is Op.READ else Op.READ
        if "off-by-one" in self.bugs:
            la[:, 1] -= 1
            ra[:, 1] -= 1
        if "remote-offset" in self.bugs and len(ra):
            ra[:, 0] = ra[0, 0]
        if "drop-descriptor" in self.bugs:
            la, ra = la[:-1], ra[:-1]
        if "ignore-notify" in self.bugs:
            notification = None
        assert remote.peer is not None
        x = _Xfer()
        x.thread = threading.Thread(target=self._run, args=(x, op, remote.peer, la, ra, notification), daemon=True)
        x.thread.start()
        return x

    def _connect(self, peer: str) -> tuple[socket.socket, str]:
        if peer not in self._peers:
            raise UnknownPeerError(f"{self.name}: unknown peer {peer!r}")
        host, port, token = self._peers[peer]
        try:
            return socket.create_connection((host, port), timeout=30), token
        except OSError as exc:
            raise PeerDisconnectedError(f"{self.name}: peer {peer!r} is unreachable: {exc}") from None

    def _run(self, x: _Xfer, op: Op, peer: str, la: np.ndarray, ra: np.ndarray, note: bytes | None) -> None:
        try:
            sock, token = self._connect(peer)
            with x.lock:
                if x.cancelled:
                    sock.close()
                    return
                x.sock = sock
            spans = [[int(a), int(n)] for a, n, _ in ra.tolist()]
            _send(sock, {"op": op.value, "token": token, "spans": spans, "sender": self.agent_name,
                         "note": None if note is None else note.hex()})
            reply = _recv(sock)
            if "error" in reply:
                raise (OutOfRegistrationError if reply["error"] == "OutOfRegistrationError" else BackendError)(
                    reply["message"])
            x.sent = True
            for addr, n, _ in la.tolist():
                view, got = _view(int(addr), int(n)), 0
                while got < n and not x.cancelled:
                    if op is Op.READ:
                        k = sock.recv_into(view[got:got + CHUNK])
                        if k == 0:
                            if "eof-done" in self.bugs:
                                x.done = True  # the bug: the stream ended, so we must be finished
                                return
                            raise ConnectionError("peer closed the stream mid-transfer")
                    else:
                        k = len(view[got:got + CHUNK])
                        sock.sendall(view[got:got + CHUNK])
                    got += k
            if x.cancelled:
                return
            if "done" not in _recv(sock):  # the peer has every byte (WRITE) or sent every byte (READ)
                raise BackendError("peer did not confirm the transfer")
            if op is Op.READ and note is not None:
                _send(sock, {"op": "notify", "note": note.hex()})
                _recv(sock)
            x.done = True
        except KvxferError as exc:
            x.error = self._dead_done(x, exc)
        except (OSError, ValueError, struct.error) as exc:
            if not x.cancelled:
                x.error = self._dead_done(x, PeerDisconnectedError(f"{self.name}: peer {peer!r} lost: {exc}"))
        finally:
            if x.sock is not None:
                x.sock.close()

    def _dead_done(self, x: _Xfer, exc: KvxferError) -> KvxferError | None:
        if "dead-done" in self.bugs and isinstance(exc, PeerDisconnectedError):
            x.done = True  # the bug: a peer that went away counts as finished
            return None
        return exc

    def poll(self, xfer: _Xfer) -> bool:
        if xfer.error is not None:
            raise xfer.error
        return xfer.done or ("early-done" in self.bugs and xfer.sent)

    def release(self, xfer: _Xfer) -> None:
        if "late-write" in self.bugs:
            return  # the bug: the end is reported while the reading thread may still write
        with xfer.lock:
            xfer.cancelled = True
            if xfer.sock is not None:
                try:
                    xfer.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if xfer.thread is not None and xfer.thread is not threading.current_thread():
            xfer.thread.join(30)

    # -- the serving side -------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            req = _recv(conn)
            if req.get("token") != self._token:
                return _send(conn, {"error": "MetadataError", "message": "wrong token (stale metadata?)"})
            spans = np.array(req.get("spans") or [], dtype=np.uint64).reshape(-1, 2)
            descs = np.zeros((len(spans), 3), np.uint64)
            descs[:, :2] = spans
            try:
                self._bounds.check(descs, MemoryKind.DRAM, f"agent {self.agent_name!r}")
            except OutOfRegistrationError as exc:
                return _send(conn, {"error": "OutOfRegistrationError", "message": str(exc)})
            _send(conn, {"ok": True})
            for addr, n in spans.tolist():
                view, got = _view(int(addr), int(n)), 0
                while got < n:
                    if req["op"] == "READ":
                        conn.sendall(view[got:got + CHUNK])
                        got += len(view[got:got + CHUNK])
                    else:
                        k = conn.recv_into(view[got:got + CHUNK])
                        if k == 0:
                            return  # the initiator went away or cancelled
                        got += k
            if req["op"] == "WRITE" and req.get("note") is not None:
                self._deliver(str(req["sender"]), bytes.fromhex(req["note"]))  # after the data
            _send(conn, {"done": True})
            while True:  # a READ's notification follows on the same connection
                msg = _recv(conn)
                self._deliver(str(req["sender"]), bytes.fromhex(msg["note"]))
                _send(conn, {"ok": True})
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            pass
        finally:
            conn.close()

    def _deliver(self, sender: str, message: bytes) -> None:
        with self._lock:
            self._inbox[sender].append(message)

    # -- notifications and lifetime ---------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        sock, token = self._connect(peer)
        try:
            _send(sock, {"op": "NOTIFY", "token": token, "spans": [], "sender": self.agent_name, "note": None})
            _recv(sock)
            _recv(sock)
            _send(sock, {"op": "notify", "note": bytes(message).hex()})
            _recv(sock)
        except (OSError, ValueError, struct.error) as exc:
            raise PeerDisconnectedError(f"{self.name}: notify to {peer!r} failed: {exc}") from None
        finally:
            sock.close()

    def drain_notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            out = dict(self._inbox)
            self._inbox.clear()
        return out

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self._regs.clear()
        self._bounds = SpanIndex()
