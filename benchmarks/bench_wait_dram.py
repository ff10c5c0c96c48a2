"""What ``Transfer.wait`` costs a small DRAM READ: loopback, one 4 KB block, ``read().wait()``.

The wait asks the backend for its own ``wait`` before polling (a device-path post blocks on its
CUDA event); a DRAM post answers None and is polled as before. Prints the median in us.

    PYTHONPATH=$PWD:$PWD/plugins python benchmarks/bench_wait_dram.py 20000
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import kvxfer



def main(n: int) -> float:
    a, b = np.zeros((64, 4096), np.uint8), np.ones((64, 4096), np.uint8)
    with kvxfer.Agent("s") as s, kvxfer.Agent("d") as d:
        s.register({"l": b})
        d.register({"l": a})
        d.add_peer(s.metadata())
        for _ in range(2000):
            d.read("s", [1], [2]).wait()
        t = []
        for i in range(n):
            t0 = time.perf_counter()
            d.read("s", [i % 64], [(i * 7) % 64]).wait()
            t.append(time.perf_counter() - t0)
    assert (a == 1).any()  # rows did move
    return 1e6 * statistics.median(t)


if __name__ == "__main__":
    print(f"{main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000):.2f}")
