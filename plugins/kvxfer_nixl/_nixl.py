"""NIXL as the backend uses it: the modules, a quiet logger, exceptions mapped to kvxfer's.

Every call into NIXL goes through :func:`map_error` on failure, so no NIXL (or pybind)
exception type ever leaves the backend: a caller catches :class:`~kvxfer.KvxferError`
subclasses only, each chosen by what the caller should do next.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
from typing import Any, Sequence

import numpy as np


def _skip_absent_rdma() -> None:
    """Keep UCX from loading its InfiniBand modules on a host with no RDMA device.

    The nixl-cu13 1.5.1 wheel bundles its own libnl-route. Where the system also has
    libibverbs (rdma-core, pulled in by packages such as fio), UCX's ib module loads the
    system's libnl-route beside the bundled one, and the process dies of SIGSEGV in
    ``rtnl_tc_unregister`` when it exits, after all its work is done (RELIABILITY.md,
    "NIXL exits"). With no device under ``/sys/class/infiniband`` those modules serve
    nothing, so they are not loaded; hosts with RDMA devices, and a ``UCX_MODULES`` the
    user set, are left alone. Must run before NIXL loads UCX (this module's import).
    """
    if "UCX_MODULES" in os.environ:
        return
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not devices:
        os.environ["UCX_MODULES"] = "^ib,rdmacm"


_skip_absent_rdma()


# Whether the user chose NIXL's log level, read before the default below is written.
_USER_NIXL_LEVEL = bool(os.environ.get("NIXL_LOG_LEVEL"))


def _quiet_native_logs() -> None:
    """Keep NIXL's and UCX's native loggers to fatal lines unless the user chose a level.

    A peer that dies makes both libraries print their own error lines on stderr beside the
    :class:`~kvxfer.PeerDisconnectedError` that already says the same thing (issue 33). Every
    failure they log also reaches the caller as a typed error through :func:`map_error`, so
    by default the lines are noise. ``NIXL_LOG_LEVEL`` or ``UCX_LOG_LEVEL`` set by the user
    (e.g. ``ERROR`` / ``error`` to debug) is left alone. Both libraries read them when they
    load, so this must run before this module imports NIXL.
    """
    if not _USER_NIXL_LEVEL:
        os.environ["NIXL_LOG_LEVEL"] = "FATAL"
    if not os.environ.get("UCX_LOG_LEVEL"):
        os.environ["UCX_LOG_LEVEL"] = "fatal"


_quiet_native_logs()


def _torch_build_has_no_cuda() -> bool:
    """True when an installed torch, not imported yet, is a CPU build: its ``version.py``, read
    alone as NIXL's meta package reads it, says ``cuda = None``."""
    if any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy")):
        return False
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False
        version = importlib.util.spec_from_file_location(
            "_kvxfer_torch_version", os.path.join(os.path.dirname(spec.origin), "version.py"))
        if version is None or version.loader is None:
            return False
        module = importlib.util.module_from_spec(version)
        version.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - unreadable: NIXL's own detection decides
        return False
    return getattr(module, "cuda", "unknown") is None


def _import_nixl() -> tuple[Any, Any]:
    """``nixl._api`` and ``nixl._bindings``, without the torch import NIXL's meta package makes
    on a host whose torch is a CPU build.

    To pick its CUDA wheel, ``nixl`` asks ``nixl_meta_utils.detect_cuda_major``: torch, CUDA
    bindings or CuPy already imported, else torch's ``version.py`` read from disk, and when that
    says "no CUDA", ``import torch`` to hear the same answer again (about 1 s of every process
    that uses this backend; kvxfer itself never needs torch). Only in that last case is the
    answer given without the import (``None``, which torch would have given); NIXL then picks
    its wheel as it always does, and every other case goes to NIXL's own detection.
    """
    try:
        import nixl_meta_utils
    except ImportError:  # an older NIXL without the meta package: nothing to spare
        nixl_meta_utils = None
    detect = getattr(nixl_meta_utils, "detect_cuda_major", None)
    spare = detect is not None and "nixl" not in sys.modules and _torch_build_has_no_cuda()
    if spare:
        nixl_meta_utils.detect_cuda_major = lambda: None
    try:
        import nixl._api as api
        import nixl._bindings as bindings
    finally:
        if spare:
            nixl_meta_utils.detect_cuda_major = detect

    return api, bindings


nx, _nb = _import_nixl()  # after the two above: UCX reads UCX_MODULES when NIXL loads it
from kvxfer import (Allocation, BackendError, KvxferError, MemoryKind, PeerDisconnectedError, StalePeerError,
                    TransferCancelledError, UnsupportedError)

__all__ = ["deregister_memory", "map_error", "nb", "nx", "register_memory"]

nb = _nb


def _quiet_logging() -> None:
    """NIXL's Python logger prints INFO lines to *stdout*; peers speak JSON over stdout.

    Unless the user asked for a level with ``NIXL_LOG_LEVEL``, keep warnings only, and send
    them to stderr so that a process's stdout stays its own. (The native default set by
    :func:`_quiet_native_logs` does not count as the user's choice here.)
    """
    log = logging.getLogger("nixl")
    if not _USER_NIXL_LEVEL:
        log.setLevel(logging.WARNING)
    for h in log.handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)


