"""What ties a set of transfer parameters to one request: its prompt, and its id on the wire.

Prompt: the params name blocks, and blocks hold the KV of some prompt. Without the prompt in
the signed set, a client could send prompt B to a decode with the params issued for prompt A:
the load would pass every other check (the digests are A's and match), vLLM would cache A's
KV under B's block hashes, and a store would offload it under B's prefix keys, so later
requests of any user sharing B's prefix would be served A's KV. The prefill therefore signs
:func:`prompt_digest` of the tokens whose KV the blocks hold, and the decode recomputes it
from its own request before any byte moves.

Request id: vLLM takes request ids from clients (``X-Request-Id``, ``request_id``) and
appends a few characters of its own; the params and the decode's release notification carry
one, so it must be short and printable. :func:`wire_id` gives any id a form kvxfer can carry,
deterministically, so that the prefill's worker maps a notification back to vLLM's id.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from .params import MAX_ID

__all__ = ["prompt_digest", "bound_tokens", "request_digest", "wire_id"]

_LABEL = b"kvxfer-vllm-prompt-v1\0"
_HASHED = "kvxfer-sha256:"


def bound_tokens(num_tokens: int, prompt_tokens: int) -> int:
    """How many prompt tokens a set binds: the decode loads at most its prompt's tokens."""
    return max(0, min(int(num_tokens), int(prompt_tokens)))


def prompt_digest(token_ids: Any, n: int, salt: str | None = None, extra: Any = None) -> str:
    """SHA-256 over the first ``n`` token ids (little-endian int64, as the store's prefix keys
    are made), their count, the cache salt and ``extra`` (what else names the KV: LoRA,
    multimodal inputs), as 64 hex digits."""
    ids = np.asarray(list(token_ids[:n]), dtype="<i8")
    head = json.dumps([int(n), salt, extra], separators=(",", ":"), default=str).encode()
    return hashlib.sha256(_LABEL + len(head).to_bytes(8, "little") + head + ids.tobytes()).hexdigest()


def request_digest(request: Any, num_tokens: int) -> str | None:
    """:func:`prompt_digest` of a vLLM request's prompt as the params bind it; None when token
    ids do not name the prompt (prompt embeddings), so such a request is never bound, and a
    decode refuses unbound params."""
    ids = request.prompt_token_ids
    if ids is None:
        return None
    lora = getattr(request, "lora_request", None)
    mm = [str(getattr(f, "identifier", "")) for f in (getattr(request, "mm_features", None) or [])]
    extra = [getattr(lora, "lora_name", None) if lora is not None else None, mm]
    return prompt_digest(ids, bound_tokens(num_tokens, len(ids)), getattr(request, "cache_salt", None), extra)


def wire_id(request_id: Any) -> str:
    """``request_id`` itself when kvxfer can carry it (printable, 1..512 characters), else a
    fixed-length hash of it: never an error, and the same in every process."""
    if isinstance(request_id, str) and 0 < len(request_id) <= MAX_ID and request_id.isprintable() \
            and not request_id.startswith(_HASHED):
        return request_id
    raw = request_id.encode("utf-8", "surrogatepass") if isinstance(request_id, str) else repr(request_id).encode()
    return _HASHED + hashlib.sha256(raw).hexdigest()
