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
    assert "ERR backend 'loopback' is blocked by KVXFER_BLOCK_PLUGINS=loopback, ucx" in r.stdout


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


def test_third_party_plugin_installs_and_passes_conformance(tmp_path: Path, private_site: Callable[..., dict]) -> None:
    """Install a separate distribution from tests/ and run the conformance suite on it.

    It goes into a private folder only these subprocesses see: ``.venv`` (and `kvxfer
    backends` run from it) never lists it.
    """
    env = private_site(HERE / "third_party_plugin")
    r = subprocess.run([sys.executable, "-c", "import kvxfer; print({s.name: s.plugin for s in "
                        "kvxfer.available_backends()}['tinycopy'])"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "tinycopy"
    r = _run("import kvxfer; print(sorted(s.name for s in kvxfer.available_backends()))")
    assert "tinycopy" not in r.stdout  # the shared environment never sees it
    r = subprocess.run([sys.executable, "-c", "import kvxfer\ntry:\n kvxfer.Agent('a', backend='tinycopy', fast=1)\n"
                        "except kvxfer.UnknownOptionError as e: print(e)"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert "backend 'tinycopy' has no option 'fast'; its options: none" in r.stdout, r.stderr
    test_file = tmp_path / "test_tinycopy_conformance.py"
    test_file.write_text(textwrap.dedent("""
        from kvxfer.testing import BackendConformance

        class TestTinyCopy(BackendConformance):
            backend = "tinycopy"
    """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout


# -- broken plugins ----------------------------------------------------------------------
# Installed with `pip install --target` into a private folder that only the subprocesses see
# (through PYTHONPATH): the shared environment, and every other process using it, never see
# the broken distribution, so nothing needs uninstalling afterwards.


@pytest.fixture(scope="module")
def broken_site(private_site: Callable[..., dict]) -> dict[str, str]:
    return private_site(HERE / "broken_plugin")


def _with_broken(site: dict[str, str]) -> dict[str, str]:
    return {"PYTHONPATH": site["PYTHONPATH"]}


def test_broken_plugins_leave_loopback_agents_working(broken_site: dict[str, str]) -> None:
    r = _run("""
        import warnings, numpy as np, kvxfer
        from kvxfer.plugin.registry import broken_plugins
        src = np.arange(6 * 32, dtype=np.uint8).reshape(6, 32)
        dst = np.full((6, 32), 0xAA, np.uint8)
        a, b = kvxfer.Agent("a", backend="loopback"), kvxfer.Agent("b", backend="loopback")
        a.register({"kv": src}); b.register({"kv": dst})
        b.read(b.add_peer(a.metadata()), [0, 4], [5, 1]).wait(10)
        want = np.full((6, 32), 0xAA, np.uint8); want[0] = src[5]; want[4] = src[1]
        assert (dst == want).all()
        print(sorted((p.name, p.stage, p.distribution) for p in broken_plugins()))
        print(sorted(s.name for s in kvxfer.available_backends()))
    """, **_with_broken(broken_site))
    assert r.returncode == 0, r.stderr
    broken, names = r.stdout.splitlines()
    assert broken == str(sorted([("broken_import", "import", "kvxfer-broken-example"),
                                 ("misspelt_hook", "hooks", "kvxfer-broken-example"),
                                 ("raises_on_register", "register", "kvxfer-broken-example")]))
    assert "'loopback'" in names and "half-registered" not in names and "never-seen" not in names
    # loud: each one is a warning on stderr naming the plugin and its error
    assert "kvxfer_dependency_that_is_not_installed" in r.stderr
    assert "unknown hook 'kvxfer_register_backend'" in r.stderr
    assert "registration blew up" in r.stderr


def test_cli_lists_broken_plugins_with_their_errors(broken_site: dict[str, str]) -> None:
    env = {**os.environ, **_with_broken(broken_site)}
    r = subprocess.run([sys.executable, "-m", "kvxfer.cli", "backends", "--json"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    import json

    rows = json.loads(r.stdout)
    by_plugin = {row["plugin"]: row for row in rows}
    assert by_plugin["loopback"]["status"] == "available"
    assert by_plugin["broken_import"]["status"] == "broken"
    assert "ModuleNotFoundError" in by_plugin["broken_import"]["reason"]
    assert "kvxfer_register_backend" in by_plugin["misspelt_hook"]["reason"]
    assert "registration blew up" in by_plugin["raises_on_register"]["reason"]
    assert by_plugin["raises_on_register"]["version"] == "0.0.1"
    table = subprocess.run([sys.executable, "-m", "kvxfer.cli", "backends"], capture_output=True, text=True,
                           timeout=120, env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert any(line.split()[:1] == ["loopback"] and "available" in line for line in lines)
    assert sum(" broken " in line for line in lines) == 3
    r = _run("""
        import kvxfer
        try:
            kvxfer.Agent("x", backend="half-registered")
        except kvxfer.UnknownBackendError as e:
            print(e)
    """, **_with_broken(broken_site))
    assert "broken plugins" in r.stdout and "raises_on_register" in r.stdout


class _Misspelt:
    @kvxfer.hookimpl
    def kvxfer_transfer_finishd(self, stats: object) -> None:  # the hook is kvxfer_transfer_finished
        pass


def test_misspelt_observer_hook_fails_loudly() -> None:
    import pluggy

    from kvxfer.observe import add_observer

    obj = _Misspelt()
    with pytest.raises(pluggy.PluginValidationError, match="kvxfer_transfer_finishd"):
        add_observer(obj)
    assert not plugins.plugin_manager().is_registered(obj)


class _Duplicate:
    @kvxfer.hookimpl
    def kvxfer_register_backends(self, register: Callable[..., None]) -> None:
        register("loopback", "kvxfer_loopback.backend:LoopbackBackend")


def test_a_plugin_claiming_a_builtin_name_is_refused_not_broken() -> None:
    """Registered in-process (no distribution), it is a third party: loopback stays built-in."""
    plugins.reset_plugins()
    try:
        plugins.plugin_manager().register(_Duplicate(), name="dup")
        assert plugins.broken_plugins() == []
        [c] = plugins.backend_conflicts()
        assert (c.name, c.plugins, c.reserved) == ("loopback", ("dup",), True)
        assert {s.name: s.plugin for s in kvxfer.available_backends()}["loopback"] == "loopback"
    finally:
        plugins.reset_plugins()


def test_agent_created_hook_sees_every_agent() -> None:
    seen: list[object] = []

    class Tracer:
        @kvxfer.hookimpl
        def kvxfer_agent_created(self, agent: kvxfer.Agent) -> None:
            seen.append(agent)

    from kvxfer.observe import add_observer, remove_observer

    tracer = Tracer()
    add_observer(tracer)
    try:
        with kvxfer.Agent("traced", backend="loopback") as a:
            assert seen == [a] and a.name == "traced"
    finally:
        remove_observer(tracer)
    with kvxfer.Agent("untraced", backend="loopback"):
        assert len(seen) == 1
