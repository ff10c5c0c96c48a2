"""A hostile API client against the connector, without an engine: the fuzz of test_vllm_fuzz.py.

The connectors are the real :class:`KvxferConnector`, built for each role from a minimal
vLLM config (the fields it reads); requests are vLLM's own ``Request`` objects carrying the
fuzzed ``kv_transfer_params`` and request ids. :func:`run` calls the callbacks in the order
vLLM's scheduler and model runner call them each step, and records every exception that
escapes one of them.
"""

from __future__ import annotations

import copy
import math
import random
import secrets
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

import kvxfer
from kvxfer.integrations.vllm import params as P
from kvxfer.integrations.vllm.binding import prompt_digest
from kvxfer.integrations.vllm.connector import KvxferConnector
from kvxfer.integrations.vllm.worker import agent_name

BLOCK, MAX_LEN, CACHE_BLOCKS = 16, 2048, 64
TOKEN = "fuzz-" + secrets.token_hex(16)
HUGE = [0] * (1 << 20)  # 2^20 block ids, built once
LONG = "x" * (1 << 20)


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v


class Boom(dict):
    """A Python-API caller's mapping whose every read raises (JSON clients cannot send one)."""

    def __getitem__(self, key: Any) -> Any:
        raise RuntimeError("boom")

    def get(self, key: Any, default: Any = None) -> Any:
        raise RuntimeError("boom")


class BadEq:
    def __eq__(self, other: Any) -> bool:
        raise RuntimeError("no comparison")

    __ne__ = __eq__
    __hash__ = object.__hash__


VALUES: list[Any] = [None, True, False, 0, -1, 1, 3, 2 ** 31, 2 ** 63, 2 ** 200, 1.5, -0.0, float("nan"),
                     float("inf"), "", "a", "\u00e9" * 64, "\ud800", "\x00\t\n", "A" * 64, "0" * 65, "x" * 600,
                     LONG, [], [1, 2], {}, {"a": 1}, HUGE, _deep(5000), b"bytes", (1, 2), {1}, "127.0.0.1"]
ODD = [Boom(), BadEq(), Boom({"kvxfer": 1})]  # Python-API objects, rare
IDS = ["", "\t", "a\tb", "a" * 513, "\u00e9" * 600, "\ud800", "\n\n", "kvxfer-sha256:" + "0" * 64, "a" * 512,
       "\x00", "\u202eevil", " " * 10, "x" * 100_000]
TOP = ["do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_host", "remote_port",
       "remote_request_id", "remote_block_ids", "remote_num_tokens", "remote_tp_size", "kvxfer", "extra"]
OURS = ["v", "tag", "nonce", "exp", "dig", "p", "extra"]


def config(role_extra: dict[str, Any] | None = None, port: int = 1) -> SimpleNamespace:
    extra = {"token": TOKEN, "port": port, "backend": "loopback", "transfer_timeout": 2.0,
             "handshake_timeout": 1.0, "lease_seconds": 10.0, **(role_extra or {})}
    ktc = SimpleNamespace(kv_connector_extra_config=extra, engine_id="fuzz", kv_role="kv_both")
    par = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_index=0)
    model = SimpleNamespace(max_model_len=MAX_LEN, model="tiny", use_mla=False)
    return SimpleNamespace(kv_transfer_config=ktc, parallel_config=par, model_config=model)


def cache_config() -> SimpleNamespace:
    spec = SimpleNamespace(block_size=BLOCK, page_size_bytes=2 * BLOCK * 8 * 4)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])],
                           num_blocks=CACHE_BLOCKS)


