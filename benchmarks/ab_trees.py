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
    ap.add_argument("--benches", default="ucx,nixl", help="which of bench_ucx and bench_nixl to run")
    a = ap.parse_args()
    trees = {"A": a.a.resolve(), "B": a.b.resolve()}
    for k, t in trees.items():
        print(f"{k}: {_which(t)}", flush=True)
    gbps: dict[tuple[str, str], list[float]] = defaultdict(list)
    cpu: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in range(a.rounds):
        for k in ("AB" if r % 2 == 0 else "BA"):
            for rec in _ucx(trees[k]) if "ucx" in a.benches else []:
                if "gbps" in rec:  # every counted iteration's GB/s; CPU time: the run's median
                    name = f"bench_ucx {rec['mode']}"
                    gbps[(name, k)].extend(rec["samples_gbps"])  # warm-up already left out
                    cpu[(name, k)].append(rec["cpu_ms"])
            for rec in _nixl(trees[k]) if "nixl" in a.benches else []:
                name = f"bench_nixl {rec['who']} {rec['mode']} {rec['op']}"
                nbytes = rec["bytes"]
                gbps[(name, k)].extend(nbytes / s / 1e9 for s in rec["samples_s"])
                cpu[(name, k)].extend(1e3 * c for c in rec["cpu_s"])
            print(f"round {r + 1} {k} done", flush=True)
    print("| benchmark | GB/s samples A / B | median GB/s A / B | CPU ms per transfer A / B (B/A) |")
    print("|---|---|---|---|")
    for name in sorted({n for n, _ in gbps}):
        ga, gb, ca, cb = gbps[(name, "A")], gbps[(name, "B")], cpu[(name, "A")], cpu[(name, "B")]
        if not ga or not gb:
            continue
        ma, mb = statistics.median(ca), statistics.median(cb)
        print(f"| {name} | {len(ga)} / {len(gb)} | {statistics.median(ga):.2f} / {statistics.median(gb):.2f} | "
              f"{ma:.1f} / {mb:.1f} ({mb / ma:.2f}×) |", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"gbps": {f"{n}|{k}": v for (n, k), v in gbps.items()},
                                      "cpu_ms": {f"{n}|{k}": v for (n, k), v in cpu.items()}}))


if __name__ == "__main__":
    main()
