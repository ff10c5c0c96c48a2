"""A prefill worker that leases blocks and then never steps, as an idle vLLM engine does.

``python idle_prefill.py PORT [BACKEND_OPTIONS_JSON [ENGINE_ID]]``: registers a vLLM-shaped LBHNC cache filled from a seeded
pattern, serves its metadata on PORT, leases every block for one request, prints ``ready``
and then only waits for stdin to close. Nothing here polls the connector: whatever moves
the decode's READ forward comes from the connector's own helpers.

:func:`load_from_idle_prefill` is the decode side: it starts such a process, loads three of
its blocks and checks every byte (the test and ``load_test.py`` use it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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

    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    cfg = ConnectorConfig.from_extra({"insecure": True, "port": int(sys.argv[1]), "backend_options": options}, env={})
    side = WorkerSide(cfg, sys.argv[3] if len(sys.argv) > 3 else ENGINE, 0)
    _, views = cache(None)
    register(side, views, serve=True)
    side.start(KvxferConnectorMetadata(sends={REQUEST: 600.0}))
    print("ready", flush=True)
    sys.stdin.read()
    side.close()


def start_idle_prefill(options: dict[str, Any], attempts: int = 3, engine: str = ENGINE) -> tuple[subprocess.Popen, int]:
    """The prefill process, once it printed ``ready``, and its port.

    The port is one that looked free a moment before; another process may take it first
    (the machine is shared), so a start that failed to listen is tried again on another.
    """
    from harness import free_port

    from kvxfer.testing.lines import Channel

    for attempt in range(attempts):
        port = free_port()
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(port), json.dumps(options), engine],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                    cwd=str(Path(__file__).resolve().parents[2]))
            try:
                ready = Channel(proc).line(300).strip() == "ready"
            except EOFError:  # the child exited: its stderr says why
                ready = False
            if ready:
                return proc, port
            proc.wait(timeout=60)
            err.seek(0)
            text = err.read().decode("utf-8", "replace")
        if "Address already in use" not in text or attempt == attempts - 1:
            raise AssertionError(f"the idle prefill did not start (rc={proc.returncode}):\n{text[-3000:]}")
    raise AssertionError("unreachable")  # pragma: no cover


def load_from_idle_prefill(backend_options: dict[str, Any] | None = None, timeout: float = 120.0) -> float:
    """Decode side: start an idle prefill, READ blocks [5, 0, 6] into [1, 7, 2], check the bytes.

    ``insecure`` (no token): the agent metadata is unsigned, so with NIXL's ``prove_metadata``
    (its default) it is proven in a helper process before it is loaded. Returns the seconds
    from the load's start to its completion; raises AssertionError on any wrong byte.
    """
    from kvxfer.integrations.vllm.config import ConnectorConfig
    from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata, LoadTask
    from kvxfer.integrations.vllm.params import RemoteKV
    from kvxfer.integrations.vllm.worker import WorkerSide

    options = dict(backend_options or {})
    proc, port = start_idle_prefill(options)
    try:
        side = WorkerSide(ConnectorConfig.from_extra({"insecure": True, "port": port, "transfer_timeout": 60,
                                                      "handshake_timeout": 30, "lease_seconds": 600,
                                                      "backend_options": options}, env={}),
                          "decode", 0)  # port: unused, decode serves no metadata
    except BaseException:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)
        raise
    try:
        dst_store, dst = cache(0xAA)
        register(side, dst, serve=False)
        _, src = cache(None)  # the prefill's contents, made again from the same seed
        remote_ids, local_ids = [5, 0, 6], [1, 7, 2]
        expected = {k: v.clone() for k, v in dst.items()}
        for name in expected:
            expected[name][local_ids] = src[name][remote_ids]
        remote = RemoteKV(ENGINE, "127.0.0.1", port, REQUEST, tuple(remote_ids), 3 * N, 1)
        t0 = time.monotonic()
        side.start(KvxferConnectorMetadata(loads=[LoadTask("d-1", remote, local_ids, remote_ids, 3 * N)]))
        done: set[str] = set()
        failed: set[str] = set()
        deadline = t0 + timeout  # generous: a stall is reported by the connector's own timeout
        while "d-1" not in done and time.monotonic() < deadline:
            _, recv, bad = side.poll()
            done |= recv
            failed |= bad
            time.sleep(0.005)
        seconds = time.monotonic() - t0
        assert done == {"d-1"} and not failed and not side.take_failed_blocks(), (done, failed)
        for name in dst:
            assert torch.equal(dst[name].view(torch.uint8), expected[name].view(torch.uint8)), name
        untouched = [b for b in range(B) if b not in local_ids]
        assert (dst_store.view(L, B, -1)[:, untouched].view(torch.uint8) == 0xAA).all()
        return seconds
    finally:
        side.close()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
