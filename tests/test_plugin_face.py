"""A backend's one face, and its one registry of live backends (issue 32, "Boundaries that hold").

* A plugin's product code imports ``kvxfer`` and ``kvxfer.plugin[.*]`` only, so the core can
  move its modules without breaking a backend; a plugin's own tests may use ``kvxfer.testing``.
* The backends of this process are found in one home, :class:`kvxfer.plugin.Live`, whose only
  lookup asks for this process's token too: no backend keeps its own table of live instances.
"""

from __future__ import annotations

import ast
import gc
import os
import re
import weakref
from pathlib import Path

import pytest

from kvxfer import PeerDisconnectedError
from kvxfer.plugin import Live, identity

ROOT = Path(__file__).resolve().parent.parent
#: The plugins held to the face: the in-tree ones and the worked example of CONTRIBUTING.md.
PLUGINS = ("plugins", "tests/third_party_plugin")
FACE = re.compile(r"^kvxfer(\.plugin(\..+)?)?$")


def _product_files(root: Path) -> list[Path]:
    out = []
    for top in PLUGINS:
        for p in sorted((root / top).rglob("kvxfer_*/**/*.py")):
            rel = p.relative_to(root / top).parts
            if not any(part == "tests" or part.startswith("test_") for part in rel):
                out.append(p)
    return out


def off_face_imports(root: Path) -> list[str]:
    """``path:line module`` for every import of a kvxfer module other than the face."""
    found = []
    for p in _product_files(root):
        rel = p.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                # ``from kvxfer import peers`` imports the module kvxfer.peers
                mods = [node.module] if node.module != "kvxfer" else [
                    f"kvxfer.{a.name}" if (root / "kvxfer" / a.name).exists()
                    or (root / "kvxfer" / f"{a.name}.py").exists() else "kvxfer" for a in node.names]
            else:
                continue
            found += [f"{rel}:{node.lineno} {m}" for m in mods
                      if (m == "kvxfer" or m.startswith("kvxfer.")) and not FACE.match(m)]
    return found


def test_plugins_import_only_the_face() -> None:
    assert len(_product_files(ROOT)) > 40  # the plugins were read
    assert off_face_imports(ROOT) == [], "import it from kvxfer or kvxfer.plugin (re-export it there if a backend needs it)"


def test_control_the_face_guard_finds_planted_imports(tmp_path: Path) -> None:
    (tmp_path / "kvxfer" / "spans").mkdir(parents=True)  # kvxfer's own modules, as the guard looks them up
    (tmp_path / "kvxfer" / "peers").mkdir()
    pkg = tmp_path / "plugins" / "kvxfer_bad"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from kvxfer import Op, BackendError\nfrom kvxfer.plugin import SpanIndex\n"
                                     "from kvxfer.plugin.identity import here\nimport kvxfer\n")
    (pkg / "backend.py").write_text("from kvxfer.spans import SpanIndex\nfrom kvxfer import Op, peers\n"
                                    "def f():\n    import kvxfer.testing.seam\n")
    (pkg / "tests" / "test_x.py").write_text("from kvxfer.testing import BackendConformance\n")
    (pkg / "test_y.py").write_text("from kvxfer.testing import buffers\n")
    assert off_face_imports(tmp_path) == ["plugins/kvxfer_bad/backend.py:1 kvxfer.spans",
                                          "plugins/kvxfer_bad/backend.py:2 kvxfer.peers",
                                          "plugins/kvxfer_bad/backend.py:4 kvxfer.testing.seam"]


# -- one registry of live backends ------------------------------------------------------------
HOME = "kvxfer/plugin/live.py"
SCANNED = ("kvxfer", "plugins", "tests/third_party_plugin")
#: A registry by hand: a weak-valued dict, or a module-level dict named for live instances.
HAND_MADE = re.compile(r"WeakValueDictionary|^_?\w*(live|instances|serving)\w*\s*(:[^=]*)?=\s*(\{\}|dict\()",
                       re.IGNORECASE)


