"""The hooks a kvxfer plugin may implement.

A plugin is a module (or any object) with functions decorated by :data:`kvxfer.hookimpl`,
named in the ``kvxfer`` entry-point group of its distribution::

    [project.entry-points.kvxfer]
    mybackend = "kvxfer_mybackend"

Backends are registered through a callback rather than returned, so one plugin can offer
several backends and registration stays explicit. After registration the core calls backend
objects directly: a hook dispatch per post or per poll would cost more than the transfer.
Observers (:func:`kvxfer_transfer_finished`) are called once per transfer, and only when one
is registered. An implementation may take any subset of a hook's arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

import pluggy

from .._stats import Status, TransferStats

if TYPE_CHECKING:
    from .backend import Backend, Option
    from .doctor import Check

__all__ = ["hookspec", "hookimpl", "RegisterBackend", "ObservedAgent", "ObservedTransfer"]

hookspec = pluggy.HookspecMarker("kvxfer")
hookimpl = pluggy.HookimplMarker("kvxfer")


class RegisterBackend(Protocol):
    """The ``register`` callback handed to :func:`kvxfer_register_backends`."""

    def __call__(self, name: str, factory: "type[Backend] | str", *, requires: Iterable[str] = (),
                 install: str | None = None, summary: str = "",
                 check: Callable[[], str | None] | None = None, options: "Sequence[Option]" = ()) -> None: ...


class ObservedAgent(Protocol):
    """What the seam promises an observer of the :class:`kvxfer.Agent` it is handed.

    The object is the agent itself; naming only this much keeps the seam below the agent, so a
    plugin's hooks never import the transfer machinery to be typed.
    """

    @property
    def name(self) -> str: ...


class ObservedTransfer(Protocol):
    """What the seam promises an observer of a finished :class:`kvxfer.Transfer` (the transfer itself)."""

    @property
    def status(self) -> Status: ...
    @property
    def error(self) -> BaseException | None: ...
    @property
    def stats(self) -> TransferStats: ...


@hookspec
def kvxfer_register_backends(register: RegisterBackend) -> None:
    """Register backends by calling ``register(name, factory, *, requires=(), install=None,
    summary="", check=None, options=())``.

    ``factory`` is a :class:`kvxfer.Backend` subclass or a ``"module:attribute"`` string
    imported only when the backend is first used, so that listing backends never imports a
    transport library. ``requires`` names modules that must be importable; ``install`` is the
    exact command that makes them so; ``check`` is an optional callable returning ``None``
    when the backend can run here, or a reason why not. ``options`` is the backend's option
    table (:class:`kvxfer.plugin.Option` rows, one per keyword its class takes), shown by
    ``kvxfer backends --options NAME``.
    """


@hookspec
def kvxfer_doctor_checks(gpus: int) -> "list[Check]":
    """This plugin's rows of ``kvxfer doctor``: whether its transport library loads and what it
    offers here (``gpus``: the GPUs doctor sees), each problem with a fix.

    Return :class:`kvxfer.plugin.doctor.Check` rows; probe a library in a child process
    (:func:`kvxfer.plugin.doctor.probe`), never in doctor's own, and import it only inside
    the hook, so that loading plugins stays fast.
    """


@hookspec
def kvxfer_agent_created(agent: ObservedAgent) -> None:
    """Called after an :class:`kvxfer.Agent` is constructed (for tracing and metrics)."""


@hookspec
def kvxfer_transfer_finished(agent: ObservedAgent, transfer: ObservedTransfer, stats: TransferStats) -> None:
    """Called once when a transfer leaves flight: done, failed or cancelled.

    ``transfer.status`` and ``transfer.error`` say how it ended; ``stats`` holds descriptors,
    bytes, plan/post/completion seconds, backend, path and the backend's own telemetry. It
    runs in the thread that observed the end (the one polling the transfer), so keep it
    short; an exception here is logged and never reaches the transfer's owner.
    """
