"""Test support for kvxfer and for backend plugins.

:class:`BackendConformance` and :class:`TwoProcessConformance` are pytest classes that any
backend's test module subclasses; :mod:`kvxfer.testing.buffers` builds patterned caches;
``python -m kvxfer.testing.peer`` runs a peer agent in its own process. Importing this
package needs pytest; importing :mod:`kvxfer` does not import it.
"""

from .buffers import SENTINEL, Cache, expected_after, make_cache
from .conformance import BackendConformance, TwoProcessConformance

__all__ = ["BackendConformance", "TwoProcessConformance", "Cache", "SENTINEL", "expected_after", "make_cache"]
