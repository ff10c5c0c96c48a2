"""The third-process check has one home (:mod:`kvxfer.peers.third`), which both UCX-speaking backends call.

The end-to-end attacks (an address naming another local process, with their controls) are in
``plugins/kvxfer_ucx/tests/test_ucx_rma_bounds.py`` and ``plugins/kvxfer_nixl/tests/test_ucx_address.py``;
these pin the shared rule and that no backend writes it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvxfer.errors import IdentityError
from kvxfer.peers import third

ROOT = Path(__file__).resolve().parent.parent
RULE = "of this host, not only the sender it claims"


def _reach(*pids: int) -> third.Reach:
    return third.Reach(frozenset(pids), False)


def test_only_the_sender_may_be_named() -> None:
    third.only_the_sender(_reach(), None, False, "m")  # names no local process: nothing to check
    third.only_the_sender(_reach(41), 41, True, "m")  # the sender itself
    with pytest.raises(IdentityError, match=r"names process\(es\) \[7\] of this host, not only the sender"):
        third.only_the_sender(_reach(41, 7), 41, True, "m")
    with pytest.raises(IdentityError, match="claims another host"):
        third.only_the_sender(_reach(41), 41, False, "m")
    with pytest.raises(IdentityError, match="claims another host"):
        third.only_the_sender(_reach(41), None, True, "m")  # a header that claims no process


def test_an_unreadable_address_is_refused_and_an_empty_one_names_no_one() -> None:
    mine = third.here(1, [])
    assert third.named(b"", mine, "m") == _reach()
    with pytest.raises(IdentityError, match="cannot be read"):
        third.named(b"\x0f" * 3, mine, "m")


def copies_of_the_rule(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for top in ("kvxfer", "plugins") for p in sorted((root / top).rglob("*.py"))
            if "/tests/" not in p.as_posix() and p.relative_to(root).as_posix() != "kvxfer/peers/third.py"
            and RULE in p.read_text()]


def test_no_backend_writes_the_rule_again(tmp_path: Path) -> None:
    assert copies_of_the_rule(ROOT) == []
    (tmp_path / "plugins" / "kvxfer_x").mkdir(parents=True)  # the control: a planted copy is found
    (tmp_path / "plugins" / "kvxfer_x" / "_identity.py").write_text(f'raise E("names process(es) [1] {RULE}")\n')
    assert copies_of_the_rule(tmp_path) == ["plugins/kvxfer_x/_identity.py"]
