"""The Agent: the object a serving engine's connector holds.

It owns one backend instance, the registered KV cache spec, the known peers and their
prepared descriptor lists. All policy is here: metadata validation, peer generations,
bounds (block ids are checked by the planner against the peer's validated spec, so no
descriptor can leave the peer's registered memory), coalescing according to the backend's
capabilities, batching limits, and deadlines (through :class:`~kvxfer.transfer.Transfer`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .deadlines import Deadline, check_timeout, deadline_scope
from ._fdlimit import limit_error, raise_soft_limit
from .errors import (
    AgentClosedError,
    InvalidArgumentError,
    KvxferError,
    MetadataError,
    SpecError,
    StalePeerError,
    UnknownOptionError,
    UnknownPeerError,
    UnsupportedError,
)
from .geometry import DISCOVERY_OPTIONS, spec_from_tensors
from ._group import TransferGroup
from .geometry import KVCacheSpec
from .memory import Op, as_op
from .metadata import AgentMetadata, seal, unseal
from .observe import transfer_finished
from .pairing import Pairing, pair
from .planner import TransferPlan, plan
from .plugin.backend import Backend, check_options
from ._routed import Routed, device_options
from .plugin.registry import get_backend_class, plugin_manager
from .pairing import Gather, pair_source
from .tokens import token_key
from .transfer import Transfer
from . import _args, _checks, _many, _posting, _lifecycle as lifecycle

__all__ = ["Agent", "Peer"]

_generation_clock = [0]


def _new_generation() -> int:
    """Strictly increasing within a process and across restarts (wall-clock nanoseconds)."""
    g = max(time.time_ns(), _generation_clock[0] + 1) & ((1 << 63) - 1)
    _generation_clock[0] = g
    return g


@dataclass
class Peer:
    """What the agent knows about one remote worker.

    Everything planned for the peer lives here (the checked pairing, the prepared lists),
    so dropping the peer releases all of it.
    """

    name: str
    generation: int
    spec: KVCacheSpec | None
    prepared: dict[Any, Any] = field(default_factory=dict)
    pairing: Pairing | Gather | None = None
    source: bool = False  # added by add_source: may hold only part of our cache


def _store(store: Any) -> Any:
    """``store`` if it is a tier: a :class:`kvxfer.Store` or a :class:`kvxfer.tiers.Tier` such
    as the cluster tier (imported here: both are optional)."""
    from .store import Store
    from .tiers import Tier

    if not isinstance(store, (Store, Tier)):
        raise InvalidArgumentError(f"offload/restore take a kvxfer.Store or a kvxfer.tiers tier, "
                                   f"got {type(store).__name__}")
    return store


class Agent:
    """Moves KV blocks between this worker and its peers through one backend.

    ``Agent(name, backend="loopback", *, timeout=30.0, coalesce=None, token=None, **options)``:
    the options go to the backend. ``timeout`` (finite, positive seconds) is each transfer's
    deadline, counted from the call to :meth:`read`/:meth:`write`, planning and posting
    included. ``coalesce=None`` merges contiguous runs in the planner only for backends that
    do not merge runs themselves and prepare cheaply. With ``token`` (the shared secret, as
    given to the side channel), :meth:`metadata` is signed and :meth:`add_peer` accepts only
    metadata signed with the same token, before any of it reaches the backend.
    ``device_copy``, ``device_engine`` and ``device_copy_on`` are not the backend's: they set the
    agent's own device path, to which same-host VRAM pairs are routed (kvxfer._routed,
    docs/device-path.md).
    """

    def __init__(self, name: str, backend: str = "loopback", *, timeout: float = 30.0,
                 coalesce: bool | None = None, token: str | bytes | None = None, verify: bool = False,
                 **options: Any) -> None:
        # Validate the name exactly as peers will when they decode our metadata.
        AgentMetadata(name, 1, backend, b"", None)
        self.timeout = check_timeout(timeout, "Agent timeout")
        self.verify = bool(verify)  # every read must then carry the source's digests (kvxfer.integrity)
        self._key = token_key(token, "Agent token")
        self.name = name
        self.generation = _new_generation()
        self.backend_name = backend
        cls = get_backend_class(backend)
        device = device_options(options)  # the device path is the agent's, beside the backend
        check_options(cls, options)
        from .cuda import DevicePath  # not on import kvxfer: it is not needed before an agent exists

        self.device_path = DevicePath(**device)  # BackendError on a bad engine or copy_on
        raise_soft_limit()  # transports hold descriptors per peer; once per process
        self.backend: Backend = cls(name, **options)
        self.backend.peers_authenticated = self._key is not None  # add_peer checks every tag first
        self._route = Routed(self.backend, self.device_path)  # the seam the core calls (kvxfer._routed)
        caps = self.backend.capabilities
        self._coalesce = (not caps.merges_runs and caps.cheap_prepare) if coalesce is None else bool(coalesce)
        self.spec: KVCacheSpec | None = None
        self._held: Any = None  # what register() was given: kept alive until deregister()
        self._reg_handle: Any = None
        self._registered_before = False
        self._local_prepared: dict[Any, Any] = {}
        self._peers: dict[str, Peer] = {}
        self._inflight: set[Transfer] = set()
        self._hot: dict[tuple[str, Op], Any] = {}  # shapes the hot path repeats (kvxfer._hot)
        self._adding_source = False
        self._closed = False
        plugin_manager().hook.kvxfer_agent_created(agent=self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"<Agent {self.name!r} backend={self.backend_name!r} {state}>"

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory ---------------------------------------------------------------------------
    def register(self, kv: Any = None, /, **options: Any) -> KVCacheSpec:
        """Register a KV cache: a :class:`KVCacheSpec`, or ``{layer: tensor|array}``.

        Discovery options (``replicated``, ``tp_rank``, ``tp_size``, ``dims``...) are passed
        to :func:`kvxfer.spec_from_tensors`. Returns the spec that peers will see. The agent
        holds references to the tensors (and the spec) until :meth:`deregister` or
        :meth:`close`, so temporaries cannot be freed while transfers may touch them.
        """
        self._check_open()
        unknown = sorted(set(options) - DISCOVERY_OPTIONS)
        if unknown:
            raise UnknownOptionError(f"register() has no option {unknown[0]!r}; its options: "
                                     f"{', '.join(sorted(DISCOVERY_OPTIONS))}", tuple(sorted(DISCOVERY_OPTIONS)))
        if self.spec is not None:
            raise SpecError("a KV cache is already registered; deregister() it first")
        if isinstance(kv, KVCacheSpec):
            if options:
                raise SpecError("discovery options apply only when registering tensors or arrays")
            spec = kv
        elif isinstance(kv, Mapping):
            spec = spec_from_tensors(kv, **options)
        else:
            raise SpecError(f"register() takes a KVCacheSpec or a mapping of name -> tensor/array, "
                            f"got {type(kv).__name__}")
        kinds = {a.kind for a in spec.allocations}
        unsupported = kinds - set(self._route.capabilities.memory_kinds)
        if unsupported:
            raise UnsupportedError(f"backend {self.backend_name!r} cannot move "
                                   f"{', '.join(sorted(k.value for k in unsupported))} memory")
        self._reg_handle = self._route.register(spec.allocations)
        if self._registered_before:
            # New memory behind the same name: peers must drop the lists they prepared over
            # the old one, which is exactly what a new generation tells them.
            self.generation = _new_generation()
        self._registered_before = True
        self.spec = spec
        self._held = kv
        self._hot.clear()
        for peer in self._peers.values():
            peer.pairing = None  # planned against the previous local spec
        lifecycle.registered(self, spec)
        return spec

    def deregister(self) -> None:
        """Drop the registered cache and every list prepared over it."""
        self._check_open()
        if self.spec is None:
            return
        for t in list(self._inflight):
            t.cancel()
        for h in self._local_prepared.values():
            self._route.release_prepared(h)
        self._local_prepared.clear()
        self._hot.clear()
        self._route.deregister(self._reg_handle)
        self.spec = None
        self._held = None
        self._reg_handle = None
        for peer in self._peers.values():
            peer.pairing = None
        lifecycle.deregistered(self)

    # -- peers ----------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """Versioned bytes a peer passes to :meth:`add_peer` (no pickle; validated there)."""
        self._check_open()
        raw = AgentMetadata(self.name, self.generation, self.backend_name, self._route.local_metadata(),
                            self.spec, device=self._route.device_metadata()).encode()
        return seal(raw, self._key) if self._key is not None else raw

    def add_peer(self, metadata: bytes, *, timeout: float | None = None,
                 canary: tuple[int, int] | None = None) -> str:
        """Add (or refresh) a peer from its metadata; returns its name.

        ``timeout`` bounds the call, proving untrusted metadata in a helper process included
        (:mod:`kvxfer.prove`); without one, the prover's own bound applies.

        A newer generation of a known peer means it restarted: the old connection and
        every list prepared for it are dropped first. An older generation is refused. When
        both sides have registered a cache, a peer whose cache cannot be paired with ours is
        refused here with a :class:`~kvxfer.errors.LayoutMismatchError` subclass, before
        any connection is made (see :meth:`check`). Every failure is a :class:`KvxferError`,
        and a failed call leaves neither the agent nor its backend holding anything of it.
        ``canary=(local scratch block, peer's canary block)``: read the canary the peer wrote
        with :func:`kvxfer.integrity.canary.fill` and refuse the peer if it arrives wrong.
        """
        self._check_open()
        try:
            with deadline_scope(timeout) if timeout is not None else contextlib.nullcontext():
                name = self._add_peer(metadata)
            if canary is not None:
                _checks.canary(self, name, canary, timeout)
            return name
        except KvxferError:
            raise
        except Exception as exc:  # a transport's parser leaking its own exception on hostile bytes
            raise MetadataError(f"peer metadata rejected by backend {self.backend_name!r}: "
                                f"{type(exc).__name__}: {exc}") from exc

    def _add_peer(self, metadata: bytes) -> str:
        md = AgentMetadata.decode(unseal(metadata, self._key))
        if md.backend != self.backend_name:
            raise MetadataError(f"peer {md.name!r} uses backend {md.backend!r}; this agent uses "
                                f"{self.backend_name!r}. Both sides must pick the same backend.")
        if md.name == self.name and md.generation == self.generation:
            raise MetadataError("an agent cannot add itself as a peer")
        known = self._peers.get(md.name)
        if known is not None:
            if md.generation < known.generation:
                raise StalePeerError(f"metadata for {md.name!r} is generation {md.generation}, older than the "
                                     f"known {known.generation}; fetch fresh metadata")
            if md.generation == known.generation:
                if md.spec != known.spec:
                    raise MetadataError(f"peer {md.name!r} sent a different spec under the same generation")
                return known.name
            lifecycle.peer_restarted(self, known, md.generation)
            self._drop_peer(known)
        pairing = self._pair_with(md.spec, self._adding_source) if self.spec is not None and md.spec is not None else None
        ran_out = limit_error(f"adding peer {md.name!r}")  # before the transport: at the limit, UCX's
        if ran_out is not None:  # failed endpoint left that peer unreachable for the worker's life
            raise ran_out
        try:
            self._route.add_remote(md.name, md.blob, md.device)
        except BaseException as exc:
            self._forget_remote(md.name)  # whatever the backend half-built under that name
            ran_out = limit_error(f"adding peer {md.name!r}") if isinstance(exc, Exception) else None
            if ran_out is not None:  # the transport's own error would blame the peer
                raise ran_out from exc
            raise
        self._peers[md.name] = Peer(md.name, md.generation, md.spec, pairing=pairing, source=self._adding_source)
        lifecycle.peer_added(self, self._peers[md.name])
        return md.name

    def _forget_remote(self, key: str) -> None:
        with contextlib.suppress(Exception):  # best effort: it may never have been added
            self._route.remove_remote(key)

    def add_source(self, metadata: bytes) -> str:
        """:meth:`add_peer` for a peer of another TP size, PP stage or block size.

        Such a peer may hold only some of our heads or layers: it is accepted when every
        page both sides hold can be copied correctly (:func:`kvxfer.pairing._reshard.pair_source`),
        and refused with the typed error otherwise. Read it with :meth:`read_many`, or
        with :meth:`read` when it alone holds everything we need.
        """
        self._adding_source = True
        try:
            return self.add_peer(metadata)
        finally:
            self._adding_source = False

    def _pair_with(self, spec: KVCacheSpec, source: bool) -> Pairing | Gather:
        assert self.spec is not None
        return pair_source(self.spec, spec) if source else pair(self.spec, spec)

    def check(self, peer: str) -> Pairing | Gather:
        """Check that our cache and the peer's can be paired; raises the typed refusal.

        ``add_peer`` runs this check when both caches are registered; call it after
        registering later, or to inspect the pairing (whole rows or split, per region).
        """
        self._check_open()
        p = self._peer(peer)
        if self.spec is None:
            raise SpecError("register a KV cache before checking a peer")
        if p.spec is None:
            raise SpecError(f"peer {p.name!r} registered no KV cache")
        return self._pairing(p)

    def _pairing(self, peer: Peer) -> Pairing | Gather:
        assert self.spec is not None and peer.spec is not None
        if peer.pairing is None or not peer.pairing.matches(self.spec, peer.spec):
            peer.pairing = self._pair_with(peer.spec, peer.source)
        return peer.pairing

    def remove_peer(self, name: str) -> None:
        self._check_open()
        self._drop_peer(peer := self._peer(name))
        lifecycle.peer_removed(self, peer)

    @property
    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    def _drop_peer(self, peer: Peer) -> None:
        self._peers.pop(peer.name, None)
        for op in Op:
            self._hot.pop((peer.name, op), None)
        for h in peer.prepared.values():
            try:
                self._route.release_prepared(h)
            except KvxferError:
                pass
        peer.prepared.clear()
        peer.pairing = None
        self._route.remove_remote(peer.name)

    def _peer(self, name: str) -> Peer:
        peer = self._peers.get(name) if isinstance(name, str) else None
        if peer is None:
            raise UnknownPeerError(lifecycle.unknown_peer_message(name, self._peers))
        return peer

    # -- transfers ------------------------------------------------------------------------
    def plan(self, peer: str, local_blocks: Any, remote_blocks: Any, op: Op | str = Op.READ) -> TransferPlan:
        """The plan :meth:`read`/:meth:`write` would post (for inspection and benchmarks)."""
        self._check_open()
        return self._plan(self._peer(peer), local_blocks, remote_blocks, as_op(op))

    def _plan(self, peer: Peer, local_blocks: Any, remote_blocks: Any, op: Op) -> TransferPlan:
        if self.spec is None:
            raise SpecError("register a KV cache before transferring")
        if peer.spec is None:
            raise SpecError(f"peer {peer.name!r} registered no KV cache")
        return plan(self.spec, peer.spec, local_blocks, remote_blocks, op, coalesce=self._coalesce,
                    pairing=self._pairing(peer))

    def read(self, peer: str, local_blocks: Any, remote_blocks: Any, notify: bytes | None = None, *,
             expect: Any = None) -> Transfer:
        """Pull the peer's ``remote_blocks`` into our ``local_blocks``.

        ``expect``: the source's :class:`kvxfer.integrity.Digests` of ``remote_blocks``; the
        transfer is then verified after DONE and fails with ``IntegrityError`` instead.
        """
        if expect is None and notify is None and type(peer) is str and not self._closed:
            hot = self._hot.get((peer, Op.READ))  # _transfer's first step, inlined: the small READ's call
            if hot is not None:
                t = hot.post(self, local_blocks, remote_blocks, None, None)
                if t is not None:
                    return t
        return self._transfer(Op.READ, peer, local_blocks, remote_blocks, notify, expect=expect)

    def write(self, peer: str, local_blocks: Any, remote_blocks: Any, notify: bytes | None = None) -> Transfer:
        """Push our ``local_blocks`` into the peer's ``remote_blocks``."""
        return self._transfer(Op.WRITE, peer, local_blocks, remote_blocks, notify)

    def offload(self, store: Any, local_blocks: Any, keys: Sequence[bytes]) -> Transfer:
        """Write ``local_blocks`` to a :class:`kvxfer.Store` or another tier under ``keys`` (docs/storage.md)."""
        return _store(store).offload(self, local_blocks, keys)

    def restore(self, store: Any, keys: Sequence[bytes], local_blocks: Any) -> Transfer:
        """Read the rows a :class:`kvxfer.Store` holds under ``keys`` into ``local_blocks``."""
        return _store(store).restore(keys, self, local_blocks)

    def _transfer(self, op: Op, peer_name: str, local_blocks: Any, remote_blocks: Any,
                  notify: bytes | None, deadline: float | None = None, expect: Any = None) -> Transfer:
        if self._closed:
            self._check_open()
        hot = self._hot.get((peer_name, op)) if (type(peer_name) is str and expect is None
                                                 and (notify is None or type(notify) is bytes)) else None
        if hot is not None:  # a shape posted before: checked and posted in a few calls (kvxfer._hot)
            t = hot.post(self, local_blocks, remote_blocks, notify, deadline)
            if t is not None:
                return t
        caps = self.backend.capabilities
        if op not in caps.ops:
            raise UnsupportedError(f"backend {self.backend_name!r} does not support {op.value}")
        if _args.notify_bytes(notify) is not None and not caps.notifications:
            raise UnsupportedError(f"backend {self.backend_name!r} does not support notifications")
        t0 = time.perf_counter()
        if deadline is None:  # an Owner passes the one it started at submission
            deadline = Deadline.within(self.timeout)  # planning and posting count against it too
        peer = self._peer(peer_name)
        p = self._plan(peer, local_blocks, remote_blocks, op)
        check = _checks.for_read(self, peer, local_blocks, remote_blocks, expect) if op is Op.READ else None
        t = self._post(op, peer, p, notify, t0, deadline, verify=check, learn=check is None)
        return t

    def _post(self, op: Op, peer: Peer, p: TransferPlan, notify: bytes | None, t0: float,
              deadline: float, planned: float = 0.0, verify: Any = None, learn: bool = False) -> Transfer:
        """Prepare and post one plan (:func:`kvxfer._posting.post`)."""
        return _posting.post(self, op, peer, p, notify, t0, deadline, planned, verify, learn)

    def _finished(self, t: Transfer) -> None:
        self._inflight.discard(t)
        transfer_finished(self, t)

    def read_many(self, local_blocks: Any, remote_blocks: Mapping[str, Any],
                  notify: bytes | None = None, *, expect: Mapping[str, Any] | None = None) -> TransferGroup:
        """Gather ``local_blocks`` from several peers: ``{peer: its block ids}``, one request.

        For peers of another TP or PP size: each local member's heads and layers come from
        the peer that holds them (chosen as :mod:`kvxfer.pairing._reshard` says); a remote block
        smaller than ours fills ``k`` consecutive ids per local block. Peers given that hold
        nothing needed are not read and, with ``notify``, are told at once. ``expect``: each
        peer's digests (of :meth:`cells_for` cells where geometries differ), verified as in :meth:`read`.
        """
        return self._many(Op.READ, local_blocks, remote_blocks, notify, expect)

    def write_many(self, local_blocks: Any, remote_blocks: Mapping[str, Any],
                   notify: bytes | None = None) -> TransferGroup:
        """Scatter our blocks into several peers; the mirror of :meth:`read_many`."""
        return self._many(Op.WRITE, local_blocks, remote_blocks, notify)

    def _many(self, op: Op, local_blocks: Any, remote_blocks: Mapping[str, Any],
              notify: bytes | None, expect: Mapping[str, Any] | None = None) -> TransferGroup:
        self._check_open()
        return _many.post_many(self, op, local_blocks, remote_blocks, notify, expect)

    def digest(self, blocks: Any, *, cells: Any = None, algorithm: str = "auto", rows: bool = False) -> Any:
        """Our :class:`kvxfer.integrity.Digests` of ``blocks``: what a reader passes as ``expect``."""
        self._check_open()
        return _checks.digest(self, blocks, cells, algorithm, rows)

    def cells_for(self, *peers: str) -> dict[str, Any]:
        """Per source peer, the cells it must digest for our reads of another geometry."""
        self._check_open()
        return _checks.cells_for(self, peers)

    # -- notifications --------------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        self._check_open()
        self.backend.notify(self._peer(peer).name, _args.message_bytes(message))

    def notifications(self) -> dict[str, list[bytes]]:
        """Messages received since the last call, keyed by the sending agent's name."""
        self._check_open()
        self.backend.progress()
        return self.backend.drain_notifications()

    def progress(self) -> None:
        """Drive the backend once (needed by backends without their own progress thread)."""
        self._check_open()
        self.backend.progress()

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel what is in flight, drop peers, deregister and close the backend. Idempotent."""
        if self._closed:
            return
        try:
            for t in list(self._inflight):
                t.cancel()
            for peer in list(self._peers.values()):
                try:
                    self._drop_peer(peer)
                except KvxferError:
                    pass
            if self.spec is not None:
                self.deregister()
        finally:
            self._closed = True
            self._route.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise AgentClosedError(f"agent {self.name!r} is closed; create a new Agent")
