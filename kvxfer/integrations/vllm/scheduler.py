"""Scheduler side of the connector: decides what to load and what to hold, never moves bytes.

Prefill: ``request_finished`` keeps a finished request's blocks and returns transfer
parameters naming them. Decode: ``get_num_new_matched_tokens`` reports the prompt tokens a
prefill holds, after checking the parameters (bad ones mean recompute, never a transfer);
``update_state_after_alloc`` pairs the blocks vLLM allocated with the prefill's blocks.
Both hand their work to the workers through :class:`KvxferConnectorMetadata`. With
``store_path`` set, prompt prefixes are also served from a store (:mod:`.store`).

The ``*_failed`` and :meth:`SchedulerSide.salvage` methods are what the connector's boundary
(:mod:`.guard`) falls back on when a callback raised: they leave vLLM a consistent state in
which every request vLLM waits for ends (failed loads recompute, held blocks are released).
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from .config import ConnectorConfig
from .metadata import KvxferConnectorMetadata, LoadTask
from .digests import SchedulerDigests
from .binding import request_digest, wire_id
from .params import (MAX_BLOCKS, NonceBook, ParamsError, ParamsExpiredError, ParamsPromptError, ParamsReplayError,
                     RemoteKV, expiry, wants_remote_decode, wants_remote_prefill)
from .stats import KvxferConnectorStats
from .store import SchedulerStore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

# Under "vllm." so that vLLM's logging configuration (format, level, handlers) applies.
log = logging.getLogger("vllm.kvxfer")


class SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, block_size: int, tp_size: int,
                 max_model_len: int | None = None) -> None:
        self.cfg = cfg
        # The most blocks one request can load here: longer id lists are refused before the tag.
        self.max_blocks = MAX_BLOCKS if max_model_len is None else math.ceil(max_model_len / block_size) + 1
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.stats = KvxferConnectorStats()
        # Parsed once per request: vLLM may ask for matched tokens several times.
        self._remote: dict[str, RemoteKV | None] = {}
        self._loads: list[LoadTask] = []
        self._sends: dict[str, float] = {}
        self._failed: dict[str, list[int]] = {}  # loads that cannot start: the workers report them failed
        self._nonces = NonceBook()  # decode: a params set is used once
        self.digests = SchedulerDigests(cfg.token, tp_size)  # prefill: digests for the params it hands out
        self.store = (SchedulerStore(block_size, cfg.min_tokens, cfg.tier)
                      if cfg.store_path or cfg.tier is not None else None)

    # -- decode ---------------------------------------------------------------------------
    def _parse(self, request: "Request") -> RemoteKV | None:
        rid = request.request_id
        if rid not in self._remote:
            try:
                remote = RemoteKV.from_params(request.kv_transfer_params, self.cfg.token, self.block_size,
                                              self.max_blocks)
                if remote.tp_size != self.tp_size:
                    raise ParamsError(f"prefill runs TP={remote.tp_size}, this decode TP={self.tp_size}; "
                                      "kvxfer's vLLM connector pairs equal TP sizes")
                self.check_prompt(request, remote)
                self._nonces.claim(remote)
            except ParamsError as exc:
                log.warning("kvxfer: request %r recomputes its prompt: %s", wire_id(rid), exc)
                self.stats.count("rejected_params")
                kind = {ParamsExpiredError: "expired_params", ParamsReplayError: "replayed_params",
                        ParamsPromptError: "prompt_mismatches"}.get(type(exc))
                if kind is not None:
                    self.stats.count(kind)
                remote = None
            self._remote[rid] = remote
        return self._remote[rid]

    @staticmethod
    def check_prompt(request: "Request", remote: RemoteKV) -> None:
        """Refuse params issued for another prompt (binding.py), before any byte moves; the
        nonce stays unused, so the client the params were issued to can still use them."""
        want = request_digest(request, remote.num_tokens)
        if remote.prompt is None or want is None or remote.prompt != want:
            raise ParamsPromptError("kvxfer params were issued for another prompt (or bind none); refused")

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
        remote = RemoteKV(self.engine_id, c.host, c.port, wire_id(request.request_id), ids, tokens, self.tp_size,
                          expires=expiry(time.time(), c.lease_seconds, c.transfer_timeout, c.handshake_timeout),
                          prompt=request_digest(request, tokens))
        self._sends[request.request_id] = self.cfg.lease_seconds
        out = remote.to_params(self.cfg.token)
        if c.digests:  # digests.py: this step's worker digests are added to ``out`` before it leaves
            self.digests.issue(request.request_id, out, remote)
        return True, out

    # -- every step -----------------------------------------------------------------------
    def build_connector_meta(self) -> KvxferConnectorMetadata:
        meta = KvxferConnectorMetadata(self._loads, self._sends, failed=self._failed)
        self._loads, self._sends, self._failed = [], {}, {}
        if self.store is not None:
            meta.store_loads, meta.store_saves = self.store.loads, self.store.saves
            self.store.loads, self.store.saves = [], []
        return meta

    # -- fallbacks of the boundary (guard.py) ------------------------------------------------
    def alloc_failed(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """``update_state_after_alloc`` raised: nothing of this request loads; if vLLM now waits
        for external tokens, the workers report the load failed and vLLM recomputes."""
        rid = request.request_id
        self._remote.pop(rid, None)
        self._loads = [t for t in self._loads if t.request_id != rid]
        if self.store is not None:
            self.store.loads = [ld for ld in self.store.loads if ld.request_id != rid]
            self.store.forget(rid)
        if num_external_tokens > 0:
            self._failed[rid] = [int(b) for b in blocks.get_unhashed_block_ids()]
        params = request.kv_transfer_params
        if isinstance(params, dict):
            params["do_remote_prefill"] = False

    def finish_failed(self, request: "Request") -> tuple[bool, None]:
        """``request_finished`` raised: hand out nothing and let vLLM free the blocks now, so no
        offload or lease may still read them."""
        rid = request.request_id
        self._sends.pop(rid, None)
        self._remote.pop(rid, None)
        self.digests.forget(rid)
        if self.store is not None:
            self.store.saves = [s for s in self.store.saves if s.request_id != rid]
            self.store.forget(rid)
        return False, None

    def salvage(self) -> KvxferConnectorMetadata:
        """``build_connector_meta`` raised: the step's loads fail (vLLM recomputes them), its
        sends and offloads end at once (vLLM frees their blocks), nothing is left waiting."""
        failed = dict(self._failed)
        for t in self._loads:
            if t.local_block_ids:
                failed[t.request_id] = list(t.local_block_ids)
        released: list[str] = []
        if self.store is not None:
            failed.update({ld.request_id: list(ld.block_ids) for ld in self.store.loads})
            released = [s.request_id for s in self.store.saves]
            self.store.loads, self.store.saves = [], []
        meta = KvxferConnectorMetadata(sends=self._sends, failed=failed, released=released)
        self._loads, self._sends, self._failed = [], {}, {}
        return meta

    def take_stats(self) -> KvxferConnectorStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()
