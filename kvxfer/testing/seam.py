"""Two backends of one process joined at the seam, and a post driven to its end: the setup of
every backend test below the Agent, written once for the core's and the plugins' tests."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, TypeVar

import numpy as np

from ..memory import Allocation
from ..plugin import Backend
from .wait import wait_until

__all__ = ["finish", "joined"]

B = TypeVar("B", bound=Backend)


@contextmanager
def joined(a: B, b: B, src: np.ndarray, dst: np.ndarray, *, add: bool = True) -> Iterator[tuple[B, B]]:
    """``a`` registers ``src`` and ``b`` registers ``dst`` (DRAM); with ``add`` each then adds
    the other under its agent name. Both are closed on the way out, a test's failure included."""
    try:
        a.register([Allocation(src.ctypes.data, src.nbytes)])
        b.register([Allocation(dst.ctypes.data, dst.nbytes)])
        if add:
            b.add_remote(a.agent_name, a.local_metadata())
            a.add_remote(b.agent_name, b.local_metadata())
        yield a, b
    finally:
        b.close()
        a.close()


def finish(owner: Backend, xfer: Any, timeout: float = 30.0, progress: tuple[Backend, ...] = ()) -> None:
    """Poll ``owner`` until ``xfer`` is done (progressing ``progress`` between polls: a target
    whose transport moves only when driven), then release it; fail after ``timeout``."""

    def done() -> bool:
        for b in progress:
            b.progress()
        return bool(owner.poll(xfer))

    wait_until(done, timeout=timeout, what="the transfer", interval=0)
    owner.release(xfer)
