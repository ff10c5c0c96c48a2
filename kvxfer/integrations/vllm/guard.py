"""The connector's boundary with vLLM: no exception of kvxfer's ever reaches vLLM's engine loop.

vLLM calls the connector from its scheduler and its workers and has no handler around those
calls: an exception there ends the engine ("EngineCore encountered a fatal error"), and the
inputs include what any API client sends (``kv_transfer_params``, request ids). So every
callback vLLM makes per request or per step is wrapped once, here, rather than each parser
catching more classes: an exception is logged, counted (``connector_errors``,
``vllm:kvxfer_connector_errors``) and turned into the callback's fallback, which leaves vLLM
a state where the affected requests recompute and nothing waits forever (scheduler.py and
worker.py hold the fallbacks). Start-up (construction, ``register_kv_caches``) is not wrapped:
a connector that cannot run must stop the engine before it serves anyone.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

__all__ = ["boundary"]

log = logging.getLogger("vllm.kvxfer")

F = TypeVar("F", bound=Callable[..., Any])
#: Tracebacks logged per process; after that one line per error (a hostile client must not flood logs).
_TRACEBACKS = 20
_logged = [0]


def _contain(owner: Any, name: str, exc: BaseException) -> None:
    """Count and log one contained error; never raises."""
    try:
        side = getattr(owner, "_worker", None) or getattr(owner, "_sched", None)
        if side is not None:
            side.stats.count("connector_errors")
        _logged[0] += 1
        log.error("kvxfer: %s raised %s; contained (the request recomputes): %.300r", name, type(exc).__name__,
                  str(exc), exc_info=exc if _logged[0] <= _TRACEBACKS else None)
    except Exception:  # noqa: BLE001  # a log handler or a stats object that fails: still never raise
        pass


def boundary(default: Callable[[], Any], salvage: Callable[..., Any] | None = None) -> Callable[[F], F]:
    """Wrap a connector callback: on any ``Exception`` return ``salvage(self, *args)`` (the state
    repair that makes the failure a recompute), or ``default()`` if there is none or it raised too.

    The unwrapped callback stays reachable as ``__wrapped__`` (functools.wraps), which the
    fuzz's control uses to show what escapes without this.
    """
    def wrap(fn: F) -> F:
        name = fn.__name__

        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001  # the point: nothing reaches vLLM's loop
                _contain(self, name, exc)
            if salvage is not None:
                try:
                    return salvage(self, *args, **kwargs)
                except Exception as exc:  # noqa: BLE001
                    _contain(self, f"{name} (its fallback)", exc)
            return default()
        return call  # type: ignore[return-value]
    return wrap
