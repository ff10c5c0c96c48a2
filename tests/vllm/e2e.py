"""Shared steps of the vLLM end-to-end tests: engine configs, one P/D request, the report."""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import TOKEN_ENV, Engine, free_port, pair_cpus, start_engine, stop_all

#: Prompts as token ids, seeded: lengths chosen for 1, 2 (exactly full), 3 and 6 blocks of 128.
PROMPT_LENGTHS = (97, 256, 300, 700)
#: Prompts for the fault cases, never sent to a decode before their own case.
FAULT_LENGTHS = {"tampered": 200, "out_of_range": 300, "wrong_kv": 300, "wrong_kv_source": 300, "killed": 150}
MAX_TOKENS = 8


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 511) for _ in range(n)]


PROMPTS = [_prompt(i, n) for i, n in enumerate(PROMPT_LENGTHS)]
#: One request per pair before the measured ones: it opens the transport's connection.
WARMUP = [_prompt(50 + i, 130) for i in range(4)]
FAULT_PROMPTS = {k: _prompt(100 + i, n) for i, (k, n) in enumerate(FAULT_LENGTHS.items())}


def _bound_prompts(seed: int) -> dict[str, list[int]]:
    """Issue 31: A and B of one length; C shares B's two full blocks (256 tokens), then differs."""
    a, b = _prompt(seed, 300), _prompt(seed + 1, 300)
    return {"a": a, "b": b, "c": b[:256] + _prompt(seed + 2, 44)}


#: The prompt swap (params of A sent with B), and the same with the binding off (the control).
BOUND = _bound_prompts(200)
UNBOUND = _bound_prompts(210)
#: A prefill request id kvxfer cannot carry, then a non-ASCII tag at the decode.
HOSTILE = _prompt(220, 200)

#: Greedy tokens of a plain instance (no connector), filled once per session.
REFERENCE: dict[tuple[int, ...], list[int]] = {}

TOKEN = secrets.token_hex(16)
BLOCK = 128  # vLLM CPU's block size for this model
LAYERS, KV_HEADS, HEAD_DIM, ITEM = 4, 2, 32, 4
PAGE = 2 * KV_HEADS * BLOCK * HEAD_DIM * ITEM  # K and V of one layer's block, float32
ROWS: list[dict[str, Any]] = []  # the comparison table, written at session end
WARMUPS: list[dict[str, Any]] = []  # first request of each pair (connection set-up)


def blocks(n_tokens: int) -> int:
    return math.ceil(n_tokens / BLOCK)


def kvxfer_config(role: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
            "kv_role": role, "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": "nixl", "port": port, "token_env": TOKEN_ENV,
                                          # Generous: CI shares two cores; a side-channel reply took over 10 s there.
                                          "transfer_timeout": 120, "handshake_timeout": 60, "lease_seconds": 600,
                                          **extra}}


