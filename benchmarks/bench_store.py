"""The KV store: offload/restore GB/s for whole-row and per-layer caches, against fio, in one run.

    python benchmarks/bench_store.py [--dir /tmp] [--tokens 16384] [--repeat 5] [--threads 4] [--stub-digests]

The cache is one TP8 rank of a Llama-3-70B-style GQA model (80 layers, K and V of one head x
128 fp16/bf16 bytes-alike, 16-token blocks): 4 KiB pages, 640 KiB rows, 160 pages per row,
the shape where a per-layer store does 160 small I/Os per block. A request of ``--tokens``
moves every block of the pool in a random order (local ids shuffled; slots consecutive).
The store's I/O is buffered (page cache); ``fio`` runs on the same directory with the row size
as block size, buffered (``--direct=0``, the store's own setting) and ``O_DIRECT`` (the
disk), for write and read; raw NIXL ``POSIX`` does the same I/O by hand (one descriptor per
row, or per page for the per-layer cache; buffered, as NIXL opens the fd it is given). Bytes
are checked once per layout against the source arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Any

import numpy as np

from _timing import Column, count, print_table, samples

import kvxfer
from kvxfer.store.digest import row_digests

LAYERS, TOKENS, HEADS, DIM = 80, 16, 1, 128
CHUNK = 16384  # descriptors per raw NIXL POSIX request


def caches(pool: int, fill: bool) -> tuple[dict[str, object], dict[str, object], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    row = np.empty((pool, LAYERS, 2, TOKENS, HEADS, DIM), np.float16)
    layers = [np.empty((pool, TOKENS, HEADS, DIM), np.float16) for _ in range(2 * LAYERS)]
    for a in [row] + layers:
        a.view(np.uint8)[...] = 0xAA
    if fill:
        row.view(np.uint16)[...] = rng.integers(0, 1 << 16, row.shape, dtype=np.uint16)
        for l in range(LAYERS):
            for kv in (0, 1):
                layers[2 * l + kv][...] = row[:, l, kv]
    rows = {f"layer.{l}": (row[:, l, 0], row[:, l, 1]) for l in range(LAYERS)}
    per = {f"layer.{l}": (layers[2 * l], layers[2 * l + 1]) for l in range(LAYERS)}
    return rows, per, [row] + layers


def _rates(nbytes: int, secs: list[float]) -> dict[str, float]:
    """Median and best GB/s: on a shared machine the best run is what the code can do."""
    return {"gbps": nbytes / statistics.median(secs) / 1e9, "best": nbytes / min(secs) / 1e9}


def fio(path: str, rw: str, bs: int, size: int, direct: int, jobs: int) -> float | None:
    """fio's GB/s for sequential ``rw`` of ``size`` bytes in ``bs`` blocks, or None without fio."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=ceiling", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size // jobs}",
           f"--direct={direct}", *(["--ioengine=libaio", "--iodepth=16"] if direct else ["--ioengine=psync"]),
           f"--numjobs={jobs}", "--group_reporting", "--output-format=json", "--offset_increment=" + str(size // jobs), "--invalidate=0"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    out = json.loads(text[text.index("{"):])  # fio may print notes before its JSON
    job = out["jobs"][0]["read" if rw == "read" else "write"]
    return job["bw_bytes"] / 1e9


class RawPosix:
    """Raw NIXL ``POSIX`` doing the same I/O by hand: one descriptor per row (row cache) or per
    page (per-layer cache), DRAM <-> FILE, the file registered once. :meth:`open` gives None
    without nixl."""

    @classmethod
    def open(cls, path: str, n: int, row_bytes: int, src: list[np.ndarray], dst: list[np.ndarray],
             local: np.ndarray) -> "RawPosix | None":
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            return None
        return cls(nixl_agent("bench-store", nixl_agent_config(backends=["POSIX"])), path, n, row_bytes, src, dst,
                   local)

    def __init__(self, ag: Any, path: str, n: int, row_bytes: int, src: list[np.ndarray], dst: list[np.ndarray],
                 local: np.ndarray) -> None:
        self.ag, self.n, self.row_bytes, self.src, self.dst, self.local = ag, n, row_bytes, src, dst, local
        self.fd = fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, n * row_bytes)
        self.regs = [ag.register_memory([(0, n * row_bytes, fd, "")], "FILE")]
        self.regs += [ag.register_memory([(a.ctypes.data, a.nbytes, 0, "")], "DRAM") for a in src + dst]
        self.lists = {(op, per_layer): self._lists(src if op == "WRITE" else dst, per_layer)
                      for op in ("WRITE", "READ") for per_layer in (False, True)}

    def _lists(self, arrs: list[np.ndarray], per_layer: bool) -> tuple[np.ndarray, np.ndarray]:
        n, row_bytes, fd, local = self.n, self.row_bytes, self.fd, self.local
        slots = np.arange(n, dtype=np.uint64) * np.uint64(row_bytes)
        if not per_layer:  # row b of the cache <-> slot i, local ids shuffled as for the store
            mem = np.stack([arrs[0].ctypes.data + local.astype(np.uint64) * np.uint64(row_bytes),
                            np.full(n, row_bytes, np.uint64), np.zeros(n, np.uint64)], axis=1)
            fil = np.stack([slots, np.full(n, row_bytes, np.uint64), np.full(n, fd, np.uint64)], axis=1)
            return mem.astype(np.uint64), fil.astype(np.uint64)
        page = arrs[1].nbytes // n
        bases = np.array([a.ctypes.data for a in arrs[1:]], dtype=np.uint64)
        mem_addr = (bases[None, :] + local.astype(np.uint64)[:, None] * np.uint64(page)).reshape(-1)
        fil_off = (slots[:, None] + np.arange(len(bases), dtype=np.uint64)[None, :] * np.uint64(page)).reshape(-1)
        ln = np.full(mem_addr.shape[0], page, np.uint64)
        return (np.stack([mem_addr, ln, np.zeros_like(ln)], axis=1),
                np.stack([fil_off, ln, np.full_like(ln, fd)], axis=1))

    def xfer(self, op: str, per_layer: bool) -> None:
        # POSIX's aio queue refuses one request of 163,840 descriptors ("No more free blocks
        # available"), and so it does several in flight together: post CHUNK descriptors per
        # request, one request after the other.
        ag, (mem, fil) = self.ag, self.lists[(op, per_layer)]
        states = []
        for i in range(0, mem.shape[0], CHUNK):
            h = ag.initialize_xfer(op, ag.get_xfer_descs(mem[i:i + CHUNK], "DRAM"),
                                   ag.get_xfer_descs(fil[i:i + CHUNK], "FILE"), "bench-store")
            state = ag.transfer(h)
            while state not in ("DONE", "ERR"):
                state = ag.check_xfer_state(h)
            ag.release_xfer_handle(h)
            states.append(state)
        if any(st != "DONE" for st in states):
            raise RuntimeError("NIXL POSIX transfer failed")

    def checked(self, per_layer: bool) -> None:
        """Write, read back into the sentinel-filled destination, compare once."""
        for a in self.dst:
            a.view(np.uint8)[...] = 0xAA
        self.xfer("WRITE", per_layer)
        self.xfer("READ", per_layer)
        pairs = [(self.src[0], self.dst[0])] if not per_layer else list(zip(self.src[1:], self.dst[1:]))
        assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in pairs), \
            "NIXL POSIX read back other bytes"

    def row(self, op: str, per_layer: bool, secs: list[float], what: str = "raw NIXL POSIX") -> dict[str, object]:
        mem = self.lists[(op, per_layer)][0]
        return {"run": f"{what} {'offload' if op == 'WRITE' else 'restore'}", "cache": "layers" if per_layer else "rows",
                "descriptors": mem.shape[0], "ios": mem.shape[0], "requests": -(-mem.shape[0] // CHUNK),
                **_rates(self.n * self.row_bytes, secs)}

    def close(self) -> None:
        for r in self.regs:
            self.ag.deregister_memory(r)
        os.close(self.fd)


def _paired(args: argparse.Namespace, given: dict[tuple[str, str], Any], offload: Any, restore: Any, raw: RawPosix,
            out: list[dict[str, object]], room: Any, once: Any) -> list[str]:
    """Whole rows, the store's own path against raw NIXL POSIX, alternating in one process with
    the same agents alive (like with like): rows for the table, and each ratio's lines."""
    lines = []
    try:
        raw.checked(False)
    except Exception as exc:
        out.append({"run": f"raw NIXL POSIX failed: {exc!r:.60}", "cache": "-"})
        return []
    for what, fn, op, spec in (("offload", offload, "WRITE", "src rows"), ("restore", restore, "READ", "dst rows")):
        store_s: list[float] = []
        raw_s: list[float] = []
        once(fn, given[("pwritev", spec)])  # warm both
        raw.xfer(op, False)
        for k in range(args.repeat):  # raw, store, store, raw, ...: the neighbours' load falls on both
            for who in ((raw_s, store_s) if k % 2 == 0 else (store_s, raw_s)):
                if who is raw_s:
                    who += samples(lambda: raw.xfer(op, False), 1)
                else:
                    who += samples(lambda: fn(given[("pwritev", spec)]), 1, room(fn))
        t = once(fn, given[("pwritev", spec)])
        out.append(raw.row(op, False, raw_s, "paired: raw NIXL POSIX"))
        out.append({"run": f"paired: store {what} ({t.stats.path})", "cache": "rows", "requests": t.stats.posts,
                    "descriptors": t.stats.descriptors, "ios": t.stats.telemetry[0]["ios"],
                    **_rates(raw.n * raw.row_bytes, store_s)})
        each = sorted(r / s_ for r, s_ in zip(raw_s, store_s))
        lines.append(f"whole rows {what}, store / raw NIXL POSIX (paired, same live agents): "
                     f"{statistics.median(raw_s) / statistics.median(store_s):.2f}x of medians; "
                     f"per pair {', '.join(f'{x:.2f}' for x in each)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--stub-digests", action="store_true",
                    help="diagnostic: also run whole rows with the store's digests replaced by zeros (the path alone)")
    args = ap.parse_args()
    n = -(-args.tokens // TOKENS)
    work = tempfile.mkdtemp(dir=args.dir, prefix="kvxfer-bench-store-")
    try:
        run(args, n, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, n: int, work: str) -> None:
    src_rows, src_layers, keep_src = caches(n, True)
    dst_rows, dst_layers, keep_dst = caches(n, False)
    specs = {name: kvxfer.spec_from_tensors(t) for name, t in
             (("src rows", src_rows), ("src layers", src_layers), ("dst rows", dst_rows), ("dst layers", dst_layers))}
    row_bytes = specs["src rows"].row_bytes
    nbytes = n * row_bytes
    store = kvxfer.Store(os.path.join(work, "store"), capacity=n * row_bytes, layout=specs["src rows"],
                         threads=args.threads, timeout=600)
    keys = [b"%d" % i for i in range(n)]
    rng = np.random.default_rng(1)
    local = rng.permutation(n)  # local ids shuffled; the store gives consecutive slots
    out = []

    def offload(spec: Any) -> kvxfer.Transfer:
        return store.offload(spec, local, keys).wait()

    def room(fn: Any) -> Any:
        """What runs, untimed, before ``fn``: an offload of keys already stored writes nothing,
        so they are discarded first. Not part of an offload (raw NIXL POSIX has no index to
        clear); BENCHMARKS.md, "Issue 37: the store's discard, untimed"."""
        return (lambda: store.discard(keys)) if fn is offload else (lambda: None)

    def once(fn: Any, spec: Any) -> kvxfer.Transfer:
        """``fn`` untimed, its room made first."""
        room(fn)()
        return fn(spec)  # type: ignore[no-any-return]

    def restore(spec: Any) -> kvxfer.Transfer:
        return store.restore(keys, spec, local).wait()

    # The store's own path (a spec: preadv/pwritev) and NIXL POSIX (an agent of the nixl backend).
    given: dict[tuple[str, str], Any] = {("pwritev", k): v for k, v in specs.items()}
    agents = []
    try:
        for k, v in specs.items():
            a = kvxfer.Agent(f"bench-{k.replace(' ', '-')}", backend="nixl")
            a.register(v)
            agents.append(a)
            given[("nixl-posix", k)] = a
    except Exception as exc:
        out.append({"run": f"store over NIXL POSIX unavailable: {exc!r:.60}", "cache": "-"})
    raw = None
    try:  # like with like: raw NIXL POSIX runs beside the store, with the same agents alive
        raw = RawPosix.open(os.path.join(work, "nixl.dat"), n, row_bytes, keep_src, keep_dst, local)
    except Exception as exc:
        out.append({"run": f"raw NIXL POSIX failed: {exc!r:.60}", "cache": "-"})
    for (path, spec), what, fn, dst in [((p, s), w, f, d) for p in ("pwritev", "nixl-posix")
                                        for s, w, f, d in (("src rows", "offload", offload, None),
                                                           ("dst rows", "restore", restore, "rows"),
                                                           ("src layers", "offload", offload, None),
                                                           ("dst layers", "restore", restore, "layers"))
                                        if (p, s) in given]:
        t = once(fn, given[(path, spec)])  # warm-up, and the bytes checked once
        assert t.stats.path in ((path, "preadv") if path == "pwritev" else (path, path + "+stage")), t.stats.path
        if dst == "rows":
            assert np.array_equal(keep_dst[0].view(np.uint16), keep_src[0].view(np.uint16)), "restored rows differ"
            keep_dst[0].view(np.uint8)[...] = 0xAA
        elif dst == "layers":
            assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(keep_dst[1:], keep_src[1:])), "restored pages differ"
        secs = samples(lambda: fn(given[(path, spec)]), args.repeat, room(fn))
        ios = t.stats.telemetry[0]["ios"]  # system calls, staged row runs, or NIXL's one I/O per descriptor
        out.append({"run": f"store {what} ({t.stats.path})", "cache": spec.split()[1], "requests": t.stats.posts,
                    "descriptors": t.stats.descriptors, "ios": ios, "per_layer_ios": n * 2 * LAYERS,
                    **_rates(nbytes, secs)})
    paired = _paired(args, given, offload, restore, raw, out, room, once) if raw is not None else []
    if args.stub_digests:  # what the data path costs without the row digests (never a product setting)
        import kvxfer.store.store as store_module

        real = store_module.row_digests, store_module.local_row_digests
        store_module.row_digests = store_module.local_row_digests = \
            lambda spec, rows: np.zeros(rows.shape[0], np.uint64)  # the slab's digests and the cache's alike
        try:
            for path in ("pwritev", "nixl-posix"):
                for spec, what, fn in (("src rows", "offload", offload), ("dst rows", "restore", restore)):
                    if (path, spec) in given:
                        t = once(fn, given[(path, spec)])
                        secs = samples(lambda: fn(given[(path, spec)]), args.repeat, room(fn))
                        out.append({"run": f"store {what} ({t.stats.path}), digests stubbed", "cache": "rows",
                                    "requests": t.stats.posts, "descriptors": t.stats.descriptors,
                                    **_rates(nbytes, secs)})
        finally:
            store_module.row_digests, store_module.local_row_digests = real
    slots = np.arange(n)
    secs = samples(lambda: row_digests(store._slab.mapped, slots), args.repeat)
    out.append({"run": "row digests alone (kvxfer.integrity xxh3 rows, one thread)", "cache": "-",
                **_rates(nbytes, secs)})
    store.close()
    if raw is not None:  # per page, the per-layer store's reference (the agents still alive)
        try:
            raw.checked(True)
            for op in ("WRITE", "READ"):
                out.append(raw.row(op, True, samples(lambda: raw.xfer(op, True), args.repeat)))
        except Exception as exc:  # record the refusal next to the other numbers
            out.append({"run": f"raw NIXL POSIX failed: {exc!r:.60}", "cache": "-"})
        raw.close()
    for a in agents:
        a.close()
    target = os.path.join(work, "fio.dat")
    for rw in ("write", "read"):
        for direct in (0, 1):
            g = fio(target, rw, row_bytes, nbytes, direct, args.threads)
            out.append({"run": f"fio {rw} {'O_DIRECT' if direct else 'buffered'}", "cache": "-",
                        "ios": n if g is not None else None, "gbps": g, "best": None})
    print(f"{n} blocks of {row_bytes} bytes ({nbytes / 1e9:.3f} GB) per request, {args.threads} threads, "
          f"median of {args.repeat}; slab in {args.dir}")
    print_table(out, [Column("run"), Column("cache"), Column("requests", "posts", count),
                      Column("descriptors", fmt=count), Column("ios", "I/O calls", count),
                      Column("per_layer_ios", "I/Os, per-layer store", count), Column("gbps", "GB/s median", "{:.2f}"),
                      Column("best", "GB/s best", "{:.2f}")])
    for line in paired:
        print(line)


if __name__ == "__main__":
    main()
