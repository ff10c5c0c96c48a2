"""The hooks a kvxfer plugin may implement.

A plugin is a module with functions decorated by :data:`kvxfer.hookimpl`, named in the
``kvxfer`` entry-point group of its distribution::

    [project.entry-points.kvxfer]
    mybackend = "kvxfer_mybackend"

Backends are registered through a callback rather than returned, so one plugin can offer
several backends and registration stays explicit. After registration the core calls backend
objects directly: a hook dispatch per post or per poll would cost more than the transfer.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("kvxfer")
hookimpl = pluggy.HookimplMarker("kvxfer")


@hookspec
def kvxfer_register_backends(register: Callable[..., None]) -> None:
    """Register backends by calling ``register(name, factory, *, requires=(), install=None,
    summary="", check=None)``.

    ``factory`` is a :class:`kvxfer.Backend` subclass or a ``"module:attribute"`` string
    imported only when the backend is first used, so that listing backends never imports a
    transport library. ``requires`` names modules that must be importable; ``install`` is the
    exact command that makes them so; ``check`` is an optional callable returning ``None``
    when the backend can run here, or a reason why not.
    """


@hookspec
def kvxfer_agent_created(agent: Any) -> None:
    """Called after an :class:`kvxfer.Agent` is constructed (for tracing and metrics)."""
