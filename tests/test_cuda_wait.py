"""The device path's completion wait and its fence, on CPU.

Issue 38: the caller waits on the post's own CUDA event (one per post) with the core's
Deadline, instead of polling with naps; a copy that misses the deadline is a typed timeout,
and its gate is closed so nothing it had not begun lands later. Two levels:

* :class:`kvxfer.cuda.DevicePath` over :class:`kvxfer.testing.fake_cuda.FakeCuda`, whose
  ``hold`` keeps a copy's event from completing (a GPU that never gets to it);
* the real :class:`kvxfer.cuda.copy.Copier` over recorded CUDA entry points, whose launches
  are emulated from the very parameter block (gate word included) when the "GPU" runs them.

Every moved byte is checked against numpy indexing, every untouched one against the sentinel.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import pytest

from common import SENTINEL, assert_rows_moved, pattern_rows
from kvxfer import Allocation, DescriptorList, MemoryKind, Op
from kvxfer.cuda import CUDA_IPC, DevicePath
from kvxfer.cuda import completion
from kvxfer.cuda._driver import NOT_READY
from kvxfer.cuda.copy import _FEW_WORDS, FEW, Copier
from kvxfer.deadlines import Deadline
from kvxfer.errors import TransferTimeoutError
from kvxfer.testing.fake_cuda import FakeCuda

ROWS, ROW = 8, 128


class Side:
    def __init__(self, cap: FakeCuda, seed: int | None) -> None:
        self.mem = pattern_rows(ROWS, ROW, seed)
        self.path = DevicePath(capability=cap)
        self.path.register([Allocation(self.mem.ctypes.data, self.mem.nbytes, MemoryKind.VRAM, 0)])

    def rows(self) -> DescriptorList:
        return DescriptorList([[self.mem.ctypes.data + i * ROW, ROW, 0] for i in range(ROWS)], MemoryKind.VRAM)


def _pair(hold: bool = False) -> tuple[FakeCuda, Side, Side, Any, Any]:
    ca, cb = FakeCuda(), FakeCuda(hold=hold)
    remote, local = Side(ca, seed=7), Side(cb, seed=None)
    assert local.path.add_peer("r", remote.path.blob()).kind == CUDA_IPC
    lp, rp = local.path.prepare(None, local.rows()), local.path.prepare("r", remote.rows())
    assert lp is not None and rp is not None
    return cb, remote, local, lp, rp


def test_wait_takes_the_posts_event_and_nothing_else() -> None:
    cb, remote, local, lp, rp = _pair()
    li, ri = np.array([5, 1], np.int64), np.array([2, 6], np.int64)
    before_l, before_r = local.mem.copy(), remote.mem.copy()
    x = local.path.post(Op.READ, lp, li, rp, ri)
    assert local.path.wait(x, Deadline.after(30))
    assert cb.calls == ["copy", "wait"]  # one post, one wait on its event: no polls, no synchronize
    assert_rows_moved(Op.READ, local.mem, remote.mem, before_l, before_r, li, ri)
    local.path.release(x)
    assert cb.calls == ["copy", "wait"]  # a finished post is not waited for again


def _timed_out(monkeypatch: pytest.MonkeyPatch, fence: bool) -> tuple[FakeCuda, Side, Side, np.ndarray, np.ndarray]:
    cb, remote, local, lp, rp = _pair(hold=True)
    monkeypatch.setattr(completion, "_GRACE", 0.01)
    if not fence:
        monkeypatch.setattr(DevicePath, "_fence", lambda self, x: None)
    li, ri = np.array([0, 3, 4], np.int64), np.array([1, 2, 7], np.int64)
    x = local.path.post(Op.READ, lp, li, rp, ri)
    deadline = Deadline.within(0.02)
    with pytest.raises(TransferTimeoutError):
        local.path.wait(x, deadline)
    assert deadline.expired()  # it waited for the deadline, not forever
    local.path.cancel(x)  # the core's expiry: cancel, bounded (a fenced post is not synchronized)
    assert "synchronize" not in cb.calls or not fence
    return cb, remote, local, li, ri


def test_a_copy_that_never_completes_is_a_typed_timeout_and_lands_nothing_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cb, remote, local, li, ri = _timed_out(monkeypatch, fence=True)
    before_l, before_r = local.mem.copy(), remote.mem.copy()
    cb.finish()  # the GPU gets to the copy after the transfer ended
    np.testing.assert_array_equal(local.mem, before_l)
    assert (local.mem == SENTINEL).all()
    np.testing.assert_array_equal(remote.mem, before_r)


def test_control_without_the_fence_the_late_copy_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    cb, remote, local, li, ri = _timed_out(monkeypatch, fence=False)
    cb.finish()
    # without the gate the bytes landed after the timeout (here: inside the unbounded release)
    want = np.full_like(local.mem, SENTINEL)
    want[li] = remote.mem[ri]
    np.testing.assert_array_equal(local.mem, want)


# -- the real copier over recorded CUDA calls --------------------------------------------------
class _Lib:
    """Entry points the copier calls, recorded. Events answer NOT_READY ``pending`` times
    (forever when None); a launch runs, with its gate honoured, when its event completes."""

    def __init__(self, pending: int | None) -> None:
        self.calls: list[str] = []
        self.pending = pending
        self.keep: list[Any] = []
        self.launched: list[np.ndarray] = []

    def cudaEventCreateWithFlags(self, out: Any, flags: int) -> int:
        self.calls.append("cudaEventCreateWithFlags")
        out._obj.value = 0x1000 + len(self.calls)
        return 0

    def cudaHostAlloc(self, out: Any, n: int, flags: int) -> int:
        self.calls.append("cudaHostAlloc")
        buf = ctypes.create_string_buffer(n)
        self.keep.append(buf)
        out._obj.value = ctypes.addressof(buf)
        return 0

    def cudaHostGetDevicePointer(self, out: Any, host: Any, flags: int) -> int:
        self.calls.append("cudaHostGetDevicePointer")
        out._obj.value = host.value  # one address space (UVA), as on every 64-bit CUDA host
        return 0

    def cudaMalloc(self, out: Any, n: int) -> int:
        self.calls.append("cudaMalloc")
        buf = ctypes.create_string_buffer(n)
        self.keep.append(buf)
        out._obj.value = ctypes.addressof(buf)
        return 0

    def cudaMemcpyAsync(self, dst: Any, src: Any, n: int, kind: int, stream: Any) -> int:
        self.calls.append("cudaMemcpyAsync")
        ctypes.memmove(int(getattr(dst, "value", dst) or 0), int(getattr(src, "value", src) or 0), n)
        return 0

    def cuLaunchKernel(self, *args: Any) -> int:
        self.calls.append("cuLaunchKernel")
        params = ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))[0]
        self.launched.append(np.ctypeslib.as_array(ctypes.cast(params, ctypes.POINTER(ctypes.c_uint64)),
                                                   shape=(_FEW_WORDS,)).copy())
        return 0

    def cudaEventQuery(self, ev: int) -> int:
        self.calls.append("cudaEventQuery")
        if self.pending is None or self.pending > 0:
            self.pending = None if self.pending is None else self.pending - 1
            return NOT_READY
        return 0

    def run(self) -> None:
        """The GPU runs the launches: kvxfer_copy_few, piece by piece, after reading its gate."""
        for w in self.launched:
            n, piece = int(w[0]), int(w[1])
            first = w[2:3 + FEW].astype(np.int64)
            dst, src, ln = (w[3 + FEW + k * FEW:3 + FEW + (k + 1) * FEW].astype(np.int64) for k in range(3))
            gate = int(w[_FEW_WORDS - 1])  # the device Gate: [host word's address, state, finished]
            host = ctypes.c_uint64.from_address(gate).value if gate else 0
            for p in range(int(first[n])):
                if host and ctypes.c_uint64.from_address(host).value:
                    break  # the kernel's closed(gate): no piece begins once it is closed
                i = max(k for k in range(n) if int(first[k]) <= p)
                off = (p - int(first[i])) * piece
                ctypes.memmove(int(dst[i]) + off, int(src[i]) + off, min(piece, int(ln[i]) - off))
        self.launched.clear()

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append(name)
            return 0
        return call


class _Cuda:
    def __init__(self, pending: int | None) -> None:
        self.rt = self.drv = _Lib(pending)

    def on(self, device: int) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def check(self, rc: int, what: str) -> None:
        assert rc == 0, what

    check_drv = check

    def enable_peer(self, a: int, b: int) -> None:
        pass


def _copier(pending: int | None) -> tuple[Copier, _Lib, np.ndarray, np.ndarray, np.ndarray]:
    cp = Copier(_Cuda(pending))  # type: ignore[arg-type]
    cp._function = lambda device, name="": 1  # type: ignore[method-assign]
    src = np.random.default_rng(3).integers(0, 256, 3 * 70000, dtype=np.uint8)
    dst = np.full(3 * 70000 + 4096, SENTINEL, np.uint8)
    n = np.array([70000, 5000], np.uint64)
    so, do = np.array([0, 100000], np.uint64), np.array([16, 120000], np.uint64)
    return cp, cp.c.rt, src, dst, np.stack([so + src.ctypes.data, do + dst.ctypes.data, n])


def _want(src: np.ndarray, dst: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's answer: ``dst`` as it is now, with every span of ``t`` copied from ``src``."""
    want = dst.copy()
    so, do = t[0] - np.uint64(src.ctypes.data), t[1] - np.uint64(dst.ctypes.data)
    for s, d, k in zip(so.tolist(), do.tolist(), t[2].tolist()):
        want[d:d + k] = src[s:s + k]
    return want


