"""The NIXL backend's option table: every keyword of ``NixlBackend``, its default, effect, and when to change it.

Plain data (imports neither NIXL nor the backend), registered with the backend so that
``kvxfer backends --options nixl`` shows it where NIXL is not installed; docs/backends.md
shows the same rows (``tests/test_backend_options.py`` keeps the three in step).
"""

from __future__ import annotations

from kvxfer.plugin import Option

__all__ = ["OPTIONS"]

OPTIONS = (
    Option("background_progress", "True",
           "once memory is registered and the metadata taken, a thread progresses the NIXL worker (naps up "
           "to 1 ms; ~2 % of a core idle), so peers can read from this agent while its owner calls nothing",
           "False only when your engine calls Agent.progress() or notifications() every few ms itself"),
    Option("progress_thread", "False",
           "NIXL's own progress thread instead; it spins a whole core",
           "a dedicated core to spare and a transport that needs constant target progress"),
    Option("backends", '("UCX",)', "NIXL transport plugins this agent instantiates",
           "another NIXL plugin (every peer must offer it too)"),
    Option("num_threads", "0", "worker threads of multi-threaded NIXL plugins (UCX's num_threads)",
           "many large concurrent transfers on a machine with cores to spare"),
    Option("notify_thread", "True",
           "a helper thread polls notification-carrying transfers, so the notification goes out although "
           "the caller does not poll", "False only when the caller polls every transfer to completion"),
    Option("request_descriptors", "16384",
           "the most descriptors one NIXL request carries; larger posts go out piece by piece from poll",
           "lower it if one huge request stalls Agent.read(); raise it for fewer, larger requests"),
    Option("prove_metadata", '"auto"',
           "load a new peer blob in a helper process first, so a blob that crashes NIXL is refused there; "
           '"auto" proves only unauthenticated metadata (token=NO_AUTH). Starting the helper costs a few '
           "seconds, once, at the first add_peer that needs it; the kvxfer.prove logger says so at INFO, with "
           "the seconds it took",
           "True to prove signed blobs too; False only for peers you trust completely"),
    Option("prove_timeout", "30.0", "seconds of CPU time the helper may spend on one blob before it counts as hung",
           "raise it on a heavily loaded machine if healthy blobs are refused as hanging"),
    Option("fence_reads", '"auto"',
           "DRAM READs land in a private area copied out only once DONE, so a stopped peer that resumes cannot "
           'write after a timeout or cancel; "auto" does it for peers UCX reaches only over TCP',
           "True to fence every peer; False only where no transport can deliver a READ late (costs one copy "
           "per row when on, BENCHMARKS.md)"),
)
