"""The side channel under hostile clients: slow sockets, floods, replays, disabled deadlines.

No assertion is on elapsed time. "Legitimate clients are not delayed" is checked as "every
legitimate call succeeds while 64 slow clients hold their connections open", which the old
thread-per-socket server failed outright (it answered ServerBusyError). Memory is measured
in a child process, so the test's own client buffers do not count, with a loose bound.
"""

from __future__ import annotations

import math
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import Errors
from kvxfer.errors import InvalidTimeoutError
from kvxfer.testing.lines import Channel
from kvxfer.sidechannel import (
    HEADER_SIZE,
    NO_AUTH,
    HandshakeAuthError,
    HandshakeError,
    HandshakeReplayError,
    MetadataServer,
    ServerBusyError,
    encode_header,
    exchange,
    fetch,
)
from kvxfer.sidechannel.frames import AUTH, CHALLENGE, ERROR, EXCHANGE, HELLO, decode_header

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hostile-test-token"
PREFILL = b"prefill-metadata:" + bytes(range(256)) * 4
DECODE = b"decode-metadata:" + bytes(range(256)) * 4


@pytest.fixture
def server(errors: Errors) -> Iterator[MetadataServer]:
    with MetadataServer(PREFILL, token=TOKEN, on_error=errors, timeout=60) as srv:
        yield srv


