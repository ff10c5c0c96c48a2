"""Per-transfer observability: observers, structured logging, and an environment switch.

Every finished transfer (done, failed or cancelled) is offered to observers, plugin objects
implementing :func:`kvxfer.plugin.hookspecs.kvxfer_transfer_finished`, registered through
an entry point or with :func:`add_observer`. With no observer and logging off, the cost is
one check per transfer.

Logging goes through the ``kvxfer`` logger and is quiet by default (a ``NullHandler``; the
application decides). ``KVXFER_LOG=info`` or ``debug`` turns on a stderr handler without a
code change, ``KVXFER_LOG_FORMAT=json`` makes it one JSON object per line. Finished transfers
are logged at DEBUG (INFO when they failed), with their stats under the record's ``kvxfer``
attribute, which :class:`JsonFormatter` merges into the line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import IO, Any

from .plugin import registry as _registry
from .plugin.hookspecs import ObservedAgent, ObservedTransfer
from ._stats import Status, TransferStats

__all__ = ["add_observer", "remove_observer", "stats_dict", "enable_logging", "JsonFormatter", "LOG_ENV"]

LOG_ENV = "KVXFER_LOG"
LOG_FORMAT_ENV = "KVXFER_LOG_FORMAT"

logger = logging.getLogger("kvxfer")
logger.addHandler(logging.NullHandler())
_xfer_log = logging.getLogger("kvxfer.transfer")
_handler: logging.Handler | None = None


def stats_dict(stats: TransferStats, transfer: ObservedTransfer | None = None) -> dict[str, Any]:
    """A transfer's stats as JSON types (plus ``status``/``error`` when the transfer is given)."""
    d = dataclasses.asdict(stats)
    d["gbps"] = stats.gbps
    d["completion_seconds"] = stats.completion_seconds
    if transfer is not None:
        d["status"] = transfer.status.value
        d["error"] = None if transfer.error is None else f"{type(transfer.error).__name__}: {transfer.error}"
    return d


#: (manager, its registration count, whether it has observers) as last seen: asked again only
#: when a plugin or observer was registered or removed since (kvxfer.plugin.registry._Manager).
_seen: list[Any] = [None, -1, False]
_DONE = Status.DONE  # a module constant: reading an enum member through its class costs a call's worth


def _observers() -> tuple[Any, bool]:
    pm = _registry._pm or _registry.plugin_manager()
    gen = getattr(pm, "generation", None)
    if pm is not _seen[0] or gen != _seen[1] or gen is None:
        # A manager that counts nothing (not kvxfer's) is never taken as seen: asked every time.
        _seen[:] = [pm if gen is not None else None, gen, bool(pm.hook.kvxfer_transfer_finished.get_hookimpls())]
    return pm, _seen[2]


def transfer_finished(agent: ObservedAgent, transfer: ObservedTransfer) -> None:
    """Called by the agent once per transfer leaving flight: log it and tell observers.
    With no observer and the logger quiet, a DONE transfer costs this call and two lookups."""
    failed = transfer.status is not _DONE
    pm = _registry._pm
    if not failed and pm is _seen[0] and pm.generation == _seen[1] and not _seen[2] \
            and not _xfer_log.isEnabledFor(logging.DEBUG):
        return
    pm, observers = _observers()
    level = logging.INFO if failed else logging.DEBUG
    s = transfer.stats
    # A 0-descriptor transfer that succeeded is a warm-up (a connection opened ahead of time):
    # nothing an operator needs, and at -vv it would drown the real ones.
    logged = _xfer_log.isEnabledFor(level) and (failed or s.descriptors > 0)
    if not observers and not logged:
        return
    hook = pm.hook.kvxfer_transfer_finished
    if logged:
        _xfer_log.log(level, "%s %s %s: %d descriptors, %d bytes, %s", agent.name, s.op, transfer.status.value,
                      s.descriptors, s.nbytes, f"{s.seconds:.6f} s" if s.seconds is not None else "-",
                      extra={"kvxfer": {"agent": agent.name, **stats_dict(s, transfer)}})
    if observers:
        try:
            hook(agent=agent, transfer=transfer, stats=s)
        except Exception:  # an observer must never break the transfer's owner
            logger.warning("a kvxfer_transfer_finished observer raised", exc_info=True)


def add_observer(observer: object, name: str | None = None) -> None:
    """Register an object with hook implementations (for example a metrics exporter).

    Its hooks are validated at once: a misspelt hook name raises
    ``pluggy.PluginValidationError`` here rather than never being called.
    """
    pm = _registry.plugin_manager()
    pm.register(observer, name=name)
    try:
        pm.check_pending()
    except Exception:
        pm.unregister(observer)
        raise


def remove_observer(observer: object) -> None:
    pm = _registry.plugin_manager()
    if pm.is_registered(observer):
        pm.unregister(observer)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the ``kvxfer`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {"time": record.created, "level": record.levelname, "logger": record.name,
                             "message": record.getMessage()}
        extra = getattr(record, "kvxfer", None)
        if isinstance(extra, dict):
            d.update(extra)
        if record.exc_info:
            d["exception"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def enable_logging(level: str | int = "INFO", *, json_lines: bool = False,
                   stream: IO[str] | None = None) -> logging.Handler:
    """Send kvxfer's log records to ``stream`` (stderr); calling again replaces the handler."""
    global _handler
    if _handler is not None:
        logger.removeHandler(_handler)
    h = logging.StreamHandler(stream if stream is not None else sys.stderr)
    h.setFormatter(JsonFormatter() if json_lines else logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                                                          "%(message)s"))
    logger.addHandler(h)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    _handler = h
    return h


def _configure_from_env() -> None:
    level = os.environ.get(LOG_ENV, "").strip()
    if level and level != "0":
        known = logging.getLevelName(level.upper())
        enable_logging(known if isinstance(known, int) else logging.INFO,
                       json_lines=os.environ.get(LOG_FORMAT_ENV, "").lower() == "json")


_configure_from_env()
