"""What the same-host identity proof costs ``add_peer``: NIXL ``add_remote`` of a genuine peer in
another process, with the check (:mod:`kvxfer_nixl._identity`) and without it, interleaved in
one run; and :func:`kvxfer.peers.prove` alone. Results go to BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_identity.py --adds 200
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time

import numpy as np

_PEER = r"""
import base64, json, sys
import numpy as np
from kvxfer import Agent
buf = np.zeros((64, 4096), np.uint8)
with Agent("peer", backend="nixl") as agent:
    agent.register({"layer.0": buf})
    print(json.dumps({"metadata": base64.b64encode(agent.backend.local_metadata()).decode()}), flush=True)
    sys.stdin.read()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--adds", type=int, default=200)
    args = ap.parse_args()
    from kvxfer import peers
    from kvxfer.memory import Allocation
    from kvxfer.testing.lines import Channel
    from kvxfer_nixl import _identity
    from kvxfer_nixl.backend import NixlBackend

    proc = subprocess.Popen([sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "NIXL_LOG_LEVEL": "ERROR"})
    assert proc.stdin is not None
    blob = base64.b64decode(Channel(proc).read(120)["metadata"])
    real = _identity.check
    mem = np.zeros((64, 4096), np.uint8)
    be = NixlBackend("bench", prove_metadata=False)
    be.register([Allocation(mem.ctypes.data, mem.nbytes)])
    times: dict[str, list[float]] = {"with check": [], "check bypassed": []}
    try:
        for i in range(2 * args.adds):
            mode = "with check" if i % 2 else "check bypassed"
            _identity.check = real if i % 2 else (lambda *a, **k: None)  # type: ignore[assignment]
            t0 = time.perf_counter()
            be.add_remote("peer", blob)
            times[mode].append(time.perf_counter() - t0)
            be.remove_remote("peer")
        _identity.check = real
        from kvxfer_nixl._blob import parse

        claim = parse(blob, "peer", ("UCX",)).identity
        proofs = []
        for _ in range(args.adds):
            t0 = time.perf_counter()
            peers.prove(claim, "bench")
            proofs.append(time.perf_counter() - t0)
        times["peers.prove alone"] = proofs
    finally:
        be.close()
        proc.stdin.close()
        proc.wait(timeout=60)
    print(f"{'what':<20} {'n':>5} {'median us':>10} {'p90 us':>10} {'p99 us':>10}")
    for k, v in times.items():
        a = np.array(v) * 1e6
        print(f"{k:<20} {len(a):>5} {np.median(a):>10.0f} {np.percentile(a, 90):>10.0f} {np.percentile(a, 99):>10.0f}")


if __name__ == "__main__":
    main()
