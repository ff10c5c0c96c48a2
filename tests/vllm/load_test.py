"""The whole P/D path with both cores busy: a script, not a test (it takes minutes).

``.venv-vllm/bin/python tests/vllm/load_test.py [--busy-seconds 900] [--requests 8] [--nixl-rounds 6]``

1. A plain vLLM instance computes the reference tokens, alone, before any load starts.
2. Two busy processes start, each pinned to one core and spinning a numpy loop; each stops
   by itself after ``--busy-seconds`` (and is stopped by this script when it ends first).
3. A kvxfer prefill/decode pair (vLLM CPU, NIXL, signed parameters, the tests' settings)
   starts under that load and serves ``--requests`` prompts. Every request must load its KV
   (``vllm:kvxfer_loaded_tokens`` = the prompt, bytes = blocks x layers x page, no
   ``kvxfer_failed_loads``) and answer the reference's tokens; the first one included.
4. ``--nixl-rounds`` two-process NIXL transfers (``idle_prefill.py``, a fresh prefill process
   each round, so fresh agent metadata): unsigned metadata with ``prove_metadata`` on, proven
   in a helper process before it is loaded; every byte checked, and the prover's own count
   must show one proof per round.

Prints one summary line per phase and a JSON summary at the end; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import e2e  # noqa: E402
from harness import write_tiny_llama  # noqa: E402

BUSY = """
import os, sys, time
import numpy as np
os.sched_setaffinity(0, {int(sys.argv[1])})
deadline = time.monotonic() + float(sys.argv[2])
a = np.random.default_rng(0).random((256, 256))
n = 0
while time.monotonic() < deadline:
    a = (a @ a) / 256.0
    n += 1
print(n, flush=True)
"""


def busy(seconds: float) -> list[subprocess.Popen]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    return [subprocess.Popen([sys.executable, "-c", BUSY, str(c), str(seconds)], env=env, stdout=subprocess.PIPE)
            for c in cpus]


def alive(procs: list[subprocess.Popen]) -> bool:
    return all(p.poll() is None for p in procs)


def prompts(n: int) -> list[list[int]]:
    """The suite's four measured prompts, then seeded ones of 100-700 tokens."""
    out = list(e2e.PROMPTS)
    i = 0
    while len(out) < n:
        out.append(e2e._prompt(1000 + i, 100 + (137 * i) % 600))
        i += 1
    return out[:n]


def vllm_phase(model: Path, logdir: Path, ps: list[list[int]], hogs: list[subprocess.Popen]) -> dict:
    t0 = time.monotonic()
    pair = e2e.start_kvxfer_pair(model, logdir, "LBHNC")
    rows, problems = [], []
    try:
        for e in pair.engines:
            e.wait_ready()
        started = time.monotonic() - t0
        busy_at_start = alive(hogs)
        for p in ps:
            out = e2e.decode(pair, p, e2e.prefill(pair, p))
            d = out["delta"]
            row = {"tokens": len(p), "loaded_tokens": d.get("vllm:kvxfer_loaded_tokens", 0),
                   "bytes": d.get("vllm:kvxfer_bytes_transferred:sum", 0),
                   "failed_loads": d.get("vllm:kvxfer_failed_loads", 0),
                   "token_equal": out["tokens"][0] == e2e.REFERENCE[tuple(p)], "decode_s": round(out["seconds"], 2)}
            rows.append(row)
            want = e2e.blocks(len(p)) * e2e.LAYERS * e2e.PAGE
            if not (row["token_equal"] and row["loaded_tokens"] == len(p) and row["bytes"] == want
                    and not row["failed_loads"]):
                problems.append(row)
            print(f"  vllm request {len(rows)}: {row}", flush=True)
        loaded = sum(r["loaded_tokens"] == r["tokens"] for r in rows)
        return {"pair_start_s": round(started, 1), "requests": len(rows), "loaded": loaded,
                "token_equal": sum(r["token_equal"] for r in rows), "problems": problems,
                "busy_throughout": busy_at_start and alive(hogs), "seconds": round(time.monotonic() - t0, 1),
                "decode_s_max": max((r["decode_s"] for r in rows), default=None)}
    finally:
        for e in pair.engines:
            e.stop()


def nixl_phase(rounds: int, hogs: list[subprocess.Popen]) -> dict:
    from idle_prefill import load_from_idle_prefill

    t0 = time.monotonic()
    times, errors = [], []
    for i in range(rounds):
        try:
            times.append(round(load_from_idle_prefill({"prove_metadata": True}), 3))
            print(f"  nixl round {i + 1}: verified, load {times[-1]} s", flush=True)
        except Exception as exc:  # counted and reported; the script fails at the end
            errors.append(f"round {i}: {exc!r}")
            print(f"  nixl round {i + 1}: {exc!r}", flush=True)
    from kvxfer.prove import health

    stats = {k: v for k, v in health().items() if isinstance(v, int)}
    return {"rounds": rounds, "verified": len(times), "errors": errors, "prover": stats,
            "busy_throughout": alive(hogs), "load_s": times, "seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy-seconds", type=float, default=900)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--nixl-rounds", type=int, default=6)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    d = Path(os.environ.get("KVXFER_E2E_DIR") or tempfile.mkdtemp(prefix="kvxfer-load-test-"))
    d.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(d / "tiny-llama")
    ps = prompts(args.requests)
    summary: dict = {"logs": str(d), "load_average_before": os.getloadavg()}
    t0 = time.monotonic()
    if not args.skip_vllm:
        ref = e2e.start_engine("reference", model, d)
        try:
            ref.wait_ready()
            for p in ps:
                e2e.REFERENCE[tuple(p)] = ref.generate([p], e2e.MAX_TOKENS)["tokens"][0]
        finally:
            ref.stop()
        summary["reference_s"] = round(time.monotonic() - t0, 1)
    hogs = busy(args.busy_seconds)
    try:
        time.sleep(2)
        if not args.skip_vllm:
            summary["vllm"] = vllm_phase(model, d, ps, hogs)
            print(f"vllm: {summary['vllm']}", flush=True)
        summary["nixl"] = nixl_phase(args.nixl_rounds, hogs)
        print(f"nixl: {summary['nixl']}", flush=True)
    finally:
        summary["load_average_end"] = os.getloadavg()
        for h in hogs:
            if h.poll() is None:
                h.terminate()
            h.wait(timeout=30)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    n = summary["nixl"]
    ok = n["verified"] == args.nixl_rounds and n["prover"].get("proven", 0) >= args.nixl_rounds
    if "vllm" in summary:
        v = summary["vllm"]
        ok = ok and not v["problems"] and v["loaded"] == v["token_equal"] == args.requests
    summary["ok"] = ok
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
