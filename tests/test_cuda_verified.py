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


# -- a verified READ through an agent: the core hands the source's digests to the device path ----
BLOCKS, HALF = 8, 1024  # two members ("k", "v") of one 1024-byte chunk each: every cell one mm8 chunk


def _host_mm8(calls: list[int]) -> object:
    """The process's VRAM mm8 digest kernel, on the host (the fake VRAM is host memory): counts
    the cells it hashes, so a test sees whether a second pass over the bytes ran."""
    import ctypes

    def run(addr: np.ndarray, lengths: np.ndarray, devices: list[int]) -> np.ndarray:
        out = np.empty(addr.shape, np.uint64)
        for c in range(addr.shape[1]):
            n = int(lengths[c])
            rows = np.stack([np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(int(a))) for a in addr[:, c]])
            out[:, c] = _mm8_rows(rows).view(np.uint64)
        calls.append(int(addr.size))
        return out
    return run


def _agents(monkeypatch: pytest.MonkeyPatch, cap: FakeCuda) -> tuple[object, object, np.ndarray, np.ndarray,
                                                                        list[int]]:
    import kvxfer
    from kvxfer.cuda import capability
    from kvxfer.integrity import _gpu

    monkeypatch.setitem(capability._cap, "cap", cap)
    hashed: list[int] = []
    monkeypatch.setattr(_gpu, "KERNEL", [_host_mm8(hashed)])
    src, dst = pattern_rows(BLOCKS, 2 * HALF, 13), pattern_rows(BLOCKS, 2 * HALF, None)
    p, d = kvxfer.Agent("p"), kvxfer.Agent("d")
    for a, mem in ((p, src), (d, dst)):
        a.register(kvxfer.spec_from_pointers((mem.ctypes.data, mem.nbytes, 0), num_blocks=BLOCKS,
                                             members=[("k", HALF), ("v", HALF)], kind="VRAM"))
    d.add_peer(p.metadata())
    return p, d, src, dst, hashed


AL, AR = [0, 4, 5], [3, 1, 2]  # blocks 4 and 5 are one run here: the core cuts it into cells


def test_a_verified_agent_read_is_copied_and_checked_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = FakeCuda()
    p, d, src, dst, hashed = _agents(monkeypatch, cap)
    before_d, before_s = dst.copy(), src.copy()
    with p, d:
        expect = p.digest(AR, algorithm="mm8")  # type: ignore[attr-defined]
        assert hashed == [len(AR) * 2]  # the source's own digests: one pass on its side
        cap.calls.clear()
        t = d.read("p", AL, AR, expect=expect)  # type: ignore[attr-defined]
        t.wait(30)
    assert cap.calls == ["copy_mm8", "query", "digests"]  # one fused launch, compared at completion
    assert hashed == [len(AR) * 2]  # and no second pass over the destination after DONE
    assert_rows_moved(Op.READ, dst, src, before_d, before_s, np.array(AL), np.array(AR))


