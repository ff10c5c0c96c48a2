"""What the hardening costs and bounds: signed add_peer, side-channel waits, per-peer bounds.

    python benchmarks/bench_hardening.py [--repeat 200] [--backends loopback,nixl,ucx]

1. ``add_peer`` with and without a token (the HMAC over the metadata), per backend: median
   of up to ``--repeat`` add/remove cycles of the same peer (20 s per case at most), and the
   tag check alone.
2. Side channel: a token holder's ``exchange`` while 0 and while 64 slow clients (silent
   sockets, half headers, HELLOs without AUTH) hold connections: median and slowest.
3. 64 clients x 16 MiB at a side-channel server in its own process: its resident growth
   after the flood, for clients without the token, token holders, and a NO_AUTH server.
4. A peer advertising one region of 2^26 blocks: ``add_peer`` plus a 5-block read, seconds
   and resident growth, coalesced and with prepared lists.
5. 300 restarts of a peer (new agent, new 3 MB cache, ``add_peer``, one read): resident
   growth after a 30-restart warm-up.
6. Time from each kind of bad input to its typed error.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
from _timing import samples

import kvxfer
from kvxfer.metadata import unseal
from kvxfer.table import Column, print_table
from kvxfer.sidechannel import NO_AUTH, MetadataServer, encode_header, exchange
from kvxfer.sidechannel.frames import EXCHANGE, HELLO
from kvxfer.testing.buffers import SENTINEL, make_cache
from kvxfer.testing.lines import Channel
from kvxfer.tokens import token_key


class Table:
    """Rows for the project's one table printer (:mod:`kvxfer.table`), filled column by column."""

    def __init__(self, title: str) -> None:
        self.title, self.cols, self.rows = title, [], []  # type: ignore[var-annotated]

    def add_column(self, name: str, justify: str = "right") -> None:
        self.cols.append(name)

    def add_row(self, *cells: str) -> None:
        self.rows.append(dict(zip(self.cols, cells)))

    def print(self) -> None:
        print_table(self.rows, [Column(c, justify="right") for c in self.cols], title=self.title)
        print()


def rss_mb() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def add_peer_cost(backends: list[str], repeat: int) -> Table:
    table = Table(title="add_peer: unsigned vs signed metadata (median of add+remove cycles)")
    for col in ("backend", "metadata bytes", "unsigned ms", "signed ms", "signed - unsigned µs", "tag check µs"):
        table.add_column(col, justify="right")
    for backend in backends:
        meds = []
        size = 0
        check_us = 0.0
        for token in (None, "bench-token"):
            src = make_cache("packed", num_blocks=64, num_layers=61, page=1024, seed=1)
            dst = make_cache("packed", num_blocks=64, num_layers=61, page=1024)
            with kvxfer.Agent("p", backend=backend, token=token) as a, \
                    kvxfer.Agent("d", backend=backend, token=token) as b:
                a.register(src.views, replicated=True)
                b.register(dst.views, replicated=True)
                md = a.metadata()
                size = len(md)

                def cycle() -> None:
                    b.remove_peer(b.add_peer(md))

                for _ in range(3):
                    cycle()
                ts: list[float] = []
                end = time.perf_counter() + 20  # time-boxed: a UCX cycle connects and takes ~0.5 s
                while len(ts) < repeat and (len(ts) < 5 or time.perf_counter() < end):
                    ts += samples(cycle, 1)
                meds.append(statistics.median(ts) * 1e3)
                if token:
                    key = token_key(token)
                    check_us = statistics.median(samples(lambda: unseal(md, key), repeat * 5)) * 1e6
        table.add_row(backend, f"{size:,}", f"{meds[0]:.3f}", f"{meds[1]:.3f}", f"{(meds[1] - meds[0]) * 1e3:+.1f}",
                      f"{check_us:.1f}")
    return table


