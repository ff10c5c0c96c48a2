"""kvxfer's wheel in a fresh virtualenv, made once per test session and shared: the install test
checks what it brings, the doc test runs every block with it (a reader installs the wheel, not
a checkout).

The virtualenv is the expensive part (on the shared 2-core VM: about 10 s for the venv, 40 s
for the CPU torch that must come before nixl, 10 s for the wheel and nixl, with pip's cache
warm). It lives outside the repository, and nothing is ever installed into ``.venv``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from doc_blocks import REPO

#: What never goes into the copy the wheel is built from (environments, caches, build output).
_SKIP = shutil.ignore_patterns(".git", ".venv*", ".whl", "build", "dist", "*.egg-info", "__pycache__",
                               ".pytest_cache", ".hypothesis", ".benchmarks")
#: The extras the README's and CONTRIBUTING's install commands name: nixl for the backend, kit for
#: the conformance kit's block, cluster for the cluster tier's.
EXTRAS = "nixl,kit,cluster"


def pip(python: Path | str, *args: str, timeout: float = 900) -> None:
    r = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def wheel(src: Path, out: Path) -> Path:
    """``pip wheel`` with this interpreter's setuptools (no download), from a copy of ``src``."""
    pip(sys.executable, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src))
    (whl,) = out.glob("*.whl")
    return whl


def torch_spec() -> str:
    """The Makefile's CPU torch (one home for the pin): nixl needs torch, installed first."""
    m = re.search(r"^TORCH_SPEC \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, "the Makefile pins TORCH_SPEC"
    return m.group(1)


def make(work: Path) -> Path:
    """A new virtualenv in ``work`` holding only what ``pip install 'kvxfer-*.whl[nixl,kit]'`` brings."""
    src = work / "kvxfer"
    shutil.copytree(REPO, src, ignore=_SKIP)
    whl = wheel(src, work / "dist")
    shutil.rmtree(src)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # Without pip's byte-compiling, one file at a time (most of torch's install): compileall
    # does the same on every core afterwards, so the venv ends as pip would leave it.
    pip(py, "install", "-q", "--no-compile", torch_spec())
    pip(py, "install", "-q", "--no-compile", f"{whl}[{EXTRAS}]")
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    subprocess.run([str(py), "-m", "compileall", "-q", "-j", "0", site], capture_output=True, timeout=900)
    return venv
