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

Only the request's tokens are covered: a partly filled last block gets cells of its first
tokens only (``Cells.tokens``), because with asynchronous scheduling the next step's forward
may already write the first generated token's KV behind them. Each rank's text is
``"<full blocks>;<last partial block>"`` (either may be empty).
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

#: Per-rank digest sets inside the params' one ``dig`` string (base64 never holds these).
RANK_SEP = ","
PART_SEP = ";"


@dataclass
class DigestMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: ``{rank: {request id: (tokens covered, digests text)}}`` for this step."""

    by_rank: dict[int, dict[str, tuple[int, str]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, DigestMeta):
            for rank, d in other.by_rank.items():
                self.by_rank.setdefault(rank, {}).update(d)
        return self


def worker_digests(agent: Any, rank: int, todo: Mapping[str, tuple[list[int], int]]) -> DigestMeta | None:
    """Digest each listed request's first ``tokens`` tokens (rows form) on this rank, after the forward."""
    if not todo or agent is None or agent.spec is None:
        return None
    from kvxfer.integrity import Cells

    bt = agent.spec.block_tokens
    out: dict[str, tuple[int, str]] = {}
    for rid, (blocks, tokens) in todo.items():
        full, rest = divmod(tokens, bt)
        if tokens <= 0 or len(blocks) < full + (rest > 0):
            continue
        try:
            head = agent.digest(blocks[:full], rows=True).to_text() if full else ""
            tail = agent.digest([blocks[full]], cells=Cells.tokens(agent.spec, rest), rows=True).to_text() if rest else ""
        except (MissingDependencyError, KvxferError) as exc:
            log.warning("kvxfer: request %s goes out without digests: %s", rid, exc)
            continue
        out[rid] = (tokens, head + PART_SEP + tail)
    return DigestMeta({rank: out}) if out else None


class SchedulerDigests:
    """The scheduler's half: which blocks to digest, and the params waiting for their digests."""

    def __init__(self, token: bytes | None, tp_size: int) -> None:
        self.token, self.tp_size = token, tp_size
        self.watch: dict[str, Any] = {}  # do_remote_decode requests not finished yet
        self.issued: dict[str, tuple[dict[str, Any], RemoteKV]] = {}  # handed out this step

    def want(self, request: Any) -> None:
        self.watch[request.request_id] = request

    def plan(self, scheduled: Mapping[str, int],
             block_ids: Callable[[str], list[int]]) -> dict[str, tuple[list[int], int]]:
        """What to digest after this step's forward: every watched request it runs whose prompt is
        complete by then, up to the tokens it will have computed (called before vLLM advances
        ``num_computed_tokens``); earlier chunks of a long prompt cost nothing."""
        out = {}
        for rid, req in self.watch.items():
            if rid in scheduled:
                tokens = int(req.num_computed_tokens) + int(scheduled[rid])
                if tokens >= int(req.num_prompt_tokens):
                    out[rid] = (list(block_ids(rid)), tokens)
        return out

    def issue(self, request_id: str, params: dict[str, Any], remote: RemoteKV) -> None:
        self.watch.pop(request_id, None)
        self.issued[request_id] = (params, remote)

    def forget(self, request_id: str) -> None:
        self.watch.pop(request_id, None)
        self.issued.pop(request_id, None)

    def attach(self, meta: Any) -> None:
        """Add this step's digests to the params handed out in it, signed again, in place."""
        issued, self.issued = self.issued, {}
        if not isinstance(meta, DigestMeta):
            return
        for rid, (params, remote) in issued.items():
            got = [meta.by_rank.get(r, {}).get(rid) for r in range(self.tp_size)]
            if any(g is None or g[0] != remote.num_tokens for g in got):
                continue  # not digested this step, or up to another token count
            try:
                parts = [_check(g[1], remote.block_ids) for g in got]  # type: ignore[index]
                signed = RemoteKV(**{**remote.__dict__, "digests": RANK_SEP.join(parts)}).to_params(self.token)
            except KvxferError as exc:
                log.warning("kvxfer: request %s goes out without digests: %s", rid, exc)
                continue
            params.clear()
            params.update(signed)


def _check(text: str, block_ids: tuple[int, ...]) -> str:
    """The step's digests, once they are seen to name exactly the params' blocks."""
    from kvxfer.integrity import Digests

    named = [b for part in text.split(PART_SEP) if part for b in Digests.from_text(part).blocks.tolist()]
    if named != list(block_ids):
        raise KvxferError("the digested blocks are not the blocks the params name")
    return text