def sidechannel_waits(repeat: int) -> Table:
    table = Table(title="side channel: a token holder's exchange() while slow clients hold connections")
    for col in ("slow clients", "calls", "failed", "median ms", "slowest ms"):
        table.add_column(col, justify="right")
    meta = b"m" * 4096
    with MetadataServer(meta, token="t", timeout=60, on_error=lambda e: None) as srv:
        for n_slow in (0, 64):
            slow = []
            for i in range(n_slow):
                s = socket.create_connection(srv.address)
                if i % 3 == 1:
                    s.sendall(encode_header(HELLO, 33)[:7])
                elif i % 3 == 2:
                    s.sendall(encode_header(HELLO, 33) + b"\1" + os.urandom(32))
                slow.append(s)
            failed = 0
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                try:
                    exchange(*srv.address, meta, token="t", timeout=30)
                except kvxfer.HandshakeError:
                    failed += 1
                ts.append(time.perf_counter() - t0)
            for s in slow:
                s.close()
            table.add_row(str(n_slow), str(repeat), str(failed), f"{statistics.median(ts) * 1e3:.2f}",
                          f"{max(ts) * 1e3:.2f}")
    return table


_FLOOD_SERVER = """
import sys
from kvxfer.sidechannel import MetadataServer, NO_AUTH
token = NO_AUTH if sys.argv[1] == "-" else sys.argv[1]
with MetadataServer(b"m" * 1000, token=token, on_peer=lambda b: None, on_error=lambda e: None, timeout=60) as s:
    print(s.address[1], flush=True)
    for _ in sys.stdin:
        print(int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]), flush=True)
"""


