"""Backend names are settled after every plugin registered: built-in names stay built-in, and
a name two third parties claim is refused for both, whatever the load order.

Each impostor is a temporary ``*.dist-info`` plus a module in a folder put on ``sys.path`` of
a subprocess (before or after the real site-packages), so nothing is pip-installed and the
shared virtualenv never sees them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PLUGIN = '''
import kvxfer

@kvxfer.hookimpl
def kvxfer_register_backends(register):
    register({backend!r}, "kvxfer_loopback.backend:LoopbackBackend", summary="impostor from {dist}")
'''


def _dist(root: Path, dist: str, ep_name: str, backend: str) -> str:
    """A folder holding one distribution ``dist`` whose ``kvxfer`` entry point registers ``backend``."""
    site = root / dist
    module = dist.replace("-", "_")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvxfer]\n{ep_name} = {module}\n")
    (site / f"{module}.py").write_text(_PLUGIN.format(backend=backend, dist=dist))
    return str(site)


def _run(code: str, first: list[str], last: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with ``first`` ahead of site-packages on sys.path and ``last`` after it."""
    prelude = f"import sys; sys.path[:0] = {first!r}; sys.path += {last!r}\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "default"})


_PROBE = """
    import json, kvxfer
    from kvxfer.plugin.registry import backend_conflicts, registry
    out = {"owner": {n: i.plugin for n, i in registry().items()},
           "conflicts": [(c.name, c.plugins, c.distributions, c.reserved) for c in backend_conflicts()]}
    try:
        from kvxfer.plugin.registry import get_backend_class
        out["class"] = get_backend_class(sys.argv[1]).__module__
    except kvxfer.KvxferError as e:
        out["error"] = [type(e).__name__, str(e)]
    print(json.dumps(out))
"""


@pytest.mark.parametrize("ep_name", ["dupnixl", "nixl"])
@pytest.mark.parametrize("impostor_first", [True, False], ids=["impostor-first", "impostor-last"])
def test_a_third_party_cannot_take_a_builtin_name(tmp_path: Path, ep_name: str, impostor_first: bool) -> None:
    site = _dist(tmp_path, "kvxfer-dupnixl", ep_name, "nixl")
    r = _run(_PROBE, [site] if impostor_first else [], [] if impostor_first else [site], "nixl")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["owner"]["nixl"] == "nixl", out
    assert "error" not in out and out["class"] == "kvxfer_nixl.backend", out
    [(name, plugins, dists, reserved)] = out["conflicts"]
    assert (name, dists, reserved) == ("nixl", ["kvxfer-dupnixl"], True)
    assert plugins[0].startswith(ep_name)


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_two_third_parties_on_one_name_are_both_refused(tmp_path: Path, order: str) -> None:
    a = _dist(tmp_path, "kvxfer-alpha", "alpha", "shared")
    b = _dist(tmp_path, "kvxfer-beta", "beta", "shared")
    r = _run(_PROBE, [a, b] if order == "ab" else [b, a], [], "shared")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "shared" not in out["owner"]
    assert out["conflicts"] == [["shared", ["alpha", "beta"], ["kvxfer-alpha", "kvxfer-beta"], False]]
    kind, message = out["error"]
    assert kind == "BackendNameConflictError"
    assert "kvxfer-alpha" in message and "kvxfer-beta" in message and "both are refused" in message
    assert "Warning" not in r.stderr, r.stderr


def test_the_cli_shows_each_conflict_on_one_line_without_warnings(tmp_path: Path) -> None:
    a = _dist(tmp_path, "kvxfer-alpha", "alpha", "shared")
    b = _dist(tmp_path, "kvxfer-beta", "beta", "shared")
    imp = _dist(tmp_path, "kvxfer-dupnixl", "nixl", "nixl")
    code = "import sys; from kvxfer.cli.app import main; sys.exit(main(sys.argv[1:]))"
    r = _run(code, [imp, a, b], [], "backends")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr
    lines = r.stdout.splitlines()
    shared = [ln for ln in lines if ln.split()[:1] == ["shared"]]
    assert len(shared) == 1 and "conflict" in shared[0], r.stdout
    assert "kvxfer-alpha" in shared[0] and "kvxfer-beta" in shared[0]
    nixl = [ln for ln in lines if ln.split()[:1] == ["nixl"]]
    assert len(nixl) == 2, r.stdout  # the built-in, and one line refusing the impostor
    assert any(ln.split()[1] == "nixl" and "broken" not in ln and "refused" not in ln for ln in nixl), r.stdout
    assert sum("refused" in ln and "kvxfer-dupnixl" in ln for ln in nixl) == 1, r.stdout
    r = _run(code, [imp, a, b], [], "backends", "--json")
    rows = json.loads(r.stdout)
    assert {(row["backend"], row["status"]) for row in rows if row["status"] in ("refused", "conflict")} == {
        ("nixl", "refused"), ("shared", "conflict")}
