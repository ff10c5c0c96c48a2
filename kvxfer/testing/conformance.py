"""The conformance suite every backend runs: subclass, set ``backend``, collect with pytest.

::

    from kvxfer.testing import BackendConformance, TwoProcessConformance

    class TestMyBackend(BackendConformance):
        backend = "mybackend"
        options = {}          # passed to Agent(..., **options)
        memory = "DRAM"       # or "VRAM" to run the same tests on CUDA tensors

    class TestMyBackendTwoProcesses(TwoProcessConformance):
        backend = "mybackend"

    class TestMyBackendOwner(BackendConformance):
        backend = "mybackend"
        owned = True          # the same cases, every agent driven through kvxfer.Owner

Every transfer test moves real bytes: sources hold random bytes, destinations the sentinel
0xAA; each test checks the bytes that must have changed against an independent per-layer
reference copy, and every other byte (other blocks, row padding, the source) for change.

The suite reads the backend's :class:`~kvxfer.Capabilities` and skips what the backend does
not claim (WRITE, notifications, VRAM, peers in other processes) instead of failing it.
Rules it checks beyond moving bytes:

* a notification attached to a transfer arrives only after the transfer's bytes are
  visible, and it arrives even if the initiator never polls the transfer;
* ``release()`` (cancel) stops a transfer: after it returns the destination no longer changes;
* the backend honours the index arrays it is given (tests run uncoalesced too, so indices
  are block ids, not ``0..n``);
* a corrupt connection blob is refused with a :class:`~kvxfer.KvxferError`, never a raw
  exception.
* (two processes) a peer killed while a large READ or WRITE is in flight ends the transfer
  with a typed error, or DONE with every byte verified; never DONE with bytes missing.

Every test is bounded (``pytest-timeout``), so a hanging backend fails in minutes, not hours.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import numpy as np
import pytest

from ..deadlines import Deadline
from .. import Agent, AgentMetadata, KVCacheSpec
from ..errors import (
    AgentClosedError,
    BlockCountMismatchError,
    BlockIdOutOfRangeError,
    KvxferError,
    MetadataError,
    StalePeerError,
    UnknownPeerError,
)
from .buffers import Cache, make_cache
from .conformance_base import DST_BLOCKS, GEOM, SRC_BLOCKS, _Base, _Snapshot
from .conformance_processes import TwoProcessConformance, _PeerProcess

# Importable from here as before: the two-process class and its peer moved beside this module.
__all__ = ["BackendConformance", "TwoProcessConformance", "GEOM", "SRC_BLOCKS", "DST_BLOCKS", "_PeerProcess"]


class BackendConformance(_Base):
    """Two agents in one process."""

    @pytest.fixture(params=[None, False], ids=["default", "uncoalesced"])
    def agents(self, request: pytest.FixtureRequest) -> Iterator[tuple[Agent, Agent]]:
        # Uncoalesced plans index the prepared lists by block id: a backend that ignores the
        # index arrays (and copies 0..n) fails there, while coalesced plans use 0..n.
        a = self.make_agent("prefill", coalesce=request.param)
        b = self.make_agent("decode", coalesce=request.param)
        try:
            yield a, b
        finally:
            b.close()
            a.close()

    def _caches(self, src_kind: str, dst_kind: str, replicated: bool = True) -> tuple[Cache, Cache]:
        src = make_cache(src_kind, num_blocks=12, pad=32 if src_kind == "packed" else 0, memory=self.memory,
                         seed=1234, **GEOM)
        dst = make_cache(dst_kind, num_blocks=16, pad=96 if dst_kind == "packed" else 0, memory=self.memory, **GEOM)
        return src, dst

    def _registered(self, a: Agent, b: Agent, src_kind: str = "packed", dst_kind: str = "packed",
                    **options: Any) -> tuple[Cache, Cache]:
        """Caches for ``a`` (patterned source) and ``b`` (sentinel destination), registered."""
        src, dst = self._caches(src_kind, dst_kind)
        opts = {"replicated": True, **options}
        a.register(src.views, **opts)
        b.register(dst.views, **opts)
        return src, dst

    # -- registration and metadata -----------------------------------------------------
    def test_register_metadata_round_trip(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, _ = self._caches("packed", "packed")
        spec = a.register(src.views, replicated=True)
        assert len(spec.allocations) == 1 and len(spec.regions) == 1
        md = a.metadata()
        name = b.add_peer(md)
        assert name == "prefill"
        assert b.peers[name].spec == spec
        assert KVCacheSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
        a.deregister()
        assert a.spec is None
        a.register(src.views, replicated=True)  # registering again after deregister works

    def test_duplicate_add_peer_is_idempotent(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, dst = self._registered(a, b)
        md = a.metadata()
        assert b.add_peer(md) == b.add_peer(md)

    # -- transfers -----------------------------------------------------------------------
    @pytest.mark.parametrize("src_kind,dst_kind", [("packed", "packed"), ("packed", "layers"),
                                                   ("layers", "packed"), ("layers", "layers")])
    @pytest.mark.parametrize("op", ["READ", "WRITE"])
    def test_transfer_moves_exact_bytes(self, agents: tuple[Agent, Agent], src_kind: str, dst_kind: str,
                                        op: str) -> None:
        self.require(op=op)
        a, b = agents
        src, dst = self._registered(a, b, src_kind, dst_kind)
        snap = _Snapshot(src, dst)
        if op == "READ":  # decode pulls from prefill
            peer = b.add_peer(a.metadata())
            t = b.read(peer, DST_BLOCKS, SRC_BLOCKS)
        else:  # prefill pushes into decode
            peer = a.add_peer(b.metadata())
            t = a.write(peer, SRC_BLOCKS, DST_BLOCKS)
        t.wait(self.timeout)
        assert t.status.value == "DONE"
        assert t.stats.nbytes == len(DST_BLOCKS) * GEOM["num_layers"] * GEOM["page"]
        snap.check(DST_BLOCKS, SRC_BLOCKS)

    def test_whole_rows_use_one_descriptor_per_block(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, dst = self._registered(a, b)
        peer = b.add_peer(a.metadata())
        # Block ids chosen so that no two are consecutive on both sides: nothing can merge.
        p = b.plan(peer, DST_BLOCKS, SRC_BLOCKS)
        assert p.mode == "whole-row"
        split = make_cache("layers", num_blocks=16, memory=self.memory, **GEOM)
        c = Agent("decode2", backend=self.backend, timeout=self.timeout, **self.options)
        try:
            c.register(split.views, replicated=True)
            q = c.plan(c.add_peer(a.metadata()), DST_BLOCKS, SRC_BLOCKS)
            assert q.mode == "split"
            assert q.nbytes == p.nbytes
            assert p.descriptors < q.descriptors
        finally:
            c.close()

    def test_head_split_pages_of_another_rank_are_refused(self, agents: tuple[Agent, Agent]) -> None:
        from ..errors import HeadSliceMismatchError

        a, b = agents
        src, dst = self._caches("packed", "packed")
        a.register(src.views, replicated=False, tp_rank=0, tp_size=2)
        b.register(dst.views, replicated=False, tp_rank=1, tp_size=2)
        before = dst.layer_pages()
        with pytest.raises(HeadSliceMismatchError, match="TP rank 1 of 2.*TP rank 0 of 2"):
            b.add_peer(a.metadata())
        assert "prefill" not in b.peers
        np.testing.assert_array_equal(dst.layer_pages(), before)

    def test_head_split_pages_of_the_same_rank_move_whole_rows(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, dst = self._caches("packed", "packed")
        a.register(src.views, replicated=False, tp_rank=1, tp_size=2)
        b.register(dst.views, replicated=False, tp_rank=1, tp_size=2)
        snap = _Snapshot(src, dst)
        peer = b.add_peer(a.metadata())
        assert b.plan(peer, DST_BLOCKS, SRC_BLOCKS).mode == "whole-row"
        b.read(peer, DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
        snap.check(DST_BLOCKS, SRC_BLOCKS)

    def test_duplicate_destination_blocks_are_refused(self, agents: tuple[Agent, Agent]) -> None:
        from ..errors import DuplicateBlockIdError

        a, b = agents
        src, dst = self._registered(a, b)
        before = dst.layer_pages()
        peer = b.add_peer(a.metadata())
        with pytest.raises(DuplicateBlockIdError, match="local block id 0"):
            b.read(peer, [0, 0], [1, 2])
        b.read(peer, [1, 2], [0, 0]).wait(self.timeout)  # one source into two destinations is fine
        np.testing.assert_array_equal(dst.layer_pages()[:, 1], src.layer_pages()[:, 0])
        np.testing.assert_array_equal(dst.layer_pages()[:, 2], src.layer_pages()[:, 0])
        others = np.ones(before.shape[1], dtype=bool)
        others[[1, 2]] = False
        np.testing.assert_array_equal(dst.layer_pages()[:, others], before[:, others])

    def test_empty_request_completes(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, dst = self._registered(a, b)
        before = dst.layer_pages()
        peer = b.add_peer(a.metadata())
        t = b.read(peer, [], []).wait(self.timeout)
        assert t.stats.descriptors == 0
        np.testing.assert_array_equal(dst.layer_pages(), before)

    # -- notifications -------------------------------------------------------------------
    def _drain(self, agent: Agent, count: int = 1, timeout: float | None = None) -> dict[str, list[bytes]]:
        """Collect ``count`` notifications, waiting at most ``notify_timeout`` (or ``timeout``)."""
        import time

        got: dict[str, list[bytes]] = {}
        deadline = Deadline.within(self.notify_timeout if timeout is None else timeout)
        while sum(map(len, got.values())) < count and time.monotonic() < deadline:
            for k, v in agent.notifications().items():
                got.setdefault(k, []).extend(v)
        return got

    def test_notification_arrives_after_data(self, agents: tuple[Agent, Agent]) -> None:
        """The receiver's only signal that bytes are there is the notification, and the
        initiator does not poll: only the receiver drains its notifications."""
        self.require(op="WRITE", notifications=True)
        a, b = agents
        # Large enough (about 24 MiB) that a copy racing its notification is caught.
        big = {"num_layers": 6, "page": 64 << 10}
        blocks = list(range(63, -1, -1))
        src = make_cache("packed", num_blocks=64, pad=32, memory=self.memory, seed=4242, **big)
        dst = make_cache("layers", num_blocks=64, memory=self.memory, **big)
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        snap = _Snapshot(src, dst)
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        t = a.write(peer, blocks, list(range(64)), notify=b"req-42 done")
        got = self._drain_after_data(b, snap, list(range(64)), blocks)
        assert got == {"prefill": [b"req-42 done"]}
        snap.check(list(range(64)), blocks)
        t.wait(self.timeout)

    def _drain_after_data(self, agent: Agent, snap: _Snapshot, dst_blocks: list[int],
                          src_blocks: list[int]) -> dict[str, list[bytes]]:
        """Wait (up to the transfer timeout) for the notification or for all of its data; once
        the data is all there, the notification gets only ``notify_timeout``: fail fast."""
        import time

        got: dict[str, list[bytes]] = {}
        deadline = Deadline.within(self.timeout)
        while not got and time.monotonic() < deadline:
            for k, v in agent.notifications().items():
                got.setdefault(k, []).extend(v)
            if snap.dst.pages_reached() < len(dst_blocks) * snap.dst.num_layers:  # cheap probe first
                time.sleep(0.005)
                continue
            try:
                snap.check(dst_blocks, src_blocks)
                break
            except AssertionError:
                time.sleep(0.005)
        if not got:
            got = self._drain(agent)
        return got

    def test_cancel_stops_the_copy(self, agents: tuple[Agent, Agent]) -> None:
        """After ``cancel()`` returns, the destination no longer changes."""
        import time

        a, b = agents
        big = {"num_layers": 6, "page": 64 << 10}
        src = make_cache("packed", num_blocks=64, pad=32, memory=self.memory, seed=77, **big)
        dst = make_cache("packed", num_blocks=64, pad=32, memory=self.memory, **big)
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        peer = b.add_peer(a.metadata())
        t = b.read(peer, list(range(64)), list(range(63, -1, -1)))
        t.cancel()
        after_cancel = dst.layer_pages()
        for _ in range(20):
            b.progress()
            a.progress()
            time.sleep(0.01)
        np.testing.assert_array_equal(dst.layer_pages(), after_cancel,
                                      err_msg="the destination changed after cancel() returned")

    def test_standalone_notify(self, agents: tuple[Agent, Agent]) -> None:
        self.require(notifications=True)
        a, b = agents
        src, dst = self._registered(a, b)
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        a.notify(peer, b"hello")
        a.notify(peer, b"world")
        assert self._drain(b, 2) == {"prefill": [b"hello", b"world"]}

    # -- errors --------------------------------------------------------------------------
    def test_unknown_peer(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, _ = self._caches("packed", "packed")
        b.register(src.views, replicated=True)
        with pytest.raises(UnknownPeerError):
            b.read("nobody", [0], [0])

    def test_block_id_out_of_range_moves_nothing(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, dst = self._registered(a, b)
        before = dst.layer_pages()
        peer = b.add_peer(a.metadata())
        with pytest.raises(BlockIdOutOfRangeError):
            b.read(peer, [0, 1], [0, src.num_blocks])
        with pytest.raises(BlockIdOutOfRangeError):
            b.read(peer, [0, -1], [0, 1])
        with pytest.raises(BlockCountMismatchError):
            b.read(peer, [0, 1], [0])
        np.testing.assert_array_equal(dst.layer_pages(), before)

    def test_closed_agent(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, dst = self._registered(a, b)
        peer = b.add_peer(a.metadata())
        b.close()
        b.close()  # idempotent
        with pytest.raises(AgentClosedError):
            b.read(peer, [0], [0])
        with pytest.raises(AgentClosedError):
            b.metadata()

    def test_stale_generation_rejected_and_restart_replaces(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, dst = self._registered(a, b)
        old_md = a.metadata()
        b.add_peer(old_md)
        # "prefill" restarts: a new agent of the same name, new memory, newer generation.
        a.close()
        src2 = make_cache("packed", num_blocks=12, pad=32, memory=self.memory, seed=99, **GEOM)
        a2 = self.make_agent("prefill")
        try:
            a2.register(src2.views, replicated=True)
            b.add_peer(a2.metadata())
            with pytest.raises(StalePeerError):
                b.add_peer(old_md)
            snap = _Snapshot(src2, dst)
            b.read("prefill", DST_BLOCKS, SRC_BLOCKS).wait(self.timeout)
            snap.check(DST_BLOCKS, SRC_BLOCKS)
        finally:
            a2.close()

    def test_corrupt_metadata_rejected(self, agents: tuple[Agent, Agent]) -> None:
        a, b = agents
        src, _ = self._caches("packed", "packed")
        a.register(src.views, replicated=True)
        md = a.metadata()
        from ..metadata import PROTOCOL_VERSION

        newer = md.replace(f'"version":{PROTOCOL_VERSION}'.encode(), b'"version":99')
        assert newer != md
        for bad in (b"", b"garbage", md[:-5], newer):
            with pytest.raises(MetadataError):
                b.add_peer(bad)

    def test_corrupt_backend_blob_is_a_typed_error(self, agents: tuple[Agent, Agent]) -> None:
        """A garbage blob must make ``add_remote`` raise a KvxferError, not a raw exception.

        Called on the backend itself: the agent also wraps a raw exception into a
        MetadataError as a last guard, which would hide the backend's own behaviour here.
        """
        a, b = agents
        src, _ = self._caches("packed", "packed")
        a.register(src.views, replicated=True)
        md = AgentMetadata.decode(a.metadata())
        rng = np.random.default_rng(5)
        blob = bytes(md.blob)
        candidates = [b"", b"\x00" * 16, blob[: len(blob) // 2], bytes(rng.integers(0, 256, 64, dtype=np.uint8))]
        for bad in candidates:
            try:
                b.backend.add_remote(md.name, bad)
            except KvxferError:
                continue
            except Exception as exc:  # pragma: no cover - this is the failure being tested
                pytest.fail(f"add_remote raised {type(exc).__name__} for a corrupt blob: {exc}")
            b.backend.remove_remote(md.name)
        b.add_peer(a.metadata())  # the genuine peer can still be added afterwards

    def test_layout_mismatch_is_reported(self, agents: tuple[Agent, Agent]) -> None:
        from ..errors import LayoutMismatchError

        a, b = agents
        src = make_cache("packed", num_blocks=8, num_layers=3, page=384, memory=self.memory, seed=1)
        dst = make_cache("packed", num_blocks=8, num_layers=4, page=384, memory=self.memory)
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        with pytest.raises(LayoutMismatchError, match="layer.3"):
            b.add_peer(a.metadata())  # refused before any connection or transfer
        assert not b.peers
        # A peer added before our cache was registered is checked on demand, and at the
        # first transfer.
        b.deregister()
        peer = b.add_peer(a.metadata())
        b.register(dst.views, replicated=True)
        with pytest.raises(LayoutMismatchError, match="layer.3"):
            b.check(peer)
        with pytest.raises(LayoutMismatchError, match="layer.3"):
            b.read(peer, [0], [0])
