"""Plugin discovery: entry points, blocking, tracing, install hints, third-party backends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest

import kvxfer
from kvxfer.plugin import registry as plugins
from kvxfer.errors import BackendUnavailableError, UnknownBackendError

HERE = Path(__file__).parent


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_builtin_backends_come_from_entry_points() -> None:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="kvxfer")}
    assert {"loopback", "nixl", "ucx"} <= names
    status = {s.name: s for s in kvxfer.available_backends()}
    assert status["loopback"].available and status["loopback"].plugin == "loopback"


def test_import_is_light() -> None:
    r = _run("""
        import sys, kvxfer
        kvxfer.available_backends()   # listing must not import transports either
        heavy = [m for m in sys.modules if m == 'torch' or m.startswith(('nixl', 'ucxx', 'torch.'))]
        print(heavy)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_block_switch_hides_a_plugin() -> None:
    r = _run("""
        import kvxfer
        print(sorted(s.name for s in kvxfer.available_backends()))
        try:
            kvxfer.Agent('x', backend='loopback')
        except kvxfer.UnknownBackendError as e:
            print('ERR', e)
    """, KVXFER_BLOCK_PLUGINS="loopback, ucx")
    assert r.returncode == 0, r.stderr
    assert "'loopback'" not in r.stdout.splitlines()[0] and "'ucx'" not in r.stdout.splitlines()[0]
    assert "ERR no backend named 'loopback'" in r.stdout and "KVXFER_BLOCK_PLUGINS" in r.stdout


def test_trace_switch_prints_hook_calls() -> None:
    r = _run("import kvxfer; kvxfer.available_backends()", KVXFER_TRACE_PLUGINS="1")
    assert r.returncode == 0
    assert "kvxfer_register_backends" in r.stderr


class _MissingDepPlugin:
    @kvxfer.hookimpl
    def kvxfer_register_backends(self, register: Callable[..., None]) -> None:
        register("needs-missing", "kvxfer_not_a_module.backend:B", requires=("kvxfer_not_a_module",),
                 install="pip install 'kvxfer[imaginary]'")
        register("fails-check", "kvxfer_loopback.backend:LoopbackBackend", check=lambda: "no device here")


@pytest.fixture
def extra_plugin() -> object:
    plugins.reset_plugins()
    pm = plugins.plugin_manager()
    plugin = _MissingDepPlugin()
    pm.register(plugin, name="missing-dep")
    yield plugin
    plugins.reset_plugins()


def test_missing_dependency_gives_install_command(extra_plugin: object) -> None:
    status = {s.name: s for s in kvxfer.available_backends()}
    s = status["needs-missing"]
    assert not s.available and "kvxfer_not_a_module" in (s.reason or "")
    assert s.install == "pip install 'kvxfer[imaginary]'"
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvxfer\[imaginary\]'"):
        kvxfer.Agent("a", backend="needs-missing")
    assert status["fails-check"].reason == "no device here"


def test_unknown_backend() -> None:
    with pytest.raises(UnknownBackendError, match="installed backends"):
        kvxfer.Agent("a", backend="no-such-backend")


def test_cli_lists_backends() -> None:
    r = subprocess.run([sys.executable, "-m", "kvxfer.cli", "backends"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "loopback" in r.stdout and "available" in r.stdout


def test_third_party_plugin_installs_and_passes_conformance(tmp_path: Path) -> None:
    """Install a separate distribution from tests/ and run the conformance suite on it."""
    pkg = HERE / "third_party_plugin"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(pkg)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run("import kvxfer; print({s.name: s.plugin for s in kvxfer.available_backends()}['tinycopy'])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "tinycopy"
    test_file = tmp_path / "test_tinycopy_conformance.py"
    test_file.write_text(textwrap.dedent("""
        from kvxfer.testing import BackendConformance

        class TestTinyCopy(BackendConformance):
            backend = "tinycopy"
    """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
