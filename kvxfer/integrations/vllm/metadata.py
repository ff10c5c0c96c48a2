"""What the scheduler side tells the worker side each step (both run inside vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import RemoteKV
from .store import StoreLoad, StoreSave

__all__ = ["LoadTask", "KvxferConnectorMetadata"]


@dataclass
class LoadTask:
    """Decode: pull ``remote_block_ids`` of a prefill into ``local_block_ids``.

    Empty block lists mean nothing to load (a local prefix hit, or too few tokens to be
    worth a transfer): the worker only tells prefill to release its blocks.
    """

    request_id: str
    remote: RemoteKV
    local_block_ids: list[int]
    remote_block_ids: list[int]
    tokens: int


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadTask] = field(default_factory=list)
    #: Prefill: request id -> seconds its blocks stay reserved for decode at most.
    sends: dict[str, float] = field(default_factory=dict)
    #: Prefill: request id -> blocks each worker digests after this step's forward (digests.py).
    digest: dict[str, list[int]] = field(default_factory=dict)
    #: Prefixes from a store (store.py): restores to start, and offloads of finished requests.
    store_loads: list[StoreLoad] = field(default_factory=list)
    store_saves: list[StoreSave] = field(default_factory=list)
    #: Decode: request id -> its blocks, for loads that could not start (reported failed: recompute).
    failed: dict[str, list[int]] = field(default_factory=dict)
    #: Requests whose held blocks vLLM may free now (an offload that was never started).
    released: list[str] = field(default_factory=list)
