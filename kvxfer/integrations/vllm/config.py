"""The connector's settings, read from ``kv_connector_extra_config`` and checked once.

Unknown keys are refused (a misspelt ``"tokn"`` must not silently turn authentication off),
and the side channel needs either a shared token or an explicit ``"insecure": true``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvxfer.errors import KvxferError
from kvxfer.tokens import check_token

__all__ = ["ConnectorConfig", "ConnectorConfigError"]


class ConnectorConfigError(KvxferError, ValueError):
    """``kv_connector_extra_config`` holds an unknown key or a value of the wrong kind."""


_DEFAULTS: dict[str, Any] = {
    "backend": "nixl",
    "backend_options": {},
    "host": "127.0.0.1",
    "bind_host": None,
    "port": 5720,
    "token": None,
    "token_env": None,
    "insecure": False,
    "transfer_timeout": 30.0,
    "handshake_timeout": 5.0,
    "lease_seconds": 120.0,
    "min_tokens": 1,
    "digests": True,
    "store_path": None,
    "store_capacity": 1 << 30,
    "tier": None,
}
#: The keys of ``tier`` (the cluster tier, kvxfer.tiers.MooncakeTier) and their kinds.
_TIER_KEYS: dict[str, type | tuple[type, ...]] = {"type": str, "master": str, "hostname": str, "segment": int,
                                                   "buffer": int, "namespace": str, "timeout": (int, float)}


def _want(key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) and kind is not bool:
        raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be {kind}, got a bool")
    if not isinstance(value, kind):
        raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}] must be "
                                   f"{getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated settings. ``token`` is the resolved secret (from ``token`` or ``token_env``)."""

    backend: str = "nixl"
    backend_options: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    bind_host: str = "127.0.0.1"
    port: int = 5720
    token: bytes | None = field(default=None, repr=False)  # a secret: never in a repr or a message
    insecure: bool = False
    transfer_timeout: float = 30.0
    handshake_timeout: float = 5.0
    lease_seconds: float = 120.0
    min_tokens: int = 1
    #: Prefill: put row digests in the params (where it can); decode: verify them (docs/integrity.md).
    digests: bool = True
    #: Serve prompt prefixes from a kvxfer.Store in this directory (None: off); its slots' bytes.
    store_path: str | None = None
    store_capacity: int = 1 << 30
    #: Serve prompt prefixes from the cluster tier instead (None: off): the checked ``tier``
    #: settings, ``type`` "mooncake", ``master`` (host:port), optional ``hostname`` (this host's
    #: address as other clients reach it), ``segment`` and ``buffer`` (bytes), ``namespace``,
    #: ``timeout`` (seconds; also bounds each scheduler lookup).
    tier: dict[str, Any] | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> "ConnectorConfig":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_DEFAULTS))
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config keys {unknown}; "
                                       f"known: {sorted(_DEFAULTS)}")
        v = {**_DEFAULTS, **extra}
        env = os.environ if env is None else env
        backend = _want("backend", v["backend"], str)
        options = dict(_want("backend_options", v["backend_options"], dict))
        host = _want("host", v["host"], str)
        bind_host = host if v["bind_host"] is None else _want("bind_host", v["bind_host"], str)
        port = _want("port", v["port"], int)
        if not 1 <= port <= 65535:
            raise ConnectorConfigError(f"kv_connector_extra_config['port']={port} is not a TCP port")
        token = _resolve_token(v["token"], v["token_env"], env)
        insecure = _want("insecure", v["insecure"], bool)
        if token is None and not insecure:
            raise ConnectorConfigError(
                "the kvxfer side channel needs a shared token: set kv_connector_extra_config "
                "'token_env' to the name of an environment variable holding it (or 'token'), on both "
                "prefill and decode; or set 'insecure': true to run without authentication")
        if token is not None and insecure:
            raise ConnectorConfigError("'insecure': true and a token contradict each other; pick one")
        times = {}
        for key in ("transfer_timeout", "handshake_timeout", "lease_seconds"):
            t = float(_want(key, v[key], (int, float)))
            if not 0 < t < 86400:
                raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}]={t} must be in (0, 86400) seconds")
            times[key] = t
        if times["lease_seconds"] < 2 * (times["transfer_timeout"] + times["handshake_timeout"]):
            # Prefill frees (and may reuse) blocks when the lease ends: a decode still reading
            # them then would load another request's KV. Keep the lease well above a load's
            # longest life on the decode side.
            raise ConnectorConfigError(
                f"lease_seconds={times['lease_seconds']:g} must be at least twice transfer_timeout + "
                f"handshake_timeout ({times['transfer_timeout']:g} + {times['handshake_timeout']:g})")
        min_tokens = _want("min_tokens", v["min_tokens"], int)
        if min_tokens < 1:
            raise ConnectorConfigError("kv_connector_extra_config['min_tokens'] must be >= 1")
        digests = _want("digests", v["digests"], bool)
        store_path = None if v["store_path"] is None else _want("store_path", v["store_path"], str)
        if store_path == "":
            raise ConnectorConfigError("kv_connector_extra_config['store_path'] is empty")
        capacity = _want("store_capacity", v["store_capacity"], int)
        if capacity <= 0:
            raise ConnectorConfigError("kv_connector_extra_config['store_capacity'] must be a positive number of bytes")
        tier = _tier(v["tier"])
        if tier is not None and store_path is not None:
            raise ConnectorConfigError("set either 'store_path' (a local kvxfer.Store) or 'tier' (the cluster tier), "
                                       "not both")
        return cls(backend, options, host, bind_host, port, token, insecure, times["transfer_timeout"],
                   times["handshake_timeout"], times["lease_seconds"], min_tokens, digests, store_path, capacity, tier)

    def rank_port(self, rank: int) -> int:
        """Each worker rank serves its own metadata on ``port + rank``."""
        p = self.port + int(rank)
        if p > 65535:
            raise ConnectorConfigError(f"side-channel port {self.port} + rank {rank} exceeds 65535")
        return p


