"""The metadata directory's contract, run on both stores: in-process and a real etcd.

Every transfer moves real bytes between loopback agents: the source holds random bytes, the
destination the 0xAA sentinel, and the result is compared, block by block and including the
blocks that must not change, with a reference built by plain numpy indexing. Waits for
asynchronous events are bounded by generous deadlines; nothing asserts on speed.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from etcd_fixtures import etcd_server, no_thread_left  # noqa: F401  (fixtures)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import Agent
from kvxfer.directory import (Directory, DirectoryError, DirectoryUnavailableError, Event, InProcessDirectory,
                              MemoryStore, NotPublishedError, PeerTracker, entry_key, parse_key)
from kvxfer.directory.codec import decode_value, encode_value
from kvxfer.errors import InvalidTimeoutError, MetadataError, StalePeerError, UnknownPeerError
from kvxfer.testing.buffers import SENTINEL, expected_after, make_cache
from kvxfer.testing.wait import wait_until

TOKEN = b"0123456789abcdef-cluster-token"


class Stores:
    """Makes directories over one shared store, and writes raw bytes as a foreign writer would."""

    def __init__(self, kind: str, url: str | None) -> None:
        self.kind, self.url = kind, url
        self.cluster = f"t-{uuid.uuid4().hex[:10]}"
        self.skew = 0.0  # seconds the in-process store's clock runs ahead of real time
        self.memory = MemoryStore(clock=lambda: time.monotonic() + self.skew) if kind == "memory" else None
        self.made: list[Directory] = []

    def let_time_pass(self, seconds: float) -> None:
        """Leases age by ``seconds``: the in-process store's clock jumps ahead; etcd's needs real time."""
        if self.memory is not None:
            self.skew += seconds
        else:
            time.sleep(seconds)

    def directory(self, **kw: Any) -> Directory:
        kw.setdefault("ttl", 2)
        kw.setdefault("timeout", 5)
        d: Directory
        if self.memory is not None:
            d = InProcessDirectory(self.cluster, store=self.memory, **kw)
        else:
            from kvxfer.directory import EtcdDirectory

            d = EtcdDirectory(self.url or "", self.cluster, **kw)
            # A closing watch waits out its stream's quiet period (2 s by default) on every
            # close; re-opening more often changes no outcome here (test_etcd.py's quiet-period
            # test keeps the re-open itself under test) and saves 1.5 s per watching test.
            d._watcher.idle = 0.5
        self.made.append(d)
        return d

    def write_raw(self, key: str, value: bytes) -> None:
        if self.memory is not None:
            self.memory.write_raw(key, value)
        else:
            from etcd3gw.client import Etcd3Client

            host, port = (self.url or "").split("://")[1].rsplit(":", 1)
            Etcd3Client(host=host, port=int(port), api_path="/v3/", timeout=5).put(key, value)

    def write_leased(self, key: str, value: bytes, ttl: int = 30) -> None:
        """Store any bytes under a live lease of their own: what a writer with store access can do."""
        d = self.directory()
        deadline = time.monotonic() + 10
        d.store.put(key, value, d.store.grant(ttl, deadline), deadline)

    def close(self) -> None:
        for d in self.made:
            d.close()


@pytest.fixture(params=["memory", "etcd"])
def stores(request: pytest.FixtureRequest) -> Iterator[Stores]:
    url = request.getfixturevalue("etcd_server").url if request.param == "etcd" else None
    s = Stores(request.param, url)
    try:
        yield s
    finally:
        s.close()


def loopback_agent(name: str, seed: int | None, blocks: int = 8) -> tuple[Agent, Any]:
    cache = make_cache("packed", num_blocks=blocks, num_layers=2, page=64, seed=seed)
    agent = Agent(name, backend="loopback", timeout=10)
    agent.register(cache.views)
    return agent, cache


def check_read(decode: Agent, dcache: Any, peer: str, pcache: Any, local: list[int], remote: list[int]) -> None:
    """Read ``remote`` blocks of ``peer`` into ``local`` and compare everything with a reference."""
    before, src = dcache.layer_pages(), pcache.layer_pages()
    decode.read(peer, local, remote).wait(10)
    np.testing.assert_array_equal(dcache.layer_pages(), expected_after(before, src, local, remote))


# ---------------------------------------------------------------------------------------------
# Key layout and value format (pure functions)
# ---------------------------------------------------------------------------------------------
def test_key_layout_is_cluster_role_rank_name() -> None:
    k = entry_key("prod", "prefill", 3, 1, "prefill/host-a:7")
    assert k == "kvxfer/v1/prod/prefill/tp3-pp1/prefill/host-a:7"
    p = parse_key(k, "prod")
    assert (p.cluster, p.role, p.tp_rank, p.pp_rank, p.name) == ("prod", "prefill", 3, 1, "prefill/host-a:7")


_names = st.from_regex(r"[A-Za-z0-9_.:@/+-]{1,40}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(role=st.from_regex(r"[a-z][a-z0-9_-]{0,10}", fullmatch=True), tp=st.integers(0, 65535),
       pp=st.integers(0, 65535), name=_names)
def test_key_round_trip(role: str, tp: int, pp: int, name: str) -> None:
    p = parse_key(entry_key("c", role, tp, pp, name), "c")
    assert (p.role, p.tp_rank, p.pp_rank, p.name) == (role, tp, pp, name)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=80), st.binary(max_size=80),
                 st.text(max_size=60).map(lambda s: "kvxfer/v1/c/" + s)))
def test_foreign_keys_raise_metadata_error_only(key: Any) -> None:
    try:
        parse_key(key, "c")
    except MetadataError:
        pass


@pytest.mark.parametrize("bad", ["kvxfer/v1/c/prefill/tp0-pp0", "kvxfer/v1/c/Prefill/tp0-pp0/x",
                                 "kvxfer/v1/c/prefill/tp01-pp0/x", "kvxfer/v1/c/prefill/tp0-pp99999/x",
                                 "kvxfer/v1/other/prefill/tp0-pp0/x", "kvxfer/v1/c/prefill/tp0-pp0/a b"])
def test_malformed_keys_are_rejected(bad: str) -> None:
    with pytest.raises(MetadataError):
        parse_key(bad, "c")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([None, TOKEN]))
def test_random_values_raise_metadata_error_only(value: bytes, token: bytes | None) -> None:
    for v in (value, b"KVXD\x01\x00" + value, b"KVXD\x01\x01" + value):
        try:
            decode_value("kvxfer/v1/c/prefill/tp0-pp0/x", v, token)
        except MetadataError:
            pass


def test_signed_values_bind_the_key_and_the_token() -> None:
    agent, _ = loopback_agent("p0", seed=1)
    try:
        md = agent.metadata()
        key = entry_key("c", "prefill", 0, 0, "p0")
        signed = encode_value(key, md, TOKEN)
        assert decode_value(key, signed, TOKEN)[1] == md
        with pytest.raises(MetadataError, match="wrong signature"):
            decode_value(entry_key("c", "prefill", 1, 0, "p0"), signed, TOKEN)  # moved to another rank
        with pytest.raises(MetadataError, match="wrong signature"):
            decode_value(key, signed, b"another-token-of-16-bytes")
        tampered = bytearray(signed)
        tampered[-2] ^= 1
        with pytest.raises(MetadataError):
            decode_value(key, bytes(tampered), TOKEN)
        with pytest.raises(MetadataError, match="not signed"):
            decode_value(key, encode_value(key, md, None), TOKEN)
        with pytest.raises(MetadataError, match="is signed"):
            decode_value(key, signed, None)
    finally:
        agent.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1, True])
def test_deadlines_must_be_finite_and_positive(bad: Any) -> None:
    """The shared typed check (kvxfer.deadlines), not a plain ValueError of the directory's own."""
    with pytest.raises(InvalidTimeoutError):
        InProcessDirectory("c", store=MemoryStore(), timeout=bad)
    d = InProcessDirectory("c", store=MemoryStore())
    with pytest.raises(InvalidTimeoutError):
        d.entries(timeout=bad)
    d.close()


