"""Idle CPU of a NIXL agent that others may read from: what a passive peer costs while nothing moves.

For each mode an agent registers 1 MiB of DRAM and then sits idle (its owner calls nothing)
for ``--seconds``; the process's CPU time over that window (every thread: the background
progress thread, NIXL's own progress thread, UCX's) is printed as a share of one core.

* ``off``: ``background_progress=False`` (the owner would drive progress itself);
* ``background``: the default, kvxfer's background progress thread (naps up to 1 ms);
* ``nixl-thread``: ``progress_thread=True``, NIXL's own progress thread;
* ``unadvertised``: the default options, but the agent's metadata never taken (an agent made
  only for the store's file path): no peer can connect, and no thread runs.

``--agents N`` opens N such agents at once. Context switches per second (voluntary, the
process's ``getrusage``) count the wake-ups.

Commands and figures: BENCHMARKS.md ("A passive peer").
"""

from __future__ import annotations

import argparse
import time

import numpy as np

MODES = {"off": {"background_progress": False}, "background": {}, "nixl-thread": {"progress_thread": True},
         "unadvertised": {}}


def idle_share(mode: str, seconds: float, agents: int = 1) -> tuple[float, float]:
    """Share of one core and voluntary context switches per second over the idle window."""
    import resource

    import kvxfer

    opened = []
    try:
        for i in range(agents):
            agent = kvxfer.Agent(f"idle-{i}", backend="nixl", **MODES[mode])
            opened.append(agent)
            agent.register({"kv": np.zeros((256, 4096), np.uint8)})
            if mode != "unadvertised":
                agent.metadata()
        time.sleep(1.0)  # the threads settle
        c0, w0 = time.process_time(), time.perf_counter()
        s0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        time.sleep(seconds)
        wall = time.perf_counter() - w0
        return (time.process_time() - c0) / wall, (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - s0) / wall
    finally:
        for agent in opened:
            agent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--agents", type=int, default=1)
    args = ap.parse_args()
    print(f"{'mode':<13} {'agents':>6} {'idle CPU, % of one core':>24} {'wake-ups/s':>11}")
    for mode in args.modes.split(","):
        share, wakes = idle_share(mode, args.seconds, args.agents)
        print(f"{mode:<13} {args.agents:>6} {100 * share:>24.2f} {wakes:>11.0f}", flush=True)


if __name__ == "__main__":
    main()
