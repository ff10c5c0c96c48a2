"""Same-host identity for backends: who sent a blob, and the proof that it is that process.

A blob is bytes from the network; the process it names may be forged. A backend puts
:func:`here` (encoded with :func:`encode`) in its blob and publishes what it registered on
this process's proof page (:func:`process_page`); a receiver decodes the claim
(:func:`decode`, typed) and, when it names this host (``Identity.same_host``), proves it with
:func:`prove`: the named process must hold the secret behind the token, and the memory the
blob advertises must lie inside what that process published (``Proven.covers``). What a
transport's address names (a UCX worker address, a Mooncake session's port) is the
backend's own check. The machinery lives in :mod:`kvxfer.peers` (rationale: docs/design.md
section 8); this module is the part of it a plugin may use.
"""

from __future__ import annotations

from ..peers import (IDENTITY, Identity, ProofUnavailable, Proven, decode, encode, here, names_this_process, on_fork,
                     process_page, prove)

__all__ = ["IDENTITY", "Identity", "ProofUnavailable", "Proven", "decode", "encode", "here", "names_this_process",
           "on_fork", "process_page", "prove"]
