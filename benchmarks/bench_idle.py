"""Idle CPU of a NIXL agent that others may read from: what a passive peer costs while nothing moves.

For each mode an agent registers 1 MiB of DRAM and then sits idle (its owner calls nothing)
for ``--seconds``; the process's CPU time over that window (every thread: the background
progress thread, NIXL's own progress thread, UCX's) is printed as a share of one core.

* ``off``: ``background_progress=False`` (the owner would drive progress itself);
* ``background``: the default, kvxfer's background progress thread (naps up to 1 ms);
* ``nixl-thread``: ``progress_thread=True``, NIXL's own progress thread.

Commands and figures: BENCHMARKS.md ("A passive peer").
"""

from __future__ import annotations

import argparse
import time

import numpy as np

MODES = {"off": {"background_progress": False}, "background": {}, "nixl-thread": {"progress_thread": True}}


def idle_share(options: dict[str, object], seconds: float) -> float:
    import kvxfer

    agent = kvxfer.Agent("idle", backend="nixl", **options)
    try:
        agent.register({"kv": np.zeros((256, 4096), np.uint8)})
        agent.metadata()
        time.sleep(1.0)  # the threads settle
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        return (time.process_time() - c0) / (time.perf_counter() - w0)
    finally:
        agent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    print(f"{'mode':<12} {'idle CPU, % of one core':>24}")
    for mode in args.modes.split(","):
        print(f"{mode:<12} {100 * idle_share(MODES[mode], args.seconds):>24.2f}", flush=True)


if __name__ == "__main__":
    main()
