"""The data-path shape: how one way of moving bytes plugs into a backend's ``post``.

A backend often has more than one way to move a pair of lists: NIXL's prepared lists or the
core's same-host device path (:class:`kvxfer.cuda.DevicePath`); UCX's RMA or its same-host
copy. Each is a :class:`DataPath`, and a backend keeps them in a table, most specific first:
``post`` takes the first path that :meth:`~DataPath.serves` the pair (:func:`choose`), and
``poll``/``release``/``data_path`` hand the path's own handle back to it. So adding a path,
the device path included, is one more row, and no backend asks a list what it is.

A path that can block on its own completion (the device path's CUDA event) may also offer
``wait(h, deadline) -> bool`` (True once done, False or :class:`~kvxfer.errors.TransferTimeoutError`
at the deadline, with the path fenced); :class:`~kvxfer.plugin.PathBackend` hands
:meth:`~kvxfer.plugin.backend.Backend.wait` to it. It is optional, so it is not in the protocol.

The backend keeps everything else: validation, the peer's state, and the notification for
paths that do not send it themselves (``sends_notification = False``: it goes out once the
path reports every byte in place, so it never overtakes its data).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import BackendError
from ..memory import Op

__all__ = ["DataPath", "choose"]


class DataPath(Protocol):
    """One way of moving ``local[li[i]] <-> remote[ri[i]]``; ``h`` is what :meth:`start` returned."""

    #: True when the path delivers the notification itself, after the data (NIXL's does).
    sends_notification: bool

    def serves(self, local: Any, remote: Any) -> bool:
        """Whether this path can move between these two prepared lists (the remote one names its peer)."""
        ...

    def start(self, op: Op, local: Any, li: np.ndarray, remote: Any, ri: np.ndarray, peer: str,
              notification: bytes | None) -> Any:
        """Start the transfer; returns the path's handle. Raises a typed error, or nothing."""
        ...

    def poll(self, h: Any) -> bool:
        """One non-blocking step: True once every byte is in place; raises the path's error."""
        ...

    def cancel(self, h: Any) -> None:
        """Stop: once this returns, the path no longer touches either side's memory."""
        ...

    def kind(self, h: Any) -> str:
        """The name of the path taken, for :attr:`kvxfer.TransferStats.path`."""
        ...


def choose(paths: Sequence[DataPath], local: Any, remote: Any) -> DataPath:
    """The first path of ``paths`` that serves the pair; :class:`BackendError` if none does."""
    for path in paths:
        if path.serves(local, remote):
            return path
    raise BackendError("no data path of this backend serves these lists (released, or empty?)")
