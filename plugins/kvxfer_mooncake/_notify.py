"""Notifications on Mooncake's own: a batch call's ``TransferNotify``, read with ``get_notifies``.

Mooncake sends a batch's notification after the batch completed (so never before its data)
as a ``(name, msg)`` pair of strings, to whoever the session names; the receiver learns the
sender's claimed name and nothing else. Its ports authenticate nobody (the agent runs only with
``trusted_network=True``), so what arrives is bounded and checked here, and a malformed one is
dropped, never raised into the receiver. Messages travel as base64 text: the binding takes and
returns ``str``, and kvxfer's notifications are bytes.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections import defaultdict
from typing import Any

from kvxfer import UnsupportedError

__all__ = ["MAX_NOTIFICATION", "MAX_NAME", "check_size", "decode", "encode"]

#: Larger payloads belong in KV memory (as for the other backends).
MAX_NOTIFICATION = 64 << 10
MAX_NAME = 256
_log = logging.getLogger("kvxfer.mooncake")


def check_size(message: bytes) -> None:
    if len(message) > MAX_NOTIFICATION:
        raise UnsupportedError(f"mooncake notifications are limited to {MAX_NOTIFICATION} bytes")


def encode(message: bytes) -> str:
    return base64.b64encode(message).decode("ascii")


def decode(notes: list[Any]) -> dict[str, list[bytes]]:
    """``get_notifies``' pairs as ``{sender: [message, ...]}``, in arrival order; the malformed
    (not strings, a name empty or over ``MAX_NAME``, a message not base64 or over the bound)
    are dropped and counted in one warning."""
    out: dict[str, list[bytes]] = defaultdict(list)
    dropped = 0
    for n in notes:
        name, msg = getattr(n, "name", None), getattr(n, "msg", None)
        if (not isinstance(name, str) or not isinstance(msg, str) or not 0 < len(name) <= MAX_NAME
                or len(msg) > 4 * ((MAX_NOTIFICATION + 2) // 3)):
            dropped += 1
            continue
        try:
            data = base64.b64decode(msg.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError):
            dropped += 1
            continue
        out[name].append(data)
    if dropped:
        _log.warning("mooncake: dropped %d malformed notification(s) (the port is unauthenticated)", dropped)
    return dict(out)