def _tier(raw: Any) -> dict[str, Any] | None:
    """The ``tier`` settings, checked here so that a bad one stops the engine at start, not at
    its first request (the tier's own checks repeat these when it is created)."""
    if raw is None:
        return None
    tier = dict(_want("tier", raw, dict))
    unknown = sorted(map(str, set(tier) - set(_TIER_KEYS)))
    if unknown:
        raise ConnectorConfigError(f"unknown kv_connector_extra_config['tier'] keys {str(unknown)[:200]}; "
                                   f"known: {sorted(_TIER_KEYS)}")
    for k, v in tier.items():
        _want(f"tier.{k}", v, _TIER_KEYS[k])
    if tier.get("type") != "mooncake":
        raise ConnectorConfigError("kv_connector_extra_config['tier']['type'] must be \"mooncake\" (the only cluster tier)")
    if "master" not in tier:
        raise ConnectorConfigError("kv_connector_extra_config['tier'] needs 'master': the Mooncake master's host:port")
    from kvxfer.tiers import parse_master  # kvxfer's own checks: no Mooncake code is loaded

    try:
        parse_master(tier["master"])
    except KvxferError as exc:
        raise ConnectorConfigError(f"kv_connector_extra_config['tier']['master']: {exc}") from None
    if not 0 < len(tier.get("hostname", "h")) <= 255:
        raise ConnectorConfigError("kv_connector_extra_config['tier']['hostname'] must be 1 to 255 characters")
    for k in ("segment", "buffer"):
        if tier.get(k, 0) < 0:
            raise ConnectorConfigError(f"kv_connector_extra_config['tier'][{k!r}] must be a number of bytes >= 0")
    if "timeout" in tier and not 0 < float(tier["timeout"]) < 86400:
        raise ConnectorConfigError("kv_connector_extra_config['tier']['timeout'] must be in (0, 86400) seconds")
    return tier


def _resolve_token(token: Any, token_env: Any, env: Mapping[str, str]) -> bytes | None:
    if token is not None and token_env is not None:
        raise ConnectorConfigError("set either 'token' or 'token_env', not both")
    if token_env is not None:
        name = _want("token_env", token_env, str)
        value = env.get(name)
        if not value:
            raise ConnectorConfigError(f"'token_env' names {name!r}, which is unset or empty in this process")
        return check_token(value, f"token in ${name}", ConnectorConfigError)
    if token is not None:
        return check_token(_want("token", token, str), "'token'", ConnectorConfigError)
    return None
