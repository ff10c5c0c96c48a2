"""``kvxfer plan``: what one request costs between two workers' layouts, and why.

Each side is a preset or a spec file, optionally on another tensor- or pipeline-parallel
rank. The table shows descriptors, bytes, whether rows move whole or split at member
boundaries, and the reason the planner chose that.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from .args import add_json, positive_int, rank_of
from .output import CliError, emit_json
from ..table import Column, count, print_table

__all__ = ["add_parser", "plan_rows", "explain", "EXIT_REFUSED"]

#: Exit status when a pairing is refused (the table or JSON still says why).
EXIT_REFUSED = 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="descriptors and bytes for one request between two layouts (presets or spec files)",
        description="Plan one request and show its descriptors, bytes, whole-row or split moves and why. "
                    "Without --local/--remote: every preset, local packed against a packed and a per-layer "
                    "remote. Sides are preset names (see --list) or spec files (.toml or .json).")
    p.add_argument("--tokens", type=positive_int, default=100_000, help="request length (default 100000)")
    p.add_argument("--preset", action="append", metavar="NAME|FILE", help="limit the default table to these "
                   "(repeatable)")
    p.add_argument("--local", metavar="NAME|FILE", help="the local (initiating) worker's geometry")
    p.add_argument("--remote", metavar="NAME|FILE", help="the remote worker's geometry (default: --local's)")
    for side in ("local", "remote"):
        p.add_argument(f"--{side}-layout", choices=("packed", "layers", "both"), default=None,
                       help=f"{side} cache: one row per block (packed), one region per layer, or both "
                            "(default: the spec's own; for the default table: packed local, both remote)")
        p.add_argument(f"--{side}-tp", type=rank_of, metavar="RANK/SIZE", help=f"{side} tensor-parallel rank")
        p.add_argument(f"--{side}-pp", type=rank_of, metavar="RANK/SIZE", help=f"{side} pipeline-parallel rank")
    p.add_argument("--tp", type=rank_of, metavar="RANK/SIZE", help="tensor-parallel rank of both sides")
    p.add_argument("--seed", type=int, default=0, help="seed for the random block ids")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    add_json(p)
    p.set_defaults(fn=run)


def _label(g: Any) -> str:
    parts = [g.name, "packed" if g.packed else "layers"]
    if g.tp_size > 1:
        parts.append(f"tp{g.tp_rank}/{g.tp_size}")
    if g.pp_size > 1:
        parts.append(f"pp{g.pp_rank}/{g.pp_size}")
    return " ".join(parts)


def explain(p: Any) -> str:
    """Why the planner moved whole rows or split them (from the two specs, not its arithmetic)."""
    local, remote = p.local_spec, p.remote_spec
    where = {m.name: ri for ri, r in enumerate(remote.regions) for m in r.members}
    reasons: list[str] = []
    for lr in local.regions:  # the pair passed the pairing rules: every member means the same bytes
        rr = remote.regions[where[lr.members[0].name]]
        replicated = all(m.replicated for m in lr.members)
        same = lr.layout.canonical == rr.layout.canonical
        if same and len(lr.members) == 1:
            why = "one region per layer on both sides: one descriptor per layer and block"
        elif same:
            why = "same members in the same row layout on both sides" + (
                "" if replicated else " (head-split members holding the same heads)")
        elif len(rr.members) < len(lr.members):
            why = "the remote keeps one region per layer"
        elif len(rr.members) > len(lr.members):
            why = "the local side keeps one region per layer"
        else:
            why = "member order, offsets or sizes differ inside the row"
        if why not in reasons:
            reasons.append(why)
    return "; ".join(reasons)


def _sides(args: argparse.Namespace) -> list[tuple[Any, Any]]:
    from ..geometry import PRESETS, resolve

    def variants(g: Any, layout: str | None, tp: Any, pp: Any) -> list[Any]:
        g = g.with_parallel(tp, pp)
        if layout == "both":
            return [g.with_layout(True), g.with_layout(False)]
        return [g.with_layout(None if layout is None else layout == "packed")]

    tp_l = args.local_tp or args.tp
    tp_r = args.remote_tp or args.tp
    if args.local or args.remote:
        if args.preset:
            raise CliError("--preset selects the default table; with --local/--remote name the sides only")
        local = resolve(args.local or args.remote)
        remote = resolve(args.remote) if args.remote else local
        ls = variants(local, args.local_layout, tp_l, args.local_pp)
        rs = variants(remote, args.remote_layout, tp_r, args.remote_pp)
        return [(a, b) for a in ls for b in rs]
    pairs = []
    for name in args.preset or list(PRESETS):
        g = resolve(name)
        ls = variants(g, args.local_layout or "packed", tp_l, args.local_pp)
        rs = variants(g, args.remote_layout or "both", tp_r, args.remote_pp)
        pairs += [(a, b) for a in ls for b in rs]
    return pairs


def plan_rows(pairs: list[tuple[Any, Any]], tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    """One row per (local, remote) geometry pair; a refused pairing is a row that says why."""
    from ..errors import LayoutMismatchError
    from ..pairing import pair
    from ..planner import plan

    rng = np.random.default_rng(seed)
    rows = []
    for lg, rg in pairs:
        n = lg.blocks_for(tokens)
        pool = 2 * n
        lb, rb = rng.permutation(pool)[:n], rng.permutation(pool)[:n]
        row: dict[str, Any] = {"local": _label(lg), "remote": _label(rg), "tokens": tokens, "blocks": n}
        local, remote = lg.spec(pool), rg.spec(pool)
        t0 = time.perf_counter()
        try:  # the verdict Agent.add_peer reaches: the same pair() on the same discovered specs
            p = plan(local, remote, lb, rb, pairing=pair(local, remote))
        except LayoutMismatchError as exc:
            if _resharded(lg, rg):  # what read_many runs over every rank of the remote's TP x PP grid
                try:
                    row.update(_gather_row(lg, rg, local, pool, lb, rng))
                except LayoutMismatchError:
                    pass  # no gather either: report the direct pair's refusal, the one add_peer gives
                else:
                    rows.append(row)
                    continue
            diff = ", ".join(f"{f}: {a} vs {b}" for f, a, b in exc.diff[:3])
            row.update(descriptors=None, bytes=None, mode="refused", why=f"{str(exc).splitlines()[0]} ({diff})",
                       plan_seconds=None, error=type(exc).__name__)
        else:
            row.update(descriptors=p.descriptors, bytes=p.nbytes, mode=p.mode, why=explain(p),
                       plan_seconds=time.perf_counter() - t0)
        rows.append(row)
    return rows


def _resharded(lg: Any, rg: Any) -> bool:
    """Sides of different TP or PP sizes: one remote rank rarely holds a rank's pages, read_many gathers them."""
    return (lg.tp_size, lg.pp_size) != (rg.tp_size, rg.pp_size)


