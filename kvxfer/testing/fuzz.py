"""Fuzz campaign: mutated agent metadata fed to ``Agent.add_peer``, one subprocess per backend.

``python -m kvxfer.testing.fuzz --count 100000`` splits the count over the backends that
can run here (loopback, nixl, ucx) and prints what each input did. A persistent worker
process per backend holds a victim agent with registered memory and a seed agent whose
metadata is mutated (:mod:`kvxfer.testing.mutate`); the parent sends each mutant and waits
for the outcome with a deadline. Outcomes:

* ``accepted``: ``add_peer`` took it (the peer is removed again before the next input);
* ``typed``: it raised a :class:`~kvxfer.errors.KvxferError`, the only allowed failure;
* ``untyped``: any other exception left ``add_peer`` (a bug);
* ``crash``: the worker died (a signal, an abort): counted, the input saved, a new worker
  started;
* ``hang``: no answer within ``--timeout`` seconds: counted, saved, the worker replaced.

Inputs that crash, hang or escape untyped are written to ``--save DIR`` (with the backend in
the file name) and ``--replay FILE`` feeds one back. Nothing here judges the numbers; the
test that runs a small campaign in CI asserts zero crashes, hangs and untyped errors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..prove import ask, read_exact
from .mutate import mutate

__all__ = ["Result", "run_backend", "run_campaign", "available", "main"]

BACKENDS = ("loopback", "nixl", "ucx")
OUTCOMES = ("accepted", "typed", "untyped", "crash", "hang")
_FRAME = struct.Struct("!cI")


@dataclass
class Result:
    """What one backend's campaign saw."""

    backend: str
    inputs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # typed error classes
    mutations: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    seconds: float = 0.0
    max_ms: float = 0.0  # slowest answer, accepted or refused
    bad: list[str] = field(default_factory=list)  # saved inputs, or descriptions when not saved

    @property
    def failures(self) -> int:
        return self.outcomes["crash"] + self.outcomes["hang"] + self.outcomes["untyped"]

    def as_dict(self) -> dict[str, Any]:
        d = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}
        d["failures"] = self.failures
        return d


# -- the worker (runs in the subprocess) ----------------------------------------------------------
_ADD_TIMEOUT = 90.0  # seconds for one add_peer, below the campaign's 120 s per input in CI
def _worker(backend: str) -> int:
    """Answer seed and mutant requests on the original stdout; native chatter goes to stderr."""
    import faulthandler

    import numpy as np

    from .. import Agent, KvxferError

    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    faulthandler.enable()
    inbox = os.fdopen(os.dup(0), "rb", buffering=0)
    caches = [np.zeros((8, 4096), np.uint8) for _ in range(2)]
    victim = Agent("victim", backend=backend, timeout=5)
    seed = Agent("seed", backend=backend, timeout=5)
    victim.register({"kv": caches[0]}, replicated=True)
    seed.register({"kv": caches[1]}, replicated=True)
    # The unmutated seed must be accepted. add_peer gets more time than the agents' transfers:
    # on a loaded machine, a prover's helper (re)start alone can take tens of seconds.
    victim.remove_peer(victim.add_peer(seed.metadata(), timeout=_ADD_TIMEOUT))

    def send(kind: bytes, payload: bytes) -> None:
        proto.write(_FRAME.pack(kind, len(payload)) + payload)

    while True:
        head = read_exact(inbox, _FRAME.size)
        if head is None:
            return 0
        op, n = _FRAME.unpack(head)
        data = read_exact(inbox, n) or b""
        if op == b"S":
            send(b"S", seed.metadata())
            continue
        try:
            name = victim.add_peer(data, timeout=_ADD_TIMEOUT)
            try:
                victim.plan(name, [0, 7], [7, 0])  # the core must cope with what it accepted
            except KvxferError:
                pass
            victim.remove_peer(name)
            send(b"A", b"")
        except KvxferError as exc:
            send(b"T", type(exc).__name__.encode())
        except BaseException as exc:  # noqa: BLE001 - the point is to report it
            send(b"U", f"{type(exc).__name__}: {exc}"[:500].encode("utf-8", "replace"))


# -- the parent ----------------------------------------------------------------------------------
class _Worker:
    def __init__(self, backend: str, log: Any) -> None:
        env = dict(os.environ, PYTHONFAULTHANDLER="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvxfer.testing.fuzz", "--worker", backend],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        self.seed = b""

    def ask(self, op: bytes, payload: bytes, timeout: float) -> tuple[bytes, bytes] | str:
        """Send one request; ``(kind, payload)``, or ``"crash"``/``"hang"``."""
        return ask(self.proc, op, payload, timeout, kinds=(b"S", b"A", b"T", b"U"), max_reply=1 << 24)

    def stop(self) -> str:
        """End the worker; returns how it ended (for crash reports)."""
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()
        return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


def available() -> list[str]:
    """The backends this machine can fuzz (their plugin loads)."""
    from ..plugin.registry import available_backends

    status = {s.name: s.available for s in available_backends()}
    return [b for b in BACKENDS if status.get(b)]


