"""A probe for testing :class:`kvxfer.prove.Prover`: it crashes, hangs or refuses on request.

``make_probe(log=PATH)`` returns a probe that appends every input it receives to ``PATH`` (so
a test sees what reached the helper, and what the cache kept from it) and then acts on the
input's first word: ``segv`` reads address 8, ``abort`` aborts, ``hang`` sleeps, ``refuse``
raises; anything else is loaded fine.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable

__all__ = ["make_probe"]


def make_probe(log: str) -> Callable[[bytes], None]:
    def probe(data: bytes) -> None:
        with open(log, "ab") as f:
            f.write(data.hex().encode() + b"\n")
        word = data.split(b" ", 1)[0]
        if word == b"segv":
            ctypes.c_char.from_address(8).value  # a real invalid read
        elif word == b"abort":
            os.abort()
        elif word == b"hang":
            time.sleep(3600)
        elif word == b"refuse":
            raise ValueError("this probe refuses it")

    return probe
