"""A peer agent in its own process, driven over stdin/stdout with JSON lines (:mod:`._childproc.lines`), and its driver.

The conformance suite's two-process tests (through the kit's face, :mod:`kvxfer.testing.peer`),
the demo and ``kvxfer bench`` start it through :class:`PeerProcess` (or by hand: ``python -m
kvxfer._peer --backend nixl ...``). The cache is either the suite's uniform one (``--cache
packed|layers --layers --page``) or a model geometry (``--preset NAME|FILE --layout
packed|layers``) whose blocks ``--seed`` fills with :func:`~kvxfer._buffers.block_rows`. With
``--serve HOST:PORT`` it also serves its
metadata over the side channel (token from ``KVXFER_PEER_TOKEN``). It prints one line once
registered::

    {"metadata": b64, "address": [host, port] | null, "pid": n, "timings": {"cache": s, "agent": s, "register": s}}

then answers one JSON command per line:

``{"cmd": "add_peer", "metadata": b64}`` -> ``{"peer": name}``
``{"cmd": "metadata"}`` -> ``{"metadata": b64}``
``{"cmd": "pages"}`` -> ``{"pages": b64 of (layers, blocks, page) bytes, "padding": b64}`` (suite cache)
``{"cmd": "fill", "byte": v}`` or ``{"cmd": "fill", "seed": s, "blocks": [...]}`` -> ``{"ok": true}``
``{"cmd": "verify", "dst": [...], "src": [...], "seed": s}`` -> ``{"problem": null | text}`` (geometry cache)
``{"cmd": "logical"}`` -> ``{"logical": b64, "shape": [...], "dtype": name}`` (``--engine`` cache)
``{"cmd": "write", "peer": name, "local": [...], "remote": [...]}`` -> ``{"done": true}``
``{"cmd": "notifications", "timeout": s, "count": n}`` -> ``{"notifications": {peer: [b64]}}``
``{"cmd": "die_mid_transfer", "timeout": s, "ready_file": path}`` -> creates ``ready_file`` once
watching, SIGKILLs itself once some but not all pages were written, or answers
``{"complete": bool}`` when every page was reached (or ``timeout`` passed) first
``{"cmd": "exit"}``

A failing command answers ``{"error": type, "message": text}``. Between commands it keeps
driving the backend's progress, so backends without a progress thread still complete
one-sided transfers that target this process; peers that contact its side channel are added.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from .deadlines import Deadline
from . import Agent
from .errors import KvxferError
from ._childproc import lines
from ._buffers import allocate, make_cache

__all__ = ["PeerProcess", "InProcessPeer", "PeerError", "main", "TOKEN_ENV"]

TOKEN_ENV = "KVXFER_PEER_TOKEN"


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvxfer._peer", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--name", default="peer")
    ap.add_argument("--cache", choices=("packed", "layers"), default="packed")
    ap.add_argument("--memory", choices=("DRAM", "VRAM"), default="DRAM")
    ap.add_argument("--device", type=int, default=0, help="CUDA device for VRAM")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--pad", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None, help="fill with random bytes (else the sentinel)")
    ap.add_argument("--options", default="{}", help="backend options as JSON")
    ap.add_argument("--replicated", action="store_true")
    ap.add_argument("--cuda-device", type=int, default=None, help="GPU for VRAM caches (default: the current one)")
    ap.add_argument("--preset", help="a model geometry (preset name or spec file) instead of --layers/--page")
    ap.add_argument("--layout", choices=("packed", "layers"), default=None, help="with --preset (default: its own)")
    ap.add_argument("--serve", metavar="HOST:PORT", help="also serve metadata over the side channel")
    ap.add_argument("--engine", help="an engine-shaped cache: kvxfer._harness.engines.EngineCache as JSON")
    return ap


def _build(args: argparse.Namespace) -> tuple[Any, dict[str, float]]:
    t0 = time.perf_counter()
    if args.cuda_device is not None:
        import torch

        torch.cuda.set_device(args.cuda_device)
    if args.engine:
        from ._harness.engines import EngineCache, build

        cache: Any = build(EngineCache.from_json(args.engine), seed=args.seed)
    elif args.preset:
        from .geometry import resolve

        geometry = resolve(args.preset)
        cache = allocate(geometry, args.blocks, packed=None if args.layout is None else args.layout == "packed",
                              memory=args.memory, device=args.device, pad=args.pad)
        if args.seed is not None:
            cache.fill_blocks(args.seed)
    else:
        if args.memory == "VRAM" and args.device:
            import torch

            torch.cuda.set_device(args.device)
        cache = make_cache(args.cache, num_blocks=args.blocks, num_layers=args.layers, page=args.page, pad=args.pad,
                           memory=args.memory, seed=args.seed)
    return cache, {"cache": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The command channel is a private copy of stdout; fd 1 goes to stderr, because transport
    # libraries print diagnostics on it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    cache, timings = _build(args)
    t0 = time.perf_counter()
    agent = Agent(args.name, backend=args.backend, **json.loads(args.options))
    t1 = time.perf_counter()
    if args.preset:
        cache.register(agent)
    elif args.engine:
        agent.register(cache.views, **cache.cache.register_options())
    else:
        agent.register(cache.views, replicated=args.replicated)
    timings.update(agent=t1 - t0, register=time.perf_counter() - t1)
    incoming: queue.Queue[bytes] = queue.Queue()
    server = None
    if args.serve:
        from .sidechannel import NO_AUTH, MetadataServer

        host, _, port = args.serve.rpartition(":")
        # A test harness: a spawner that gives no token opts out explicitly.
        server = MetadataServer(agent.metadata, host or "127.0.0.1", int(port or 0),
                                token=os.environ.get(TOKEN_ENV) or NO_AUTH, on_peer=incoming.put)
    lines.say(out, {"metadata": _b64(agent.metadata()), "address": list(server.address) if server else None,
                    "pid": os.getpid(), "timings": timings})
    pending_notes: dict[str, list[bytes]] = {}

    def idle() -> None:
        while not incoming.empty():  # peers that contacted the side channel
            try:
                agent.add_peer(incoming.get_nowait())
            except Exception as exc:  # a bad peer must not stop this one
                print(f"peer: refused a peer: {exc}", file=sys.stderr)
        agent.progress()

    try:
        return lines.serve(lambda cmd: handle(agent, cache, cmd, pending_notes), idle, out)
    finally:
        if server is not None:
            server.close()
        agent.close()


def handle(agent: Agent, cache: Any, cmd: dict[str, Any], notes: dict[str, list[bytes]]) -> dict[str, Any]:
    """Answer one command (shared by the child process and :class:`InProcessPeer`)."""
    c = cmd.get("cmd")
    if c == "add_peer":
        return {"peer": agent.add_peer(base64.b64decode(cmd["metadata"]))}
    if c == "metadata":
        return {"metadata": _b64(agent.metadata())}
    if c == "pages":
        return {"pages": _b64(cache.layer_pages().tobytes()), "padding": _b64(cache.padding().tobytes())}
    if c == "fill":
        if "seed" in cmd:
            cache.fill_blocks(int(cmd["seed"]), cmd.get("blocks"))
        else:
            cache.reset(int(cmd.get("byte", 0xAA)))
        return {"ok": True}
    if c == "logical":
        arr = cache.logical()
        return {"logical": _b64(arr.tobytes()), "shape": list(arr.shape), "dtype": arr.dtype.name}
    if c == "write":  # push our blocks into a peer's and wait for completion
        agent.write(cmd["peer"], cmd["local"], cmd["remote"]).wait(float(cmd.get("timeout", 30.0)))
        return {"done": True}
    if c == "verify":
        return {"problem": cache.verify(cmd["dst"], cmd["src"], int(cmd["seed"]))}
    if c == "notifications":
        deadline = Deadline.within(float(cmd.get("timeout", 5.0)))
        want = int(cmd.get("count", 1))
        while True:
            for k, v in agent.notifications().items():
                notes.setdefault(k, []).extend(v)
            if sum(map(len, notes.values())) >= want or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        got = {k: [_b64(m) for m in v] for k, v in notes.items()}
        notes.clear()
        return {"notifications": got}
    if c == "die_mid_transfer":  # the conformance kit's peer killed while a WRITE lands here
        import signal

        deadline = Deadline.within(float(cmd.get("timeout", 30.0)))
        total = cache.num_layers * cache.num_blocks
        last = 0.0
        if cmd.get("ready_file"):  # tells the driver we watch, before it posts the transfer
            open(cmd["ready_file"], "w").close()
        while time.monotonic() < deadline:
            if time.monotonic() - last > 1e-3:  # drive the transport, but probe between drives
                agent.progress()
                last = time.monotonic()
            reached = cache.pages_reached()
            if 0 < reached < total:
                os.kill(os.getpid(), signal.SIGKILL)
            if reached == total:
                return {"complete": True}
        return {"complete": False}
    if c == "exit":
        return {"exit": True}
    raise ValueError(f"unknown command {c!r}")


class PeerError(KvxferError, RuntimeError):
    """The peer process failed to start, answered with an error, or did not answer in time."""


class PeerProcess:
    """Drive ``python -m kvxfer._peer`` from the parent: start, call, close.

    ``args`` are the child's command-line options (see :func:`spawn_args`). Every read is
    bounded by ``timeout``; a child that hangs is killed and reported as :class:`PeerError`.
    """

    def __init__(self, args: Sequence[str], *, timeout: float = 60.0, token: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.timeout = timeout
        started = time.perf_counter()
        child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        if token:
            child_env[TOKEN_ENV] = token
        # The child's stderr goes to a file: a failure then reports its last line instead of
        # interleaving a traceback with the parent's output.
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvxfer._peer", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=child_env)
        self._ch = lines.Channel(self.proc)
        try:
            self.ready = self._readline()
        except BaseException:
            self.kill()
            self._stderr.close()
            raise
        self.startup_seconds = time.perf_counter() - started
        self.metadata = base64.b64decode(self.ready["metadata"])
        addr = self.ready.get("address")
        self.address: tuple[str, int] | None = (addr[0], int(addr[1])) if addr else None

    @classmethod
    def spawn(cls, backend: str, *, timeout: float = 60.0, token: str | None = None, **options: Any) -> "PeerProcess":
        """Start a peer; ``options`` are the child's flags by name (``blocks=12, seed=7``)."""
        return cls(spawn_args(backend, **options), timeout=timeout, token=token)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _readline(self, idle: Callable[[], None] | None = None) -> dict[str, Any]:
        try:
            reply = self._ch.read(self.timeout, idle)
        except TimeoutError:
            self.kill()
            raise PeerError(f"peer process did not answer within {self.timeout:g} s") from None
        except EOFError:
            code = self.proc.wait()
            raise PeerError(f"peer process exited with {code}: {self.stderr_tail() or 'no message'}") from None
        if "error" in reply:
            raise PeerError(f"peer failed: {reply['error']}: {reply['message']}")
        return reply

    def stderr_text(self) -> str:
        """Everything the child wrote on stderr so far."""
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read()
        self._stderr.seek(0, os.SEEK_END)
        return text

    def stderr_tail(self) -> str:
        lines = [ln.strip() for ln in self.stderr_text().splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def send(self, cmd: dict[str, Any]) -> None:
        """Send ``cmd`` without waiting (read its reply with :meth:`next_reply`)."""
        self._ch.send(cmd)

    def next_reply(self, idle: Callable[[], None] | None = None,
                   timeout: float | None = None) -> dict[str, Any] | None:
        """The next reply as it came (an error reply too), or None once the child has exited:
        for a test that kills the peer on purpose and must tell a death from an answer.
        ``timeout`` (default: the peer's) bounds a command that itself runs for a while."""
        limit = self.timeout if timeout is None else timeout
        try:
            return self._ch.read(limit, idle)
        except EOFError:
            return None
        except TimeoutError:
            self.kill()
            raise PeerError(f"peer process did not answer within {limit:g} s") from None

    def call(self, cmd: dict[str, Any], idle: Callable[[], None] | None = None) -> dict[str, Any]:
        """Send ``cmd`` and return its reply; ``idle`` runs while waiting (progress a local
        agent there when the command makes the peer transfer into this process)."""
        self._ch.send(cmd)
        return self._readline(idle)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if not self._ch.stop(30):
            self.kill()
        self._ch.close()
        self._stderr.close()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessPeer:
    """The same commands as :class:`PeerProcess`, answered by an agent in this process.

    For backends that cannot cross processes, so callers drive one peer interface either way.
    """

    def __init__(self, backend: str, cache: Any, *, name: str = "peer", options: dict[str, Any] | None = None):
        self.cache = cache
        self.agent = Agent(name, backend=backend, **(options or {}))
        if hasattr(cache, "geometry"):
            cache.register(self.agent)
        else:
            self.agent.register(cache.views, replicated=True)
        self._notes: dict[str, list[bytes]] = {}
        self.address = None
        self.pid = os.getpid()

    @property
    def metadata(self) -> bytes:
        return self.agent.metadata()

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return handle(self.agent, self.cache, cmd, self._notes)

    def close(self) -> None:
        self.agent.close()

    def __enter__(self) -> "InProcessPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_args(backend: str, **options: Any) -> list[str]:
    """Command-line flags for the child from keyword options (``True`` flags, ``None`` skipped)."""
    out = ["--backend", backend]
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


if __name__ == "__main__":
    sys.exit(main())
