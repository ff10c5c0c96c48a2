"""One vocabulary for time: deadlines are :class:`kvxfer.deadlines.Deadline` values, never
``time.monotonic() + x`` written by hand (issue 32, "One notion of time")."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvxfer.deadlines import Backoff, Deadline, check_timeout
from kvxfer.errors import InvalidTimeoutError

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("kvxfer", "plugins", "benchmarks", "examples")
HOME = "kvxfer/deadlines.py"
#: Trees exempt from the rule: none.
ALLOWED: tuple[str, ...] = ()
PATTERN = "time.monotonic() +"


def hand_made_deadlines(root: Path, allowed: tuple[str, ...] = ALLOWED) -> list[str]:
    """``path:line`` of every hand-made deadline under the scanned trees of ``root``."""
    found = []
    for top in SCANNED:
        for p in sorted((root / top).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if rel == HOME or rel.startswith(allowed):
                continue
            for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if PATTERN in line:
                    found.append(f"{rel}:{n}")
    return found


def test_no_hand_made_deadlines() -> None:
    assert hand_made_deadlines(ROOT) == [], "use kvxfer.deadlines.Deadline.after/within instead"


def test_control_the_guard_finds_a_planted_deadline(tmp_path: Path) -> None:
    (tmp_path / "kvxfer").mkdir()
    (tmp_path / "kvxfer" / "late.py").write_text("import time\nend = time.monotonic() + 5\n")
    (tmp_path / "kvxfer" / "store").mkdir()
    (tmp_path / "kvxfer" / "store" / "ok.py").write_text("import time\nend = time.monotonic() + 5\n")
    assert hand_made_deadlines(tmp_path, allowed=("kvxfer/store/",)) == ["kvxfer/late.py:2"]
    assert len(hand_made_deadlines(tmp_path, allowed=())) == 2


def test_directory_checks_timeouts_through_the_shared_rule() -> None:
    src = (ROOT / "kvxfer/directory/base.py").read_text()
    assert "def _check_timeout" not in src


def test_deadline_is_a_clock_reading_with_what_loops_ask() -> None:
    d = Deadline.after(30)
    assert isinstance(d, float) and not d.expired() and 29 < d.left() <= 30
    past = Deadline.within(-1.0)
    assert past.expired() and past.left() == 0.0
    assert Deadline.never().left() == float("inf")
    assert d.earliest(past) == past and past.earliest(d) == past and d.earliest(None) is d
    for bad in (0, -1, float("nan"), float("inf"), "1", True, None):
        with pytest.raises(InvalidTimeoutError):
            Deadline.after(bad)
    assert check_timeout(2) == 2.0


def test_backoff_spins_then_grows_to_its_cap_and_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Backoff(1e-3, 4e-3, spins=2)
    assert [b.next() for _ in range(6)] == [0.0, 0.0, 1e-3, 2e-3, 4e-3, 4e-3]
    b.reset()
    assert b.next() == 0.0
    linear = Backoff(1e-6, 3e-6, factor=1.0, step=1e-6)
    assert [round(linear.next() * 1e6) for _ in range(4)] == [1, 2, 3, 3]
    naps: list[float] = []
    monkeypatch.setattr(time, "sleep", naps.append)
    Backoff(10.0, 10.0).pause(Deadline.within(-1.0))  # cut at the deadline
    Backoff(10.0, 10.0).pause()
    assert naps == [0.0, 10.0]