def connectors(monkeypatch: Any, port: int) -> tuple[KvxferConnector, KvxferConnector]:
    """The scheduler's connector and a worker's, the worker's agent (loopback) registered on a
    small cache and owned as the connector's own registration leaves it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    monkeypatch.setattr("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0)
    sched = KvxferConnector(config(port=port), KVConnectorRole.SCHEDULER, cache_config())
    work = KvxferConnector(config(port=port), KVConnectorRole.WORKER, cache_config())
    w = work._worker
    agent = kvxfer.Agent(agent_name("fuzz", 0), backend="loopback", token=TOKEN.encode())
    agent.register({f"l{i}": np.zeros((CACHE_BLOCKS, 2, BLOCK, 8), np.float32) for i in range(2)}, dims="BHND")
    w.agent, w.owner = agent, kvxfer.Owner(agent, max_pending_per_peer=1024, add_peer_timeout=1.0, name="fuzz-owner")
    return sched, work


class Blocks:
    """vLLM's KVCacheBlocks, as far as the connector reads it."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)

    def get_unhashed_block_ids(self) -> list[int]:
        return self.ids


def genuine(prompt: list[int], port: int) -> dict[str, Any]:
    n = len(prompt)
    ids = tuple(random.Random(n).sample(range(CACHE_BLOCKS), math.ceil(n / BLOCK)))
    return P.RemoteKV("fuzz-prefill", "127.0.0.1", port, "prefill-req", ids, n, 1,
                      prompt=prompt_digest(prompt, n, None, [None, []])).to_params(TOKEN.encode())


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b if type(a) in (str, int, float, bool, list, type(None)) else False)


def intact(p: Any, g: dict[str, Any]) -> bool:
    """Every field the tag covers (and the tag) as the prefill signed it: judged here, field by field."""
    if type(p) is not dict or type(p.get("kvxfer")) is not dict:
        return False
    top = ["do_remote_prefill", *P._TOP]
    return all(_same(p.get(k), g[k]) for k in top) and all(_same(p["kvxfer"].get(k), g["kvxfer"][k])
                                                             for k in ("v", "tag", *P._OURS))


def mutate(rng: random.Random, params: dict[str, Any]) -> tuple[Any, bool]:
    """1-3 mutations of ``params``; True when the result was signed again (reaches the checks after the tag)."""
    p: Any = copy.copy(params)
    p["kvxfer"] = dict(p["kvxfer"])
    for _ in range(rng.randint(1, 3)):
        if type(p) is not dict:
            break
        ours = p.get("kvxfer") if type(p.get("kvxfer")) is dict else None
        op = rng.random()
        value = rng.choice(ODD) if rng.random() < 0.02 else rng.choice(VALUES)
        if op < 0.35:
            p[rng.choice(TOP)] = value
        elif op < 0.55 and ours is not None:
            ours[rng.choice(OURS)] = value
        elif op < 0.62:
            target = ours if ours is not None and rng.random() < 0.5 else p
            target.pop(rng.choice(OURS if target is ours else TOP), None)
        elif op < 0.72 and ours is not None:
            ours["tag"] = rng.choice(["\u00e9" * 64, "A" * 64, "g" * 64, "0" * 63, b"0" * 64, "\ud800" * 64,
                                      " " * 64, secrets.token_hex(32)])
        elif op < 0.84:
            ids = p.get("remote_block_ids")
            ids = list(ids) if type(ids) in (list, tuple) and 0 < len(ids) <= 64 and \
                all(type(b) is int for b in ids) else [0]
            p["remote_block_ids"] = rng.choice([HUGE, ids[::-1], ids + ids, [-1] * len(ids), [True] * len(ids),
                                                [1.0] * len(ids), [str(i) for i in ids], [2 ** 40] * len(ids),
                                                [[i] for i in ids], ids[:-1], [10 ** 6] * len(ids)])
        elif op < 0.92:
            p = rng.choice([[p], {"kvxfer": p}, {**p, "kvxfer": {**(ours or {}), "kvxfer": ours}}, "params", 7, None])
        else:
            key = rng.choice(["remote_engine_id", "remote_request_id", "remote_host"])
            p[key] = rng.choice(["\u00e9", "\ud800", "\x00", "\u202e", "\u200b", "a\nb"]) * rng.choice([1, 64, 600])
    signed = False
    if type(p) is dict and type(p.get("kvxfer")) is dict and p.get("remote_block_ids") is not HUGE \
            and rng.random() < 0.3:
        p["kvxfer"]["nonce"] = secrets.token_hex(16)
        try:
            p["kvxfer"]["tag"] = P._tag(p, TOKEN.encode()).decode()
            signed = True
        except Exception:  # noqa: BLE001  # fields JSON cannot sign: sent as they are
            pass
    return p, signed


