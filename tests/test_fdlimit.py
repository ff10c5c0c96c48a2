"""Running out of file descriptors is named as such, not blamed on the peer (:mod:`kvxfer._fdlimit`).

In a child process (limits are per process): two NIXL agents, then every descriptor under a
lowered soft limit taken. ``add_peer`` then fails, and the error says descriptors ran out,
with the count and the limit. The control: once the descriptors are given back, the same
metadata loads and real bytes move, checked against numpy indexing. A second check: the
first agent of a process raises the soft limit to the hard one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess]
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}

SCRIPT = textwrap.dedent("""
    import json, os, resource
    import numpy as np
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    from kvxfer import Agent, KvxferError
    out = {}
    dec = Agent("dec", backend="nixl", timeout=30, prove_metadata=False)
    pre = Agent("pre", backend="nixl", timeout=30, prove_metadata=False)
    out["raised"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    dst = np.full((8, 4096), 0xAA, np.uint8)
    src = np.random.default_rng(5).integers(0, 256, (8, 4096), dtype=np.uint8)
    dec.register({"kv": dst}, tp_rank=0, tp_size=1)
    pre.register({"kv": src}, tp_rank=0, tp_size=1)
    md = pre.metadata()
    n = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        dec.add_peer(md)
        out["full"] = "accepted"
    except KvxferError as exc:
        out["full"] = type(exc).__name__
        out["message"] = str(exc)
        out["open"], out["limit"] = getattr(exc, "open", None), getattr(exc, "limit", None)
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    dec.add_peer(md)
    before = dst.copy()
    dec.read("pre", [1, 6], [3, 0]).wait()
    before[[1, 6]] = src[[3, 0]]
    out["moved"] = bool(np.array_equal(dst, before))
    out["soft"] = n + 64
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.nixl
def test_running_out_of_descriptors_is_named_and_recovers() -> None:
    pytest.importorskip("kvxfer_nixl.backend", reason="nixl is not installed: pip install 'kvxfer[nixl]'")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=ENV)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["raised"], out
    if out["full"] == "accepted":
        pytest.skip("this NIXL loads a peer without a free descriptor: nothing to name")
    assert out["full"] == "DescriptorLimitError", out
    assert out["limit"] == out["soft"] and out["open"] >= out["limit"] - 32, out
    assert "file descriptors" in out["message"] and "ulimit -n" in out["message"], out
    assert out["moved"], out  # the control: with descriptors back, the same metadata loads


LOG_ONCE = textwrap.dedent("""
    import json, logging, resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, hard, 1024) - 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("kvxfer").addHandler(Keep())
    logging.getLogger("kvxfer").setLevel(logging.INFO)
    from kvxfer import Agent
    agents = [Agent(f"a{i}", backend="loopback") for i in range(3)]
    print("RESULT " + json.dumps({"low": low, "hard": hard, "now": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                                  "records": [m for m in records if "open-file limit" in m]}))
""")


def test_the_raise_is_logged_once_per_process() -> None:
    """Three agents in a process under a lowered soft limit: the limit is raised to the hard
    one and one log record says so, from the first agent only. Control: the limit really was
    below the hard one when the first agent started (else there is nothing to log)."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 64:
        pytest.skip("hard RLIMIT_NOFILE too low to lower the soft one under it")
    r = subprocess.run([sys.executable, "-c", LOG_ONCE], capture_output=True, text=True, timeout=300, env=ENV)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["low"] < out["hard"], out  # the control: there was something to raise
    assert out["now"] == out["hard"], out
    assert len(out["records"]) == 1 and f"from {out['low']} to {out['hard']}" in out["records"][0], out
