"""The NIXL backend's control plane: one NIXL agent, its peers, notifications, and paths.

This class owns the NIXL agent's lifetime, registrations, peers (loading and unloading their
metadata) and notifications. The post loop is :class:`kvxfer.plugin.PathBackend`'s; this
backend adds its rows, :mod:`kvxfer_nixl._xfer` (NIXL prepared lists, plain or fenced), and
its hooks: which row a post takes once its lists are checked current (:meth:`NixlBackend.route`),
and the stale-peer check once the bytes are in place (:meth:`NixlBackend.landed`). VRAM
between agents of one host is routed by the agent to the core's device path
(:mod:`kvxfer._routed`) before it reaches this backend. Why it is built this way is in
``plugins/kvxfer_nixl/README.md``.

This module imports ``nixl``; :mod:`kvxfer_nixl` itself does not, so listing backends on a
machine without NIXL stays cheap and says how to install it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from typing import Any, Sequence


from kvxfer import (Allocation, BackendClosedError, BackendError, Capabilities, DescriptorList, KvxferError,
                    MemoryKind, MetadataError, Op, OutOfRegistrationError, StalePeerError, UnknownPeerError, UnsupportedError)
from kvxfer.plugin import DataPath, PathBackend, Post, Pump, SpanIndex, identity as peers

from . import _blob, _identity, _probe
from ._bounce import needs_fence
from ._files import Files
from ._nixl import deregister_memory, map_error, nb, nx, register_memory
from ._notify import BACKGROUND_SLEEP_S, Notifications
from ._parking import Parking
from ._records import Flush, Prepared, Registration, Remote, extents, instances
from ._xfer import Fenced, NixlPath

__all__ = ["DEFAULT_BACKGROUND_PROGRESS", "DEFAULT_PROGRESS_THREAD", "DEFAULT_REQUEST_DESCRIPTORS", "NixlBackend"]

#: Default for the ``progress_thread`` option (BENCHMARKS.md shows why it is off).
DEFAULT_PROGRESS_THREAD = False
#: Default for ``background_progress``: a peer others read from must progress without its owner.
DEFAULT_BACKGROUND_PROGRESS = True
#: Default for ``request_descriptors``: the most descriptors one NIXL request carries.
DEFAULT_REQUEST_DESCRIPTORS = 1 << 14

_LOCAL_AGENT = "NIXL_INIT_AGENT"
#: A completing transfer reads notifications (for deregistration notices) at most this often.
_COLLECT_EVERY = 1e-3


class NixlBackend(Notifications, Files, PathBackend):
    """kvxfer backend over NIXL (UCX by default): DRAM and VRAM, READ and WRITE, notifications.

    Options (``kvxfer.Agent(name, backend="nixl", **options)``): one table, in
    :mod:`kvxfer_nixl._options` (shown by ``kvxfer backends --options nixl`` and docs/backends.md),
    with each default, what it does and when to change it.
    """

    name = "nixl"

    def __init__(self, agent_name: str, *, progress_thread: bool | None = None,
                 background_progress: bool = DEFAULT_BACKGROUND_PROGRESS,
                 backends: Sequence[str] = ("UCX",), num_threads: int = 0, notify_thread: bool = True,
                 request_descriptors: int = DEFAULT_REQUEST_DESCRIPTORS, prove_metadata: bool | str = "auto",
                 prove_timeout: float = 30.0, fence_reads: bool | str = "auto") -> None:
        super().__init__(agent_name)
        if fence_reads not in (True, False, "auto"):
            raise BackendError(f"fence_reads must be True, False or 'auto', got {fence_reads!r}")
        self._fence_reads = fence_reads
        self._progress_thread = DEFAULT_PROGRESS_THREAD if progress_thread is None else bool(progress_thread)
        self._backends = tuple(backends)
        if prove_metadata not in (True, False, "auto"):
            raise BackendError(f"prove_metadata must be True, False or 'auto', got {prove_metadata!r}")
        self._prove_all = prove_metadata is True
        # The helper's backend never runs NIXL's progress thread: proving only adds and removes
        # peers, and that thread would spin a core in an idle helper for its whole life.
        self._prover = _probe.prover(dict(
            progress_thread=False, backends=list(self._backends), num_threads=int(num_threads),
            notify_thread=bool(notify_thread)),
            prove_timeout) if prove_metadata else None
        if self._prove_all:
            self._prover.start_soon()  # most of its cost (importing NIXL) is paid before the first add_remote
        self._notify_thread = bool(notify_thread)
        self.capabilities = Capabilities(
            memory_kinds=frozenset({MemoryKind.DRAM, MemoryKind.VRAM}),
            ops=frozenset({Op.READ, Op.WRITE}),
            notifications=True,
            strided_lists=True,
            merges_runs=True,
            cheap_prepare=False,
            max_descriptors=None,
            needs_progress=not self._progress_thread,
            cross_process=True,
        )
        cfg = nx.nixl_agent_config(enable_prog_thread=self._progress_thread, backends=list(self._backends),
                                    num_threads=int(num_threads))
        try:
            self._agent = nx.nixl_agent(agent_name, cfg)
        except Exception as exc:
            raise map_error(exc, f"creating NIXL agent {agent_name!r}") from exc
        missing = [b for b in self._backends if b not in self._agent.backends]
        if missing:
            raise UnsupportedError(f"NIXL plugin(s) {missing} are not available here; "
                                   f"available: {self._agent.get_plugin_list()}")
        # NIXL agents are not thread-safe in the default sync mode; every call goes through
        # this lock (the notify thread and the caller share it).
        self._lock = threading.RLock()
        self._id = os.urandom(16)
        self._remotes: dict[str, Remote] = {}
        self._parked = Parking()  # removed peers' loads, for a re-add of the same bytes
        self._loads = 0
        self._prepared: "weakref.WeakSet[Prepared]" = weakref.WeakSet()
        self._registrations: list[Registration] = []
        self._memory = SpanIndex()
        self._reg_epoch = 0
        self._inbox: dict[str, list[bytes]] = {}
        self._collected = 0.0  # when notifications were last read
        self._request_descriptors = max(1, int(request_descriptors))
        self._nixl_path = NixlPath(self._agent, self._lock, self._request_descriptors)
        self._fenced = Fenced(self._nixl_path)  # route() picks it for a READ that needs the fence
        self.paths = (self._nixl_path,)
        # NIXL sends a notification only while polled, and posts later pieces while polled: the pump drives both
        self.pump_over = self._request_descriptors if self._notify_thread else None
        self._flush = Flush()
        self._pump = Pump(self._pumped, name="kvxfer-nixl-notify")  # PathBackend's, also driving the flush
        self._keeper: Pump[Any] | None = (Pump(self._kept, name="kvxfer-nixl-progress", max_sleep=BACKGROUND_SLEEP_S)
                                          if background_progress and not self._progress_thread else None)
        self._exported = False  # local_metadata() was called: a peer may now connect (the keeper may run)
        self._closed = False
        instances[self._id] = self

    def __repr__(self) -> str:
        return (f"<NixlBackend {self.agent_name!r} progress_thread={self._progress_thread} "
                f"peers={sorted(self._remotes)}>")

    def _proving(self) -> bool:
        """Whether a new blob is loaded in a helper first (``prove_metadata``, and who signed it)."""
        return self._prover is not None and (self._prove_all or not self.peers_authenticated)

    # -- memory -------------------------------------------------------------------------
    def register(self, allocations: Sequence[Allocation]) -> Registration:
        """Register every allocation once (one NIXL call per memory kind)."""
        self._check_open()
        allocs = tuple(allocations)
        others = {a.kind for a in allocs} - {MemoryKind.DRAM, MemoryKind.VRAM}
        if others:
            raise UnsupportedError(f"NIXL backend moves DRAM and VRAM only, not {sorted(map(str, others))}")
        handle = Registration(register_memory(self._agent, self._lock, allocs), allocs)
        self._registrations.append(handle)
        self._registered_changed()
        self._keep_progressing()
        if self._proving():
            self._prover.start_soon()  # peers come after registration: have a helper ready for them
        return handle

    def deregister(self, handle: Any) -> None:
        """Drop a registration: lists over it die first, then peers hear that it is gone."""
        if not isinstance(handle, Registration) or handle not in self._registrations:
            return
        self._registrations.remove(handle)
        self._registered_changed()
        for p in list(self._prepared):
            ext = extents(p.descs)
            if p.peer is None and (self._memory.find(ext[:, 0], ext[:, 1], ext[:, 2], p.descs.kind) < 0).any():
                self.release_prepared(p)
                p.gone = "the local list lies in memory that was deregistered since it was prepared"
        errors = deregister_memory(self._agent, self._lock, handle.lists)
        self._announce_deregistration()
        if errors:
            raise map_error(errors[0], "deregistering memory")

    def _registered_changed(self) -> None:
        self._memory = SpanIndex(a for r in self._registrations for a in r.allocations)
        self._reg_epoch += 1
        # what same-host peers check our blob's memory sections against (kvxfer_nixl._identity)
        peers.process_page().set(self._id, [(a.address, a.end) for r in self._registrations for a in r.allocations])

    # -- peers --------------------------------------------------------------------------
    def local_metadata(self) -> bytes:
        """Header (process identity, instance id, registration epoch), then NIXL metadata."""
        self._check_open()
        with self._lock:
            try:
                md = self._agent.get_agent_metadata()
            except Exception as exc:
                raise map_error(exc, "reading local NIXL metadata") from exc
        self._exported = True
        self._keep_progressing()  # peers can reach us from now on
        return _blob.encode(peers.here(), self._id, self._reg_epoch, bytes(md))

    def add_remote(self, peer_name: str, blob: bytes) -> None:
        """Load a peer's metadata; a known name is replaced only once the new load succeeded.

        Only :class:`~kvxfer.errors.KvxferError` leaves this method, and a failure leaves the
        peer as it was. The blob is validated completely before NIXL sees it
        (:mod:`kvxfer_nixl._blob`), then (``prove_metadata``) loaded in a helper process
        first (:mod:`kvxfer_nixl._probe`), and each load gets a fresh NIXL name: NIXL keeps the
        connection of a blob it refused halfway under the name it was loaded with, which
        would otherwise block that peer for good.
        """
        self._check_open()
        try:
            parsed = _blob.parse(blob, peer_name, self._backends)
            _identity.check(parsed, peer_name, self._backends, instances)  # IdentityError: not who it says
            memory = SpanIndex(parsed.allocations())  # spans already checked by parse()
            if self._proving():  # MetadataError (or MetadataCrashError) unless the helper survives it
                self._prover.prove(_probe.request(peer_name, blob), f"NIXL metadata of {peer_name!r}")
            self._loads += 1
            alias = self._reusable(peer_name, bytes(blob))
            reused = alias is not None
            if alias is None:
                alias = f"{peer_name}#{self._loads}"
                with self._lock:
                    try:
                        loaded = self._agent.add_remote_agent(parsed.nixl_metadata(alias))
                    except Exception as exc:
                        raise MetadataError(f"NIXL refused the metadata of {peer_name!r}: "
                                            f"{map_error(exc, 'loading')}") from exc
                if (loaded.decode("utf-8", "replace") if isinstance(loaded, bytes) else str(loaded)) != alias:
                    raise MetadataError(f"NIXL loaded {loaded!r} instead of {alias!r}")  # pragma: no cover
        except KvxferError:
            raise
        except Exception as exc:  # nothing untyped may escape a call that takes network input
            raise MetadataError(f"could not load the NIXL metadata of {peer_name!r}: {exc!r}") from exc
        local = None
        other = instances.find(parsed.instance, parsed.identity.token, peers.here().token)
        if other is not None and other is not self and other.agent_name == peer_name:
            local = weakref.ref(other)
        old = self._remotes.get(peer_name)
        fence = self._fence_reads is True or (self._fence_reads == "auto" and local is None
                                              and needs_fence(parsed.identity.same_host()))
        self._remotes[peer_name] = Remote(peer_name, alias, self._loads, parsed, memory, local, bytes(blob),
                                          fence=fence)
        if old is not None:
            self._release_lists(old)
        parked = self._parked.take(peer_name)
        for gone in {a for a in (old.nixl if old is not None else None, parked) if a is not None and a != alias}:
            with contextlib.suppress(KvxferError):  # the old incarnation is gone either way
                self._unload(peer_name, gone)

    def _reusable(self, peer: str, blob: bytes) -> str | None:
        """The NIXL alias already holding exactly these bytes for ``peer`` (:mod:`._parking`)."""
        rem = self._remotes.get(peer)
        return rem.nixl if rem is not None and rem.key == blob else self._parked.alias_for(peer, blob)

    def remove_remote(self, peer: str) -> None:
        """Disconnect; NIXL invalidates every list prepared for the peer, so we release ours.
        The load itself is parked under its own alias (unreachable: no list can name it) for
        a re-add of the same bytes; a different blob for the name unloads it."""
        rem = self._remotes.pop(peer, None)
        if rem is None:
            return
        self._release_lists(rem)
        for name, alias in self._parked.park(peer, rem.key, rem.nixl):
            self._unload(name, alias)

    def _release_lists(self, rem: Remote) -> None:
        for p in list(self._prepared):
            if p.peer == rem.name and p.epoch == rem.epoch:
                self.release_prepared(p)

    def _unload(self, peer: str, alias: str) -> None:
        with self._lock:
            try:
                self._agent.remove_remote_agent(alias)
            except nb.nixlNotFoundError:
                pass
            except Exception as exc:
                raise map_error(exc, "removing peer", peer) from exc

    # -- descriptor lists ----------------------------------------------------------------
    def prepare(self, peer: str | None, descs: DescriptorList) -> Prepared:
        """``prep_xfer_dlist`` once, after checking the list against registered memory.

        Local lists must lie in our registrations, a peer's lists in what its blob says it
        registered: :class:`~kvxfer.errors.OutOfRegistrationError` otherwise. N x 5 strided
        rows go to NIXL as they are (much cheaper to prepare than expanded rows).
        """
        self._check_open()
        if descs.kind not in (MemoryKind.DRAM, MemoryKind.VRAM):
            raise UnsupportedError(f"NIXL backend cannot move {descs.kind} memory")
        rem = None
        if peer is None:
            target, epoch = _LOCAL_AGENT, 0
            self._memory.check(extents(descs), descs.kind, f"local list of {self.agent_name!r}")
        else:
            rem = self._remotes.get(peer)
            if rem is None:
                raise UnknownPeerError(f"NIXL backend of {self.agent_name!r} has no peer {peer!r}; add it first")
            if rem.stale:
                raise StalePeerError(rem.stale)
            rem.memory.check(extents(descs), descs.kind, f"list for peer {peer!r}")
            target, epoch = rem.nixl, rem.epoch
        p = Prepared(None, peer, epoch, descs)
        if len(descs):
            with self._lock:
                try:
                    p.nixl = self._agent.prep_xfer_dlist(target, descs.array, descs.kind.value)
                except Exception as exc:
                    raise map_error(exc, f"preparing {len(descs)} {descs.kind.value} descriptors", peer) from exc
        self._prepared.add(p)
        return p

    def release_prepared(self, prepared: Any) -> None:
        if not isinstance(prepared, Prepared):
            return
        with self._lock:
            h, prepared.nixl = prepared.nixl, None
            self._prepared.discard(prepared)
            if h is None or self._closed:
                return
            try:
                self._agent.release_dlist_handle(h)
            except Exception:
                pass  # a list NIXL already dropped (peer removed) is gone either way

    # -- transfers: PathBackend's loop over NixlPath; these are its hooks ------------------
    def route(self, op: Op, local: Any, remote: Any) -> tuple[DataPath, str, Remote]:
        """Check the lists are current; a READ that needs the fence takes the fenced row."""
        if self._closed:  # checks inlined: a small READ's post is the hot path (issue 37)
            self._check_open()
        if not isinstance(local, Prepared) or not isinstance(remote, Prepared):
            raise BackendError("post() needs lists returned by this backend's prepare()")
        if local.peer is not None:
            raise BackendError("the local list was prepared for a peer; prepare it with peer=None")
        if local.gone:
            raise OutOfRegistrationError(local.gone)
        rem = self._remotes.get(remote.peer or "")
        if rem is None or rem.epoch != remote.epoch:
            raise StalePeerError(f"the remote list was prepared for {remote.peer!r}, which was removed or re-added "
                                 "since; prepare it again")
        if rem.stale:
            raise StalePeerError(rem.stale)
        if rem.fence and op is Op.READ and local.descs.kind is MemoryKind.DRAM:
            return self._fenced, rem.name, rem
        return self._nixl_path, rem.name, rem

    def landed(self, x: Post) -> None:
        """Refuse DONE for a peer known to have deregistered; a sent notification still needs progress."""
        now = time.monotonic()
        if now - self._collected > _COLLECT_EVERY:
            try:
                self._collect()  # a deregistration notice may have come in with the data
            except KvxferError:
                pass  # reported by the next progress(); the transfer itself completed
        rem: Remote = x.tag
        if rem.stale:
            raise StalePeerError(f"transfer with {rem.name!r} may have moved stale bytes: {rem.stale}")
        if x.h.notification:
            self._flush_soon()  # NIXL sent it after the data; it may still wait in the worker for progress

    # -- progress (notifications: kvxfer_nixl._notify) ---------------------------------
    def progress(self) -> None:
        """Drive NIXL once (reading notifications drives the UCX worker) and retry releases."""
        if self._closed:
            return
        self._collect()
        self.waiting()
        self._nixl_path.reap()

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the notify thread, drop peers and registrations, destroy the NIXL agent."""
        if self._closed:
            return
        super().close()  # PathBackend's: stops the notify thread
        if self._keeper is not None:
            self._keeper.stop()
        for peer in list(self._remotes):
            with contextlib.suppress(KvxferError):
                self.remove_remote(peer)
        for peer, alias in self._parked.drain():
            with contextlib.suppress(KvxferError):
                self._unload(peer, alias)
        for p in list(self._prepared):
            self.release_prepared(p)
        self._nixl_path.reap()
        for reg in list(self._registrations):
            with contextlib.suppress(KvxferError):
                self.deregister(reg)
        self._closed = True
        instances.pop(self._id, None)
        peers.process_page().drop(self._id)
        with self._lock:
            self._agent = None  # the C++ agent is destroyed with its last reference
            self._nixl_path.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError(f"NIXL backend of {self.agent_name!r} is closed")
