"""What the connector reports through vLLM's connector stats and Prometheus metrics.

Workers and the scheduler each fill a :class:`KvxferConnectorStats` per engine step; vLLM
aggregates them, logs :meth:`reduce` and feeds :class:`KvxferPromMetrics` (``vllm:kvxfer_*``,
next to vLLM's own ``vllm:nixl_*``), which ``LLM.get_metrics()`` and ``/metrics`` expose.
Only plain lists of numbers are kept: the object crosses process boundaries.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["KvxferConnectorStats", "KvxferPromMetrics", "PER_TRANSFER", "PER_STEP", "COUNTS", "PROVER_COUNTS"]

#: One entry per completed load.
PER_TRANSFER = ("transfer_seconds", "plan_seconds", "bytes", "descriptors", "runs", "posts", "tokens")
#: One entry per step that started loads: the seconds ``start_load_kv`` took (no network: microseconds).
PER_STEP = ("start_seconds",)
#: One entry (a count) per event.
#: What the metadata prover counts (:func:`kvxfer.prove.health`) that an operator must see:
#: helpers that would not start, and peers refused for want of one.
PROVER_COUNTS = ("start_failures", "unavailable")
COUNTS = ("failed_loads", "rejected_params", "handshake_failures", "sends_done", "expired_sends",
          "integrity_failures", "expired_params", "replayed_params", "prompt_mismatches", "connector_errors",
          "store_failures", "store_corrupt", "store_saved_blocks", "store_save_failures", "store_busy",
          *(f"prover_{k}" for k in PROVER_COUNTS))


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """Per-transfer observations plus event counts for one interval."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            for key in PER_TRANSFER + PER_STEP + COUNTS:
                self.data.setdefault(key, [])

    def reset(self) -> None:
        fresh: dict[str, list[Any]] = {key: [] for key in PER_TRANSFER + PER_STEP + COUNTS}
        self.data = fresh

    def record_load(self, *, seconds: float, plan_seconds: float, nbytes: int, descriptors: int, runs: int,
                    posts: int, tokens: int) -> None:
        """``runs``: descriptors once those contiguous on both sides are merged, as NIXL does."""
        for key, value in zip(PER_TRANSFER, (seconds, plan_seconds, nbytes, descriptors, runs, posts, tokens)):
            self.data[key].append(value)

    def count(self, key: str, n: int = 1) -> None:
        self.data[key].append(n)

    def clone_and_reset(self) -> "KvxferConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in PER_TRANSFER + PER_STEP + COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        n = len(d["transfer_seconds"])
        out: dict[str, int | float] = {"kvxfer loads": n}
        if n:
            secs = sum(d["transfer_seconds"])
            out.update({
                "avg transfer ms": round(1e3 * secs / n, 3),
                "avg descriptors": round(sum(d["descriptors"]) / n, 1),
                "MB": round(sum(d["bytes"]) / 1e6, 3),
                "tokens": sum(d["tokens"]),
                "GB/s": round(sum(d["bytes"]) / secs / 1e9, 3) if secs else 0.0,
            })
        for key in COUNTS:
            out[key] = sum(d[key])
        return out


class KvxferPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvxfer_*`` histograms and counters, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def hist(name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
            m = self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            return create_metric_per_engine(m, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, Any]:
            m = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(m, per_engine_labelvalues)

        self._hists = {
            "transfer_seconds": hist("vllm:kvxfer_xfer_time_seconds", "kvxfer load time, first post to done",
                                     [1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            "descriptors": hist("vllm:kvxfer_num_descriptors", "Descriptors per kvxfer load",
                                [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]),
            "runs": hist("vllm:kvxfer_num_runs", "Descriptors per kvxfer load after merging contiguous ones",
                         [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]),
            "bytes": hist("vllm:kvxfer_bytes_transferred", "Bytes per kvxfer load",
                          [float(2 ** (10 + 2 * i)) for i in range(13)]),
            "start_seconds": hist("vllm:kvxfer_start_load_seconds",
                                  "Seconds start_load_kv took on steps that started loads (never waits on the network)",
                                  [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0]),
        }
        self._counters = {
            "tokens": counter("vllm:kvxfer_loaded_tokens", "Prompt tokens whose KV decode loaded through kvxfer"),
            "failed_loads": counter("vllm:kvxfer_failed_loads", "kvxfer loads that failed (recomputed instead)"),
            "rejected_params": counter("vllm:kvxfer_rejected_params",
                                       "Transfer params refused by decode (malformed or unauthenticated)"),
            "handshake_failures": counter("vllm:kvxfer_handshake_failures", "Side-channel fetches that failed"),
            "integrity_failures": counter("vllm:kvxfer_integrity_failures",
                                          "Loads whose bytes differed from the prefill's digests (recomputed)"),
            "expired_params": counter("vllm:kvxfer_expired_params",
                                      "Params refused as expired, at parsing or before the read (recomputed)"),
            "replayed_params": counter("vllm:kvxfer_replayed_params",
                                       "Params refused because their nonce was already used here (recomputed)"),
            "prompt_mismatches": counter("vllm:kvxfer_prompt_mismatches",
                                         "Params refused because they were issued for another prompt (recomputed)"),
            "connector_errors": counter("vllm:kvxfer_connector_errors",
                                        "Errors the connector caught at vLLM's callbacks (recomputed, never raised)"),
            "store_failures": counter("vllm:kvxfer_store_failures",
                                      "Store restores that failed (evicted, damaged row, missing slab): recomputed"),
            "store_corrupt": counter("vllm:kvxfer_store_corrupt",
                                     "Store restores whose rows failed their digest (dropped, recomputed)"),
            "store_saved_blocks": counter("vllm:kvxfer_store_saved_blocks", "Prompt blocks offloaded to the store"),
            "store_save_failures": counter("vllm:kvxfer_store_save_failures",
                                           "Store offloads that failed (nothing published)"),
            "store_busy": counter("vllm:kvxfer_store_busy",
                                  "Workers that found the store held by another process (ran without it)"),
            "sends_done": counter("vllm:kvxfer_sends_done", "Prefill requests whose blocks decode released"),
            "expired_sends": counter("vllm:kvxfer_expired_sends", "Prefill requests freed after the lease expired"),
            "prover_start_failures": counter("vllm:kvxfer_prover_start_failures",
                                             "Metadata-prover helper processes that failed to start (retried)"),
            "prover_unavailable": counter("vllm:kvxfer_prover_unavailable",
                                          "Peer metadata not loaded because no prover helper could answer in time"),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self._hists.items():
            for v in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(v)
        for key, metric in self._counters.items():
            total = sum(transfer_stats_data.get(key, ()))
            if total:
                metric[engine_idx].inc(total)
