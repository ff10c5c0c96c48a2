"""``kvxfer doctor``: is this machine ready to move KV caches, and if not, what to change.

Transport libraries are probed in child processes with deadlines, so a library that hangs,
crashes or prints on stdout cannot take the command with it. Every problem comes with a
concrete fix; the exit status is 1 when any check fails.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import socket
import sys
import time
from dataclasses import asdict
from typing import Any

from ..plugin.doctor import MARK, Check, probe as _probe
from .args import add_json
from .output import CliError, emit_json
from ..table import Column, print_table

__all__ = ["add_parser", "run", "Check"]

#: Where the token is looked for when --token is not given (the vLLM connector's default too).
TOKEN_ENV = "KVXFER_TOKEN"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check the backends, CUDA, CPUs and the side channel, with fixes",
                       description="Check whether this machine is ready to move KV caches: the plugins and each "
                                   "one's own checks (its transport library, its helpers), CUDA, CPUs, the side "
                                   "channel. Each problem comes with a fix; the exit status is 1 when a check fails.")
    p.add_argument("--peer", metavar="HOST:PORT", help="also fetch metadata from a running side-channel server")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None, help=f"the side channel's shared secret, for --peer "
                                                                       f"(default: ${TOKEN_ENV})")
    p.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:0",
                   help="where to try serving the side channel (default 127.0.0.1:0, a free local port)")
    add_json(p)
    p.set_defaults(fn=run)


def check_plugins() -> list[Check]:
    from ..plugin.registry import available_backends, broken_plugins

    out = []
    for b in broken_plugins():
        dist = f" (distribution {b.distribution} {b.version})" if b.distribution else ""
        out.append(Check(f"plugin {b.name}", "fail", f"failed to load at {b.stage}{dist}: {b.error}",
                         f"upgrade or reinstall {b.distribution or 'the plugin'}, or skip it with "
                         f"KVXFER_BLOCK_PLUGINS={b.name}"))
    for s in available_backends():
        if s.available:
            out.append(Check(f"backend {s.name}", "ok", f"runs here ({s.plugin} {s.version or ''})".strip()))
        else:
            out.append(Check(f"backend {s.name}", "warn", f"cannot run here: {s.reason}",
                             s.install or "see `kvxfer backends`"))
    return out


_TORCH_PROBE = f"""
import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
names = [torch.cuda.get_device_name(i) for i in range(n)]
print({MARK!r} + json.dumps({{"torch": torch.__version__, "cuda": torch.version.cuda, "devices": names}}))
"""


def check_cuda() -> tuple[list[Check], int]:
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import importlib.util

    if not nodes:
        return [Check("cuda", "info", "no NVIDIA device on this machine: DRAM transfers only")], 0
    if importlib.util.find_spec("torch") is None:
        return [Check("cuda", "warn", f"{len(nodes)} NVIDIA device(s), but torch is not installed: kvxfer "
                                      "discovers VRAM caches from torch tensors",
                      "pip install torch (a CUDA build: PyPI's default index)")], 0
    data, err = _probe(_TORCH_PROBE)
    if data is None:
        return [Check("cuda", "fail", f"importing torch failed: {err}", "reinstall torch")], 0
    n = len(data["devices"])
    if not n:
        why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        fix = ("unset or correct CUDA_VISIBLE_DEVICES" if visible is not None else
               "install a CUDA build of torch (pip install torch: PyPI's default index)"
               if not data["cuda"] else "check the NVIDIA driver with nvidia-smi")
        return [Check("cuda", "fail", f"{len(nodes)} NVIDIA device(s) but torch {data['torch']} sees none{why}",
                      fix)], 0
    return [Check("cuda", "ok", f"torch {data['torch']} (CUDA {data['cuda']}) sees {n}: "
                                f"{', '.join(sorted(set(data['devices'])))}")], n


def check_cpus() -> list[Check]:
    total = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    out = [Check("cpus", "ok", f"{usable} usable of {total}; load {load:.1f}")]
    if load > usable:
        out.append(Check("load", "info", f"load {load:.1f} on {usable} cores: benchmarks run now will be noisy"))
    return out


def _hostport(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise CliError(f"{flag}: expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _peer_advice(exc: BaseException) -> str:
    """The likeliest fix first: a server that answered rules out the network."""
    from ..sidechannel.frames import HandshakeAuthError

    if isinstance(exc, HandshakeAuthError):
        return ("the peer answered but holds another token: pass the secret its server was started with "
                f"(--token, or {TOKEN_ENV})")
    return ("check that the peer's MetadataServer listens on that address (not only 127.0.0.1), that no "
            "firewall blocks the port, and that both sides use the same --token")


def check_sidechannel(listen: tuple[str, int], peer: tuple[str, int] | None, token: str | None) -> list[Check]:
    from ..errors import HandshakeError
    from ..sidechannel import MetadataServer, fetch

    out = []
    secret = os.urandom(16).hex()
    try:
        with MetadataServer(b"kvxfer doctor", listen[0], listen[1], token=secret) as server:
            host, port = server.address
            t0 = time.perf_counter()
            got = fetch(host, port, token=secret, timeout=10)
            dt = time.perf_counter() - t0
        ok = got == b"kvxfer doctor"
        out.append(Check("side channel", "ok" if ok else "fail",
                         f"served on {host}:{port} and fetched back with a token in {dt * 1e3:.1f} ms",
                         None if ok else "report this: the side channel returned different bytes"))
    except HandshakeError as exc:
        out.append(Check("side channel", "fail", f"cannot serve on {listen[0]}:{listen[1]}: {exc}",
                         "pick a free port and an address of this host with --listen HOST:PORT"))
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        out.append(Check("hostname", "warn", f"{socket.gethostname()!r} does not resolve: {exc}",
                         "add it to /etc/hosts or DNS, or give peers an IP address"))
    else:
        if addr.startswith("127."):
            # Right for one host; a multi-host deployment binds an interface address instead.
            out.append(Check("hostname", "info", f"{socket.gethostname()!r} resolves to {addr}: peers on other hosts "
                                                 "cannot reach a server bound by hostname; bind an interface address",
                             "kvxfer doctor --listen ADDRESS:0 checks serving on that address"))
        else:
            out.append(Check("hostname", "ok", f"{socket.gethostname()!r} resolves to {addr}"))
    if peer is not None and token is None:
        out.append(Check("peer", "fail", f"{peer[0]}:{peer[1]}: no token to prove to the peer's side channel",
                         f"kvxfer doctor --peer {peer[0]}:{peer[1]} --token TOKEN (or set {TOKEN_ENV}), the secret "
                         "the peer's server was started with"))
    elif peer is not None:
        try:
            t0 = time.perf_counter()
            md = fetch(peer[0], peer[1], token=token, timeout=10)
            out.append(Check("peer", "ok", f"fetched {len(md)} bytes of metadata from {peer[0]}:{peer[1]} in "
                                           f"{(time.perf_counter() - t0) * 1e3:.1f} ms"))
        except HandshakeError as exc:
            out.append(Check("peer", "fail", f"{peer[0]}:{peer[1]}: {type(exc).__name__}: {exc}", _peer_advice(exc)))
    return out


def run(args: argparse.Namespace) -> int:
    listen = _hostport(args.listen, "--listen")
    peer = _hostport(args.peer, "--peer") if args.peer else None
    from .. import __version__

    checks = [Check("kvxfer", "info", f"kvxfer {__version__}, Python {sys.version.split()[0]} at {sys.executable}")]
    checks += check_plugins()
    cuda, gpus = check_cuda()
    from ..plugin.registry import plugin_manager

    # each plugin's own diagnostics (its transport library, its helpers): doctor names no plugin
    checks += [c for group in plugin_manager().hook.kvxfer_doctor_checks(gpus=gpus) for c in group]
    checks += cuda + check_cpus() + check_sidechannel(listen, peer, args.token)
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        emit_json([asdict(c) for c in checks])
    else:
        print_table([asdict(c) for c in checks], [Column("check"), Column("status"), Column("detail"),
                                                  Column("fix")],
                    caption="1 or more checks failed" if failed else "no failures")
    return 1 if failed else 0