def nixl_config(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute"}


@dataclass
class Pair:
    connector: str
    layout: str
    prefill: Engine
    decode: Engine

    @property
    def engines(self) -> list[Engine]:
        return [self.prefill, self.decode]


#: The store of the LBHNC pair's decode and the file that switches its prompt binding off (binding_site).
ROW = LAYERS * PAGE  # one block of every layer: a store row
DECODE_STORE: dict[str, Path] = {}


def start_kvxfer_pair(model: Path, logdir: Path, layout: str) -> Pair:
    env = {TOKEN_ENV: TOKEN}
    port = free_port(2)
    tag, bl = layout.lower(), layout == "BLHNC"
    p_cpus, d_cpus = pair_cpus()
    dec_env, dec_extra = dict(env), {}
    if not bl:  # issue 31: the decode offloads prompts to a store; the control can unbind its params
        DECODE_STORE["store"] = logdir / f"decode-store-{port}"
        DECODE_STORE["unbound"] = logdir / f"unbound-{port}"
        dec_extra = {"store_path": str(DECODE_STORE["store"]), "store_capacity": 64 * ROW}
        site = str(Path(__file__).resolve().parent / "binding_site")
        dec_env.update({"KVXFER_E2E_UNBOUND": str(DECODE_STORE["unbound"]),
                        "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))})
    return Pair("kvxfer", layout,
                start_engine(f"kvxfer-prefill-{tag}", model, logdir, env=env, blhnc=bl, cpus=p_cpus,
                             kv_transfer_config=kvxfer_config("kv_producer", port)),
                start_engine(f"kvxfer-decode-{tag}", model, logdir, env=dec_env, blhnc=bl, cpus=d_cpus,
                             kv_transfer_config=kvxfer_config("kv_consumer", port + 1, **dec_extra)))


def start_nixl_pair(model: Path, logdir: Path, layout: str) -> Pair:
    tag, bl = layout.lower(), layout == "BLHNC"
    engines = []
    for role, cpus in zip(("kv_producer", "kv_consumer"), pair_cpus()):
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        engines.append(start_engine(f"nixl-{role.split('_')[1]}-{tag}", model, logdir, env=env, blhnc=bl,
                                    cpus=cpus, kv_transfer_config=nixl_config(role)))
    return Pair("NixlConnector", layout, *engines)


#: The plain instance once :func:`boot_reference` started it, until :func:`ensure_reference` uses it.
_REFERENCE_ENGINE: list[Engine] = []
#: Engines asked to exit and not yet waited for: vLLM's shutdown (about 5 s) overlaps what runs next.
_LEAVING: list[Engine] = []


def leave(engines: list[Engine]) -> None:
    """Ask ``engines`` to exit without waiting; :func:`reap` waits for them (and kills their groups)."""
    for e in engines:
        e.ask_to_exit()
    _LEAVING.extend(engines)


def reap() -> None:
    """Wait for every engine that was asked to exit, as :meth:`Engine.stop` does (60 s, then SIGKILL)."""
    while _LEAVING:
        _LEAVING.pop(0).stop()


def boot_reference(model: Path, logdir: Path) -> None:
    """Start the plain instance without waiting for it: it boots (about 20 s) while the tests
    that need no engine run, and :func:`ensure_reference` finds it ready."""
    if not _REFERENCE_ENGINE and not all(tuple(p) in REFERENCE for p in all_prompts()):
        _REFERENCE_ENGINE.append(start_engine("reference", model, logdir))


def ensure_reference(model: Path, logdir: Path) -> None:
    """Fill :data:`REFERENCE` from a plain instance (no connector), then let it leave.

    Once per session: every test module compares against the same tokens.
    """
    if all(tuple(p) in REFERENCE for p in all_prompts()):
        return
    boot_reference(model, logdir)
    ref = _REFERENCE_ENGINE.pop()
    try:
        ref.wait_ready()
        fill_reference(ref)
    finally:
        leave([ref])


def stop_engines() -> None:
    """At the session's end: the reference if it was never used, and every engine still leaving."""
    leave(_REFERENCE_ENGINE)
    _REFERENCE_ENGINE.clear()
    reap()


class Pairs:
    """The pairs of one test module, started on first use and one at a time.

    On two cores engines started together share them (see ``start_times.py``); asking for a
    layout stops the pair that runs before starting the next (its shutdown, mostly waiting,
    overlaps the new pair's first seconds: it is reaped once the new processes exist).
    ``starts`` maps a layout to its start function. A pair that failed to start is not
    started again: its later tests get the same error.
    """

    def __init__(self, model: Path, logdir: Path, starts: dict[str, Any]) -> None:
        self.model, self.logdir, self.starts = model, logdir, starts
        self.current: Pair | None = None
        self.failed: dict[str, BaseException] = {}

    def __getitem__(self, layout: str) -> Pair:
        if self.current is not None and self.current.layout == layout:
            return self.current
        if layout in self.failed:
            raise RuntimeError(f"the {layout} pair did not start") from self.failed[layout]
        self.stop()
        pair = self.starts[layout](self.model, self.logdir, layout)
        reap()
        try:
            for e in pair.engines:
                e.wait_ready()
            warm_up(pair)
        except BaseException as exc:
            stop_all(pair.engines)
            self.failed[layout] = exc
            raise
        self.current = pair
        return pair

    def stop(self) -> None:
        if self.current is not None:
            leave(self.current.engines)
            self.current = None

    def __enter__(self) -> "Pairs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def all_prompts() -> list[list[int]]:
    return PROMPTS + WARMUP + list(FAULT_PROMPTS.values()) + list(BOUND.values()) + list(UNBOUND.values()) + [HOSTILE]


def fill_reference(ref: Engine) -> None:
    """Greedy tokens of a plain instance, one prompt per call (as the P/D runs send them)."""
    for p in all_prompts():
        if tuple(p) not in REFERENCE:
            REFERENCE[tuple(p)] = ref.generate([p], MAX_TOKENS)["tokens"][0]


def prefill(pair: Pair, prompt: list[int]) -> dict[str, Any]:
    out = pair.prefill.generate([prompt], 1, [{"do_remote_decode": True}])
    params = out["params"][0]
    assert params and params.get("do_remote_prefill") is True, params
    return params


def decode(pair: Pair, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    return pair.decode.generate([prompt], MAX_TOKENS, [params])


def flushed_metric(engine: Engine, name: str, at_least: float, timeout: float = 120.0) -> float:
    """An engine's metric once it reaches ``at_least`` (or the timeout).

    An offline engine publishes what its engine core counted (a prefill freeing blocks
    after decode's notification, say) only when the client next steps it: each look runs a
    3-token request first.
    """
    deadline = time.monotonic() + timeout
    while True:
        engine.generate([[1, 2, 3]], 1)
        value = engine.call({"cmd": "metrics"})["metrics"].get(name, 0.0)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def warm_up(pair: Pair, attempts: int = 2) -> None:
    """A first request per pair opens the transport's connection; it must answer correctly, loaded or not.

    Under load that first load can outlive its deadline (vLLM then recomputes); a second
    prompt is tried so that the measured requests start on an open connection.
    """
    key = "kvxfer" if pair.connector == "kvxfer" else "nixl"
    for attempt in range(attempts):
        prompt = WARMUP[(0 if pair.layout == "LBHNC" else 1) + 2 * attempt]
        out = decode(pair, prompt, prefill(pair, prompt))
        assert out["tokens"][0] == REFERENCE[tuple(prompt)], f"{pair.connector} warm-up"
        loaded = bool(out["delta"].get(f"vllm:{key}_num_descriptors:count"))
        WARMUPS.append({"connector": pair.connector, "layout": pair.layout, "decode_call_ms": 1e3 * out["seconds"],
                        "loaded": loaded})
        if loaded:
            break


def record(pair: Pair, prompt: list[int], out: dict[str, Any]) -> dict[str, Any]:
    d = out["delta"]
    key = "kvxfer" if pair.connector == "kvxfer" else "nixl"
    kvx = key == "kvxfer"
    row = {"connector": pair.connector, "layout": pair.layout, "tokens": len(prompt), "blocks": blocks(len(prompt)),
           # NixlConnector registers one region per layer in both layouts: a descriptor per (layer, block);
           # NIXL's telemetry counts what it posted after merging contiguous descriptors.
           "planned": d.get("vllm:kvxfer_num_descriptors:sum") if kvx else LAYERS * blocks(len(prompt)),
           "descriptors": d.get("vllm:kvxfer_num_runs:sum" if kvx else "vllm:nixl_num_descriptors:sum"),
           "transfers": d.get(f"vllm:{key}_num_descriptors:count"),
           "bytes": d.get(f"vllm:{key}_bytes_transferred:sum"),
           "xfer_ms": 1e3 * d[f"vllm:{key}_xfer_time_seconds:sum"] if f"vllm:{key}_xfer_time_seconds:sum" in d else None,
           "decode_call_ms": 1e3 * out["seconds"]}
    ROWS.append(row)
    return row


def write_report(path: Path) -> str:
    lines = ["| connector | cache layout | prompt tokens | blocks | descriptors planned | descriptors posted "
             "| bytes | transfer ms | decode call ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(v: Any, f: str) -> str:
        return "n/a" if v is None else format(v, f)

    for r in sorted(ROWS, key=lambda r: (r["layout"] != "LBHNC", r["connector"] != "kvxfer", r["tokens"])):
        planned = fmt(r["planned"], ".0f") + ("" if r["connector"] == "kvxfer" else "\u2020")
        lines.append(f"| {r['connector']} | {r['layout']} | {r['tokens']} | {r['blocks']} | {planned} | "
                     f"{fmt(r['descriptors'], '.0f')} | {fmt(r['bytes'], '.0f')} | {fmt(r['xfer_ms'], '.3f')} | "
                     f"{r['decode_call_ms']:.1f} |")
    for w in WARMUPS:
        lines.append(f"| {w['connector']}, first request | {w['layout']} | 130 | 2 | | | | | "
                     f"{w['decode_call_ms']:.1f}{'' if w['loaded'] else ' (recomputed)'} |")
    lines.append("")
    lines.append("\u2020 from NixlConnector's registration (one region per layer); posted: NIXL's telemetry count, "
                 "after NIXL merges descriptors contiguous on both sides (kvxfer: the plan's run count).")
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps({"rows": ROWS, "first_requests": WARMUPS}, indent=1))
    return text


def report_path() -> Path:
    return Path(os.environ.get("KVXFER_VLLM_REPORT", Path(__file__).resolve().parents[2] / "build" / "vllm-e2e.md"))
