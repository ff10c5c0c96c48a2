"""NIXL backend tests: the shared conformance suite on real NIXL, plus seam-level checks.

Everything skips cleanly when ``nixl`` is not installed (VRAM classes also without CUDA).
Every transfer moves real bytes: sources hold a pattern, destinations the 0xAA sentinel,
and the tests check both the bytes that must change and the ones that must not. No test
asserts on time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np
import pytest

from kvxfer.deadlines import Deadline
from kvxfer import DescriptorList, MemoryKind, Op
from kvxfer.errors import BackendUnavailableError, MetadataError, StalePeerError, UnknownPeerError
from kvxfer.testing.seam import finish, joined
from kvxfer.testing import BackendConformance, TwoProcessConformance

pytestmark = pytest.mark.nixl

SENTINEL = 0xAA


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# --------------------------------------------------------------------------------------------
# Plugin registration: must work (and say how to install) without importing nixl
# --------------------------------------------------------------------------------------------
def test_plugin_module_does_not_import_nixl() -> None:
    code = "import sys, kvxfer_nixl; assert 'nixl' not in sys.modules and 'kvxfer_nixl.backend' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_registration_names_requirement_and_install_command() -> None:
    import kvxfer_nixl

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    kvxfer_nixl.kvxfer_register_backends(lambda *a, **k: calls.append((a, k)))
    (args, kwargs), = calls
    assert args == ("nixl", "kvxfer_nixl.backend:NixlBackend")
    assert kwargs["requires"] == ("nixl",)
    assert kwargs["install"].startswith("pip install 'nixl>=")


def test_missing_nixl_is_reported_with_install_command() -> None:
    import dataclasses

    from kvxfer.plugin.registry import registry

    info = registry()["nixl"]
    missing = dataclasses.replace(info, requires=("nixl_not_installed_here",))
    assert "nixl_not_installed_here" in (missing.unavailable_reason() or "")
    with pytest.raises(BackendUnavailableError, match=r"pip install 'nixl>="):
        missing.load()


# Everything below needs nixl itself; without it these tests skip (the suite classes skip
# themselves through the backend's availability).
try:
    from kvxfer_nixl import backend as nb
except ImportError:  # pragma: no cover - exercised on machines without nixl
    nb = None  # type: ignore[assignment]
needs_nixl = pytest.mark.skipif(nb is None, reason="nixl is not installed: pip install -e '.[nixl]'")


# --------------------------------------------------------------------------------------------
# The conformance suite
# --------------------------------------------------------------------------------------------
class TestNixlConformance(BackendConformance):
    """Two agents in one process, DRAM, default options (no progress thread)."""

    backend = "nixl"
    options: dict[str, Any] = {}


class TestNixlConformanceProgressThread(BackendConformance):
    """The same suite with NIXL's own progress thread."""

    backend = "nixl"
    options: dict[str, Any] = {"progress_thread": True}


class TestNixlTwoProcess(TwoProcessConformance):
    backend = "nixl"
    options: dict[str, Any] = {}


class TestNixlConformanceVRAM(BackendConformance):
    """CUDA tensors, one process: served by the same-process device-copy path."""

    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {}


class TestNixlConformanceVRAMViaUCX(BackendConformance):
    """CUDA tensors, one process, device copies off: every byte goes through NIXL/UCX."""

    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {"device_copy": False}

    @pytest.mark.xfail(reason="NIXL over UCX keeps copying device memory after the request is released "
                              "(seen on 2xH200, also when cancel first waits for the request); the default "
                              "device path stops (see the plugin README)", strict=False)
    def test_cancel_stops_the_copy(self, agents: Any) -> None:
        super().test_cancel_stops_the_copy(agents)


class TestNixlTwoProcessVRAM(TwoProcessConformance):
    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {}


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_same_process_vram_uses_device_copy() -> None:
    import torch

    import kvxfer

    src = torch.randint(0, 256, (8, 1024), dtype=torch.uint8, device="cuda")
    dst = torch.full((8, 1024), SENTINEL, dtype=torch.uint8, device="cuda")
    with kvxfer.Agent("p", backend="nixl") as a, kvxfer.Agent("d", backend="nixl") as b:
        a.register({"layer.0": src[:, :512], "layer.1": src[:, 512:]}, replicated=True)
        b.register({"layer.0": dst[:, :512], "layer.1": dst[:, 512:]}, replicated=True)
        peer = b.add_peer(a.metadata())
        t = b.read(peer, [1, 5], [6, 0]).wait(20)
        assert t.stats.path == "same-process", b.device_path.route(peer)
        torch.cuda.synchronize()
        assert torch.equal(dst[1], src[6]) and torch.equal(dst[5], src[0])
        keep = [i for i in range(8) if i not in (1, 5)]
        assert bool((dst[keep] == SENTINEL).all())


