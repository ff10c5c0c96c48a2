"""Mutate the UCX backend's connection blob and feed it to ``Agent.add_peer``, in a child process.

A child process holds two agents: ``source`` (whose genuine metadata is the seed) and
``victim`` (which adds every mutant). Each mutant replaces the blob inside otherwise valid
agent metadata, under a newer generation so that the core does not refuse it as stale. The
child reports each outcome on a line; if it dies (SIGSEGV, SIGABRT) or hangs, the parent
counts a crash for the mutant it was on and starts a new child after it. So a crash is a
number in the report, not the end of the run. Mutants are deterministic in ``(seed, index)``.

Strategies: raw byte edits of the JSON (flips, inserts, deletes, truncation, splices) and
structure-aware edits that keep the JSON valid and change what reaches native code (the
worker address and remote-key bytes, addresses, sizes, the host entry, types, nesting).
``--mode rma`` turns the same-host path off on both agents, so remote keys are unpacked too.

    python plugins/kvxfer_ucx/tests/ucx_fuzz.py --count 50000            # both modes
    python plugins/kvxfer_ucx/tests/ucx_fuzz.py --count 1000 --modes rma --json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

from kvxfer.testing.lines import Channel

MODES = {"copy": {}, "rma": {"same_host_copy": False}}


# ---------------------------------------------------------------------------------------------
# mutants

def _flip_bytes(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.choice((1, 1, 2, 4, 16))):
        if not b:
            break
        i = rng.randrange(len(b))
        b[i] = rng.choice((0, 0xFF, rng.randrange(256), b[i] ^ (1 << rng.randrange(8))))
    return bytes(b)


def _edit_bytes(raw: bytes, rng: random.Random) -> bytes:
    """Byte-level edits of any byte string (JSON text, or decoded native bytes)."""
    op = rng.randrange(7)
    if op <= 2 or not raw:
        return _flip_bytes(raw, rng)
    i = rng.randrange(len(raw) + 1)
    if op == 3:
        return raw[:i]  # truncate
    if op == 4:
        return raw[:i] + bytes(rng.randrange(256) for _ in range(rng.choice((1, 8, 64)))) + raw[i:]
    if op == 5:
        j = min(len(raw), i + rng.choice((1, 8, 64)))
        return raw[:i] + raw[j:]  # delete
    j = rng.randrange(len(raw) + 1)
    return raw[:i] + raw[min(i, j):max(i, j)] + raw[i:]  # splice a copy of a chunk


_ODD_VALUES: list[Any] = [None, True, False, 0, -1, 1 << 64, 2 ** 63, 1.5, "", "x", [], {}, [[]], "A" * 5000]


def _structured(blob: bytes, rng: random.Random) -> bytes:
    doc = json.loads(blob)
    target = rng.randrange(8)
    if target <= 2 and doc.get("worker"):  # the worker address: the bytes UCX parses in ep_create
        raw = base64.b64decode(doc["worker"])
        doc["worker"] = base64.b64encode(_edit_bytes(raw, rng)).decode()
    elif target <= 4 and doc.get("allocations"):  # a remote key (unpacked on the RMA path)
        a = rng.choice(doc["allocations"])
        if rng.random() < 0.8:
            a[2] = base64.b64encode(_edit_bytes(base64.b64decode(a[2]), rng)).decode()
        else:
            a[rng.randrange(2)] = rng.choice([0, 1, a[0] + rng.randrange(-4096, 4096), (1 << 64) - 1, 1 << 63])
    elif target == 5 and doc.get("host"):
        key = rng.choice(sorted(doc["host"]))
        doc["host"][key] = rng.choice(_ODD_VALUES + [doc["host"][key]])
        if key in ("pid", "page", "start") and rng.random() < 0.5 and isinstance(doc["host"][key], int):
            doc["host"][key] = max(0, doc["host"][key] + rng.randrange(-64, 64))
    elif target == 6:
        key = rng.choice(sorted(doc))
        doc[key] = rng.choice(_ODD_VALUES)
    else:
        depth = rng.choice((10, 1000, 100_000))
        return ("[" * depth + "]" * depth).encode() if rng.random() < 0.5 else json.dumps(
            {**doc, "allocations": doc["allocations"] * rng.choice((2, 500, 5000))}).encode()
    return json.dumps(doc).encode()


def mutant(blob: bytes, seed: int, index: int) -> bytes:
    rng = random.Random(seed * 1_000_003 + index)
    return _edit_bytes(blob, rng) if rng.random() < 0.35 else _structured(blob, rng)


# ---------------------------------------------------------------------------------------------
# the child

def child(mode: str, seed: int, start: int, count: int) -> None:
    import numpy as np

    import kvxfer

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # UCX prints on fd 1 and 2; keep the report channel private
    src = np.full((8, 4096), 7, dtype=np.uint8)
    dst = np.full((8, 4096), 0xAA, dtype=np.uint8)
    source = kvxfer.Agent("source", backend="ucx", **MODES[mode])
    victim = kvxfer.Agent("victim", backend="ucx", **MODES[mode])
    source.register({"layer.0": src}, replicated=True)
    victim.register({"layer.0": dst}, replicated=True)
    md = kvxfer.AgentMetadata.decode(source.metadata())
    for k in range(start, start + count):
        out.write(f"start {k}\n")
        out.flush()
        forged = kvxfer.AgentMetadata(md.name, md.generation + 1 + k, md.backend, mutant(md.blob, seed, k), md.spec)
        try:
            victim.add_peer(forged.encode())
            result = "accepted"
        except kvxfer.KvxferError as exc:
            result = f"typed {type(exc).__name__}"
        except BaseException as exc:  # noqa: BLE001 - what the fuzzer is looking for
            result = f"untyped {type(exc).__name__}"
        out.write(f"done {k} {result}\n")
        out.flush()
    # the genuine peer can still be added and used afterwards
    victim.add_peer(kvxfer.AgentMetadata(md.name, md.generation + 2 + start + count, md.backend, md.blob,
                                         md.spec).encode())
    t = victim.read("source", [1], [2])
    while not t.done():  # the RMA path needs the target (in this process) progressed too
        source.progress()
    ok = bool((dst[1] == 7).all() and (dst[0] == 0xAA).all())
    out.write(f"final {'ok' if ok else 'wrong-bytes'}\n")
    out.flush()
    victim.close()
    source.close()


# ---------------------------------------------------------------------------------------------
# the parent

def run(count: int, mode: str = "copy", seed: int = 1, hang_s: float = 60.0) -> dict[str, Any]:
    """Feed ``count`` mutants; returns counts of outcomes, crashes, hangs and examples."""
    outcomes: Counter[str] = Counter()
    crashes: list[dict[str, Any]] = []
    final = "not reached"
    k = 0
    while k < count:
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, __file__, "--child", mode, "--seed", str(seed), "--start", str(k),
                                     "--count", str(count - k)], stdout=subprocess.PIPE, stderr=err)
            ch = Channel(proc)
            current, stalled = None, False
            while True:
                try:
                    line = ch.line(hang_s)
                except TimeoutError:
                    stalled = True
                    proc.kill()
                    break
                except EOFError:
                    break
                word, _, rest = line.strip().partition(" ")
                if word == "start":
                    current = int(rest)
                elif word == "done":
                    _, _, result = rest.partition(" ")
                    outcomes[result] += 1
                    k, current = int(rest.split()[0]) + 1, None
                elif word == "final":
                    final = rest
            rc = proc.wait()
            if current is None and not stalled:
                if rc != 0 and k >= count:
                    final = f"child exited {rc} after the last mutant"
                break
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            crashes.append({"index": current, "kind": "hang" if stalled else f"exit {rc}", "stderr": tail})
            k = (current if current is not None else k) + 1
    untyped = sum(v for key, v in outcomes.items() if key.startswith("untyped"))
    return {"mode": mode, "mutants": count, "outcomes": dict(outcomes), "untyped": untyped,
            "crashes": len(crashes), "crash_examples": crashes[:5], "genuine_after": final}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=50_000, help="mutants per mode")
    ap.add_argument("--modes", default="copy,rma")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--start", type=int, default=0)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.seed, a.start, a.count)
        return []
    results = []
    for mode in a.modes.split(","):
        r = run(a.count, mode, a.seed)
        results.append(r)
        print(json.dumps(r) if a.json else f"{mode}: {a.count} mutants, crashes {r['crashes']}, untyped "
              f"{r['untyped']}, outcomes {r['outcomes']}, genuine peer afterwards: {r['genuine_after']}", flush=True)
    return results


if __name__ == "__main__":
    main()
