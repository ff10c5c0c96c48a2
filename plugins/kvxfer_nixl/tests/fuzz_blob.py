"""Byte-level fuzzing of the NIXL connection blob through ``Agent.add_peer``, crash-proof.

A genuine peer runs in its own process (``python -m kvxfer.testing.peer``); its metadata is
the seed. Worker processes hold a victim agent and feed it mutated copies of the peer's
NIXL blob, wrapped in otherwise valid kvxfer metadata. Each mutation must end in one of:

* accepted (the mutation kept the blob valid, e.g. a changed address or key byte),
* a :class:`~kvxfer.KvxferError` subclass;

and after each one the genuine metadata must still load (a rejected blob must not block the
peer). An untyped exception, or a genuine blob refused afterwards, is a finding. A worker
that dies (SIGSEGV, SIGABRT...) is counted as a crash of that mutation and replaced, and the
campaign goes on. Mutations are derived from ``(seed, index)`` alone, so any finding can be
replayed with ``--start INDEX --count 1``.

Each mutation has an *operator* (bit flips, random bytes, eight zero bytes, truncation,
insertion, deletion, a length field set to a boundary value, a duplicated chunk) and a
*region*: where its first changed byte lies (kvxfer header, NIXL
framing, agent name, UCX connection info, a descriptor, a remote key). Operators ``payload-*`` keep the framing intact
and change only bytes inside the two opaque UCX payloads, which no parser here can check.

Usage::

    python plugins/kvxfer_nixl/tests/fuzz_blob.py --count 50000 --json fuzz.json
    python plugins/kvxfer_nixl/tests/fuzz_blob.py --start 1234 --count 1      # replay one
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from kvxfer.testing.lines import Channel

OPERATORS = ("bitflip", "bytes", "zero8", "truncate", "insert", "delete", "length", "splice",
             "payload-bytes", "payload-zero8")
_HEADER = struct.Struct("<8s60s16sQ")  # kvxfer_nixl._blob.HEADER
_LEN = struct.Struct("<Q")


# --------------------------------------------------------------------------------------------
# The blob's map: which bytes are framing, name, connection info, descriptors, keys
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Regions:
    """Byte ranges ``[start, end)`` of the blob, by kind, and the offsets of length fields."""

    spans: tuple[tuple[int, int, str], ...]
    lengths: tuple[int, ...]
    payloads: tuple[tuple[int, int], ...]  # connection info and remote keys

    def region(self, offset: int) -> str:
        for a, b, kind in self.spans:
            if a <= offset < b:
                return kind
        return "framing"


def regions(blob: bytes) -> Regions:
    """Walk the records of a genuine blob (NIXL's layout, see :mod:`kvxfer_nixl._blob`)."""
    dev = _HEADER.size
    spans: list[tuple[int, int, str]] = [(0, _HEADER.size, "header")]
    lengths: list[int] = []
    payloads: list[tuple[int, int]] = []
    pos = dev + len(b"nixlSerDes|")

    def record(tag: bytes, kind: str | None = None) -> bytes:
        nonlocal pos
        assert blob.startswith(tag, pos), (tag, pos)
        lengths.append(pos + len(tag))
        (n,) = _LEN.unpack_from(blob, pos + len(tag))
        start = pos + len(tag) + 8
        if kind == "rkey":
            spans.append((start, start + 24, "descriptor"))
            spans.append((start + 24, start + n, "rkey"))
            payloads.append((start + 24, start + n))
        elif kind:
            spans.append((start, start + n, kind))
            if kind == "conninfo":
                payloads.append((start, start + n))
        pos = start + n + 1
        return blob[start:start + n]

    record(b"Agent", "name")
    for _ in range(_LEN.unpack(record(b"Conns"))[0]):
        record(b"t")
        record(b"c", "conninfo")
    record(b"")
    for _ in range(_LEN.unpack(record(b"nixlSecElms"))[0]):
        record(b"bknd")
        record(b"nixlDList")
        record(b"t")
        for _ in range(_LEN.unpack(record(b"n"))[0]):
            record(b"", "rkey")
    assert pos == len(blob)
    return Regions(tuple(spans), tuple(lengths), tuple(payloads))


def mutate(blob: bytes, reg: Regions, seed: int, index: int, sweep: bool = False) -> tuple[str, str, bytes]:
    """The ``index``-th mutation of ``blob``: ``(operator, region, bytes)``.

    ``sweep``: instead of random mutations, mutation ``2k`` zeroes the 8 bytes at offset
    ``k`` and ``2k + 1`` sets byte ``k`` to 0xFF (a map of which bytes matter).
    """
    b = bytearray(blob)
    n = len(b)
    if sweep:
        off = (index // 2) % n
        if index % 2:
            b[off] = 0xFF
        else:
            b[off:off + 8] = bytes(min(8, n - off))
        return ("sweep-ff" if index % 2 else "sweep-zero8"), reg.region(off), bytes(b)
    rng = np.random.default_rng([seed, index])
    op = OPERATORS[index % len(OPERATORS)]
    if op.startswith("payload-"):
        a, e = reg.payloads[int(rng.integers(len(reg.payloads)))]
        off = int(rng.integers(a, e))
        if op == "payload-zero8":
            k = min(8, e - off)
            b[off:off + k] = bytes(k)
        else:
            for _ in range(int(rng.integers(1, 5))):
                b[int(rng.integers(a, e))] = int(rng.integers(256))
        return op, reg.region(off), bytes(b)
    off = int(rng.integers(0, n))
    if op == "bitflip":
        for i in range(int(rng.integers(1, 5))):
            o = off if i == 0 else int(rng.integers(0, n))
            b[o] ^= 1 << int(rng.integers(8))
    elif op == "bytes":
        k = int(rng.integers(1, 9))
        b[off:off + k] = rng.integers(0, 256, min(k, n - off), dtype=np.uint8).tobytes()
    elif op == "zero8":
        b[off:off + 8] = bytes(min(8, n - off))
    elif op == "truncate":
        del b[off:]
    elif op == "insert":
        b[off:off] = rng.integers(0, 256, int(rng.integers(1, 17)), dtype=np.uint8).tobytes()
    elif op == "delete":
        del b[off:off + int(rng.integers(1, 17))]
    elif op == "length":
        off = reg.lengths[int(rng.integers(len(reg.lengths)))]
        (cur,) = _LEN.unpack_from(b, off)
        value = [0, 1, cur - 1, cur + 1, cur * 2, 1 << 31, 1 << 32, 1 << 63, (1 << 64) - 1,
                 int(rng.integers(0, 1 << 16))][int(rng.integers(10))]
        b[off:off + 8] = _LEN.pack(value % (1 << 64))
    elif op == "splice":
        k = int(rng.integers(1, 65))
        src = int(rng.integers(0, n))
        b[off:off] = b[src:src + k]
    return op, reg.region(off), bytes(b)


# --------------------------------------------------------------------------------------------
# Worker: one victim agent, many mutations, one JSON line per mutation
# --------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    import kvxfer
    from kvxfer.errors import KvxferError

    with open(args.metadata, "rb") as f:
        genuine = kvxfer.AgentMetadata.decode(f.read())
    reg = regions(genuine.blob)
    from kvxfer.testing.buffers import make_cache

    # The victim's cache has the genuine peer's geometry (see ``campaign``), so the genuine
    # metadata pairs and the only refusals left are the ones the mutations cause.
    cache = make_cache("packed", num_blocks=4, num_layers=2, page=256)
    out = sys.stdout
    with kvxfer.Agent("victim", backend="nixl") as agent:
        agent.register(cache.views)
        generation = genuine.generation
        for i in range(args.start, args.start + args.count):
            op, region, blob = mutate(genuine.blob, reg, args.seed, i, args.sweep)
            off = (i // 2) % len(genuine.blob) if args.sweep else None
            out.write(json.dumps({"i": i, "op": op, "region": region, "offset": off, "started": True}) + "\n")
            out.flush()  # if the next call kills us, the parent knows which mutation did it
            generation += 2
            md = kvxfer.AgentMetadata(genuine.name, generation, "nixl", blob, genuine.spec).encode()
            rec: dict[str, Any] = {"i": i, "op": op, "region": region}
            try:
                agent.add_peer(md)
                rec["result"] = "accepted"
            except KvxferError as exc:
                rec["result"] = type(exc).__name__
            except BaseException as exc:  # a finding: nothing untyped may leave add_peer
                rec["result"] = "untyped"
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            # The genuine metadata must load right after, whatever happened to the mutation.
            try:
                agent.add_peer(kvxfer.AgentMetadata(genuine.name, generation + 1, "nixl", genuine.blob,
                                                    genuine.spec).encode())
                rec["genuine"] = "ok"
            except BaseException as exc:
                rec["genuine"] = f"{type(exc).__name__}: {exc}"[:300]
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return 0


# --------------------------------------------------------------------------------------------
# Campaign: genuine peer, workers restarted after crashes, counts
# --------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.pathsep.join([root, os.path.join(root, "plugins"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "ERROR",
            "UCX_LOG_LEVEL": "fatal"}


def _records(proc: subprocess.Popen[str], quiet_s: float = 600.0) -> Iterator[dict[str, Any]]:
    """The worker's records until it exits; :class:`TimeoutError` if it says nothing for ``quiet_s``."""
    ch = Channel(proc)
    while True:
        try:
            line = ch.line(quiet_s)
        except EOFError:
            return
        if line.startswith("{"):
            yield json.loads(line)


def campaign(count: int, seed: int = 0, start: int = 0, timeout: float = 3600.0, log: Any = None,
             sweep: bool = False) -> dict[str, Any]:
    """Run mutations ``start .. start+count`` and return the counts (see module docstring)."""
    import tempfile

    from kvxfer.testing.peer import PeerProcess

    env = _env()
    peer = PeerProcess(["--backend", "nixl", "--name", "genuine", "--blocks", "4", "--layers", "2", "--page", "256"],
                       env=env)
    results: Counter[str] = Counter()
    by_class: dict[str, Counter[str]] = {}
    crashes: list[dict[str, Any]] = []
    findings: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        with tempfile.NamedTemporaryFile(suffix=".md", delete=False) as f:
            f.write(peer.metadata)
            md_path = f.name
        nxt = start
        end = start + count
        while nxt < end and time.monotonic() - t0 < timeout:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--metadata", md_path,
                                     "--seed", str(seed), "--start", str(nxt), "--count", str(end - nxt)]
                                    + (["--sweep"] if sweep else []),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            pending = None
            for rec in _records(proc):
                if rec.get("started"):
                    pending = rec
                    continue
                pending = None
                cls = f"{rec['op']}@{rec['region']}"
                by_class.setdefault(cls, Counter())[rec["result"]] += 1
                results[rec["result"]] += 1
                if rec["result"] == "untyped" or rec["genuine"] != "ok":
                    findings.append(rec)
                nxt = rec["i"] + 1
            rc = proc.wait()
            if pending is not None:  # died inside this mutation
                cls = f"{pending['op']}@{pending['region']}"
                by_class.setdefault(cls, Counter())["crash"] += 1
                results["crash"] += 1
                crashes.append({**pending, "returncode": rc})
                del pending["started"]
                nxt = pending["i"] + 1
            elif rc != 0 and nxt < end:
                raise RuntimeError(f"fuzz worker exited with {rc} between mutations")
            if log is not None:
                log(f"{nxt - start}/{count} mutations, {results['crash']} crashes, {len(findings)} findings")
        os.unlink(md_path)
    finally:
        peer.close()
    return {"mutations": sum(results.values()), "seed": seed, "start": start, "results": dict(results),
            "classes": {k: dict(v) for k, v in sorted(by_class.items())}, "crashes": crashes,
            "findings": findings, "seconds": round(time.monotonic() - t0, 1)}


def _report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ["accepted", "MetadataError", "crash", "untyped"]
    others = sorted({k for v in res["classes"].values() for k in v} - set(cols))
    table = Table(title=f"{res['mutations']} mutations of the NIXL blob in {res['seconds']} s")
    for c in ["operator@region", *cols, *others]:
        table.add_column(c, justify="left" if c == "operator@region" else "right")
    for cls, v in res["classes"].items():
        table.add_row(cls, *[str(v.get(c, 0)) for c in cols + others])
    table.add_row("total", *[str(res["results"].get(c, 0)) for c in cols + others])
    Console().print(table)
    print(f"genuine blob refused after a mutation: {sum(1 for f in res['findings'] if f.get('genuine') != 'ok')}")
    for c in res["crashes"][:20]:
        at = f", offset {c['offset']}" if c.get("offset") is not None else ""
        print(f"crash: mutation {c['i']} ({c['op']} @ {c['region']}{at}), exit status {c['returncode']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=6 * 3600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="zero 8 bytes / set 0xFF at every offset in turn")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--metadata", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    res = campaign(args.count, args.seed, args.start, args.timeout, log=lambda s: print(s, file=sys.stderr),
                   sweep=args.sweep)
    _report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
