"""UCX's own log level defaults to fatal before libucp loads, unless the user set one (issue 33).

UCX reads ``UCX_LOG_LEVEL`` once, when libucs loads, so what counts is the value the process
holds right after :func:`kvxfer_ucx._libucp.load`. The control: a level the user set is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os
from kvxfer_ucx import _libucp
before = os.environ.get("UCX_LOG_LEVEL")
_libucp.load()
print(json.dumps([before, os.environ.get("UCX_LOG_LEVEL")]))
"""


@pytest.mark.parametrize("user, want", [(None, "fatal"), ("warn", "warn")])
def test_ucx_log_level_is_fatal_unless_the_user_set_one(user: str | None, want: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_LOG_LEVEL"}
    if user is not None:
        env["UCX_LOG_LEVEL"] = user
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [user, want]  # set at load, not at import of the plugin
