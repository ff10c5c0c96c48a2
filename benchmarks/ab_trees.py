"""Two trees, one run: ``bench_ucx.py`` and ``bench_nixl.py`` against each, alternating.

On a shared machine two separate runs measure the neighbours as much as the code. This
script runs this tree's bench scripts with ``PYTHONPATH`` pointing at tree A, then B, then
B, then A (and so on, ``--rounds`` times), and prints per tree the median over every counted
iteration of every round: GB/s, and the initiator's CPU milliseconds per transfer, which
contention disturbs far less than wall time. Raw NIXL runs inside the same bench processes
(``nixl-raw``, bench_nixl's ``raw`` rows) and is the control: the same code in both trees.

    git archive BASE | tar -x -C /tmp/base
    python benchmarks/ab_trees.py --a /tmp/base --b . --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
UCX_ARGS = ["--json", "--modes", "ucx,ucx-rma,agent-ucx,agent-ucx-rma,nixl-raw,agent-nixl", "--rows", "100",
            "--iters", "11"]
NIXL_ARGS = ["--memory", "DRAM", "--blocks", "128", "--iters", "7", "--small-iters", "50", "--write"]


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'plugins'}"}


def _ucx(tree: Path) -> list[dict[str, Any]]:
    p = subprocess.run([sys.executable, str(HERE / "bench_ucx.py"), *UCX_ARGS], env=_env(tree), capture_output=True,
                       text=True, timeout=900)
    return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]


def _nixl(tree: Path) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        p = subprocess.run([sys.executable, str(HERE / "bench_nixl.py"), *NIXL_ARGS, "--json", str(out)],
                           env=_env(tree), capture_output=True, text=True, timeout=900)
        if p.returncode or not out.exists():
            print(f"bench_nixl failed in {tree}: {p.stderr.strip()[-300:]}", file=sys.stderr)
            return []
        return json.loads(out.read_text())["runs"]  # type: ignore[no-any-return]


#: The agent's own per-transfer work, without a transport to wait on: loopback reads, CPU time.
AGENT_COST = """
import json, statistics, time
import kvxfer
from kvxfer.testing.buffers import make_cache
g = dict(num_layers=61, page=73728)
src, dst = make_cache("packed", num_blocks=128, seed=1, **g), make_cache("packed", num_blocks=128, **g)
with kvxfer.Agent("p", backend="loopback") as a, kvxfer.Agent("d", backend="loopback") as b:
    a.register(src.views); b.register(dst.views); b.add_peer(a.metadata())
    out = []
    for name, blocks, n in (("1 block", [3], 300), ("128 blocks", list(range(128)), 30)):
        ts = []
        for _ in range(n):
            c0 = time.process_time(); b.read("p", blocks, blocks).wait(); ts.append(time.process_time() - c0)
        out.append({"mode": name, "cpu_ms": 1e3 * statistics.median(ts[5:])})
    print(json.dumps(out))
"""


def _agent(tree: Path) -> list[dict[str, Any]]:
    p = subprocess.run([sys.executable, "-c", AGENT_COST], env=_env(tree), capture_output=True, text=True, cwd="/",
                       timeout=600)
    return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else []  # type: ignore[no-any-return]


def _fixed(tree: Path) -> list[dict[str, Any]]:
    """``bench_fixed_cost.py`` of the tree itself (its helpers import that tree's kvxfer):
    one-block READs, raw NIXL beside kvxfer and the owner in the same process."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "f.json"
        p = subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_fixed_cost.py"), "--sizes", "4KB,64KB",
                            "--json", str(out)], env=_env(tree), capture_output=True, text=True, timeout=900)
        if p.returncode or not out.exists():
            print(f"bench_fixed_cost failed in {tree}: {p.stderr.strip()[-300:]}", file=sys.stderr)
            return []
        return [r for r in json.loads(out.read_text())["rows"] if "median_us" in r]  # type: ignore[no-any-return]


