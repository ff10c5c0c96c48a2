"""``kvxfer bench``: bandwidth and descriptors over request sizes and layouts, every byte checked.

The remote worker holds a model geometry (a preset or a spec file) in one process with the
caller (``--processes 1``) or in a child (``--processes 2``, through the peer harness of
:mod:`kvxfer._peer`). Each run resets the destination to the 0xAA sentinel, moves one
request of random blocks, and checks that the requested blocks hold the source's seeded
bytes and that nothing else changed: checks run outside the timed part, and a mismatch stops
the bench with an error. Times are the transfers' own (first post until done).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import numpy as np

from .args import add_json, int_list, plain, positive_int
from ..extras import install_hint
from .output import CliError, check_memory, emit_json, require_cuda
from .progress import Steps
from ..table import Column, count, print_table

__all__ = ["add_parser", "run", "plot"]

LAYOUTS = {"packed": True, "layers": False}
PLOT_INSTALL = install_hint("plot")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure transfers over request sizes and layouts, verifying every byte",
                       description=plain(__doc__))
    p.add_argument("--backend", default="loopback", help="any backend `kvxfer backends` lists (default loopback)")
    p.add_argument("--processes", type=int, choices=(1, 2), default=1,
                   help="1: both agents in this process; 2: the remote one in a child process")
    p.add_argument("--preset", default="mla-61", metavar="NAME|FILE", help="model geometry (default mla-61)")
    p.add_argument("--tokens", type=int_list, default=[1024, 4096, 16384], metavar="N,N,...",
                   help="request sizes in tokens (default 1024,4096,16384; 4k means 4096)")
    p.add_argument("--layouts", default="packed:packed,layers:packed", metavar="LOCAL:REMOTE,...",
                   help="cache layouts per side, packed (one row per block) or layers (one region per layer); "
                        "default packed:packed,layers:packed")
    p.add_argument("--op", choices=("read", "write"), default="read", help="read pulls into the local cache, "
                                                                            "write pushes into the remote one")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed runs per point, after one warm-up "
                                                                  "(default 3)")
    p.add_argument("--memory", choices=("DRAM", "VRAM"), default="DRAM",
                   help="where both caches live: host memory (DRAM, the default) or GPU memory (VRAM, needs CUDA)")
    p.add_argument("--options", default="{}", metavar="JSON", help="backend options, for example "
                                                                   "'{\"progress_thread\": true}'")
    p.add_argument("--seed", type=int, default=0, help="seed of the source bytes and of the random block ids "
                                                          "(default 0)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline per transfer, seconds (default 120)")
    p.add_argument("--store", metavar="PATH", help="offload to and restore from a kvxfer.Store in a temporary "
                                                   "folder under PATH instead of moving between agents")
    p.add_argument("--plot", metavar="FILE.png", help="draw GB/s and descriptors against request size "
                                                      f"(needs matplotlib: {PLOT_INSTALL})")
    add_json(p)
    p.set_defaults(fn=run)


def _layouts(text: str) -> list[tuple[str, str]]:
    out = []
    for item in text.split(","):
        local, sep, remote = item.strip().partition(":")
        if not sep or local not in LAYOUTS or remote not in LAYOUTS:
            raise CliError(f"--layouts: {item!r} is not LOCAL:REMOTE with each packed or layers")
        out.append((local, remote))
    return list(dict.fromkeys(out))


def _check_args(args: argparse.Namespace) -> tuple[Any, list[tuple[str, str]], dict[str, Any]]:
    from ..plugin.registry import get_backend_class
    from ..geometry import resolve

    try:
        options = json.loads(args.options)
    except ValueError as exc:
        raise CliError(f"--options is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise CliError("--options must be a JSON object")
    if args.timeout <= 0:
        raise CliError("--timeout must be positive")
    layouts = _layouts(args.layouts)
    geometry = resolve(args.preset)
    if args.plot and args.store:
        raise CliError("--plot draws peer transfers; it does not apply with --store")
    if args.plot:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise CliError(f"--plot: folder {folder} does not exist")
        _pyplot()  # fail before measuring, not after
    if args.memory == "VRAM":
        require_cuda("--memory VRAM")
    caps = get_backend_class(args.backend).capabilities
    if args.processes == 2 and not caps.cross_process:
        raise CliError(f"backend {args.backend!r} cannot cross processes; use --processes 1")
    if args.op.upper() not in {o.value for o in caps.ops}:
        raise CliError(f"backend {args.backend!r} does not support {args.op}")
    return geometry, layouts, options


class _Point:
    """Timed runs of one (layout, size) point."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.plan: list[float] = []
        self.stats: Any = None
        self.verified = 0