def hand_made_registries(root: Path) -> list[str]:
    found = []
    for top in SCANNED:
        for p in sorted((root / top).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if rel == HOME or "/tests/" in rel:
                continue
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if HAND_MADE.search(line):
                    found.append(f"{rel}:{n}")
    return found


def test_no_backend_keeps_its_own_live_registry() -> None:
    assert hand_made_registries(ROOT) == [], "keep live backends in kvxfer.plugin.Live"


def test_control_the_registry_guard_finds_planted_tables(tmp_path: Path) -> None:
    (tmp_path / "plugins" / "kvxfer_x").mkdir(parents=True)
    (tmp_path / "plugins" / "kvxfer_x" / "a.py").write_text(
        "import weakref\n_LIVE: dict[str, object] = {}\nseen = weakref.WeakValueDictionary()\nok: Live = Live()\n")
    (tmp_path / "kvxfer" / "plugin").mkdir(parents=True)
    (tmp_path / "kvxfer" / "plugin" / "live.py").write_text("import weakref\nd = weakref.WeakValueDictionary()\n")
    assert hand_made_registries(tmp_path) == ["plugins/kvxfer_x/a.py:2", "plugins/kvxfer_x/a.py:3"]


class _Backend:
    pass


def test_live_resolves_an_id_only_with_this_processes_token() -> None:
    live: Live[_Backend] = Live()
    b, mine = _Backend(), identity.here().token
    live[b"id"] = b
    assert live.find(b"id", mine, mine) is b
    assert b"id" in live and len(live) == 1 and live.values() == [b]
    assert live.find(b"id", bytes(len(mine)), mine) is None  # a copied id with another process's token
    assert live.find(b"id", b"", b"") is None  # no token expected: nothing is resolved
    assert live.find(b"other", mine, mine) is None
    assert live.pop(b"id") is b and live.find(b"id", mine, mine) is None
    live[b"id"] = _Backend()  # weak: a dropped backend leaves by itself
    gc.collect()
    assert len(live) == 0 and b"id" not in live


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_forked_child_starts_with_no_live_backend() -> None:
    """A child shares no live backend with its parent. Control: a plain weak table, forked the
    same way, still holds the parent's backend in the child."""
    live: Live[_Backend] = Live()
    plain: "weakref.WeakValueDictionary[bytes, _Backend]" = weakref.WeakValueDictionary()
    b, mine = _Backend(), identity.here().token
    live[b"id"] = plain[b"id"] = b
    pid = os.fork()
    if pid == 0:
        os._exit((len(live) == 0) | (b"id" not in live) << 1 | (plain.get(b"id") is b) << 2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0b111
    assert live.find(b"id", mine, mine) is b  # the parent keeps it


def test_a_forged_same_process_blob_is_not_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: a blob that copies a live agent's id but not this process's token. The control
    (Live.find with the token check bypassed) shows the forged blob would reach the agent."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "third_party_plugin"))
    import kvxfer_tinycopy

    a = kvxfer_tinycopy.TinyCopy("a")
    b = kvxfer_tinycopy.TinyCopy("b")
    try:
        good = a.local_metadata()
        forged = good[:kvxfer_tinycopy._TOKEN] + bytes(len(good) - kvxfer_tinycopy._TOKEN)
        b.add_remote("a", good)
        with pytest.raises(PeerDisconnectedError):
            b.add_remote("forged", forged)
        monkeypatch.setattr(Live, "find", lambda self, key, claimed, expected: self._by_id.get(key))
        b.add_remote("forged", forged)  # control: without the token check the forgery is believed
        assert b._peers["forged"] is a
    finally:
        a.close()
        b.close()


# -- doctor names no plugin ---------------------------------------------------------------------
BACKEND_NAMES = re.compile(r"nixl|ucx|mooncake|loopback|tinycopy|process_vm_readv", re.IGNORECASE)


def plugin_names_in(path: Path) -> list[str]:
    """``line: text`` of every line of a core module naming a backend or its mechanism."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if BACKEND_NAMES.search(line)]


def test_doctor_names_no_plugin() -> None:
    """Each backend's rows (its library, helpers, progress thread, ptrace policy) come from its
    ``kvxfer_doctor_checks`` hook, not from the CLI."""
    assert plugin_names_in(ROOT / "kvxfer" / "cli" / "doctor.py") == []


def test_control_the_doctor_guard_finds_a_planted_name(tmp_path: Path) -> None:
    p = tmp_path / "doctor.py"
    p.write_text('rows = []\nrows.append(Check("progress thread", "info", "NIXL\'s thread spins"))\n')
    assert plugin_names_in(p) == ['2: rows.append(Check("progress thread", "info", "NIXL\'s thread spins"))']
