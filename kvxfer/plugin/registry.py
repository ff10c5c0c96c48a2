"""Plugin discovery: pluggy, the ``kvxfer`` entry-point group, and the backend registry.

Built-in backends are found exactly like third-party ones, through entry points, so the
built-ins prove the path every plugin takes. Two environment switches help when a plugin
misbehaves:

``KVXFER_BLOCK_PLUGINS=nixl,ucx``
    skip those entry points (comma-separated names) without uninstalling anything.
``KVXFER_TRACE_PLUGINS=1``
    print every hook call and result to stderr.

A plugin that fails to import, implements a hook that does not exist (a misspelt name), or
raises while registering is *broken*: it is skipped with a :class:`PluginWarning`, listed by
:func:`broken_plugins` and ``kvxfer backends`` with its error, and never takes the other
plugins (or an ``Agent`` on another backend) down with it.

Backend names are claims, settled after every plugin has registered, so the outcome never
depends on load order: the built-in names (``loopback``, ``nixl``, ``ucx``) belong to the
kvxfer distribution and a third-party claim on one is refused; a name two third-party
plugins claim is refused for both (:class:`~kvxfer.errors.BackendNameConflictError` names
both distributions). Conflicts are listed by :func:`backend_conflicts` and ``kvxfer
backends``, one line each, and logged, not warned: they are raised where the name is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Iterable

import pluggy

from . import hookspecs
from .backend import Option
from .hookspecs import RegisterBackend
from ..errors import BackendNameConflictError, BackendUnavailableError, KvxferError, UnknownBackendError

if TYPE_CHECKING:
    from .backend import Backend

__all__ = ["BUILTIN_NAMES", "BackendConflict", "BackendInfo", "BackendStatus", "BrokenPlugin", "PluginWarning",
           "available_backends", "backend_conflicts", "broken_plugins", "get_backend_class", "plugin_manager", "reset_plugins"]

BLOCK_ENV = "KVXFER_BLOCK_PLUGINS"
TRACE_ENV = "KVXFER_TRACE_PLUGINS"
GROUP = "kvxfer"
#: Backend names only the kvxfer distribution's own plugins may register.
BUILTIN_NAMES = frozenset({"loopback", "nixl", "ucx"})
CORE_DISTRIBUTION = "kvxfer"

_log = logging.getLogger("kvxfer.plugin")


class PluginWarning(UserWarning):
    """A plugin was skipped because it is broken (see :func:`broken_plugins`)."""


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that was skipped: where it failed (``import``, ``hooks`` or ``register``) and why."""

    name: str
    stage: str
    error: str
    distribution: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class BackendConflict:
    """A backend name refused to some plugins: a built-in name, or one two third parties claim."""

    name: str
    plugins: tuple[str, ...]  # the refused claimants, sorted by distribution then plugin
    distributions: tuple[str | None, ...]
    versions: tuple[str | None, ...]
    reserved: bool  # a built-in name: the built-in keeps it

    def claimants(self) -> str:
        return " and ".join(f"plugin {p!r} ({_dist_label(d, v)})"
                            for p, d, v in zip(self.plugins, self.distributions, self.versions))

    @property
    def short(self) -> str:
        """One table cell: who was refused."""
        who = " and ".join(_dist_label(d, v) for d, v in zip(self.distributions, self.versions))
        return f"built-in name; refused {who}" if self.reserved else f"claimed by {who}: both refused"

    @property
    def message(self) -> str:
        if self.reserved:
            return (f"backend name {self.name!r} is reserved for kvxfer's built-in backend; refused the claim of "
                    f"{self.claimants()}")
        return (f"backend name {self.name!r} is claimed by {self.claimants()}; both are refused: uninstall one, "
                f"or hide one with {BLOCK_ENV}=<plugin>")


def _dist_label(dist: str | None, version: str | None) -> str:
    if dist is None:
        return "registered in-process, no distribution"
    return f"{dist} {version}" if version else dist


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
    options: tuple[Option, ...] = ()  # the option table: docs/backends.md, `kvxfer backends --options`

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
    distribution: str | None = None
    version: str | None = None


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None marks a module blocked from import
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_registry: dict[str, BackendInfo] | None = None
_broken: list[BrokenPlugin] = []
_dists: dict[str, tuple[str | None, str | None]] = {}  # plugin name -> (distribution, version)
_conflicts: list[BackendConflict] = []


