"""What the SGLang backend checks before a byte moves: keys, host indices, the host pool's geometry.

SGLang hands the backend page hashes (strings) and host token indices (a tensor). Both come
from SGLang's own bookkeeping, but the backend is the last place before memory is addressed,
so each is bounded and typed here (kvxfer.errors), and the pool's page addresses are derived
once and cross-checked against SGLang's own ``get_page_buffer_meta`` on every call, so a pool
whose layout is not what this module derived is refused rather than read past. No SGLang
import: pure checks over numpy.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvxfer.errors import InvalidArgumentError, UnsupportedError
from kvxfer.geometry import KVCacheSpec, spec_from_pointers

__all__ = ["NAMESPACE", "MAX_KEY", "PoolRows", "store_key", "namespace"]

#: Prefix of every store key this backend writes: SGLang's keys never collide with other adapters'.
NAMESPACE = b"kvxfer-sglang-v1\0"
#: Longest page key accepted (SGLang's are 64 hex digits, with a short suffix for some pools).
MAX_KEY = 256
_KEY = re.compile(r"[A-Za-z0-9_.:-]+")
#: Host pool layouts whose page is one contiguous K blob and one V blob (SGLang's page_first family).
LAYOUTS = ("page_first", "page_first_direct")


def store_key(key: Any) -> bytes:
    """The store key of one SGLang page key, or :class:`InvalidArgumentError` (never a path:
    the store's keys are opaque, and these are refused before they get there)."""
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY or not _KEY.fullmatch(key):
        raise InvalidArgumentError(f"an SGLang page key must be 1 to {MAX_KEY} characters of [A-Za-z0-9_.:-], "
                                   f"got {key!r:.60}")
    return NAMESPACE + key.encode("ascii")


def namespace(config: Any, pool: Any, explicit: str) -> str:
    """What must match for two engines to share rows: model, parallel shape and rank (``tp_rank``
    and ``tp_size`` choose the slab, as vLLM's ranks do), and the page's byte order (layout,
    dtype, heads, page size, layers). Hashed into the slab's ``model=`` string, so it is part
    of the slab's fingerprint: engines that differ get different slabs, never each other's rows."""
    fields = {"namespace": explicit, "layout": pool.layout, "dtype": str(pool.dtype), "page": int(pool.page_size),
              "layers": int(pool.layer_num), "heads": int(pool.head_num), "head_dim": int(pool.head_dim)}
    for f in ("model_name", "tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size", "dp_rank",
              "is_mla_model", "dcp_rank", "dcp_size"):
        fields[f] = getattr(config, f, None)
    return "sglang-hicache:" + hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PoolRows:
    """An MHA host pool in a page_first layout as a kvxfer spec: block ``p`` is host page
    ``p``, a row of two members, its K blob and its V blob (each all layers of the page)."""

    pool: Any
    base: int
    blob: int  # bytes of one K (or V) blob: layers x page tokens x heads x head_dim x itemsize
    pages: int
    spec: KVCacheSpec

    @classmethod
    def of(cls, pool: Any) -> "PoolRows":
        layout = getattr(pool, "layout", None)
        if layout not in LAYOUTS:
            raise UnsupportedError(f"the kvxfer HiCache backend needs --hicache-mem-layout {' or '.join(LAYOUTS)} "
                                   f"(a page is then one K and one V blob), not {layout!r}")
        buf = getattr(pool, "kv_buffer", None)
        if buf is None or not hasattr(buf, "data_ptr") or not buf.is_contiguous() or buf.device.type != "cpu":
            raise UnsupportedError("the host pool's kv_buffer must be one contiguous CPU tensor (an MHA host pool)")
        page = int(pool.page_size)
        blob = int(pool.layer_num) * page * int(pool.head_num) * int(pool.head_dim) * int(pool.dtype.itemsize)
        pages = int(pool.size) // page
        nbytes = int(buf.numel()) * int(buf.element_size())
        if pages < 1 or nbytes != 2 * pages * blob:
            raise UnsupportedError(f"the host pool holds {nbytes} bytes, not K and V blobs of {pages} pages of {blob}")
        base = int(buf.data_ptr())
        spec = spec_from_pointers((base, nbytes, 0), num_blocks=pages, members=[("k", blob), ("v", blob)],
                                  layout="LBHNC")
        rows = cls(pool, base, blob, pages, spec)
        rows.check_meta(np.arange(min(pages, 2), dtype=np.int64))
        return rows

    def flat_spec(self, tensor: Any) -> KVCacheSpec:
        """A spec over one flat page (SGLang's non-zero-copy path): K blob then V blob."""
        if not hasattr(tensor, "data_ptr") or tensor.device.type != "cpu" or not tensor.is_contiguous() or \
                int(tensor.numel()) * int(tensor.element_size()) != 2 * self.blob:
            raise InvalidArgumentError(f"a flat page must be a contiguous CPU tensor of {2 * self.blob} bytes")
        return spec_from_pointers((int(tensor.data_ptr()), 2 * self.blob, 0), num_blocks=1,
                                  members=[("k", self.blob), ("v", self.blob)], layout="BLHNC")

    def blocks(self, host_indices: Any, n: int) -> np.ndarray:
        """The host pages of ``n`` keys' token indices: whole, aligned, in-range, distinct pages,
        cross-checked against the pool's own page addresses."""
        if isinstance(host_indices, (list, tuple)) or not hasattr(host_indices, "shape"):
            raise InvalidArgumentError("host_indices must be a tensor of token indices, got "
                                       f"{type(host_indices).__name__}")
        arr = host_indices.cpu().numpy() if hasattr(host_indices, "cpu") else np.asarray(host_indices)
        page = int(self.pool.page_size)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.shape[0] != n * page:
            raise InvalidArgumentError(f"host_indices must be 1-D integers, {page} per key ({n} keys), got "
                                       f"shape {arr.shape} of {arr.dtype}")
        if not n:
            return np.zeros(0, dtype=np.int64)
        tok = arr.astype(np.int64).reshape(n, page)
        if int(tok.min()) < 0 or int(tok.max()) >= self.pages * page:
            raise InvalidArgumentError(f"a host index lies outside the pool's {self.pages * page} tokens")
        if np.any(tok[:, 0] % page) or np.any(tok - tok[:, :1] != np.arange(page)):
            raise InvalidArgumentError("each key's host indices must be one whole, aligned host page")
        blocks = tok[:, 0] // page
        if np.unique(blocks).shape[0] != n:
            raise InvalidArgumentError("a host page appears twice in one call")
        self.check_meta(blocks)
        return blocks

    def check_meta(self, blocks: np.ndarray) -> None:
        """SGLang's own addresses of these pages must be the rows the spec names."""
        import torch  # the pool's own API takes a tensor; torch is there, SGLang's pool needs it

        page = int(self.pool.page_size)
        tok = torch.from_numpy(np.repeat(blocks * page, page) + np.tile(np.arange(page), blocks.shape[0]))
        ptrs, sizes = self.pool.get_page_buffer_meta(tok)
        want = np.stack([self.base + blocks * self.blob, self.base + (self.pages + blocks) * self.blob], 1).ravel()
        if list(sizes) != [self.blob] * want.shape[0] or not np.array_equal(np.asarray(ptrs, dtype=np.int64), want):
            raise UnsupportedError("the host pool's page addresses (get_page_buffer_meta) are not the K and V blobs "
                                   "this backend derived from its geometry")


def keys_of(keys: Any, bound: int) -> list[bytes]:
    """Store keys of a call's page keys (a list of at most ``bound``), or a typed error."""
    if not isinstance(keys, (list, tuple)) or len(keys) > bound:
        raise InvalidArgumentError(f"keys must be a list of at most {bound} page keys, got {type(keys).__name__}")
    out = [store_key(k) for k in keys]
    if len(set(out)) != len(out):
        raise InvalidArgumentError("a key appears twice in one call")
    return out


def leading(flags: Sequence[bool]) -> int:
    """How many leading flags are true (SGLang's batch_exists counts a prefix)."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
