"""Test support for kvxfer and for backend plugins.

:class:`BackendConformance` and :class:`TwoProcessConformance` are pytest classes that any
backend's test module subclasses; :mod:`kvxfer.testing.buffers` builds patterned caches;
``python -m kvxfer.testing.peer`` runs a peer agent in its own process. Importing this
package needs pytest; importing :mod:`kvxfer` does not import it.
"""

import pytest

# Plugin authors collect this suite from an installed package, which pytest does not rewrite
# by default: without this their failures would be a bare AssertionError with no diff.
pytest.register_assert_rewrite("kvxfer.testing.conformance", "kvxfer.testing.buffers")

from .buffers import SENTINEL  # noqa: E402, Cache, expected_after, make_cache
from .conformance import BackendConformance, TwoProcessConformance  # noqa: E402

__all__ = ["BackendConformance", "TwoProcessConformance", "Cache", "SENTINEL", "expected_after", "make_cache"]
