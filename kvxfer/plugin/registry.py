"""Plugin discovery: pluggy, the ``kvxfer`` entry-point group, and the backend registry.

Built-in backends are found exactly like third-party ones, through entry points, so the
built-ins prove the path every plugin takes. Two environment switches help when a plugin
misbehaves:

``KVXFER_BLOCK_PLUGINS=nixl,ucx``
    skip those entry points (comma-separated names) without uninstalling anything.
``KVXFER_TRACE_PLUGINS=1``
    print every hook call and result to stderr.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import pluggy

from . import hookspecs
from ..errors import BackendUnavailableError, KvxferError, UnknownBackendError

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["BackendInfo", "BackendStatus", "available_backends", "get_backend_class", "plugin_manager",
           "reset_plugins"]

BLOCK_ENV = "KVXFER_BLOCK_PLUGINS"
TRACE_ENV = "KVXFER_TRACE_PLUGINS"


@dataclass(frozen=True)
class BackendInfo:
    """What a plugin registered: a name, a lazily imported factory and how to make it run."""

    name: str
    factory: Any  # a Backend subclass or "module:attribute"
    plugin: str
    requires: tuple[str, ...] = ()
    install: str | None = None
    summary: str = ""
    check: Callable[[], str | None] | None = None

    def unavailable_reason(self) -> str | None:
        missing = [m for m in self.requires if not _importable(m)]
        if missing:
            return f"missing Python module(s): {', '.join(missing)}"
        if self.check is not None:
            try:
                return self.check()
            except Exception as exc:  # a broken check must not break listing
                return f"availability check failed: {exc}"
        return None

    def load(self) -> type[Backend]:
        reason = self.unavailable_reason()
        if reason:
            hint = f"; install it with: {self.install}" if self.install else ""
            raise BackendUnavailableError(f"backend {self.name!r} cannot run here: {reason}{hint}")
        f = self.factory
        if isinstance(f, str):
            mod, _, attr = f.partition(":")
            try:
                f = getattr(importlib.import_module(mod), attr)
            except ImportError as exc:
                hint = f"; install it with: {self.install}" if self.install else ""
                raise BackendUnavailableError(f"backend {self.name!r} failed to import ({exc}){hint}") from None
        return f  # type: ignore[no-any-return]


@dataclass(frozen=True)
class BackendStatus:
    """One row of :func:`available_backends`."""

    name: str
    plugin: str
    available: bool
    reason: str | None
    install: str | None
    summary: str


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None marks a module blocked from import
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None
_registry: dict[str, BackendInfo] | None = None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading entry points on first use."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager("kvxfer")
            pm.add_hookspecs(hookspecs)
            for name in _split(os.environ.get(BLOCK_ENV, "")):
                pm.set_blocked(name)
            if os.environ.get(TRACE_ENV, "") not in ("", "0"):
                pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[kvxfer plugins] {msg}"))
                pm.enable_tracing()
            pm.load_setuptools_entrypoints("kvxfer")
            _pm = pm
        return _pm


def _split(value: str) -> Iterable[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _build_registry() -> dict[str, BackendInfo]:
    pm = plugin_manager()
    registry: dict[str, BackendInfo] = {}
    current = {"plugin": "?"}

    def register(name: str, factory: Any, *, requires: Iterable[str] = (), install: str | None = None,
                 summary: str = "", check: Callable[[], str | None] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise KvxferError(f"plugin {current['plugin']!r} registered a backend without a name")
        if name in registry:
            raise KvxferError(f"backend {name!r} registered twice (by {registry[name].plugin!r} and "
                              f"{current['plugin']!r}); block one with {BLOCK_ENV}")
        registry[name] = BackendInfo(name, factory, current["plugin"], tuple(requires), install, summary, check)

    # Call each plugin's hook on its own (still through pluggy, so tracing sees it) so that a
    # registration error names the plugin that made it.
    plugins = [impl.plugin for impl in pm.hook.kvxfer_register_backends.get_hookimpls()]
    for plugin in plugins:
        current["plugin"] = pm.get_name(plugin) or repr(plugin)
        others = [p for p in plugins if p is not plugin]
        pm.subset_hook_caller("kvxfer_register_backends", remove_plugins=others)(register=register)
    return registry


def registry() -> dict[str, BackendInfo]:
    global _registry
    if _registry is None:
        _registry = _build_registry()
    return _registry


def reset_plugins() -> None:
    """Forget loaded plugins (tests use it after installing or blocking a plugin)."""
    global _pm, _registry
    with _lock:
        _pm = None
        _registry = None


def available_backends() -> list[BackendStatus]:
    """Every backend found, whether it can run here, why not, and the install command."""
    out = []
    for info in registry().values():
        reason = info.unavailable_reason()
        out.append(BackendStatus(info.name, info.plugin, reason is None, reason, info.install, info.summary))
    return sorted(out, key=lambda s: s.name)


def get_backend_class(name: str) -> type[Backend]:
    reg = registry()
    if name not in reg:
        known = ", ".join(sorted(reg)) or "none"
        blocked = os.environ.get(BLOCK_ENV)
        extra = f" ({BLOCK_ENV}={blocked})" if blocked else ""
        raise UnknownBackendError(f"no backend named {name!r}; installed backends: {known}{extra}")
    return reg[name].load()
