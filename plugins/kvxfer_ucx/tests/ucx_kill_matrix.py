"""Kill the peer in the middle of a READ or WRITE, over and over, and check every outcome.

Each trial: a peer process (an Agent on the UCX backend whose KV memory is a file in
/dev/shm, so its bytes can be read after it died) is added; this process starts a READ or a
WRITE of many scattered rows and a timer SIGKILLs the peer at a random moment. The outcome
must be either DONE with every byte verified (READ: our rows equal the peer's pattern; WRITE:
the dead peer's file holds exactly what we wrote) or a typed :class:`kvxfer.KvxferError`
before the deadline. Then this same agent must still move verified bytes with a peer that
stayed alive all along and with the restarted peer (the victim of the next trial); at the
end of each path, with a peer it has never seen.

    python plugins/kvxfer_ucx/tests/ucx_kill_matrix.py --trials 100            # 3 paths
    python plugins/kvxfer_ucx/tests/ucx_kill_matrix.py --paths copy --trials 5 --json
    python plugins/kvxfer_ucx/tests/ucx_kill_matrix.py --zombies --trials 10         # unreaped peers
    python plugins/kvxfer_ucx/tests/ucx_kill_matrix.py --reverse --paths rma --rows 128 --trials 10

``--reverse`` kills the initiator instead, this agent being its target (``ucx_kill_reverse.py``);
``--control`` runs it without the request zeroing that keeps the target alive (``kvxfer_ucx._requests``),
``--control-wedge`` without the skipping of a dead writer's receive-queue slot that keeps it serving
(``kvxfer.ucxabi.mmqueue``).

``--set PATH=JSON`` redefines a path's backend options, e.g. to run the matrix against
another tree (``PYTHONPATH``) whose backend takes other options.
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from kvxfer.testing.lines import Channel, Inbox

PAGE = 64 << 10  # one layer page; a row is LAYERS pages
LAYERS = 16
ROW = PAGE * LAYERS
PATHS: dict[str, dict[str, Any]] = {
    "copy": {},  # defaults: the same-host copy path
    "rma": {"same_host_copy": False},  # UCX RMA, default (same-host) transports
    "rma-tcp": {"same_host_copy": False, "trusted_network": True, "tls": "self,tcp"},
}
EXPECTED_PATH = {"copy": "same-host-copy", "rma": "ucx-rma", "rma-tcp": "ucx-rma"}


def kill_delay(rng: random.Random, span: float, trial: int, trials: int) -> float:
    """A kill delay for ``trial`` (READ on even trials, WRITE on odd ones), stratified per op:
    that op's ``k``-th of ``n`` kills is drawn in the ``k``-th ``n``-th of ``span``, so a few
    trials still reach from the transfer's start to its end for both ops."""
    n = len(range(trial % 2, trials, 2))
    return span * (trial // 2 + rng.uniform(0, 1)) / n


def pattern(rows: int, seed: int) -> np.ndarray:
    """Cheap, position- and seed-dependent bytes: misplaced or stale rows do not match."""
    words = np.arange(rows * ROW // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed + 1)
    return words.view(np.uint8).reshape(rows, ROW)


def cache(buf: np.ndarray) -> dict[str, np.ndarray]:
    return {f"layer.{i}": buf[:, i * PAGE:(i + 1) * PAGE] for i in range(LAYERS)}


# ---------------------------------------------------------------------------------------------
# the peer process

def serve(path: str, name: str, rows: int, seed: int, backing: str) -> None:
    import kvxfer

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # UCX may print on fd 1: keep the reply channel private
    with open(backing, "w+b") as f:
        f.truncate(rows * ROW)
        mem = mmap.mmap(f.fileno(), rows * ROW)
    buf = np.frombuffer(mem, dtype=np.uint8).reshape(rows, ROW)
    buf[:] = pattern(rows, seed)
    agent = kvxfer.Agent(name, backend="ucx", **PATHS[path])
    agent.register(cache(buf), replicated=True)
    out.write(json.dumps({"metadata": base64.b64encode(agent.metadata()).decode(), "pid": os.getpid()}) + "\n")
    out.flush()
    inbox = Inbox(sys.stdin.fileno())
    while True:  # keep progressing (software RMA needs the target to) until stdin closes
        agent.progress()
        try:
            inbox.line(0.0005)  # a line is ignored: only the end of input matters
        except TimeoutError:
            continue
        except EOFError:
            break
    agent.close()


class Peer:
    def __init__(self, path: str, rows: int, seed: int, workdir: str, name: str = "target") -> None:
        self.backing = os.path.join(workdir, f"peer-{seed}")
        self.seed = seed
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", path, "--name", name, "--rows", str(rows),
                                      "--seed", str(seed), "--backing", self.backing,
                                      f"--set={path}={json.dumps(PATHS[path])}"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        try:
            hello = Channel(self.proc).read(60)
        except (EOFError, TimeoutError) as exc:
            self.proc.kill()
            raise RuntimeError("peer did not start") from exc
        self.metadata = base64.b64decode(hello["metadata"])

    def memory(self, rows: int) -> np.ndarray:
        return np.fromfile(self.backing, dtype=np.uint8).reshape(rows, ROW)

    def kill(self, reap: bool = True) -> None:
        """SIGKILL, then reap at once as a supervisor would, unless ``reap`` is False (the
        dead process then stays a zombie until the trial ends)."""
        self.proc.kill()
        if reap:
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if os.path.exists(self.backing):
            os.unlink(self.backing)


# ---------------------------------------------------------------------------------------------
# the matrix

def _read_verified(agent: Any, name: str, local: np.ndarray, peer_seed: int, rows: int, timeout: float) -> float:
    """Read every row (reversed), check every byte; returns the seconds the READ took."""
    local[:] = 0xAA
    blocks = np.arange(rows)
    t0 = time.perf_counter()
    agent.read(name, blocks, blocks[::-1]).wait(timeout)
    took = time.perf_counter() - t0
    if not np.array_equal(local, pattern(rows, peer_seed)[::-1]):
        raise AssertionError(f"READ from {name} reported DONE with wrong bytes")
    return took


def run_path(path: str, trials: int, rows: int, timeout: float, seed: int, workdir: str,
             reap: bool = True) -> dict[str, Any]:
    import kvxfer

    rng = random.Random(seed)
    agent = kvxfer.Agent("initiator", backend="ucx", timeout=timeout, **PATHS[path])
    local = np.full((rows, ROW), 0xAA, dtype=np.uint8)
    agent.register(cache(local), replicated=True)
    live = Peer(path, rows, 1, workdir, "live")
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    false_done = untyped = 0
    worst_error_s = 0.0
    victim: Peer | None = None
    stuck = ""  # why the agent stopped working, if it did
    kills = mid_flight = 0
    timings: list[tuple[float, float]] = []  # (kill delay, time to the outcome) per trial
    try:
        live_name = agent.add_peer(live.metadata)
        if agent.backend.peer_path(live_name)[0] != EXPECTED_PATH[path]:  # type: ignore[attr-defined]
            raise AssertionError(f"{path}: live peer got path {agent.backend.peer_path(live_name)}")  # type: ignore[attr-defined]
        _read_verified(agent, live_name, local, live.seed, rows, timeout)  # warm-up: plans, lists
        duration = float("inf")
        for _ in range(3):  # the fastest clean transfer: kills drawn within it land mid-flight
            duration = min(duration, _read_verified(agent, live_name, local, live.seed, rows, timeout))
        victim = Peer(path, rows, 100, workdir)
        estimate = duration
        for trial in range(trials):
            name = agent.add_peer(victim.metadata)
            op = "READ" if trial % 2 == 0 else "WRITE"
            perm = np.array(rng.sample(range(rows), rows))
            if op == "READ":
                local[:] = 0xAA
            else:
                local[:] = pattern(rows, 10_000 + trial)
            sent = local.copy()
            delay = kill_delay(rng, estimate, trial, trials)
            killed_at: list[float] = []

            def kill(v: Peer = victim) -> None:
                killed_at.append(time.monotonic())
                v.kill(reap)

            # The timer starts before the request is made: planning and posting are part of
            # the transfer, and on software RMA most of its time.
            killer = threading.Timer(delay, kill)
            start = time.monotonic()
            killer.start()
            try:
                (agent.read if op == "READ" else agent.write)(name, np.arange(rows), perm).wait(timeout)
                outcome = "DONE"
            except kvxfer.KvxferError as exc:
                outcome = type(exc).__name__
                errors[outcome] += 1
                worst_error_s = max(worst_error_s, time.monotonic() - start)
            except Exception as exc:  # noqa: BLE001 - counted: the matrix's point
                outcome = f"untyped {type(exc).__name__}"
                untyped += 1
            ended = time.monotonic()
            killer.join()
            victim.proc.wait()
            kills += 1
            # Mid-flight: the kill came before the outcome was known (DONE or error); a kill
            # after DONE tests nothing but the recovery.
            mid_flight += killed_at[0] < ended
            timings.append((round(delay, 3), round(ended - start, 3)))
            if outcome == "DONE":
                counts[f"{op} DONE, {'kill first' if killed_at[0] < ended else 'kill after'}"] += 1
            else:
                counts[f"{op} error"] += 1
            if outcome == "DONE":
                if op == "READ":
                    ok = np.array_equal(local, pattern(rows, victim.seed)[perm])
                else:
                    ok = np.array_equal(victim.memory(rows)[perm], sent)
                false_done += not ok
            victim.stop()
            # the same agent keeps working: with the peer that stayed alive, and with the restart
            victim = Peer(path, rows, 101 + trial, workdir)
            try:
                _read_verified(agent, live_name, local, live.seed, rows, timeout)
                name = agent.add_peer(victim.metadata)
                # a clean transfer with the next victim: the window the next kill is drawn in
                estimate = _read_verified(agent, name, local, victim.seed, rows, timeout)
            except (kvxfer.KvxferError, AssertionError) as exc:
                stuck = f"after kill {trial + 1}: {type(exc).__name__}: {exc}"[:300]
                print(f"{path}: stuck {stuck}", file=sys.stderr, flush=True)
                break
        if not stuck:
            fresh = Peer(path, rows, 7, workdir, "fresh")
            try:
                fresh_name = agent.add_peer(fresh.metadata)
                _read_verified(agent, fresh_name, local, fresh.seed, rows, timeout)
            except (kvxfer.KvxferError, AssertionError) as exc:
                stuck = f"with a new peer: {type(exc).__name__}: {exc}"[:300]
            finally:
                fresh.stop()
    finally:
        if victim is not None:
            victim.stop()
        live.stop()
        agent.close()
    return {"path": path, "reaped": reap, "trials": kills, "mid_flight": mid_flight, "outcomes": dict(counts), "errors": dict(errors),
            "false_done": false_done, "untyped": untyped, "worst_error_s": round(worst_error_s, 3), "timeout_s": timeout,
            "clean_read_s": round(duration, 4), "recovered": not stuck, "stuck": stuck,
            "timings": timings}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve")
    ap.add_argument("--initiate", help="run as a reversed matrix's initiator peer")
    ap.add_argument("--reverse", action="store_true", help="kill the initiating peer; this agent is the target")
    ap.add_argument("--control", action="store_true",
                    help="with --reverse: this agent's UCP requests not zeroed (kvxfer_ucx._requests), to show the crash")
    ap.add_argument("--control-wedge", action="store_true",
                    help="with --reverse: no skipping of a dead writer's slot (kvxfer.ucxabi.mmqueue), to show the wedge")
    ap.add_argument("--backing")
    ap.add_argument("--name", default="target")
    ap.add_argument("--zombies", action="store_true", help="do not reap killed peers until the outcome is in")
    ap.add_argument("--set", action="append", default=[], help="PATH=JSON: backend options of a path (both sides)")
    a = ap.parse_args(argv)
    for spec in a.set:
        name, _, options = spec.partition("=")
        PATHS[name] = json.loads(options)
        EXPECTED_PATH.setdefault(name, "ucx-rma")
    if a.serve:
        serve(a.serve, a.name, a.rows, a.seed, a.backing)
        return []
    if a.initiate or a.reverse:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import ucx_kill_reverse as rev

        rev.PATHS.update(PATHS)
        rev.EXPECTED_PATH.update(EXPECTED_PATH)
        if a.initiate:
            rev.initiate(a.initiate, a.name, a.rows, a.seed)
            return []
        if a.control:
            from kvxfer_ucx import _requests

            _requests.ENABLED[0] = False
        if a.control_wedge:
            from kvxfer.ucxabi import mmqueue as _stuckslot

            _stuckslot.ENABLED[0] = False
        results = [rev.run_reverse(p, a.trials, a.rows, a.timeout, a.seed) for p in a.paths.split(",")]
        for r in results:
            print(json.dumps(r) if a.json else _line(r), flush=True)
        return results
    results = []
    with tempfile.TemporaryDirectory(prefix="kvxfer-kill-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        for path in a.paths.split(","):
            r = run_path(path, a.trials, a.rows, a.timeout, a.seed, d, reap=not a.zombies)
            results.append(r)
            print(json.dumps(r) if a.json else _line(r), flush=True)
    return results


def failed(results: list[dict[str, Any]]) -> list[str]:
    """What went wrong, per path: a false DONE, an untyped error, or an agent that did not
    recover. Empty when every path held."""
    return [f"{r['path']}: false DONE {r['false_done']}, untyped {r['untyped']}, stuck {r['stuck']!r}"
            for r in results if r["false_done"] or r["untyped"] or not r["recovered"]]


def _line(r: dict[str, Any]) -> str:
    return (f"{r['path']:>8}: {r['trials']} kills ({r['mid_flight']} mid-flight)  outcomes {r['outcomes']}  errors {r['errors']}  "
            f"false DONE {r['false_done']}  untyped {r['untyped']}  slowest error {r['worst_error_s']} s "
            f"(deadline {r['timeout_s']} s)  clean read {r['clean_read_s']} s  recovered: {r['recovered']}")


if __name__ == "__main__":
    problems = failed(main())
    for line in problems:
        print(f"FAILED {line}", file=sys.stderr)
    sys.exit(1 if problems else 0)
