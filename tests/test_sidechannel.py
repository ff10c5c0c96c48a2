"""Tests for the metadata side channel (kvxfer.sidechannel).

Every failure path asserts on the error type and on the server staying usable, never on
elapsed seconds: deadlines are short so a hang would show up as a pytest-timeout failure.
"""

from __future__ import annotations

import contextlib
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
from hypothesis import given
from hypothesis import strategies as st

from common import Errors
from kvxfer.errors import HandshakeError, KvxferError
from kvxfer.testing.lines import Channel
from kvxfer.sidechannel import (
    DEFAULT_MAX_MESSAGE,
    NO_AUTH,
    HEADER_SIZE,
    MAGIC,
    HandshakeAuthError,
    HandshakeProtocolError,
    HandshakeTimeoutError,
    MessageTooLargeError,
    MetadataServer,
    PeerRejectedError,
    ServerBusyError,
    TokenRequiredError,
    decode_header,
    encode_header,
    exchange,
    fetch,
)

REPO = Path(__file__).resolve().parents[1]
PREFILL = b"prefill-agent\x00" + bytes(range(256)) * 8
DECODE = b"decode-agent\x00" + bytes(range(255, -1, -1)) * 8
TOKEN = "test-token"


@pytest.fixture
def server(errors: Errors) -> Iterator[tuple[MetadataServer, queue.Queue[bytes]]]:
    peers: queue.Queue[bytes] = queue.Queue()
    with MetadataServer(PREFILL, token=TOKEN, on_peer=peers.put, on_error=errors, timeout=2.0) as srv:
        yield srv, peers


def assert_still_serving(srv: MetadataServer) -> None:
    assert exchange(*srv.address, DECODE, token=TOKEN) == PREFILL


def raw_connect(srv: MetadataServer) -> socket.socket:
    return socket.create_connection(srv.address, timeout=10)