class _Manager(pluggy.PluginManager):
    """pluggy's manager, counting registrations: a finished transfer asks whether anyone
    observes only when the count moved (:mod:`kvxfer.observe`), not once per transfer."""

    generation = 0

    def register(self, plugin: object, name: str | None = None) -> str | None:
        try:
            return super().register(plugin, name)
        finally:
            self.generation += 1

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        try:
            return super().unregister(plugin, name)
        finally:
            self.generation += 1


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading entry points on first use."""
    global _pm
    with _lock:
        if _pm is None:
            pm = _Manager(GROUP)
            pm.add_hookspecs(hookspecs)
            for name in _split(os.environ.get(BLOCK_ENV, "")):
                pm.set_blocked(name)
            if os.environ.get(TRACE_ENV, "") not in ("", "0"):
                pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[kvxfer plugins] {msg}"))
                pm.enable_tracing()
            _load_entry_points(pm)
            _pm = pm
        return _pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """pluggy's loader stops at the first plugin that fails; this one skips it and goes on.

    kvxfer's own entry points load first, under their own names; a third-party entry point
    whose name is taken is registered as ``name@distribution`` rather than dropped, so its
    backend claims are settled by :func:`_settle` like any other.
    """
    def dist_of(ep: Any) -> tuple[str | None, str | None]:
        dist = getattr(ep, "dist", None)
        return (dist.metadata["Name"], dist.version) if dist is not None else (None, None)

    eps = sorted(entry_points(group=GROUP), key=lambda ep: dist_of(ep)[0] != CORE_DISTRIBUTION)
    for ep in eps:
        info = dist_of(ep)
        name = ep.name
        if pm.is_blocked(name):
            continue
        if pm.has_plugin(name):
            name = f"{ep.name}@{info[0]}"
            if pm.has_plugin(name) or pm.is_blocked(name):
                continue
        try:
            plugin = ep.load()
        except Exception as exc:  # any import failure, including errors raised by its code
            _mark_broken(name, "import", exc, info)
            continue
        try:
            pm.register(plugin, name=name)
            pm.check_pending()  # a hook implementation without a spec: a misspelt hook name
        except Exception as exc:
            if pm.is_registered(plugin):
                pm.unregister(plugin)
            _mark_broken(name, "hooks", exc, info)
            continue
        _dists[name] = info


def _mark_broken(name: str, stage: str, exc: BaseException, info: tuple[str | None, str | None]) -> None:
    error = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    _broken.append(BrokenPlugin(name, stage, error, *info))
    msg = f"kvxfer plugin {name!r} is broken and was skipped ({stage}): {error}"
    _log.warning(msg)
    warnings.warn(msg, PluginWarning, stacklevel=4)


def _split(value: str) -> Iterable[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _registrar(plugin: str, mine: dict[str, BackendInfo]) -> RegisterBackend:
    """The ``register`` callback one plugin gets; what it registers lands in ``mine``.

    Only a plugin registering one name twice fails here; clashes between plugins are
    settled once all have registered (:func:`_settle`), so load order cannot decide them.
    """

    def register(name: str, factory: Any, *, requires: Iterable[str] = (), install: str | None = None,
                 summary: str = "", check: Callable[[], str | None] | None = None,
                 options: Iterable[Option] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise KvxferError("registered a backend without a name")
        if name in mine:
            raise KvxferError(f"plugin {plugin!r} registers backend {name!r} twice")
        rows = tuple(options)
        if not all(isinstance(o, Option) for o in rows):
            raise KvxferError(f"plugin {plugin!r} registers backend {name!r} with options that are not "
                              "kvxfer.plugin.Option rows")
        mine[name] = BackendInfo(name, factory, plugin, tuple(requires), install, summary, check, rows)

    return register


def _build_registry() -> dict[str, BackendInfo]:
    pm = plugin_manager()
    registry: dict[str, BackendInfo] = {}

    # Call each plugin's hook on its own (still through pluggy, so tracing sees it): a failure
    # names the plugin that made it, and only that plugin's backends are dropped.
    plugins = [impl.plugin for impl in pm.hook.kvxfer_register_backends.get_hookimpls()]
    claims: dict[str, list[BackendInfo]] = {}
    for plugin in plugins:
        name = pm.get_name(plugin) or repr(plugin)
        mine: dict[str, BackendInfo] = {}
        others = [p for p in plugins if p is not plugin]
        try:
            pm.subset_hook_caller("kvxfer_register_backends", remove_plugins=others)(
                register=_registrar(name, mine))
        except Exception as exc:
            _mark_broken(name, "register", exc, _dists.get(name, (None, None)))
            continue
        for backend, info in mine.items():
            claims.setdefault(backend, []).append(info)
    for backend in sorted(claims):
        winner = _settle(backend, claims[backend])
        if winner is not None:
            registry[backend] = winner
    return registry


def _builtin(plugin: str) -> bool:
    return _dists.get(plugin, (None, None))[0] == CORE_DISTRIBUTION


def _settle(backend: str, infos: list[BackendInfo]) -> BackendInfo | None:
    """Who gets ``backend``: a built-in, the only claimant, or (two third parties) nobody."""
    builtins = [i for i in infos if _builtin(i.plugin)]
    others = [i for i in infos if not _builtin(i.plugin)]
    if len(infos) == 1 and not (others and backend in BUILTIN_NAMES):
        return infos[0]
    if others and (builtins or backend in BUILTIN_NAMES or len(others) > 1):
        others.sort(key=lambda i: (_dists.get(i.plugin, (None, None))[0] or "", i.plugin))
        meta = [_dists.get(i.plugin, (None, None)) for i in others]
        conflict = BackendConflict(backend, tuple(i.plugin for i in others), tuple(d for d, _ in meta),
                                   tuple(v for _, v in meta), reserved=bool(builtins) or backend in BUILTIN_NAMES)
        _conflicts.append(conflict)
        _log.info("kvxfer: %s", conflict.message)
    return builtins[0] if builtins else None


def registry() -> dict[str, BackendInfo]:
    global _registry
    with _lock:
        if _registry is None:
            _registry = _build_registry()
        return _registry


def reset_plugins() -> None:
    """Forget loaded plugins (tests use it after installing or blocking a plugin)."""
    global _pm, _registry
    with _lock:
        _pm = None
        _registry = None
        _broken.clear()
        _dists.clear()
        _conflicts.clear()


def broken_plugins() -> list[BrokenPlugin]:
    """Plugins skipped because they failed to import, validate or register."""
    registry()
    return list(_broken)


def backend_conflicts() -> list[BackendConflict]:
    """Backend names refused to some plugins, one entry per name, sorted by name."""
    registry()
    return list(_conflicts)


def available_backends() -> list[BackendStatus]:
    """Every backend found, whether it can run here, why not, and the install command."""
    out = []
    for info in registry().values():
        reason = info.unavailable_reason()
        dist, version = _dists.get(info.plugin, (None, None))
        out.append(BackendStatus(info.name, info.plugin, reason is None, reason, info.install, info.summary,
                                 dist, version))
    return sorted(out, key=lambda s: s.name)


def blocked_plugins() -> set[str]:
    """The plugin names ``KVXFER_BLOCK_PLUGINS`` hides."""
    return set(_split(os.environ.get(BLOCK_ENV, "")))


def get_backend_class(name: str) -> type[Backend]:
    reg = registry()
    conflict = next((c for c in _conflicts if c.name == name), None)
    if name not in reg and conflict is not None:
        raise BackendNameConflictError(conflict.message)
    if name not in reg and name in blocked_plugins():
        raise UnknownBackendError(f"backend {name!r} is blocked by {BLOCK_ENV}={os.environ.get(BLOCK_ENV, '')}; "
                                  f"remove {name} from it to use that backend")
    if name not in reg:
        known = ", ".join(sorted(reg)) or "none"
        blocked = os.environ.get(BLOCK_ENV)
        extra = f" ({BLOCK_ENV}={blocked})" if blocked else ""
        broken = "; ".join(f"{b.name}: {b.error}" for b in _broken)
        extra += f"; broken plugins (see `kvxfer backends`): {broken}" if broken else ""
        raise UnknownBackendError(f"no backend named {name!r}; installed backends: {known}{extra}")
    return reg[name].load()
