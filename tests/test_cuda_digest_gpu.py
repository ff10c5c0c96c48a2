"""The device path's kernels on a GPU: the prepared post and the one-pass mm8 digest.

``kvxfer_mm8_tc`` (tensor cores) and ``kvxfer_mm8`` (``__dp4a``) must give exactly
:mod:`kvxfer.integrity`'s ``mm8`` (the numpy definition, on a host copy of the same bytes) for
every cell length, and, when they copy, land exactly the source's bytes and nothing else.
``kvxfer_copy_few`` must move exactly its spans; a post whose gate is closed before it runs
moves nothing (the fence; control: the same post with the gate open moves everything). Every
destination starts as the 0xAA sentinel; references are numpy. Skips without CUDA.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SENTINEL = 0xAA
LENGTHS = [1, 15, 16, 1000, 1024, 1025, 4096, 65536, 70001, 61 * 73728]


def _copier() -> Any:
    from kvxfer.cuda.capability import cuda_capability

    cap = cuda_capability()
    cap.c  # noqa: B018
    return cap._copier


def _layout(lengths: list[int], gap: int = 4096) -> np.ndarray:
    """16-byte aligned starts with gaps between cells (the gaps must keep the sentinel)."""
    return np.concatenate([[0], np.cumsum([-(-n // 16) * 16 + gap for n in lengths])[:-1]]).astype(np.int64)


def _want(host: np.ndarray, starts: np.ndarray, lengths: list[int]) -> np.ndarray:
    from kvxfer.integrity.digests import _mm8_rows

    return np.array([int(_mm8_rows(host[None, s:s + n])[0]) for s, n in zip(starts.tolist(), lengths)]).view(np.uint64)


@pytest.fixture(params=["kvxfer_mm8_tc", "kvxfer_mm8"])
def kernel(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    from kvxfer.cuda import digest

    monkeypatch.setattr(digest, "KERNEL", [request.param])
    return str(request.param)


@pytest.mark.parametrize("copy", [False, True])
def test_mm8_kernel_equals_the_integrity_definition(copy: bool, kernel: str) -> None:
    from kvxfer.cuda.digest import mm8

    starts = _layout(LENGTHS)
    total = int(starts[-1]) + LENGTHS[-1] + 64
    g = torch.Generator(device="cuda").manual_seed(7)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full((total,), SENTINEL, dtype=torch.uint8, device="cuda")
    host = src.cpu().numpy()
    got = mm8(_copier(), src.device.index or 0, starts.astype(np.uint64) + np.uint64(src.data_ptr()),
              np.array(LENGTHS, np.uint64), starts.astype(np.uint64) + np.uint64(dst.data_ptr()) if copy else None)
    assert got is not None
    np.testing.assert_array_equal(got, _want(host, starts, LENGTHS))
    ref = np.full(total, SENTINEL, np.uint8)
    if copy:
        for s, n in zip(starts.tolist(), LENGTHS):
            ref[s:s + n] = host[s:s + n]
    np.testing.assert_array_equal(dst.cpu().numpy(), ref)  # moved bytes, and nothing else


def test_one_changed_byte_changes_its_cell_digest_only(kernel: str) -> None:
    """The control: the comparison above can fail (a flipped byte shows in its cell alone)."""
    from kvxfer.cuda.digest import mm8

    starts = _layout(LENGTHS)
    total = int(starts[-1]) + LENGTHS[-1] + 64
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    args = (starts.astype(np.uint64) + np.uint64(src.data_ptr()), np.array(LENGTHS, np.uint64))
    before = mm8(_copier(), src.device.index or 0, *args)
    at = int(starts[7]) + 5000
    src[at] ^= 1
    after = mm8(_copier(), src.device.index or 0, *args)
    assert before is not None and after is not None
    assert (before != after).tolist() == [i == 7 for i in range(len(LENGTHS))]


def test_unaligned_cells_are_left_to_the_other_path() -> None:
    from kvxfer.cuda.digest import mm8

    src = torch.zeros(8192, dtype=torch.uint8, device="cuda")
    assert mm8(_copier(), src.device.index or 0, np.array([src.data_ptr() + 3], np.uint64),
               np.array([100], np.uint64)) is None


def test_agent_digest_is_the_same_through_the_kernel_and_torch() -> None:
    import kvxfer
    from kvxfer.cuda.capability import mm8_cells  # loading the device path registers the kernel
    from kvxfer.integrity import set_mm8_kernel

    st = torch.randint(0, 256, (8, 3 * 4096), dtype=torch.uint8, device="cuda")
    with kvxfer.Agent("d", backend="loopback") as a:
        a.register({f"layer.{i}": st[:, i * 4096:(i + 1) * 4096] for i in range(3)})
        blocks = np.array([5, 1, 6])
        fast = a.digest(blocks)
        set_mm8_kernel(None)
        try:
            slow = a.digest(blocks)
        finally:
            set_mm8_kernel(mm8_cells)
    assert fast == slow


@pytest.mark.parametrize("sizes", [[4096], [65536], [61 * 73728], [1, 7, 100001, 3, 4096], [33000] * 16, [64] * 17])
def test_prepared_post_moves_exactly_its_spans(sizes: list[int]) -> None:
    cp = _copier()
    n = np.array(sizes, dtype=np.int64)
    so = _layout(sizes, gap=0) + 3  # unaligned on purpose: the kernel's byte and head paths
    do = _layout(sizes, gap=512)
    src = torch.randint(0, 256, (int(so[-1]) + sizes[-1] + 64,), dtype=torch.uint8, device="cuda")
    dst = torch.full((int(do[-1]) + sizes[-1] + 64,), SENTINEL, dtype=torch.uint8, device="cuda")
    dev = src.device.index or 0
    for _ in range(3):  # the shape is prepared once, then reused
        cp.synchronize(cp.copy((do + dst.data_ptr()).astype(np.uint64), (so + src.data_ptr()).astype(np.uint64),
                               n.astype(np.uint64), dev))
    host, ref = src.cpu().numpy(), np.full(dst.shape[0], SENTINEL, np.uint8)
    for a, b, k in zip(do.tolist(), so.tolist(), sizes):
        ref[a:a + k] = host[b:b + k]
    np.testing.assert_array_equal(dst.cpu().numpy(), ref)


@pytest.mark.parametrize("closed", [True, False])
@pytest.mark.parametrize("what", ["few", "table", "mm8"])
def test_a_closed_gate_moves_nothing(what: str, closed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fence on hardware: the kernels read the post's gate (its watcher's mirror) before
    each piece. Closed before the launch, nothing lands; open (the control), every span does.
    Then the same gate, reopened and recycled, serves the next post whole: the watcher put its
    mirror back (a mirror left closed would silently move nothing)."""
    import ctypes

    from kvxfer.cuda import digest

    cp = _copier()
    sizes = {"few": [4096, 70001], "table": [4096] * 20, "mm8": [4096, 70001]}[what]
    n = np.array(sizes, dtype=np.int64)
    so, do = _layout(sizes, gap=0), _layout(sizes, gap=512)
    src = torch.randint(0, 256, (int(so[-1]) + sizes[-1] + 64,), dtype=torch.uint8, device="cuda")
    dst = torch.full((int(do[-1]) + sizes[-1] + 64,), SENTINEL, dtype=torch.uint8, device="cuda")
    dev = src.device.index or 0
    real = cp._event

    def event(d: Any) -> int:
        ev = real(d)
        ctypes.c_uint64.from_address(d.gates[ev][0]).value = int(closed)
        return ev

    monkeypatch.setattr(cp, "_event", event)
    monkeypatch.setattr(digest, "KERNEL", ["kvxfer_mm8_tc"])
    d_addr, s_addr = (do + dst.data_ptr()).astype(np.uint64), (so + src.data_ptr()).astype(np.uint64)
    if what == "mm8":
        h = digest.post(cp, dev, s_addr, n.astype(np.uint64), d_addr)
        assert h is not None
    else:
        h = cp.copy(d_addr, s_addr, n.astype(np.uint64), dev)
    cp.synchronize(h)
    monkeypatch.setattr(cp, "_event", real)
    ctypes.c_uint64.from_address(cp._devices[dev].gates[h.event][0]).value = 0
    host, ref = src.cpu().numpy(), np.full(dst.shape[0], SENTINEL, np.uint8)
    whole = ref.copy()
    for a, b, k in zip(do.tolist(), so.tolist(), sizes):
        whole[a:a + k] = host[b:b + k]
    np.testing.assert_array_equal(dst.cpu().numpy(), ref if closed else whole)
    dst.fill_(SENTINEL)
    h2 = digest.post(cp, dev, s_addr, n.astype(np.uint64), d_addr) if what == "mm8" else \
        cp.copy(d_addr, s_addr, n.astype(np.uint64), dev)
    assert h2 is not None and h2.event == h.event  # the recycled event, with its gate
    cp.synchronize(h2)
    np.testing.assert_array_equal(dst.cpu().numpy(), whole)
