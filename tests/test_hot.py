"""The hot path (kvxfer._hot): a small request of a shape seen before is posted in a few calls,
moves exactly the bytes the general path would, and still checks every id on every call."""

from __future__ import annotations

import sys
from typing import Any, Iterator

import numpy as np
import pytest

import kvxfer
from kvxfer import _hot
from kvxfer.errors import BlockIdOutOfRangeError, BlockIdTypeError, DuplicateBlockIdError, KvxferError
from kvxfer.testing.buffers import SENTINEL, make_cache

G = dict(num_blocks=16, num_layers=3, page=256)


@pytest.fixture(params=["packed", "layers"])
def pair(request: Any) -> Iterator[tuple[kvxfer.Agent, Any, Any]]:
    src, dst = make_cache(request.param, seed=5, **G), make_cache(request.param, **G)
    with kvxfer.Agent("p", coalesce=False) as a, kvxfer.Agent("d", coalesce=False) as b:
        a.register(src.views)
        b.register(dst.views)
        b.add_peer(a.metadata())
        yield b, src, dst


def _expect(src: Any, moves: dict[int, int]) -> np.ndarray:
    """The destination's layer pages computed independently: sentinel, then each moved row."""
    ref = np.full_like(src.layer_pages(), SENTINEL)
    for d, s in moves.items():
        ref[:, d] = src.layer_pages()[:, s]
    return ref


def test_repeated_small_reads_move_exactly_their_rows(pair: Any) -> None:
    b, src, dst = pair
    moves: dict[int, int] = {}
    requests = [([0], [5]), ([1], [5]), ([2, 3], [9, 4]), ([7], [15]), ([8, 9, 10], [0, 1, 2]), ([15], [3])]
    for i, (local, remote) in enumerate(requests):
        t = b.read("p", local, remote)
        if i:
            assert type(t._plan) is tuple, "a repeated shape takes the hot path (its plan is built on request)"
        t.wait(5)
        moves.update(zip(local, remote))
        assert t.stats.descriptors == len(local) * t.plan.descriptors // len(local)
        assert t.stats.nbytes == t.plan.nbytes
    assert ("p", kvxfer.Op.READ) in b._hot
    np.testing.assert_array_equal(dst.layer_pages(), _expect(src, moves))


def test_hot_path_refuses_what_the_general_path_refuses(pair: Any) -> None:
    b, src, dst = pair
    b.read("p", [0], [1]).wait(5)
    assert b._hot
    for local, remote in (([16], [0]), ([0], [16]), ([-1], [0]), ([0], [-16]), ([1, 2], [3, 99]),
                               ([True], [0]), ([1.0], [0]), ([4, 4], [1, 2])):
        with pytest.raises(KvxferError) as e:
            b.read("p", local, remote).wait(5)
        assert isinstance(e.value, (BlockIdOutOfRangeError, BlockIdTypeError, DuplicateBlockIdError)), e.value
    expect = _expect(src, {0: 1})
    np.testing.assert_array_equal(dst.layer_pages(), expect)  # nothing else landed


def test_control_without_the_bounds_check_an_id_reaches_the_backend(pair: Any, monkeypatch: Any) -> None:
    """Control: the hot path's own check is what stops an id past the peer's blocks here."""
    b, src, dst = pair
    b.read("p", [0], [1]).wait(5)
    shape = b._hot[("p", kvxfer.Op.READ)]
    posted: list[np.ndarray] = []
    real = b.backend.post

    def spy(op: Any, lp: Any, li: np.ndarray, rp: Any, ri: np.ndarray, notify: Any) -> Any:
        posted.append(np.array(ri))
        return real(op, lp, li, rp, ri, notify)

    monkeypatch.setattr(b.backend, "post", spy)
    with pytest.raises(BlockIdOutOfRangeError):
        b.read("p", [2], [G["num_blocks"]])
    assert not posted
    shape.remote_n += 1  # the bypass: the bound one block too far
    shape.legs = [(lp, k, lids, None if rids is None else
                   np.arange(int(rids[0]), int(rids[0]) + shape.remote_n, dtype=rids.dtype), g)
                  for lp, k, lids, rids, g in shape.legs]
    with pytest.raises(Exception):  # loopback indexes its list and fails untyped: the bound was ours
        b.read("p", [2], [G["num_blocks"]]).wait(5)
    assert posted and int(posted[-1].max()) >= G["num_blocks"], "without the check the id reached the backend"