def _which(tree: Path) -> str:
    code = "import kvxfer, kvxfer_ucx, kvxfer_nixl; print(kvxfer.__file__, kvxfer_ucx.__file__, kvxfer_nixl.__file__)"
    return subprocess.run([sys.executable, "-c", code], env=_env(tree), capture_output=True, text=True,
                          cwd="/").stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="tree A (before)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (after)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None, help="also write every sample here")
    ap.add_argument("--benches", default="ucx,nixl", help="which of ucx, nixl (the bench scripts), agent "
                    "(loopback reads: the agent's own CPU time per transfer) and fixed (bench_fixed_cost) to run")
    a = ap.parse_args()
    trees = {"A": a.a.resolve(), "B": a.b.resolve()}
    for k, t in trees.items():
        print(f"{k}: {_which(t)}", flush=True)
    gbps: dict[tuple[str, str], list[float]] = defaultdict(list)
    cpu: dict[tuple[str, str], list[float]] = defaultdict(list)
    fixed: dict[tuple[str, str], list[float]] = defaultdict(list)  # (size who, tree): medians in us
    for r in range(a.rounds):
        for k in ("AB" if r % 2 == 0 else "BA"):
            for rec in _ucx(trees[k]) if "ucx" in a.benches else []:
                if "gbps" in rec:  # every counted iteration's GB/s; CPU time: the run's median
                    name = f"bench_ucx {rec['mode']}"
                    gbps[(name, k)].extend(rec["samples_gbps"])  # warm-up already left out
                    cpu[(name, k)].append(rec["cpu_ms"])
            for rec in _agent(trees[k]) if "agent" in a.benches else []:
                cpu[(f"agent loopback {rec['mode']}", k)].append(rec["cpu_ms"])
            for rec in _nixl(trees[k]) if "nixl" in a.benches else []:
                name = f"bench_nixl {rec['who']} {rec['mode']} {rec['op']}"
                nbytes = rec["bytes"]
                gbps[(name, k)].extend(nbytes / s / 1e9 for s in rec["samples_s"])
                cpu[(name, k)].extend(1e3 * c for c in rec["cpu_s"])
            for rec in _fixed(trees[k]) if "fixed" in a.benches else []:
                fixed[(f"{rec['size']} {rec['who']}", k)].append(rec["median_us"])
                fixed[(f"{rec['size']} {rec['who']} over raw", k)].append(rec["added_vs_raw_us"])
            print(f"round {r + 1} {k} done", flush=True)
    print("| benchmark | GB/s samples A / B | median GB/s A / B | CPU ms per transfer A / B (B/A) |")
    print("|---|---|---|---|")
    for name in sorted({n for n, _ in cpu}):
        ga, gb, ca, cb = gbps[(name, "A")], gbps[(name, "B")], cpu[(name, "A")], cpu[(name, "B")]
        if not ca or not cb:
            continue
        ma, mb = statistics.median(ca), statistics.median(cb)
        bw = f"{statistics.median(ga):.2f} / {statistics.median(gb):.2f}" if ga and gb else "-"
        print(f"| {name} | {len(ga)} / {len(gb)} | {bw} | {ma:.3f} / {mb:.3f} ({mb / ma:.2f}×) |", flush=True)
    if fixed:
        print("| bench_fixed_cost (one-block READ) | median of the rounds' medians, us, A / B | rounds' medians B |")
        print("|---|---|---|")
        for name in sorted({n for n, _ in fixed}):
            fa, fb = fixed[(name, "A")], fixed[(name, "B")]
            if fa and fb:
                print(f"| {name} | {statistics.median(fa):.1f} / {statistics.median(fb):.1f} | "
                      f"{', '.join(f'{v:.1f}' for v in fb)} |", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"gbps": {f"{n}|{k}": v for (n, k), v in gbps.items()},
                                      "cpu_ms": {f"{n}|{k}": v for (n, k), v in cpu.items()},
                                      "fixed_us": {f"{n}|{k}": v for (n, k), v in fixed.items()}}))


if __name__ == "__main__":
    main()
