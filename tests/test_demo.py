"""The main job end to end, at a small size: two processes over NIXL, and the fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MLA_ROW = 61 * 64 * 576 * 2  # bytes per block of the demo's 61-layer MLA cache


def _demo(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo", "--tokens", "512", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def test_demo_over_nixl_in_two_processes() -> None:
    pytest.importorskip("nixl")
    r = _demo("--backend", "nixl", "--memory", "DRAM", "--token", "s3cret", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["backend"] == "nixl" and report["mode"].startswith("two processes")
    whole, layers = report["results"]
    assert whole["descriptors"] == 8  # whole rows: one descriptor per block (512 tokens / 64)
    assert layers["descriptors"] == 488  # per-layer regions: 61 per block
    assert whole["bytes"] == layers["bytes"] == 8 * MLA_ROW
    assert whole["verified"] == layers["verified"] == "every byte"
    assert "VERIFY FAILED" not in r.stdout + r.stderr


def test_demo_falls_back_to_loopback_and_says_so() -> None:
    r = _demo(KVXFER_BLOCK_PLUGINS="nixl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "falling back to the loopback backend" in r.stdout
    assert "the nixl plugin is blocked (KVXFER_BLOCK_PLUGINS=nixl)" in r.stdout  # not "not installed"
    assert "backend=loopback" in r.stdout
    assert sum(line.rstrip().endswith("every byte") for line in r.stdout.splitlines()) == 2
    for phase in ("start-up", "registration", "handshake", "transfers", "verification"):
        assert phase in r.stdout
