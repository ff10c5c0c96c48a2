"""The agent against hostile metadata and disabled deadlines.

* ``add_peer`` lets out nothing but :class:`KvxferError`, and a failed call leaves nothing
  behind, in the agent or its backend;
* with a token, metadata is signed and checked before anything reaches the backend;
* a valid spec advertising 2^26 blocks costs what the request costs, not gigabytes;
* timeouts are finite and positive, and the deadline covers planning and posting;
* 300 peer restarts leave memory flat.
"""

from __future__ import annotations

import base64
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import GEOM, agent_pair
import kvxfer
from kvxfer.errors import (
    InvalidTimeoutError,
    KvxferError,
    MetadataError,
    OutOfRegistrationError,
    StalePeerError,
    TransferTimeoutError,
)
from kvxfer.metadata import MAGIC, MAX_PEER_MEMBERS, SIGNED_MAGIC
from kvxfer._harness import faults
from kvxfer.testing.buffers import SENTINEL, make_cache

HAS_PROC = Path("/proc/self/status").exists()


def rss_mb() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def doc_of(raw: bytes) -> dict:
    assert raw.startswith(MAGIC)
    return json.loads(raw[len(MAGIC):])


def encode_doc(doc: dict) -> bytes:
    return MAGIC + json.dumps(doc).encode()


# --------------------------------------------------------------------------- only typed errors


def _hostile_variants(raw: bytes) -> dict[str, bytes]:
    doc = doc_of(raw)
    blob = json.loads(base64.b64decode(doc["blob"]))
    out = {}
    for name, bad_blob in {
        "list-token": {**blob, "token": ["a", "b"]},
        "dict-token": {**blob, "token": {"x": 1}},
        "float-identity": {**blob, "identity": 1.5},
        "forged-identity": {**blob, "identity": blob["identity"][:-40] + "00" * 20},
        "nested-blob": "[" * 120 + "]" * 120,
        "non-utf8-blob": b"\xff\xfe\x80",
    }.items():
        data = bad_blob if isinstance(bad_blob, bytes) else (
            bad_blob if isinstance(bad_blob, str) else json.dumps(bad_blob)).encode()
        out[name] = encode_doc({**doc, "blob": base64.b64encode(data).decode()})
    member = doc["spec"]["regions"][0]["layout"]["members"][0]
    for name, value in {"lone-surrogate-member": "\udc80x", "high-surrogate-member": "a\ud800"}.items():
        d = json.loads(json.dumps(doc))
        d["spec"]["regions"][0]["layout"]["members"][0] = {**member, "name": value}
        out[name] = encode_doc(d)
    out["lone-surrogate-name"] = raw.replace(b'"name":"p"', b'"name":"\\udc80"')
    out["non-utf8-json"] = raw[:-2] + b"\xc3\x28}"
    text = json.dumps(doc).replace(json.dumps(doc["spec"]["regions"]), "[" * 3000 + "]" * 3000)
    out["deeply-nested-spec"] = MAGIC + text.encode()
    return out


def test_add_peer_lets_out_only_typed_errors_and_keeps_nothing() -> None:
    with agent_pair(4, seed=1) as (a, b, src, dst):
        for what, bad in _hostile_variants(a.metadata()).items():
            with pytest.raises(MetadataError):
                b.add_peer(bad)
            assert b.peers == {}, what
            assert b.backend._peers == {}, what  # type: ignore[attr-defined]
        b.add_peer(a.metadata())  # the genuine peer is still welcome
        b.read("p", [0, 3], [2, 1]).wait(5)
        np.testing.assert_array_equal(dst.layer_pages()[:, [0, 3]], src.layer_pages()[:, [2, 1]])
        assert (dst.layer_pages()[:, [1, 2]] == SENTINEL).all()


@pytest.mark.parametrize("exc", [RecursionError("deep"), TypeError("unhashable type: 'list'"),
                                 UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
                                 UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed"),
                                 ValueError("x"), OverflowError("y")])
def test_a_backend_failing_half_way_leaves_nothing(faulty: None, exc: BaseException) -> None:
    """add_remote built the peer inside the backend, then raised: the core undoes it."""
    f = faults.Faults(add_remote_raises=exc)
    with kvxfer.Agent("p", backend="faulty") as a, kvxfer.Agent("d", backend="faulty", faults=f) as b:
        a.register(make_cache("packed", num_blocks=4, **GEOM).views)
        b.register(make_cache("packed", num_blocks=4, **GEOM).views)
        with pytest.raises(MetadataError, match=type(exc).__name__) as info:
            b.add_peer(a.metadata())
        assert info.value.__cause__ is exc
        assert b.peers == {} and b.backend.inner._peers == {}  # type: ignore[attr-defined]
        assert f.removed == ["p"]
        f.add_remote_raises = None
        assert b.add_peer(a.metadata()) == "p"


