"""Mutated connection blobs through ``Agent.add_peer``, in child processes (ucx_fuzz.py).

CI size: 1,000 mutants per path. A native crash would be counted by the parent, so this
fails on the count rather than dying with the child. The big run is the script itself.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess]


@pytest.mark.parametrize("mode", ["copy", "rma"])
def test_mutated_blobs_give_typed_errors_only(mode: str) -> None:
    import ucx_fuzz

    r = ucx_fuzz.run(1000, mode, seed=7)
    print(r)
    assert r["crashes"] == 0, r["crash_examples"]
    assert r["untyped"] == 0, r["outcomes"]
    assert r["genuine_after"] == "ok", r
    assert sum(r["outcomes"].values()) == 1000
