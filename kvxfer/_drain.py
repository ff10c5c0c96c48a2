"""How an :class:`~kvxfer.owner.Owner` ends what it holds without posting it: queued transfers
past their deadline, and everything at close. Both run on the owner's loop thread; they are
kept apart from the loop so that ``kvxfer/owner.py`` holds the loop and its admission only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .errors import AgentClosedError, TransferTimeoutError
from .transfer import Status

__all__ = ["expire_queued", "shutdown"]

log = logging.getLogger("kvxfer.owner")


def expire_queued(owner: Any, now: float) -> None:
    """Fail, typed, each queued transfer whose deadline passed before it could be posted."""
    if owner._held == len(owner._inflight):  # nothing queued (the common case): nothing to expire
        return
    for route in list(owner._routes.values()):
        if route.queue and now >= min(t.deadline for t in route.queue):
            for t in [t for t in route.queue if now >= t.deadline]:
                route.queue.remove(t)
                what = "metadata of" if not route.ready else "its turn to post to"
                owner._end(t, TransferTimeoutError(
                    f"{t.op.value} from {route.key!r} waited {t.timeout:g} s for the {what} the peer; "
                    "nothing was posted"))


def shutdown(owner: Any) -> None:
    """Everything held ends DONE or typed; then the agent closes (see :meth:`kvxfer.owner.Owner.close`)."""
    with owner._lock:
        ops = list(owner._inbox)
        owner._inbox.clear()
    for op in ops:
        if op[0] == "transfer":
            owner._routes[op[1].route].queue.append(op[1])
        elif op[0] == "call" or op[0] in ("connect", "refresh"):
            op[2]._finish(Status.FAILED, None, AgentClosedError("the owner closed before running this"))
        elif op[0] == "cancel":
            owner._cancel_now(op[1])
    closed = AgentClosedError(f"the owner of agent {owner.agent.name!r} closed before this was posted")
    for route in list(owner._routes.values()):
        while route.queue:
            owner._end(route.queue.popleft(), closed)
        for w in route.waiters:
            w._finish(Status.FAILED, None, closed)
        route.waiters.clear()
    while owner._inflight and time.monotonic() < owner._drain_until:
        if not owner._poll(time.monotonic()):
            time.sleep(50e-6)
    for t in list(owner._inflight):
        owner._cancel_now(t)
    if owner._close_agent:
        try:
            owner.agent.close()
        except Exception:
            log.exception("kvxfer: closing agent %r failed", owner.agent.name)
