"""The two-process example runs as a deployment: ``examples/prefill.py`` and ``examples/decode.py``.

Each runs as its own process, as the README's two terminals do (another working directory,
a token in the environment, the prefill's port read from what it prints). Both must exit 0,
and decode's dumped caches must hold, byte for byte, what prefill computed for the blocks
it read, and the 0xAA sentinel everywhere else. The reference is rebuilt here with numpy
from the seed, not by importing the example.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvxfer.testing.lines import Channel

from common import has_nixl

pytestmark = [pytest.mark.multiprocess, pytest.mark.nixl,
              pytest.mark.skipif(not has_nixl(), reason="nixl is not installed: pip install -e '.[nixl]'")]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SEED, BLOCKS, REQUESTS, PER_REQUEST, LAYERS = 2026, 64, 4, 5, 4
SHAPE = (2, 16, 2, 128)  # one block of one layer: K/V, tokens, heads, 64 fp16 dims as bytes


def reference(local: np.ndarray, remote: np.ndarray) -> dict[str, np.ndarray]:
    """Decode's caches as bytes: the sentinel, and prefill's seeded bytes where it read them."""
    want = {}
    for layer in range(LAYERS):
        w = np.full((2, BLOCKS, *SHAPE[1:]), 0xAA, np.uint8)
        for ours, theirs in zip(local, remote):
            w[:, ours] = np.random.default_rng([SEED, layer, int(theirs)]).integers(0, 256, SHAPE, dtype=np.uint8)
        want[f"layer.{layer}"] = w
    return want


def run_pair(tmp_path: Path) -> tuple[str, str, np.lib.npyio.NpzFile]:
    env = {**os.environ, "KVXFER_TOKEN": secrets.token_hex(16)}
    prefill = subprocess.Popen([sys.executable, str(EXAMPLES / "prefill.py"), "--port", "0", "--seed", str(SEED)],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ch = Channel(prefill)
        try:
            first = ch.line(120) + "\n"
        except EOFError:
            first = ""
        m = re.match(r"prefill: serving on ([\d.]+):(\d+)$", first.strip())
        assert m, f"prefill did not start: {first}"
        dump = tmp_path / "decode.npz"
        decode = subprocess.run([sys.executable, str(EXAMPLES / "decode.py"), "--connect", f"{m[1]}:{m[2]}",
                                 "--dump", str(dump)], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=240)
        got, tail = ch.inbox.rest(120)
        prefill.wait(timeout=120)
        rest = "".join(ln.decode() + "\n" for ln in got) + tail.decode()
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.communicate()
    assert decode.returncode == 0, decode.stdout + decode.stderr
    assert prefill.returncode == 0, first + rest
    return first + rest, decode.stdout, np.load(dump)


def test_prefill_and_decode_move_and_verify_every_byte(tmp_path: Path) -> None:
    prefill_out, decode_out, dump = run_pair(tmp_path)
    local, remote = dump["local"], dump["remote"]
    # prefill announced REQUESTS x PER_REQUEST blocks in its seeded order; decode used distinct blocks
    assert remote.tolist() == np.random.default_rng(SEED).permutation(BLOCKS)[:REQUESTS * PER_REQUEST].tolist()
    assert len(set(local.tolist())) == len(local) == REQUESTS * PER_REQUEST
    want = reference(local, remote)
    for name, w in want.items():
        np.testing.assert_array_equal(dump[name], w, err_msg=name)
    assert decode_out.count("blocks verified") == REQUESTS and "decode: closed" in decode_out
    assert prefill_out.count("done; its blocks are free") == REQUESTS and "prefill: closed" in prefill_out


def test_control_the_byte_check_sees_a_misplaced_block(tmp_path: Path) -> None:
    """The check above can fail: the reference with two of decode's blocks swapped differs."""
    local = np.arange(REQUESTS * PER_REQUEST)
    remote = np.random.default_rng(SEED).permutation(BLOCKS)[:len(local)]
    good = reference(local, remote)
    swapped = local.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    bad = reference(swapped, remote)
    assert any(not np.array_equal(good[k], bad[k]) for k in good)
