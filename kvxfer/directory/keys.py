"""The directory's key layout, and the checks that keep hostile keys out.

Every worker's metadata lives under one key::

    kvxfer/v1/<cluster>/<role>/tp<T>-pp<P>/<name>

``cluster`` separates deployments that share one store, ``role`` is what the worker does
(``prefill``, ``decode`` or any other lower-case word), ``T``/``P`` are its tensor- and
pipeline-parallel ranks, and ``name`` is the agent name (the same name kvxfer's metadata
carries; it may contain ``/``, so it is everything after the rank). One prefix therefore
lists a whole cluster, a role, or a role at one rank, and a watch on the cluster prefix sees
every arrival, restart and departure.

Keys come back from a shared store that other programs can write, so :func:`parse_key`
accepts only keys of exactly this shape and raises :class:`~kvxfer.errors.MetadataError`
for anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import MetadataError

__all__ = ["ROOT", "KeyParts", "cluster_prefix", "role_prefix", "rank_prefix", "entry_key", "parse_key",
           "check_cluster", "check_role", "check_rank", "prefix_end"]

ROOT = "kvxfer/v1/"
MAX_RANK = 1 << 16
_CLUSTER = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ROLE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_NAME = re.compile(r"[A-Za-z0-9_.:@/+-]{1,128}")  # the agent-name rule of kvxfer.metadata
_RANK = re.compile(r"tp(0|[1-9][0-9]{0,4})-pp(0|[1-9][0-9]{0,4})")


@dataclass(frozen=True)
class KeyParts:
    cluster: str
    role: str
    tp_rank: int
    pp_rank: int
    name: str


def check_cluster(cluster: str) -> str:
    if not isinstance(cluster, str) or not _CLUSTER.fullmatch(cluster):
        raise MetadataError(f"cluster {cluster!r} must match {_CLUSTER.pattern}")
    return cluster


def check_role(role: str) -> str:
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise MetadataError(f"role {role!r} must match {_ROLE.pattern} (for example 'prefill' or 'decode')")
    return role


def check_rank(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_RANK:
        raise MetadataError(f"{what} must be an integer in [0, {MAX_RANK}), got {value!r}")
    return value


def cluster_prefix(cluster: str) -> str:
    return f"{ROOT}{check_cluster(cluster)}/"


def role_prefix(cluster: str, role: str) -> str:
    return f"{cluster_prefix(cluster)}{check_role(role)}/"


def rank_prefix(cluster: str, role: str, tp_rank: int, pp_rank: int) -> str:
    return f"{role_prefix(cluster, role)}tp{check_rank(tp_rank, 'tp_rank')}-pp{check_rank(pp_rank, 'pp_rank')}/"


def entry_key(cluster: str, role: str, tp_rank: int, pp_rank: int, name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise MetadataError(f"agent name {name!r} must match {_NAME.pattern}")
    return rank_prefix(cluster, role, tp_rank, pp_rank) + name


def parse_key(key: str | bytes, cluster: str) -> KeyParts:
    """Split a stored key into its parts; anything not of the documented shape is rejected."""
    if isinstance(key, (bytes, bytearray)):
        try:
            key = bytes(key).decode("utf-8")
        except UnicodeDecodeError:
            raise MetadataError("directory key is not UTF-8") from None
    if not isinstance(key, str):
        raise MetadataError(f"directory key must be text, got {type(key).__name__}")
    prefix = cluster_prefix(cluster)
    if not key.startswith(prefix):
        raise MetadataError(f"key {key[:200]!r} is outside cluster prefix {prefix!r}")
    parts = key[len(prefix):].split("/", 2)
    if len(parts) != 3:
        raise MetadataError(f"key {key[:200]!r} is not <role>/tp<T>-pp<P>/<name>")
    role, rank, name = parts
    m = _RANK.fullmatch(rank)
    if not _ROLE.fullmatch(role) or m is None or not _NAME.fullmatch(name):
        raise MetadataError(f"key {key[:200]!r} is not <role>/tp<T>-pp<P>/<name>")
    tp, pp = int(m.group(1)), int(m.group(2))
    if tp >= MAX_RANK or pp >= MAX_RANK:
        raise MetadataError(f"key {key[:200]!r} has a rank over {MAX_RANK}")
    return KeyParts(cluster, role, tp, pp, name)


def prefix_end(prefix: str) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``range_end``)."""
    b = bytearray(prefix.encode("utf-8"))
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)
