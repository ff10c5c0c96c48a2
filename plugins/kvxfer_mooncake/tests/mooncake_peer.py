"""A Mooncake backend in its own process, for the fence tests: it registers ``--mib`` MiB of
a known pattern, prints its blob as one hex line, and sleeps until killed."""

from __future__ import annotations

import sys
import time

import numpy as np

from kvxfer import Allocation
from kvxfer_mooncake.backend import MooncakeBackend


def pattern(nbytes: int) -> np.ndarray:
    """The bytes the peer serves: the test computes the same array as its reference."""
    return (np.arange(nbytes, dtype=np.uint64) * 2654435761 >> 7).astype(np.uint8)


def main() -> None:
    mib = int(sys.argv[1])
    buf = pattern(mib << 20)
    be = MooncakeBackend("peer", trusted_network=True, progress_timeout=30)
    be.register([Allocation(buf.ctypes.data, buf.nbytes)])
    sys.stdout.write(be.local_metadata().hex() + "\n")
    sys.stdout.flush()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