def run(args: argparse.Namespace) -> int:
    from ..agent import Agent
    from .._buffers import allocate
    from .._peer import InProcessPeer, PeerProcess

    geometry, layouts, options = _check_args(args)
    if args.store:
        from . import bench_store

        return bench_store.run(args, geometry, [(lo, LAYOUTS[lo]) for lo, _ in layouts], options)
    sizes = sorted(set(args.tokens))
    nmax = geometry.blocks_for(sizes[-1])
    pool = nmax + max(4, nmax // 8)
    source_remote = args.op == "read"
    if args.memory == "DRAM":  # the remote cache and one local cache at a time
        check_memory(2 * pool * geometry.row, "this bench")
    rows: list[dict[str, Any]] = []
    fill = f"{pool:,} blocks of {geometry.row / 1e6:.2f} MB"
    with Steps("kvxfer bench", len(layouts) * len(sizes) * (args.repeat + 1)) as steps:
        for remote_layout in dict.fromkeys(r for _, r in layouts):
            if args.processes == 2:
                with steps.step(f"starting the remote process ({remote_layout}, {fill}"
                                f"{', filled' if source_remote else ''})"):
                    peer: Any = PeerProcess.spawn(args.backend, name="remote", preset=args.preset,
                                                  layout=remote_layout, blocks=pool, memory=args.memory,
                                                  options=options, seed=args.seed if source_remote else None,
                                                  timeout=args.timeout)
            else:
                with steps.step(f"allocating the remote cache ({remote_layout}, {fill}"
                                f"{', filled' if source_remote else ''})"):
                    cache = allocate(geometry, pool, packed=LAYOUTS[remote_layout], memory=args.memory)
                    if source_remote:
                        cache.fill_blocks(args.seed)
                    peer = InProcessPeer(args.backend, cache, name="remote", options=options)
            try:
                for local_layout in (lo for lo, r in layouts if r == remote_layout):
                    with steps.step(f"allocating the local cache ({local_layout}, {fill}"
                                    f"{', filled' if not source_remote else ''})"):
                        local = allocate(geometry, pool, packed=LAYOUTS[local_layout], memory=args.memory)
                        if not source_remote:
                            local.fill_blocks(args.seed)
                    with Agent("local", backend=args.backend, timeout=args.timeout, **options) as agent:
                        with steps.step("registering and connecting"):
                            local.register(agent)
                            name = agent.add_peer(peer.metadata)
                            agent.read(name, [], []).wait()  # connect outside the timed runs
                        for tokens in sizes:
                            n = geometry.blocks_for(tokens)
                            point = f"{local_layout}:{remote_layout} {tokens:,} tokens"
                            with steps.step(f"{point}, {args.repeat + 1} runs"):
                                pt = _measure(args, agent, name, peer, local, n, pool, steps, point)
                            rows.append(_row(args, f"{local_layout}:{remote_layout}", tokens, n, pt))
                    del local
            finally:
                peer.close()
    order = [f"{lo}:{r}" for lo, r in layouts]
    rows.sort(key=lambda r: (order.index(r["layout"]), r["tokens"]))
    if args.plot:
        plot(rows, args.plot, title=f"kvxfer bench: {args.backend}, {processes(args.processes)}, {args.op}, "
                                    f"{geometry.name}, {args.memory}", note=caption(rows, args.backend))
    if args.json:
        emit_json(rows)
        return 0
    print_table(rows, [Column("layout", "local:remote"), Column("tokens", fmt=count), Column("blocks", fmt=count),
                       Column("descriptors", fmt=count), Column("posts"),
                       Column("bytes", "GB", lambda v: f"{v / 1e9:.3f}"),
                       Column("median_seconds", "median ms", lambda v: f"{v * 1e3:.2f}"),
                       Column("gbps", "GB/s", "{:.2f}"), Column("plan_seconds", "plan ms", lambda v: f"{v * 1e3:.3f}"),
                       Column("verified", "verified runs")],
                title=f"kvxfer bench: {args.backend}, {processes(args.processes)}, {args.op}, {geometry.name} "
                      f"({geometry.row / 1e6:.2f} MB rows), {args.memory}; median of {args.repeat}",
                caption=f"plot: {args.plot}" if args.plot else None)
    return 0


def _measure(args: argparse.Namespace, agent: Any, name: str, peer: Any, local: Any, n: int, pool: int,
             steps: Steps, point: str) -> _Point:
    from ..errors import VerificationError

    rng = np.random.default_rng((args.seed, n))
    src, dst = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
    pt = _Point()
    for i in range(args.repeat + 1):  # run 0 warms up (plans, prepared lists, page faults)
        run = "warm-up" if i == 0 else f"run {i}/{args.repeat}"
        with steps.step(f"{point}, {run}: transfer"):
            if args.op == "read":
                local.reset()
                t = agent.read(name, dst, src).wait(args.timeout)
            else:
                peer.call({"cmd": "fill", "byte": 0xAA})
                t = agent.write(name, src, dst).wait(args.timeout)
        with steps.step(f"{point}, {run}: verifying {n:,} blocks and the sentinel"):
            if args.op == "read":
                problem = local.verify(dst, src, args.seed)
            else:
                problem = peer.call({"cmd": "verify", "dst": dst.tolist(), "src": src.tolist(),
                                     "seed": args.seed})["problem"]
        if problem:
            raise VerificationError(f"VERIFY FAILED at {n} blocks: {problem}")
        pt.verified += 1
        if i:
            pt.seconds.append(t.stats.seconds)
            pt.plan.append(t.stats.plan_seconds)
        pt.stats = t.stats
        steps.advance()
    return pt


def _row(args: argparse.Namespace, layout: str, tokens: int, blocks: int, pt: _Point) -> dict[str, Any]:
    med = statistics.median(pt.seconds)
    s = pt.stats
    return {"backend": args.backend, "processes": args.processes, "op": args.op, "memory": args.memory,
            "preset": args.preset, "layout": layout, "tokens": tokens, "blocks": blocks,
            "descriptors": s.descriptors, "posts": s.posts, "bytes": s.nbytes, "mode": s.mode, "path": s.path,
            "median_seconds": med, "min_seconds": min(pt.seconds), "max_seconds": max(pt.seconds), "gbps": s.nbytes / med / 1e9 if med else None,
            "plan_seconds": statistics.median(pt.plan), "verified": pt.verified}


def _pyplot() -> Any:
    from ..errors import MissingDependencyError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError(f"--plot needs matplotlib; install it with: {PLOT_INSTALL}") from None
    return plt


def processes(n: int) -> str:
    return "1 process" if n == 1 else f"{n} processes"


def caption(rows: list[dict[str, Any]], backend: str) -> str:
    """What the backend's cost per descriptor means for the layouts, from these rows.

    Over a transport the sentence after the ratios is chosen by the ratios themselves: a fixed
    "fewer descriptors move faster" once sat under a run whose per-layer layout was as fast
    (issue 33), and a caption must not contradict the plot above it.
    """
    top = max(r["tokens"] for r in rows)
    last = {r["layout"]: r for r in rows if r["tokens"] == top and r["gbps"]}
    base = last.get("packed:packed")
    out, speeds = [], []
    if base is not None:
        for layout, r in last.items():
            if layout != "packed:packed":
                more, speed = r["descriptors"] / base["descriptors"], r["gbps"] / base["gbps"]
                out.append(f"at {top:,} tokens, {layout} carries {more:,.0f}x "
                           f"the descriptors of packed:packed and moves at {speed:.2f}x its GB/s")
                if more > 1:
                    speeds.append(speed)
    if backend == "loopback":
        why = ("loopback copies with memmove inside one process, so a descriptor costs little more than its bytes "
               "and both layouts run at memory speed; over a transport each descriptor is a work request, and "
               "per-layer layouts pay for every one (BENCHMARKS.md)")
    elif not speeds:
        why = "no layout here carries more descriptors than packed:packed, so this run shows no cost per descriptor"
    elif max(speeds) < 0.9:
        why = (f"{backend} pays per descriptor: the layouts that need more descriptors per block moved slower "
               "for the same bytes")
    elif min(speeds) > 1.1:
        why = (f"the layouts with more descriptors moved faster here: {backend}'s cost per descriptor did not "
               "limit this run (compare the spread)")
    else:
        why = (f"in this run the extra descriptors cost {backend} little or nothing measurable at this size "
               "(compare the spread)")
    text = "; ".join(out + [why])
    return text[0].upper() + text[1:] + ". Points: median; bars: min to max of the timed runs."


def plot(rows: list[dict[str, Any]], path: str, *, title: str, note: str = "") -> None:
    """GB/s (median, min-max bars) and descriptors per transfer against request size, one line per
    layout pair, with ``note`` as the caption under both panels."""
    import textwrap

    plt = _pyplot()
    fig, (ax_bw, ax_desc) = plt.subplots(1, 2, figsize=(11, 4.8))
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == layout]
        xs = [r["tokens"] for r in mine]
        med = [r["gbps"] for r in mine]
        lo = [r["bytes"] / r["max_seconds"] / 1e9 if r.get("max_seconds") else g for r, g in zip(mine, med)]
        hi = [r["bytes"] / r["min_seconds"] / 1e9 if r.get("min_seconds") else g for r, g in zip(mine, med)]
        ax_bw.errorbar(xs, med, yerr=[[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]],
                       marker="o", capsize=3, label=layout)
        ax_desc.plot(xs, [r["descriptors"] for r in mine], marker="o", label=layout)
    sizes = sorted({r["tokens"] for r in rows})
    for ax, ylabel in ((ax_bw, "GB/s (median; bars: min-max)"), (ax_desc, "descriptors per transfer")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{x:,}" for x in sizes])
        ax.minorticks_off()
        ax.margins(x=0.08, y=0.12)  # no marker cut in half at an edge
        ax.set_xlabel("request size (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="local:remote")
    ax_desc.set_yscale("log")
    ax_bw.set_ylim(bottom=0, top=max(r["bytes"] / r["min_seconds"] / 1e9 if r.get("min_seconds") else r["gbps"] or 0
                                     for r in rows) * 1.15 or None)
    fig.suptitle(title)
    if note:
        fig.text(0.01, 0.01, "\n".join(textwrap.wrap(note, 160)), fontsize=8, va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.1 if note else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
