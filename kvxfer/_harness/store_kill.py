"""SIGKILL a process that offloads to a :class:`kvxfer.Store` at random moments, then check.

    python -m kvxfer._harness.store_kill --count 50 --seed 1 [--dir /tmp] [--path pwritev|nixl|staged]

Each round starts a child that opens the store (the slab survives from round to round) and
offloads batches of random blocks of a per-layer cache under keys naming the block, printing
each batch once its transfer is DONE; the parent kills it after a random delay. The parent
then reopens the store and checks, against numpy over the logical array (never the store's
arithmetic): every entry present restores byte-exact into a sentinel-filled cache (no torn
entry is ever served, nor published: a digest failure is counted as ``torn_published``), and
the last batch reported DONE is present. ``--path`` is the data path the child offloads
through: the store's ``pwritev`` (a spec), NIXL POSIX (an agent of the ``nixl`` backend) or
the staged path (host memory through the stage, as for VRAM). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from .._childproc.lines import Channel

__all__ = ["campaign"]

LAYERS, BLOCKS, PAGE, SLOTS, BATCH = 4, 64, 4096, 48, 6


def _cache(fill: bool) -> tuple[dict[str, Any], np.ndarray]:
    """Per-layer K and V arrays ``[block, page]``; logical truth ``X[layer, kv, block]``."""
    x = np.random.default_rng(7).integers(0, 256, (LAYERS, 2, BLOCKS, PAGE), dtype=np.uint8)
    arrs = {f"layer.{l}": tuple(x[l, kv].copy() if fill else np.full((BLOCKS, PAGE), 0xAA, np.uint8)
                                for kv in (0, 1)) for l in range(LAYERS)}
    return arrs, x


def _store(path: str, spec: Any) -> Any:
    import kvxfer

    return kvxfer.Store(path, capacity=SLOTS * LAYERS * 2 * PAGE, layout=spec)


def _child(path: str, seed: int, via: str = "pwritev") -> None:
    import kvxfer

    arrs, _ = _cache(True)
    spec = kvxfer.spec_from_arrays(arrs, dims="BX")
    st = _store(path, spec)
    who: Any = spec
    if via == "nixl":
        who = kvxfer.Agent("store-kill", backend="nixl")
        who.register(spec)
    elif via == "staged":
        kvxfer.Store._stage_host = True
    rng = random.Random(seed)
    print("READY", flush=True)
    r, prev = 0, []
    while True:
        blocks = rng.sample(range(BLOCKS), BATCH)
        keys = [f"{seed}:{r}:{b}".encode() for b in blocks]
        t = st.offload(who, blocks, keys).wait()
        if r == 0:
            print("PATH " + str(t.stats.path), flush=True)
        print("DONE " + " ".join(k.decode() for k in keys), flush=True)
        if r % 5 == 4:  # some drops too (never of the batch just reported)
            st.discard(prev[:2])
        r, prev = r + 1, keys


def _check(path: str, last: list[bytes]) -> dict[str, int]:
    import kvxfer

    arrs, x = _cache(False)
    spec = kvxfer.spec_from_arrays(arrs, dims="BX")
    with _store(path, spec) as st:
        entries = st.keys()
        present = set(entries)
        missing_last = sum(k not in present for k in last)
        torn = 0
        while entries:  # at most SLOTS < BLOCKS entries: one local block each
            try:
                st.restore(entries, spec, np.arange(len(entries))).wait()
                break
            except kvxfer.StoreCorruptError as e:  # a torn entry was published: caught, but counted
                torn += len(e.keys)
                entries = [k for k in entries if k not in set(e.keys)]
    # Compare every restored block with the logical array at the block its key names.
    wrong = 0
    for i, k in enumerate(entries):
        b = int(k.split(b":")[2])
        got = np.stack([np.stack([arrs[f"layer.{l}"][kv][i] for kv in (0, 1)]) for l in range(LAYERS)])
        wrong += not np.array_equal(got, x[:, :, b])
    return {"present": len(entries), "wrong": wrong, "torn_published": torn, "missing_last_done": missing_last}


def campaign(directory: str, count: int, seed: int, path: str = "pwritev") -> dict[str, Any]:
    """``count`` kills; returns totals (``wrong`` and ``missing_last_done`` must be 0) and the
    data paths the children reported."""
    rng = random.Random(seed)
    out: dict[str, Any] = {"kills": 0, "present": 0, "wrong": 0, "torn_published": 0, "missing_last_done": 0,
                           "batches_done": 0, "paths": []}
    for i in range(count):
        proc = subprocess.Popen([sys.executable, "-m", "kvxfer._harness.store_kill", "--child", directory,
                                 "--seed", str(seed * 1000 + i), "--path", path], stdout=subprocess.PIPE, text=True)
        ch = Channel(proc)
        try:
            if ch.line(60).strip() != "READY":
                raise RuntimeError("child did not start")
        except (EOFError, TimeoutError) as exc:
            proc.kill()
            raise RuntimeError(f"child did not start (rc={proc.wait()})") from exc
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        # The kill may cut the last line short: a batch counts once its line is whole.
        whole_lines, _cut = ch.inbox.rest(30)
        proc.wait()
        ch.close()
        lines = [ln.decode() for ln in whole_lines]
        whole = [ln.split()[1:] for ln in lines if ln.startswith("DONE ")]
        out["paths"] = sorted(set(out["paths"]) | {ln.split()[1] for ln in lines if ln.startswith("PATH ")})
        last = [k.encode() for k in whole[-1]] if whole else []
        res = _check(directory, last)
        out["kills"] += 1
        out["batches_done"] += len(whole)
        for k in ("present", "wrong", "torn_published", "missing_last_done"):
            out[k] += res[k]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--path", choices=("pwritev", "nixl", "staged"), default="pwritev")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.seed, args.path)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(json.dumps(campaign(os.path.join(d, "store"), args.count, args.seed, args.path)))


if __name__ == "__main__":
    main()
