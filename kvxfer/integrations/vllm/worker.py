"""Worker side of the connector: registers vLLM's KV cache and moves blocks with kvxfer.

Prefill workers register their cache and serve the agent's metadata on the side channel;
they release a request's blocks when decode's notification (the request id) arrives, or
when the lease runs out. Decode workers post one kvxfer READ per request and poll it each
step. A failed or late load is reported both as failed blocks
(``get_block_ids_with_load_errors``) and a failed request, so vLLM recomputes those tokens
instead of attending over garbage.

The engine's thread never waits for the network. The agent belongs to a
:class:`kvxfer.Owner`: ``start`` only names each prefill (a route whose metadata is fetched
on a thread of its own, once, and again after a failure a restart explains) and submits the
READ; ``poll`` reads flags. The owner's thread plans, posts, polls and enforces each load's
``transfer_timeout``, so a prefill that stops answering fails only its own requests. Two
other helpers run: the metadata server, which serves immutable bytes, and, on prefill, a
:class:`kvxfer.progress.Pump` that drives the transport while blocks are leased. vLLM steps
an engine only while it has requests to run: a prefill that handed out its last parameters
goes idle and would no longer drive NIXL, and a decode's READ (its first above all, which
needs the prefill to answer the connection set-up) would wait until the prefill's next
request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Mapping

import kvxfer
from kvxfer import prove
from kvxfer.deadlines import Deadline
from kvxfer.errors import HandshakeError, KvxferError
from kvxfer.owned import OwnedTransfer
from kvxfer.progress import Pump
from kvxfer.sidechannel import NO_AUTH, MetadataServer, fetch

from .config import ConnectorConfig
from .metadata import KvxferConnectorMetadata, LoadTask
from . import params as _params  # replay and integrity checks (issue 19/23): kept in params.py
from .binding import wire_id
from .registration import describe_spec, discovered_spec, spec_from_vllm
from .stats import PROVER_COUNTS, KvxferConnectorStats
from .store import StoreHandshake, WorkerStore

__all__ = ["WorkerSide", "agent_name"]

# Under "vllm." so that vLLM's logging configuration (format, level, handlers) applies.
log = logging.getLogger("vllm.kvxfer")

#: Notifications for requests this worker does not hold (yet) are kept this long at most.
_EARLY_LIMIT = 4096
#: The one handle the prefill's pump polls while any request's blocks are leased.
_LEASED = "leased"
#: Loads one prefill may hold at once on the owner (past that, its new loads recompute).
_PER_PREFILL = 1024


def agent_name(engine_id: str, rank: int) -> str:
    return f"kvxfer-vllm:{engine_id}:{rank}"


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """Threads started inside may run on every CPU, not only on the caller's.

    vLLM's CPU worker pins its main thread to one core, and a new thread inherits its
    creator's affinity: the transport's event thread and the side channel's server threads
    would share that core with the busy engine loop and wait seconds for it (first transfers
    stalled for tens of seconds that way, see docs/vllm.md). They do little work; they need
    to run promptly.
    """
    try:
        pinned = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or a cpuset that refuses: leave as is
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


@dataclass
class _Load:
    task: LoadTask
    peer: str  # the prefill's route on the owner
    transfer: OwnedTransfer


def _route(task: LoadTask, rank: int) -> str:
    """One route per prefill rank: its metadata is fetched once, not per load."""
    r = task.remote
    return f"{r.engine_id}@{r.host}:{r.port + rank}"


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, rank: int) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.rank = rank
        self.stats = KvxferConnectorStats()
        self.agent: kvxfer.Agent | None = None  # owned by self.owner once registered: use it only there
        self.owner: kvxfer.Owner | None = None
        self.server: MetadataServer | None = None
        self._loads: dict[str, _Load] = {}
        self._sending: dict[str, float] = {}  # prefill request id -> deadline
        self._wire: dict[str, str] = {}  # the id the params carry (binding.wire_id) -> vLLM's request id
        self._released: set[str] = set()  # sends and offloads the scheduler gave up (guard.py)
        self._early: dict[str, float] = {}  # notifications that beat their request's metadata
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._pump: Pump[str] | None = None
        self._routes: set[str] = set()  # prefill ranks named to the owner
        self._prover_seen: dict[str, int] = {}
        self.store: WorkerStore | None = None  # prompt prefixes from a kvxfer.Store (store.py)
        # The side channel wants the token, or an explicit NO_AUTH (the config's "insecure").
        self._side_token: object = cfg.token if cfg.token is not None else NO_AUTH

    # -- registration ---------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], *, num_blocks: int, page_bytes: Mapping[str, int],
                 layout: str | None, block_tokens: int, tp_size: int, replicated: bool,
                 serve: bool = True, model: str = "") -> kvxfer.KVCacheSpec:
        """Register vLLM's cache; ``serve``: publish the metadata (prefill roles; decode only reads)."""
        spec = spec_from_vllm(kv_caches, num_blocks=num_blocks, page_bytes=page_bytes, layout=layout,
                              block_tokens=block_tokens, tp_rank=self.rank, tp_size=tp_size, replicated=replicated)
        try:
            spec = discovered_spec(kv_caches, spec)
            log.info("kvxfer: generic discovery agrees; registering its spec (element type, page axes, heads)")
        except KvxferError as exc:
            log.warning("kvxfer: generic discovery differs, registering the explicit spec: %s", exc)
        with _unpinned():
            agent = kvxfer.Agent(agent_name(self.engine_id, self.rank), backend=self.cfg.backend,
                                 timeout=self.cfg.transfer_timeout, token=self.cfg.token, **self.cfg.backend_options)
        try:
            if not agent.backend.capabilities.cross_process:
                raise kvxfer.UnsupportedError(f"backend {self.cfg.backend!r} cannot reach other processes; "
                                              "prefill and decode are separate vLLM instances (use nixl or ucx)")
            agent.register(spec)
            if serve:
                with _unpinned():
                    self.server = MetadataServer(agent.metadata(), self.cfg.bind_host,
                                                 self.cfg.rank_port(self.rank), token=self._side_token,
                                                 timeout=self.cfg.handshake_timeout)
        except BaseException:
            agent.close()
            raise
        with _unpinned():  # the owner's thread (and the fetch threads it starts) must not share the engine's core
            self.owner = kvxfer.Owner(agent, max_pending_per_peer=_PER_PREFILL,
                                      add_peer_timeout=self.cfg.handshake_timeout, name=f"kvxfer-vllm-owner:{self.rank}")
        self.agent = agent
        if self.cfg.store_path is not None or self.cfg.tier is not None:
            self.store = WorkerStore.open(self.cfg.store_path, self.cfg.store_capacity, spec, model, self.stats,
                                          _unpinned, self.cfg.tier)
        if serve:
            self._pump = Pump(self._drive, name="kvxfer-vllm-progress", max_sleep=1e-3)
        where = "metadata on {}:{}".format(*self.server.address) if self.server else "not serving metadata (decode)"
        log.info("kvxfer registered %s; backend %s; %s", describe_spec(spec), self.cfg.backend, where)
        return spec

    def _drive(self, handle: str) -> bool:
        """The pump's poll: drive the transport once; pumping ends when :meth:`_release_sends` says."""
        agent = self.agent
        if agent is None:
            return True
        agent.progress()
        return False

    # -- each step ------------------------------------------------------------------------
    def start(self, meta: KvxferConnectorMetadata) -> None:
        t0 = time.perf_counter()
        now = time.monotonic()
        self._released.update(meta.released)
        for rid, blocks in meta.failed.items():  # loads the scheduler could not set up: recompute
            self._failed_blocks.update(blocks)
            self._failed_recv.add(rid)
            self._done_recv.add(rid)
        for rid, lease in meta.sends.items():
            wire = wire_id(rid)
            self._wire[wire] = rid
            if self._early.pop(wire, None) is not None:
                self._sending[rid] = 0.0  # decode already released it
            else:
                self._sending[rid] = now + lease
        if meta.sends and self._pump is not None and not len(self._pump):
            with _unpinned():  # the pump's thread must not share the engine loop's core
                self._pump.add(_LEASED)
        for task in meta.loads:
            self._start_load(task)
        if self.store is not None:
            self.store.start(meta.store_loads, meta.store_saves, self._store_fail)
        if meta.loads or meta.store_loads:
            self.stats.data["start_seconds"].append(time.perf_counter() - t0)

    def _start_load(self, task: LoadTask) -> None:
        """Hand the load to the owner; no network, no planning here (microseconds)."""
        assert self.owner is not None
        msg = task.remote.request_id.encode()
        key = _route(task, self.rank)
        try:
            if key not in self._routes:
                self._routes.add(key)
                r = task.remote
                self.owner.route(key, lambda: self._fetch(r.host, r.port + self.rank),
                                 expect=agent_name(r.engine_id, self.rank))
            # integrity: refuse a late load before it is queued (the expiry leaves transfer_timeout
            # plus handshake_timeout of margin, so a read that starts later is still inside the
            # lease); verify the prefill's digests after DONE
            _params.refuse_late(task.remote)
            expect = _params.load_digests(task.remote, task.remote_block_ids, self.rank) if self.cfg.digests else None
            # An empty load posts nothing: its notification still tells prefill to free the blocks.
            t = self.owner.read(key, task.local_block_ids, task.remote_block_ids, notify=msg,
                                timeout=self.cfg.transfer_timeout, expect=expect)
        except KvxferError as exc:  # BackPressureError: that prefill holds too many loads already
            self._fail(task, exc, None)
            return
        self._loads[task.request_id] = _Load(task, key, t)

    def _fetch(self, host: str, port: int) -> bytes:
        """The route's metadata fetch; runs on a fetch thread of the owner, never the engine's."""
        return fetch(host, port, token=self._side_token, timeout=self.cfg.handshake_timeout)

    def _fail(self, task: LoadTask, exc: BaseException, peer: str | None = None) -> None:
        log.warning("kvxfer: load of request %s failed, vLLM recomputes it: %s", task.request_id, exc)
        self.stats.count("failed_loads")
        if isinstance(exc, HandshakeError):
            self.stats.count("handshake_failures")
        extra = _params.failure_count(exc)  # integrity: digest mismatch or expired params
        if extra:
            self.stats.count(extra)
        if task.local_block_ids:
            self._failed_blocks.update(task.local_block_ids)
            self._failed_recv.add(task.request_id)
            self._done_recv.add(task.request_id)
        if peer is not None and self.owner is not None:
            try:  # let prefill free its blocks now rather than at the end of its lease (best effort)
                self.owner.notify(peer, task.remote.request_id.encode())
            except KvxferError:
                pass

    def store_handshake(self) -> StoreHandshake | None:
        """For the scheduler's read-only view of the store (None: no store configured)."""
        if self.cfg.store_path is None and self.cfg.tier is None:
            return None
        return StoreHandshake(self.store.handshake().handle if self.store is not None else None)

    def _store_fail(self, rid: str, block_ids: list[int], exc: BaseException) -> None:
        log.warning("kvxfer: restore of request %s from the store failed, vLLM recomputes it: %s", rid, exc)
        self.stats.count("failed_loads")
        self._failed_blocks.update(block_ids)
        self._failed_recv.add(rid)
        self._done_recv.add(rid)

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished sending, finished receiving, failed receiving)`` since the last call.

        Reads the loads' flags only: the owner enforces each load's ``transfer_timeout``.
        """
        if self.owner is None:
            return set(), set(), set()
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            t = load.transfer
            try:
                finished = t.done()
            except KvxferError as exc:
                del self._loads[rid]
                self._fail(load.task, exc, load.peer)
                continue
            if finished:
                del self._loads[rid]
                if not load.task.local_block_ids:  # nothing to load: prefill was told to free its blocks
                    continue
                s = t.stats
                assert s is not None
                self.stats.record_load(seconds=s.seconds or 0.0, plan_seconds=s.plan_seconds, nbytes=s.nbytes,
                                       descriptors=s.descriptors, runs=t.plan.runs, posts=s.posts,
                                       tokens=load.task.tokens)
                log.debug("kvxfer: loaded request %s: %d descriptors, %d bytes, %.3f ms", rid, s.descriptors,
                          s.nbytes, 1e3 * (s.seconds or 0.0))
                self._done_recv.add(rid)
        sending = self._release_sends(now)
        if self.store is not None:
            sending |= self.store.poll(self._done_recv.add, self._store_fail)
        recv, failed = self._done_recv, self._failed_recv
        self._done_recv, self._failed_recv = set(), set()
        return sending, recv, failed

    def _release_sends(self, now: float) -> set[str]:
        assert self.owner is not None
        done: set[str] = set()
        released = 0
        try:
            notes = self.owner.notifications(timeout=self.cfg.handshake_timeout) if self._sending else {}
        except KvxferError as exc:
            log.warning("kvxfer: reading notifications failed: %s", exc)
            notes = {}
        for msgs in notes.values():
            for m in msgs:
                wire = m[:4 * _params.MAX_ID].decode("utf-8", "replace")
                rid = self._wire.pop(wire, None)
                if rid is not None and rid in self._sending:
                    del self._sending[rid]
                    done.add(rid)
                    released += 1
                elif len(self._early) < _EARLY_LIMIT:
                    self._early[wire] = now
        for rid, deadline in list(self._sending.items()):
            if deadline == 0.0:
                done.add(rid)
                del self._sending[rid]
                released += 1
            elif now > deadline:
                log.warning("kvxfer: no decode released request %r within %g s; freeing its blocks",
                            wire_id(rid), self.cfg.lease_seconds)
                self.stats.count("expired_sends")
                done.add(rid)
                del self._sending[rid]
            else:
                continue
            self._wire.pop(wire_id(rid), None)
        done |= self._released
        self._released = set()
        if released:
            self.stats.count("sends_done", released)
        if not self._sending and self._pump is not None:
            self._pump.discard(_LEASED)
        for rid, seen in list(self._early.items()):
            if now - seen > self.cfg.lease_seconds:
                del self._early[rid]
        return done

    def abandon(self, meta: KvxferConnectorMetadata) -> None:
        """``start_load_kv`` raised: every load of ``meta`` not started fails (vLLM recomputes it),
        every offload not started is released, so vLLM waits for nothing that will not come."""
        for task in meta.loads:
            if task.request_id not in self._loads and task.request_id not in self._done_recv:
                self._failed_blocks.update(task.local_block_ids)
                self._failed_recv.add(task.request_id)
                self._done_recv.add(task.request_id)
        for rid, blocks in meta.failed.items():
            self._failed_blocks.update(blocks)
            self._failed_recv.add(rid)
            self._done_recv.add(rid)
        store = self.store
        for ld in meta.store_loads:
            if store is None or ld.request_id not in store._loads:
                self._store_fail(ld.request_id, ld.block_ids, KvxferError("not started"))
        for sv in meta.store_saves:
            if store is None or sv.request_id not in store._saves:
                self._released.add(sv.request_id)
        for rid, lease in meta.sends.items():
            if rid not in self._sending:
                self._wire[wire_id(rid)] = rid
                self._sending[rid] = Deadline.within(lease)
        self._released.update(meta.released)

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_stats(self) -> KvxferConnectorStats | None:
        self._count_prover()
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def _count_prover(self) -> None:
        """What the metadata prover saw since the last look, as counters (kvxfer.prove.health)."""
        now = prove.health()
        for key in PROVER_COUNTS:
            grown = int(now.get(key, 0)) - self._prover_seen.get(key, 0)
            if grown > 0:
                self.stats.count(f"prover_{key}", grown)
            self._prover_seen[key] = int(now.get(key, 0))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._pump is not None:
            self._pump.stop()
            self._pump = None
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.owner is not None:
            self.owner.close()  # loads in flight end cancelled; then the agent closes
            self.owner = None
            self.agent = None
