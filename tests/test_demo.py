"""The main job end to end, at a small size: two processes over NIXL, and the fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _demo(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer.demo", "--tokens", "512", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_demo_over_nixl_in_two_processes() -> None:
    pytest.importorskip("nixl")
    r = _demo("--backend", "nixl", "--memory", "DRAM", "--token", "s3cret")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend=nixl" in r.stdout and "two processes" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.endswith("every byte")]
    assert len(rows) == 2
    assert rows[0].split()[2] == "8"  # whole rows: one descriptor per block (512 tokens / 64)
    assert rows[1].split()[2] == "488"  # per-layer regions: 61 per block
    assert "VERIFY FAILED" not in r.stdout + r.stderr


def test_demo_falls_back_to_loopback_and_says_so() -> None:
    r = _demo(KVXFER_BLOCK_PLUGINS="nixl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "falling back to the loopback backend" in r.stdout
    assert "pip install 'kvxfer[nixl]'" in r.stdout
    assert "backend=loopback" in r.stdout and r.stdout.count("every byte") == 2