def run_backend(backend: str, count: int, *, seed: int = 0, timeout: float = 10.0, save: Path | None = None,
                log: Path | None = None, inputs: list[bytes] | None = None) -> Result:
    """Feed ``count`` mutants (or the given ``inputs``) to one backend's worker."""
    res = Result(backend)
    rng = random.Random(f"{seed}:{backend}")
    logf = open(log, "ab") if log else subprocess.DEVNULL
    worker: _Worker | None = None
    t0 = time.monotonic()
    try:
        for i in range(count if inputs is None else len(inputs)):
            if worker is None:
                worker = _start(backend, logf, max(timeout, 60.0))
            how, data = ("replay", inputs[i]) if inputs is not None else mutate(rng, worker.seed)
            res.mutations[how] += 1
            start = time.monotonic()
            got = worker.ask(b"M", data, timeout)
            res.max_ms = max(res.max_ms, (time.monotonic() - start) * 1e3)
            res.inputs += 1
            if isinstance(got, str):
                ended = worker.stop()
                worker = None
                res.restarts += 1
                res.outcomes[got] += 1
                res.bad.append(_keep(save, backend, got, data, f"{how}, worker {ended}"))
                continue
            kind, payload = got
            if kind == b"A":
                res.outcomes["accepted"] += 1
            elif kind == b"T":
                res.outcomes["typed"] += 1
                res.errors[payload.decode()] += 1
            else:
                res.outcomes["untyped"] += 1
                res.bad.append(_keep(save, backend, "untyped", data, payload.decode("utf-8", "replace")))
    finally:
        if worker is not None:
            worker.stop()
        if log:
            logf.close()  # type: ignore[union-attr]
        res.seconds = time.monotonic() - t0
    return res


def _start(backend: str, log: Any, timeout: float, attempts: int = 3) -> _Worker:
    """A fresh worker with its seed metadata; a start that fails is retried, then reported."""
    why = ""
    for _ in range(attempts):
        worker = _Worker(backend, log)
        got = worker.ask(b"S", b"", timeout)
        if not isinstance(got, str):
            worker.seed = got[1]
            return worker
        why = f"{got}, {worker.stop()}"
    raise RuntimeError(f"{backend} fuzz worker failed to start {attempts} times ({why}); run with --log FILE")


def _keep(save: Path | None, backend: str, what: str, data: bytes, why: str) -> str:
    if save is None:
        return f"{backend} {what}: {why}"
    save.mkdir(parents=True, exist_ok=True)
    path = save / f"{backend}-{what}-{hashlib.sha256(data).hexdigest()[:16]}.bin"
    path.write_bytes(data)
    return f"{path} ({why})"


def run_campaign(count: int, backends: list[str] | None = None, **kw: Any) -> list[Result]:
    """Split ``count`` evenly over ``backends`` (default: every one that can run here)."""
    backends = backends or available()
    if not backends:
        raise RuntimeError("no backend available to fuzz")
    share, extra = divmod(count, len(backends))
    return [run_backend(b, share + (i < extra), **kw) for i, b in enumerate(backends)]


def _print(results: list[Result]) -> None:
    from ..table import Column, count, print_table

    rows = [{"backend": r.backend, "inputs": r.inputs, **{k: r.outcomes[k] for k in OUTCOMES},
             "restarts": r.restarts, "rate": r.inputs / max(r.seconds, 1e-9), "slowest": r.max_ms} for r in results]
    print_table(rows, ["backend", Column("inputs", fmt=count), *(Column(k, fmt=count) for k in OUTCOMES), "restarts",
                       Column("rate", "inputs/s", "{:,.0f}"), Column("slowest", "slowest ms", "{:,.1f}")],
                title="add_peer fuzz campaign (mutated agent metadata, subprocess workers)")
    for r in results:
        print(f"{r.backend}: typed errors {dict(r.errors.most_common())}; mutations {dict(r.mutations)}")
        for line in r.bad[:20]:
            print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.testing.fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10_000, help="mutated inputs in total, split over the backends")
    ap.add_argument("--backends", default=None, help=f"comma-separated, from {','.join(BACKENDS)} (default: "
                                                    "every one that can run here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds one input may take before it is a hang")
    ap.add_argument("--save", type=Path, default=None, help="directory for inputs that crash, hang or escape")
    ap.add_argument("--log", type=Path, default=None, help="append the workers' stderr here (default: discard)")
    ap.add_argument("--replay", type=Path, nargs="*", default=None, help="feed these saved inputs instead")
    ap.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    backends = args.backends.split(",") if args.backends else None
    kw = dict(seed=args.seed, timeout=args.timeout, save=args.save, log=args.log)
    backends = backends or available()
    inputs = [p.read_bytes() for p in args.replay] if args.replay is not None else None
    share, extra = divmod(args.count, len(backends))
    results = []
    for i, backend in enumerate(backends):  # reported as each finishes: a long run may be cut short
        results.append(run_backend(backend, share + (i < extra), inputs=inputs, **kw))
        _print(results[-1:])
        if args.json:
            args.json.write_text(json.dumps([r.as_dict() for r in results], indent=2))
    if len(results) > 1:
        _print(results)
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