# ---------------------------------------------------------------------------------------------
# Publish, look up, watch (both stores)
# ---------------------------------------------------------------------------------------------
def test_publish_lookup_find(stores: Stores) -> None:
    agents = [loopback_agent(n, seed=i) for i, n in enumerate(["p0", "p1", "d0"])]
    try:
        d = stores.directory()
        d.publish(agents[0][0], "prefill", tp_rank=0)
        d.publish(agents[1][0], "prefill", tp_rank=1, pp_rank=2)
        d.publish(agents[2][0].metadata(), "decode")
        reader = stores.directory()
        e = reader.lookup("p1")
        assert (e.role, e.tp_rank, e.pp_rank, e.name) == ("prefill", 1, 2, "p1")
        assert e.metadata == agents[1][0].metadata() and e.generation == agents[1][0].generation
        assert e.key == f"kvxfer/v1/{stores.cluster}/prefill/tp1-pp2/p1"
        assert [x.name for x in reader.find("prefill")] == ["p0", "p1"]
        assert [x.name for x in reader.find("prefill", tp_rank=1)] == ["p1"]
        assert [x.name for x in reader.find("prefill", tp_rank=1, pp_rank=2)] == ["p1"]
        assert reader.find("prefill", tp_rank=1, pp_rank=0) == []
        assert [x.name for x in reader.entries()] == ["d0", "p0", "p1"]
        with pytest.raises(NotPublishedError):
            reader.lookup("p9")
        with pytest.raises(NotPublishedError):
            reader.lookup("p0", role="decode")
        with pytest.raises(NotPublishedError):
            reader.wait_for(role="prefill", count=3, timeout=0.5)
        assert [x.name for x in reader.wait_for(role="prefill", count=2, timeout=5)] == ["p0", "p1"]
    finally:
        for a, _ in agents:
            a.close()


