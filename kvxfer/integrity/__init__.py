"""Row digests and verified transfers: catch bytes that arrive wrong, or the right layout over
the wrong data (docs/integrity.md says why each choice).

A digest is computed per **cell**: a byte range ``(member, offset, length)`` of one block's
member page. By default every member page is one cell, so a digest names a block and a
member and does not depend on where the page lives: a packed row, a per-layer region, DRAM
or VRAM all give the same value for the same logical bytes. A heterogeneous read (another TP
size or block size) moves byte ranges of pages; the destination names those ranges with
:func:`cells_for` and the source digests exactly them.

``Agent.digest(blocks)`` computes a source's :class:`Digests`; ``Agent.read(..., expect=d)``
(or ``Agent(verify=True)`` with ``expect``) verifies after DONE and raises
:class:`~kvxfer.errors.IntegrityError` naming the block and member on a mismatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .cells import Cells, CellSpans, cells_for, gather_cells, local_spans, source_spans
from .digests import ALGORITHMS, Digests, compute, verify
from .verified import check_received

if TYPE_CHECKING:
    import numpy as np

__all__ = ["ALGORITHMS", "Cells", "Digests", "CellSpans", "cells_for", "check_received", "compute", "gather_cells",
           "gpu_product", "local_spans", "set_mm8_kernel", "source_spans", "verify"]


def gpu_product() -> str | None:
    """Which exact int8 product the GPU mm8 digest settled on here (None before one ran), for benchmarks."""
    from . import _gpu

    return _gpu.PRODUCT[0] if _gpu.PRODUCT else None


def set_mm8_kernel(fn: Callable[[np.ndarray, np.ndarray, list[int]], np.ndarray | None] | None) -> None:
    """Let VRAM ``mm8`` digests run through ``fn`` (the device path's one-pass kernel registers
    itself when it loads; ``fn`` returns None where it cannot serve, and the torch ops then do)."""
    from . import _gpu

    _gpu.KERNEL[0] = fn
