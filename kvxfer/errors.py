"""One exception hierarchy for everything kvxfer raises.

Serving engines catch :class:`KvxferError` at the connector boundary and decide whether to
retry, re-handshake or fail the request. Each subclass exists because callers react to it
differently, and each message says what was wrong and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "KvxferError",
    "BackendClosedError",
    "BackendNameConflictError",
    "SpecError",
    "LayoutMismatchError",
    "DtypeMismatchError",
    "PageFormatMismatchError",
    "HeadSliceMismatchError",
    "BlockTokensMismatchError",
    "DuplicateBlockIdError",
    "BlockIdOutOfRangeError",
    "BlockCountMismatchError",
    "MetadataError",
    "MetadataCrashError",
    "IdentityError",
    "ProverUnavailableError",
    "UnknownPeerError",
    "StalePeerError",
    "PeerDisconnectedError",
    "TransferTimeoutError",
    "TransferCancelledError",
    "BackendError",
    "OutOfRegistrationError",
    "DescriptorLimitError",
    "BackendUnavailableError",
    "UnknownBackendError",
    "UnsupportedError",
    "AgentClosedError",
    "HandshakeError",
    "SpecFileError",
    "MissingDependencyError",
    "InvalidTimeoutError",
    "StoreError",
    "StoreMissError",
    "StoreCorruptError",
    "StoreUnavailableError",
    "StoreFullError",
    "StoreBusyError",
    "StorePermissionError",
    "BackPressureError",
    "IntegrityError",
    "InvalidArgumentError",
    "UnknownOptionError",
    "BlockIdTypeError",
    "VerificationError",
]


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class SpecError(KvxferError, ValueError):
    """A geometry object was built with inconsistent values (caught at construction)."""


class LayoutMismatchError(KvxferError):
    """Two specs cannot be paired. ``diff`` lists ``(field, local, remote)`` per difference."""

    def __init__(self, message: str, diff: list[tuple[str, object, object]] | None = None):
        self.diff = list(diff or [])
        if self.diff:
            shown = self.diff[:24]  # the message stays readable; ``diff`` keeps everything
            lines = "\n".join(f"  {f}: local={lv!r} remote={rv!r}" for f, lv, rv in shown)
            more = f"\n  (+{len(self.diff) - len(shown)} more differences)" if len(self.diff) > len(shown) else ""
            message = f"{message}\n{lines}{more}"
        super().__init__(message)


class DtypeMismatchError(LayoutMismatchError):
    """The two sides' pages hold different element types (bf16 against fp16)."""


class PageFormatMismatchError(LayoutMismatchError):
    """The pages order or shape their elements differently (NHD against HND, other extents)."""


class HeadSliceMismatchError(LayoutMismatchError):
    """The two sides hold different KV heads: another tensor-parallel rank's or size's slice."""


class BlockTokensMismatchError(LayoutMismatchError):
    """The two sides put a different number of tokens in one block."""


class BlockIdOutOfRangeError(KvxferError, IndexError):
    """A block id is negative or not below the side's ``num_blocks``."""


class BlockCountMismatchError(KvxferError, ValueError):
    """Local and remote block lists have different lengths."""


class DuplicateBlockIdError(KvxferError, ValueError):
    """A destination block id appears twice in one request: which source would win is undefined."""


class MetadataError(KvxferError, ValueError):
    """Peer metadata is malformed, too large, of an unknown version, or out of bounds.

    Metadata arrives from the network, so this is raised instead of trusting it.
    """


class MetadataCrashError(MetadataError):
    """Peer metadata crashed, or hung, the process that tried it first (:mod:`kvxfer.prove`).

    The bytes never reached native code in this process. The peer's metadata is corrupt or
    hostile; a genuine peer's fresh metadata loads.
    """


class IdentityError(MetadataError):
    """Peer metadata names a process that is not the one that sent it (:mod:`kvxfer.peers`).

    A same-host peer proves which process it is by a secret only that process holds; metadata
    that claims this very process, another process's identity, or memory that process did not
    register, is refused. A genuine peer's fresh metadata loads.
    """


class ProverUnavailableError(KvxferError):
    """Peer metadata could not be proven now, through no fault of its bytes; it was not loaded.

    ``reason`` says which: ``"starved"`` or ``"stopped"`` (the helper was not given the CPU
    time to answer before the caller's deadline), ``"ended"`` (killed from outside, twice),
    ``"start_failed"`` (the helper does not start; it is retried with backoff), ``"busy"``
    (every helper is proving other bytes) or ``"deadline"``. Nothing is remembered against
    the bytes: the same metadata may be tried again.
    """

    def __init__(self, message: str, reason: str = "deadline") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.reason))


