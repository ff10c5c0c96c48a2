"""Scheduler side of the connector: decides what to load and what to hold, never moves bytes.

Prefill: ``request_finished`` keeps a finished request's blocks and returns transfer
parameters naming them. Decode: ``get_num_new_matched_tokens`` reports the prompt tokens a
prefill holds, after checking the parameters (bad ones mean recompute, never a transfer);
``update_state_after_alloc`` pairs the blocks vLLM allocated with the prefill's blocks.
Both hand their work to the workers through :class:`KvxferConnectorMetadata`. With
``store_path`` set, prompt prefixes are also served from a store (:mod:`.store`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from .config import ConnectorConfig
from .metadata import KvxferConnectorMetadata, LoadTask
from .digests import SchedulerDigests
from .params import (NonceBook, ParamsError, ParamsExpiredError, ParamsReplayError, RemoteKV, expiry,
                     wants_remote_decode, wants_remote_prefill)
from .stats import KvxferConnectorStats
from .store import SchedulerStore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

# Under "vllm." so that vLLM's logging configuration (format, level, handlers) applies.
log = logging.getLogger("vllm.kvxfer")


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, block_size: int, tp_size: int) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.stats = KvxferConnectorStats()
        # Parsed once per request: vLLM may ask for matched tokens several times.
        self._remote: dict[str, RemoteKV | None] = {}
        self._loads: list[LoadTask] = []
        self._sends: dict[str, float] = {}
        self._nonces = NonceBook()  # decode: a params set is used once
        self.digests = SchedulerDigests(cfg.token, tp_size)  # prefill: digests for the params it hands out
        self.store = SchedulerStore(block_size, cfg.min_tokens) if cfg.store_path else None

    # -- decode ---------------------------------------------------------------------------
    def _parse(self, request: "Request") -> RemoteKV | None:
        rid = request.request_id
        if rid not in self._remote:
            try:
                remote = RemoteKV.from_params(request.kv_transfer_params, self.cfg.token, self.block_size)
                if remote.tp_size != self.tp_size:
                    raise ParamsError(f"prefill runs TP={remote.tp_size}, this decode TP={self.tp_size}; "
                                      "kvxfer's vLLM connector pairs equal TP sizes")
                self._nonces.claim(remote)
            except ParamsError as exc:
                log.warning("kvxfer: request %s recomputes its prompt: %s", rid, exc)
                self.stats.count("rejected_params")
                if isinstance(exc, (ParamsExpiredError, ParamsReplayError)):
                    self.stats.count("expired_params" if isinstance(exc, ParamsExpiredError) else "replayed_params")
                remote = None
            self._remote[rid] = remote
        return self._remote[rid]

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if not wants_remote_prefill(request.kv_transfer_params):
            n = self.store.matched(request, num_computed_tokens) if self.store is not None else 0
            return n, n > 0
        remote = self._parse(request)
        if remote is None:
            return 0, False
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        if count < self.cfg.min_tokens:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if wants_remote_decode(params) and self.cfg.digests:
            self.digests.want(request)
        if not wants_remote_prefill(params):
            if self.store is not None:
                self.store.allocated(request, blocks.get_block_ids()[0], num_external_tokens)
            return
        remote = self._parse(request)
        del self._remote[request.request_id]
        params["do_remote_prefill"] = False  # load once, even if the request is preempted later
        if remote is None:
            return
        if num_external_tokens <= 0:  # nothing to pull; prefill may release its blocks now
            self._loads.append(LoadTask(request.request_id, remote, [], [], 0))
            return
        (all_ids,) = blocks.get_block_ids()
        local = blocks.get_unhashed_block_ids()  # the blocks not served by the local prefix cache
        cached = len(all_ids) - len(local)
        remote_ids = list(remote.block_ids[cached:cached + len(local)])
        self._loads.append(LoadTask(request.request_id, remote, local, remote_ids, num_external_tokens))

    # -- prefill --------------------------------------------------------------------------
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        # store.py: offload the prompt's full blocks the store lacks; not blocks a decode leases, nor
        # blocks still waiting for a prefill's KV (a request that ended before its load)
        keep = ok and not wants_remote_decode(params) and not wants_remote_prefill(params)
        save = self.store is not None and self.store.finished(request, block_ids, keep)
        if wants_remote_prefill(params):  # a decode request that finished before it loaded
            self._remote.pop(request.request_id, None)
            return save, None
        if not wants_remote_decode(params):
            return save, None
        self.digests.forget(request.request_id)
        if not ok:
            return False, None  # aborted: free now
        tokens = int(request.num_computed_tokens)
        needed = math.ceil(tokens / self.block_size)
        if tokens <= 0 or len(block_ids) < needed:
            return False, None
        ids = tuple(int(b) for b in block_ids[:needed])
        c = self.cfg
        remote = RemoteKV(self.engine_id, c.host, c.port, request.request_id, ids, tokens, self.tp_size,
                          expires=expiry(time.time(), c.lease_seconds, c.transfer_timeout, c.handshake_timeout))
        self._sends[request.request_id] = self.cfg.lease_seconds
        out = remote.to_params(self.cfg.token)
        if c.digests:  # digests.py: this step's worker digests are added to ``out`` before it leaves
            self.digests.issue(request.request_id, out, remote)
        return True, out

    # -- every step -----------------------------------------------------------------------
    def build_connector_meta(self) -> KvxferConnectorMetadata:
        meta = KvxferConnectorMetadata(self._loads, self._sends)
        self._loads, self._sends = [], {}
        if self.store is not None:
            meta.store_loads, meta.store_saves = self.store.loads, self.store.saves
            self.store.loads, self.store.saves = [], []
        return meta

    def take_stats(self) -> KvxferConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()
