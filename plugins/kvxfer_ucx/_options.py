"""The UCX backend's option table: every keyword of ``UcxBackend``, its default, effect, and when to change it.

Plain data (loads no UCX), registered with the backend for ``kvxfer backends --options ucx``;
docs/backends.md shows the same rows (``tests/test_backend_options.py`` keeps them in step).
What each option exposes: ``plugins/kvxfer_ucx/README.md``.
"""

from __future__ import annotations

from kvxfer.plugin import Option

__all__ = ["OPTIONS"]

OPTIONS = (
    Option("same_host_copy", "None",
           "None: peers proven to run on this host get the process_vm_readv path, others UCX RMA; True: a "
           "same-host peer that fails the proof is an error; False: never",
           "True to insist on the copy path; False where ptrace is forbidden"),
    Option("trusted_network", "False",
           "False: UCX uses same-host transports only (self,posix); True adds TCP, reachable from the network",
           "True only on a network where every host may read this agent's registered memory"),
    Option("tls", "None", "UCX_TLS for this agent (default: by trusted_network)", "to pin transports"),
    Option("ucx_config", "None", "extra UCX settings, keys without the UCX_ prefix", "UCX tuning"),
    Option("copy_chunk", "8388608", "most bytes one same-host syscall moves: the granularity of budgets "
           "and cancellation", "smaller for faster cancellation, larger for fewer syscalls"),
    Option("poll_budget", "0.005", "seconds one poll may spend moving bytes before it returns",
           "smaller when the polling thread must stay responsive"),
    Option("cancel_timeout", "2.0", "longest a release drives still-pending RMA before giving up on it",
           "longer over slow links"),
    Option("prove_metadata", '"auto"',
           "load an unauthenticated peer's blob (token=NO_AUTH) in a helper process first; True proves "
           "signed blobs too, False none; starting the helper costs a few seconds once, logged at INFO "
           "by kvxfer.prove with the seconds it took", "as for nixl"),
    Option("prove_timeout", "30.0", "seconds of CPU time the helper may spend on one blob",
           "raise it on a heavily loaded machine"),
)
