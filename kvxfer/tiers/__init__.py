"""Tiers: where whole KV rows go beyond GPU memory, behind one protocol.

:class:`Tier` is what an engine or connector needs of a place to offload rows to and restore
them from, by opaque key: :class:`kvxfer.Store` (one machine's slab file) is one, and
:class:`MooncakeTier` (a Mooncake Store cluster, :mod:`.mooncake`) is the other. Both return
:class:`kvxfer.Transfer` objects, so deadlines and cancellation behave as for a peer
transfer; :class:`MooncakeLookup` answers lookups for a process that holds no cache (a
scheduler). Importing this package imports no Mooncake code: the client library is loaded
when a :class:`MooncakeTier` is created. docs/storage.md describes the cluster tier.
"""

from __future__ import annotations

from ._client import parse_master
from .base import Tier
from .lookup import MooncakeLookup
from .mooncake import MooncakeTier

__all__ = ["Tier", "MooncakeTier", "MooncakeLookup", "parse_master"]
