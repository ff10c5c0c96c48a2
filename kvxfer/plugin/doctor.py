"""What a plugin's ``kvxfer_doctor_checks`` hook returns, and the helpers its checks share.

``kvxfer doctor`` names no plugin: each plugin diagnoses its own transport (is the library
there, does an agent start, are the device transports listed) through the hook, so a
third-party backend's checks appear beside the in-tree ones. Libraries are probed in a
child Python (:func:`probe`) with a deadline, so one that hangs, crashes or prints on stdout
cannot take the command with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["Check", "MARK", "PROBE_TIMEOUT", "check_prover", "probe"]

PROBE_TIMEOUT = 60.0
MARK = "KVXFER-DOCTOR "


@dataclass
class Check:
    check: str
    status: str  # ok | warn | fail | info
    detail: str
    fix: str | None = None


def probe(code: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """Run ``code`` in a child Python; it reports by printing ``MARK + json``. Returns (data, error)."""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                           env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {PROBE_TIMEOUT:g} s"
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):]), ""
    tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    return None, tail[:300]


_PROVER_PROBE = """
import json, time
from kvxfer import prove
from kvxfer.deadlines import Deadline
p = prove.Prover({target!r}, {options!r}, start_backoff=(0.01, 0.01))
t, err = time.monotonic(), None
try:
    p.start(deadline=Deadline.within({seconds!r}))
except Exception as exc:
    err = f"{{type(exc).__name__}}: {{exc}}"
print({mark!r} + json.dumps({{"seconds": time.monotonic() - t, "error": err, "health": prove.health()}}))
"""


def check_prover(target: str, options: dict[str, Any] | None = None, needs: str | None = None) -> list[Check]:
    """Whether the helper that proves a backend's unauthenticated metadata starts here, and how fast
    (``target`` as :class:`kvxfer.prove.Prover` takes it; nothing when module ``needs`` is missing).

    A helper that cannot start refuses every ``NO_AUTH`` peer (signed peers are not proven);
    engines count it as ``vllm:kvxfer_prover_start_failures`` (docs/design.md, section 8).
    """
    import importlib.util

    if needs is not None and importlib.util.find_spec(needs) is None:
        return []
    code = _PROVER_PROBE.format(target=target, options=options or {}, seconds=PROBE_TIMEOUT - 10,
                                mark=MARK)
    data, err = probe(code, {"NIXL_LOG_LEVEL": "ERROR"})
    err = err if data is None else data["error"]
    if err:
        return [Check("metadata prover", "fail", f"its helper process does not start: {err}; unauthenticated "
                      "(token=NO_AUTH) peers are refused until it does",
                      "set KVXFER_PROVE_LOG=/tmp/kvxfer-prove.log and read the helper's errors there")]
    assert data is not None
    return [Check("metadata prover", "ok", f"a helper starts in {data['seconds']:.1f} s (used for unauthenticated "
                                          "metadata only; signed peers are not proven)")]