def test_entries_carry_kvxfer_metadata_that_moves_bytes(stores: Stores) -> None:
    (p, pc), (dec, dc) = loopback_agent("p0", seed=11), loopback_agent("d0", seed=None)
    try:
        stores.directory().publish(p, "prefill")
        e = stores.directory().lookup("p0")
        assert e.agent_metadata().spec == p.spec and e.backend == "loopback"
        dec.add_peer(e.metadata)
        check_read(dec, dc, "p0", pc, [7, 0, 3], [1, 2, 6])
    finally:
        p.close()
        dec.close()


def test_watch_reports_arrival_restart_and_departure(stores: Stores) -> None:
    (p, _), = [loopback_agent("p0", seed=1)]
    try:
        events: list[Event] = []
        watcher = stores.directory()
        watcher.watch(events.append, role="prefill")
        pub = stores.directory()
        first = pub.publish(p, "prefill")
        wait_until(lambda: [e.kind for e in events] == ["added"], what="added")
        p.deregister()
        p.register(make_cache("packed", num_blocks=8, num_layers=2, page=64, seed=2).views)
        second = pub.publish(p, "prefill")
        assert second.generation > first.generation
        wait_until(lambda: [e.kind for e in events] == ["added", "restarted"], what="restarted")
        assert events[1].entry.generation == second.generation and events[1].previous == events[0].entry
        pub.publish(loopback_agent("d0", seed=None)[0], "decode")  # other role: filtered out
        pub.unpublish("p0")
        wait_until(lambda: [e.kind for e in events] == ["added", "restarted", "removed"], what="removed")
        late: list[Event] = []
        watcher.watch(late.append)
        assert [(e.kind, e.entry.name) for e in late] == [("added", "d0")]
    finally:
        p.close()


def test_expiry_when_the_publisher_stops_renewing(stores: Stores) -> None:
    p, _ = loopback_agent("p0", seed=1)
    try:
        events: list[Event] = []
        watcher = stores.directory()
        watcher.watch(events.append)
        pub = stores.directory(ttl=2)
        pub.publish(p, "prefill")
        wait_until(lambda: events, what="added")
        pub.close(revoke=False)  # as if the process died: nobody renews the lease
        wait_until(lambda: [e.kind for e in events] == ["added", "removed"], what="expiry")
        with pytest.raises(NotPublishedError):
            watcher.lookup("p0")
    finally:
        p.close()


def test_close_revokes_at_once(stores: Stores) -> None:
    p, _ = loopback_agent("p0", seed=1)
    try:
        pub = stores.directory(ttl=60)
        pub.publish(p, "prefill")
        reader = stores.directory()
        assert reader.lookup("p0").name == "p0"
        pub.close()
        with pytest.raises(NotPublishedError):
            reader.lookup("p0")
    finally:
        p.close()


def test_an_old_incarnation_leaving_does_not_remove_the_new_one(stores: Stores) -> None:
    old, _ = loopback_agent("p0", seed=1)
    new, _ = loopback_agent("p0", seed=2)
    try:
        d_old, d_new = stores.directory(ttl=60), stores.directory(ttl=60)
        d_old.publish(old, "prefill")
        d_new.publish(new, "prefill")
        d_old.close()  # revokes the old lease: the record now belongs to the new lease
        assert stores.directory().lookup("p0").generation == new.generation
    finally:
        old.close()
        new.close()


