"""The JSON-lines codec for plugin tests and kvxfer's harness: a face of :mod:`kvxfer._childproc.lines`.

Tests that drive a peer in another process import it from here; the codec itself lives with
the frames codec in :mod:`kvxfer._childproc`, the one home of child-process protocols.
"""

from __future__ import annotations

from .._childproc.lines import Channel, Inbox, say, serve

__all__ = ["Channel", "Inbox", "say", "serve"]
