"""One child-process module: no process reads another's pipe by hand (issue 32, "One child-process module").

:mod:`kvxfer._childproc` holds both codecs (frames, JSON lines); each read there has a
deadline and waits through ``poll``. A ``readline`` on a pipe blocks forever on a child that
stopped or hung, ``for line in proc.stdout`` likewise, and ``select.select`` fails past 1,024
descriptors: each was a hang loop of its own in the ad-hoc children this test replaced. A
child blocked on its *own* stdin (``for line in sys.stdin``) ends at its parent's EOF and hangs
no one, so it is not flagged.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvxfer.testing.lines import Channel

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("kvxfer", "plugins", "benchmarks", "examples", "tests")
HOME = "kvxfer/_childproc/"
#: Files exempt, each with its reason.
ALLOWED: tuple[str, ...] = (
    "tests/test_lines.py",  # the JSON-lines codec's own tests: a deaf child, and select's 1,024 limit shown
    "tests/test_children.py",  # this guard (its patterns are in its own text)
)
PATTERNS = {
    "select.select": re.compile(r"\bselect\.select\("),
    "readline on a pipe": re.compile(r"\b(stdout|stdin|stderr)\.readlines?\("),
    "iterating a child's pipe": re.compile(r"\bfor\s+\w+\s+in\s+[\w.\[\]]+\.(stdout|stderr)\s*:"),
}


def ad_hoc_children(root: Path, allowed: tuple[str, ...] = ALLOWED) -> list[str]:
    """``path:line (what)`` of every pipe read by hand under the scanned trees of ``root``."""
    found = []
    for top in SCANNED:
        for p in sorted((root / top).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if rel.startswith(HOME) or rel in allowed or "/.venv" in rel:
                continue
            for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for what, rx in PATTERNS.items():
                    if rx.search(line):
                        found.append(f"{rel}:{n} ({what})")
    return found


def test_no_ad_hoc_child_protocols() -> None:
    assert ad_hoc_children(ROOT) == [], "read a child through kvxfer.testing.lines.Channel (or kvxfer._childproc)"


def test_control_the_guard_finds_planted_hang_loops(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import select, subprocess\n"
        "p = subprocess.Popen(['cat'], stdout=subprocess.PIPE)\n"
        "hello = p.stdout.readline()\n"
        "while not select.select([p.stdout], [], [], 1)[0]:\n"
        "    pass\n"
        "for line in p.stdout:\n"
        "    print(line)\n"
        "for line in sys.stdin:\n"  # a child on its own stdin: not flagged
        "    print(line)\n")
    (tmp_path / "kvxfer" / "_childproc").mkdir(parents=True)
    (tmp_path / "kvxfer" / "_childproc" / "lines.py").write_text("x = p.stdout.readline()\n")  # the home
    assert ad_hoc_children(tmp_path, allowed=()) == [
        "tests/test_x.py:3 (readline on a pipe)", "tests/test_x.py:4 (select.select)",
        "tests/test_x.py:6 (iterating a child's pipe)"]
    assert ad_hoc_children(tmp_path, allowed=("tests/test_x.py",)) == []


_ANNOUNCE = ("import sys, time\n"
             "sys.stdout.write('READY\\nDONE a\\nDONE b\\nDONE c'); sys.stdout.flush(); time.sleep(600)\n")


def test_a_child_announcing_itself_is_read_with_a_deadline() -> None:
    """What the migrated children rely on: lines split as written, a cut-short tail kept apart,
    and a child that goes quiet a :class:`TimeoutError` (not a hang), then its death an EOF."""
    proc = subprocess.Popen([sys.executable, "-c", _ANNOUNCE], stdout=subprocess.PIPE)
    ch = Channel(proc)
    try:
        assert ch.until(("READY",), 60) == "READY"
        assert ch.line(60) == "DONE a"
        try:
            ch.until(("NEVER",), 0.2)
            raise AssertionError("a quiet child did not time out")
        except TimeoutError:
            pass
        proc.kill()
        lines, cut = ch.inbox.rest(60)
        assert lines == [] and cut == b"DONE c"  # "DONE b" went to until() above; "DONE c" was cut short
    finally:
        proc.kill()
        proc.wait()
        ch.close()