def test_the_old_lease_expiring_does_not_remove_the_new_incarnation(stores: Stores) -> None:
    old, _ = loopback_agent("p0", seed=1)
    new, _ = loopback_agent("p0", seed=2)
    try:
        d_old, d_new = stores.directory(ttl=2), stores.directory(ttl=60)
        d_old.publish(old, "prefill")
        d_new.publish(new, "prefill")
        d_old.close(revoke=False)  # the old process died; its lease runs out in 2 s
        stores.let_time_pass(3.5)
        assert stores.directory().lookup("p0").generation == new.generation
    finally:
        old.close()
        new.close()


def test_moving_to_another_rank_replaces_the_record(stores: Stores) -> None:
    p, _ = loopback_agent("p0", seed=1)
    try:
        d = stores.directory()
        d.publish(p, "prefill", tp_rank=0)
        d.publish(p, "prefill", tp_rank=1)
        assert [(e.tp_rank, e.name) for e in stores.directory().entries()] == [(1, "p0")]
    finally:
        p.close()


def test_invalid_records_are_skipped_and_overwrites_count_as_departure(stores: Stores) -> None:
    (p, _), (q, _) = loopback_agent("p0", seed=1), loopback_agent("p1", seed=2)
    try:
        events: list[Event] = []
        watcher = stores.directory()
        watcher.watch(events.append)
        d = stores.directory()
        d.publish(p, "prefill")
        d.publish(q, "prefill", tp_rank=1)
        wait_until(lambda: len(events) == 2, what="two added")
        c = stores.cluster  # written under live leases: a leaseless record is not even read
        stores.write_leased(f"kvxfer/v1/{c}/prefill/tp0-pp0/ghost", b"not metadata")
        stores.write_leased(f"kvxfer/v1/{c}/prefill/tp0-pp0/ghost2",  # p0's metadata under another name
                         encode_value(f"kvxfer/v1/{c}/prefill/tp0-pp0/ghost2", p.metadata(), None))
        stores.write_leased(f"kvxfer/v1/{c}/prefill/tp0/bad-shape", encode_value("x", p.metadata(), None))
        stores.write_leased(f"kvxfer/v1/{c}/prefill/tp1-pp0/p1", b"\x00" * 64)  # q's record overwritten with junk
        wait_until(lambda: len(events) == 3, what="removed after overwrite")
        assert (events[2].kind, events[2].entry.name) == ("removed", "p1")
        assert [e.name for e in stores.directory().entries()] == ["p0"]
        assert [e.name for e in watcher.snapshot()] == ["p0"]
        assert watcher.rejected >= 4
    finally:
        p.close()
        q.close()


def test_token_keeps_out_unsigned_and_foreign_entries(stores: Stores) -> None:
    (p, _), (q, _) = loopback_agent("p0", seed=1), loopback_agent("p1", seed=2)
    try:
        stores.directory(token=TOKEN).publish(p, "prefill")
        stores.directory().publish(q, "prefill", tp_rank=1)  # no token: unsigned
        assert [e.name for e in stores.directory(token=TOKEN).entries()] == ["p0"]
        assert [e.name for e in stores.directory(token=b"some-other-16-byte-token").entries()] == []
        assert [e.name for e in stores.directory().entries()] == ["p1"]
        with pytest.raises(MetadataError):
            stores.directory(token=b"short")
    finally:
        p.close()
        q.close()


def test_tracker_follows_restart_and_departure_with_real_bytes(stores: Stores) -> None:
    (p, pc), (dec, dc) = loopback_agent("p0", seed=21), loopback_agent("d0", seed=None)
    try:
        pub = stores.directory()
        pub.publish(p, "prefill")
        dd = stores.directory()
        dd.publish(dec, "decode")
        tracker = PeerTracker(dec, dd, role="prefill")
        r = tracker.sync()
        assert r.added == ["p0"] and set(dec.peers) == {"p0"}  # decode itself and other roles are not added
        check_read(dec, dc, "p0", pc, [0, 1], [5, 4])
        # prefill restarts with new memory (new generation): decode must drop the old and add the new
        old_gen = p.generation
        p.deregister()
        pc2 = make_cache("packed", num_blocks=8, num_layers=2, page=64, seed=22)
        p.register(pc2.views)
        pub.publish(p, "prefill")
        wait_until(lambda: tracker.wait_changed(0.05) and dd.snapshot(role="prefill")[0].generation > old_gen,
                   what="restart seen")
        r = tracker.sync()
        assert r.refreshed == ["p0"] and dec.peers["p0"].generation == p.generation
        check_read(dec, dc, "p0", pc2, [2, 3], [4, 5])
        pub.unpublish("p0")
        wait_until(lambda: not dd.snapshot(role="prefill"), what="departure seen")
        assert tracker.sync().removed == ["p0"]
        with pytest.raises(UnknownPeerError):
            dec.read("p0", [0], [0])
        assert (dc.layer_pages()[:, 6:] == SENTINEL).all()
    finally:
        p.close()
        dec.close()


