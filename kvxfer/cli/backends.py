"""``kvxfer backends``: every installed backend, whether it runs here, and what to install;
``--options NAME``: one backend's option table (default, effect, when to change it)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .args import add_json
from .output import emit_json
from ..table import Column, print_table

__all__ = ["add_parser", "backend_rows", "option_rows"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("backends", help="list installed backends, their capabilities and whether they run here",
                       description="List every backend the installed plugins offer, with its plugin, version "
                                   "and capabilities; say why one cannot run here and how to fix it. Plugins "
                                   "that fail to load are listed as broken, with their error. With --options "
                                   "NAME: every option of that backend (Agent(name, backend=NAME, **options)), "
                                   "its default, its effect and when to change it (docs/backends.md).")
    p.add_argument("--options", metavar="NAME", default=None, help="show the option table of backend NAME")
    add_json(p)
    p.set_defaults(fn=run)


def describe_capabilities(caps: Any) -> dict[str, Any]:
    return {
        "memory": sorted(k.value for k in caps.memory_kinds),
        "ops": sorted(o.value for o in caps.ops),
        "notifications": caps.notifications,
        "cross_process": caps.cross_process,
        "needs_progress": caps.needs_progress,
        "merges_runs": caps.merges_runs,
        "strided_lists": caps.strided_lists,
        "cheap_prepare": caps.cheap_prepare,
        "max_descriptors": caps.max_descriptors,
    }


def _short(caps: dict[str, Any] | None) -> str | None:
    if caps is None:
        return None
    words = ["+".join(caps["memory"]), "+".join(o.lower() for o in caps["ops"])]
    words += [w for w, on in (("notify", caps["notifications"]), ("cross-process", caps["cross_process"]),
                              ("needs-progress", caps["needs_progress"])) if on]
    return " ".join(words)


def backend_rows() -> list[dict[str, Any]]:
    """One dict per backend, then one per broken plugin; backends that can run are loaded."""
    from ..plugin.registry import available_backends, backend_conflicts, broken_plugins, registry

    rows: list[dict[str, Any]] = []
    for s in available_backends():
        caps = None
        status, reason = ("available", None) if s.available else ("unavailable", s.reason)
        if s.available:
            try:
                caps = describe_capabilities(registry()[s.name].load().capabilities)
            except Exception as exc:  # its module fails to import: say so, keep listing
                status, reason = "broken", f"{type(exc).__name__}: {exc}"
        rows.append({"backend": s.name, "plugin": s.plugin, "distribution": s.distribution, "version": s.version,
                     "status": status, "capabilities": caps, "summary": s.summary or None, "reason": reason,
                     "install": s.install if status != "available" else None})
    for b in broken_plugins():
        rows.append({"backend": None, "plugin": b.name, "distribution": b.distribution, "version": b.version,
                     "status": "broken", "capabilities": None, "summary": None,
                     "reason": f"failed to load ({b.stage}): {b.error}", "install": None})
    for c in backend_conflicts():  # one row per refused name, naming every refused claimant
        rows.append({"backend": c.name, "plugin": ", ".join(c.plugins),
                     "distribution": ", ".join(d or "-" for d in c.distributions),
                     "version": ", ".join(v or "-" for v in c.versions),
                     "status": "refused" if c.reserved else "conflict", "capabilities": None, "summary": None,
                     "reason": c.message, "short": c.short, "install": None})
    return rows


def option_rows(name: str) -> list[dict[str, Any]]:
    """The option table backend ``name`` registered; options its class takes without a row are
    listed too (loaded only if its requirements are installed), marked undocumented."""
    from ..errors import UnknownBackendError
    from ..plugin.backend import backend_options
    from ..plugin.registry import registry

    info = registry().get(name)
    if info is None:
        raise UnknownBackendError(f"no backend {name!r}; `kvxfer backends` lists them")
    rows = [{"option": o.name, "default": o.default, "effect": o.effect, "when": o.when} for o in info.options]
    if info.unavailable_reason() is None:
        try:
            named, _ = backend_options(info.load())
        except Exception:  # its module fails to import: the registered table is all there is
            named = ()
        listed = {o.name for o in info.options}
        rows += [{"option": n, "default": None, "effect": "undocumented: its plugin lists no row for it",
                  "when": None} for n in named if n not in listed]
    return rows


def _show_options(args: argparse.Namespace) -> int:
    from ..errors import KvxferError

    try:
        rows = option_rows(args.options)
    except KvxferError as exc:
        print(f"kvxfer backends: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        emit_json(rows)
        return 0
    if not rows:
        print(f"backend {args.options!r} takes no options")
        return 0
    print_table(rows, [Column("option"), Column("default"), Column("effect"), Column("when", "when to change it")],
                title=f"options of backend {args.options!r}: Agent(name, backend={args.options!r}, **options)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.options is not None:
        return _show_options(args)
    import logging
    import warnings

    from ..plugin.registry import PluginWarning

    # The table lists broken plugins and conflicts itself: no warning text on top of it.
    log = logging.getLogger("kvxfer.plugin")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PluginWarning)
            rows = backend_rows()
    finally:
        log.setLevel(level)
    if args.json:
        emit_json(rows)
        return 0
    for r in rows:
        if "short" in r:  # a refused name: who was refused, on one line
            r["detail"] = r["short"]
        elif r["status"] == "available":
            r["detail"] = r["summary"]
        else:
            r["detail"] = f"{r['reason']}" + (f"; install: {r['install']}" if r["install"] else "")
        r["caps"] = _short(r["capabilities"])
    print_table(rows, [Column("backend"), Column("plugin"), Column("version"), Column("status"),
                       Column("caps", "capabilities"), Column("detail")])
    return 0
