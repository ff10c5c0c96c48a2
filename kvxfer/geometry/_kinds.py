"""The page kinds a spec file names (``kv``, ``k``, ``indexer``, ``ssm``) and the layer groups holding them.

They sit below both the spec-file parser (:mod:`kvxfer.geometry._specfile`) and the tensor views
built from a geometry (:mod:`kvxfer.geometry._views`), so neither has to import the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SpecError

__all__ = ["DTYPES", "MemberKind", "LayerGroup"]

#: Bytes per element of the dtypes a spec file may name.
DTYPES: dict[str, int] = {
    "float64": 8, "float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
    "float8_e4m3": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1, "uint8": 1,
}

@dataclass(frozen=True)
class MemberKind:
    """One page kind every layer of a group keeps per block (``kv``, ``k``, ``indexer``, ``ssm``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # per head (and per token when per_token)
    heads: int = 1
    per_token: bool = True
    replicated: bool = False

    def heads_on_rank(self, tp_size: int) -> int:
        if self.replicated or tp_size == 1:
            return self.heads
        if self.heads % tp_size == 0:
            return self.heads // tp_size
        if tp_size % self.heads == 0:
            return 1  # more ranks than heads: each rank holds one head, shared with others
        raise SpecError(f"member {self.name or '(unnamed)'}: {self.heads} heads do not split over tp_size {tp_size}")

    def page_bytes(self, block_tokens: int, tp_size: int) -> int:
        tokens = block_tokens if self.per_token else 1
        return tokens * self.heads_on_rank(tp_size) * math.prod(self.shape) * DTYPES[self.dtype]


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]
    members: tuple[MemberKind, ...]
