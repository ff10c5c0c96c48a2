"""Same-host identity for backends: who sent a blob, and the proof that it is that process.

A blob is bytes from the network; the process it names may be forged. A backend puts
:func:`here` (encoded with :func:`encode`) in its blob and publishes what it registered on
this process's proof page (:func:`process_page`); a receiver decodes the claim
(:func:`decode`, typed) and, when it names this host (``Identity.same_host``), proves it with
:func:`prove`: the named process must hold the secret behind the token, and the memory the
blob advertises must lie inside what that process published (``Proven.covers``). What a
transport's address names (a UCX worker address, a Mooncake session's port) is the
backend's own check, helped by :mod:`third` (which processes of this host a UCX worker
address reaches). A peer that must be this very process is checked with
:func:`check_this_process`; whether a peer process still runs, with :class:`ProcessWatch`.
The machinery lives in :mod:`kvxfer.peers` (rationale: docs/design.md section 8); this module
is the part of it a plugin may use.
"""

from __future__ import annotations

from ..peers import (IDENTITY, READ_TRIES, Identity, Page, ProcessWatch, ProofUnavailable, Proven, check_this_process,
                     decode, encode, here, holds, names_this_process, on_fork, process_page, prove, read_memory,
                     retry_pause, third)

__all__ = ["IDENTITY", "READ_TRIES", "Identity", "Page", "ProcessWatch", "ProofUnavailable", "Proven",
           "check_this_process", "decode", "encode", "here", "holds", "names_this_process", "on_fork", "process_page",
           "prove", "read_memory", "retry_pause", "third"]
