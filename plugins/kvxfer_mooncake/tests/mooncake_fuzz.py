"""Fuzz campaign: mutated Mooncake connection blobs through ``Agent.add_peer``.

``python plugins/kvxfer_mooncake/tests/mooncake_fuzz.py --count 10000`` prints one JSON line of
outcomes. Half the mutants change the whole agent metadata (kvxfer.testing.mutate), half
only the plugin's own JSON blob re-wrapped in otherwise valid metadata, so the plugin's
parser sees structure-aware damage (dropped keys, hostile values, nudged addresses), not
only bytes the agent layer refuses first. Every accepted mutant is planned against, which
prepares the peer's lists and so exercises the bounds. It runs in its own process: a native
crash shows as the process's exit status, counted by the test that starts it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections import Counter
from typing import Any

import numpy as np

from kvxfer import Agent, AgentMetadata, KvxferError
from kvxfer.testing.mutate import mutate

OPTIONS: dict[str, Any] = {"trusted_network": True, "progress_timeout": 2}


def run(count: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    caches = [np.zeros((8, 4096), np.uint8) for _ in range(2)]
    out: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    untyped: list[str] = []
    with Agent("victim", backend="mooncake", timeout=5, **OPTIONS) as victim, \
            Agent("seed", backend="mooncake", timeout=5, **OPTIONS) as seeder:
        victim.register({"kv": caches[0]}, replicated=True)
        seeder.register({"kv": caches[1]}, replicated=True)
        genuine = seeder.metadata()
        md = AgentMetadata.decode(genuine)
        for i in range(count):
            if i % 2:
                _, data = mutate(rng, genuine)
            else:
                _, blob = mutate(rng, bytes(md.blob))
                data = dataclasses.replace(md, blob=blob).encode()
            try:
                name = victim.add_peer(data, timeout=10)
                try:
                    victim.plan(name, [0, 7], [7, 0])
                except KvxferError:
                    pass
                victim.remove_peer(name)
                out["accepted"] += 1
            except KvxferError as exc:
                out["typed"] += 1
                errors[type(exc).__name__] += 1
            except Exception as exc:  # noqa: BLE001 - the point is to count it
                out["untyped"] += 1
                untyped.append(f"{type(exc).__name__}: {exc}"[:300])
        name = victim.add_peer(genuine)  # the genuine peer still pairs, and moves bytes
        caches[1][:] = np.arange(caches[1].size, dtype=np.uint64).astype(np.uint8).reshape(caches[1].shape)
        caches[0][:] = 0xAA
        victim.read(name, [3], [5]).wait()
        ok = np.array_equal(caches[0][3], caches[1][5]) and bool((np.delete(caches[0], 3, 0) == 0xAA).all())
    return {"inputs": count, "outcomes": dict(out), "errors": dict(errors), "untyped_examples": untyped[:5],
            "genuine_after": "ok" if ok else "wrong bytes"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(run(args.count, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
