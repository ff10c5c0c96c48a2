"""Whether two caches can exchange blocks by byte copies, and how their regions pair up.

The modules inside are private (underscored); these names, and ``kvxfer``'s own, are the public
ones. The rules (:func:`check_pairing`) refuse what byte copies would get wrong, the templates
(:func:`pair`) say per region which bytes meet which, and resharding (:func:`gather`,
:func:`sources`) covers peers with other tensor-parallel cuts of the same heads.
"""

from __future__ import annotations

from ._rules import Refusal, check_pairing, head_slice, refusals, spec_diff
from ._templates import Group, Pairing, cached_pairing, pair
from ._sliced import SlicedLists, may_merge
from ._reshard import Gather, HeadSource, cached_gather, gather, heads_of, may_free, pair_source, readers, sources

__all__ = [
    "Refusal", "check_pairing", "head_slice", "refusals", "spec_diff", "Pairing", "pair", "SlicedLists",
    "Gather", "HeadSource", "gather", "heads_of", "may_free", "pair_source", "readers", "sources", "cached_gather", "may_merge", "Group", "cached_pairing",
]
