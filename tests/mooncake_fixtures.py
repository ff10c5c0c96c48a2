"""Pytest fixtures for the cluster tier: a real ``mooncake_master`` on loopback, started once per module.

Imported by the test modules that need it (``from mooncake_fixtures import ...``). Without the
Mooncake wheel the tests skip with the install command, except under CI (``CI=true``), where
it fails loudly: the Makefile's ``venv`` and ``deps`` targets install the wheel and libibverbs1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvxfer.testing.mooncake_master import MooncakeMaster, require

__all__ = ["require_mooncake", "master", "own_master", "worker", "LEASE_MS", "HERE"]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: Reads lease objects this long (Mooncake's default is 10 s): the lease tests stay short.
LEASE_MS = 1500



require_mooncake = require  # the name the main suite's modules import


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    """One master for a test module; tests keep apart through their own keys."""
    require()
    with MooncakeMaster(lease_ms=LEASE_MS, client_ttl=2) as m:
        yield m


@pytest.fixture
def own_master() -> Iterator[MooncakeMaster]:
    """A master of the test's own, which it may kill and start again (losing every object)."""
    require()
    with MooncakeMaster(lease_ms=LEASE_MS, client_ttl=2) as m:
        yield m


def worker(args: list[str], popen: object = None) -> subprocess.Popen[str]:
    """tests/tier_worker.py in a child process (through ``popen``: e.g. a namespace's)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "plugins")]), GLOG_minloglevel="2")
    argv = [sys.executable, os.path.join(HERE, "tier_worker.py"), *args]
    start = popen or subprocess.Popen
    return start(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,  # type: ignore[operator]
                 text=True)
