"""Pytest fixtures that run a real etcd on a free loopback port in a temporary directory.

Imported by the test modules that need it (``from etcd_fixtures import ...``). Without the
``etcd`` binary the tests skip with the install command, except under CI (``CI=true``),
where a missing etcd fails loudly: the Makefile's ``deps`` target must have installed it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kvxfer.testing.etcd_server import INSTALL_HINT, EtcdServer, etcd_binary

__all__ = ["require_etcd", "etcd_server", "own_etcd", "cluster_name", "no_thread_left"]


def require_etcd() -> None:
    if etcd_binary() is not None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"etcd is not installed on this CI machine; `make test` runs `make deps` first. {INSTALL_HINT}",
                    pytrace=False)
    pytest.skip(f"etcd is not installed; {INSTALL_HINT}")


def _served(path: "os.PathLike[str]") -> Iterator[EtcdServer]:
    require_etcd()
    server = EtcdServer(path)
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for a test module; tests keep apart through their own cluster names."""
    yield from _served(tmp_path_factory.mktemp("etcd"))


@pytest.fixture
def own_etcd(tmp_path: "os.PathLike[str]") -> Iterator[EtcdServer]:
    """An etcd of the test's own, which the test may stop, kill, wipe and start again."""
    yield from _served(tmp_path)


@pytest.fixture
def cluster_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def no_thread_left() -> Iterator[None]:
    """Every directory a test made is closed by its end: no renewal or watch thread lives on.

    Autouse in the modules that import it.
    """
    yield
    deadline = time.monotonic() + 15
    while [t for t in threading.enumerate() if t.name.startswith("kvxfer-directory")]:
        if time.monotonic() > deadline:
            names = [t.name for t in threading.enumerate() if t.name.startswith("kvxfer-directory")]
            pytest.fail(f"directory threads still running after the test: {names}")
        time.sleep(0.05)
