"""The xxh3 row digest: one hash of the row's bytes (cells back to back), whatever the layout.

The reference is computed independently: xxhash over the concatenated logical pages (numpy
indexing over the truth ``X``). Controls show each check can fail: another block, swapped
pages, a changed byte, the version-1 wire form and the per-page fold of the old definition.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import IntegrityError, MetadataError
from kvxfer.integrity import Cells, Digests, compute, local_spans, verify
from kvxfer.integrity.digests import _combine, hash_rows, hash_spans

xxhash = pytest.importorskip("xxhash")

NB, L, PAGE = 12, 3, 1024
BLOCKS = np.array([7, 0, 11, 3])


def _cache(shape: str, X: np.ndarray | None) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """``packed``: every layer's page in one row (64 spare bytes); ``layers``: one array per layer."""
    if shape == "packed":
        st = np.full((NB, L * PAGE + 64), 0xAA, np.uint8)
        if X is not None:
            st[:, :L * PAGE] = X.transpose(1, 0, 2).reshape(NB, L * PAGE)
        return {f"layer.{i}": st[:, i * PAGE:(i + 1) * PAGE] for i in range(L)}, [st]
    sts = [np.full((NB, PAGE), 0xAA, np.uint8) if X is None else X[i].copy() for i in range(L)]
    return {f"layer.{i}": s for i, s in enumerate(sts)}, sts


def _truth() -> np.ndarray:
    return np.random.default_rng(5).integers(0, 256, (L, NB, PAGE), dtype=np.uint8)


def _reference(X: np.ndarray, blocks: np.ndarray) -> list[int]:
    return [xxhash.xxh3_64_intdigest(np.ascontiguousarray(X[:, b]).tobytes()) for b in blocks.tolist()]


@pytest.mark.parametrize("shape", ["packed", "layers"])
def test_row_digest_is_one_xxh3_of_the_row_in_place_or_gathered(shape: str) -> None:
    """Packed rows are hashed in place, per-layer pages gathered: both give xxh3 of the row."""
    X = _truth()
    t, _ = _cache(shape, X)
    spec = kvxfer.spec_from_tensors(t)
    got = compute(spec, BLOCKS, algorithm="xxh3", rows=True)
    assert got.row and got.values[:, 0].tolist() == _reference(X, BLOCKS)
    # Controls: other blocks, and the same pages in another order, give other digests.
    assert got.values[:, 0].tolist() != _reference(X, BLOCKS[::-1])
    assert got.values[:, 0].tolist() != _reference(X[::-1], BLOCKS)
    # Not the old definition (page digests folded), which a version-2 journal holds.
    old = _combine(hash_spans(local_spans(spec, BLOCKS, got.cells), "xxh3"))[:, 0]
    assert not np.array_equal(old, got.values[:, 0])


def test_row_digest_streams_cells_that_are_not_one_run() -> None:
    """Pages of one block in other allocations, and a packed row whose cells are listed out of
    order: streamed, the value is still xxh3 of the cells in the digests' order."""
    X = _truth()
    spec = kvxfer.spec_from_tensors(_cache("packed", X)[0])
    cells = Cells.pages(spec, ["layer.2", "layer.0", "layer.1"])
    got = hash_rows(local_spans(spec, BLOCKS, cells))
    assert got.tolist() == _reference(X[[2, 0, 1]], BLOCKS)
    assert got.tolist() != _reference(X, BLOCKS)  # control: the in-place order is another value


@pytest.mark.parametrize("shape", ["packed", "layers"])
def test_verify_row_digests_catches_one_changed_byte(shape: str) -> None:
    X = _truth()
    src = kvxfer.spec_from_tensors(_cache("packed", X)[0])
    t, arrays = _cache(shape, X)
    dst = kvxfer.spec_from_tensors(t)
    d = compute(src, BLOCKS, algorithm="xxh3", rows=True)
    spans = local_spans(dst, BLOCKS, d.cells)
    verify(d, spans, BLOCKS)  # control: the same bytes pass
    a = arrays[-1]
    a[BLOCKS[2], 700 if shape == "layers" else L * PAGE - 1] ^= 0x10  # one bit of the last page
    with pytest.raises(IntegrityError) as e:
        verify(d, spans, BLOCKS)
    assert e.value.block == BLOCKS[2] and e.value.mismatches == 1


def test_version_1_digests_are_refused_typed_and_xxh3_rows_need_the_bytes() -> None:
    X = _truth()
    spec = kvxfer.spec_from_tensors(_cache("packed", X)[0])
    d = compute(spec, BLOCKS, algorithm="xxh3", rows=True)
    raw = d.encode()
    assert raw[:5] == b"KVXD2" and Digests.decode(raw) == d  # control: the current version decodes
    with pytest.raises(MetadataError, match="version 1"):
        Digests.decode(b"KVXD1" + raw[5:])
    with pytest.raises(IntegrityError, match="rows=True"):
        compute(spec, BLOCKS, algorithm="xxh3").rows()
    m = compute(spec, BLOCKS, algorithm="mm8")
    assert m.rows() == compute(spec, BLOCKS, algorithm="mm8", rows=True)  # mm8 rows still fold cell digests


@pytest.mark.parametrize("shape", ["packed", "layers", "swapped", "strided"])
def test_rows_found_in_place_are_exactly_the_cells_that_run_on(shape: str) -> None:
    """Where every block is laid out alike, ``_in_place`` checks the cells once, not per block:
    its answer and row offsets equal the per-block check over every cell's address (numpy
    here). ``swapped``: the pages of a row out of order (not one run); ``strided``: layer 1
    with a block stride of its own in the same allocation (the per-block path decides)."""
    from kvxfer.integrity.digests import _in_place

    st = np.zeros((NB * 2, L * PAGE + 64), np.uint8)
    if shape == "packed":
        t = {f"layer.{i}": st[:NB, i * PAGE:(i + 1) * PAGE] for i in range(L)}
    elif shape == "swapped":
        t = {f"layer.{i}": st[:NB, (L - 1 - i) * PAGE:(L - i) * PAGE] for i in range(L)}
    elif shape == "strided":
        t = {"layer.0": st[:NB, :PAGE], "layer.1": st[::2, PAGE:2 * PAGE], "layer.2": st[:NB, 2 * PAGE:3 * PAGE]}
    else:
        t = _cache("layers", None)[0]
    spec = kvxfer.spec_from_tensors(t)
    spans = local_spans(spec, BLOCKS, Cells.pages(spec, [f"layer.{i}" for i in range(L)]))
    addr = spans.base[None, :] + BLOCKS[:, None] * spans.stride[None, :]  # [B, C], computed here
    one = len(set(spans.alloc.tolist())) == 1
    runs = one and bool((addr[:, 1:] == addr[:, :-1] + spans.length[None, :-1]).all())
    got = _in_place(spans)
    assert (got is not None) is runs is (shape == "packed")
    if runs:
        base = spans.allocations[int(spans.alloc[0])].address
        assert got[1].tolist() == (addr[:, 0] - base).tolist() and got[2] == L * PAGE
