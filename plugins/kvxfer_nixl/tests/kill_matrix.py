"""Kill the NIXL peer mid-transfer, many times: every outcome must be DONE with every byte
verified, or a typed error within the deadline; then a restarted peer must work.

Each trial starts a READ (we pull the peer's blocks) or a WRITE (we push ours into the
peer) while a timer SIGKILLs the peer process (``python -m kvxfer.testing.peer``) after a
random delay drawn up to the transfer's measured duration, so the kill lands while the
transfer is being posted (shared memory and TCP copy inside ``post``) or in flight. Trial
``i`` of ``n`` draws its delay in the ``i``-th ``n``-th of that duration (stratified), so a few
trials still spread their kills from the post's start to the transfer's end:

* ``done``: DONE, and every requested block holds exactly the expected bytes while every
  other block holds what it held before. For a READ we check our own memory against the
  peer's seeded contents, recomputed here. A WRITE that finished before the kill is checked
  in the peer; one that reports DONE after the kill cannot be (the peer is gone): it is
  counted as ``done-after-kill``.
* ``error``: a :class:`~kvxfer.KvxferError` subclass (the type and the time from the kill
  are recorded); ``timeout`` when that error is the deadline's.
* ``false-done``: DONE with wrong bytes, ``untyped``: any other exception. Both are failures.

After each kill a new peer process starts under the same name; it is added again and one
verified READ and WRITE must succeed before the next trial.

Usage::

    python plugins/kvxfer_nixl/tests/kill_matrix.py --trials 100 --json kill.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from kvxfer.testing.peer import PeerProcess

SENTINEL = 0xAA
GEOM: dict[str, Any] = {"num_blocks": 64, "num_layers": 4, "page": 256 << 10}  # 1 MiB rows, 64 MiB per side
PEER_SEED = 11
LOCAL_SEED = 12


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.pathsep.join([root, os.path.join(root, "plugins"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "ERROR",
            "UCX_LOG_LEVEL": "fatal"}


class Peer(PeerProcess):
    """A peer agent in its own process (:mod:`kvxfer.testing.peer`): a seeded cache (``seed``) or the sentinel."""

    def __init__(self, seed: int | None, timeout: float = 120.0) -> None:
        args = ["--backend", "nixl", "--name", "peer", "--cache", "packed", "--blocks", str(GEOM["num_blocks"]),
                "--layers", str(GEOM["num_layers"]), "--page", str(GEOM["page"]),
                "--replicated"] + ([] if seed is None else ["--seed", str(seed)])
        super().__init__(args, timeout=timeout, env=_env())

    def pages(self) -> np.ndarray:
        raw = base64.b64decode(self.call({"cmd": "pages"})["pages"])
        return np.frombuffer(raw, np.uint8).reshape(GEOM["num_layers"], GEOM["num_blocks"], GEOM["page"])


class Matrix:
    """One local agent, one peer process at a time, trials of one op."""

    def __init__(self, timeout: float = 20.0) -> None:
        import kvxfer
        from kvxfer.testing.buffers import make_cache

        self.kvxfer = kvxfer
        self.timeout = timeout
        self.reference = make_cache("packed", seed=PEER_SEED, **GEOM).layer_pages()  # what the peer holds
        self.cache = make_cache("packed", **GEOM)
        self.source = make_cache("packed", seed=LOCAL_SEED, **GEOM).layer_pages()  # what we write
        self.agent = kvxfer.Agent("local", backend="nixl", timeout=timeout)
        self.agent.register(self.cache.views, replicated=True)
        self.rng = np.random.default_rng(0)
        self.peer: Peer | None = None
        self.name = ""
        self.model: np.ndarray | None = None  # what the peer's pages should hold (WRITE)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
        self.agent.close()

    # -- helpers --------------------------------------------------------------------------
    def _start_peer(self, op: str) -> None:
        if self.peer is not None:
            self.peer.close()
        self.peer = Peer(PEER_SEED if op == "READ" else None)
        self.model = np.full_like(self.reference, SENTINEL)
        self.name = self.agent.add_peer(self.peer.metadata)
        if op == "WRITE":
            self.peer.call({"cmd": "add_peer", "metadata": base64.b64encode(self.agent.metadata()).decode()})

    def _fill_local(self, op: str) -> None:
        """READ: our blocks to the sentinel; WRITE: our blocks to the source pattern."""
        rows = self.cache.storages[0]
        L, P = GEOM["num_layers"], GEOM["page"]
        if op == "READ":
            rows[...] = SENTINEL
        else:
            rows[...] = self.source.transpose(1, 0, 2).reshape(GEOM["num_blocks"], L * P)

    def _check_read(self, dst: np.ndarray, src: np.ndarray) -> bool:
        got = self.cache.layer_pages()
        if not np.array_equal(got[:, dst], self.reference[:, src]):
            return False
        rest = np.setdiff1d(np.arange(GEOM["num_blocks"]), dst)
        return bool((got[:, rest] == SENTINEL).all())

    def _check_write(self, pages: np.ndarray, src: np.ndarray, dst: np.ndarray) -> bool:
        """The peer holds what earlier WRITEs to it put there, plus this one."""
        assert self.model is not None
        self.model[:, dst] = self.source[:, src]
        return bool(np.array_equal(pages, self.model))

    def _ids(self) -> tuple[np.ndarray, np.ndarray]:
        n = int(self.rng.integers(GEOM["num_blocks"] // 2, GEOM["num_blocks"] + 1))
        return (self.rng.permutation(GEOM["num_blocks"])[:n], self.rng.permutation(GEOM["num_blocks"])[:n])

    def _verified_round(self, op: str) -> float:
        """One transfer with a live peer, verified; returns its duration."""
        assert self.peer is not None
        self._fill_local(op)
        a, b = self._ids()
        t0 = time.perf_counter()
        if op == "READ":
            self.agent.read(self.name, a, b).wait(self.timeout)
            took = time.perf_counter() - t0
            ok = self._check_read(a, b)
        else:
            self.agent.write(self.name, a, b).wait(self.timeout)
            took = time.perf_counter() - t0
            ok = self._check_write(self.peer.pages(), a, b)
        if not ok:
            raise AssertionError(f"{op} with a live peer moved wrong bytes")
        return took

    # -- one trial ------------------------------------------------------------------------
    def trial(self, op: str, stratum: tuple[int, int] = (0, 1)) -> dict[str, Any]:
        """Kill the peer from a timer while the transfer is posted or in flight, after a delay
        drawn in the ``i``-th of ``n`` equal slices of a clean transfer's duration (``stratum``)."""
        from kvxfer.errors import KvxferError, TransferTimeoutError

        if self.peer is None or self.peer.proc.poll() is not None:
            self._start_peer(op)
        peer = self.peer
        assert peer is not None
        duration = self._verified_round(op)
        self._fill_local(op)
        a, b = self._ids()
        i, n = stratum
        delay = float(duration * (i + self.rng.uniform(0, 1)) / n)
        rec: dict[str, Any] = {"op": op, "blocks": int(len(a)), "delay_ms": round(delay * 1e3, 2),
                               "duration_ms": round(duration * 1e3, 2)}
        lock = threading.Lock()
        state: dict[str, float | None] = {"killed": None}

        def kill() -> None:
            with lock:
                if state["killed"] is None:
                    peer.proc.kill()
                    state["killed"] = time.perf_counter()

        timer = threading.Timer(delay, kill)
        timer.start()
        try:
            t = self.agent.read(self.name, a, b) if op == "READ" else self.agent.write(self.name, a, b)
            t.wait(self.timeout)
            outcome = "done"
        except TransferTimeoutError as exc:
            outcome, rec["error"] = "timeout", type(exc).__name__
        except KvxferError as exc:
            outcome, rec["error"] = "error", type(exc).__name__
        except Exception as exc:
            outcome, rec["error"] = "untyped", f"{type(exc).__name__}: {exc}"[:200]
        ended = time.perf_counter()
        with lock:
            killed = state["killed"]
            if killed is None:
                state["killed"] = -1.0  # too late now: the timer will not kill
        timer.cancel()
        rec["when"] = "after kill" if killed is not None else "before kill"
        if killed is not None and outcome != "done":
            rec["after_kill_ms"] = round((ended - killed) * 1e3, 2)
        if outcome == "done":
            if op == "READ":
                outcome = "done" if self._check_read(a, b) else "false-done"
            elif killed is None:
                outcome = "done" if self._check_write(peer.pages(), a, b) else "false-done"
            else:
                outcome = "done-after-kill"  # the peer is gone: nothing left to check
        rec["outcome"] = outcome
        peer.kill()
        # the restarted peer must work at once
        self._start_peer(op)
        try:
            self._verified_round(op)
            rec["restart"] = "ok"
        except Exception as exc:
            rec["restart"] = f"{type(exc).__name__}: {exc}"[:200]
        return rec