@dataclass
class Outcome:
    cases: int = 0
    escaped: list[tuple[str, str, str]] = field(default_factory=list)
    loaded_unsigned: list[str] = field(default_factory=list)  # loads planned from altered, unsigned or unbound params
    stranded: list[str] = field(default_factory=list)  # vLLM told to wait for a load nobody reports
    planned: int = 0  # loads planned (intact or signed-again params for their own prompt)
    handed_out: int = 0  # prefill params handed out (hostile ids included), all valid


def run(sched: KvxferConnector, work: KvxferConnector, n: int, seed: int, port: int,
        unguarded: bool = False) -> Outcome:
    """``n`` hostile requests, each through the callbacks in vLLM's order; every 8th step also
    through the worker's (the step's metadata, as the model runner hands it over)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    rng = random.Random(seed)
    out = Outcome()

    def call(conn: KvxferConnector, name: str, *args: Any) -> Any:
        fn: Callable[..., Any] = getattr(type(conn), name)
        try:
            return (fn.__wrapped__ if unguarded else fn)(conn, *args)
        except Exception as exc:  # noqa: BLE001  # what would have reached vLLM
            out.escaped.append((name, type(exc).__name__, repr(exc)[:200]))
            return None

    prompts = [[rng.randrange(1, 500) for _ in range(k)] for k in (1, 16, 17, 100, 300)]
    statuses = [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED]
    for i in range(n):
        prompt = rng.choice(prompts)
        rid = (rng.choice(IDS) if rng.random() < 0.3 else "req") + f"-{i:08x}"  # vLLM appends a suffix too
        signed = False
        if rng.random() < 0.15:  # a prefill request: hostile ids and params reach request_finished
            params: Any = rng.choice([{"do_remote_decode": True}, {"do_remote_decode": True, "x": rng.choice(VALUES)},
                                      {"do_remote_decode": rng.choice(VALUES)}])
        elif rng.random() < 0.05:
            params = rng.choice(VALUES + ODD)
        else:
            own = prompt if rng.random() < 0.8 else rng.choice(prompts)
            g = genuine(own, port)
            params, signed = mutate(rng, g)
            signed = (signed or intact(params, g)) and own == prompt
        req = Request(rid, list(prompt), SamplingParams(max_tokens=1), None)
        req.kv_transfer_params = params  # as Request takes it from extra_args, past vLLM's own checks (a superset)
        out.cases += 1
        got = call(sched, "get_num_new_matched_tokens", req, 0)
        ext, is_async = got if isinstance(got, tuple) else (0, False)
        blocks = Blocks(list(range(math.ceil(len(prompt) / BLOCK))))
        call(sched, "update_state_after_alloc", req, blocks, ext if is_async else 0)
        meta = call(sched, "build_connector_meta", SimpleNamespace(num_scheduled_tokens={rid: len(prompt)}))
        loads = {t.request_id for t in getattr(meta, "loads", []) if t.local_block_ids}
        out.planned += len(loads)
        if loads and not signed:
            out.loaded_unsigned.append(rid)
        if is_async and ext and rid not in loads and rid not in getattr(meta, "failed", {}):
            out.stranded.append(rid)
        call(sched, "update_connector_output", SimpleNamespace(kv_connector_worker_meta=None))
        req.status = rng.choice(statuses)
        req.num_computed_tokens = len(prompt)
        fin = call(sched, "request_finished", req, blocks.ids)
        if isinstance(fin, tuple) and fin[1] is not None:
            P.RemoteKV.from_params(fin[1], TOKEN.encode(), BLOCK)  # what the prefill hands out is valid
            out.handed_out += 1
        if i % 8 == 0 and meta is not None:
            work.bind_connector_metadata(meta)
            call(work, "start_load_kv", None)
            call(work, "get_finished", {rid, rng.choice(IDS)})
            call(work, "get_block_ids_with_load_errors")
            call(work, "build_connector_worker_meta")
            call(work, "get_kv_connector_stats")
            work.clear_connector_metadata()
    return out
