"""NIXL's exceptions, translated into the kvxfer errors a caller can act on.

Every call into NIXL goes through :func:`map_error` on failure, so no NIXL (or pybind)
exception type ever leaves the backend: a caller catches :class:`~kvxfer.KvxferError`
subclasses only, each chosen by what the caller should do next.
"""

from __future__ import annotations

import nixl._bindings as _nb
from kvxfer.errors import (
    BackendError,
    KvxferError,
    PeerDisconnectedError,
    StalePeerError,
    TransferCancelledError,
    UnsupportedError,
)

__all__ = ["map_error"]


def map_error(exc: BaseException, action: str, peer: str | None = None) -> KvxferError:
    """The kvxfer error for ``exc``, raised while doing ``action`` (with ``peer``, if any)."""
    if isinstance(exc, KvxferError):
        return exc
    who = f" peer {peer!r}" if peer else ""
    detail = f"{type(exc).__name__}: {exc}"
    err: KvxferError
    if isinstance(exc, _nb.nixlRemoteDisconnectError):
        err = PeerDisconnectedError(f"{action}:{who or ' the peer'} disconnected ({detail}); "
                                    "add it again once it is back")
    elif isinstance(exc, (_nb.nixlNotFoundError, _nb.nixlNotAllowedError)) and peer:
        err = StalePeerError(f"{action}: NIXL no longer accepts{who} or lists prepared for it ({detail}); "
                             "the peer was removed or restarted: add it again from fresh metadata")
    elif isinstance(exc, _nb.nixlNotSupportedError):
        err = UnsupportedError(f"{action}: not supported by the NIXL backends in use ({detail})")
    elif isinstance(exc, _nb.nixlCancelledError):
        err = TransferCancelledError(f"{action}: cancelled inside NIXL ({detail})")
    elif isinstance(exc, (_nb.nixlInvalidParamError, _nb.nixlMismatchError)):
        err = BackendError(f"{action}: NIXL rejected the request ({detail}); descriptors must lie in registered "
                           "memory of the stated kind, with equal lengths on both sides")
    else:
        err = BackendError(f"{action}: NIXL failed ({detail})")
    err.__cause__ = exc
    return err
