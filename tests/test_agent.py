"""Agent and Transfer behaviour that no backend should have to implement: deadlines,
cancellation, failure mapping, peer bookkeeping, coalescing by capability."""

from __future__ import annotations


import numpy as np
import pytest

from common import GEOM, agent_pair
import kvxfer
from kvxfer.errors import (
    BackendError,
    MetadataError,
    PeerDisconnectedError,
    SpecError,
    TransferCancelledError,
    TransferTimeoutError,
    UnsupportedError,
)
from kvxfer.testing.buffers import SENTINEL, make_cache


def test_wait_times_out_cancels_and_keeps_raising(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    t = b.read("p", [0, 1], [2, 3])
    with pytest.raises(TransferTimeoutError, match="within 0.05 s"):
        t.wait(0.05)
    assert t.status is kvxfer.Status.FAILED
    assert f.released, "the hung post must be released on timeout"
    with pytest.raises(TransferTimeoutError):
        t.done()
    assert (dst.layer_pages() == SENTINEL).all()


def test_default_timeout_applies(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    with pytest.raises(TransferTimeoutError):
        b.read("p", [0], [0]).wait()  # the agent's timeout=0.2


def test_cancel(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    t = b.read("p", [0], [0])
    t.cancel()
    assert t.status is kvxfer.Status.CANCELLED
    with pytest.raises(TransferCancelledError):
        t.wait(1)


def test_disconnect_during_poll_is_reported(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    f.disconnect_on_poll = 3
    with pytest.raises(PeerDisconnectedError):
        b.read("p", [0], [0]).wait(5)


def test_foreign_exception_becomes_backend_error(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    f.raise_foreign_on_poll = 1
    with pytest.raises(BackendError, match="injected"):
        b.read("p", [0], [0]).wait(5)


def test_failed_post_leaks_nothing(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.fail_post = True
    with pytest.raises(PeerDisconnectedError):
        b.read("p", [0], [0])
    f.fail_post = False
    t = b.read("p", [4], [5]).wait(5)  # the agent still works afterwards
    assert t.status is kvxfer.Status.DONE
    np.testing.assert_array_equal(dst.layer_pages()[:, 4], src.layer_pages()[:, 5])


def test_close_cancels_inflight(faulty_pair) -> None:
    a, b, f, src, dst = faulty_pair
    f.hang_posts = True
    t = b.read("p", [0], [0])
    b.close()
    assert t.status is kvxfer.Status.CANCELLED


def test_max_descriptors_splits_posts_and_notifies_once(faulty: None) -> None:
    """A backend that takes few descriptors per post still gets one notification, after all data."""

    src = make_cache("layers", num_blocks=10, seed=5, **GEOM)
    dst = make_cache("layers", num_blocks=10, **GEOM)
    a = kvxfer.Agent("p", backend="faulty", inner="loopback")
    b = kvxfer.Agent("d", backend="faulty", inner="loopback", coalesce=False)
    from dataclasses import replace

    b.backend.capabilities = replace(b.backend.capabilities, max_descriptors=4)  # type: ignore[misc]
    a.register(src.views, replicated=True)
    b.register(dst.views, replicated=True)
    b.add_peer(a.metadata())
    a.add_peer(b.metadata())
    blocks = [9, 0, 3, 7, 1]
    t = b.read("p", blocks, blocks, notify=b"all")
    assert t.stats.posts == 4  # 5 blocks x 3 layers = 15 descriptors in posts of <= 4
    t.wait(5)
    assert a.notifications() == {"d": [b"all"]}
    np.testing.assert_array_equal(dst.layer_pages()[:, blocks], src.layer_pages()[:, blocks])
    a.close()
    b.close()


def test_coalescing_follows_capabilities() -> None:
    with agent_pair(16, seed=9) as (a, b, src, dst):
        peer = b.add_peer(a.metadata())
        blocks = [2, 3, 4, 5, 9, 10]
        p = b.plan(peer, blocks, blocks)  # loopback: merges_runs=False -> coalesced
        assert p.coalesced and p.descriptors == 2
        t = b.read(peer, blocks, blocks).wait(5)
        assert t.stats.descriptors == 2
        np.testing.assert_array_equal(dst.layer_pages()[:, blocks], src.layer_pages()[:, blocks])
        others = [i for i in range(16) if i not in blocks]
        assert (dst.layer_pages()[:, others] == SENTINEL).all()
    with kvxfer.Agent("p2", coalesce=False) as c:
        c.register(make_cache("packed", num_blocks=16, **GEOM).views, replicated=True)
        with kvxfer.Agent("p3") as d:
            d.register(make_cache("packed", num_blocks=16, **GEOM).views, replicated=True)
            assert c.plan(c.add_peer(d.metadata()), blocks, blocks).descriptors == 6


def test_register_rules() -> None:
    cache = make_cache("packed", num_blocks=4, **GEOM)
    with kvxfer.Agent("x") as a:
        with pytest.raises(SpecError):
            a.register([1, 2, 3])  # type: ignore[arg-type]
        spec = a.register(cache.views)
        with pytest.raises(SpecError, match="already registered"):
            a.register(cache.views)
        a.deregister()
        assert a.register(spec) is spec


def test_add_peer_rules() -> None:
    cache = make_cache("packed", num_blocks=4, **GEOM)
    with kvxfer.Agent("x") as a:
        a.register(cache.views)
        with pytest.raises(MetadataError, match="itself"):
            a.add_peer(a.metadata())
        md = kvxfer.AgentMetadata("y", 5, "nixl", b"", None).encode()
        with pytest.raises(MetadataError, match="backend"):
            a.add_peer(md)
    with pytest.raises(MetadataError):
        kvxfer.Agent("bad name with spaces")


def test_vram_refused_by_dram_only_backend(faulty: None) -> None:
    spec = kvxfer.spec_from_pointers((0x1000, 4096, 0), num_blocks=4, members=[("a", 1024)], kind="VRAM")
    with kvxfer.Agent("x", backend="faulty", inner="loopback") as a:
        a.backend.capabilities = kvxfer.Capabilities()  # type: ignore[misc]  # DRAM only
        with pytest.raises(UnsupportedError, match="VRAM"):
            a.register(spec)


def test_reregistration_is_a_new_generation() -> None:
    """Peers must re-prepare after a worker swaps its memory: the generation says so."""
    old = make_cache("packed", num_blocks=6, seed=1, **GEOM)
    new = make_cache("packed", num_blocks=6, seed=2, **GEOM)
    dst = make_cache("packed", num_blocks=6, **GEOM)
    with kvxfer.Agent("p") as a, kvxfer.Agent("d") as b:
        a.register(old.views, replicated=True)
        b.register(dst.views, replicated=True)
        b.add_peer(a.metadata())
        b.read("p", [0], [1]).wait(5)
        a.deregister()
        a.register(new.views, replicated=True)
        b.add_peer(a.metadata())  # newer generation: replaces the peer and its prepared lists
        b.read("p", [2], [3]).wait(5)
        np.testing.assert_array_equal(dst.layer_pages()[:, 0], old.layer_pages()[:, 1])
        np.testing.assert_array_equal(dst.layer_pages()[:, 2], new.layer_pages()[:, 3])