def test_copier_wait_looks_at_its_event_until_done_without_naps(monkeypatch: pytest.MonkeyPatch) -> None:
    cp, lib, src, dst, t = _copier(pending=3)
    want = _want(src, dst, t)
    monkeypatch.setattr(time, "sleep", lambda s: pytest.fail("the wait napped"))
    h = cp.copy(t[1], t[0], t[2], 0)
    lib.calls.clear()
    assert cp.wait(h, Deadline.after(30))
    lib.run()
    assert lib.calls == ["cudaEventQuery"] * 4  # three NOT_READY, then done; no cudaEventSynchronize
    np.testing.assert_array_equal(dst, want)
    # the event (and its gate) is recycled: the next post creates none
    lib.calls.clear()
    cp.copy(t[1], t[0], t[2], 0)
    assert "cudaEventCreateWithFlags" not in lib.calls and "cudaHostAlloc" not in lib.calls
    assert lib.calls.count("cuLaunchKernel") == 1 and lib.calls.count("cudaEventRecord") == 1


@pytest.mark.parametrize("fence", [True, False])
def test_copier_deadline_and_gate(fence: bool) -> None:
    """A never-ready event: False at the deadline; once fenced, the late kernel writes nothing
    (control: without the fence it writes every span)."""
    cp, lib, src, dst, t = _copier(pending=None)
    before, want = dst.copy(), _want(src, dst, t)
    h = cp.copy(t[1], t[0], t[2], 0)
    deadline = Deadline.within(0.01)
    assert not cp.wait(h, deadline)
    assert deadline.expired() and not h.done
    if fence:
        assert cp.fence(h) and h.fenced
    lib.run()  # the GPU gets to it after the deadline
    if fence:
        np.testing.assert_array_equal(dst, before)
    else:
        np.testing.assert_array_equal(dst, want)


