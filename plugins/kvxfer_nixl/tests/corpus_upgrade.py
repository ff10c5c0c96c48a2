"""Rewrite saved NIXL fuzz inputs to the current blob (v5, ``KVXNIXL5``) from v3 or v4.

v4 carried the process identity (:mod:`kvxfer.peers`) and the device path's export; v5 drops
the export (it travels in the agent's metadata now, :mod:`kvxfer._routed`). The NIXL part,
which is what crashes NIXL, is kept byte for byte, so the corpus still reaches native code.
Older inputs (``KVXNIXL2``) are left as they are: they were refused by version before too.
From the repository root::

    python plugins/kvxfer_nixl/tests/corpus_upgrade.py tests/fuzz_corpus/nixl/*.bin
"""

from __future__ import annotations

import base64
import json
import struct
import sys

from kvxfer import peers
from kvxfer.peers import Identity
from kvxfer_nixl import _blob

_V3 = struct.Struct("<8s16s16sQI")  # magic, token, instance, epoch, device export length
_V4 = struct.Struct(f"<8s{peers.IDENTITY.size}s16sQI")  # magic, identity, instance, epoch, export length


def upgrade(raw: bytes) -> bytes | None:
    """The v5 form of a v3 or v4 NIXL blob, or None for any other version."""
    if raw[:8] == b"KVXNIXL3":
        _, token, instance, epoch, dev_len = _V3.unpack_from(raw)
        ident = peers.encode(Identity(b"", 0, 0, token))  # the sender is long gone: no host claim
        rest = raw[_V3.size + dev_len:]
    elif raw[:8] == b"KVXNIXL4":
        _, ident, instance, epoch, dev_len = _V4.unpack_from(raw)
        rest = raw[_V4.size + dev_len:]
    else:
        return None
    return _blob.HEADER.pack(_blob.MAGIC, ident, instance, epoch) + rest


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
            print("not version 3 or 4 (already upgraded, or older), left as is:", path)
            continue
        doc["blob"] = base64.b64encode(new).decode()
        with open(path, "wb") as f:
            f.write(b"KVXFMETA" + json.dumps(doc, separators=(",", ":")).encode())
        print("upgraded", path)


if __name__ == "__main__":
    main(sys.argv[1:])
