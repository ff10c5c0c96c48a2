"""Public-API fuzz: random calls with wrong types, shapes, huge lists, None and wrong objects.

README promises that every error is a :class:`~kvxfer.errors.KvxferError` subclass. This
campaign holds a working pair of agents (pattern in the source, 0xAA in the destination), an
:class:`~kvxfer.Owner` and a :class:`~kvxfer.Store`, and calls public functions and methods
with arguments drawn from :data:`VALUES` mixed with valid ones. Outcomes per call:

* ``ok``: it returned (a returned transfer is waited for, its typed failure is ``typed``);
* ``typed``: a :class:`KvxferError` left the call, the only allowed failure;
* ``untyped``: anything else left it (a bug; the call and the exception are kept).

After the calls, the pair must still move the right bytes (a fixed read checked against the
source). ``python -m kvxfer.testing.api_fuzz --count 10000`` runs every backend that can run
here, each in a process of its own, and prints the numbers (RELIABILITY.md, "Typed edges").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import KvxferError

__all__ = ["ApiResult", "VALUES", "run", "main"]

BLOCKS, ROW = 16, 256


def _values() -> list[Any]:
    """Hostile arguments, one of each kind a caller gets wrong (built once: some are large)."""
    return [None, True, False, 0, 1, -1, 2**63, 2**64 + 5, -(2**70), 1.5, float("nan"), float("inf"), 1e300,
            "", "x", "prefill", "\0", "é" * 300, "x" * 100_000, b"", b"x", b"\xff" * 70_000, bytearray(b"ab"),
            memoryview(b"abc"), [], [None], [0, True], [np.True_, 5], [1.0], ["1"], [[0], [1, 2]], [0] * 100_000,
            list(range(200_000)), [-1], [BLOCKS], [2**63], (0, 1), {0, 1}, {"a": 1}, {"prefill": [0]},
            {"prefill": None}, {None: [0]}, range(3), range(10**9), np.array(3), np.zeros((2, 2), np.int64),
            np.zeros(3, np.float16), np.array([2**64 - 1], np.uint64), np.array([0, 1], np.int8),
            np.array(["a"]), np.array([None]), np.zeros(0, np.int64), np.arange(10**6), object(), type,
            lambda *a: 1 / 0, Exception("x"), np.zeros((4, 16), np.uint8), np.zeros((4, 2, 3, 4), np.float32),
            {"kv": None}, {"kv": np.zeros(5, np.uint8)}, {"kv": np.zeros((4, 16), object)}, {1: np.zeros((4, 8))},
            {"kv": (np.zeros((4, 8)), np.zeros((5, 8)))}, {"kv": np.zeros((4, 16), np.uint8)[:, ::2]}]


VALUES = _values()


@dataclass
class ApiResult:
    """What one backend's calls did."""

    backend: str
    calls: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # typed error classes
    untyped: list[str] = field(default_factory=list)  # "call(args): Type: message", the first 50
    seconds: float = 0.0
    intact: bool = False  # the pair moved the right bytes after the calls


class _World:
    """A working pair, an owner over a third agent, a store: what the calls aim at."""

    def __init__(self, backend: str, tmp: str) -> None:
        import kvxfer

        self.kvxfer, self.backend, self.tmp = kvxfer, backend, tmp
        self.src = np.arange(BLOCKS * ROW, dtype=np.uint32).astype(np.uint8).reshape(BLOCKS, ROW)
        self.dst = np.full((BLOCKS, ROW), 0xAA, np.uint8)
        self.a = kvxfer.Agent("prefill", backend=backend, timeout=5.0)
        self.b = kvxfer.Agent("decode", backend=backend, timeout=5.0)
        self.a.register({"kv": self.src})
        self.b.register({"kv": self.dst})
        self.md = self.a.metadata()
        self.b.add_peer(self.md)
        self.c = kvxfer.Agent("owned", backend=backend, timeout=5.0)
        self.c.register({"kv": np.full((BLOCKS, ROW), 0xAA, np.uint8)})
        self.owner = kvxfer.Owner(self.c)
        self.owner.add_peer(self.md).result(30)
        self.store = kvxfer.Store(f"{tmp}/store", capacity=BLOCKS * 4096, layout=self.b.spec, timeout=5.0)

    def close(self) -> None:
        self.owner.close()
        self.store.close()
        self.b.close()
        self.a.close()

    def ready(self) -> None:
        """Undo what valid calls changed (a removed peer, a deregistered cache)."""
        if "prefill" not in self.b.peers:
            self.b.add_peer(self.md)
        if self.b.spec is None:
            self.b.register({"kv": self.dst})

    def intact(self) -> bool:
        """The pair and the owner still move the right bytes, and nothing else."""
        self.ready()
        self.dst[:] = 0xAA
        self.b.read("prefill", [1, 4], [9, 2]).wait(10)
        want = np.full_like(self.dst, 0xAA)
        want[[1, 4]] = self.src[[9, 2]]
        owned = self.c._held["kv"]
        owned[:] = 0xAA
        if "prefill" not in self.c.peers:
            self.owner.add_peer(self.md).result(30)
        self.owner.read("prefill", [1, 4], [9, 2]).wait(10)  # a dead owner's loop fails this
        return bool((self.dst == want).all() and (owned == want).all())


