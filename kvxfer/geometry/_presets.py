"""Built-in model geometries for ``kvxfer plan``, ``kvxfer bench``, the demo and the benchmarks.

Each preset is written in the spec-file format (:mod:`kvxfer.geometry._specfile`) and parsed by the same
code that reads a user's file, so ``kvxfer plan --local my.toml`` and ``--local mla-61`` mean
the same kind of thing. Specs built from a preset point at a fake address: they are for
planning; ``kvxfer.testing.buffers.allocate`` builds real buffers with the same geometry.
"""

from __future__ import annotations

from typing import Any

from ._specfile import FAKE_BASE, Geometry

__all__ = ["Preset", "PRESETS", "FAKE_BASE", "resolve"]

#: A preset is a :class:`~kvxfer.geometry._specfile.Geometry`; the name stays for existing callers.
Preset = Geometry


def _mla(name: str, layers: int, description: str, per_token: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "description": description, "layers": layers, "block_tokens": 64,
            "groups": [{"layers": "all", "members": per_token}]}


_DEFS: list[dict[str, Any]] = [
    _mla("mla-61", 61, "DeepSeek-style MLA: 61 layers, 576 bf16 latent channels, 64-token blocks",
         [{"dtype": "bfloat16", "head_dim": 576, "replicated": True}]),
    _mla("glm-99", 99, "the seed case: 99 packed views, MLA-like 656-byte token pages, 64-token blocks",
         [{"dtype": "uint8", "head_dim": 656, "replicated": True}]),
    _mla("glm5-mla", 78, "GLM-5-style MLA with a sparse-attention indexer: 78 layers, 576 bf16 latent "
                         "channels and a 132-byte fp8 indexer key (with its scale) per token",
         [{"name": "kv", "dtype": "bfloat16", "head_dim": 576, "replicated": True},
          {"name": "indexer", "dtype": "uint8", "head_dim": 132, "replicated": True}]),
    {"name": "gqa-80", "description": "GQA, one TP8 rank: 80 layers, K and V of 8 heads x 128 bf16 "
                                      "(1 head per rank), 16-token blocks",
     "layers": 80, "block_tokens": 16, "parallel": {"tp_size": 8, "tp_rank": 0},
     "groups": [{"layers": "all", "members": [
         {"name": kv, "dtype": "bfloat16", "heads": 8, "head_dim": 128} for kv in ("k", "v")]}]},
    {"name": "llama3-70b", "description": "Llama-3-70B-style GQA: 80 layers, K and V of 8 KV heads x 128 bf16, "
                                          "16-token blocks, TP1 (use --tp to cut heads per rank)",
     "layers": 80, "block_tokens": 16,
     "groups": [{"layers": "all", "members": [
         {"name": kv, "dtype": "bfloat16", "heads": 8, "head_dim": 128} for kv in ("k", "v")]}]},
    {"name": "qwen-hybrid", "description": "Qwen3-Next-style hybrid: 48 layers, every 4th full attention "
                                           "(K and V of 2 heads x 256 bf16), the rest linear attention with a "
                                           "conv and an SSM state per block; 64-token blocks",
     "layers": 48, "block_tokens": 64,
     "groups": [
         {"layers": "3-47/4", "members": [
             {"name": kv, "dtype": "bfloat16", "heads": 2, "head_dim": 256} for kv in ("k", "v")]},
         {"layers": "rest", "members": [
             {"name": "conv", "dtype": "bfloat16", "heads": 32, "shape": [256, 3], "per_token": False},
             {"name": "ssm", "dtype": "bfloat16", "heads": 32, "shape": [128, 128], "per_token": False}]},
     ]},
]

PRESETS: dict[str, Geometry] = {d["name"]: Geometry.from_dict(d, source=f"preset {d['name']}") for d in _DEFS}


def resolve(name_or_path: str) -> Geometry:
    """A preset by name, or a spec file by path (``.toml`` or ``.json``)."""
    import os

    from ..errors import SpecFileError
    from ._specfile import load

    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.sep in name_or_path or name_or_path.endswith((".toml", ".json")) or os.path.exists(name_or_path):
        return load(name_or_path)
    raise SpecFileError(f"no preset named {name_or_path!r} and no such spec file; presets: {', '.join(PRESETS)}")