@pytest.mark.parametrize("how", ["fused", "control: no comparison", "unfused: the check after DONE"])
def test_a_corrupted_byte_fails_the_verified_agent_read(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The source's digests vouch for other bytes than those moved (one flipped byte of the
    second cell of the run): the fused post's comparison fails the read, typed. Control: with
    that comparison taken out, the read passes silently (no second pass stands behind it).
    Where the fused kernel cannot serve, the plain copy is checked after DONE and fails too."""
    from kvxfer.errors import IntegrityError

    cap = FakeCuda(unfused=how.startswith("unfused"))
    if how.startswith("control"):
        monkeypatch.setattr(DevicePath, "_compare", lambda self, x: None)
    p, d, src, dst, hashed = _agents(monkeypatch, cap)
    with p, d:
        expect = p.digest(AR, algorithm="mm8")  # type: ignore[attr-defined]
        src[AR[2], HALF + 7] ^= 0x10  # block 5's "v" page changes after it was digested
        t = d.read("p", AL, AR, expect=expect)  # type: ignore[attr-defined]
        if how.startswith("control"):
            t.wait(30)
        else:
            with pytest.raises(IntegrityError) as e:
                t.wait(30)
            assert e.value.mismatches == 1  # named as the check after DONE names it:
            assert (e.value.block, e.value.remote_block, e.value.member) == (5, 2, "v")
            assert "block 5 (source block 2): member 'v'" in str(e.value)
            if how == "fused":
                assert "copy_mm8" in cap.calls and hashed == [6]  # no second pass found it
            else:
                assert "copy_mm8" not in cap.calls and hashed == [6, 6]
    want = np.full_like(dst, SENTINEL)
    want[AL] = src[AR]  # the bytes landed either way: a failed check says nobody vouches for them
    np.testing.assert_array_equal(dst, want)


def test_runs_are_cut_only_into_whole_adjacent_cells() -> None:
    from kvxfer.integrity.fused import Expected

    # cells at 0+16, 16+16, 48+16 (a gap at 32), digests 1, 2, 3
    t = Expected(np.array([16, 0, 48], np.uint64), np.array([16, 16, 16], np.uint64), np.array([2, 1, 3], np.uint64))
    for addr, n in (([8], [8]), ([0], [24]), ([0], [64]), ([0], [40]), ([64], [16])):
        assert t.cut(np.array(addr, np.uint64), np.array(n, np.uint64)) is None, (addr, n)
    assert t.cut(np.array([0, 0], np.uint64), np.array([16, 16], np.uint64)) is None  # one cell twice in a request
    cut = t.cut(np.array([48, 0], np.uint64), np.array([16, 32], np.uint64))
    assert cut is not None
    run, off, ln, dig, cells = cut
    assert run.tolist() == [0, 1, 1] and off.tolist() == [0, 0, 16] and ln.tolist() == [16] * 3
    assert dig.tolist() == [3, 1, 2] and not t.complete()
    t.cover(cells)
    assert t.complete()
    assert t.cut(np.array([0], np.uint64), np.array([16], np.uint64)) is None  # a cell already checked


class _Backend:
    """The agent as post_parts saw it before it posted through the seam: its backend, not its router."""

    def __init__(self, agent: object) -> None:
        self.__dict__["_a"] = agent

    def __getattr__(self, name: str) -> object:
        return getattr(self._a, "backend" if name == "_route" else name)


@pytest.mark.parametrize("seam", [True, False])
def test_a_verified_read_in_parts_goes_through_the_agents_seam(monkeypatch: pytest.MonkeyPatch, seam: bool) -> None:
    """Parts forced on (``PART_BYTES``, and VRAM let into them) and the fused kernel out of the
    way: a verified VRAM READ posted part by part goes through the agent's seam, so the device
    path carries each part and each is checked as it lands. Control: posted to the backend
    itself, the device path is passed by."""
    from kvxfer import _posting
    from kvxfer.cuda import SAME_PROCESS
    from kvxfer.errors import UnsupportedError
    from kvxfer.integrity import fused, overlap

    cap = FakeCuda()
    monkeypatch.setattr(fused.Expected, "of", classmethod(lambda cls, check: None))
    monkeypatch.setattr(overlap, "PART_BYTES", 2 * HALF)  # three blocks of 2 KiB: a part each
    from kvxfer.plugin import copies
    monkeypatch.setattr(copies, "_REPORTERS", set())  # earlier tests' folding backends would skip parts
    monkeypatch.setattr(_posting, "_on_device", lambda check: False)
    if not seam:
        real = _posting.post_parts
        monkeypatch.setattr(_posting, "post_parts", lambda agent, *a: real(_Backend(agent), *a))
    p, d, src, dst, hashed = _agents(monkeypatch, cap)
    before_d, before_s = dst.copy(), src.copy()
    with p, d:
        expect = p.digest(AR, algorithm="mm8")  # type: ignore[attr-defined]
        if not seam:  # the backend is handed the VRAM lists (its own copy is not run: no real GPU here)
            asked: list[int] = []

            def post(self: object, op: Op, local: object, li: np.ndarray, *a: object) -> object:
                asked.append(len(li))
                raise UnsupportedError("the backend was asked to move the VRAM itself")
            monkeypatch.setattr(type(d.backend), "post", post)  # type: ignore[attr-defined]
            with pytest.raises(UnsupportedError):
                d.read("p", AL, AR, expect=expect).wait(30)  # type: ignore[attr-defined]
            assert asked and "copy" not in cap.calls and (dst == SENTINEL).all()
            return
        t = d.read("p", AL, AR, expect=expect)  # type: ignore[attr-defined]
        t.wait(30)
        assert t.stats.path == SAME_PROCESS
    assert cap.calls.count("copy") == 3 and hashed[1:] == [2, 2, 2]  # one post and one check a part
    assert_rows_moved(Op.READ, dst, src, before_d, before_s, np.array(AL), np.array(AR))


@pytest.mark.parametrize("how", ["fixed", "control-parts"])
def test_a_verified_vram_read_is_not_cut_into_parts(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Where the cells lie in VRAM, one kernel hashes the whole request after DONE: parts would
    only add a post, a wait and a launch each (on an H100, 7-9 ms for a READ whose copy takes
    0.7 ms). Control: with VRAM let into parts, the same READ is cut into three."""
    from kvxfer import _posting
    from kvxfer.integrity import fused, overlap
    from kvxfer.plugin import copies

    cap = FakeCuda()
    monkeypatch.setattr(fused.Expected, "of", classmethod(lambda cls, check: None))
    monkeypatch.setattr(overlap, "PART_BYTES", 2 * HALF)
    monkeypatch.setattr(copies, "_REPORTERS", set())
    if how.startswith("control"):
        monkeypatch.setattr(_posting, "_on_device", lambda check: False)
    p, d, src, dst, hashed = _agents(monkeypatch, cap)
    before_d, before_s = dst.copy(), src.copy()
    with p, d:
        expect = p.digest(AR, algorithm="mm8")  # type: ignore[attr-defined]
        d.read("p", AL, AR, expect=expect).wait(30)  # type: ignore[attr-defined]
    if how == "fixed":
        assert cap.calls.count("copy") == 1 and hashed[1:] == [6]  # one post, one check of every cell
    else:
        assert cap.calls.count("copy") == 3 and hashed[1:] == [2, 2, 2]
    assert_rows_moved(Op.READ, dst, src, before_d, before_s, np.array(AL), np.array(AR))
