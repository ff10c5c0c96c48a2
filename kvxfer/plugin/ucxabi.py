"""What a UCX-based backend reads of UCX's own internals (:mod:`kvxfer.ucxabi`, their one home).

:mod:`~kvxfer.ucxabi.address` reads a packed worker address (:class:`Here` is this process
as its own addresses show it); :mod:`~kvxfer.ucxabi.mmqueue` watches the shared-memory
receive queue for a slot a killed writer left half-written (:class:`SlotWatch`). The UCX
releases each layout was checked against, and the upgrade test, stay in the core.
"""

from __future__ import annotations

from ..ucxabi import address, mmqueue
from ..ucxabi.address import Here
from ..ucxabi.mmqueue import SlotWatch

__all__ = ["Here", "SlotWatch", "address", "mmqueue"]
