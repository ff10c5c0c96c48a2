"""Decode loads from a prefill whose engine has gone idle (no steps, so no connector calls).

vLLM steps an engine only while it has requests to run; after prefill hands out its last
transfer parameters nothing calls its connector until the next request. The decode's READ
must still finish: the prefill worker drives the transport itself while blocks are leased.
Real bytes between two processes over NIXL, checked against torch indexing over the views.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import idle_prefill as idle
from harness import free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess, pytest.mark.nixl]

HERE = Path(__file__).resolve().parent


def test_decode_loads_from_an_idle_prefill() -> None:
    from kvxfer.integrations.vllm.config import ConnectorConfig
    from kvxfer.integrations.vllm.metadata import KvxferConnectorMetadata, LoadTask
    from kvxfer.integrations.vllm.params import RemoteKV
    from kvxfer.integrations.vllm.worker import WorkerSide

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "idle_prefill.py"), str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=str(HERE.parents[1]))
    side = WorkerSide(ConnectorConfig.from_extra({"insecure": True, "port": port + 1, "transfer_timeout": 60,
                                                  "handshake_timeout": 30, "lease_seconds": 600}, env={}),
                      "decode", 0)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        dst_store, dst = idle.cache(0xAA)
        idle.register(side, dst, serve=False)
        _, src = idle.cache(None)  # the prefill's contents, made again from the same seed
        remote_ids, local_ids = [5, 0, 6], [1, 7, 2]
        expected = {k: v.clone() for k, v in dst.items()}
        for name in expected:
            expected[name][local_ids] = src[name][remote_ids]
        remote = RemoteKV(idle.ENGINE, "127.0.0.1", port, idle.REQUEST, tuple(remote_ids), 3 * idle.N, 1)
        side.start(KvxferConnectorMetadata(loads=[LoadTask("d-1", remote, local_ids, remote_ids, 3 * idle.N)]))
        done: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 120  # generous: a stall is reported by the connector's own timeout
        while "d-1" not in done and time.monotonic() < deadline:
            _, recv, bad = side.poll()
            done |= recv
            failed |= bad
            time.sleep(0.005)
        assert done == {"d-1"} and not failed and not side.take_failed_blocks()
        for name in dst:
            assert torch.equal(dst[name].view(torch.uint8), expected[name].view(torch.uint8)), name
        untouched = [b for b in range(idle.B) if b not in local_ids]
        assert (dst_store.view(idle.L, idle.B, -1)[:, untouched].view(torch.uint8) == 0xAA).all()
    finally:
        side.close()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=60)