# --------------------------------------------------------------------------------------------
# Seam-level tests: NixlBackend driven directly with hand-made descriptor lists
# --------------------------------------------------------------------------------------------
ROWS, ROW = 16, 4096


@pytest.fixture
def pair() -> Iterator[tuple[nb.NixlBackend, nb.NixlBackend, np.ndarray, np.ndarray]]:
    """Backend ``a`` owns the patterned source, ``b`` the sentinel destination; b knows a."""
    src = (np.arange(ROWS * ROW, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8).reshape(ROWS, ROW)
    dst = np.full((ROWS, ROW), SENTINEL, dtype=np.uint8)
    with joined(nb.NixlBackend("seam-a"), nb.NixlBackend("seam-b"), src, dst) as (a, b):
        yield a, b, src, dst


def _rows(arr: np.ndarray, strided: bool) -> DescriptorList:
    if strided:
        return DescriptorList(np.array([[arr.ctypes.data, ROW, 0, ROW, ROWS]], dtype=np.uint64), MemoryKind.DRAM)
    base = arr.ctypes.data + np.arange(ROWS, dtype=np.uint64) * ROW
    return DescriptorList(np.stack([base, np.full(ROWS, ROW, np.uint64), np.zeros(ROWS, np.uint64)], axis=1))


def _wait(b: nb.NixlBackend, x: Any, timeout: float = 20.0) -> None:
    finish(b, x, timeout)


def _check(src: np.ndarray, dst: np.ndarray, dst_rows: list[int], src_rows: list[int]) -> None:
    np.testing.assert_array_equal(dst[dst_rows], src[src_rows])
    rest = [i for i in range(ROWS) if i not in dst_rows]
    assert (dst[rest] == SENTINEL).all(), "rows outside the request changed"


@needs_nixl
@pytest.mark.parametrize("strided", [True, False], ids=["strided", "plain"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_read_moves_exact_rows(pair: Any, strided: bool, dtype: Any) -> None:
    _, b, src, dst = pair
    lp, rp = b.prepare(None, _rows(dst, strided)), b.prepare("seam-a", _rows(src, strided))
    d, s = [0, 3, 4, 5, 9], [15, 2, 3, 4, 0]  # 3,4,5 <- 2,3,4 is a run NIXL may merge
    _wait(b, b.post(Op.READ, lp, np.array(d, dtype), rp, np.array(s, dtype), None))
    _check(src, dst, d, s)


@needs_nixl
def test_write_notification_is_sent_without_the_initiator_polling(pair: Any) -> None:
    a, b, src, dst = pair
    lp, rp = a.prepare(None, _rows(src, True)), a.prepare("seam-b", _rows(dst, True))
    x = a.post(Op.WRITE, lp, np.array([1, 2], np.int32), rp, np.array([7, 8], np.int32), b"req-1")
    got: dict[str, list[bytes]] = {}
    deadline = Deadline.within(20)
    while not got and time.monotonic() < deadline:  # only the *target* is driven here
        got = b.drain_notifications()
        time.sleep(0.001)
    assert got == {"seam-a": [b"req-1"]}
    _check(src, dst, [7, 8], [1, 2])
    _wait(a, x)


@needs_nixl
def test_lists_prepared_before_a_restart_are_stale(pair: Any) -> None:
    a, b, src, dst = pair
    lp, rp = b.prepare(None, _rows(dst, True)), b.prepare("seam-a", _rows(src, True))
    b.add_remote("seam-a", a.local_metadata())  # known name: removed, then added again
    with pytest.raises(StalePeerError):
        b.post(Op.READ, lp, np.array([0], np.int32), rp, np.array([0], np.int32), None)
    rp2 = b.prepare("seam-a", _rows(src, True))
    _wait(b, b.post(Op.READ, lp, np.array([0], np.int32), rp2, np.array([4], np.int32), None))
    _check(src, dst, [0], [4])
    b.remove_remote("seam-a")
    with pytest.raises(UnknownPeerError):
        b.prepare("seam-a", _rows(src, True))


@needs_nixl
@pytest.mark.parametrize("blob", [b"", b"short", b"NOTKVXFR" + bytes(44) + b"md", b"KVXNIXL2" + bytes(36) + b"junk",
                                  b"KVXNIXL4" + bytes(88) + b"junk", b"KVXNIXL4" + bytes(88) + b"nixlSerDes|"])
def test_bad_connection_blob_is_metadata_error(pair: Any, blob: bytes) -> None:
    _, b, _, _ = pair
    with pytest.raises(MetadataError):
        b.add_remote("someone", blob)


@needs_nixl
def test_blob_must_name_the_same_agent(pair: Any) -> None:
    a, b, _, _ = pair
    with pytest.raises(MetadataError, match="names agent"):
        b.add_remote("not-seam-a", a.local_metadata())


@needs_nixl
def test_release_pending_and_close_are_quiet(pair: Any) -> None:
    _, b, src, dst = pair
    lp, rp = b.prepare(None, _rows(dst, True)), b.prepare("seam-a", _rows(src, True))
    x = b.post(Op.READ, lp, np.arange(ROWS, dtype=np.int32), rp, np.arange(ROWS, dtype=np.int32), None)
    b.release(x)
    b.release(x)
    b.close()
    b.close()


@needs_nixl
def test_progress_thread_option_sets_needs_progress() -> None:
    off = nb.NixlBackend("opt-off")
    on = nb.NixlBackend("opt-on", progress_thread=True)
    try:
        assert off.capabilities.needs_progress is (not nb.DEFAULT_PROGRESS_THREAD)
        assert on.capabilities.needs_progress is False
        caps = off.capabilities
        assert caps.merges_runs and caps.strided_lists and not caps.cheap_prepare and caps.cross_process
        assert caps.memory_kinds == frozenset({MemoryKind.DRAM, MemoryKind.VRAM})
    finally:
        on.close()
        off.close()


@needs_nixl
def test_unknown_option_is_rejected() -> None:
    with pytest.raises(TypeError):
        nb.NixlBackend("opt-bad", no_such_option=1)  # type: ignore[call-arg]


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------
@needs_nixl
def test_error_mapping_covers_every_nixl_exception() -> None:
    from kvxfer.errors import (
        BackendError,
        KvxferError,
        PeerDisconnectedError,
        TransferCancelledError,
        UnsupportedError,
    )

    from kvxfer_nixl._nixl import map_error

    B = nb.nb
    expect = {
        "nixlRemoteDisconnectError": PeerDisconnectedError,
        "nixlNotFoundError": StalePeerError,
        "nixlNotAllowedError": StalePeerError,
        "nixlNotSupportedError": UnsupportedError,
        "nixlCancelledError": TransferCancelledError,
        "nixlInvalidParamError": BackendError,
    }
    for name in [n for n in dir(B) if n.startswith("nixl") and n.endswith("Error")]:
        exc = getattr(B, name)("boom")
        err = map_error(exc, "testing", "peer-x")
        assert isinstance(err, KvxferError) and err.__cause__ is exc
        if name in expect:
            assert isinstance(err, expect[name]), name
    assert isinstance(map_error(B.nixlNotFoundError("x"), "testing"), BackendError)  # no peer involved
    assert isinstance(map_error(TypeError("bad"), "testing"), BackendError)


@needs_nixl
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_forked_child_changes_process_token() -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    r, w = os.pipe()
    pid = os.fork()
    from kvxfer import peers

    mine = peers.here().token
    if pid == 0:  # child: report whether the token changed, then leave without cleanup
        os.write(w, peers.here().token)
        os._exit(0)
    os.close(w)
    child_token = os.read(r, 16)
    os.waitpid(pid, 0)
    os.close(r)
    assert child_token and child_token != mine


class TestNixlConformanceOwner(BackendConformance):
    """The same suite with every agent driven through kvxfer.Owner (its thread posts and polls)."""

    backend = "nixl"
    options: dict[str, Any] = {}
    owned = True


class TestNixlConformanceVRAMOwner(BackendConformance):
    """CUDA tensors through kvxfer.Owner: the device path driven from the owner's thread."""

    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {}
    owned = True


class TestNixlTwoProcessOwner(TwoProcessConformance):
    backend = "nixl"
    options: dict[str, Any] = {}
    owned = True
