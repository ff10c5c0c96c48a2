"""Helpers shared by the UCX backend's tests (imported by name: this folder is on sys.path)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvxfer import DescriptorList
from kvxfer.testing.seam import finish

SENT = 0xAA
PATHS: dict[str, bool | None] = {"copy": None, "rma": False}  # same_host_copy option per path
PATH_NAMES = {"copy": "same-host-copy", "rma": "ucx-rma"}


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def descs(base: int, offsets: Any, sizes: Any) -> DescriptorList:
    o, s = np.asarray(offsets, dtype=np.uint64), np.asarray(sizes, dtype=np.uint64)
    return DescriptorList(np.stack([base + o, s, np.zeros_like(o)], 1))


def drive(*backends: Any, xfer: Any, owner: Any, timeout: float = 20.0) -> None:
    """Poll ``owner`` until ``xfer`` is done, progressing ``backends`` meanwhile; release it."""
    finish(owner, xfer, timeout, backends)
