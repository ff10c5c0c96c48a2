"""The install command for an optional feature, as one that works wherever kvxfer is installed.

kvxfer is installed from a checkout (``pip install -e '.[nixl]'``), not from a package index,
so ``pip install 'kvxfer[nixl]'`` would fail. What always works in the environment kvxfer
runs in is installing the extra's own requirements, which the installed distribution's
metadata lists: :func:`install_hint` reads them from there, so the hint never drifts from
``pyproject.toml``.
"""

from __future__ import annotations

import functools
import re

__all__ = ["CPU_TORCH", "install_hint", "extra_requirements"]

#: The command that installs torch on a machine without a GPU (README, "Install", says the same).
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

#: Said after a requirement that has to come in a particular order.
_NOTES = {
    "nixl": f" (nixl needs torch: on a CPU-only machine first {CPU_TORCH}, or pip fetches the multi-GB CUDA build)",
}


@functools.lru_cache(maxsize=None)
def extra_requirements(extra: str) -> tuple[str, ...]:
    """The requirements ``kvxfer[extra]`` adds, from the installed metadata (empty if unknown)."""
    from importlib import metadata

    try:
        requires = metadata.requires("kvxfer") or []
    except metadata.PackageNotFoundError:
        return ()
    out = []
    for req in requires:
        spec, _, marker = req.partition(";")
        if re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker):
            out.append(spec.strip())
    return tuple(out)


def install_hint(extra: str) -> str:
    """``pip install 'nixl>=1.5'``: the command that adds ``extra`` to this environment."""
    reqs = extra_requirements(extra)
    if not reqs:
        return f"pip install -e '.[{extra}]' in a kvxfer checkout"
    return "pip install " + " ".join(f"'{r}'" for r in reqs) + _NOTES.get(extra, "")
