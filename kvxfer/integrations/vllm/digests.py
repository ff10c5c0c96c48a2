"""Prefill: row digests of the blocks it hands out, computed where the bytes are, carried in the params.

vLLM's scheduler returns a request's transfer parameters from ``request_finished``, but
the KV lives in the worker processes. Within one engine step the order is: the workers run
the forward, then each builds its connector *worker metadata*; the scheduler then calls
``request_finished`` for the requests that step finished, and only after that
``update_connector_output`` with the workers' metadata, before any output leaves the engine
core. So:

1. each step the scheduler lists the blocks of every scheduled ``do_remote_decode``
   request (:meth:`SchedulerDigests.plan`, in the connector metadata);
2. each worker digests those blocks after the forward (:func:`worker_digests`) and returns
   them as worker metadata (one digest set per TP rank);
3. ``update_connector_output`` adds the digests to the parameters ``request_finished``
   returned in the same step and signs them again, in place (:meth:`SchedulerDigests.attach`).

A request whose digests do not arrive in that step goes out without them; decode then
relies on the nonce and the expiry alone (counted nowhere: nothing failed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvxfer.errors import KvxferError, MissingDependencyError

from .params import RemoteKV

__all__ = ["DigestMeta", "SchedulerDigests", "worker_digests", "RANK_SEP"]

log = logging.getLogger("vllm.kvxfer")

#: Per-rank digest sets inside the params' one ``dig`` string (base64 never holds a comma).
RANK_SEP = ","


@dataclass
class DigestMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: ``{rank: {request id: Digests text}}`` for this step."""

    by_rank: dict[int, dict[str, str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, DigestMeta):
            for rank, d in other.by_rank.items():
                self.by_rank.setdefault(rank, {}).update(d)
        return self


def worker_digests(agent: Any, rank: int, todo: Mapping[str, list[int]]) -> DigestMeta | None:
    """Digest each listed request's blocks (rows form) on this rank, after the step's forward."""
    if not todo or agent is None or agent.spec is None:
        return None
    out: dict[str, str] = {}
    for rid, blocks in todo.items():
        try:
            out[rid] = agent.digest(blocks, rows=True).to_text()
        except (MissingDependencyError, KvxferError) as exc:
            log.warning("kvxfer: request %s goes out without digests: %s", rid, exc)
    return DigestMeta({rank: out}) if out else None


class SchedulerDigests:
    """The scheduler's half: which blocks to digest, and the params waiting for their digests."""

    def __init__(self, token: bytes | None, tp_size: int) -> None:
        self.token, self.tp_size = token, tp_size
        self.watch: set[str] = set()  # do_remote_decode requests not finished yet
        self.issued: dict[str, tuple[dict[str, Any], RemoteKV]] = {}  # handed out this step

    def want(self, request_id: str) -> None:
        self.watch.add(request_id)

    def plan(self, scheduled: Mapping[str, int], block_ids: Callable[[str], list[int]]) -> dict[str, list[int]]:
        """Blocks to digest after this step's forward: every watched request it runs."""
        return {rid: list(block_ids(rid)) for rid in self.watch if rid in scheduled}

    def issue(self, request_id: str, params: dict[str, Any], remote: RemoteKV) -> None:
        self.watch.discard(request_id)
        self.issued[request_id] = (params, remote)

    def forget(self, request_id: str) -> None:
        self.watch.discard(request_id)
        self.issued.pop(request_id, None)

    def attach(self, meta: Any) -> None:
        """Add this step's digests to the params handed out in it, signed again, in place."""
        issued, self.issued = self.issued, {}
        if not isinstance(meta, DigestMeta):
            return
        for rid, (params, remote) in issued.items():
            texts = [meta.by_rank.get(r, {}).get(rid) for r in range(self.tp_size)]
            if any(t is None for t in texts):
                continue
            try:
                parts = [_take(t, remote.block_ids) for t in texts]  # type: ignore[arg-type]
                signed = RemoteKV(**{**remote.__dict__, "digests": RANK_SEP.join(parts)}).to_params(self.token)
            except KvxferError as exc:
                log.warning("kvxfer: request %s goes out without digests: %s", rid, exc)
                continue
            params.clear()
            params.update(signed)


def _take(text: str, block_ids: tuple[int, ...]) -> str:
    """The digests of the params' blocks (a prefix of what the step digested)."""
    from kvxfer.integrity import Digests

    d = Digests.from_text(text)
    n = len(block_ids)
    if d.blocks[:n].tolist() != list(block_ids):
        raise KvxferError("the digested blocks are not the blocks the params name")
    return d.take(range(n)).to_text()
