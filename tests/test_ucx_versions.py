"""The upgrade test: every UCX installed here is a release kvxfer's reading of UCX internals was checked against.

kvxfer reads two UCX layouts that are not API (:mod:`kvxfer.ucxabi`): the packed worker
address and the shared-memory receive queue. A new UCX (a ``libucx`` wheel, or one bundled
with a NIXL wheel) may change either; this fails until each layout is validated against the
new release and the release is added to :data:`kvxfer.ucxabi.VALIDATED`, and says how.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer import ucxabi
from kvxfer.ucxabi import mmqueue

ROOT = Path(__file__).resolve().parent.parent
# Reads one library's version in a process of its own (two UCX builds must not meet), loading
# kvxfer/ucxabi/__init__.py by path so the child does not import kvxfer itself.
_VERSION = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ucxabi", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
print(".".join(map(str, m.libucp_version(sys.argv[2]))))
"""


def what_to_validate(found: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """One line per (library, layout it is read for) not validated: what to check, and where
    the release goes. ``found``: ``{path: (backend, version)}``."""
    out = []
    for path, (backend, version) in sorted(found.items()):
        for layout in ucxabi.unvalidated(version, backend):
            out.append(f"UCX {'.'.join(map(str, version))} ({path}): the {layout} layout is validated for "
                       f"{sorted(ucxabi.VALIDATED[layout])} only. To validate: {ucxabi.HOW_TO_VALIDATE[layout]}; "
                       f"then add {tuple(version[:2])} to VALIDATED[{layout!r}] in kvxfer/ucxabi/__init__.py.")
    return out


def test_every_installed_ucx_is_validated() -> None:
    paths = ucxabi.installed_libucp()
    try:  # the UCX backend may be pointed at a system libucp instead of the wheel's
        from kvxfer_ucx._libucp import find_libucp
    except ImportError:
        pass
    else:
        if (mine := find_libucp()) is not None:
            paths[mine] = "ucx"
    if not paths:
        pytest.skip("no libucp installed (neither the libucx wheel nor a NIXL wheel)")
    home = str(ROOT / "kvxfer" / "ucxabi" / "__init__.py")
    found = {}
    for p, backend in paths.items():
        r = subprocess.run([sys.executable, "-c", _VERSION, home, p], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"cannot read the version of {p}: {r.stderr[-500:]}"
        found[p] = (backend, tuple(int(x) for x in r.stdout.split(".")[:3]))
    assert what_to_validate(found) == []


def test_control_an_unvalidated_release_fails_and_says_what_to_validate() -> None:
    msgs = what_to_validate({"/x/libucp.so": ("ucx", (1, 99, 0)), "/y/libucp.so": ("ucx", (1, 21, 0))})
    assert len(msgs) == 2  # both layouts of 1.99; nothing of 1.21
    assert all(m.startswith("UCX 1.99.0 (/x/libucp.so)") for m in msgs)
    assert "test_ucx_address.py" in msgs[0] and "test_ucx_stuckslot.py" in msgs[1]
    # NIXL's UCX is read for its addresses only; the UCX backend's for its receive queue too.
    assert what_to_validate({"/n/libucp.so": ("nixl", (1, 23, 0))}) == []
    (only,) = what_to_validate({"/u/libucp.so": ("ucx", (1, 23, 0))})
    assert "the receive queue layout" in only


def test_the_table_is_the_only_one() -> None:
    """The stuck-slot watch reads the table's entry, and no other module names a UCX release pair."""
    assert mmqueue.LAYOUT_VERSIONS is ucxabi.VALIDATED["receive queue"]
    pair = re.compile(r"\(1,\s*2\d\)")
    hits = [f"{p.relative_to(ROOT)}:{n}" for top in ("kvxfer", "plugins") for p in sorted((ROOT / top).rglob("*.py"))
            if "/tests/" not in p.as_posix() and p != ROOT / "kvxfer/ucxabi/__init__.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if pair.search(line)]
    assert hits == []
