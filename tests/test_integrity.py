"""Row digests catch what layout checks cannot: flipped bits, zeroed pages, swapped and stale blocks.

Each fault kind of :class:`kvxfer._harness.faults.CorruptingBackend` is injected in 1,000
seeded trials per backend, rotating over plan shapes (whole rows, split rows, per-layer
regions); with verification on, every trial must fail with ``IntegrityError``. The control
runs the same seeds with verification off: every transfer then reports DONE with bytes that
differ from the source (checked against numpy indexing), which is what shows the check can fail.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import IntegrityError, MetadataError
from kvxfer.integrity import Cells, Digests
from kvxfer._harness import faults

from common import has_nixl

xxhash = pytest.importorskip("xxhash")

NB, L, PAGE = 16, 3, 1024
TRIALS = 1000
LB, RB = np.array([9, 2, 14, 5]), np.array([3, 4, 11, 0])


BACKENDS = ["loopback", pytest.param("nixl", marks=[pytest.mark.nixl,
                                                    pytest.mark.skipif(not has_nixl(), reason="nixl not installed")])]


def _pages(rng: np.random.Generator) -> np.ndarray:
    """The logical truth ``[layer, block, page bytes]``."""
    return rng.integers(0, 256, (L, NB, PAGE), dtype=np.uint8)


def _cache(shape: str, X: np.ndarray | None) -> tuple[dict[str, np.ndarray], Any]:
    """``packed``: one (block, row) storage with every layer's page inside; ``layers``: one per layer.

    Returns the tensors to register and a function giving the logical ``[L, NB, PAGE]`` view back.
    """
    if shape == "packed":
        st = np.full((NB, L * PAGE + 64), 0xAA, np.uint8)  # 64 spare bytes: rows are not dense
        if X is not None:
            st[:, :L * PAGE] = X.transpose(1, 0, 2).reshape(NB, L * PAGE)
        views = {f"layer.{i}": st[:, i * PAGE:(i + 1) * PAGE] for i in range(L)}
        return views, lambda: st[:, :L * PAGE].reshape(NB, L, PAGE).transpose(1, 0, 2)
    sts = [np.full((NB, PAGE), 0xAA, np.uint8) if X is None else X[i].copy() for i in range(L)]
    return {f"layer.{i}": s for i, s in enumerate(sts)}, lambda: np.stack(sts)


SHAPES = [("packed", "packed"), ("packed", "layers"), ("layers", "layers")]  # whole rows, split, per layer


class Pair:
    """A prefill holding ``X`` and a decode whose backend corrupts, for one plan shape."""

    def __init__(self, backend: str, shape: tuple[str, str], corruption: faults.Corruption, X: np.ndarray):
        self.X = X
        src, _ = _cache(shape[0], X)
        self.dst, self.logical = _cache(shape[1], None)
        self.p = kvxfer.Agent("prefill", backend="corrupting", inner=backend)
        self.d = kvxfer.Agent("decode", backend="corrupting", inner=backend, corruption=corruption)
        self.p.register(src)
        self.d.register(self.dst)
        self.d.add_peer(self.p.metadata())
        self.mode = self.d.plan("prefill", LB, RB).mode

    def reset(self) -> None:
        for v in self.dst.values():
            v[...] = 0xAA

    def delivered(self) -> bool:
        """The destination blocks hold exactly the source's (numpy indexing over ``X``)."""
        return bool((self.logical()[:, LB] == self.X[:, RB]).all())

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture
def pairs(request: Any) -> Iterator[Any]:
    made: list[Pair] = []

    def make(backend: str, corruption: faults.Corruption) -> list[Pair]:
        X = _pages(np.random.default_rng(7))
        out = [Pair(backend, s, corruption, X) for s in SHAPES]
        made.extend(out)
        return out

    faults.install()
    try:
        yield make
    finally:
        for p in made:
            p.close()
        faults.uninstall()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", faults.CORRUPTIONS)
def test_every_corruption_is_caught_and_passes_silently_without_verification(pairs: Any, backend: str,
                                                                            kind: str) -> None:
    c = faults.Corruption(kind, page=PAGE)
    ps = pairs(backend, c)
    assert [p.mode for p in ps] == ["whole-row", "split", "whole-row"]
    caught = silent = 0
    for trial in range(TRIALS):
        p = ps[trial % len(ps)]
        c.seed = trial
        p.reset()
        try:
            p.d.read("prefill", LB, RB, expect=p.p.digest(RB)).wait(30)
        except IntegrityError as e:
            assert e.block in LB.tolist() and e.member in {f"layer.{i}" for i in range(L)}
            caught += 1
        p.reset()
        p.d.read("prefill", LB, RB).wait(30)  # the control: same seed, verification off
        silent += not p.delivered()
    assert c.done == 2 * TRIALS
    assert caught == TRIALS, f"{kind} on {backend}: caught {caught} of {TRIALS}"
    assert silent == TRIALS, f"control: {silent} of {TRIALS} corrupted transfers were wrong and reported DONE"


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_transfers_verify_on_every_shape(pairs: Any, backend: str) -> None:
    for p in pairs(backend, faults.Corruption(None)):
        for rows in (False, True):
            p.reset()
            p.d.read("prefill", LB, RB, expect=p.p.digest(RB, rows=rows)).wait(30)
            assert p.delivered()


