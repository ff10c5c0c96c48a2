"""The public API fuzz (:mod:`kvxfer.testing.api_fuzz`), sized for CI: a few hundred seeded calls
per backend with wrong types, shapes, huge lists, None and wrong objects. Nothing but a
:class:`~kvxfer.KvxferError` may leave a call, and afterwards the pair and the owner still move
the right bytes (pattern source, 0xAA destination, checked against numpy indexing).
``python -m kvxfer.testing.api_fuzz --count 10000`` is the large run (RELIABILITY.md).
"""

from __future__ import annotations

import pytest

from kvxfer import _args
from kvxfer.testing.api_fuzz import run
from kvxfer.testing.fuzz import available

HAVE = set(available())
CALLS = 300


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["loopback", "nixl", "ucx"])
def test_public_api_raises_only_typed_errors(backend: str) -> None:
    if backend not in HAVE:
        pytest.skip(f"backend {backend} cannot run here")
    r = run(backend, CALLS, seed=7)
    assert r.calls == CALLS and r.outcomes["typed"] > CALLS // 3 and r.outcomes["ok"] > 0, dict(r.outcomes)
    assert r.outcomes["untyped"] == 0, "\n".join(r.untyped)
    assert r.intact


def test_control_an_unguarded_validator_lets_untyped_errors_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same campaign with the Owner's peer-name check off finds the leaks it stops (a list
    as a name is unhashable; on the loop's side it ended the loop, which ``intact`` sees)."""
    monkeypatch.setattr(_args, "peer_key", lambda key: key)
    r = run("loopback", CALLS, seed=7)
    assert r.outcomes["untyped"] > 0 and not r.intact, dict(r.outcomes)
