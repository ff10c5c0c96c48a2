"""The connector's boundary with vLLM: no exception of kvxfer's ever reaches vLLM's engine loop.

vLLM calls the connector from its scheduler and its workers and has no handler around those
calls: an exception there ends the engine ("EngineCore encountered a fatal error"), and the
inputs include what any API client sends (``kv_transfer_params``, request ids). So every
callback vLLM makes per request or per step is wrapped once, by :mod:`.._boundary` (shared
with the SGLang backend): an exception is logged, counted (``connector_errors``,
``vllm:kvxfer_connector_errors``) and turned into the callback's fallback, which leaves vLLM
a state where the affected requests recompute and nothing waits forever (scheduler.py and
worker.py hold the fallbacks). Start-up (construction, ``register_kv_caches``) is not wrapped:
a connector that cannot run must stop the engine before it serves anyone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .._boundary import boundary as _boundary

__all__ = ["boundary"]

log = logging.getLogger("vllm.kvxfer")


def boundary(default: Callable[[], Any], salvage: Callable[..., Any] | None = None) -> Callable[[Any], Any]:
    """:func:`kvxfer.integrations._boundary.boundary`, logging to vLLM's ``vllm.kvxfer`` logger."""
    return _boundary(default, salvage, log=log)
