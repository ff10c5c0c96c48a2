"""The wire toolkit for backends: parse a connection blob with the core's readers and rules.

A backend's blob arrives from the network like the core's own metadata, so it is read with
the same bounded cursor and the same text and integer rules (:mod:`kvxfer._wire` says which,
and why); a backend that writes its own reader re-opens the questions settled there.
"""

from __future__ import annotations

from .._wire import U32, U64, U64_MAX, Reader, b64, integer, keys, load_json, text

__all__ = ["Reader", "U32", "U64", "U64_MAX", "b64", "integer", "keys", "load_json", "text"]
