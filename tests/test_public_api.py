"""kvxfer's public surface: ``kvxfer.__all__``, the ``kvxfer.geometry`` and ``kvxfer.pairing``
packages, and the plugin seam. Everything under an underscored name is private.

Backends, the vLLM integration, the benchmarks and the examples are written as a third party
would write them, so none of them may import a private module: when one does, a refactor of
the core breaks a plugin that the core's own tests never load.
"""

from __future__ import annotations

import ast
import importlib
import re
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
        for n in set(pkg.__all__) & set(dir(kvxfer)):
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


DOCS = ["README.md", "docs"]
_DOTTED = re.compile(r"\bkvxfer(?:\.[A-Za-z_]\w*)+")
_FROM = re.compile(r"^\s*from (kvxfer(?:\.\w+)*) import \(?([\w, ]+)\)?", re.M)


def doc_references(root: Path) -> dict[str, str]:
    """``{dotted name: where}`` of every kvxfer name README.md and docs/ use: ``kvxfer.a.b`` in
    text and code, and each name of ``from kvxfer.a import b, c``."""
    found: dict[str, str] = {}
    for top in DOCS:
        base = root / top
        for p in ([base] if base.is_file() else sorted(base.rglob("*.md"))):
            text = p.read_text()
            where = p.relative_to(root).as_posix()
            for m in _DOTTED.finditer(text):
                found.setdefault(m[0], where)
            for m in _FROM.finditer(text):
                for n in filter(None, (x.strip().split(" as ")[0] for x in m[2].split(","))):
                    found.setdefault(f"{m[1]}.{n}", where)
    return found


def _source(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def unresolved(names: dict[str, str]) -> list[str]:
    """The names that do not resolve: the longest importable module, then attributes."""
    bad = []
    for dotted, where in sorted(names.items()):
        parts = dotted.split(".")
        obj: object = None
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except Exception:  # noqa: BLE001 - no such module, or one that needs an extra not installed (vLLM)
                src = _source(".".join(parts[:i]))
                if src is None:
                    continue  # a shorter prefix, then attributes
                # it exists: read its source for the first attribute instead
                ok = i == len(parts) or re.search(rf"\b{parts[i]}\b", src.read_text())
                obj = True if ok else None
                break
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                obj = None
            break
        if obj is None:
            bad.append(f"{dotted} ({where})")
    return bad


def test_every_name_the_docs_use_resolves() -> None:
    refs = doc_references(ROOT)
    assert len(refs) > 20  # the walk sees the docs
    assert unresolved(refs) == []


def test_control_a_name_the_docs_use_that_is_gone_is_found(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("Call `kvxfer.Agent` and `kvxfer.NoSuchName`.\n\n"
                                        "    from kvxfer.geometry import load, gone_away\n")
    (tmp_path / "docs").mkdir()
    refs = doc_references(tmp_path)
    assert set(refs) == {"kvxfer.Agent", "kvxfer.NoSuchName", "kvxfer.geometry", "kvxfer.geometry.load",
                         "kvxfer.geometry.gone_away"}
    assert unresolved(refs) == ["kvxfer.NoSuchName (README.md)", "kvxfer.geometry.gone_away (README.md)"]


def test_the_top_level_all_is_what_the_docs_use() -> None:
    """``kvxfer.__all__`` names what README and docs/ use at the top level, and no more: expert
    names live in their packages (``kvxfer.geometry``, ``kvxfer.plugin``, ...)."""
    top = {d.split(".")[1] for d in doc_references(ROOT)}
    used = {n for n in top if not isinstance(getattr(kvxfer, n, None), type(kvxfer)) or n == "errors"}
    assert set(kvxfer.__all__) == used
