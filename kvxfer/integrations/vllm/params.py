"""The transfer parameters a prefill hands its client, and decode's checks on them.

They travel through the client (a router, a proxy, a user script), so decode treats them
as untrusted: every field is type- and range-checked, and the whole set carries an
HMAC-SHA256 tag keyed with the side-channel token. A tampered or corrupted set is refused
before any transfer is planned, and decode recomputes the prompt instead. Without a token
(``insecure``) the tag is keyed with the empty string: it still catches corruption, not
forgery.

The top-level names (``do_remote_prefill``, ``remote_block_ids``...) are the ones vLLM's own
P/D routers already pass along; kvxfer's own fields live under ``"kvxfer"``.

Replay (docs/integrity.md): the signed set carries a one-time ``nonce`` (decode refuses a
second use), an expiry ``exp`` that ends before the prefill's lease by more than a load may
take (a load that could start after its lease is refused before it reads), and, where the
prefill can compute them, row digests of the blocks (``dig``): a set replayed at another
decode after the blocks were freed and reused fails verification. Each refusal means recompute.

Prompt (issue 31): the signed set also carries ``p``, a digest of the token ids whose KV the
blocks hold (:mod:`.binding`); decode refuses a set issued for another prompt before any
transfer, so one prompt's KV is never loaded, cached or offloaded as another's.

Order of the checks: first the shape, in constant time (types, string lengths, the number of
block ids against what this decode can hold), then the tag, compared as bytes over the
fields as they arrived, and only then the fields one by one. An unauthenticated set costs
at most one HMAC over a bounded text.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kvxfer.plugin import wire as _wire
from kvxfer.errors import IntegrityError, KvxferError, MetadataError
from kvxfer.tokens import mac

__all__ = ["RemoteKV", "ParamsError", "ParamsExpiredError", "ParamsReplayError", "ParamsPromptError", "NonceBook",
           "PARAMS_VERSION",
           "wants_remote_prefill", "wants_remote_decode", "expiry", "refuse_late", "load_digests", "failure_count"]

log = logging.getLogger("vllm.kvxfer")

PARAMS_VERSION = 3
MAX_DIGEST_TEXT = 8 << 20  # base64 of row digests: 16 bytes per block plus the member list
MAX_BLOCKS = 1 << 20  # a 134M-token prompt at 128 tokens per block: far beyond any context
MAX_ID = 512
MAX_HOST = 255


class ParamsError(KvxferError, ValueError):
    """Transfer parameters are malformed, out of range, or fail authentication."""


class ParamsExpiredError(ParamsError):
    """The parameters' expiry has passed: the prefill's lease may end before a load would."""


class ParamsReplayError(ParamsError):
    """These parameters (their nonce) were already used at this decode."""


class ParamsPromptError(ParamsError):
    """These parameters were issued for another prompt (their ``p`` is not this request's)."""


def _new_nonce() -> str:
    return secrets.token_hex(16)


def _default_expiry() -> float:
    return time.time() + 60.0


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill side: the client asked to keep this request's KV for a decode instance."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Decode side: the client brought KV prepared by a kvxfer prefill."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True and "kvxfer" in params


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
    nonce: str = field(default_factory=_new_nonce)
    expires: float = field(default_factory=_default_expiry)  # wall-clock seconds (time.time())
    digests: str | None = None  # per TP rank, kvxfer.integrity.Digests (rows) of block_ids as text, ","-joined
    prompt: str | None = None  # binding.prompt_digest of the tokens whose KV the blocks hold (None: unbound)

    def __post_init__(self) -> None:
        _wire.text(self.engine_id, "remote_engine_id", MAX_ID, ParamsError)
        _wire.text(self.host, "remote_host", MAX_HOST, ParamsError)
        _wire.integer(self.port, "remote_port", 1, 65535, ParamsError)
        _wire.text(self.request_id, "remote_request_id", MAX_ID, ParamsError)
        _wire.integer(self.num_tokens, "remote_num_tokens", 1, MAX_BLOCKS * (1 << 16), ParamsError)
        _wire.integer(self.tp_size, "remote_tp_size", 1, 1 << 16, ParamsError)
        ids = self.block_ids
        if not isinstance(ids, tuple) or not 0 < len(ids) <= MAX_BLOCKS:
            raise ParamsError(f"remote_block_ids must hold 1..{MAX_BLOCKS} block ids")
        for b in ids:
            _wire.integer(b, "remote_block_ids[i]", 0, (1 << 31) - 1, ParamsError)
        n = self.nonce
        if not isinstance(n, str) or not 16 <= len(n) <= 64 or any(c not in "0123456789abcdef" for c in n):
            raise ParamsError("kvxfer nonce must be 16..64 lowercase hex digits")
        if isinstance(self.expires, bool) or not isinstance(self.expires, (int, float)) \
                or not 0 < self.expires < 1e11:
            raise ParamsError("kvxfer expiry must be a positive wall-clock time in seconds")
        if self.digests is not None and (not isinstance(self.digests, str) or len(self.digests) > MAX_DIGEST_TEXT):
            raise ParamsError(f"kvxfer digests must be a string of at most {MAX_DIGEST_TEXT} characters")
        p = self.prompt
        if p is not None and (not isinstance(p, str) or len(p) != 64 or any(c not in _HEX for c in p)):
            raise ParamsError("kvxfer prompt digest must be 64 lowercase hex digits")

    def tag(self, token: bytes | None) -> str:
        return _tag(self._unsigned(), token).decode()

    def to_params(self, token: bytes | None) -> dict[str, Any]:
        """The dict returned to the client: JSON types only."""
        out = self._unsigned()
        out["kvxfer"]["tag"] = _tag(out, token).decode()
        return out

    def _unsigned(self) -> dict[str, Any]:
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
            "kvxfer": {"v": PARAMS_VERSION, "nonce": self.nonce, "exp": float(self.expires), "dig": self.digests,
                       "p": self.prompt},
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any], token: bytes | None, block_size: int,
                    max_blocks: int = MAX_BLOCKS) -> "RemoteKV":
        """Validate what a client brought; raises :class:`ParamsError` on any doubt.

        ``max_blocks``: the most blocks this decode could load for one request (its model
        length); a longer list is refused before the tag is computed.
        """
        if not wants_remote_prefill(params):
            raise ParamsError("not kvxfer transfer parameters (need do_remote_prefill and a 'kvxfer' entry)")
        ours = params["kvxfer"]
        if not isinstance(ours, Mapping) or ours.get("v") != PARAMS_VERSION:
            raise ParamsError(f"unsupported kvxfer params version (this connector speaks {PARAMS_VERSION})")
        tag = ours.get("tag")
        # Only ASCII hex reaches compare_digest, and as bytes: a str of other characters raises there.
        if not isinstance(tag, str) or len(tag) != 64 or any(c not in _HEX for c in tag):
            raise ParamsError("kvxfer params carry no valid tag")
        fields = _shape(params, ours, min(max_blocks, MAX_BLOCKS))
        if not hmac.compare_digest(tag.encode("ascii"), _signature(fields, token)):
            raise ParamsError("kvxfer params fail authentication: altered in transit, or prefill and decode "
                              "hold different tokens")
        remote = cls(*fields[1:5], tuple(fields[5]), *fields[6:])
        need = math.ceil(remote.num_tokens / block_size)
        if len(remote.block_ids) != need:
            raise ParamsError(f"{remote.num_tokens} tokens need {need} blocks of {block_size}, "
                              f"params list {len(remote.block_ids)}")
        if remote.digests is not None:
            if remote.digests.count(",") != remote.tp_size - 1:
                raise ParamsError(f"kvxfer digests must hold one set per prefill rank ({remote.tp_size})")
            for rank in range(remote.tp_size):
                parts = remote.parsed_digests(rank)
                if [b for d in parts for b in d.blocks.tolist()] != list(remote.block_ids) \
                        or not all(d.row for d in parts):
                    raise ParamsError("kvxfer digests do not cover the parameters' blocks")
        return remote

    def parsed_digests(self, rank: int = 0) -> Any:
        """Rank ``rank``'s carried :class:`kvxfer.integrity.Digests` (full blocks, then a partly
        filled last block), or None; malformed ones are a ParamsError."""
        if self.digests is None:
            return None
        from kvxfer.integrity import Digests

        ranks = self.digests.split(",")
        if not 0 <= rank < len(ranks):
            raise ParamsError(f"kvxfer digests hold no set for rank {rank}")
        parts = ranks[rank].split(";")
        if len(parts) != 2:
            raise ParamsError("kvxfer digests must be '<full blocks>;<last block>' per rank")
        try:
            return [Digests.from_text(p) for p in parts if p]
        except MetadataError as exc:
            raise ParamsError(f"kvxfer digests are malformed: {exc}") from None


