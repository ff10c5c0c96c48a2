"""The kill matrix reversed: the process killed is the one that *initiates* the transfer.

In ``ucx_kill_matrix.py`` this process reads and writes, and the peer it targets is killed.
Here this process's agent is the target: peer processes add it and READ or WRITE its
memory, and one of them is SIGKILLed at a random moment of its request. Over software RMA
the initiator writes into the *target's* receive queue (its requests, and a WRITE's data),
so a kill there tests the target's own queue. After each kill this agent must still serve
a peer that was never killed, serve the restarted peer, and read from the live peer itself.
Run through ``ucx_kill_matrix.py --reverse``; the exit status is non-zero unless it did.
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from ucx_kill_matrix import EXPECTED_PATH, PATHS, cache, kill_delay, pattern  # same directory

from kvxfer.testing.lines import Channel, Inbox
from kvxfer.ucxabi import mmqueue as _stuckslot
from kvxfer.ucxabi.mmqueue import Queue


def _own_fifos(agent: Any) -> list[tuple[int, str, str]]:
    """The receive queues of ``agent``'s UCX workers (its own, its peers', the retired ones)."""
    b = agent.backend
    return [f for f in [b._w.fifo, *(p.w.fifo for p in b._peers.values() if p.w is not None), *b._pw.fifos()] if f]


def initiate(path: str, name: str, rows: int, seed: int) -> None:
    """The peer: add the target whose metadata arrives first on stdin, then run each command."""
    import kvxfer

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    buf = pattern(rows, seed).copy()
    agent = kvxfer.Agent(name, backend="ucx", timeout=30, **PATHS[path])
    agent.register(cache(buf), replicated=True)
    inbox = Inbox(sys.stdin.fileno())
    target = agent.add_peer(base64.b64decode(inbox.line(60)))
    out.write(json.dumps({"metadata": base64.b64encode(agent.metadata()).decode(), "pid": os.getpid(),
                          "path": agent.backend.peer_path(target)[0]}) + "\n")  # type: ignore[attr-defined]
    out.flush()
    while True:
        try:  # progress while no command waits (software RMA needs this peer to)
            line = inbox.line(3600, idle=agent.progress, idle_s=0.0005)
        except EOFError:
            break
        op, target_seed, perm_seed = line.decode().split()
        perm = np.array(random.Random(int(perm_seed)).sample(range(rows), rows))
        try:
            if op == "READ":
                buf[:] = 0xAA
                agent.read(target, np.arange(rows), perm).wait(30)
                ok = bool(np.array_equal(buf, pattern(rows, int(target_seed))[perm]))
                buf[:] = pattern(rows, seed)  # what the target reads back from this peer
            else:
                buf[:] = pattern(rows, seed)
                agent.write(target, np.arange(rows), perm).wait(30)
                ok = True
            reply = {"outcome": "DONE", "ok": ok}
        except kvxfer.KvxferError as exc:
            reply = {"outcome": type(exc).__name__, "ok": False, "error": str(exc)[:200]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    agent.close()


class Initiator:
    def __init__(self, path: str, rows: int, seed: int, name: str, target_md: bytes) -> None:
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ucx_kill_matrix.py")
        self.seed, self.rows = seed, rows
        self.proc = subprocess.Popen([sys.executable, here, "--initiate", path, "--name", name, "--rows", str(rows),
                                      "--seed", str(seed), f"--set={path}={json.dumps(PATHS[path])}"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._ch = Channel(self.proc)
        self._ch.send_line(base64.b64encode(target_md).decode())

    def hello(self, agent: Any, timeout: float = 60) -> dict[str, Any]:
        reply = self.reply(agent, timeout)
        self.metadata = base64.b64decode(reply["metadata"])
        return reply

    def send(self, op: str, target_seed: int, perm_seed: int) -> None:
        self._ch.send_line(f"{op} {target_seed} {perm_seed}")

    def reply(self, agent: Any, timeout: float) -> dict[str, Any]:
        """The peer's next line, progressing this (target) agent meanwhile: software RMA needs it."""
        return self._ch.read(timeout, idle=agent.progress, idle_s=0.0005)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def run_reverse(path: str, trials: int, rows: int, timeout: float, seed: int) -> dict[str, Any]:
    import kvxfer

    rng = random.Random(seed)
    agent = kvxfer.Agent("target", backend="ucx", timeout=timeout, **PATHS[path])
    mine = pattern(rows, 5).copy()
    agent.register(cache(mine), replicated=True)
    md = agent.metadata()
    counts: Counter[str] = Counter()
    stuck, kills, mid_flight, false_done = "", 0, 0, 0
    live = Initiator(path, rows, 1, "live", md)
    victim: Initiator | None = None
    duration, skipped, queues = 0.0, 0, []

    def served(peer: Initiator, what: str) -> float:
        """``peer`` READs all of this agent's rows and checks them; seconds it took."""
        mine[:] = pattern(rows, 5)
        t0 = time.monotonic()
        peer.send("READ", 5, 0)
        r = peer.reply(agent, timeout + 30)
        if r["outcome"] != "DONE" or not r["ok"]:
            raise AssertionError(f"{what}: {r}")
        return time.monotonic() - t0

    try:
        hello = live.hello(agent)
        if hello["path"] != EXPECTED_PATH[path]:
            raise AssertionError(f"{path}: the live peer reaches this agent by {hello['path']}")
        live_name = agent.add_peer(live.metadata)
        duration = min(served(live, "warm-up") for _ in range(3))
        victim = Initiator(path, rows, 100, "victim", md)
        victim.hello(agent)
        for trial in range(trials):
            op = "READ" if trial % 2 == 0 else "WRITE"
            mine[:] = pattern(rows, 5)
            delay = kill_delay(rng, duration, trial, trials)
            killed_at: list[float] = []

            def kill(v: Initiator = victim) -> None:
                killed_at.append(time.monotonic())
                print(f"target {os.getpid()}: kill {trial + 1} ({op}) of pid {v.proc.pid}", file=sys.stderr, flush=True)
                v.proc.kill()
                v.proc.wait()

            killer = threading.Timer(delay, kill)
            victim.send(op, 5, trial + 1)
            killer.start()
            try:
                r = victim.reply(agent, timeout + 30)
                outcome = r["outcome"]
                false_done += outcome == "DONE" and not r["ok"]
            except EOFError:
                outcome = "killed"
            ended = time.monotonic()
            killer.join()
            kills += 1
            mid_flight += killed_at[0] < ended and outcome == "killed"
            counts[f"{op} {outcome}"] += 1
            victim.stop()
            victim = Initiator(path, rows, 101 + trial, "victim", md)
            try:
                served(live, f"after kill {trial + 1}, the live peer reading this agent")
                victim.hello(agent)
                served(victim, f"after kill {trial + 1}, the restarted peer reading this agent")
                mine[:] = 0xAA
                agent.read(live_name, np.arange(rows), np.arange(rows)).wait(timeout)
                if not np.array_equal(mine, pattern(rows, live.seed)):
                    raise AssertionError("this agent's own READ of the live peer reported DONE with wrong bytes")
            except (kvxfer.KvxferError, AssertionError, TimeoutError, EOFError) as exc:
                stuck = f"after kill {trial + 1}: {type(exc).__name__}: {exc}"[:300]
                print(f"{path} reversed: stuck {stuck}", file=sys.stderr, flush=True)
                # What is stuck: per receive queue of this process, head, tail, first unready slot.
                queues = [(*q.ends(), q.first_unready()) for q in [Queue(*f) for f in _own_fifos(agent)]]
                print(f"{path} reversed: queues (head, tail, first unready slot) {queues}", file=sys.stderr, flush=True)
                break
    finally:
        skipped = agent.backend._slots.skipped  # type: ignore[attr-defined]
        watched = agent.backend._slots.active and _stuckslot.ENABLED[0]  # type: ignore[attr-defined]
        if victim is not None:
            victim.stop()
        live.stop()
        agent.close()
    return {"path": f"{path} (reversed)", "reaped": True, "trials": kills, "mid_flight": mid_flight,
            "outcomes": dict(counts), "errors": {}, "false_done": false_done, "untyped": 0, "worst_error_s": 0.0,
            "timeout_s": timeout, "clean_read_s": round(duration, 4), "recovered": not stuck, "stuck": stuck,
            "slots_skipped": skipped, "slot_watch": watched, "queues_when_stuck": queues,
            "timings": []}
