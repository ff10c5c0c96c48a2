"""Process identity and liveness, once for the core and every backend.

* :mod:`.identity`: who a process is (boot id, pid, start time, token, proof page), one wire
  encoding (:func:`encode`/:func:`decode`) and one fork hook (:func:`on_fork`);
* :mod:`.proof`: the page that proves a same-host peer is the process it names, and carries
  what that process registered and exported, in its own words;
* :mod:`.watch`: whether that process is still running (pidfd, falling back to ``/proc``);
* :mod:`.third`: the third-process check, that a peer's UCX worker address names no process
  of this host but the sender its header claims (the NIXL and UCX backends).

Backends use these through this package only; rationale in ``docs/design.md`` section 8.
"""

from __future__ import annotations

from .identity import IDENTITY, Identity, boot_id, decode, encode, on_fork, pid_namespace, start_time, stat
from .proof import (MAX_DIGESTS, MAX_SPANS, READ_TRIES, Page, ProofUnavailable, Proven, check_this_process, here,
                    holds, names_this_process, process_page, prove, read_memory, retry_pause)
from .watch import ProcessWatch, pidfd_getfd

__all__ = ["IDENTITY", "MAX_DIGESTS", "MAX_SPANS", "READ_TRIES", "Identity", "Page", "ProcessWatch",
           "ProofUnavailable", "Proven", "boot_id", "check_this_process", "decode", "encode", "here", "holds",
           "names_this_process", "on_fork", "pid_namespace", "pidfd_getfd", "process_page", "prove", "read_memory",
           "retry_pause", "start_time", "stat"]
