"""CI's quick run of the micro-benchmarks (benchmarks/micro): every body once, no timing.

``--benchmark-disable`` runs each benchmark's function once and keeps its checks (bytes,
digests, round trips), so a benchmark that rots fails here; speed is never asserted (it is
``make bench``'s, compared against benchmarks/micro/baseline.json).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_micro_benchmarks_run_once_and_check_their_results(tmp_path) -> None:
    pytest.importorskip("pytest_benchmark")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "plugins"),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable",
                        f"--basetemp={tmp_path / 'b'}", os.path.join(ROOT, "benchmarks", "micro")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "error" not in r.stdout.splitlines()[-1]
    # Control: the same run over a benchmark whose check fails reports it (the run can fail).
    bad = tmp_path / "test_bad.py"
    bad.write_text("def test_bad(benchmark):\n    assert benchmark(lambda: 1) == 2\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable",
                        f"--basetemp={tmp_path / 'c'}", str(bad)], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "1 failed" in r.stdout
