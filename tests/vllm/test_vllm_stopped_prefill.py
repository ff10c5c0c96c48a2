"""Two prefills, one decode (real vLLM instances on CPU); one prefill is SIGSTOPped.

Each decode call carries one request from each prefill. Healthy, both load and answer as a
plain instance does. Then prefill A is stopped (its whole process group) after handing out
its parameters: B's request must still load and stay token-equal, A's must fail alone and
recompute (token-equal too), within ``transfer_timeout``. The decode's own figures for both
calls (wall time, ``start_load_kv`` seconds, inter-token latency, which a blocked step would
raise) are written to ``build/vllm-stopped-prefill.json``; BENCHMARKS.md ("A stopped
prefill") has them. Three engines and the reference: kept to one case, two calls.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from e2e import MAX_TOKENS, PROMPTS, REFERENCE, TOKEN, WARMUP, kvxfer_config, leave
from harness import TOKEN_ENV, free_port, pair_cpus, start_engine

pytestmark = [pytest.mark.timeout(3000), pytest.mark.multiprocess, pytest.mark.nixl]

#: Short enough to finish the stopped call soon (A's load fails at ``transfer_timeout``), long
#: enough for two busy cores: the routes are open before A stops and a load here takes about 0.1 s.
TIMES = {"transfer_timeout": 10, "handshake_timeout": 15, "lease_seconds": 60}


def _prefill(engine: Any, prompt: list[int]) -> dict[str, Any]:
    params = engine.generate([prompt], 1, [{"do_remote_decode": True}])["params"][0]
    assert params and params.get("do_remote_prefill") is True, params
    return params


def _figures(out: dict[str, Any]) -> dict[str, Any]:
    d = out["delta"]

    def mean(name: str) -> float | None:
        n = d.get(f"{name}:count")
        return round(1e3 * d[f"{name}:sum"] / n, 3) if n else None

    return {"decode_call_s": round(out["seconds"], 3), "loaded_tokens": d.get("vllm:kvxfer_loaded_tokens", 0),
            "failed_loads": d.get("vllm:kvxfer_failed_loads", 0),
            "start_load_kv_mean_ms": mean("vllm:kvxfer_start_load_seconds"),
            "start_load_kv_steps": d.get("vllm:kvxfer_start_load_seconds:count", 0),
            "inter_token_latency_mean_ms": mean("vllm:inter_token_latency_seconds")}


def test_a_stopped_prefill_fails_only_its_own_requests(model_dir: Path, workdir: Path, reference: dict) -> None:
    env = {TOKEN_ENV: TOKEN}
    p_cpu, d_cpu = pair_cpus()
    engines = {}
    try:
        for name, role, cpu in (("a", "kv_producer", p_cpu), ("b", "kv_producer", p_cpu), ("d", "kv_consumer", d_cpu)):
            engines[name] = start_engine(f"stopped-{name}", model_dir, workdir, env=env, cpus=cpu,
                                         kv_transfer_config=kvxfer_config(role, free_port(), **TIMES))
        for e in engines.values():
            e.wait_ready()
        a, b, d = engines["a"], engines["b"], engines["d"]
        for engine, prompt in ((a, WARMUP[0]), (b, WARMUP[1])):  # opens each route's connection
            out = d.generate([prompt], MAX_TOKENS, [_prefill(engine, prompt)])
            assert out["tokens"][0] == REFERENCE[tuple(prompt)]
        report: dict[str, Any] = {}
        # Healthy: one request from each prefill in one decode call.
        pa, pb = PROMPTS[0], PROMPTS[1]
        out = d.generate([pa, pb], MAX_TOKENS, [_prefill(a, pa), _prefill(b, pb)])
        assert out["tokens"] == [REFERENCE[tuple(pa)], REFERENCE[tuple(pb)]]
        report["healthy"] = _figures(out)
        assert report["healthy"]["loaded_tokens"] == len(pa) + len(pb) and not report["healthy"]["failed_loads"]
        # A stops after handing out its parameters; B still answers.
        pa, pb = PROMPTS[2], PROMPTS[3]
        params_a = _prefill(a, pa)
        os.killpg(a.proc.pid, signal.SIGSTOP)
        out = d.generate([pa, pb], MAX_TOKENS, [params_a, _prefill(b, pb)])
        assert out["tokens"] == [REFERENCE[tuple(pa)], REFERENCE[tuple(pb)]]  # A's recomputed, B's loaded
        f = report["one_prefill_stopped"] = _figures(out)
        # B's loaded; A's failed and recomputed (or, if its READ needed no CPU of A, loaded too).
        assert (f["loaded_tokens"], f["failed_loads"]) in ((len(pb), 1), (len(pa) + len(pb), 0)), f
        out_path = Path(__file__).resolve().parents[2] / "build" / "vllm-stopped-prefill.json"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1))
        print(json.dumps(report))
    finally:
        for e in engines.values():
            try:
                os.killpg(e.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        leave(list(engines.values()))  # they shut down while what follows runs; reaped at the session's end
