"""An agent driven only through an :class:`~kvxfer.owner.Owner`: the conformance kit's owner variant.

The kit's cases call an agent's methods; this stand-in runs each of them on the owner's
thread (``Owner.call``) and turns ``read``/``write`` into submissions, so the same cases
check, byte for byte, that transfers posted and completed by the owner are right.
"""

from __future__ import annotations

from typing import Any

from ..agent import Agent
from ..owned import OwnedTransfer
from ..owner import Owner

__all__ = ["OwnedAgent"]


class OwnedAgent:
    """``Agent``'s interface, every call made on the owner's thread."""

    def __init__(self, agent: Agent, **owner_options: Any) -> None:
        self.owner = Owner(agent, **owner_options)
        self.name = agent.name

    def __enter__(self) -> "OwnedAgent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, peer: str, local_blocks: Any, remote_blocks: Any, notify: bytes | None = None) -> OwnedTransfer:
        # Agent.read raises planning errors itself and returns a posted transfer: so does this.
        return self.owner.read(peer, local_blocks, remote_blocks, notify).wait_posted()

    def write(self, peer: str, local_blocks: Any, remote_blocks: Any, notify: bytes | None = None) -> OwnedTransfer:
        return self.owner.write(peer, local_blocks, remote_blocks, notify).wait_posted()

    def add_peer(self, metadata: bytes, *, timeout: float | None = None) -> str:
        return self.owner.add_peer(metadata, timeout=timeout).result()

    def close(self) -> None:
        self.owner.close()

    def __getattr__(self, name: str) -> Any:
        value = self.owner.call(lambda a: getattr(a, name)).result()
        if callable(value) and getattr(value, "__self__", None) is self.owner.agent:
            return lambda *args, **kw: self.owner.call(lambda _a: value(*args, **kw)).result()
        return value
