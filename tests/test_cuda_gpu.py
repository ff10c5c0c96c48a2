"""The device path on real GPUs, through the NIXL backend, with peers in other processes.

Skipped without CUDA or NIXL. Covers: the conformance suite's two-process VRAM cases (same
GPU, and the peer on a second GPU when there is one), the path actually taken
(``TransferStats.path``), a peer killed mid-transfer, a peer restart, and PyTorch's
expandable segments (the VMM export route). Every transfer is checked byte for byte against
an independent reference; nothing asserts on time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvxfer import Agent
from kvxfer.errors import KvxferError, PeerDisconnectedError
from kvxfer.testing import TwoProcessConformance
from kvxfer.testing.buffers import SENTINEL, expected_after, make_cache
from kvxfer.testing.conformance import GEOM, _PeerProcess
from kvxfer.testing.lines import Channel


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


try:
    import kvxfer_nixl.backend  # noqa: F401

    HAVE_NIXL = True
except ImportError:  # pragma: no cover - machines without nixl
    HAVE_NIXL = False

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess,
              pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device"),
              pytest.mark.skipif(not HAVE_NIXL, reason="needs nixl: pip install -e '.[nixl]'")]
two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")


class TestDevicePathTwoProcessSameGPU(TwoProcessConformance):
    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {}


@two_gpus
class TestDevicePathTwoProcessTwoGPUs(TwoProcessConformance):
    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {}
    peer_args = ("--cuda-device", "1")


@two_gpus
class TestDevicePathTwoGPUsCopyEngines(TwoProcessConformance):
    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {"device_engine": "ce"}
    peer_args = ("--cuda-device", "1")


@two_gpus
class TestDevicePathTwoGPUsKernelOnPeerGPU(TwoProcessConformance):
    backend = "nixl"
    memory = "VRAM"
    options: dict[str, Any] = {"device_engine": "sm", "device_copy_on": "peer"}
    peer_args = ("--cuda-device", "1")


def _peer(seed: int | None, name: str = "remote", extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
          options: dict[str, Any] | None = None) -> _PeerProcess:
    return _PeerProcess("nixl", options or {}, "VRAM", "packed", seed, name, 120.0, extra, env)


def _local(agent: Agent, blocks: int = 16) -> Any:
    dst = make_cache("packed", num_blocks=blocks, memory="VRAM", **GEOM)
    agent.register(dst.views, replicated=True)
    return dst


SRC, DST = [7, 3, 4, 5, 11, 0], [0, 9, 10, 11, 2, 5]


@pytest.mark.parametrize("peer_gpu", [0, 1])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_transfers_take_the_cuda_ipc_path(peer_gpu: int, op: str) -> None:
    if peer_gpu >= _gpus():
        pytest.skip("needs two GPUs")
    from kvxfer.cuda import open_mappings

    peer = _peer(seed=7 if op == "READ" else None, extra=("--cuda-device", str(peer_gpu)))
    try:
        with Agent("local", backend="nixl", timeout=30) as agent:
            cache = (make_cache("packed", num_blocks=16, memory="VRAM", seed=None if op == "READ" else 5, **GEOM))
            agent.register(cache.views, replicated=True)
            name = agent.add_peer(peer.metadata)
            assert open_mappings() >= 1
            if op == "READ":
                before, src = cache.layer_pages(), peer.pages()
                t = agent.read(name, DST, SRC).wait(30)
                np.testing.assert_array_equal(cache.layer_pages(), expected_after(before, src, DST, SRC))
            else:
                before = peer.pages()
                t = agent.write(name, SRC, DST).wait(30)
                np.testing.assert_array_equal(peer.pages(), expected_after(before, cache.layer_pages(), DST, SRC))
                assert (peer.padding() == SENTINEL).all()
            assert t.stats.path == "cuda-ipc", agent.device_path.route(name)
        assert open_mappings() == 0  # closing the agent unmapped the peer's handles
    finally:
        peer.close()


def _big_peer(name: str, seed: int, blocks: int, layers: int, page: int,
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvxfer.testing.peer", "--backend", "nixl", "--name", name, "--cache", "packed",
           "--memory", "VRAM", "--blocks", str(blocks), "--layers", str(layers), "--page", str(page), "--seed",
           str(seed), "--replicated"]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _metadata(proc: subprocess.Popen[str]) -> bytes:
    import base64

    try:
        return base64.b64decode(Channel(proc).read(120)["metadata"])
    except EOFError:
        raise AssertionError(f"peer exited with {proc.wait()}") from None


def test_peer_killed_mid_transfer_is_a_typed_error_and_unmaps() -> None:
    import torch

    from kvxfer.cuda import open_mappings

    blocks, layers, page = 256, 16, 1 << 20  # 4 GiB a read; ten reads queued when the kill lands
    proc = _big_peer("big", 11, blocks, layers, page)
    try:
        md = _metadata(proc)
        dst = make_cache("packed", num_blocks=blocks, num_layers=layers, page=page, memory="VRAM")
        with Agent("local", backend="nixl", timeout=60) as agent:
            agent.register(dst.views, replicated=True)
            name = agent.add_peer(md)
            ids = list(range(blocks))
            agent.read(name, ids[:1], ids[:1]).wait(60)
            pending = [agent.read(name, ids, ids) for _ in range(10)]
            assert pending[0].stats.path == "cuda-ipc"
            proc.kill()
            proc.wait(timeout=30)
            errors = []
            for t in pending:
                try:
                    t.wait(60)
                except KvxferError as exc:
                    errors.append(exc)
            assert errors and all(isinstance(e, PeerDisconnectedError) for e in errors), errors
            assert open_mappings() == 0, "a dead peer's handles stayed mapped"
            with pytest.raises(PeerDisconnectedError):
                agent.read(name, [0], [0]).wait(60)
        # this process's CUDA context survived: it still computes correctly
        x = torch.arange(1 << 20, device="cuda", dtype=torch.int64)
        assert int(x.sum().item()) == (1 << 20) * ((1 << 20) - 1) // 2
    finally:
        if proc.poll() is None:
            proc.kill()


def test_restarted_peer_replaces_the_old_handles() -> None:
    from kvxfer.cuda import open_mappings

    old = _peer(seed=7, name="prefill")
    new = None
    try:
        with Agent("local", backend="nixl", timeout=30) as agent:
            dst = _local(agent)
            agent.add_peer(old.metadata)
            agent.read("prefill", DST, SRC).wait(30)
            one_peer = open_mappings()
            old.kill()
            new = _peer(seed=99, name="prefill")  # same name, new process, newer generation
            before, src = dst.layer_pages(), new.pages()
            agent.add_peer(new.metadata)
            assert open_mappings() == one_peer, "the old incarnation's handles are still mapped"
            t = agent.read("prefill", DST, SRC).wait(30)
            assert t.stats.path == "cuda-ipc"
            np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src, DST, SRC))
        assert open_mappings() == 0
    finally:
        old.close()
        if new is not None:
            new.close()


def test_expandable_segments_go_through_vmm_handles() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    peer = _PeerProcess("nixl", {}, "VRAM", "packed", 21, "vmm", 120.0, (), env)
    try:
        with Agent("local", backend="nixl", timeout=30) as agent:
            dst = _local(agent)
            name = agent.add_peer(peer.metadata)
            before, src = dst.layer_pages(), peer.pages()
            t = agent.read(name, DST, SRC).wait(30)
            np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src, DST, SRC))
            assert t.stats.path == "cuda-ipc", agent.device_path.route(name)
    finally:
        peer.close()


def test_device_path_off_uses_nixl_and_says_so() -> None:
    peer = _peer(seed=7, options={"device_copy": False})
    try:
        with Agent("local", backend="nixl", timeout=30, device_copy=False) as agent:
            dst = _local(agent)
            name = agent.add_peer(peer.metadata)
            before, src = dst.layer_pages(), peer.pages()
            t = agent.read(name, DST, SRC).wait(30)
            np.testing.assert_array_equal(dst.layer_pages(), expected_after(before, src, DST, SRC))
            assert t.stats.path == "nixl"
    finally:
        peer.close()
