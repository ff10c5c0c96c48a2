"""What a transfer ended as and what it cost: plain values, below the agent, the plugin seam and observers.

Observers (:mod:`kvxfer.observe`, the plugin hooks) read these without importing the transfer
machinery, so the seam's type hints do not tie it back to the agent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["Status", "TransferStats"]


class Status(str, enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


@dataclass(slots=True)  # slots: built once per transfer, on the hot path (kvxfer._hot)
class TransferStats:
    """What a transfer cost: descriptors posted, bytes, backend posts and wall seconds.

    ``plan_seconds``: planning and list preparation; ``post_seconds``: handing the posts to
    the backend; ``seconds``: from the first post until DONE was observed. ``mode`` is the
    plan's shape (``whole-row``, ``split``...). ``path`` names the data path the backend chose
    (e.g. ``"cuda-ipc"`` or its transport's name), so a silent fallback shows up in stats
    instead of only as a slower number. ``telemetry`` holds what the backend reports per post
    (:meth:`kvxfer.Backend.telemetry`), or None when it reports nothing.
    """

    descriptors: int
    nbytes: int
    posts: int
    plan_seconds: float
    seconds: float | None = None  # from the first post until DONE was observed
    path: str | None = None
    post_seconds: float = 0.0
    backend: str = ""
    op: str = ""
    peer: str = ""
    mode: str = ""
    telemetry: list[dict[str, Any]] | None = None
    wall_seconds: float | None = None  # a group's: from the call until DONE was observed

    def __str__(self) -> str:
        """One line for people (``print(t.stats)``); ``repr`` keeps every field."""
        who = " ".join(w for w in (self.op, f"with {self.peer!r}" if self.peer else "") if w) or "transfer"
        took = "pending" if self.seconds is None else f"{self.seconds * 1e3:.3f} ms"
        rate = f" ({self.gbps:.2f} GB/s)" if self.gbps else ""
        how = ", ".join(w for w in (self.mode, f"path {self.path}" if self.path else "",
                                    f"backend {self.backend}" if self.backend else "") if w)
        return (f"{who}: {self.descriptors:,} descriptors, {self.nbytes:,} bytes in {self.posts} "
                f"post{'s' if self.posts != 1 else ''}, {took}{rate}; plan {self.plan_seconds * 1e3:.3f} ms"
                + (f"; {how}" if how else ""))

    @property
    def gbps(self) -> float | None:
        if not self.seconds:
            return None
        return self.nbytes / self.seconds / 1e9

    @property
    def completion_seconds(self) -> float | None:
        """Time from the last post until DONE was observed."""
        return None if self.seconds is None else max(0.0, self.seconds - self.post_seconds)
