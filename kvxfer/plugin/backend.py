"""The backend seam: what a transport implements, and nothing more.

A backend registers allocations and moves descriptor lists. It never sees blocks, layers or
members; validation, bounds, deadlines, cancellation, coalescing and whole-row packing live
in the core, so a new transport stays small and every transport behaves the same. The call
order, what the core guarantees and what a backend promises are written down in
``docs/design.md`` (section "The seam"); the conformance suite in :mod:`kvxfer.testing`
checks each promise.

**The fence.** A transfer's end is final: once :meth:`Backend.poll` has returned True or
raised, or :meth:`Backend.release` has returned, nothing more may land in the transfer's
destination, whatever the peer does next (it may be stopped and resume, or answer late): the
engine reuses those blocks at once. A transport that cannot recall a request in flight must
make sure of it before it reports: wait for the request to settle, tear down the endpoint (and
its worker, if the worker could still complete the request), or let the transfer land in a
private buffer copied to the destination only once it is DONE. The kit's
``test_stopped_peer_writes_nothing_after_the_end`` checks it (docs/design.md, section 7).
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import UnknownOptionError
from ..memory import Allocation, DescriptorList, MemoryKind, Op

__all__ = ["Backend", "Capabilities", "Option", "backend_options", "check_options", "undocumented_options"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the core adapts to it instead of asking at run time.

    ``merges_runs``: the backend merges consecutive contiguous descriptors itself, so the
    planner does not coalesce. ``cheap_prepare``: preparing a list costs about as much as
    storing it, so the core may prepare a fresh (coalesced) list per transfer.
    ``max_descriptors``: the most descriptors one post takes (the core splits larger
    plans). ``cross_process``: peers may live in other processes or hosts. ``fence``: once a
    transfer has reported its end, nothing more lands in its destination, even from a peer that
    stopped mid-transfer and resumes (docs/design.md, promise 5). A backend whose transport can
    outlive its end says False, and the conformance kit skips the stopped-peer case with that reason.
    """

    memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.DRAM})
    ops: frozenset[Op] = frozenset({Op.READ, Op.WRITE})
    notifications: bool = True
    strided_lists: bool = False
    merges_runs: bool = False
    cheap_prepare: bool = True
    max_descriptors: int | None = None
    needs_progress: bool = False
    cross_process: bool = True
    fence: bool = True


