"""A worker process that publishes itself in a directory and finds its peers there.

Tests (and the network-namespace harness) start it as
``python -m kvxfer._harness.directory_worker --directory URL --role prefill --name p0 ...``.
It builds a cache (random bytes from ``--seed``, else the 0xAA sentinel), registers it,
publishes the agent, prints ``{"ready": true, "name": ..., "generation": ...}``, then answers
one JSON command per line on stdin (:mod:`kvxfer.testing.lines`; driving the backend's progress in between):

``{"cmd": "sync"}`` -> what :meth:`PeerTracker.sync` did (needs ``--follow ROLE``)
``{"cmd": "wait_peer", "name": n, "newer_than": g, "timeout": s}`` -> ``{"peers": {name: generation}}``
``{"cmd": "read", "peer": n, "local": [...], "remote": [...], "timeout": s, "announce": bool}``
    -> ``{"ok": true, "elapsed": s, "nbytes": n}`` or ``{"error": type, "message": m, "elapsed": s}``;
    with ``announce`` a ``{"posted": true, "nbytes": n}`` line comes first
``{"cmd": "save", "path": p}`` -> writes the (layers, blocks, page) pages with ``numpy.save``
``{"cmd": "fill"}`` -> back to the sentinel;  ``{"cmd": "peers"}``;  ``{"cmd": "exit"}``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ..deadlines import Deadline
from .. import Agent
from ..directory import PeerTracker, open_directory
from ..errors import KvxferError
from .._childproc import lines
from .._buffers import SENTINEL, make_cache


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--directory", required=True, help="memory:// or http://host:port (etcd)")
    ap.add_argument("--cluster", default="default")
    ap.add_argument("--role", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tp", type=int, default=0)
    ap.add_argument("--pp", type=int, default=0)
    ap.add_argument("--follow", default=None, help="role whose workers become this agent's peers")
    ap.add_argument("--backend", default="nixl")
    ap.add_argument("--options", default="{}", help="backend options as JSON")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ttl", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args(argv)

    cache = make_cache("packed", num_blocks=args.blocks, num_layers=args.layers, page=args.page, seed=args.seed)
    agent = Agent(args.name, backend=args.backend, timeout=args.timeout, **json.loads(args.options))
    agent.register(cache.views)
    directory = open_directory(args.directory, args.cluster, ttl=args.ttl, timeout=args.timeout)
    directory.publish(agent, args.role, args.tp, args.pp)
    tracker = PeerTracker(agent, directory, role=args.follow) if args.follow else None
    _say({"ready": True, "name": agent.name, "generation": agent.generation})
    try:
        return lines.serve(lambda cmd: _handle(agent, cache, tracker, cmd), agent.progress)
    finally:
        directory.close()
        agent.close()


def _say(doc: dict[str, Any]) -> None:
    lines.say(sys.stdout, doc)


def _peers(agent: Agent) -> dict[str, int]:
    return {name: p.generation for name, p in agent.peers.items()}


def _handle(agent: Agent, cache: Any, tracker: PeerTracker | None, cmd: dict[str, Any]) -> dict[str, Any]:
    c = cmd.get("cmd")
    if c == "sync":
        if tracker is None:
            raise ValueError("start the worker with --follow ROLE to track peers")
        r = tracker.sync()
        return {"added": r.added, "refreshed": r.refreshed, "removed": r.removed,
                "failed": {k: str(v) for k, v in r.failed.items()}, "peers": _peers(agent)}
    if c == "wait_peer":
        if tracker is None:
            raise ValueError("start the worker with --follow ROLE to track peers")
        name, newer, gone = str(cmd["name"]), int(cmd.get("newer_than", 0)), bool(cmd.get("gone", False))
        deadline = Deadline.within(float(cmd.get("timeout", 30.0)))
        while True:
            tracker.sync()
            p = agent.peers.get(name)
            if (p is None) if gone else (p is not None and p.generation > newer):
                return {"peers": _peers(agent)}
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": "Timeout", "message": f"peer {name!r} not in the wanted state", "peers": _peers(agent)}
            tracker.wait_changed(min(left, 0.5))
    if c == "read":
        t0 = time.monotonic()
        try:
            t = agent.read(cmd["peer"], cmd["local"], cmd["remote"])
            if cmd.get("announce"):
                _say({"posted": True, "nbytes": t.stats.nbytes})
            t.wait(float(cmd.get("timeout", 10.0)))
        except KvxferError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0}
        return {"ok": True, "elapsed": time.monotonic() - t0, "nbytes": t.stats.nbytes}
    if c == "save":
        np.save(cmd["path"], cache.layer_pages())
        return {"saved": cmd["path"]}
    if c == "fill":
        for s in cache.storages:
            s[...] = SENTINEL
        return {"filled": True}
    if c == "peers":
        return {"peers": _peers(agent)}
    raise ValueError(f"unknown command {c!r}")



class WorkerProcess:
    """The parent's handle on a worker: start it, send commands, read replies with deadlines."""

    def __init__(self, argv: list[str], *, popen: Any = None, env: dict[str, str] | None = None,
                 ready_timeout: float = 60.0) -> None:
        start = popen or subprocess.Popen
        self.proc = start([sys.executable, "-m", "kvxfer._harness.directory_worker", *argv], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, env=env)
        self._ch = lines.Channel(self.proc)
        first = self.read(ready_timeout)
        if not first.get("ready"):
            raise RuntimeError(f"worker did not start: {first}")
        self.name: str = first["name"]
        self.generation: int = first["generation"]

    def read(self, timeout: float) -> dict[str, Any]:
        """The next JSON line from the worker; RuntimeError if none within ``timeout`` or it died."""
        try:
            return self._ch.read(timeout)
        except TimeoutError:
            raise RuntimeError(f"no reply from the worker within {timeout}s") from None
        except EOFError:
            raise RuntimeError(f"the worker exited (code {self.proc.wait(5)})") from None

    def send(self, doc: dict[str, Any]) -> None:
        self._ch.send(doc)

    def ask(self, doc: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        self.send(doc)
        return self.read(timeout)

    def kill(self) -> None:
        """SIGKILL: no goodbye, the lease is left to expire."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.proc.wait(timeout)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
