"""A probe for testing :class:`kvxfer.prove.Prover`: it crashes, hangs or refuses on request.

``make_probe(log=PATH)`` returns a probe that appends every input it receives to ``PATH`` (so
a test sees what reached the helper, and what the cache kept from it) and then acts on the
input's first word: ``segv`` reads address 8, ``abort`` aborts, ``hang`` sleeps for an hour,
``slow`` sleeps for the number of seconds that follows, ``leak`` opens that many
descriptors and keeps them, ``refuse`` raises; anything else is
loaded fine.

Starting can fail on request too: with ``fail_starts=PATH`` the factory raises while the
number in that file is positive (and counts it down), so a test controls how many starts
fail; with ``hang_start=True`` it never returns.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable

__all__ = ["make_probe"]
_kept: list[int] = []


def make_probe(log: str, fail_starts: str | None = None, hang_start: bool = False) -> Callable[[bytes], None]:
    if hang_start:
        time.sleep(3600)
    if fail_starts is not None:
        with open(fail_starts) as f:
            left = int(f.read() or 0)
        if left > 0:
            with open(fail_starts, "w") as f:
                f.write(str(left - 1))
            raise RuntimeError(f"this probe refuses to start ({left} more)")

    def probe(data: bytes) -> None:
        with open(log, "ab") as f:
            f.write(data.hex().encode() + b"\n")
        word, _, rest = data.partition(b" ")
        if word == b"segv":
            ctypes.c_char.from_address(8).value  # a real invalid read
        elif word == b"abort":
            os.abort()
        elif word == b"hang":
            time.sleep(3600)
        elif word == b"slow":
            time.sleep(float(rest.split()[0]))
        elif word == b"leak":  # keeps descriptors open, as refused native loads can
            _kept.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(int(rest.split()[0])))
        elif word == b"refuse":
            raise ValueError("this probe refuses it")

    return probe
