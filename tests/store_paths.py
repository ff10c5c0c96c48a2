"""The store's data paths as a test parameter: the store's own ``preadv``/``pwritev``, or NIXL POSIX.

``via(cache)`` is what a test hands to ``Store.offload``/``restore``: the cache's spec (the
store's own path), or a NIXL agent holding the cache (the backend's file path). Creating a
NIXL agent costs about a second here, so agents are pooled per module and re-registered per
cache; each cache gets an agent of its own until the test ends. Test files import the
``via`` fixture from here.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import kvxfer
from common import has_nixl
from store_caches import Cache

#: own: the store's preadv/pwritev; nixl: NIXL POSIX; staged: the pinned-stage path (for VRAM),
#: host memory standing in for the GPU (host copies instead of CUDA batches).
PATHS = {"own": ("pwritev", "preadv"), "nixl": ("nixl-posix", "nixl-posix"),
         "staged": ("staged-host", "staged-host")}


class Via:
    def __init__(self, name: str) -> None:
        self.name = name
        self.own = name in ("own", "staged")  # both hand the store a spec
        self.staged = name == "staged"
        self.write_path, self.read_path = PATHS[name]
        self._pool: list[kvxfer.Agent] = []
        self._used = 0
        self._given: dict[int, tuple[Cache, kvxfer.Agent]] = {}

    def path(self, write: bool, kind: str = "row") -> str:
        """The path a transfer of a ``kind`` cache reports: on NIXL POSIX a per-layer cache is
        gathered into rows through the stage first (one I/O per row run, not per page)."""
        p = self.write_path if write else self.read_path
        return p + "+stage" if self.name == "nixl" and kind == "layer" else p

    def __call__(self, c: Cache) -> Any:
        if self.own:
            return c.spec
        hit = self._given.get(id(c))
        if hit is not None and hit[0] is c:
            return hit[1]
        if self._used == len(self._pool):
            self._pool.append(kvxfer.Agent(f"store-test-{len(self._pool)}", backend="nixl"))
        a = self._pool[self._used]
        self._used += 1
        a.deregister()
        a.register(c.spec)
        self._given[id(c)] = (c, a)
        return a

    def child_setup(self, var: str, cache_expr: str) -> str:
        """Python source, for a child process, binding ``var`` to what ``via(cache)`` gives."""
        if self.own:
            return f"{var} = {cache_expr}.spec\n" + ("kvxfer.Store._stage_host = True\n" if self.staged else "")
        return f"{var} = kvxfer.Agent('child-{var}', backend='nixl')\n{var}.register({cache_expr}.spec)\n"

    def reset(self) -> None:
        for a in self._pool[:self._used]:
            a.deregister()
        self._used = 0
        self._given.clear()

    def close(self) -> None:
        for a in self._pool:
            a.close()


@pytest.fixture(scope="module", params=sorted(PATHS))
def _via_pool(request: pytest.FixtureRequest) -> Iterator[Via]:
    if request.param == "nixl" and not has_nixl():
        pytest.skip("nixl is not installed: pip install -e '.[nixl]'")
    v = Via(request.param)
    try:
        yield v
    finally:
        v.close()


@pytest.fixture
def via(_via_pool: Via) -> Iterator[Via]:
    kvxfer.Store._stage_host = _via_pool.staged
    try:
        yield _via_pool
    finally:
        kvxfer.Store._stage_host = False
        _via_pool.reset()