_HEX = frozenset("0123456789abcdef")
#: The signed fields, in signing order: top-level names, then kvxfer's own under "kvxfer".
_TOP = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
        "remote_num_tokens", "remote_tp_size")
_OURS = ("nonce", "exp", "dig", "p")
_SCALARS = (str, int, float, type(None))


def _shape(params: Mapping[str, Any], ours: Mapping[str, Any], max_blocks: int) -> list[Any]:
    """The signed fields as they arrived, once each is seen to be small: constant time per field
    (no look inside the block-id list), so what the tag is computed over is bounded."""
    try:
        fields = [PARAMS_VERSION, *(params[k] for k in _TOP), *(ours[k] for k in _OURS)]
    except KeyError as exc:
        raise ParamsError(f"kvxfer params lack {exc.args[0]!r}") from None
    ids = fields[5]
    if not isinstance(ids, (list, tuple)) or not 0 < len(ids) <= max_blocks:
        raise ParamsError(f"remote_block_ids must be a list of 1..{max_blocks} ids")
    for i, v in enumerate(fields):
        if i == 5:
            continue
        if not isinstance(v, _SCALARS) or (isinstance(v, str) and len(v) > (MAX_DIGEST_TEXT if i == 10 else MAX_ID)):
            raise ParamsError("kvxfer params hold a field of the wrong kind or length")
    return fields


