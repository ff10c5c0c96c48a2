"""A passive NIXL peer: a prefill process whose owner never calls ``progress()`` is still read.

The prefill child registers a seeded cache, serves its metadata over the side channel and
then only waits on stdin. Its backend's background progress thread (on by default) is all
that drives its NIXL worker. The control builds the same child with
``background_progress=False``: the read then times out, with an error that names the cause
and the fix. No test asserts on time: the deadline of the working case is
generous, and only the control's failure depends on one.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from typing import Any, Iterator

import numpy as np
import pytest

import kvxfer
from kvxfer.errors import TransferTimeoutError
from kvxfer.testing.lines import Channel

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]

try:
    import nixl  # noqa: F401
except ImportError:  # pragma: no cover - exercised on machines without nixl
    pytest.skip("nixl is not installed: pip install -e '.[nixl]'", allow_module_level=True)

SENTINEL, BLOCKS, ROW, SEED = 0xAA, 16, 4096, 33

# The prefill: register, serve, then wait for stdin to close. Never progress(), never notifications().
PREFILL = """
import json, os, sys
import numpy as np
import kvxfer
from kvxfer.sidechannel import MetadataServer
token, options = os.environ["KVXFER_TOKEN"], json.loads(sys.argv[1])
agent = kvxfer.Agent("prefill", backend="nixl", token=token, **options)
kv = np.random.default_rng(int(sys.argv[2])).integers(0, 256, (int(sys.argv[3]), int(sys.argv[4])), dtype=np.uint8)
agent.register({"kv": kv})
with MetadataServer(agent.metadata(), "127.0.0.1", 0, token=token) as server:
    print(json.dumps(list(server.address)), flush=True)
    sys.stdin.read()
agent.close()
"""


def _prefill(options: dict[str, Any], token: str) -> subprocess.Popen[str]:
    env = {**__import__("os").environ, "KVXFER_TOKEN": token}
    return subprocess.Popen([sys.executable, "-c", PREFILL, json.dumps(options), str(SEED), str(BLOCKS), str(ROW)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture
def read_from() -> Iterator[Any]:
    """``read_from(options, timeout)``: a fresh passive prefill, and a decode that reads from it."""
    procs: list[subprocess.Popen[str]] = []
    agents: list[kvxfer.Agent] = []

    def run(options: dict[str, Any], timeout: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, BaseException | None]:
        from kvxfer.sidechannel import fetch

        token = secrets.token_hex(16)
        proc = _prefill(options, token)
        procs.append(proc)
        try:
            host, port = json.loads(Channel(proc).line(120))
        except EOFError:
            raise AssertionError(f"prefill did not start: {proc.stderr.read() if proc.stderr else ''}") from None
        decode = kvxfer.Agent("decode", backend="nixl", token=token)
        agents.append(decode)
        dst = np.full((BLOCKS, ROW), SENTINEL, np.uint8)
        decode.register({"kv": dst})
        peer = decode.add_peer(fetch(host, port, token=token, timeout=30))
        ours, theirs = np.array([0, 1, 7, 12]), np.array([5, 9, 3, 15])
        error: BaseException | None = None
        try:
            decode.read(peer, ours, theirs).wait(timeout=timeout)
        except TransferTimeoutError as exc:
            error = exc
        return dst, ours, theirs, error

    yield run
    for a in agents:
        a.close()
    for p in procs:
        try:
            p.communicate(timeout=30)  # stdin closes: the prefill exits on its own
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def test_a_prefill_that_never_progresses_is_read(read_from: Any) -> None:
    dst, ours, theirs, error = read_from({}, 60.0)
    assert error is None
    source = np.random.default_rng(SEED).integers(0, 256, (BLOCKS, ROW), dtype=np.uint8)  # the child's bytes
    want = np.full((BLOCKS, ROW), SENTINEL, np.uint8)
    want[ours] = source[theirs]
    np.testing.assert_array_equal(dst, want)


def test_control_without_background_progress_the_read_times_out_and_says_why(read_from: Any) -> None:
    dst, ours, _, error = read_from({"background_progress": False}, 3.0)
    assert isinstance(error, TransferTimeoutError)
    text = str(error)
    assert "background_progress" in text and "Agent.progress()" in text and "docs/backends.md" in text
    # Over shared memory the bytes themselves may already be there (UCX reads them one-sided);
    # what never comes without the target's progress is the completion. Nothing else moved.
    untouched = np.setdiff1d(np.arange(BLOCKS), ours)
    assert (dst[untouched] == SENTINEL).all()