def test_a_failed_restart_leaves_no_half_peer(faulty: None) -> None:
    """A newer generation replaces the old peer; if the backend rejects it, neither remains."""
    f = faults.Faults()
    src = make_cache("packed", num_blocks=4, seed=4, **GEOM)
    dst = make_cache("packed", num_blocks=4, **GEOM)
    with kvxfer.Agent("d", backend="faulty", faults=f) as b:
        b.register(dst.views, replicated=True)
        with kvxfer.Agent("p", backend="faulty") as a:
            a.register(src.views, replicated=True)
            b.add_peer(a.metadata())
            b.read("p", [0], [1]).wait(5)
            old = a.metadata()
            a.deregister()
            a.register(src.views, replicated=True)  # a new generation
            f.add_remote_raises = OSError("transport refused the new address")
            with pytest.raises(MetadataError):
                b.add_peer(a.metadata())
            assert b.peers == {} and b.backend.inner._peers == {}  # type: ignore[attr-defined]
            f.add_remote_raises = None
            b.add_peer(a.metadata())
            with pytest.raises(StalePeerError):
                b.add_peer(old)
            b.read("p", [2], [3]).wait(5)
        np.testing.assert_array_equal(dst.layer_pages()[:, [0, 2]], src.layer_pages()[:, [1, 3]])
        assert (dst.layer_pages()[:, [1, 3]] == SENTINEL).all()


def test_too_many_members_are_refused_before_building_them() -> None:
    with kvxfer.Agent("p") as a:
        a.register(make_cache("packed", num_blocks=2, **GEOM).views)
        doc = doc_of(a.metadata())
    region = doc["spec"]["regions"][0]
    region["layout"]["members"] = [{"name": f"m{i}", "size": 1, "offset": 0, "replicated": True}
                                   for i in range(MAX_PEER_MEMBERS + 1)]
    with pytest.raises(MetadataError, match="members"):
        kvxfer.AgentMetadata.decode(encode_doc(doc))
    with pytest.raises(MetadataError, match="JSON items"):
        kvxfer.AgentMetadata.decode(MAGIC + b"[" + b"0," * 300_000 + b"0]")


# --------------------------------------------------------------------------- signed metadata


def test_signed_metadata_round_trip_and_refusals(faulty: None) -> None:
    f = faults.Faults()
    with kvxfer.Agent("p", backend="faulty", token="s3cret") as a, \
            kvxfer.Agent("d", backend="faulty", token="s3cret", faults=f) as b, \
            kvxfer.Agent("x", backend="faulty", token="other") as c, kvxfer.Agent("y", backend="faulty") as plain:
        for agent in (a, b, c, plain):
            agent.register(make_cache("packed", num_blocks=4, **GEOM).views)
        signed = a.metadata()
        assert signed.startswith(SIGNED_MAGIC)
        with pytest.raises(MetadataError, match="different token"):
            b.add_peer(c.metadata())
        with pytest.raises(MetadataError, match="unsigned"):
            b.add_peer(plain.metadata())
        with pytest.raises(MetadataError, match="has none"):
            plain.add_peer(signed)
        assert f.added == []  # nothing above reached the backend
        assert b.add_peer(signed) == "p" and f.added == ["p"]


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, 1 << 20), byte=st.integers(1, 255), cut=st.booleans())
def test_any_change_to_signed_metadata_stops_before_the_backend(pos: int, byte: int, cut: bool) -> None:
    faults.install()
    try:
        f = faults.Faults()
        with kvxfer.Agent("p", backend="faulty", token="k") as a, \
                kvxfer.Agent("d", backend="faulty", token="k", faults=f) as b:
            raw = bytearray(a.metadata())
            i = pos % len(raw)
            bad = bytes(raw[:i]) if cut else bytes(raw[:i] + bytes([raw[i] ^ byte]) + raw[i + 1:])
            with pytest.raises(MetadataError):
                b.add_peer(bad)
            assert f.added == []
    finally:
        faults.uninstall()