def _gather_row(lg: Any, rg: Any, local: Any, pool: int, lb: Any, rng: Any) -> dict[str, Any]:
    """The plan ``Agent.read_many`` makes reading one request from every remote rank: the same
    ``cached_gather`` and ``plan_gather``; ranks that hold nothing this rank needs are not read."""
    from ..pairing import cached_gather
    from ..planner import plan_gather

    ranks = {_label(g): g for t in range(rg.tp_size) for q in range(rg.pp_size)
             for g in [rg.with_parallel((t, rg.tp_size), (q, rg.pp_size))]}
    k = max(1, local.block_tokens // next(iter(ranks.values())).block_tokens)  # remote blocks per local block
    specs = {n: g.spec(pool * k) for n, g in ranks.items()}
    t0 = time.perf_counter()
    gathered = cached_gather(local, specs)
    blocks = {n: rng.permutation(pool * gathered.k)[:lb.shape[0] * gathered.k] for n in gathered.tables}
    plans = plan_gather(gathered, local, specs, lb, blocks)
    seconds = time.perf_counter() - t0
    parts = ", ".join(f"{n}: {p.descriptors:,}" for n, p in plans.items())
    return {"descriptors": sum(p.descriptors for p in plans.values()), "bytes": sum(p.nbytes for p in plans.values()),
            "mode": "gather", "plan_seconds": seconds, "peers": {n: p.descriptors for n, p in plans.items()},
            "why": f"read_many over {len(plans)} of {len(ranks)} remote ranks (descriptors {parts})"}


def run(args: argparse.Namespace) -> int:
    from ..geometry import PRESETS

    if args.list:
        rows = [{"preset": g.name, "layers": g.num_layers, "members": len(g.members), "block_tokens": g.block_tokens,
                 "row_bytes": g.row, "description": g.description} for g in PRESETS.values()]
        if args.json:
            emit_json(rows)
        else:
            print_table(rows, ["preset", "layers", "members", "block_tokens",
                               Column("row_bytes", "row bytes", count), "description"])
        return 0
    rows = plan_rows(_sides(args), args.tokens, args.seed)
    refused = sum(r["mode"] == "refused" for r in rows)
    if args.json:
        emit_json(rows)
    else:
        _print(rows, args)
    if refused:  # scripts use `kvxfer plan` as a check: a refused pairing is a failure
        print(f"kvxfer plan: {refused} of {len(rows)} pairing(s) refused", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print_table(rows, [Column("local"), Column("remote"), Column("blocks", fmt=count),
                       Column("descriptors", fmt=count), Column("bytes", "GB", lambda v: f"{v / 1e9:.2f}"),
                       Column("mode"), Column("plan_seconds", "plan ms", lambda v: f"{v * 1e3:.3f}"),
                       Column("why")],
                title=f"{args.tokens:,}-token request; plan ms includes matching members for a new pair of specs")