# -- the core's Transfer.wait over an agent's device path ----------------------------------------
BLOCKS = 8


def _agents(monkeypatch: pytest.MonkeyPatch, cap: FakeCuda) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """Two loopback agents of this process, VRAM through the core's device path (same process)."""
    import kvxfer
    from kvxfer.cuda import capability

    monkeypatch.setitem(capability._cap, "cap", cap)
    src, dst = pattern_rows(BLOCKS, ROW, 5), pattern_rows(BLOCKS, ROW, None)
    p, d = kvxfer.Agent("p"), kvxfer.Agent("d")
    for a, mem in ((p, src), (d, dst)):
        a.register(kvxfer.spec_from_pointers((mem.ctypes.data, mem.nbytes, 0), num_blocks=BLOCKS,
                                             members=[("a", ROW)], kind="VRAM"))
    d.add_peer(p.metadata())
    return p, d, src, dst


@pytest.mark.parametrize("hook", [True, False])
def test_transfer_wait_blocks_on_the_device_paths_event(monkeypatch: pytest.MonkeyPatch, hook: bool) -> None:
    """Transfer.wait hands a device-path post still pending at its first poll to the backend's
    wait: one event wait, no more polls. Control: without the hook (the Backend default) the
    core polls the post again and again. The "GPU" runs the copy once the waiter is seen waiting."""
    import threading

    from kvxfer._routed import Routed
    from kvxfer.plugin import Backend

    cap = FakeCuda(hold=True)
    if not hook:
        monkeypatch.setattr(Routed, "wait", Backend.wait)
    p, d, src, dst = _agents(monkeypatch, cap)
    before_d, before_s = dst.copy(), src.copy()
    li, ri = np.array([0, 5, 6], np.int64), np.array([3, 1, 7], np.int64)

    def gpu() -> None:  # no timing: it acts once the caller is waiting (an event wait, or a second poll)
        for _ in range(20000):
            if "wait" in cap.calls or cap.calls.count("query") >= 2:
                break
            time.sleep(0.0005)
        cap.finish()

    with p, d:
        cap.calls.clear()
        t = d.read("p", li.tolist(), ri.tolist())
        g = threading.Thread(target=gpu)
        g.start()
        t.wait(30)
        g.join()
        assert t.stats.path == "same-process"
        if hook:
            assert cap.calls == ["copy", "query", "wait"]
        else:
            assert "wait" not in cap.calls and cap.calls.count("query") >= 2
    assert_rows_moved(Op.READ, dst, src, before_d, before_s, li, ri)


