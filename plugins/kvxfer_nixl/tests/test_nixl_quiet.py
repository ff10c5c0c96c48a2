"""A dead NIXL peer prints kvxfer's typed error and nothing of NIXL's or UCX's own (issue 33).

A decode process reads from a prefill child, checks the bytes, kills the child and reads
again. By default its stderr holds no native log line: the backend sets ``NIXL_LOG_LEVEL``
and ``UCX_LOG_LEVEL`` to fatal before NIXL loads. The control sets ``NIXL_LOG_LEVEL=ERROR``
as a user would: the level is respected and NIXL's own line about the dead peer is back,
which shows the test can see such lines. A ``UCX_LOG_LEVEL`` the user set is left as set.

Nothing is lost by the silence: kvxfer's error carries NIXL's own status (the exception text of
NIXL's binding, ``NIXL_ERR_REMOTE_DISCONNECT``), the reason the native line gives. The control
run also drops that detail from the error (``KVXFER_TEST_DROP_NATIVE``), and the check sees it gone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]

try:
    import nixl  # noqa: F401
except ImportError:  # pragma: no cover - exercised on machines without nixl
    pytest.skip("nixl is not installed: pip install -e '.[nixl]'", allow_module_level=True)

SENTINEL, BLOCKS, ROW, SEED = 0xAA, 8, 4096, 5

# Glog-style NIXL lines ("E1205 01:43:10.905499 ... nixl_agent.cpp:1198] ...") and UCX's ("... UCX  ERROR ...").
NATIVE = re.compile(r"^[EWIF]\d{4} \d\d:\d\d:\d\d|UCX\s+(ERROR|WARN|FATAL)", re.M)

PREFILL = """
import json, os, sys
import numpy as np
import kvxfer
from kvxfer.sidechannel import MetadataServer
token = os.environ["KVXFER_TOKEN"]
agent = kvxfer.Agent("prefill", backend="nixl", token=token)
agent.register({"kv": np.random.default_rng(int(sys.argv[1])).integers(0, 256, (int(sys.argv[2]), int(sys.argv[3])), dtype=np.uint8)})
with MetadataServer(agent.metadata(), "127.0.0.1", 0, token=token) as server:
    print(json.dumps(list(server.address)), flush=True)
    sys.stdin.read()
"""

# The decode: read two blocks, kill the prefill, read again; report bytes, the error and the levels.
DECODE = """
import json, os, secrets, subprocess, sys
import numpy as np
import kvxfer
from kvxfer.sidechannel import fetch
from kvxfer.testing.lines import Channel
if os.environ.get("KVXFER_TEST_DROP_NATIVE"):  # the control: the error without NIXL's own text
    import kvxfer_nixl._nixl as native, kvxfer_nixl._xfer as xfer
    full = native.map_error
    xfer.map_error = lambda exc, action, peer=None: type(full(exc, action, peer))(f"{action}: peer {peer!r} failed")
seed, blocks, row = (int(a) for a in sys.argv[2:5])
token = secrets.token_hex(16)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:5]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "KVXFER_TOKEN": token})
host, port = json.loads(Channel(child).line(120))
agent = kvxfer.Agent("decode", backend="nixl", token=token)
dst = np.full((blocks, row), 0xAA, np.uint8)
agent.register({"kv": dst})
peer = agent.add_peer(fetch(host, port, token=token, timeout=30))
agent.read(peer, [0, 1], [3, 6]).wait(30)
child.kill()
child.wait()
error = message = None
try:
    agent.read(peer, [2], [4]).wait(30)
except kvxfer.KvxferError as exc:
    error, message = type(exc).__name__, str(exc)
agent.close()
print(json.dumps({"dst": dst.tolist(), "error": error, "message": message,
                  "levels": [os.environ.get("NIXL_LOG_LEVEL"), os.environ.get("UCX_LOG_LEVEL")]}), flush=True)
"""


def _decode(levels: dict[str, str]) -> tuple[dict[str, object], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NIXL_LOG_LEVEL", "UCX_LOG_LEVEL")}
    proc = subprocess.run([sys.executable, "-c", DECODE, PREFILL, str(SEED), str(BLOCKS), str(ROW)],
                          capture_output=True, text=True, timeout=300, env={**env, **levels})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    src = np.random.default_rng(SEED).integers(0, 256, (BLOCKS, ROW), dtype=np.uint8)
    want = np.full((BLOCKS, ROW), SENTINEL, np.uint8)
    want[[0, 1]] = src[[3, 6]]
    np.testing.assert_array_equal(np.array(out["dst"], np.uint8), want)  # block 2 untouched: the peer was dead
    assert out["error"] == "PeerDisconnectedError", out
    return out, proc.stderr


#: What NIXL said about the dead peer, in the exception its binding raised.
NATIVE_REASON = "NIXL_ERR_REMOTE_DISCONNECT"


def test_a_dead_peer_prints_no_native_log_lines_by_default() -> None:
    """Quiet, and the typed error still says what NIXL said: its status, and that the peer left."""
    out, err = _decode({})
    assert not NATIVE.search(err), err
    assert out["levels"] == ["FATAL", "fatal"]
    assert NATIVE_REASON in str(out["message"]) and "'prefill' disconnected" in str(out["message"]), out["message"]


def test_control_a_level_the_user_set_is_respected_and_shows_the_native_line() -> None:
    """A user's level brings the native line back; with NIXL's text dropped from the error (the
    control of the check above), only that line would say why."""
    out, err = _decode({"NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "warn", "KVXFER_TEST_DROP_NATIVE": "1"})
    assert NATIVE.search(err), f"NIXL's own line about the dead peer should be printed at ERROR: {err!r}"
    assert "disconnected" in err and NATIVE_REASON not in str(out["message"]), (err, out["message"])
    assert out["levels"] == ["ERROR", "warn"]