def run(trials: int, ops: tuple[str, ...] = ("READ", "WRITE"), timeout: float = 20.0,
        log: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"trials": trials, "geometry": GEOM, "records": [], "counts": {}}
    for op in ops:
        m = Matrix(timeout)
        try:
            for i in range(trials):
                rec = m.trial(op, (i, trials))
                out["records"].append(rec)
                if log is not None:
                    log(f"{op} {i + 1}/{trials}: {rec}")
        finally:
            m.close()
        recs = [r for r in out["records"] if r["op"] == op]
        counts = Counter(r["outcome"] for r in recs)
        counts.update(f"error:{r['error']}" for r in recs if r["outcome"] == "error")
        counts["restart-failed"] = sum(r["restart"] != "ok" for r in recs)
        errs = [r["after_kill_ms"] for r in recs if r["outcome"] in ("error", "timeout")]
        out["counts"][op] = dict(counts)
        out["counts"][op]["error_ms_max"] = max(errs) if errs else None
        out["counts"][op]["error_ms_median"] = float(np.median(errs)) if errs else None
    return out


def failures(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Trials that break the rule: wrong bytes, untyped errors, or a restarted peer that fails."""
    return [r for r in res["records"] if r["outcome"] in ("false-done", "untyped") or r["restart"] != "ok"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100, help="per op")
    ap.add_argument("--ops", default="READ,WRITE")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args.trials, tuple(args.ops.split(",")), args.timeout, log=lambda s: print(s, file=sys.stderr))
    for op, c in res["counts"].items():
        print(op, json.dumps(c))
    bad = failures(res)
    print(f"failures: {len(bad)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
