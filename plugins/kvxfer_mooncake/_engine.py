"""Loading Mooncake: its log level follows kvxfer's, its TCP progress timeout the agent's bound.

Both are read from the environment when the library loads or an engine starts, so they are
set here, before either, and never over a value the user set.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any

from kvxfer import BackendError

__all__ = ["glog_level", "start_engine", "stop_engine"]

_log = logging.getLogger("kvxfer.mooncake")

_PROGRESS_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"


def glog_level(level: int) -> str:
    """Mooncake's ``MC_LOG_LEVEL`` for a kvxfer logging level, one step quieter.

    Mooncake's failures reach the caller as typed kvxfer errors, so its INFO and WARNING lines
    are detail. This glog ignores ``GLOG_minloglevel`` and knows no level above ERROR, so its
    harmless "Local segment descriptor not found" (ERROR, once per engine) still prints.
    """
    if level <= logging.DEBUG:
        return "INFO"
    if level <= logging.INFO:
        return "WARNING"
    return "ERROR"


def start_engine(host: str, progress_timeout: float) -> tuple[Any, str]:
    """A started engine on ``host`` (P2P handshake, TCP) and its session id."""
    os.environ.setdefault("MC_LOG_LEVEL", glog_level(logging.getLogger("kvxfer").getEffectiveLevel()))
    os.environ[_PROGRESS_ENV] = str(max(1, math.ceil(progress_timeout)))  # whole seconds, read at start
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise BackendError(f"mooncake: TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) returned {rc}")
    return engine, f"{host}:{engine.get_rpc_port()}"


#: Memory an engine may still write into, kept for the life of the process: the engine
#: outlived its backend's close (something else still referred to it), so nothing tells
#: when its queued spans are done with this memory.
_KEPT: list[Any] = []


def _outlives(engine: Any) -> bool:
    """Whether something besides the caller's name refers to ``engine`` (then dropping that
    name does not stop it)."""
    return sys.getrefcount(engine) > 3  # the caller's name, this parameter and the call's argument


def stop_engine(box: list[Any], held: list[Any]) -> None:
    """Stop the engine in ``box``, then let ``held`` go (landing areas of READs that ended
    early, the first contact's byte): memory a queued span may still land in.

    The engine's destructor joins its threads, so once it has run nothing writes there. It runs
    here only if ``box`` held the last reference; if anything else still refers to the engine
    (a traceback, a caller's name), ``held`` is kept instead, never freed under it (RELIABILITY.md,
    "Mooncake: a held landing area freed before its engine")."""
    engine = box.pop()
    if _outlives(engine):
        _log.warning("mooncake: the engine outlived its backend's close; %d landing areas are kept for the "
                     "life of the process", len(held))
        _KEPT.extend(held)
    del engine
    held.clear()