def _under(tmp: str, path: str | bytes) -> str | bytes:
    """A hostile relative path ("x", "prefill") anchored in the campaign's temporary folder: with
    a valid capacity and layout it makes a real store, which once landed in the caller's working
    directory (the repository root, under pytest). Absolute paths and their bytes stay as drawn."""
    return os.path.join(os.fsencode(tmp) if isinstance(path, bytes) else tmp, path)


def _targets(w: _World) -> list[tuple[str, int, Callable[..., Any], tuple[Any, ...]]]:
    """``(name, arity, call, valid arguments)``: each call gets each argument valid or hostile."""
    kv, b, a, o, s = w.kvxfer, w.b, w.a, w.owner, w.store

    def fresh_register(x: Any, opt: Any) -> Any:
        with kv.Agent("r", backend=w.backend) as r:
            return r.register(x, **(opt if isinstance(opt, dict) and all(isinstance(k, str) for k in opt) else {}))

    def fresh_agent(name: Any, timeout: Any, token: Any) -> Any:
        kv.Agent(name, backend=w.backend, timeout=timeout, token=token).close()

    def fresh_store(path: Any, capacity: Any, layout: Any) -> Any:
        kv.Store(_under(w.tmp, path) if isinstance(path, (str, bytes)) and path else f"{w.tmp}/s{random.random()}",
                 capacity=capacity, layout=layout).close()

    spec = b.spec
    return [
        ("read", 4, lambda p, l, r, n: b.read(p, l, r, n), ("prefill", [0], [1], None)),
        ("write", 4, lambda p, l, r, n: b.write(p, l, r, n), ("prefill", [0], [1], b"n")),
        ("read.expect", 2, lambda l, e: b.read("prefill", l, l, expect=e), ([2], None)),
        ("plan", 4, lambda p, l, r, op: b.plan(p, l, r, op), ("prefill", [0], [1], "read")),
        ("read_many", 3, lambda l, m, n: b.read_many(l, m, n), ([0], {"prefill": [1]}, None)),
        ("write_many", 2, lambda l, m: b.write_many(l, m), ([0], {"prefill": [1]})),
        ("add_peer", 3, lambda m, t, c: b.add_peer(m, timeout=t, canary=c), (w.md, 5.0, None)),
        ("add_source", 1, lambda m: b.add_source(m), (w.md,)),
        ("check", 1, lambda p: b.check(p), ("prefill",)),
        ("remove_peer", 1, lambda p: b.remove_peer(p), ("prefill",)),
        ("notify", 2, lambda p, m: b.notify(p, m), ("prefill", b"m")),
        ("digest", 3, lambda bl, c, al: b.digest(bl, cells=c, algorithm=al), ([0], None, "auto")),
        ("cells_for", 1, lambda p: b.cells_for(p), ("prefill",)),
        ("register", 2, fresh_register, ({"kv": np.zeros((4, 16), np.uint8)}, {})),
        ("agent", 3, fresh_agent, ("n", 5.0, None)),
        ("offload", 3, lambda st, l, k: b.offload(st, l, k), (s, [0], [b"k0"])),
        ("restore", 3, lambda st, k, l: b.restore(st, k, l), (s, [b"k0"], [0])),
        ("store.lookup", 1, lambda k: s.lookup(k), ([b"k0"],)),
        ("store.prefix", 1, lambda k: s.prefix(k), ([b"k0"],)),
        ("store.discard", 1, lambda k: s.discard(k), ([b"zz"],)),
        ("store.offload", 4, lambda sp, l, k, t: s.offload(sp, l, k, timeout=t), (b, [0], [b"k0"], 5.0)),
        ("store.restore", 4, lambda k, sp, l, t: s.restore(k, sp, l, timeout=t), ([b"k0"], b, [0], 5.0)),
        ("Store", 3, fresh_store, ("", 1 << 16, spec)),
        ("owner.read", 5, lambda p, l, r, n, t: o.read(p, l, r, n, timeout=t), ("prefill", [0], [1], None, 5.0)),
        ("owner.write", 4, lambda p, l, r, n: o.write(p, l, r, n), ("prefill", [0], [1], None)),
        ("owner.notify", 2, lambda p, m: o.notify(p, m), ("prefill", b"m")),
        ("owner.route", 3, lambda k, f, e: o.route(k, f, expect=e), ("r", lambda: w.md, None)),
        ("owner.connect", 1, lambda k: o.connect(k), ("prefill",)),
        ("kvxfer.plan", 5, lambda x, y, l, r, op: kv.plan(x, y, l, r, op), (spec, a.spec, [0], [1], "read")),
        ("spec_from_arrays", 2, lambda x, opt: kv.spec_from_arrays(x, **(opt if isinstance(opt, dict) and all(
            isinstance(k, str) for k in opt) else {})), ({"kv": np.zeros((4, 16), np.uint8)}, {})),
        ("spec_from_pointers", 3, lambda sp, n, m: kv.spec_from_pointers(sp, num_blocks=n, members=m),
         ((w.src.ctypes.data, w.src.nbytes, 0), BLOCKS, [("kv", ROW)])),
        ("wait", 1, lambda t: b.read("prefill", [5], [6]).wait(t), (5.0,)),
    ]


