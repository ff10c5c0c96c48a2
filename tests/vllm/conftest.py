"""Fixtures for the vLLM end-to-end tests; they run only in the venv that has vLLM.

The tests need ``make venv-vllm`` (vLLM pins its own torch and numpy, so it lives in
``.venv-vllm``); anywhere else this directory is skipped at collection.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _have_vllm() -> bool:
    """vLLM itself, not this folder: with ``tests/`` on ``sys.path`` (the main suite puts it
    there) this folder is a namespace package named ``vllm``, which has no origin."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent != HERE


collect_ignore_glob = [] if _have_vllm() else ["*.py"]


@pytest.fixture(scope="session")
def workdir() -> Path:
    d = Path(os.environ.get("KVXFER_E2E_DIR") or tempfile.mkdtemp(prefix="kvxfer-vllm-e2e-"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def model_dir(workdir: Path) -> Path:
    from harness import write_tiny_llama

    return write_tiny_llama(workdir / "tiny-llama")


@pytest.fixture(scope="session", autouse=True)
def _engines(request: pytest.FixtureRequest) -> Iterator[None]:
    """When a collected test needs the reference, its plain instance starts with the session and
    boots while the tests that need no engine run (the ``reference`` fixture waits for it). At
    the end, every engine still shutting down is waited for (e2e.leave)."""
    if any("reference" in getattr(item, "fixturenames", ()) for item in request.session.items):
        import e2e

        e2e.boot_reference(request.getfixturevalue("model_dir"), request.getfixturevalue("workdir"))
    try:
        yield
    finally:
        e2e_module = sys.modules.get("e2e")
        if e2e_module is not None:
            e2e_module.stop_engines()


@pytest.fixture(scope="session")
def reference(model_dir: Path, workdir: Path) -> dict:
    """Greedy tokens of one plain instance (no connector) for every prompt, once per session."""
    from e2e import REFERENCE, ensure_reference

    ensure_reference(model_dir, workdir)
    return REFERENCE


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the connector comparison (descriptors and times per request) if any ran."""
    e2e = sys.modules.get("e2e")
    if e2e is not None and e2e.ROWS:
        path = e2e.report_path()
        text = e2e.write_report(path)
        print(f"\nkvxfer vs NixlConnector, per request (also in {path}):\n{text}")