def test_digests_do_not_depend_on_layout_and_match_an_independent_hash() -> None:
    X = _pages(np.random.default_rng(1))
    ref = np.array([[xxhash.xxh3_64_intdigest(X[l, b].tobytes()) for l in range(L)] for b in RB], np.uint64)
    got = []
    for shape in ("packed", "layers"):
        t, _ = _cache(shape, X)
        with kvxfer.Agent("a") as a:
            a.register(t)
            d = a.digest(RB)
            assert d.cells.members == tuple(f"layer.{i}" for i in range(L))
            got.append(d)
            m = a.digest(RB, algorithm="mm8")
            got.append(m)
    assert np.array_equal(got[0].values, ref) and np.array_equal(got[2].values, ref)
    assert np.array_equal(got[1].values, got[3].values)  # mm8, packed vs per-layer
    assert not np.array_equal(got[1].values, ref)


def test_mm8_catches_every_single_bit_flip_of_a_page() -> None:
    """mm8 is linear with non-zero weights: every one of a page's 8 x 1024 single-bit flips shows."""
    from kvxfer.integrity.digests import _mm8_rows

    page = np.random.default_rng(5).integers(0, 256, 1024, dtype=np.uint8)
    flips = np.repeat(page[None], 8 * 1024, axis=0)
    i = np.arange(8 * 1024)
    flips[i, i // 8] ^= (1 << (i % 8)).astype(np.uint8)
    base = _mm8_rows(page[None])[0]
    assert (_mm8_rows(flips) != base).all()
    assert _mm8_rows(np.zeros((1, 1024), np.uint8))[0] != base


def test_digests_for_other_blocks_are_refused_before_any_byte_moves(pairs: Any) -> None:
    p = pairs("loopback", faults.Corruption(None))[0]
    wrong = p.p.digest(RB[::-1])
    with pytest.raises(IntegrityError, match="refused before any byte moved"):
        p.d.read("prefill", LB, RB, expect=wrong)
    assert (p.logical()[:, LB] == 0xAA).all()


def test_agent_verify_requires_digests() -> None:
    X = _pages(np.random.default_rng(2))
    with kvxfer.Agent("p") as a, kvxfer.Agent("d", verify=True) as b:
        a.register(_cache("layers", X)[0])
        b.register(_cache("layers", None)[0])
        b.add_peer(a.metadata())
        with pytest.raises(IntegrityError, match="no kvxfer.integrity.Digests"):
            b.read("p", LB, RB)
        b.read("p", LB, RB, expect=a.digest(RB)).wait(10)


def test_wire_form_round_trips_and_hostile_bytes_are_typed() -> None:
    X = _pages(np.random.default_rng(3))
    with kvxfer.Agent("a") as a:
        a.register(_cache("packed", X)[0])
        for rows in (False, True):
            d = a.digest(RB, rows=rows)
            assert Digests.from_text(d.to_text()) == d
        raw = a.digest(RB).encode()
    rng = np.random.default_rng(0)
    for i in range(2000):
        b = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
        cut = bytes(b[: int(rng.integers(len(b) + 1))]) if i % 3 == 0 else bytes(b)
        try:
            Digests.decode(cut)
        except MetadataError:
            pass
    for bad in (b"", b"KVXD1", "x", 12, b"KVXD1\xff\xff\xff\xff{}"):
        with pytest.raises(MetadataError):
            Digests.decode(bad) if not isinstance(bad, str) else Digests.from_text("!!")
    with pytest.raises(IntegrityError):
        Cells.pages(kvxfer.Agent("z").register(_cache("layers", X)[0]), ["nope"])


def test_plan_shapes_are_whole_rows_and_split() -> None:
    faults.install()
    try:
        ps = [Pair("loopback", s, faults.Corruption(None), _pages(np.random.default_rng(1))) for s in SHAPES]
        assert [p.mode for p in ps] == ["whole-row", "split", "whole-row"]  # per-layer rows are whole too
        for p in ps:
            p.close()
    finally:
        faults.uninstall()


@pytest.mark.parametrize("kind", faults.CORRUPTIONS)
def test_heterogeneous_read_many_verifies_the_cells_it_copies(kind: str) -> None:
    """Decode TP=1 gathers heads from two TP=2 prefills: each source digests the ranges this
    destination copies from it (Agent.cells_for); a corrupted gather fails, a clean one passes."""
    from hetero_caches import gqa_rank, logical
    from kvxfer.pairing import heads_of

    faults.install()
    X = logical(2, 8, 4, 4, 8)
    lb, rb = np.array([5, 0, 3]), np.array([2, 7, 4])
    c = faults.Corruption(None, page=64)
    pre = [gqa_rank([0, 1], 8, 4, heads_of(p, 2, 4), 8, "HND", X) for p in range(2)]
    pa = [kvxfer.Agent(f"p{p}", backend="corrupting") for p in range(2)]
    try:
        for p in range(2):
            pa[p].register(pre[p].tensors(), tp_rank=p, tp_size=2, kv_heads=4)
        dec = gqa_rank([0, 1], 8, 4, (0, 4), 8, "HND")
        with kvxfer.Agent("d", backend="corrupting", corruption=c) as da:
            da.register(dec.tensors(), tp_rank=0, tp_size=1, kv_heads=4)
            for p in pa:
                da.add_source(p.metadata())
            cells = da.cells_for("p0", "p1")
            assert set(cells) == {"p0", "p1"}
            expect = {n: pa[int(n[1])].digest(rb, cells=cells[n]) for n in cells}
            da.read_many(lb, {"p0": rb, "p1": rb}, expect=expect).wait(10)
            ok = all((dec.views[(l, kv)][lb] == X[l, kv][rb]).all() for l in range(2) for kv in (0, 1))
            assert ok
            c.kind = kind
            caught = 0
            for trial in range(50):
                c.seed = trial
                for st in dec.storages:
                    st.view(np.uint8)[...] = 0xAA
                try:
                    da.read_many(lb, {"p0": rb, "p1": rb}, expect=expect).wait(10)
                except IntegrityError as e:
                    caught += 1
                    assert e.member is not None and e.block in lb.tolist()
            assert caught == 50
            c.seed = 0  # the control: the same damage without verification lands silently
            for st in dec.storages:
                st.view(np.uint8)[...] = 0xAA
            da.read_many(lb, {"p0": rb, "p1": rb}).wait(10)
            assert not all((dec.views[(l, kv)][lb] == X[l, kv][rb]).all() for l in range(2) for kv in (0, 1))
    finally:
        for p in pa:
            p.close()
        faults.uninstall()


@pytest.mark.parametrize("backend", BACKENDS)
def test_canary_at_connect_refuses_a_path_that_moves_wrong_bytes(backend: str) -> None:
    from kvxfer.integrity import canary

    faults.install()
    try:
        X = _pages(np.random.default_rng(4))
        c = faults.Corruption("flip", page=PAGE)
        with kvxfer.Agent("prefill", backend="corrupting", inner=backend) as p, \
                kvxfer.Agent("decode", backend="corrupting", inner=backend, corruption=c) as d:
            p.register(_cache("packed", X)[0])
            canary.fill(p, 15)
            dst, logical = _cache("layers", None)
            d.register(dst)
            with pytest.raises(IntegrityError, match="canary from 'prefill' arrived wrong"):
                d.add_peer(p.metadata(), canary=(0, 15))
            assert "prefill" not in d.peers
            d.add_peer(p.metadata())  # the control: without the canary the broken path is accepted
            c.kind = None
            d.remove_peer("prefill")
            d.add_peer(p.metadata(), canary=(0, 15))  # a clean path passes
            expect = np.stack([canary.pattern("prefill", f"layer.{i}", PAGE) for i in range(L)])
            assert (logical()[:, 0] == expect).all()
            with pytest.raises(IntegrityError):  # a block that holds no canary fails
                canary.check(d, "prefill", local_block=1, remote_block=14)
    finally:
        faults.uninstall()


def test_a_write_is_verified_by_its_destination_with_the_writers_digests() -> None:
    from kvxfer.integrity import check_received

    faults.install()
    try:
        X = _pages(np.random.default_rng(6))
        with kvxfer.Agent("w") as w, kvxfer.Agent("r") as r:
            w.register(_cache("packed", X)[0])
            dst, logical = _cache("layers", None)
            r.register(dst)
            w.add_peer(r.metadata())
            msg = w.digest(RB).to_text().encode()
            w.write("r", RB, LB, notify=msg).wait(10)
            (got,) = r.notifications()["w"]
            check_received(r, LB, Digests.from_text(got.decode()))
            assert (logical()[:, LB] == X[:, RB]).all()
            dst["layer.2"][LB[1], 100] ^= 4  # the control: a flipped bit after the write is caught
            with pytest.raises(IntegrityError) as e:
                check_received(r, LB, Digests.from_text(got.decode()))
            assert (e.value.block, e.value.member) == (int(LB[1]), "layer.2")
    finally:
        faults.uninstall()


def test_missing_xxhash_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer.errors import MissingDependencyError

    X = _pages(np.random.default_rng(8))
    with kvxfer.Agent("a") as a:
        a.register(_cache("layers", X)[0])
        monkeypatch.setitem(__import__("sys").modules, "xxhash", None)
        with pytest.raises(MissingDependencyError, match=r"pip install xxhash"):
            a.digest(RB)
        assert a.digest(RB, algorithm="mm8").algorithm == "mm8"  # the numpy function needs nothing more
