"""The kit's face of :mod:`kvxfer._buffers`: plugin and kvxfer tests import it from here.

kvxfer's own command line uses it too, so it lives outside the kit.
"""

# face written by issue 32's rename script
from .._buffers import (  # noqa: F401
    SENTINEL,
    Cache,
    make_cache,
    expected_after,
    block_rows,
    GeometryCache,
    allocate,
)

__all__ = [
    "SENTINEL",
    "Cache",
    "make_cache",
    "expected_after",
    "block_rows",
    "GeometryCache",
    "allocate",
]
