"""The public API fuzz (:mod:`kvxfer.testing.api_fuzz`), sized for CI: a few hundred seeded calls
per backend with wrong types, shapes, huge lists, None and wrong objects. Nothing but a
:class:`~kvxfer.KvxferError` may leave a call, and afterwards the pair and the owner still move
the right bytes (pattern source, 0xAA destination, checked against numpy indexing).
``python -m kvxfer.testing.api_fuzz --count 10000`` is the large run (RELIABILITY.md).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

import kvxfer.testing.api_fuzz as api_fuzz
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
    r = run("loopback", CALLS, seed=7, settle=1.0)  # the dead loop's future: 1 s, not 10
    assert r.outcomes["untyped"] > 0 and not r.intact, dict(r.outcomes)


def _store_target(tmp: Path, a: Any) -> Callable[..., Any]:
    """The campaign's ``Store`` call, as :func:`run` draws it, over an agent's layout."""
    import numpy as np

    import kvxfer

    w = SimpleNamespace(kvxfer=kvxfer, backend="loopback", tmp=str(tmp), a=a, b=a, owner=None, store=None,
                        md=None, src=np.zeros((4, 16), np.uint8))
    return {t[0]: t[2] for t in api_fuzz._targets(w)}["Store"]  # type: ignore[arg-type]


@pytest.mark.parametrize("anchored", [True, False], ids=["fixed", "control-unanchored"])
def test_a_hostile_relative_store_path_stays_in_the_campaigns_folder(anchored: bool, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """"x" and "prefill" (hostile values) with a valid capacity and layout make real stores: under
    the campaign's folder, never the working directory. The control, the anchoring off, leaves them
    there, and the root conftest's guard names them."""
    import numpy as np

    import kvxfer

    guard = importlib.util.spec_from_file_location("root_conftest", Path(__file__).parents[1] / "conftest.py")
    assert guard and guard.loader
    root_conftest = importlib.util.module_from_spec(guard)
    guard.loader.exec_module(root_conftest)
    (cwd := tmp_path / "cwd").mkdir()
    (campaign := tmp_path / "campaign").mkdir()
    monkeypatch.chdir(cwd)
    if not anchored:
        monkeypatch.setattr(api_fuzz, "_under", lambda tmp, path: path)
    with kvxfer.Agent("s") as a:
        store = _store_target(campaign, a)
        spec = a.register({"kv": np.zeros((4, 4096), np.uint8)})
        store("x", 1 << 16, spec)
        store("prefill", 1 << 16, spec)
    left = root_conftest.new_entries(cwd, set())
    if anchored:
        assert left == [] and sorted(os.listdir(campaign)) == ["prefill", "x"]
        assert any(n.startswith("slab-") for n in os.listdir(campaign / "x"))
    else:
        assert left == ["prefill", "x"] and os.listdir(campaign) == []