def test_a_forged_generation_does_not_lock_a_worker_out(stores: Stores) -> None:
    """One unauthenticated write with generation 2**63-1 once refused every later genuine
    record as older (``StalePeerError``); the directory's current view now wins."""
    (p, pc), (dec, dc) = loopback_agent("p0", seed=31), loopback_agent("d0", seed=None)
    try:
        pub = stores.directory()
        (entry,) = [pub.publish(p, "prefill")]
        tracker = PeerTracker(dec, stores.directory(), role="prefill")
        assert tracker.sync().added == ["p0"]
        genuine = p.metadata()
        forged = genuine.replace(f'"generation":{p.generation},'.encode(), f'"generation":{2**63 - 1},'.encode())
        assert forged != genuine
        stores.write_leased(entry.key, encode_value(entry.key, forged, None))
        wait_until(lambda: tracker.wait_changed(0.05) and
                   tracker.directory.snapshot(role="prefill")[0].generation == 2**63 - 1, what="forgery seen")
        tracker.sync()
        assert dec.peers["p0"].generation == 2**63 - 1  # unauthenticated: the forgery is believed, for now
        pub.publish(p, "prefill")  # the genuine worker publishes again
        wait_until(lambda: tracker.wait_changed(0.05) and
                   tracker.directory.snapshot(role="prefill")[0].generation == p.generation, what="republish seen")
        r = tracker.sync()
        assert r.refreshed == ["p0"] and not r.failed and dec.peers["p0"].generation == p.generation
        check_read(dec, dc, "p0", pc, [0, 3], [6, 1])
    finally:
        p.close()
        dec.close()


