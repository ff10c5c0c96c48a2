"""The boundary between kvxfer and an engine that calls it: no exception of kvxfer's reaches
the engine's loop.

Engines call their storage seams from threads with no handler around the calls (vLLM's
scheduler, SGLang's HiCache storage threads): an exception there ends the engine or a thread
it needs. So every callback an engine makes per request or per step is wrapped once, here: an
exception is logged, counted and turned into the callback's fallback (a miss, a failed job),
which leaves the engine a state where the affected requests recompute. Start-up is not
wrapped: an adapter that cannot run must stop the engine before it serves anyone.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

__all__ = ["boundary"]

F = TypeVar("F", bound=Callable[..., Any])
#: Tracebacks logged per process; after that one line per error (a hostile client must not flood logs).
_TRACEBACKS = 20
_logged = [0]


def _contain(owner: Any, name: str, exc: BaseException, log: logging.Logger) -> None:
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


def boundary(default: Callable[[], Any], salvage: Callable[..., Any] | None = None, *,
             log: logging.Logger) -> Callable[[F], F]:
    """Wrap a callback: on any ``Exception`` return ``salvage(self, *args)`` (the state repair
    that makes the failure a recompute), or ``default()`` if there is none or it raised too.

    The unwrapped callback stays reachable as ``__wrapped__`` (functools.wraps), which the
    tests' controls use to show what escapes without this.
    """
    def wrap(fn: F) -> F:
        name = fn.__name__

        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001  # the point: nothing reaches the engine's loop
                _contain(self, name, exc, log)
            if salvage is not None:
                try:
                    return salvage(self, *args, **kwargs)
                except Exception as exc:  # noqa: BLE001
                    _contain(self, f"{name} (its fallback)", exc, log)
            return default()
        return call  # type: ignore[return-value]
    return wrap
