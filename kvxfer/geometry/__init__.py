"""What a KV cache looks like in memory: specs, page formats, discovery, spec files and presets.

The modules inside are private (underscored); these names, and ``kvxfer``'s own, are the public
ones. A spec says where each block's pages live (:class:`KVCacheSpec`), a page format what one
page holds (:class:`PageFormat`), discovery builds a spec from live tensors, and a spec file
(:func:`load`) or preset (:data:`PRESETS`) says the same in TOML or JSON.
"""

from __future__ import annotations

from ._pageformat import PageFormat, Shard
from ._spec import KNOWN_LAYOUTS, Granularity, KVCacheSpec, Member, PackedLayout, Region, abbreviate, natural_key
from ._discover import DISCOVERY_OPTIONS, spec_from_arrays, spec_from_pointers, spec_from_tensors
from ._specfile import DTYPES, Geometry, LayerGroup, MemberKind, load, loads
from ._presets import PRESETS, resolve

__all__ = [
    "PageFormat", "Shard", "KNOWN_LAYOUTS", "Granularity", "KVCacheSpec", "Member", "PackedLayout", "Region",
    "spec_from_arrays", "spec_from_pointers", "spec_from_tensors", "DTYPES", "Geometry", "LayerGroup",
    "MemberKind", "load", "loads", "PRESETS", "resolve", "DISCOVERY_OPTIONS", "abbreviate", "natural_key",
]