def read_error_frame(sock: socket.socket) -> bytes:
    """What a raw client gets back after misbehaving: an ERROR frame, then EOF."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:  # the server closed with our unread bytes still queued
        pass
    return data


# --------------------------------------------------------------------------- happy paths


def test_round_trip(server: tuple[MetadataServer, queue.Queue[bytes]]) -> None:
    srv, peers = server
    assert exchange(*srv.address, DECODE, token=TOKEN) == PREFILL
    assert peers.get(timeout=10) == DECODE


def test_fetch_does_not_report_a_peer(server: tuple[MetadataServer, queue.Queue[bytes]]) -> None:
    srv, peers = server
    assert fetch(*srv.address, token=TOKEN) == PREFILL
    assert exchange(*srv.address, b"", token=TOKEN) == PREFILL  # empty metadata is still an exchange
    assert peers.get(timeout=10) == b""
    assert peers.empty()


def test_callable_metadata_is_read_per_client() -> None:
    generation = iter(range(100))
    with MetadataServer(lambda: b"gen-%d" % next(generation), token=TOKEN) as srv:
        assert fetch(*srv.address, token=TOKEN) == b"gen-0"
        assert fetch(*srv.address, token=TOKEN) == b"gen-1"


def test_concurrent_clients(server: tuple[MetadataServer, queue.Queue[bytes]]) -> None:
    srv, peers = server
    n = 8
    barrier = threading.Barrier(n)
    results: list[bytes | BaseException] = [b""] * n

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = exchange(*srv.address, b"decode-%d" % i, token=TOKEN, timeout=20)
        except BaseException as exc:  # surfaced by the assert below
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [PREFILL] * n
    received = sorted(peers.get(timeout=10) for _ in range(n))
    assert received == sorted(b"decode-%d" % i for i in range(n))


def test_errors_are_kvxfer_errors() -> None:
    assert issubclass(HandshakeTimeoutError, HandshakeError)
    assert issubclass(HandshakeTimeoutError, TimeoutError)
    assert issubclass(HandshakeError, KvxferError)


# --------------------------------------------------------------------------- authentication


def test_token_ok() -> None:
    peers: queue.Queue[bytes] = queue.Queue()
    with MetadataServer(PREFILL, token="s3cret", on_peer=peers.put) as srv:
        assert exchange(*srv.address, DECODE, token="s3cret") == PREFILL
        assert fetch(*srv.address, token="s3cret") == PREFILL
        assert peers.get(timeout=10) == DECODE


@pytest.mark.parametrize(
    ("server_token", "client_token"),
    [("s3cret", "wrong"), ("s3cret", NO_AUTH), (NO_AUTH, "s3cret")],
    ids=["wrong-token", "client-missing-token", "server-missing-token"],
)
def test_token_mismatch_fails_on_both_sides(
    errors: Errors, server_token: object, client_token: object
) -> None:
    peers: queue.Queue[bytes] = queue.Queue()
    with MetadataServer(PREFILL, token=server_token, on_peer=peers.put, on_error=errors) as srv:
        with pytest.raises(HandshakeAuthError):
            exchange(*srv.address, DECODE, token=client_token)
        assert isinstance(errors.get(), HandshakeAuthError)
        assert peers.empty()  # an unauthenticated client's metadata never reaches on_peer
        assert fetch(*srv.address, token=server_token) == PREFILL


def test_token_never_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[bytes] = []
    real_sendall, real_send = socket.socket.sendall, socket.socket.send

    def spy_all(self: socket.socket, data: bytes, *args: int) -> None:
        sent.append(bytes(data))
        real_sendall(self, data, *args)

    def spy(self: socket.socket, data: bytes, *args: int) -> int:
        n = real_send(self, data, *args)
        sent.append(bytes(data[:n]))
        return n

    monkeypatch.setattr(socket.socket, "sendall", spy_all)
    monkeypatch.setattr(socket.socket, "send", spy)
    token = "a-rather-long-shared-secret"
    with MetadataServer(PREFILL, token=token) as srv:
        assert exchange(*srv.address, DECODE, token=token) == PREFILL
    wire = b"".join(sent)
    assert DECODE in wire and PREFILL in wire  # the spy did see the conversation
    assert token.encode() not in wire


def test_metadata_altered_in_flight_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    real_send = socket.socket.send

    def flip_reply(self: socket.socket, data: bytes, *args: int) -> int:
        if bytes(data) == PREFILL:  # the server's metadata: corrupt its last byte
            data = bytes(data[:-1]) + bytes([data[-1] ^ 0xFF])
        return real_send(self, data, *args)

    monkeypatch.setattr(socket.socket, "send", flip_reply)
    with MetadataServer(PREFILL, token="s3cret") as srv:
        with pytest.raises(HandshakeAuthError, match="REPLY"):
            exchange(*srv.address, DECODE, token="s3cret")


def test_client_metadata_altered_in_flight_is_detected(monkeypatch: pytest.MonkeyPatch, errors: Errors) -> None:
    real_sendall = socket.socket.sendall

    def flip_exchange(self: socket.socket, data: bytes, *args: int) -> None:
        if data[5:6] == bytes([3]):  # an EXCHANGE frame: corrupt its last metadata byte
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        real_sendall(self, data, *args)

    monkeypatch.setattr(socket.socket, "sendall", flip_exchange)
    peers: queue.Queue[bytes] = queue.Queue()
    with MetadataServer(PREFILL, token="s3cret", on_peer=peers.put, on_error=errors) as srv:
        with pytest.raises(HandshakeAuthError, match="EXCHANGE"):
            exchange(*srv.address, DECODE, token="s3cret")
        assert isinstance(errors.get(), HandshakeAuthError)
    assert peers.empty()


def test_empty_token_is_refused() -> None:
    with pytest.raises(ValueError):
        MetadataServer(PREFILL, token="")


def test_a_token_is_required_unless_opted_out() -> None:
    with pytest.raises(TokenRequiredError, match="NO_AUTH"):
        MetadataServer(PREFILL)
    with pytest.raises(TokenRequiredError):
        fetch("127.0.0.1", 9)
    with pytest.raises(TokenRequiredError):
        exchange("127.0.0.1", 9, DECODE, token=None)
    with pytest.raises(TypeError):
        MetadataServer(PREFILL, token=["not", "a", "token"])
    with MetadataServer(PREFILL, token=NO_AUTH) as srv:  # the explicit opt-out works
        assert "auth=off" in repr(srv)
        assert exchange(*srv.address, DECODE, token=NO_AUTH) == PREFILL


# --------------------------------------------------------------------------- size limits


def test_client_metadata_too_large_for_server(errors: Errors) -> None:
    with MetadataServer(PREFILL, token=TOKEN, max_message=64 * 1024, on_error=errors) as srv:
        with pytest.raises(MessageTooLargeError):
            exchange(*srv.address, b"x" * (4 * 1024 * 1024), token=TOKEN)
        assert isinstance(errors.get(), MessageTooLargeError)
        assert_still_serving(srv)


def test_server_metadata_too_large_for_client(errors: Errors) -> None:
    with MetadataServer(b"y" * 100_000, token=TOKEN, on_error=errors) as srv:
        with pytest.raises(MessageTooLargeError):
            fetch(*srv.address, token=TOKEN, max_message=1000)
        assert len(fetch(*srv.address, token=TOKEN)) == 100_000


def test_error_frames_get_through_a_tiny_max_message(errors: Errors) -> None:
    with MetadataServer(PREFILL, token="s3cret", on_error=errors) as srv:
        with pytest.raises(HandshakeAuthError):
            fetch(*srv.address, token=NO_AUTH, max_message=0)
        assert fetch(*srv.address, token="s3cret", max_message=len(PREFILL)) == PREFILL


def test_own_metadata_too_large_is_caught_before_sending() -> None:
    with pytest.raises(MessageTooLargeError):
        exchange("127.0.0.1", 9, b"z" * 2000, token=TOKEN, max_message=1000)
    with pytest.raises(MessageTooLargeError):
        MetadataServer(b"z" * 2000, token=TOKEN, max_message=1000)


def test_callable_metadata_too_large_or_failing(errors: Errors) -> None:
    with MetadataServer(lambda: b"z" * 2000, token=TOKEN, max_message=1000, on_error=errors) as srv:
        with pytest.raises(MessageTooLargeError):
            fetch(*srv.address, token=TOKEN)

    def broken() -> bytes:
        raise RuntimeError("spec not registered yet")

    with MetadataServer(broken, token=TOKEN, on_error=errors) as srv:
        with pytest.raises(PeerRejectedError, match="spec not registered yet"):
            fetch(*srv.address, token=TOKEN)


def test_on_peer_rejection_reaches_the_client(errors: Errors) -> None:
    def on_peer(metadata: bytes) -> None:
        raise ValueError("generation went backwards")

    with MetadataServer(PREFILL, token=TOKEN, on_peer=on_peer, on_error=errors) as srv:
        with pytest.raises(PeerRejectedError, match="generation went backwards"):
            exchange(*srv.address, DECODE, token=TOKEN)
        assert isinstance(errors.get(), PeerRejectedError)


# --------------------------------------------------------------------------- hostile bytes

GARBAGE = {
    "not-the-protocol": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "wrong-magic": b"NOPE" + encode_header(1, 33)[4:] + b"\0" * 33,
    "wrong-version": MAGIC + bytes([99, 1, 0, 0]) + (33).to_bytes(4, "big") + b"\0" * 33,
    "unknown-type": encode_header(77, 0),
    "reserved-bits": MAGIC + bytes([1, 1, 0, 1]) + (33).to_bytes(4, "big") + b"\0" * 33,
    "hello-too-long": encode_header(1, 1 << 30),
    "hello-too-short": encode_header(1, 3) + b"\0\0\0",
    "unknown-flags": encode_header(1, 33) + b"\x80" + b"\0" * 32,
    "out-of-order": encode_header(5, 4) + b"meta",
    "truncated-header": MAGIC + b"\x01",
    "truncated-payload": encode_header(1, 33) + b"\0" * 10,
}


@pytest.mark.parametrize("payload", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_is_rejected_and_server_keeps_serving(
    server: tuple[MetadataServer, queue.Queue[bytes]], errors: Errors, payload: bytes
) -> None:
    srv, _ = server
    with raw_connect(srv) as sock:
        sock.sendall(payload)
        with contextlib.suppress(OSError):  # the server may already have hung up on us
            sock.shutdown(socket.SHUT_WR)  # EOF: truncated frames fail now, not at the deadline
        reply = read_error_frame(sock)
    assert isinstance(errors.get(), HandshakeProtocolError)
    assert reply[:HEADER_SIZE] == encode_header(6, len(reply) - HEADER_SIZE)  # an ERROR frame
    assert_still_serving(srv)


def test_garbage_from_a_fake_server_is_rejected_by_the_client() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(HEADER_SIZE + 33)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        host, port = listener.getsockname()
        with pytest.raises(HandshakeProtocolError, match="magic"):
            exchange(host, port, DECODE, token=TOKEN, timeout=10)
        t.join(timeout=10)


# --------------------------------------------------------------------------- deadlines


def test_client_times_out_against_a_silent_server() -> None:
    # Listening but never accepting: the kernel completes the TCP handshake from the backlog,
    # then nobody ever answers.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host, port = listener.getsockname()
        with pytest.raises(HandshakeTimeoutError):
            exchange(host, port, DECODE, token=TOKEN, timeout=0.3)
        with pytest.raises(HandshakeTimeoutError):
            fetch(host, port, token=TOKEN, timeout=0.3)


def test_server_drops_a_silent_client_and_serves_others_meanwhile(errors: Errors) -> None:
    with MetadataServer(PREFILL, token=TOKEN, on_error=errors, timeout=1.0) as srv:
        with raw_connect(srv) as silent:
            # While the silent client holds its connection, others are served.
            assert_still_serving(srv)
            assert_still_serving(srv)
            assert isinstance(errors.get(), HandshakeTimeoutError)
            read_error_frame(silent)  # the server hung up on it
        assert_still_serving(srv)


def test_busy_server_turns_clients_away(errors: Errors) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_metadata() -> bytes:
        entered.set()
        release.wait(30)
        return PREFILL

    with MetadataServer(slow_metadata, token=TOKEN, max_connections=1, on_error=errors, timeout=30) as srv:
        first: queue.Queue[bytes] = queue.Queue()
        t = threading.Thread(target=lambda: first.put(fetch(*srv.address, token=TOKEN, timeout=30)))
        t.start()
        assert entered.wait(30)
        with pytest.raises(ServerBusyError):
            fetch(*srv.address, token=TOKEN)
        release.set()
        assert first.get(timeout=30) == PREFILL
        t.join(timeout=30)
        # The slot frees just after the first client has its reply; busy is retryable.
        for _ in range(200):
            with contextlib.suppress(ServerBusyError):
                assert fetch(*srv.address, token=TOKEN) == PREFILL
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server never freed its only slot")


def test_connection_refused_is_a_handshake_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(HandshakeError, match="could not connect"):
        fetch("127.0.0.1", port, token=TOKEN, timeout=5)


def test_port_in_use_is_a_handshake_error() -> None:
    with MetadataServer(PREFILL, token=TOKEN) as srv:
        with pytest.raises(HandshakeError, match="cannot listen"):
            MetadataServer(PREFILL, *srv.address, token=TOKEN)


def test_close_is_idempotent_and_stops_serving() -> None:
    srv = MetadataServer(PREFILL, token=TOKEN)
    address = srv.address
    srv.close()
    srv.close()
    with pytest.raises(HandshakeError):
        fetch(*address, token=TOKEN, timeout=2)


# --------------------------------------------------------------------------- header fuzzing


@given(st.binary(min_size=0, max_size=2 * HEADER_SIZE), st.integers(0, DEFAULT_MAX_MESSAGE))
def test_decode_header_accepts_or_raises_a_handshake_error(data: bytes, max_message: int) -> None:
    try:
        msg_type, length = decode_header(data, max_message)
    except HandshakeError:
        return
    assert encode_header(msg_type, length) == data  # only a canonical header is accepted
    fixed = {1: 33, 2: 96, 4: 32, 6: 1025, 7: 64, 8: 0}  # HELLO, CHALLENGE, FETCH, ERROR, AUTH, READY
    assert length <= fixed.get(msg_type, max_message + 32)


@given(st.sampled_from([1, 2, 3, 4, 5, 6, 7]), st.integers(0, 32))
def test_header_round_trip(msg_type: int, length: int) -> None:
    assert decode_header(encode_header(msg_type, length)) == (msg_type, length)


# --------------------------------------------------------------------------- two processes

CHILD = textwrap.dedent(
    """
    import queue, sys
    from kvxfer.sidechannel import MetadataServer

    peers = queue.Queue()
    ours = b"prefill-in-child:" + bytes(range(256)) * 64
    with MetadataServer(ours, token=sys.argv[1], on_peer=peers.put) as srv:
        print(srv.address[1], flush=True)
        print(peers.get(timeout=60).hex(), flush=True)
    """
)


@pytest.mark.multiprocess
def test_two_processes_exchange_metadata() -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "shared-token"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        ch = Channel(child)
        port = int(ch.line(60))
        theirs = exchange("127.0.0.1", port, DECODE, token="shared-token", timeout=30)
        out = ch.line(60)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert theirs == b"prefill-in-child:" + bytes(range(256)) * 64
    assert bytes.fromhex(out.strip()) == DECODE