class UnknownPeerError(KvxferError, KeyError):
    """A transfer names a peer that was never added (or was removed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StalePeerError(KvxferError):
    """The peer restarted (new generation) or the metadata used is older than the known one."""


class PeerDisconnectedError(KvxferError):
    """The peer went away while a transfer was in flight."""


class TransferTimeoutError(KvxferError, TimeoutError):
    """A transfer did not complete before its deadline; it has been cancelled."""


class TransferCancelledError(KvxferError):
    """The transfer was cancelled by the caller."""


class BackendError(KvxferError):
    """The transport reported a failure that has no more specific kvxfer error."""


class OutOfRegistrationError(BackendError):
    """A descriptor leaves the memory registered for it (a corrupt plan, or a hostile peer)."""


class DescriptorLimitError(BackendError):
    """The process ran out of file descriptors (``open`` of ``limit``), not the peer's fault."""

    def __init__(self, message: str, open_: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.open, self.limit = open_, limit

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.open, self.limit))


class BackendUnavailableError(KvxferError, ImportError):
    """A backend is known but cannot run here; the message carries the install command."""


class UnknownBackendError(KvxferError, LookupError):
    """No installed plugin registers a backend of that name."""


class BackendNameConflictError(UnknownBackendError):
    """Two third-party plugins claim one backend name: neither is used, whatever the load order."""


class UnsupportedError(KvxferError):
    """The backend does not support what was asked (memory kind, op, notifications...)."""


class AgentClosedError(KvxferError):
    """The agent was closed; create a new one."""


class BackendClosedError(AgentClosedError, BackendError):
    """A closed backend was called (every backend raises this one type; its agent is closed too)."""


class HandshakeError(KvxferError):
    """The metadata side channel failed: refused, timed out, oversized or unauthenticated."""


class SpecFileError(SpecError):
    """A spec file cannot be read or describes an impossible geometry; names the file and key."""


class MissingDependencyError(KvxferError, ImportError):
    """An optional feature needs a package that is not installed; the message has the install command."""


class InvalidTimeoutError(KvxferError, ValueError):
    """A timeout that is not a finite, positive number of seconds (NaN, inf, 0 or negative)."""


class StoreError(KvxferError):
    """The KV store (:mod:`kvxfer.store`) cannot do what was asked; the message says why."""


class StoreMissError(StoreError, KeyError):
    """Keys asked for are not in the store (never written, evicted, or dropped as corrupt).

    ``keys`` lists them. A restore that raises this moved no byte.
    """

    def __init__(self, message: str, keys: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.keys))


class StoreCorruptError(StoreMissError):
    """Stored rows failed their digest (a torn write, a flipped byte, a truncated slab).

    The rows were not copied and their entries were dropped: the next lookup is a miss.
    """


class StoreUnavailableError(StoreMissError):
    """A cluster tier's service cannot serve the rows now: its master is unreachable or
    restarting, or the client holding them is gone. A miss for the caller (recompute); the
    message says which, and a later request may succeed."""


class StoreFullError(StoreError, OSError):
    """No room: the file system refused the slab at creation, or every slot is pinned."""


class StoreBusyError(StoreError):
    """Another store object (in this or another process) holds the slab's lock."""


class StorePermissionError(StoreError, PermissionError):
    """The store's directory, or a file in it, is not this user's own or others may write it:
    its rows cannot be trusted. The message says which and what to do."""


class BackPressureError(KvxferError):
    """An :class:`~kvxfer.owner.Owner` already holds as many transfers as it admits (in all,
    or for that peer): nothing was queued. Retry later, or fail the request (recompute).

    ``pending`` is what was held, ``limit`` the bound that refused, ``peer`` the peer whose
    own bound refused (None when the owner's total bound did)."""

    def __init__(self, message: str, *, pending: int = 0, limit: int = 0, peer: str | None = None) -> None:
        super().__init__(message)
        self.pending, self.limit, self.peer = pending, limit, peer


class IntegrityError(KvxferError):
    """Bytes that arrived differ from the source's digests: a corrupt path or stale/reused data.

    ``block`` (the local block id), ``remote_block`` and ``member`` name the first mismatch
    (None where unknown, e.g. for a row digest); ``mismatches`` counts them all. Callers
    recompute the request: the destination blocks hold bytes nobody vouches for.
    """

    def __init__(self, message: str, *, block: int | None = None, remote_block: int | None = None,
                 member: str | None = None, mismatches: int = 0):
        super().__init__(message)
        self.block = block
        self.remote_block = remote_block
        self.member = member
        self.mismatches = mismatches


class InvalidArgumentError(KvxferError, TypeError, ValueError):
    """A public call got an argument of the wrong type or value (``notify="x"``, ``op="COPY"``).

    It is also a ``TypeError`` and a ``ValueError``, so code written against the builtin
    exceptions keeps working; callers that catch :class:`KvxferError` see it too.
    """


class UnknownOptionError(InvalidArgumentError):
    """A backend was given an option it does not take; ``valid`` lists the ones it does."""

    def __init__(self, message: str, valid: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.valid = tuple(valid)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.valid))


class BlockIdTypeError(InvalidArgumentError):
    """Block ids that are not integers (floats, bools, strings): never rounded, always refused."""


class VerificationError(KvxferError):
    """Bytes a transfer delivered are not the source's, or bytes outside it changed (demo, bench)."""
