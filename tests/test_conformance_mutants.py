"""The conformance suite catches backends that break the seam's contract.

Each mutant in ``conformance_mutants.py`` breaks one rule; running the suite against it must
fail the test that states that rule, and the unbroken backends (loopback, the reference
backend the mutants come from) must pass the same tests. Runs in subprocesses that find the
mutants through a temporary entry point, so they never leak into this process's registry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

ONE, TWO = "TestMutant", "TestMutantProcesses"
#: (mutant, the suite class and test that must fail on it)
CASES = [
    ("mutant-notify-early", ONE, "test_notification_arrives_after_data"),
    ("mutant-raw-blob", ONE, "test_corrupt_backend_blob_is_a_typed_error"),
    ("mutant-release-ignored", ONE, "test_cancel_stops_the_copy"),
    ("mutant-ignores-indices", ONE, "test_transfer_moves_exact_bytes"),
    ("mutant-off-by-one", ONE, "test_transfer_moves_exact_bytes"),
    ("mutant-remote-offset", ONE, "test_transfer_moves_exact_bytes"),
    ("mutant-drop-descriptor", ONE, "test_transfer_moves_exact_bytes"),
    ("mutant-swap-direction", TWO, "test_write_with_notification"),
    ("mutant-ignore-notify", ONE, "test_notification_arrives_after_data"),
    ("mutant-early-done", TWO, "test_peer_killed_mid_read"),
    ("mutant-eof-done", TWO, "test_peer_killed_mid_read"),
    ("mutant-dead-done", TWO, "test_peer_killed_mid_write"),
    ("mutant-late-write", TWO, "test_stopped_peer_writes_nothing_after_the_end"),
]


def _pytest(tmp_path: Path, backend: str, k: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    sys.path.insert(0, str(HERE))
    try:
        import conformance_mutants

        conformance_mutants.write_dist(site)
    finally:
        sys.path.remove(str(HERE))
    module = tmp_path / "test_one_mutant.py"
    module.write_text("import conformance_mutants\n"
                      f"TestMutant = conformance_mutants.suite_for({backend!r})\n"
                      f"TestMutantProcesses = conformance_mutants.two_process_suite_for({backend!r})\n")
    path = os.pathsep.join([str(HERE), str(site), os.environ.get("PYTHONPATH", "")])
    # Without the plugins the kit does not use (half a second of each run's start-up).
    return subprocess.run([sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider", "-p",
                           "no:hypothesispytest", "-p", "no:benchmark", "-k", k, "--timeout", "120"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path},
                          cwd=tmp_path, timeout=600)


@pytest.mark.parametrize("backend,suite,test", CASES, ids=[c[0] for c in CASES])
def test_suite_catches_mutant(tmp_path: Path, backend: str, suite: str, test: str) -> None:
    r = _pytest(tmp_path, backend, f"{suite} and {test}")
    out = r.stdout + r.stderr
    assert r.returncode == 1, f"the suite did not catch {backend}:\n{out[-3000:]}"
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ failed", summary) and not re.search(r"\d+ errors?", summary), out[-3000:]


def test_every_bug_has_a_mutant_case() -> None:
    from reference_backend import BUGS

    assert {f"mutant-{b}" for b in BUGS} <= {c[0] for c in CASES}


def test_suite_passes_the_unbroken_loopback(tmp_path: Path) -> None:
    """Control: the same harness with the real loopback passes the single-process tests."""
    k = " or ".join(sorted({t for _, s, t in CASES if s == ONE}))
    r = _pytest(tmp_path, "loopback", f"{ONE} and ({k})")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_suite_passes_the_unbroken_reference_backend(tmp_path: Path) -> None:
    """Control: the backend every reference mutant derives from passes the whole kit."""
    r = _pytest(tmp_path, "reference", "TestMutant")  # both suite classes
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # Not skipped: the kills landed mid-flight, so the kill cases above prove something.
    assert "skipped" not in out.strip().splitlines()[-1], out[-3000:]
