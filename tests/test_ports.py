"""kvxfer.testing.ports: a range that is only partly claimable gives back what it claimed.

Another live process holds the middle port of the first range tried; ``free_port`` must move
on to the next range *and* release the port it had claimed before meeting the held one,
so that once the holder is gone the whole first range can be had again. The control skips
the release (the old behaviour) and shows the stranded claim then keeps that range away.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from kvxfer.testing import ports

FIRST, SECOND = 21000, 22000


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Claims under ``tmp_path``, every port bindable, and ranges tried in the order pushed
    onto the returned list (so the test decides which range comes first)."""
    monkeypatch.setattr(ports, "_RESERVED", tmp_path / "claims")
    monkeypatch.setattr(ports, "_mine", set())
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    monkeypatch.setattr(ports, "_bindable", lambda port, host: True)
    order: list[int] = []
    monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: order.pop(0))
    yield order


def _hold(port: int, pid: int) -> Path:
    path = ports._RESERVED / str(port)
    path.parent.mkdir(exist_ok=True)
    path.write_text(str(pid))
    return path


def _owner(port: int) -> int | None:
    path = ports._RESERVED / str(port)
    return int(path.read_text()) if path.exists() else None


def _partly_held_then_freed(order: list[int]) -> int:
    """Try FIRST..FIRST+2 with FIRST+1 held by a live process, then again once it is gone."""
    held = _hold(FIRST + 1, os.getppid())  # the parent is alive for the whole test
    order += [FIRST, SECOND]
    assert ports.free_port(3) == SECOND
    assert _owner(FIRST + 1) == os.getppid()  # another's claim is never touched
    held.unlink()  # the holder has gone
    order += [FIRST, SECOND + 10]
    return ports.free_port(3)


def test_a_partly_claimed_range_is_given_back(sandbox: list[int]) -> None:
    got = _partly_held_then_freed(sandbox)
    assert got == FIRST
    assert [_owner(q) for q in range(FIRST, FIRST + 3)] == [os.getpid()] * 3
    assert [_owner(q) for q in range(SECOND, SECOND + 3)] == [os.getpid()] * 3


def test_control_without_the_release_the_claim_is_stranded(sandbox: list[int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_release", lambda port: None)
    got = _partly_held_then_freed(sandbox)
    assert got == SECOND + 10  # FIRST is still claimed by this process, yet never handed out
    assert _owner(FIRST) == os.getpid() and FIRST not in ports._mine
