"""The kit for backend plugins' tests (kvxfer's own tests use it too).

:class:`BackendConformance` and :class:`TwoProcessConformance` are pytest classes that any
backend's test module subclasses; :mod:`kvxfer.testing.buffers` builds patterned caches;
:mod:`kvxfer.testing.peer` runs a peer agent in its own process (``python -m
kvxfer.testing.peer``) and drives it from the parent (:class:`~kvxfer.testing.peer.PeerProcess`).
Those two are faces of ``kvxfer._buffers`` and ``kvxfer._peer``, which the demo and ``kvxfer
bench`` import without this package. What only kvxfer's own tests use (fault injection, network
namespaces, the store-kill child, the directory worker) is ``kvxfer._harness``, not this kit.
The conformance classes need pytest and are imported on first use.
"""

import sys
from typing import Any

_pytest = sys.modules.get("pytest")  # only a pytest run rewrites asserts: a child process skips importing it
if _pytest is not None:
    # Plugin authors collect this suite from an installed package, which pytest does not rewrite
    # by default: without this their failures would be a bare AssertionError with no diff.
    _pytest.register_assert_rewrite("kvxfer.testing.conformance", "kvxfer.testing.conformance_base",
                                    "kvxfer.testing.conformance_processes", "kvxfer.testing.buffers")

from .buffers import SENTINEL, Cache, expected_after, make_cache  # noqa: E402

__all__ = ["BackendConformance", "TwoProcessConformance", "Cache", "SENTINEL", "expected_after", "make_cache"]


def __getattr__(name: str) -> Any:
    if name in ("BackendConformance", "TwoProcessConformance"):
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