@pytest.mark.parametrize("fixed", [True, False], ids=["refused", "control"])
def test_an_old_signed_record_written_back_is_refused_as_stale(stores: Stores, fixed: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Signed records: after the worker restarted (new generation, new memory), its old
    record put back by a writer of the store is refused as stale, once, and the decode keeps
    the newer peer: real bytes come from the new cache. Control (the tracker's check taken
    out): the old record replaces the newer peer, as it did since the lockout fix."""
    if not fixed:
        monkeypatch.setattr(PeerTracker, "_authentic", lambda self: False)
    (p, pc), (dec, dc) = loopback_agent("p0", seed=51), loopback_agent("d0", seed=None)
    try:
        pub = stores.directory(token=TOKEN)
        entry = pub.publish(p, "prefill")
        old_value, old_gen = encode_value(entry.key, p.metadata(), TOKEN), p.generation
        tracker = PeerTracker(dec, stores.directory(token=TOKEN), role="prefill")
        assert tracker.sync().added == ["p0"]
        p.deregister()
        pc2 = make_cache("packed", num_blocks=8, num_layers=2, page=64, seed=52)
        p.register(pc2.views)
        pub.publish(p, "prefill")
        wait_until(lambda: tracker.wait_changed(0.05) and
                   tracker.directory.snapshot(role="prefill")[0].generation == p.generation, what="restart seen")
        assert tracker.sync().refreshed == ["p0"]
        stores.write_leased(entry.key, old_value)  # the old incarnation's signed record, written back
        wait_until(lambda: tracker.wait_changed(0.05) and
                   tracker.directory.snapshot(role="prefill")[0].generation == old_gen, what="replay seen")
        r = tracker.sync()
        if not fixed:
            assert r.refreshed == ["p0"] and dec.peers["p0"].generation == old_gen
            return
        assert list(r.failed) == ["p0"] and isinstance(r.failed["p0"], StalePeerError) and not r.refreshed
        assert dec.peers["p0"].generation == p.generation
        assert not tracker.sync()  # reported once, not in a loop
        check_read(dec, dc, "p0", pc2, [1, 2], [7, 0])
    finally:
        p.close()
        dec.close()


def test_a_record_without_a_lease_is_never_read(stores: Stores) -> None:
    """A replayed or forged record written without a lease would outlive every worker."""
    (p, _) = loopback_agent("p0", seed=41)
    try:
        pub = stores.directory()
        entry = pub.publish(p, "prefill")
        reader = stores.directory()
        assert [e.name for e in reader.snapshot(role="prefill")] == ["p0"]
        pub.unpublish("p0")
        wait_until(lambda: not reader.snapshot(role="prefill"), what="departure seen")
        stores.write_raw(entry.key, encode_value(entry.key, p.metadata(), None))  # the same bytes, replayed
        other = stores.directory()
        assert other.entries(role="prefill") == []  # a listing leaves it out
        time.sleep(0.5)
        assert reader.snapshot(role="prefill") == []  # and so does the watch
        # Control: the same bytes under a live lease are read, so the refusal is the lease's.
        stores.write_leased(entry.key, encode_value(entry.key, p.metadata(), None))
        assert [e.name for e in stores.directory().entries(role="prefill")] == ["p0"]
    finally:
        p.close()


def test_tracker_isolates_a_peer_that_cannot_be_added(stores: Stores) -> None:
    (p, _), (dec, _) = loopback_agent("p0", seed=1), loopback_agent("d0", seed=None)
    other = Agent("p1", backend="loopback")  # a different spec is fine; a different backend is not
    try:
        d = stores.directory()
        d.publish(p, "prefill")
        bad = bytearray(p.metadata())
        d.publish(bytes(bad).replace(b'"name":"p0"', b'"name":"p1"').replace(b'"backend":"loopback"',
                                                                             b'"backend":"nixlx"'), "prefill",
                  tp_rank=1)
        tracker = PeerTracker(dec, stores.directory(), role="prefill")
        r = tracker.sync()
        assert r.added == ["p0"] and list(r.failed) == ["p1"] and set(dec.peers) == {"p0"}
        assert not tracker.sync()  # the refused generation is not retried in a loop
    finally:
        other.close()
        p.close()
        dec.close()


# ---------------------------------------------------------------------------------------------
# Outages (in-process store; the etcd versions are in test_etcd.py)
# ---------------------------------------------------------------------------------------------
def test_store_outage_gives_typed_errors_and_keeps_the_last_view() -> None:
    store = MemoryStore()
    (p, pc), (dec, dc) = loopback_agent("p0", seed=5), loopback_agent("d0", seed=None)
    with contextlib.ExitStack() as stack:
        stack.callback(p.close)
        stack.callback(dec.close)
        pub = stack.enter_context(InProcessDirectory("c", store=store, ttl=2, timeout=1))
        pub.publish(p, "prefill")
        dd = stack.enter_context(InProcessDirectory("c", store=store, ttl=2, timeout=1))
        tracker = PeerTracker(dec, dd, role="prefill")
        tracker.sync()
        store.down()
        for call in (lambda: dd.lookup("p0"), lambda: dd.entries(), lambda: pub.publish(p, "prefill")):
            with pytest.raises(DirectoryUnavailableError):
                call()
        with pytest.raises(DirectoryUnavailableError):
            dd.wait_for(name="p0", timeout=0.3)
        wait_until(lambda: not dd.watch_connected, what="watch notices")
        assert [e.name for e in dd.snapshot()] == ["p0"]  # last view kept
        assert not tracker.sync()  # nothing dropped during the outage
        check_read(dec, dc, "p0", pc, [1], [2])  # the data path does not need the store
        store.up(wipe=True)  # back, but empty: the publisher must publish again
        wait_until(lambda: pub.publish_error is None and dd.watch_connected, what="recovery")
        assert wait_until(lambda: dd.wait_for(name="p0", timeout=5), what="republished")[0].generation == p.generation
        assert [e.name for e in dd.snapshot()] == ["p0"]


def test_an_unpublish_that_failed_is_retried_once_the_store_is_back() -> None:
    store = MemoryStore()
    p, _ = loopback_agent("p0", seed=1)
    with p, InProcessDirectory("c", store=store, ttl=6, timeout=1) as pub, \
            InProcessDirectory("c", store=store) as reader:  # ttl=6: the lease outlives the outage
        pub.publish(p, "prefill")
        store.down()
        with pytest.raises(DirectoryUnavailableError):
            pub.unpublish("p0")
        store.up()
        wait_until(lambda: reader.entries() == [], timeout=20, what="record removed by the retry")
        assert pub.publish_error is None


def test_errors_are_kvxfer_errors() -> None:
    assert issubclass(DirectoryUnavailableError, DirectoryError)
    from kvxfer.errors import KvxferError

    assert issubclass(DirectoryError, KvxferError) and issubclass(NotPublishedError, KvxferError)