@pytest.mark.parametrize("fence", [True, False])
def test_transfer_wait_past_its_deadline_is_typed_and_nothing_lands_after(monkeypatch: pytest.MonkeyPatch,
                                                                         fence: bool) -> None:
    """A device copy the GPU has not run by the deadline: Transfer.wait raises the core's typed
    timeout, the transfer is FAILED, and when the GPU gets to the copy later it lands nothing.
    Control: with the fence taken out, the late copy lands (inside the release, after the end)."""
    from kvxfer import Status

    cap = FakeCuda(hold=True)
    monkeypatch.setattr(completion, "_GRACE", 0.01)
    if not fence:
        monkeypatch.setattr(DevicePath, "_fence", lambda self, x: None)
    p, d, src, dst = _agents(monkeypatch, cap)
    li, ri = np.array([2, 4], np.int64), np.array([6, 0], np.int64)
    with p, d:
        cap.calls.clear()
        t = d.read("p", li.tolist(), ri.tolist())
        with pytest.raises(TransferTimeoutError, match="did not finish within"):
            t.wait(0.02)
        assert t.status is Status.FAILED
        assert cap.calls[:3] == ["copy", "query", "wait"]  # it blocked on the event, not on naps
        assert ("fence" in cap.calls) is fence
        cap.finish()  # the GPU gets to the copy after the transfer ended
    want = np.full_like(dst, SENTINEL)
    if not fence:
        want[li] = src[ri]
    np.testing.assert_array_equal(dst, want)
    assert (src == pattern_rows(BLOCKS, ROW, 5)).all()