class Backend(abc.ABC):
    """Base class for transports. Subclasses set ``name`` and ``capabilities``."""

    name: str = "abstract"
    capabilities: Capabilities = Capabilities()
    #: Set by the core before the first :meth:`add_remote`: True when every blob this
    #: backend is given has passed the agent token's HMAC check, so it comes from a token
    #: holder; False for metadata nobody authenticated (``token=NO_AUTH``, or a backend
    #: used without an agent). A backend may spend less care on authenticated blobs (NIXL
    #: proves only unauthenticated ones); it must never spend more trust on unauthenticated.
    peers_authenticated: bool = False

    def __init__(self, agent_name: str, /, **options: Any) -> None:
        """Subclasses take their options keyword-only: ``def __init__(self, agent_name, *, opt=...)``.

        Options a subclass passes on to here were not recognised by anyone: refused.
        """
        check_options(type(self), options, strict=True)
        self.agent_name = agent_name

    # memory
    @abc.abstractmethod
    def register(self, allocations: Sequence[Allocation]) -> Any:
        """Register memory once; returns an opaque handle for :meth:`deregister`."""

    @abc.abstractmethod
    def deregister(self, handle: Any) -> None: ...

    # peers
    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque connection blob a peer passes to :meth:`add_remote`."""

    @abc.abstractmethod
    def add_remote(self, peer_name: str, blob: bytes) -> None:
        """Connect to a peer; every later call names it by ``peer_name``."""

    @abc.abstractmethod
    def remove_remote(self, peer: str) -> None: ...

    # descriptor lists
    @abc.abstractmethod
    def prepare(self, peer: str | None, descs: DescriptorList) -> Any:
        """Prepare a list of local (``peer is None``) or the peer's memory for indexing."""

    def release_prepared(self, prepared: Any) -> None:
        """Free a prepared list. Default: nothing to free."""

    # transfers
    @abc.abstractmethod
    def post(self, op: Op, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             notification: bytes | None) -> Any:
        """Start moving ``local[local_idx[i]] <-> remote[remote_idx[i]]``; returns a handle."""

    @abc.abstractmethod
    def poll(self, xfer: Any) -> bool:
        """True when done; False while pending; raises a :class:`~kvxfer.KvxferError` on failure.
        True means every byte is there; True or an error means nothing more will land (the fence)."""

    @abc.abstractmethod
    def release(self, xfer: Any) -> None:
        """Forget a transfer; if still pending, abort it (this is how the core cancels). Once it
        returns nothing more lands in the destination, whether or not the transport could recall
        the request (the fence, above); it returns in bounded time even if the peer is stopped."""

    def wait(self, xfer: Any, deadline: float) -> bool | None:
        """Optional: block until ``xfer`` is done or ``deadline`` (a monotonic reading, the core's
        :class:`~kvxfer.deadlines.Deadline`) passes, for a transport that can block on its own
        completion (a CUDA event) where the core's polls with naps would cost more than the copy.
        True: it ended (the next :meth:`poll` says how); False: the deadline passed (the core then
        releases it, and the fence holds); None: this one cannot be waited on, poll it. The core
        calls it from :meth:`kvxfer.Transfer.wait` only if a backend overrides it."""
        return None

    def data_path(self, xfer: Any) -> str | None:
        """Which data path carries a posted transfer (reported in ``TransferStats.path``). May be
        asked after the transfer was released: the hot path asks only when the stats are read."""
        return None

    # files (optional)
    def file_path(self) -> Any:
        """Optional: a :class:`kvxfer.plugin.files.FilePath` serving the store's file I/O
        over this backend's registered memory, or None (the store then uses ``preadv``)."""
        return None

    # notifications
    @abc.abstractmethod
    def notify(self, peer: str, message: bytes) -> None: ...

    @abc.abstractmethod
    def drain_notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, keyed by peer agent name."""

    def progress(self) -> None:
        """Drive the transport once, for backends that need someone to (``needs_progress``)."""

    def stall_hint(self, peer: str | None) -> str | None:
        """Optional: what to check when a transfer with ``peer`` did not finish in time, for
        causes only the transport knows (a peer that must drive progress); the core appends
        it to :class:`~kvxfer.errors.TransferTimeoutError`. None: the core's generic advice."""
        return None

    def telemetry(self, xfer: Any) -> Mapping[str, Any] | None:
        """Optional: what the transport measured for a finished post, before it is released.

        Called only if a backend overrides it. Return JSON-friendly values (``path``, the
        data path taken; times in seconds; byte and descriptor counts); they land in
        :attr:`kvxfer.TransferStats.telemetry` and reach observers.
        """
        return None

    @abc.abstractmethod
    def close(self) -> None: ...


def backend_options(cls: type[Backend]) -> tuple[tuple[str, ...], bool]:
    """The options ``cls(agent_name, **options)`` names, and whether it also takes ``**kwargs``."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, agent_name
    except (TypeError, ValueError):
        return (), True
    named = tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


@dataclass(frozen=True)
class Option:
    """One row of a backend's option table: what ``kvxfer backends --options NAME`` prints and
    docs/backends.md shows. A plugin passes its rows to ``register(..., options=...)``; they are
    plain data, so the table is shown where the transport library is not installed."""

    name: str
    default: str  # as a user writes it: ``True``, ``"auto"``, ``("UCX",)``
    effect: str
    when: str  # when to change it


def undocumented_options(cls: type[Backend], documented: Sequence[Option]) -> list[str]:
    """Options ``cls`` accepts that ``documented`` does not list, and rows naming none it accepts."""
    named, _ = backend_options(cls)
    rows = {o.name for o in documented}
    return sorted(set(named) - rows) + [f"{r} (listed, not accepted)" for r in sorted(rows - set(named))]


def check_options(cls: type[Backend], options: Mapping[str, Any], *, strict: bool = False) -> None:
    """Refuse options the backend does not take, naming the ones it does.

    The core calls this before constructing a backend, so every backend (a third party's
    included) refuses a misspelt option the same way. A backend whose ``__init__`` takes
    ``**options`` is trusted to check them itself, or to pass them on to
    :meth:`Backend.__init__`, which refuses any that arrive there (``strict``).
    """
    named, var = backend_options(cls)
    if var and not strict:
        return
    unknown = sorted(set(options) - set(named)) if not strict else sorted(options)
    if unknown:
        valid = ", ".join(named) if named else "none"
        raise UnknownOptionError(f"backend {cls.name!r} has no option {', '.join(map(repr, unknown))}; "
                                 f"its options: {valid}", tuple(named))
