"""The Mooncake backend's option table: every keyword of ``MooncakeBackend``, its default, effect, and when to change it.

Plain data (imports neither Mooncake nor the backend), registered with the backend so that
``kvxfer backends --options mooncake`` shows it where Mooncake is not installed;
docs/backends.md shows the same rows (``tests/test_backend_options.py`` keeps them in step).
"""

from __future__ import annotations

from kvxfer.plugin import Option

__all__ = ["OPTIONS"]

OPTIONS = (
    Option("trusted_network", "False",
           "must be True: Mooncake's TCP listeners bind every interface and authenticate nobody, so whoever "
           "reaches the port can read and write the registered memory",
           "True only where everyone who can reach this host is trusted (plugins/kvxfer_mooncake/README.md)"),
    Option("host", '"127.0.0.1"', "the address this engine names itself by in its session id",
           "this host's address on the network the peers share, for peers on other hosts"),
    Option("progress_timeout", "5.0",
           "seconds Mooncake gives a batch call with a silent peer before it fails (MC_TCP_PROGRESS_TIMEOUT_SEC, "
           "whole seconds); a timed-out or cancelled transfer does not wait for it, so it bounds how long a stopped "
           "peer holds a worker thread (and close)",
           "lower it where peers often stall (each stalled call holds a worker this long); raise it on links slower "
           "than a few seconds per batch"),
    Option("workers", "2", "threads that run Mooncake's synchronous batch calls (each releases the GIL)",
           "more for many concurrent transfers on a machine with cores to spare (1 to 64)"),
)
