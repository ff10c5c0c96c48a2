"""One vLLM instance, driven by the end-to-end tests over a pipe (JSON lines, no pickle).

``python engine_proc.py CONFIG_JSON``: CONFIG_JSON holds the model folder (a local
checkpoint, nothing is downloaded), the file
descriptor to answer on, and the ``KVTransferConfig`` fields (or none). It speaks
:mod:`kvxfer.testing.lines`: commands arrive on stdin, answers go to that descriptor, so
vLLM's own output on stdout and stderr can go to a log file. vLLM spawns processes,
hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

WATCHED = ("kvxfer", "nixl", "external_prefix_cache", "prefix_cache", "inter_token_latency")


def metrics(llm: Any) -> dict[str, float]:
    """Counters and histogram sums/counts that mention a watched word, summed over labels."""
    from vllm.v1.metrics.reader import Counter, Histogram

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not any(w in m.name for w in WATCHED):
            continue
        if isinstance(m, Counter):
            out[m.name] = out.get(m.name, 0) + m.value
        elif isinstance(m, Histogram):
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0) + m.sum
            out[m.name + ":count"] = out.get(m.name + ":count", 0) + m.count
    return out


def finished(llm: Any) -> list[Any]:
    """What ``LLM._run_engine`` does, without its sort by integer request id."""
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        outs.extend(o for o in llm.llm_engine.step() if o.finished)
    return outs


def main() -> None:
    cfg = json.loads(sys.argv[1])
    answer = os.fdopen(int(cfg["fd"]), "w")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvxfer.testing import lines

    ktc = KVTransferConfig(**cfg["kv_transfer_config"]) if cfg.get("kv_transfer_config") else None
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], skip_tokenizer_init=True, dtype="float32",
              enforce_eager=True, max_model_len=cfg.get("max_model_len", 2048),
              num_gpu_blocks_override=cfg.get("num_blocks"), disable_log_stats=False, seed=0,
              kv_transfer_config=ktc, **cfg.get("llm_args", {}))
    lines.say(answer, {"ready": True, "start_seconds": time.perf_counter() - t0})

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        if req["cmd"] == "metrics":
            return {"metrics": metrics(llm)}
        if req["cmd"] != "generate":
            raise ValueError(f"unknown command {req['cmd']!r}")
        params = req.get("params") or [None] * len(req["prompts"])
        sps = [SamplingParams(max_tokens=req["max_tokens"], temperature=0.0,
                              extra_args={"kv_transfer_params": p} if p is not None else None) for p in params]
        before = metrics(llm)
        t = time.perf_counter()
        ids = req.get("request_ids")
        if ids:  # the client's own request ids (any string, as X-Request-Id carries them)
            counter, llm.request_counter = llm.request_counter, iter(ids)
            llm._run_engine = lambda output_type, use_tqdm=False: finished(llm)  # vLLM's sorts ids as ints
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], sps, use_tqdm=False)
        finally:
            if ids:
                llm.request_counter = counter
                del llm._run_engine
        if ids:
            outs.sort(key=lambda o: next((i for i, r in enumerate(ids) if o.request_id.startswith(r)), 0))
        seconds = time.perf_counter() - t
        after = metrics(llm)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "params": [o.kv_transfer_params for o in outs], "seconds": seconds,
                "delta": {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}}

    # Nothing here needs driving between commands (vLLM runs its own loop): wake rarely.
    lines.serve(handle, lambda: None, out=answer, poll_s=1.0)


if __name__ == "__main__":
    main()