def still_connected(sock: socket.socket) -> bool:
    """True while the server keeps this socket open (it may have sent a CHALLENGE)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


# --------------------------------------------------------------------------- slow clients


def test_64_slow_clients_do_not_delay_token_holders(server: MetadataServer) -> None:
    """Silent sockets, half headers and HELLOs without AUTH: none of them holds a slot."""
    slow: list[socket.socket] = []
    try:
        for i in range(64):
            s = socket.create_connection(server.address, timeout=10)
            if i % 3 == 1:
                s.sendall(encode_header(HELLO, 33)[:7])  # half a header, then nothing
            elif i % 3 == 2:
                s.sendall(encode_header(HELLO, 33) + b"\1" + os.urandom(32))  # a HELLO, never an AUTH
            slow.append(s)
        for i in range(20):
            assert exchange(*server.address, DECODE + b"%d" % i, token=TOKEN, timeout=30) == PREFILL
        assert all(still_connected(s) for s in slow), "the server must not have needed to drop anyone"
    finally:
        for s in slow:
            s.close()


def test_unauthenticated_sockets_beyond_max_pending_evict_the_oldest(errors: Errors) -> None:
    with MetadataServer(PREFILL, token=TOKEN, on_error=errors, max_pending=4, timeout=60) as srv:
        slow = [socket.create_connection(srv.address, timeout=10) for _ in range(4)]
        try:
            assert fetch(*srv.address, token=TOKEN, timeout=30) == PREFILL
            # Accepting the legitimate client dropped the oldest silent one, with a reason.
            reply = read_all(slow[0])
            assert decode_header(reply[:HEADER_SIZE])[0] == ERROR
            assert isinstance(errors.get(), ServerBusyError)
            assert all(still_connected(s) for s in slow[1:])
        finally:
            for s in slow:
                s.close()


def test_a_client_without_the_token_never_gets_a_slot(errors: Errors) -> None:
    """max_connections=1: neither a stalled HELLO nor a wrong token takes the only slot."""
    with MetadataServer(PREFILL, token=TOKEN, on_error=errors, max_connections=1, timeout=60) as srv:
        with socket.create_connection(srv.address, timeout=10) as stalled:
            stalled.sendall(encode_header(HELLO, 33) + b"\1" + os.urandom(32))
            for _ in range(5):
                with pytest.raises(HandshakeAuthError):
                    fetch(*srv.address, token="not-the-token", timeout=30)
            for _ in range(5):
                assert fetch(*srv.address, token=TOKEN, timeout=30) == PREFILL
            assert still_connected(stalled)


# --------------------------------------------------------------------------- floods

FLOOD_CHILD = textwrap.dedent(
    """
    import sys
    from kvxfer.sidechannel import MetadataServer, NO_AUTH

    token = NO_AUTH if sys.argv[1] == "-" else sys.argv[1]
    with MetadataServer(b"m" * 1000, token=token, on_peer=lambda b: None, on_error=lambda e: None,
                        timeout=60) as srv:
        print(srv.address[1], flush=True)
        for _ in sys.stdin:  # one line in, the resident set size (kB) out
            status = open("/proc/self/status").read()
            print(int(status.split("VmRSS:")[1].split()[0]), flush=True)
    """
)


def _flood(token: str, client) -> tuple[float, list[object]]:  # type: ignore[no-untyped-def]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen([sys.executable, "-c", FLOOD_CHILD, token], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    ch = Channel(child)

    def rss_mb() -> float:
        ch.send_line("")
        return int(ch.line(60)) / 1024

    try:
        port = int(ch.line(60))
        base = rss_mb()
        outcomes: list[object] = [None] * 64
        threads = [threading.Thread(target=client, args=(port, outcomes, i)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        # The server returns freed memory once it goes idle; a reading may precede that.
        readings = []
        for _ in range(3):
            time.sleep(0.7)
            readings.append(rss_mb() - base)
        return min(readings), outcomes
    finally:
        child.stdin.close()
        child.wait(timeout=30)


FLOOD = 16 << 20


def _raw_flood(port: int, outcomes: list[object], i: int) -> None:
    blob = b"\xab" * FLOOD
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(encode_header(EXCHANGE, FLOOD) + blob)
        outcomes[i] = "sent"
    except OSError as exc:
        outcomes[i] = type(exc).__name__


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_unauthenticated_16mib_flood_leaves_no_resident_memory() -> None:
    growth, outcomes = _flood(TOKEN, _raw_flood)
    assert None not in outcomes
    assert growth < 16, f"64 x 16 MiB unauthenticated flood left +{growth:.1f} MB resident"


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
@pytest.mark.parametrize("token", [TOKEN, "-"], ids=["token-holders", "no-auth"])
def test_authenticated_16mib_flood_stays_bounded(token: str) -> None:
    """Clients that may send 16 MiB each: bounded by max_buffered while it lasts, freed after."""
    def client(port: int, outcomes: list[object], i: int) -> None:
        try:
            exchange("127.0.0.1", port, b"\xcd" * FLOOD, token=NO_AUTH if token == "-" else token, timeout=60)
            outcomes[i] = "ok"
        except HandshakeError as exc:
            outcomes[i] = type(exc).__name__

    growth, outcomes = _flood(token, client)
    assert set(outcomes) <= {"ok", "ServerBusyError"} and "ok" in outcomes
    assert growth < 64, f"64 x 16 MiB flood left +{growth:.1f} MB resident"


# --------------------------------------------------------------------------- replays


def _record_client_frames(monkeypatch: pytest.MonkeyPatch, srv: MetadataServer) -> list[bytes]:
    frames: list[bytes] = []
    real = socket.socket.sendall

    def spy(self: socket.socket, data: bytes, *args: int) -> None:
        frames.append(bytes(data))
        real(self, data, *args)

    with monkeypatch.context() as m:
        m.setattr(socket.socket, "sendall", spy)
        assert exchange(*srv.address, DECODE, token=TOKEN) == PREFILL
    return frames


def test_a_replayed_client_conversation_is_named_a_replay(monkeypatch: pytest.MonkeyPatch, errors: Errors) -> None:
    peers: queue.Queue[bytes] = queue.Queue()
    with MetadataServer(PREFILL, token=TOKEN, on_peer=peers.put, on_error=errors) as srv:
        hello, auth_frame, exchange_frame = _record_client_frames(monkeypatch, srv)
        assert peers.get(timeout=10) == DECODE
        with socket.create_connection(srv.address, timeout=10) as s:
            s.sendall(hello)
            head = s.recv(HEADER_SIZE, socket.MSG_WAITALL)
            assert decode_header(head)[0] == CHALLENGE
            s.recv(decode_header(head)[1], socket.MSG_WAITALL)
            s.sendall(auth_frame + exchange_frame)
            reply = read_all(s)
        assert decode_header(reply[:HEADER_SIZE])[0] == ERROR
        assert reply[HEADER_SIZE] == HandshakeReplayError.code
        err = errors.get()
        assert isinstance(err, HandshakeReplayError)
        assert "different tokens" not in str(err) and "replayed" in str(err)
        assert peers.empty()  # the replayed metadata never reached on_peer


def test_a_replayed_server_challenge_is_named_a_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake server that plays back a recorded CHALLENGE cannot pass as the real one."""
    recorded: list[tuple[int, bytes]] = []
    real_recv = socket.socket.recv

    with MetadataServer(PREFILL, token=TOKEN) as srv:
        with monkeypatch.context() as m:
            def spy(self: socket.socket, n: int, *args: int) -> bytes:
                data = real_recv(self, n, *args)
                recorded.append((id(self), data))
                return data

            m.setattr(socket.socket, "recv", spy)
            assert fetch(*srv.address, token=TOKEN) == PREFILL
    # The client read the CHALLENGE as a header, then its payload, on one socket.
    i = next(i for i, (_, d) in enumerate(recorded) if len(d) == HEADER_SIZE and d[5] == CHALLENGE)
    payload = next(d for sid, d in recorded[i + 1:] if sid == recorded[i][0])
    challenge = recorded[i][1] + payload
    assert len(payload) == decode_header(recorded[i][1])[1]

    with socket.create_server(("127.0.0.1", 0)) as fake:
        def play_back() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(HEADER_SIZE + 33, socket.MSG_WAITALL)
                conn.sendall(challenge)
                read_all(conn)

        t = threading.Thread(target=play_back, daemon=True)
        t.start()
        with pytest.raises(HandshakeReplayError, match="replayed"):
            fetch(*fake.getsockname(), token=TOKEN, timeout=10)
        t.join(timeout=10)