def test_bad_tokens_are_refused() -> None:
    for bad, err in (([1, 2], TypeError), ("", ValueError), ("\udc80", ValueError)):
        with pytest.raises(err):
            kvxfer.Agent("a", token=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- bounded cost


@pytest.mark.skipif(not HAS_PROC, reason="reads VmRSS from /proc")
@pytest.mark.parametrize("coalesce", [None, False], ids=["coalesced", "prepared-lists"])
def test_a_peer_advertising_2_26_blocks_costs_what_the_request_costs(coalesce: bool | None) -> None:
    """One region of 2^26 one-byte blocks (a kilobyte of metadata, real registered memory)."""
    n = 1 << 26
    big = np.zeros(n, dtype=np.uint8)  # untouched pages: not resident
    far = np.array([n - 1, n // 2, 12345, 0, n - 4096], dtype=np.int64)
    big[far] = np.arange(1, 6, dtype=np.uint8)
    ptr = big.ctypes.data
    spec = kvxfer.spec_from_pointers((ptr, n, 0), num_blocks=n, members=[("kv", 1)], replicated=True)
    mine = np.full(64, SENTINEL, dtype=np.uint8)
    local = kvxfer.spec_from_pointers((mine.ctypes.data, 64, 0), num_blocks=64, members=[("kv", 1)],
                                      replicated=True)
    with kvxfer.Agent("p") as a, kvxfer.Agent("d", coalesce=coalesce) as b:
        a.register(spec)
        b.register(local)
        md = a.metadata()
        assert len(md) < 2048
        before = rss_mb()
        b.add_peer(md)
        t = b.read("p", [3, 9, 10, 11, 60], far)
        t.wait(30)
        grown = rss_mb() - before
    assert grown < 64, f"+{grown:.0f} MB for a 5-block read from a 2^26-block peer"
    expect = np.full(64, SENTINEL, dtype=np.uint8)
    expect[[3, 9, 10, 11, 60]] = big[far]
    np.testing.assert_array_equal(mine, expect)


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 50), min_size=1, max_size=6), data=st.data())
def test_take_matches_expanding(counts: list[int], data: st.DataObject) -> None:
    rows = [(1000 * (i + 1) ** 3, 7 + i, i % 2, 16 + i, c) for i, c in enumerate(counts)]
    dl = kvxfer.DescriptorList(np.array(rows, dtype=np.uint64))
    idx = np.array(data.draw(st.lists(st.integers(0, sum(counts) - 1), max_size=40)), dtype=np.int64)
    np.testing.assert_array_equal(dl.take(idx).array, dl.expand().array[idx])
    for bad in ([-1], [sum(counts)]):
        with pytest.raises(OutOfRegistrationError):
            dl.take(np.array(bad))


# --------------------------------------------------------------------------- deadlines


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1, 0, -0.0, True, "30", None, 10 ** 400])
def test_agent_timeouts_must_be_finite_and_positive(bad: object) -> None:
    with pytest.raises(InvalidTimeoutError):
        kvxfer.Agent("a", timeout=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, 0])
def test_wait_refuses_disabled_deadlines_and_stays_usable(faulty_pair, bad: float) -> None:
    a, b, f, src, dst = faulty_pair
    t = b.read("p", [1], [2])
    with pytest.raises(InvalidTimeoutError):
        t.wait(bad)
    assert t.wait(5).status is kvxfer.Status.DONE
    np.testing.assert_array_equal(dst.layer_pages()[:, 1], src.layer_pages()[:, 2])


def test_planning_and_posting_count_against_the_deadline(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    f.post_delay = 0.5  # each post takes longer than the agent's 0.2 s timeout
    with pytest.raises(TransferTimeoutError, match="posting"):
        b.read("p", [0, 1], [2, 3])
    assert len(f.released) == 1  # the post that was made is released again
    assert b._inflight == set()
    assert (dst.layer_pages() == SENTINEL).all()


def test_the_default_deadline_starts_at_the_request(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    t = b.read("p", [0], [0])
    time.sleep(0.3)  # past the agent's 0.2 s timeout before anyone waits
    with pytest.raises(TransferTimeoutError, match="0.2 s"):
        t.wait()
    assert t.status is kvxfer.Status.FAILED


# --------------------------------------------------------------------------- named errors


def test_reading_deregistered_memory_is_out_of_registration() -> None:
    with agent_pair(4, seed=8) as (a, b, src, dst):
        b.add_peer(a.metadata())
        a.deregister()
        with pytest.raises(OutOfRegistrationError):
            b.read("p", [0], [1]).wait(5)
        assert (dst.layer_pages() == SENTINEL).all()


# --------------------------------------------------------------------------- restarts


@pytest.mark.skipif(not HAS_PROC, reason="reads VmRSS from /proc")
def test_300_peer_restarts_leave_memory_flat() -> None:
    """Each restart: a new prefill agent (new generation, new 3 MB cache), add_peer, one read.

    Before the planner's per-pair cache held peer specs weakly, every restart kept the old
    spec (and the lists expanded from it) alive.
    """
    dst = make_cache("layers", num_blocks=2048, num_layers=4, page=256)
    with kvxfer.Agent("d") as b:
        b.register(dst.views, replicated=True)

        def restart(i: int) -> None:
            src = make_cache("packed", num_blocks=2048, num_layers=4, page=256, seed=i)
            with kvxfer.Agent("p") as a:
                a.register(src.views, replicated=True)
                b.add_peer(a.metadata())
                blocks = [(2 * i) % 2048, (2 * i + 1) % 2048]
                b.read("p", blocks, blocks[::-1]).wait(10)
                np.testing.assert_array_equal(dst.layer_pages()[:, blocks], src.layer_pages()[:, blocks[::-1]])

        for i in range(30):  # warm up allocator pools and caches
            restart(i)
        before = rss_mb()
        for i in range(30, 330):
            restart(i)
        grown = rss_mb() - before
    assert grown < 32, f"300 restarts grew the process by {grown:.0f} MB"


def test_only_kvxfer_errors_for_non_bytes() -> None:
    with kvxfer.Agent("a") as a:
        for bad in ("text", None, 5, [1], {"a": 1}):
            with pytest.raises(KvxferError):
                a.add_peer(bad)  # type: ignore[arg-type]
