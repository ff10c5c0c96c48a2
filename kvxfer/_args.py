"""Argument checks that :class:`~kvxfer.agent.Agent` and :class:`~kvxfer.owner.Owner` share.

Both take the same notify bytes, notification messages and peer names from callers; checked
here, the rule and the typed error (:class:`~kvxfer.errors.InvalidArgumentError`) are one,
wherever the caller enters. Timeouts have their own home, :mod:`kvxfer.deadlines`.
"""

from __future__ import annotations

from .deadlines import check_timeout
from .errors import InvalidArgumentError

__all__ = ["notify_bytes", "message_bytes", "peer_key", "timeout_or"]


def notify_bytes(notify: object) -> bytes | None:
    """A transfer's notification: None or bytes (``bytes(5)`` would be five zero bytes)."""
    if notify is None:
        return None
    if not isinstance(notify, (bytes, bytearray)):
        raise InvalidArgumentError(f"notify must be bytes (notify=b\"req-17\"), got {type(notify).__name__}")
    return bytes(notify)


def message_bytes(message: object) -> bytes:
    """A notification sent on its own: bytes."""
    if not isinstance(message, (bytes, bytearray)):
        raise InvalidArgumentError(f"a notification is bytes (b\"req-17\"), got {type(message).__name__}")
    return bytes(message)


def peer_key(key: object) -> str:
    """A peer's name (or an owner's route key): a string, checked before it reaches a dict."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"a peer is named by a string (a route's key or a peer's name), "
                                   f"got {type(key).__name__}")
    return key


def timeout_or(default: float, timeout: object) -> float:
    """``timeout`` checked (:func:`~kvxfer.deadlines.check_timeout`), or ``default`` when None."""
    return default if timeout is None else check_timeout(timeout)
