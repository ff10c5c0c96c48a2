"""Proving a peer's bytes on native code in a helper process, for a backend (:mod:`kvxfer.prove`).

A backend that hands a peer's bytes to a library that trusts them (connection info, remote
keys) proves them first in a helper that runs the same call: :func:`shared` gives the
process's prover for a target, :func:`named`/:func:`unnamed` describe what is proven in
errors, and :func:`backend_probe` is the helper side's entry point for ``kvxfer doctor``.
The machinery and its rationale live in :mod:`kvxfer.prove`; this is the part a plugin uses.
"""

from __future__ import annotations

from ..prove import Prover, backend_probe, named, shared, unnamed

__all__ = ["Prover", "backend_probe", "named", "shared", "unnamed"]
