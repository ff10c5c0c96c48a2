"""Row digests on the device path: the torch ``mm8`` equals the numpy definition, and every
corruption of a VRAM destination is caught (1,000 seeded trials per kind, loopback and NIXL),
while the same damage passes silently without verification (the control).

Needs CUDA (skips otherwise); run on the GPU machine (BENCHMARKS.md, RELIABILITY.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import IntegrityError
from kvxfer._harness import faults

from common import has_nixl

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
xxhash = pytest.importorskip("xxhash")

NB, L, PAGE = 16, 3, 4096
TRIALS = 1000
LB, RB = np.array([9, 2, 14, 5]), np.array([3, 4, 11, 0])


BACKENDS = ["loopback", pytest.param("nixl", marks=pytest.mark.skipif(not has_nixl(), reason="nixl not installed"))]


def _cache(shape: str, X: np.ndarray | None, memory: str = "VRAM") -> tuple[dict[str, Any], Any]:
    dev = "cuda" if memory == "VRAM" else "cpu"
    if shape == "packed":
        st = torch.full((NB, L * PAGE + 1024), 0xAA, dtype=torch.uint8, device=dev)
        if X is not None:
            st[:, :L * PAGE] = torch.from_numpy(X.transpose(1, 0, 2).reshape(NB, L * PAGE).copy()).to(dev)
        views = {f"layer.{i}": st[:, i * PAGE:(i + 1) * PAGE] for i in range(L)}
        return views, lambda: st[:, :L * PAGE].cpu().numpy().reshape(NB, L, PAGE).transpose(1, 0, 2)
    sts = [torch.full((NB, PAGE), 0xAA, dtype=torch.uint8, device=dev) if X is None
           else torch.from_numpy(X[i].copy()).to(dev) for i in range(L)]
    return {f"layer.{i}": s for i, s in enumerate(sts)}, lambda: np.stack([s.cpu().numpy() for s in sts])


def _X(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (L, NB, PAGE), dtype=np.uint8)


def test_torch_mm8_equals_the_numpy_definition() -> None:
    from kvxfer.integrity.digests import _mm8_rows

    X = _X(1)
    ref = np.stack([_mm8_rows(X[:, b]) for b in RB]).view(np.uint64)  # [blocks, layers]
    for shape in ("packed", "layers"):
        t, _ = _cache(shape, X)
        with kvxfer.Agent("a") as a:
            a.register(t)
            d = a.digest(RB)
            assert d.algorithm == "mm8"
            assert np.array_equal(d.values, ref), shape
            contiguous = a.digest(np.arange(NB))  # dense rows are read in place, not gathered
            assert np.array_equal(contiguous.values[RB], ref)
    # xxh3 of VRAM cells (copied to the host) equals xxh3 of the same bytes
    t, _ = _cache("layers", X)
    with kvxfer.Agent("a") as a:
        a.register(t)
        got = a.digest(RB, algorithm="xxh3").values
    assert np.array_equal(got, np.array([[xxhash.xxh3_64_intdigest(X[l, b].tobytes()) for l in range(L)]
                                         for b in RB], np.uint64))


@pytest.mark.parametrize("src_mem,dst_mem", [("DRAM", "VRAM"), ("VRAM", "DRAM")])
def test_cross_kind_transfers_verify(src_mem: str, dst_mem: str) -> None:
    X = _X(2)
    with kvxfer.Agent("p") as p, kvxfer.Agent("d") as d:
        p.register(_cache("packed", X, src_mem)[0])
        t, logical = _cache("layers", None, dst_mem)
        d.register(t)
        d.add_peer(p.metadata())
        d.read("p", LB, RB, expect=p.digest(RB)).wait(30)
        assert (logical()[:, LB] == X[:, RB]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", faults.CORRUPTIONS)
def test_every_vram_corruption_is_caught(backend: str, kind: str) -> None:
    """The damage lands between the transport's completion and DONE, so the backend must carry
    the bytes: the agents' device path is off (it would carry these same-process VRAM pairs past
    the corrupting wrapper; its own check is the next test's)."""
    faults.install()
    c = faults.Corruption(kind, page=PAGE)
    X = _X(7)
    made = []
    try:
        for shape in (("packed", "packed"), ("packed", "layers"), ("layers", "layers")):
            p = kvxfer.Agent("prefill", backend="corrupting", inner=backend, device_copy=False)
            d = kvxfer.Agent("decode", backend="corrupting", inner=backend, corruption=c, device_copy=False)
            p.register(_cache(shape[0], X)[0])
            t, logical = _cache(shape[1], None)
            d.register(t)
            d.add_peer(p.metadata())
            made.append((p, d, t, logical, p.digest(RB)))
        caught = silent = 0
        for trial in range(TRIALS):
            p, d, t, logical, expect = made[trial % len(made)]
            c.seed = trial
            for v in t.values():
                v.fill_(0xAA)
            try:
                d.read("prefill", LB, RB, expect=expect).wait(30)
            except IntegrityError as e:
                caught += e.block in LB.tolist()
            if trial % 10 == 0:  # the control on every tenth seed: the same damage, unverified
                for v in t.values():
                    v.fill_(0xAA)
                d.read("prefill", LB, RB).wait(30)
                silent += not (logical()[:, LB] == X[:, RB]).all()
        assert caught == TRIALS, f"{kind} on {backend}: caught {caught} of {TRIALS}"
        assert silent == TRIALS // 10
    finally:
        for p, d, *_ in made:
            d.close()
            p.close()
        faults.uninstall()


@pytest.mark.parametrize("verified", [True, False])
def test_the_device_paths_fused_check_catches_a_changed_source(verified: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's device path carries these reads; with ``expect`` the core hands it the source's
    mm8 digests and the fused kernel copies and hashes in one pass (no second pass after DONE).
    A source byte changed after it was digested fails the read, typed, naming block and member.
    Control: the same read unverified lands the changed bytes silently."""
    from kvxfer.cuda import SAME_PROCESS
    from kvxfer.integrity import digests

    X = _X(11)
    second: list[int] = []
    real = digests.hash_spans
    monkeypatch.setattr(digests, "hash_spans", lambda spans, algo: (second.append(1), real(spans, algo))[1])
    with kvxfer.Agent("p") as p, kvxfer.Agent("d") as d:
        views, _ = _cache("packed", X)
        p.register(views)
        t, logical = _cache("layers", None)
        d.register(t)
        d.add_peer(p.metadata())
        expect = p.digest(RB)
        second.clear()
        ok = d.read("p", LB, RB, expect=expect)
        ok.wait(30)
        assert ok.stats.path == SAME_PROCESS and not second  # fused: no pass over the destination after DONE
        assert (logical()[:, LB] == X[:, RB]).all()
        views["layer.1"][int(RB[2]), 100] ^= 1  # block 11's layer.1 page, after it was digested
        torch.cuda.synchronize()
        for v in t.values():
            v.fill_(0xAA)
        torch.cuda.synchronize()
        if verified:
            with pytest.raises(IntegrityError) as e:
                d.read("p", LB, RB, expect=expect).wait(30)
            assert (e.value.block, e.value.remote_block, e.value.member) == (int(LB[2]), int(RB[2]), "layer.1")
            assert e.value.mismatches == 1 and not second
        else:
            d.read("p", LB, RB).wait(30)
        want = X.copy()
        want[1, RB[2], 100] ^= 1
        assert (logical()[:, LB] == want[:, RB]).all()  # the bytes landed: verified, nobody vouches for them
