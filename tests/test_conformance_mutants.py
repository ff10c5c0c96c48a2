"""The conformance suite catches backends that break the seam's contract.

Each mutant in ``conformance_mutants.py`` breaks one rule; running the suite against it must
fail the test that states that rule. Runs in subprocesses so the mutants never leak into
this process's plugin registry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

CASES = [
    ("mutant-notify-early", "test_notification_arrives_after_data"),
    ("mutant-raw-blob", "test_corrupt_backend_blob_is_a_typed_error"),
    ("mutant-release-ignored", "test_cancel_stops_the_copy"),
    ("mutant-ignores-indices", "test_transfer_moves_exact_bytes"),
]


@pytest.mark.parametrize("backend,test", CASES)
def test_suite_catches_mutant(tmp_path: Path, backend: str, test: str) -> None:
    module = tmp_path / "test_one_mutant.py"
    module.write_text(
        "import conformance_mutants\n"
        "conformance_mutants.install()\n"
        f"TestMutant = conformance_mutants.suite_for({backend!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider", "-k", test,
                        "--timeout", "120"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, f"the suite did not catch {backend}:\n{out[-3000:]}"
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ failed", summary) and not re.search(r"\d+ errors?", summary), out[-3000:]


def test_suite_passes_the_unbroken_loopback(tmp_path: Path) -> None:
    """Control: the same harness with the real loopback passes those tests."""
    module = tmp_path / "test_control.py"
    module.write_text("import conformance_mutants\nconformance_mutants.install()\n"
                      "TestMutant = conformance_mutants.suite_for('loopback')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    k = " or ".join(t for _, t in CASES)
    r = subprocess.run([sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider", "-k", k,
                        "--timeout", "120"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
