"""Directory records and events, and the directory's errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import KvxferError, MetadataError
from ..metadata import AgentMetadata
from .codec import decode_value
from .keys import parse_key

__all__ = ["Entry", "Event", "EventKind", "DirectoryError", "DirectoryUnavailableError", "NotPublishedError",
           "LeaseLostError", "ResyncNeeded"]


class DirectoryError(KvxferError):
    """The metadata directory refused a request or answered something unusable."""


class DirectoryUnavailableError(DirectoryError, ConnectionError):
    """The directory's store could not be reached, or did not answer before the deadline.

    Transfers with peers already added do not need the store; retry the directory call later.
    """


class NotPublishedError(DirectoryError, LookupError):
    """No live worker is published under that name, role or rank."""

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0]) if self.args else ""


class LeaseLostError(DirectoryError):
    """The store no longer knows our lease (it expired during an outage): publish again."""


class ResyncNeeded(DirectoryError):
    """The store cannot replay changes from the requested revision: list everything again."""


@dataclass(frozen=True)
class Entry:
    """One published worker: where it sits in the cluster, and its agent metadata.

    ``metadata`` is what :meth:`kvxfer.Agent.add_peer` takes; it has been validated already
    (and its signature checked, when the directory has a token).
    """

    key: str
    cluster: str
    role: str
    tp_rank: int
    pp_rank: int
    name: str
    generation: int
    backend: str
    metadata: bytes = field(repr=False)
    revision: int = field(default=0, compare=False)

    @classmethod
    def from_stored(cls, key: str | bytes, value: bytes, cluster: str, token: bytes | None,
                    revision: int = 0) -> "Entry":
        """Build an entry from untrusted store contents; raises ``MetadataError`` on anything off."""
        if isinstance(key, (bytes, bytearray)):
            try:
                key = bytes(key).decode("utf-8")
            except UnicodeDecodeError:
                raise MetadataError("directory key is not UTF-8") from None
        parts = parse_key(key, cluster)
        md, raw = decode_value(key, value, token)
        if md.name != parts.name:
            raise MetadataError(f"key {key!r} holds the metadata of agent {md.name!r}, not {parts.name!r}")
        return cls(key, parts.cluster, parts.role, parts.tp_rank, parts.pp_rank, md.name, md.generation, md.backend,
                   raw, revision)

    def agent_metadata(self) -> AgentMetadata:
        return AgentMetadata.decode(self.metadata)

    def matches(self, role: str | None = None, tp_rank: int | None = None, pp_rank: int | None = None,
                name: str | None = None) -> bool:
        return ((role is None or self.role == role) and (tp_rank is None or self.tp_rank == tp_rank)
                and (pp_rank is None or self.pp_rank == pp_rank) and (name is None or self.name == name))


EventKind = Literal["added", "restarted", "updated", "removed"]


@dataclass(frozen=True)
class Event:
    """A change seen by a watch.

    ``added``: a name appeared; ``restarted``: same key, newer generation (drop what was
    prepared for the old one and add the peer again); ``updated``: same key, other bytes
    without a newer generation; ``removed``: the worker left, or its lease expired (``entry``
    is then the last one known).
    """

    kind: EventKind
    entry: Entry
    previous: Entry | None = None
