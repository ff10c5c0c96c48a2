"""A verified device-path post on CPU: one fused copy and mm8, its digests compared at completion.

:class:`kvxfer.testing.fake_cuda.FakeCuda` runs the fused kernel as the tensor-core kernel's
CPU model (kvxfer/cuda/mm8_model.py) over the bytes it moves. The expected digests are
kvxfer.integrity's numpy mm8 of the source rows; moved bytes are checked against numpy
indexing, untouched ones against the sentinel.
"""

from __future__ import annotations

import numpy as np
import pytest

from common import SENTINEL, assert_rows_moved, pattern_rows
from kvxfer import Allocation, DescriptorList, MemoryKind, Op
from kvxfer.cuda import CUDA_IPC, DevicePath
from kvxfer.deadlines import Deadline
from kvxfer.errors import IntegrityError
from kvxfer.integrity.digests import _mm8_rows
from kvxfer.testing.fake_cuda import FakeCuda

ROWS, ROW = 6, 1040  # one full 1024-byte chunk and a ragged one per row


class Side:
    def __init__(self, cap: FakeCuda, seed: int | None) -> None:
        self.mem = pattern_rows(ROWS, ROW, seed)
        self.path = DevicePath(capability=cap)
        self.path.register([Allocation(self.mem.ctypes.data, self.mem.nbytes, MemoryKind.VRAM, 0)])

    def rows(self) -> DescriptorList:
        return DescriptorList([[self.mem.ctypes.data + i * ROW, ROW, 0] for i in range(ROWS)], MemoryKind.VRAM)


def _setup(**kw: object) -> tuple[FakeCuda, Side, Side, object, object]:
    cb = FakeCuda(**kw)  # type: ignore[arg-type]
    remote, local = Side(FakeCuda(), seed=11), Side(cb, seed=None)
    assert local.path.add_peer("r", remote.path.blob()).kind == CUDA_IPC
    lp, rp = local.path.prepare(None, local.rows()), local.path.prepare("r", remote.rows())
    assert lp is not None and rp is not None
    return cb, remote, local, lp, rp


LI, RI = np.array([4, 0, 2], np.int64), np.array([1, 5, 3], np.int64)


def test_a_verified_post_launches_the_fused_kernel_and_compares_its_digests() -> None:
    cb, remote, local, lp, rp = _setup()
    expect = _mm8_rows(remote.mem[RI]).view(np.uint64)  # the source's digests, by the numpy definition
    before_l, before_r = local.mem.copy(), remote.mem.copy()
    x = local.path.post(Op.READ, lp, LI, rp, RI, expect=expect)  # type: ignore[arg-type]
    assert x.verified
    assert local.path.wait(x, Deadline.after(30))
    assert cb.calls == ["copy_mm8", "wait", "digests"]  # one fused launch, no second pass, no plain copy
    assert_rows_moved(Op.READ, local.mem, remote.mem, before_l, before_r, LI, RI)


@pytest.mark.parametrize("compare", [True, False])
def test_bytes_that_differ_from_the_sources_digests_fail(compare: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's digests vouch for other bytes than the ones moved (one flipped byte of one
    row): the post fails typed. Control: with the comparison taken out, it passes silently."""
    cb, remote, local, lp, rp = _setup()
    expect = _mm8_rows(remote.mem[RI]).view(np.uint64)
    remote.mem[RI[1], 1030] ^= 1  # past the first chunk: the ragged tail counts too
    if not compare:
        monkeypatch.setattr(DevicePath, "_compare", lambda self, x: None)
    x = local.path.post(Op.READ, lp, LI, rp, RI, expect=expect)  # type: ignore[arg-type]
    if compare:
        with pytest.raises(IntegrityError) as e:
            local.path.wait(x, Deadline.after(30))
        assert e.value.mismatches == 1 and "descriptor 1" in str(e.value)
    else:
        assert local.path.wait(x, Deadline.after(30))
    want = np.full_like(local.mem, SENTINEL)
    want[LI] = remote.mem[RI]  # the bytes did land: a failed verification says nobody vouches for them
    np.testing.assert_array_equal(local.mem, want)


def test_where_the_fused_kernel_cannot_serve_the_post_is_a_plain_copy() -> None:
    cb, remote, local, lp, rp = _setup(unfused=True)
    x = local.path.post(Op.READ, lp, LI, rp, RI, expect=np.zeros(3, np.uint64))  # type: ignore[arg-type]
    assert not x.verified and local.path.poll(x)  # the caller's own check after DONE stays in charge
    assert cb.calls == ["copy", "query"]