def _settle(x: Any, timeout: float) -> None:
    """Wait for what a call returned, so that its failure is seen (and nothing outlives it)."""
    if hasattr(x, "wait") and hasattr(x, "status"):
        x.wait(timeout)
    elif type(x).__name__ == "OwnedFuture":
        x.result(timeout)


def run(backend: str, count: int, *, seed: int = 0, hostile: float = 0.5, settle: float = 10.0) -> ApiResult:
    """``count`` random calls on ``backend``; each argument is hostile with probability ``hostile``.
    ``settle``: how long a returned transfer or owner future may take (a run that expects a dead
    owner's loop waits that long for the first call it ends up with)."""
    res = ApiResult(backend)
    rng = random.Random(seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvxfer-api-fuzz-") as tmp:
        w = _World(backend, tmp)
        try:
            targets = _targets(w)
            for _ in range(count):
                name, arity, call, valid = rng.choice(targets)
                args = tuple(rng.choice(VALUES) if rng.random() < hostile else valid[i] for i in range(arity))
                res.calls += 1
                try:
                    _settle(call(*args), settle)
                    res.outcomes["ok"] += 1
                except KvxferError as exc:
                    res.outcomes["typed"] += 1
                    res.errors[type(exc).__name__] += 1
                except Exception as exc:  # noqa: BLE001 - what the campaign looks for
                    res.outcomes["untyped"] += 1
                    if len(res.untyped) < 50:
                        shown = ", ".join(f"{a!r:.40}" for a in args)
                        res.untyped.append(f"{name}({shown}): {type(exc).__name__}: {str(exc)[:200]}")
                w.ready()
            try:
                res.intact = w.intact()
            except Exception as exc:  # noqa: BLE001 - a pair or owner the calls broke
                res.untyped.append(f"after the calls: {type(exc).__name__}: {str(exc)[:200]}")
        finally:
            w.close()
    res.seconds = time.monotonic() - t0
    return res


def _available() -> list[str]:
    from .fuzz import available

    return available()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.testing.api_fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=10_000, help="calls per backend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", action="append", help="only these (default: every backend that can run)")
    ap.add_argument("--json", action="store_true", help="(internal) run one backend here, print JSON")
    args = ap.parse_args(argv)
    if args.json:
        r = run(args.backend[0], args.count, seed=args.seed)
        print(json.dumps({"backend": r.backend, "calls": r.calls, "outcomes": dict(r.outcomes), "seconds": r.seconds,
                          "errors": dict(r.errors), "untyped": r.untyped, "intact": r.intact}))
        return 0
    bad = 0
    print(f"{'backend':<10} {'calls':>7} {'ok':>7} {'typed':>7} {'untyped':>8} {'intact':>7} {'seconds':>8}")
    for backend in args.backend or _available():
        p = subprocess.run([sys.executable, "-m", "kvxfer.testing.api_fuzz", "--json", "--backend", backend,
                            "--count", str(args.count), "--seed", str(args.seed)], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{backend:<10} the run ended with status {p.returncode}:\n{p.stderr[-2000:]}")
            bad += 1
            continue
        d = json.loads(p.stdout.strip().splitlines()[-1])
        o = d["outcomes"]
        print(f"{backend:<10} {d['calls']:>7} {o.get('ok', 0):>7} {o.get('typed', 0):>7} {o.get('untyped', 0):>8} "
              f"{str(d['intact']):>7} {d['seconds']:>8.1f}")
        for line in d["untyped"]:
            print(f"  {line}")
        bad += int(bool(o.get("untyped")) or not d["intact"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
