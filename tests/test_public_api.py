"""kvxfer's public surface: ``kvxfer.__all__``, the ``kvxfer.geometry`` and ``kvxfer.pairing``
packages, and the plugin seam. Everything under an underscored name is private.

Backends, the vLLM integration, the benchmarks and the examples are written as a third party
would write them, so none of them may import a private module: when one does, a refactor of
the core breaks a plugin that the core's own tests never load.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kvxfer

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ["plugins", "kvxfer/integrations", "benchmarks", "examples"]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _private_imports(path: Path) -> list[str]:
    """What ``path`` imports of ``kvxfer`` under an underscored name: a module or a name in one."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        out += [n for n in names if n.split(".")[0] == "kvxfer" and any(map(_private, n.split(".")[1:]))]
    return out


def test_the_checker_sees_a_private_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvxfer.geometry._spec import KVCacheSpec\nfrom kvxfer.geometry import _spec\n"
                   "import kvxfer._checks\nfrom kvxfer.geometry import KVCacheSpec\n")
    assert _private_imports(bad) == ["kvxfer.geometry._spec.KVCacheSpec", "kvxfer.geometry._spec", "kvxfer._checks"]


def test_clients_of_the_core_import_no_private_module() -> None:
    found = {str(p.relative_to(ROOT)): bad for d in CLIENTS for p in sorted((ROOT / d).rglob("*.py"))
             if (bad := _private_imports(p))}
    assert found == {}


@pytest.mark.parametrize("package", ["kvxfer", "kvxfer.geometry", "kvxfer.pairing", "kvxfer.plugin"])
def test_every_public_name_resolves(package: str) -> None:
    mod = importlib.import_module(package)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert missing == []
    assert len(mod.__all__) == len(set(mod.__all__))


def test_top_level_names_are_the_packages_own() -> None:
    """``kvxfer.KVCacheSpec`` and ``kvxfer.geometry.KVCacheSpec`` are one class, not two copies."""
    import kvxfer.geometry as geometry
    import kvxfer.pairing as pairing

    shared = 0
    for pkg in (geometry, pairing):
        for n in set(pkg.__all__) & set(kvxfer.__all__):
            assert getattr(kvxfer, n) is getattr(pkg, n), n
            shared += 1
    assert shared >= 12


def _packages_on_disk() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvxfer").rglob("__init__.py")}
    # A plugin with a pyproject.toml of its own (kvxfer_mooncake) is its own distribution, not this wheel's.
    found |= {p.parent.name for p in (ROOT / "plugins").glob("kvxfer_*/__init__.py")
              if not (p.parent / "pyproject.toml").exists()}
    return found


def test_the_wheel_lists_every_package() -> None:
    """A package missing from pyproject's list installs as nothing: the checkout works, the wheel does not."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {"kvxfer.geometry", "kvxfer.pairing"} <= _packages_on_disk()  # the walk sees the new packages
    assert _packages_on_disk() - listed == set()
