"""Loading Mooncake: its log level follows kvxfer's, its TCP progress timeout the agent's bound.

Both are read from the environment when the library loads or an engine starts, so they are
set here, before either, and never over a value the user set.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from kvxfer import BackendError

__all__ = ["glog_level", "start_engine"]

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