def test_a_wrong_token_is_still_called_a_token_mismatch(errors: Errors) -> None:
    with MetadataServer(PREFILL, token=TOKEN, on_error=errors) as srv:
        with pytest.raises(HandshakeAuthError, match="different tokens") as info:
            fetch(*srv.address, token="other", timeout=10)
        assert not isinstance(info.value, HandshakeReplayError)


# --------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1, 0, True, "5"])
def test_deadlines_cannot_be_disabled(bad: object) -> None:
    with pytest.raises(InvalidTimeoutError):
        MetadataServer(PREFILL, token=TOKEN, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTimeoutError):
        fetch("127.0.0.1", 9, token=TOKEN, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTimeoutError):
        exchange("127.0.0.1", 9, DECODE, token=TOKEN, timeout=bad)  # type: ignore[arg-type]


def test_auth_frame_without_hello_is_a_protocol_error(server: MetadataServer, errors: Errors) -> None:
    with socket.create_connection(server.address, timeout=10) as s:
        s.sendall(encode_header(AUTH, 64) + bytes(64))
        reply = read_all(s)
    assert decode_header(reply[:HEADER_SIZE])[0] == ERROR
    assert "AUTH" in str(errors.get())


# --------------------------------------------------------------------------- end to end


def test_no_unauthenticated_byte_reaches_add_peer() -> None:
    """MetadataServer(on_peer=agent.add_peer): a client without the token, or with garbage,
    never gets its bytes to the agent, let alone the backend; a token holder's do arrive."""
    import kvxfer
    from kvxfer._harness import faults
    from kvxfer.testing.buffers import make_cache

    faults.install()
    try:
        f = faults.Faults()
        geom = {"num_blocks": 4, "num_layers": 2, "page": 64}
        with kvxfer.Agent("prefill", backend="faulty", token=TOKEN, faults=f) as prefill, \
                kvxfer.Agent("decode", backend="faulty", token=TOKEN) as decode, \
                kvxfer.Agent("intruder", backend="faulty") as intruder:
            for agent in (prefill, decode, intruder):
                agent.register(make_cache("packed", **geom).views)
            rejected: queue.Queue[HandshakeError] = queue.Queue()
            with MetadataServer(prefill.metadata(), token=TOKEN, on_peer=prefill.add_peer,
                                on_error=rejected.put) as srv:
                for token in ("guess", NO_AUTH):
                    with pytest.raises(HandshakeAuthError):
                        exchange(*srv.address, intruder.metadata(), token=token, timeout=10)
                with socket.create_connection(srv.address, timeout=10) as s:
                    s.sendall(encode_header(EXCHANGE, len(intruder.metadata())) + intruder.metadata())
                    read_all(s)
                for _ in range(3):
                    rejected.get(timeout=30)
                assert f.added == [] and prefill.peers == {}
                theirs = exchange(*srv.address, decode.metadata(), token=TOKEN, timeout=10)
                assert decode.add_peer(theirs) == "prefill"
                assert f.added == ["decode"] and set(prefill.peers) == {"decode"}
    finally:
        faults.uninstall()


def test_close_from_inside_a_callback() -> None:
    closed = threading.Event()
    box: list[MetadataServer] = []

    def on_peer(metadata: bytes) -> None:
        box[0].close(grace=0.1)
        closed.set()

    with MetadataServer(PREFILL, token=TOKEN, on_peer=on_peer) as srv:
        box.append(srv)
        with pytest.raises(HandshakeError):
            exchange(*srv.address, DECODE, token=TOKEN, timeout=10)
        assert closed.wait(10)
    with pytest.raises(HandshakeError):
        fetch(*srv.address, token=TOKEN, timeout=2)
