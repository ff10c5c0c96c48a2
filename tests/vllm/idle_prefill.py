"""A prefill worker that leases blocks and then never steps, as an idle vLLM engine does.

``python idle_prefill.py PORT``: registers a vLLM-shaped LBHNC cache filled from a seeded
pattern, serves its metadata on PORT, leases every block for one request, prints ``ready``
and then only waits for stdin to close. Nothing here polls the connector: whatever moves
the decode's READ forward comes from the connector's own helpers.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

ENGINE, REQUEST = "idle-prefill", "req-1"
L, B, H, N, C = 3, 8, 2, 16, 8  # layers, blocks, KV heads, tokens per block, K and V of a head
PAGE = H * N * C * 4


def cache(fill: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One float32 storage with per-layer ``[B, H, N, C]`` views, layers one after another (LBHNC)."""
    storage = torch.empty(L * B * H * N * C, dtype=torch.float32)
    raw = storage.view(torch.uint8)
    if fill is None:
        raw.copy_(torch.from_numpy(np.random.default_rng(7).integers(0, 255, raw.numel(), dtype=np.uint8)))
    else:
        raw.fill_(fill)
    size = B * H * N * C
    return storage, {f"model.layers.{i}.self_attn.attn": storage[i * size:(i + 1) * size].view(B, H, N, C)
                     for i in range(L)}


def register(side, views: dict[str, torch.Tensor], serve: bool) -> None:
    side.register(views, num_blocks=B, page_bytes={k: PAGE for k in views}, layout="LBHNC", block_tokens=N,
                  tp_size=1, replicated=False, serve=serve)


def main() -> None:
    from kvxfer.integrations.vllm.config import ConnectorConfig
    from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata
    from kvxfer.integrations.vllm.worker import WorkerSide

    cfg = ConnectorConfig.from_extra({"insecure": True, "port": int(sys.argv[1])}, env={})
    side = WorkerSide(cfg, ENGINE, 0)
    _, views = cache(None)
    register(side, views, serve=True)
    side.start(KvxferConnectorMetadata(sends={REQUEST: 600.0}))
    print("ready", flush=True)
    sys.stdin.read()
    side.close()


if __name__ == "__main__":
    main()
