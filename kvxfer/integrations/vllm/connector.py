"""``KvxferConnector``: vLLM's ``KVConnectorBase_V1`` with kvxfer moving the blocks.

vLLM builds one instance per role: the scheduler's (in the engine core) decides what to
load and hold, see :mod:`.scheduler`; each worker's registers the cache and moves bytes, see
:mod:`.worker`. This class only routes vLLM's calls to the side that owns them, each through
the boundary of :mod:`.guard`: no callback raises into vLLM.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .config import ConnectorConfig, ConnectorConfigError
from .digests import worker_digests
from .guard import boundary
from .metadata import KvxferConnectorMetadata
from .scheduler import SchedulerSide
from .stats import KvxferConnectorStats, KvxferPromMetrics
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvxferConnector"]


def _check_supported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
    """Refuse, at start-up, the configurations the connector does not handle."""
    par = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(par, name, 1) > 1:
            raise ConnectorConfigError(f"kvxfer's vLLM connector does not support {name} > 1")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConnectorConfigError(f"kvxfer's vLLM connector handles one KV cache group (full attention or MLA); "
                                   f"this model has {len(groups)}")


def _model_id(model: Any) -> str:
    """What the store's slab fingerprint records of the model (at most 256 characters)."""
    text = f"{model.model}|{getattr(model, 'revision', None) or ''}|{getattr(model, 'dtype', '')}"
    return text if len(text) <= 256 else hashlib.sha256(text.encode()).hexdigest()


class KvxferConnector(KVConnectorBase_V1):
    """Pull-mode P/D: decode READs the prompt's blocks from prefill through a kvxfer Agent."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _check_supported(vllm_config, kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        par = vllm_config.parallel_config
        tp_size = par.tensor_parallel_size
        # Data-parallel engines share one config: each gets its own block of side-channel ports.
        base = self.cfg.port + getattr(par, "data_parallel_index", 0) * tp_size
        if base + tp_size - 1 > 65535:
            raise ConnectorConfigError(f"side-channel ports from {base} for {tp_size} ranks exceed 65535")
        self.cfg = type(self.cfg)(**{**self.cfg.__dict__, "port": base})
        self._group_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        engine_id = str(ktc.engine_id)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, engine_id, int(self._group_spec.block_size), tp_size,
                                        getattr(getattr(vllm_config, "model_config", None), "max_model_len", None))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(self.cfg, engine_id, int(get_tensor_model_parallel_rank()))

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        group = self._kv_cache_config.kv_cache_groups[0]
        page = int(group.kv_cache_spec.page_size_bytes)
        model = self._vllm_config.model_config
        self._worker.register(
            kv_caches, num_blocks=int(self._kv_cache_config.num_blocks),
            page_bytes={name: page for name in group.layer_names},
            layout=getattr(self._kv_cache_config, "kv_cache_layout", None),
            block_tokens=int(group.kv_cache_spec.block_size),
            tp_size=int(self._vllm_config.parallel_config.tensor_parallel_size),
            replicated=bool(getattr(model, "use_mla", False)),
            serve=self._kv_transfer_config.kv_role in ("kv_producer", "kv_both"),
            model=_model_id(model))

    @boundary(lambda: None, lambda self, *a, **k: self._abandon())
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self._worker.start(meta)

    @boundary(lambda: None)
    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous: vLLM waits for get_transfer_results

    @boundary(lambda: None)
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # pull mode: decode reads, prefill never pushes

    @boundary(lambda: None)
    def wait_for_save(self) -> None:
        return

    @boundary(lambda: (None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    @boundary(KVConnectorTransferResults)
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.poll()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    @boundary(lambda: None)
    def get_handshake_metadata(self) -> Any:
        return self._worker.store_handshake() if self._worker is not None else None

    @boundary(lambda: None)
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._sched is not None and self._sched.store is not None:  # store.py: the scheduler's view
            self._sched.store.attach(metadata)

    @boundary(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    @boundary(lambda: None)
    def get_kv_connector_stats(self) -> KvxferConnectorStats | None:
        side = self._worker or self._sched
        return side.take_stats() if side is not None else None

    @boundary(lambda: None)
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _abandon(self) -> None:
        """start_load_kv's fallback: the step's loads that did not start fail (recompute)."""
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KvxferConnectorMetadata):
            self._worker.abandon(meta)

    # -- scheduler side -------------------------------------------------------------------
    @boundary(lambda: (0, False))
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @boundary(lambda: None, lambda self, request, blocks, n: self._sched.alloc_failed(request, blocks, n))
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    @boundary(KvxferConnectorMetadata, lambda self, *a, **k: self._sched.salvage())
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        manager = getattr(self, "_kv_cache_manager", None)
        digest: dict[str, Any] = {}
        if manager is not None:  # integrity: the blocks each worker digests after this step
            digest = self._sched.digests.plan(scheduler_output.num_scheduled_tokens,
                                              lambda rid: manager.get_block_ids(rid)[0])
        meta = self._sched.build_connector_meta()  # last: once it ran, the step's work is in ``meta``
        meta.digest = digest
        return meta

    @boundary(lambda: None)
    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:  # integrity: this step's digests join the params it handed out
            self._sched.digests.attach(connector_output.kv_connector_worker_meta)

    @boundary(lambda: None)
    def build_connector_worker_meta(self) -> Any:
        if self._worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return worker_digests(self._worker.agent, self._worker.rank, getattr(meta, "digest", {}))

    @boundary(lambda: (False, None), lambda self, request, block_ids: self._sched.finish_failed(request))
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    # -- class-level hooks ----------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # any block-compact layout works; block-outermost ones move a block as one descriptor

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferConnectorStats:
        return KvxferConnectorStats(data=data) if data else KvxferConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferPromMetrics:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
