"""Model geometries for the CLI's plan table, the demo and the benchmarks.

Only geometry: layers, the page each layer keeps per block, how it splits into members.
Specs built from these point at a fake address; they are for planning, not for moving.
"""

from __future__ import annotations

from dataclasses import dataclass

from .from_tensors import spec_from_pointers
from .layout import KVCacheSpec

__all__ = ["Preset", "PRESETS", "FAKE_BASE"]

FAKE_BASE = 0x7F00_0000_0000


@dataclass(frozen=True)
class Preset:
    """One model's KV geometry on one TP rank."""

    name: str
    description: str
    layers: int
    block_tokens: int
    bytes_per_token: int  # per member
    members_per_layer: int = 1  # 2 when K and V are separate pages
    replicated: bool = True

    @property
    def page(self) -> int:
        return self.block_tokens * self.bytes_per_token

    @property
    def row(self) -> int:
        return self.page * self.layers * self.members_per_layer

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def member_names(self) -> list[tuple[str, int]]:
        if self.members_per_layer == 1:
            return [(f"layer.{i}", self.page) for i in range(self.layers)]
        return [(f"layer.{i}.{kv}", self.page) for i in range(self.layers) for kv in ("k", "v")]

    def spec(self, num_blocks: int, *, packed: bool = True) -> KVCacheSpec:
        layout = "BLHNC" if packed else "LBHNC"
        return spec_from_pointers((FAKE_BASE, num_blocks * self.row, 0), num_blocks=num_blocks,
                                  members=self.member_names(), layout=layout, replicated=self.replicated,
                                  block_tokens=self.block_tokens)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("mla-61", "DeepSeek-style MLA: 61 layers, 576 bf16 latent channels, 64-token blocks",
           layers=61, block_tokens=64, bytes_per_token=576 * 2),
    Preset("glm-99", "the seed case: 99 packed views, MLA-like pages, 64-token blocks",
           layers=99, block_tokens=64, bytes_per_token=656),
    Preset("gqa-80", "GQA, TP8 rank: 80 layers, K and V of 1 head x 128 bf16, 16-token blocks",
           layers=80, block_tokens=16, bytes_per_token=128 * 2, members_per_layer=2, replicated=False),
)}