def test_hot_shapes_are_forgotten_with_their_peer_and_registration() -> None:
    src, dst = make_cache("packed", seed=5, **G), make_cache("packed", **G)
    src2 = make_cache("packed", seed=6, **G)
    with kvxfer.Agent("p", coalesce=False) as a, kvxfer.Agent("d", coalesce=False) as b:
        a.register(src.views)
        b.register(dst.views)
        b.add_peer(a.metadata())
        b.read("p", [0], [1]).wait(5)
        assert b._hot
        a.deregister()
        a.register(src2.views)  # new memory, a new generation
        b.add_peer(a.metadata())  # the restart drops the old peer and its shape
        assert not b._hot
        b.read("p", [2], [1]).wait(5)
        np.testing.assert_array_equal(dst.layer_pages()[:, 2], src2.layer_pages()[:, 1])
        np.testing.assert_array_equal(dst.layer_pages()[:, 0], src.layer_pages()[:, 1])
        b.remove_peer("p")
        assert not b._hot
        b.deregister()
        assert not b._hot


def test_hot_read_notifies_once_after_the_data() -> None:
    src, dst = make_cache("layers", seed=5, **G), make_cache("layers", **G)
    with kvxfer.Agent("p", coalesce=False) as a, kvxfer.Agent("d", coalesce=False) as b:
        a.register(src.views)
        b.register(dst.views)
        b.add_peer(a.metadata())
        a.add_peer(b.metadata())
        b.read("p", [0], [1]).wait(5)
        b.read("p", [3], [4], notify=b"req-1").wait(5)
        got = a.notifications()
        assert got == {"d": [b"req-1"]}
        np.testing.assert_array_equal(dst.layer_pages()[:, 3], src.layer_pages()[:, 4])


def _kvxfer_calls(fn: Any) -> int:
    """Python functions of the kvxfer core entered while ``fn`` runs (a count, not a time)."""
    n = [0]
    root = kvxfer.__file__.rsplit("/", 1)[0] + "/"

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            n[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def test_hot_read_enters_few_core_functions(monkeypatch: Any) -> None:
    src, dst = make_cache("packed", seed=5, **G), make_cache("packed", **G)
    with kvxfer.Agent("p", coalesce=False) as a, kvxfer.Agent("d", coalesce=False) as b:
        a.register(src.views)
        b.register(dst.views)
        b.add_peer(a.metadata())
        ts: list[Any] = []
        b.read("p", [0], [1]).wait(5)
        hot = _kvxfer_calls(lambda: ts.append(b.read("p", [2], [3])))
        monkeypatch.setattr(_hot, "learn", lambda *a: None)  # control: the general path every time
        b._hot.clear()
        cold = _kvxfer_calls(lambda: ts.append(b.read("p", [4], [5])))
        for t in ts:
            t.wait(5)
    # read, _transfer, Shape.post, Deadline.within, two dataclasses, Transfer.__init__, the
    # loopback backend's post and data_path (its own calls are not the core's: still counted here).
    assert hot <= 16, hot
    assert cold > 2 * hot, (cold, hot)
    np.testing.assert_array_equal(dst.layer_pages(), _expect(src, {0: 1, 2: 3, 4: 5}))


def _hot_post_via_router(monkeypatch: Any, bypass: bool) -> bool:
    """A repeated READ whose remote list became the device path's (``kvxfer._routed.Listed``):
    whether the agent's router saw the post (the hot path posts to the backend itself only
    where the router would pass the post on untouched). The bytes are checked either way."""
    from kvxfer._routed import Listed

    src, dst = make_cache("packed", seed=5, **G), make_cache("packed", **G)
    with kvxfer.Agent("p", coalesce=False) as a, kvxfer.Agent("d", coalesce=False) as b:
        a.register(src.views)
        b.register(dst.views)
        b.add_peer(a.metadata())
        b.read("p", [0], [1]).wait(5)
        shape = b._hot[("p", kvxfer.Op.READ)]
        assert shape.direct is b.backend, "a plain DRAM pair posts to the backend itself"
        prepared = b._peers["p"].prepared
        key = shape.legs[0][1]
        plain = prepared[key]
        routed: list[Any] = []
        real = b._route.post

        def spy(*args: Any, **kw: Any) -> Any:
            routed.append(args[3])
            return real(*args, **kw)

        monkeypatch.setattr(b._route, "post", spy)
        if bypass:  # the control: the hot path no longer recognises the device path's lists
            monkeypatch.setattr(_hot, "Listed", type("NotListed", (), {}))
        prepared[key] = Listed(plain, None, "p")  # type: ignore[arg-type]
        try:
            try:
                b.read("p", [2], [3]).wait(5)
            except Exception:  # the backend given a list not its own: its failure, whatever it is
                assert bypass, "the router hands the backend its own list"
            else:
                np.testing.assert_array_equal(dst.layer_pages(), _expect(src, {0: 1, 2: 3}))
        finally:
            prepared[key] = plain
        return bool(routed)


def test_hot_read_of_a_device_path_list_goes_through_the_router(monkeypatch: Any) -> None:
    assert _hot_post_via_router(monkeypatch, bypass=False)


def test_control_without_the_list_check_the_router_is_skipped(monkeypatch: Any) -> None:
    assert not _hot_post_via_router(monkeypatch, bypass=True)
