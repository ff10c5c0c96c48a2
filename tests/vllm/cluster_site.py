"""Damage objects in the cluster tier the way another writer could (run as a script on a host).

``cluster_site.py MASTER HOSTNAME NAMESPACE FINGERPRINT FLIP_KEY DONOR_KEYS VICTIM_KEYS``
(keys in hex, lists comma-separated) joins the cluster as a client that lends nothing, then:

* flips one row byte of ``FLIP_KEY``'s object (rewritten in place with ``upsert``) and reads it
  back: the control that the corruption reached the object;
* writes each donor's row under a victim's name with a header made for that name and the
  donor's genuine digest (what anyone who can write to the cluster can do: the digest is not a
  signature), so only the tokens can tell.

Prints one JSON line: how many bytes differ in the flipped object, read back.
"""

from __future__ import annotations

import json
import sys

from kvxfer.tiers.objects import _FMT, HEADER, object_name, pack_header


def main() -> None:
    master, host, ns, fp, flip, donors, victims = sys.argv[1:8]
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup(host, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0

    def name(hexkey: str) -> str:
        return object_name(ns, fp, bytes.fromhex(hexkey))

    before = bytearray(store.get(name(flip)))
    assert len(before) > HEADER + 1000, len(before)
    flipped = bytearray(before)
    flipped[HEADER + 1000] ^= 0xFF
    assert store.upsert(name(flip), bytes(flipped)) == 0
    after = store.get(name(flip))
    diff = sum(a != b for a, b in zip(before, after)) + abs(len(before) - len(after))
    for d, v in zip(donors.split(","), victims.split(",")):
        obj = store.get(name(d))
        _, _, _, row_len, digest, _, _ = _FMT.unpack(obj[:HEADER])
        assert store.upsert(name(v), pack_header(row_len, digest, name(v)) + obj[HEADER:]) == 0
    print(json.dumps({"flipped_bytes": diff, "object_len": len(before)}), flush=True)
    store.close()


if __name__ == "__main__":
    main()
