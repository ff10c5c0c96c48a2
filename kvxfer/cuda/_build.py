"""Regenerate ``batch_copy.ptx`` (and :mod:`kvxfer.cuda._ptx`'s hash) from ``batch_copy.cu`` (needs ``nvcc``; run by hand).

The PTX is embedded so that the device path needs no compiler at run time: the driver
compiles PTX for the GPU it finds (once per process, in milliseconds). ``compute_80`` keeps
the text loadable on Ampere and every later GPU. A test checks that the embedded PTX was
built from the ``batch_copy.cu`` next to it (by its SHA-256).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "batch_copy.cu")
TARGET = os.path.join(HERE, "_ptx.py")
PTX_FILE = os.path.join(HERE, "batch_copy.ptx")


def source_sha256() -> str:
    with open(SOURCE, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main() -> int:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "batch_copy.ptx")
        subprocess.run([nvcc, "--ptx", "-arch=compute_80", "-O3", "-o", out, SOURCE], check=True)
        with open(out) as f:
            ptx = f.read()
    with open(PTX_FILE, "w") as f:
        f.write(ptx)
    with open(TARGET) as f:
        text = f.read()
    start = text.index('SOURCE_SHA256 = "') + len('SOURCE_SHA256 = "')
    with open(TARGET, "w") as f:
        f.write(text[:start] + source_sha256() + text[start + 64:])
    print(f"wrote {PTX_FILE} and the hash in {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
