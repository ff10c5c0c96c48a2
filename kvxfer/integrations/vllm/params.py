"""The transfer parameters a prefill hands its client, and decode's checks on them.

They travel through the client (a router, a proxy, a user script), so decode treats them
as untrusted: every field is type- and range-checked, and the whole set carries an
HMAC-SHA256 tag keyed with the side-channel token. A tampered or corrupted set is refused
before any transfer is planned, and decode recomputes the prompt instead. Without a token
(``insecure``) the tag is keyed with the empty string: it still catches corruption, not
forgery.

The top-level names (``do_remote_prefill``, ``remote_block_ids``...) are the ones vLLM's own
P/D routers already pass along; kvxfer's own fields live under ``"kvxfer"``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from kvxfer.errors import KvxferError

__all__ = ["RemoteKV", "ParamsError", "PARAMS_VERSION", "wants_remote_prefill", "wants_remote_decode"]

PARAMS_VERSION = 1
MAX_BLOCKS = 1 << 20  # a 134M-token prompt at 128 tokens per block: far beyond any context
MAX_ID = 512
MAX_HOST = 255
_LABEL = b"kvxfer-vllm-params"


class ParamsError(KvxferError, ValueError):
    """Transfer parameters are malformed, out of range, or fail authentication."""


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill side: the client asked to keep this request's KV for a decode instance."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Decode side: the client brought KV prepared by a kvxfer prefill."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True and "kvxfer" in params


def _text(name: str, v: Any, limit: int) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= limit or not v.isprintable():
        raise ParamsError(f"{name} must be a printable string of 1..{limit} characters")
    return v


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ParamsError(f"{name} must be an integer in [{lo}, {hi}]")
    return v


@dataclass(frozen=True)
class RemoteKV:
    """Where a finished prefill keeps a request's KV blocks."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    tp_size: int

    def __post_init__(self) -> None:
        _text("remote_engine_id", self.engine_id, MAX_ID)
        _text("remote_host", self.host, MAX_HOST)
        _int("remote_port", self.port, 1, 65535)
        _text("remote_request_id", self.request_id, MAX_ID)
        _int("remote_num_tokens", self.num_tokens, 1, MAX_BLOCKS * (1 << 16))
        _int("remote_tp_size", self.tp_size, 1, 1 << 16)
        ids = self.block_ids
        if not isinstance(ids, tuple) or not 0 < len(ids) <= MAX_BLOCKS:
            raise ParamsError(f"remote_block_ids must hold 1..{MAX_BLOCKS} block ids")
        for b in ids:
            _int("remote_block_ids[i]", b, 0, (1 << 31) - 1)

    def _signed_bytes(self) -> bytes:
        fields = [PARAMS_VERSION, self.engine_id, self.host, self.port, self.request_id, list(self.block_ids),
                  self.num_tokens, self.tp_size]
        return _LABEL + json.dumps(fields, separators=(",", ":")).encode()

    def tag(self, token: bytes | None) -> str:
        return hmac.new(token or b"", self._signed_bytes(), hashlib.sha256).hexdigest()

    def to_params(self, token: bytes | None) -> dict[str, Any]:
        """The dict returned to the client: JSON types only."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "remote_tp_size": self.tp_size,
            "kvxfer": {"v": PARAMS_VERSION, "tag": self.tag(token)},
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any], token: bytes | None, block_size: int) -> "RemoteKV":
        """Validate what a client brought; raises :class:`ParamsError` on any doubt."""
        if not wants_remote_prefill(params):
            raise ParamsError("not kvxfer transfer parameters (need do_remote_prefill and a 'kvxfer' entry)")
        ours = params["kvxfer"]
        if not isinstance(ours, Mapping) or ours.get("v") != PARAMS_VERSION:
            raise ParamsError(f"unsupported kvxfer params version (this connector speaks {PARAMS_VERSION})")
        tag = ours.get("tag")
        if not isinstance(tag, str) or len(tag) != 64:
            raise ParamsError("kvxfer params carry no valid tag")
        try:
            ids = params["remote_block_ids"]
            if not isinstance(ids, (list, tuple)) or len(ids) > MAX_BLOCKS:
                raise ParamsError(f"remote_block_ids must be a list of at most {MAX_BLOCKS} ids")
            remote = cls(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                         params["remote_request_id"], tuple(ids), params["remote_num_tokens"],
                         params["remote_tp_size"])
        except KeyError as exc:
            raise ParamsError(f"kvxfer params lack {exc.args[0]!r}") from None
        if not hmac.compare_digest(tag, remote.tag(token)):
            raise ParamsError("kvxfer params fail authentication: altered in transit, or prefill and decode "
                              "hold different tokens")
        need = math.ceil(remote.num_tokens / block_size)
        if len(remote.block_ids) != need:
            raise ParamsError(f"{remote.num_tokens} tokens need {need} blocks of {block_size}, "
                              f"params list {len(remote.block_ids)}")
        return remote
