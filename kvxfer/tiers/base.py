"""The protocol every tier implements (:class:`kvxfer.Store` and :class:`~.mooncake.MooncakeTier`).

Callers (an agent, a connector's prefix store) hold a :class:`Tier` and never ask which one
it is: rows go in and out by opaque key, a key not held is a typed
:class:`~kvxfer.errors.StoreMissError` (a damaged row its subclass
:class:`~kvxfer.errors.StoreCorruptError`), and transfers are :class:`~kvxfer.Transfer`
objects bounded by a deadline.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ..transfer import Transfer

__all__ = ["Tier"]


@runtime_checkable
class Tier(Protocol):
    """Whole rows of a local KV cache, offloaded and restored by key."""

    def offload(self, spec: Any, local_blocks: Any, keys: Sequence[bytes], *,
                timeout: float | None = None) -> Transfer:
        """Write ``local_blocks[i]`` under ``keys[i]``; visible once the transfer is DONE."""
        ...

    def restore(self, keys: Sequence[bytes], spec: Any, local_blocks: Any, *,
                timeout: float | None = None) -> Transfer:
        """Read ``keys[i]`` into ``local_blocks[i]``, each row checked before it is copied."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        """A bool per key: held now (a hint: it may be gone before a restore)."""
        ...

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are held."""
        ...

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drop keys; returns how many were dropped."""
        ...

    def close(self) -> None:
        ...