def _signature(fields: list[Any], token: bytes | None) -> bytes:
    """HMAC-SHA256 (hex, as bytes) over the fields' canonical JSON; anything JSON cannot write
    canonically (NaN, other objects in the id list) cannot be signed, so it is refused."""
    try:
        text = json.dumps(fields, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ParamsError("kvxfer params hold values that cannot be authenticated") from None
    return mac(token or b"", "vllm-params", text.encode()).hex().encode()


def _tag(params: Mapping[str, Any], token: bytes | None) -> bytes:
    return _signature([PARAMS_VERSION, *(params[k] for k in _TOP), *(params["kvxfer"][k] for k in _OURS)], token)


def expiry(now: float, lease_seconds: float, transfer_timeout: float, handshake_timeout: float) -> float:
    """When a decode must stop starting loads: the lease minus the longest a load may take.

    The prefill's lease starts when its worker learns of the send, after this is computed, so
    a load that starts by the expiry ends before the lease does (the config keeps the lease
    at least twice that long).
    """
    return now + lease_seconds - (transfer_timeout + handshake_timeout)


class NonceBook:
    """Decode: nonces seen, each kept until its parameters expire (they are refused after)."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def claim(self, remote: RemoteKV, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if remote.expires <= now:
            raise ParamsExpiredError(f"kvxfer params expired {now - remote.expires:.3g} s ago")
        if remote.nonce in self._seen:
            raise ParamsReplayError("kvxfer params were already used at this decode (nonce seen); refused")
        if len(self._seen) > 4096:
            self._seen = {n: e for n, e in self._seen.items() if e > now}
        self._seen[remote.nonce] = remote.expires

    def __len__(self) -> int:
        return len(self._seen)


def refuse_late(remote: RemoteKV, now: float | None = None) -> None:
    """Worker, right before it reads: past the expiry the prefill may have reused the blocks."""
    now = time.time() if now is None else now
    if now >= remote.expires:
        raise ParamsExpiredError(f"load would start {now - remote.expires:.3g} s after its parameters expired; "
                                 "the prefill's lease may be over, so nothing was read")


def load_digests(remote: RemoteKV, remote_ids: Sequence[int], rank: int = 0) -> Any:
    """Rank ``rank``'s digests of the blocks one load reads (a slice of the request's), or None."""
    parts = remote.parsed_digests(rank)
    if parts is None:
        return None
    want = set(remote_ids)
    out = []
    for d in parts:
        pos = [i for i, b in enumerate(d.blocks.tolist()) if b in want]
        if pos:
            out.append(d.take(pos))
    return out


def failure_count(exc: BaseException) -> str | None:
    """The counter a failed load adds to, beside ``failed_loads``."""
    if isinstance(exc, IntegrityError):
        return "integrity_failures"
    if isinstance(exc, ParamsExpiredError):
        return "expired_params"
    return None