_quiet_logging()


def map_error(exc: BaseException, action: str, peer: str | None = None) -> KvxferError:
    """The kvxfer error for ``exc``, raised while doing ``action`` (with ``peer``, if any)."""
    if isinstance(exc, KvxferError):
        return exc
    who = f" peer {peer!r}" if peer else ""
    detail = f"{type(exc).__name__}: {exc}"
    err: KvxferError
    if isinstance(exc, _nb.nixlRemoteDisconnectError):
        err = PeerDisconnectedError(f"{action}:{who or ' the peer'} disconnected ({detail}); "
                                    "add it again once it is back")
    elif isinstance(exc, (_nb.nixlNotFoundError, _nb.nixlNotAllowedError)) and peer:
        err = StalePeerError(f"{action}: NIXL no longer accepts{who} or lists prepared for it ({detail}); "
                             "the peer was removed or restarted: add it again from fresh metadata")
    elif isinstance(exc, _nb.nixlNotSupportedError):
        err = UnsupportedError(f"{action}: not supported by the NIXL backends in use ({detail})")
    elif isinstance(exc, _nb.nixlCancelledError):
        err = TransferCancelledError(f"{action}: cancelled inside NIXL ({detail})")
    elif isinstance(exc, (_nb.nixlInvalidParamError, _nb.nixlMismatchError)):
        err = BackendError(f"{action}: NIXL rejected the request ({detail}); descriptors must lie in registered "
                           "memory of the stated kind, with equal lengths on both sides")
    else:
        err = BackendError(f"{action}: NIXL failed ({detail})")
    err.__cause__ = exc
    return err


def register_memory(agent: Any, lock: threading.RLock, allocs: Sequence[Allocation]) -> list[tuple[MemoryKind, Any]]:
    """One ``register_memory`` per memory kind; all or nothing."""
    lists: list[tuple[MemoryKind, Any]] = []
    try:
        for kind in (MemoryKind.DRAM, MemoryKind.VRAM):
            group = [a for a in allocs if a.kind is kind]
            if not group:
                continue
            # An N x 3 array: NIXL logs bad input of other shapes and raises a vague TypeError.
            arr = np.array([(a.address, a.nbytes, a.device) for a in group], dtype=np.uint64)
            with lock:
                try:
                    lists.append((kind, agent.register_memory(arr, kind.value)))
                except Exception as exc:
                    hint = (" (VRAM needs a CUDA build of NIXL and a UCX with CUDA support)"
                            if kind is MemoryKind.VRAM else "")
                    raise map_error(exc, f"registering {len(group)} {kind.value} allocation(s){hint}") from exc
    except BaseException:
        deregister_memory(agent, lock, lists)
        raise
    return lists


def deregister_memory(agent: Any, lock: threading.RLock, lists: list[tuple[MemoryKind, Any]]) -> list[Exception]:
    """Deregister every list; returns the failures (the rest is deregistered regardless)."""
    errors = []
    for _, reg in lists:
        with lock:
            try:
                agent.deregister_memory(reg)
            except Exception as exc:
                errors.append(exc)
    return errors
