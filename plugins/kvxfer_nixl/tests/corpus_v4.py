"""Rewrite saved NIXL fuzz inputs from blob v3 (``KVXNIXL3``/``KVXCUDA1``) to v4 (``KVXNIXL4``/``KVXCUDA2``).

Only the identity headers changed (:mod:`kvxfer.peers`); the NIXL part, which is what
crashes NIXL, is kept byte for byte, so the corpus still reaches native code. Older inputs
(``KVXNIXL2``) are left as they are: they were refused by version before too. From the
repository root::

    python plugins/kvxfer_nixl/tests/corpus_v4.py tests/fuzz_corpus/nixl/*.bin
"""

from __future__ import annotations

import base64
import json
import struct
import sys

from kvxfer import peers
from kvxfer.cuda import blob as cuda_blob
from kvxfer.peers import Identity
from kvxfer_nixl import _blob

_OLD_NIXL = struct.Struct("<8s16s16sQI")
_OLD_CUDA = struct.Struct("<8s16sIQ16s16sHIII")


def upgrade(raw: bytes) -> bytes | None:
    """The v4 form of a v3 NIXL blob, or None for any other version."""
    magic, token, instance, epoch, dev_len = _OLD_NIXL.unpack_from(raw)
    if magic != b"KVXNIXL3":
        return None
    dev, rest = raw[_OLD_NIXL.size:_OLD_NIXL.size + dev_len], raw[_OLD_NIXL.size + dev_len:]
    if dev[:8] == b"KVXCUDA1" and len(dev) >= _OLD_CUDA.size:
        _, boot, pid, started, tok, dinst, nd, nh, nc, na = _OLD_CUDA.unpack_from(dev)
        ident = Identity(boot if boot.strip(b"\0") else b"", pid, started, tok)
        dev = cuda_blob._HEAD.pack(cuda_blob.MAGIC, peers.encode(ident), dinst, nd, nh, nc, na) + dev[_OLD_CUDA.size:]
    sender = Identity(b"", 0, 0, token)  # the sender is long gone: no host claim
    return _blob.HEADER.pack(_blob.MAGIC, peers.encode(sender), instance, epoch, len(dev)) + dev + rest


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(b"KVXFMETA"):
            print("not agent metadata, left as is:", path)
            continue
        doc = json.loads(data[8:])
        new = upgrade(base64.b64decode(doc["blob"]))
        if new is None:
            print("not version 3 (already upgraded, or older), left as is:", path)
            continue
        doc["blob"] = base64.b64encode(new).decode()
        with open(path, "wb") as f:
            f.write(b"KVXFMETA" + json.dumps(doc, separators=(",", ":")).encode())
        print("upgraded", path)


if __name__ == "__main__":
    main(sys.argv[1:])
