"""Fixtures any test file may use; pytest finds them here (the helpers behind them: common.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import kvxfer
from common import GEOM, Errors
from kvxfer._harness import faults
from kvxfer.testing.buffers import make_cache



@pytest.fixture
def errors() -> Errors:
    """An ``on_error`` for a MetadataServer that the test can read back."""
    return Errors()


@pytest.fixture
def faulty() -> Iterator[None]:
    """The ``faulty`` backend (:mod:`kvxfer._harness.faults`) registered for this test only."""
    faults.install()
    try:
        yield
    finally:
        faults.uninstall()


@pytest.fixture
def faulty_pair(faulty: None) -> Iterator[tuple[kvxfer.Agent, kvxfer.Agent, faults.Faults, Any, Any]]:
    """Prefill ``p`` and decode ``d`` over the faulty backend (loopback inside), both holding an
    8-block packed cache (``p``'s seeded), ``d`` with a 0.2 s deadline and the ``Faults`` that
    the test arms: ``(p, d, faults, p's cache, d's cache)``."""
    f = faults.Faults()
    src = make_cache("packed", num_blocks=8, seed=3, **GEOM)
    dst = make_cache("packed", num_blocks=8, **GEOM)
    a = kvxfer.Agent("p", backend="faulty", inner="loopback")
    b = kvxfer.Agent("d", backend="faulty", inner="loopback", faults=f, timeout=0.2)
    a.register(src.views, replicated=True)
    b.register(dst.views, replicated=True)
    b.add_peer(a.metadata())
    try:
        yield a, b, f, src, dst
    finally:
        a.close()
        b.close()


@pytest.fixture(scope="module")
def private_site(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], dict[str, str]]:
    """Install a distribution where only the test's subprocesses see it, never into ``.venv``.

    ``pip install --target`` into a private folder, given back as the environment
    (``PYTHONPATH``) a subprocess needs; the shared environment, and every other process
    using it, never see the distribution, so nothing needs uninstalling afterwards.
    """
    def install(src: Path) -> dict[str, str]:
        build = tmp_path_factory.mktemp("build") / src.name
        shutil.copytree(src, build, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        target = tmp_path_factory.mktemp("site")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(target), str(build)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *sys.path])}
    return install


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvxfer's wheel with ``[nixl,kit]`` in a fresh virtualenv, built once for the whole session
    (tests/wheel_venv.py): the install test and the doc test share it."""
    import wheel_venv as wv

    return wv.make(tmp_path_factory.mktemp("install"))