def floods(size: int = 16 << 20, clients: int = 64) -> Table:
    """64 clients each pushing 16 MiB at a server in its own process; its resident growth after."""
    table = Table(title=f"side-channel server after {clients} clients x {size >> 20} MiB at once")
    for col in ("clients", "server token", "outcomes", "seconds", "server RSS +MB after"):
        table.add_column(col, justify="right")
    blob = b"\xab" * size

    def raw(port: int) -> str:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(encode_header(EXCHANGE, size) + blob)
            return "sent"
        except OSError as exc:
            return type(exc).__name__

    def legit(token: object) -> Callable[[int], str]:
        def call(port: int) -> str:
            try:
                exchange("127.0.0.1", port, blob, token=token, timeout=60)
                return "ok"
            except kvxfer.HandshakeError as exc:
                return type(exc).__name__
        return call

    for label, server_token, client in (("no token, raw EXCHANGE", "t", raw), ("token holders", "t", legit("t")),
                                        ("NO_AUTH server", "-", legit(NO_AUTH))):
        child = subprocess.Popen([sys.executable, "-c", _FLOOD_SERVER, server_token], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        ch = Channel(child)
        port = int(ch.line(60))

        def rss(ch: Channel = ch) -> float:
            ch.send_line("")
            return int(ch.line(60)) / 1024

        base, t0 = rss(), time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            outcomes = Counter(pool.map(client, [port] * clients))
        secs = time.perf_counter() - t0
        time.sleep(2)  # the server returns freed pages once idle
        grown = rss() - base
        child.stdin.close()
        child.wait()
        table.add_row(f"{clients} ({label})", "NO_AUTH" if server_token == "-" else "yes",
                      ", ".join(f"{k} {v}" for k, v in outcomes.items()), f"{secs:.1f}", f"{grown:+.1f}")
    return table


def peer_bound() -> Table:
    table = Table(title="a peer advertising one region of 2^26 blocks: add_peer + a 5-block read")
    for col in ("path", "metadata bytes", "seconds", "RSS +MB", "bytes verified"):
        table.add_column(col, justify="right")
    n = 1 << 26
    for label, coalesce in (("coalesced (loopback default)", None), ("prepared lists", False)):
        big = np.zeros(n, dtype=np.uint8)
        far = np.array([n - 1, n // 2, 12345, 0, n - 4096], dtype=np.int64)
        big[far] = np.arange(1, 6, dtype=np.uint8)
        spec = kvxfer.spec_from_pointers((big.ctypes.data, n, 0), num_blocks=n, members=[("kv", 1)],
                                         replicated=True)
        mine = np.full(64, SENTINEL, dtype=np.uint8)
        local = kvxfer.spec_from_pointers((mine.ctypes.data, 64, 0), num_blocks=64, members=[("kv", 1)],
                                          replicated=True)
        with kvxfer.Agent("p") as a, kvxfer.Agent("d", coalesce=coalesce) as b:
            a.register(spec)
            b.register(local)
            md = a.metadata()
            before, t0 = rss_mb(), time.perf_counter()
            b.add_peer(md)
            b.read("p", [3, 9, 10, 11, 60], far).wait(60)
            secs, grown = time.perf_counter() - t0, rss_mb() - before
        ok = bool((mine[[3, 9, 10, 11, 60]] == big[far]).all())
        table.add_row(label, f"{len(md):,}", f"{secs:.4f}", f"{grown:+.1f}", "yes" if ok else "NO")
    return table


def restarts(count: int = 300) -> Table:
    table = Table(title=f"{count} peer restarts (loopback): resident growth after 30 warm-up restarts")
    for col in ("restarts", "seconds", "RSS +MB"):
        table.add_column(col, justify="right")
    dst = make_cache("layers", num_blocks=2048, num_layers=4, page=256)
    with kvxfer.Agent("d") as b:
        b.register(dst.views, replicated=True)

        def restart(i: int) -> None:
            src = make_cache("packed", num_blocks=2048, num_layers=4, page=256, seed=i)
            with kvxfer.Agent("p") as a:
                a.register(src.views, replicated=True)
                b.add_peer(a.metadata())
                b.read("p", [i % 2048], [(i * 7) % 2048]).wait(10)

        for i in range(30):
            restart(i)
        before, t0 = rss_mb(), time.perf_counter()
        for i in range(30, 30 + count):
            restart(i)
        table.add_row(str(count), f"{time.perf_counter() - t0:.1f}", f"{rss_mb() - before:+.1f}")
    return table


def typed_error_latency(repeat: int) -> Table:
    """How long each refused input takes to come back as a KvxferError (median and slowest)."""
    table = Table(title="time from a bad input to its typed error")
    for col in ("input", "tries", "error", "median ms", "slowest ms"):
        table.add_column(col, justify="right")
    rows: list[tuple[str, object]] = []
    src = make_cache("packed", num_blocks=8, num_layers=4, page=256, seed=1)
    dst = make_cache("packed", num_blocks=8, num_layers=4, page=256)
    with kvxfer.Agent("p", token="k") as a, kvxfer.Agent("d", token="k") as b, kvxfer.Agent("x") as plain:
        a.register(src.views, replicated=True)
        b.register(dst.views, replicated=True)
        plain.register(make_cache("packed", num_blocks=8, num_layers=4, page=256).views)
        signed = bytearray(a.metadata())
        signed[len(signed) // 2] ^= 1
        rows.append(("signed metadata, one bit flipped", lambda: b.add_peer(bytes(signed))))
        rows.append(("unsigned metadata to a token agent", lambda: b.add_peer(plain.metadata())))
        raw = plain.metadata()
        rows.append(("metadata with a lone surrogate name", lambda: plain.add_peer(
            raw.replace(b'"name":"x"', b'"name":"\\udc80"'))))
        rows.append(("deeply nested spec (100k levels)", lambda: plain.add_peer(
            raw[:raw.index(b'"spec"')] + b'"spec":' + b"[" * 100_000 + b"]" * 100_000 + b"}")))
        rows.append(("Agent(timeout=nan)", lambda: kvxfer.Agent("t", timeout=float("nan"))))
        with MetadataServer(b"m", token="t", on_error=lambda e: None) as srv:
            rows.append(("side channel, wrong token", lambda: exchange(*srv.address, b"x", token="u", timeout=10)))
            for what, fn in rows:
                ts, err = [], ""
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    try:
                        fn()  # type: ignore[operator]
                    except kvxfer.KvxferError as exc:
                        err = type(exc).__name__
                    ts.append(time.perf_counter() - t0)
                table.add_row(what, str(repeat), err or "none!", f"{statistics.median(ts) * 1e3:.3f}",
                              f"{max(ts) * 1e3:.3f}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--backends", default=None)
    args = ap.parse_args()
    status = {s.name: s.available for s in kvxfer.available_backends()}
    backends = args.backends.split(",") if args.backends else [b for b in ("loopback", "nixl", "ucx") if status.get(b)]
    for table in (add_peer_cost(backends, args.repeat), sidechannel_waits(args.repeat), floods(), peer_bound(),
                  restarts(), typed_error_latency(args.repeat)):
        table.print()

if __name__ == "__main__":
    main()
