"""A spec file's geometry as the tensors an engine would register, discovered by the same rules.

``kvxfer plan`` used to build spec-file specs from sizes alone (opaque pages), so it paired
bf16 with fp16 and could not say which heads a TP rank holds, while two agents that
registered real tensors of those geometries were refused. Here each member becomes a
described view (pointer, shape, strides, dtype) at a fake address, handed to
:func:`kvxfer.geometry._discover.spec_from_tensors`: dtype, page axes, role, layer and head slice
then come from the one discovery path, and pairing from the one :func:`kvxfer.pairing._templates.pair`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from ..errors import SpecError
from ..memory import MemoryKind
from ._discover import _discover, _Tensor
from ._kinds import LayerGroup, MemberKind
from ._spec import KVCacheSpec

__all__ = ["geometry_spec", "engine_dims", "CANONICAL_DTYPES"]


class Geometry(Protocol):
    """What a view reads of a :class:`kvxfer.geometry.Geometry` (the parser sits above this module)."""

    @property
    def groups(self) -> Sequence[LayerGroup]: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def layout(self) -> str: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def stage_layers(self) -> range: ...
    @property
    def packed(self) -> bool: ...
    @property
    def row(self) -> int: ...
    def replicated(self) -> Callable[[str], bool]: ...

#: Spec-file spellings of the names engines report (torch's), so both sides compare equal.
CANONICAL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "float8_e4m3": "float8_e4m3fn"}


def engine_dims(m: MemberKind, tp_size: int) -> tuple[str, tuple[int, ...]]:
    """Letters and logical shape (blocks left out) of one member's tensor as an engine holds it.

    Tokens first when per token; a heads axis unless the page is a replicated single-head
    one (an MLA latent page is ``[tokens, channels]``); then the per-head shape: ``D`` and
    ``X`` per token, ``S`` (with a leading ``D``) for per-block state.
    """
    heads = m.heads_on_rank(tp_size)
    letters, shape = "", []
    if m.per_token:
        letters += "N"
        shape.append(-1)  # filled with block_tokens
    if not (m.replicated and m.heads == 1):
        letters += "H"
        shape.append(heads)
    rest = list(m.shape)
    if m.per_token:
        letters += "D" + "X" * (len(rest) - 1)
    else:
        letters += "S" if len(rest) == 1 else "D" + "S" + "X" * (len(rest) - 2)
    return letters, tuple(shape) + tuple(rest)


def _kv_heads(g: Geometry) -> int | None:
    """The model's KV heads when every head-split page agrees on them (else discovery's default)."""
    heads = {m.heads for grp in g.groups for m in grp.members if not m.replicated and m.per_token}
    heads |= {m.heads for grp in g.groups for m in grp.members if m.replicated and m.heads > 1}
    return heads.pop() if len(heads) == 1 else None


def _view(m: MemberKind, g: Geometry, ptr: int, storage: tuple[int, int], block_stride: int,
          num_blocks: int) -> tuple[_Tensor, str]:
    letters, shape = engine_dims(m, g.tp_size)
    shape = tuple(g.block_tokens if s == -1 else s for s in shape)
    size = m.page_bytes(g.block_tokens, g.tp_size)
    item = size // max(1, _prod(shape))  # the dtype's size
    # Memory order inside a page: the layout's inner letters say whether heads or tokens lead.
    order = list(range(len(letters)))
    if "N" in letters and "H" in letters and g.layout[2:].startswith("H"):
        n, h = letters.index("N"), letters.index("H")
        order[n], order[h] = order[h], order[n]
    strides = [0] * len(letters)
    step = item
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    if step != size:
        raise SpecError(f"member {m.name}: page of {step} bytes, expected {size}")
    t = _Tensor("", ptr, storage[0], storage[1], (num_blocks, *shape), (block_stride, *strides), item,
                CANONICAL_DTYPES.get(m.dtype, m.dtype), MemoryKind.DRAM, 0)
    return t, "B" + letters


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def geometry_spec(g: Geometry, num_blocks: int, base: int) -> KVCacheSpec:
    """The spec an engine would register for ``g`` (its layout as given) at address ``base``."""
    owner = {layer: grp for grp in g.groups for layer in grp.layers}
    views: dict[str, Any] = {}
    dims: dict[str, Any] = {}
    row_off, cursor = 0, base
    total = num_blocks * g.row
    for layer in g.stage_layers:
        grp = owner[layer]
        entry = f"layer.{layer}"
        per: dict[str, _Tensor] = {}
        letters: dict[str, str] = {}
        for m in grp.members:
            size = m.page_bytes(g.block_tokens, g.tp_size)
            if g.packed:  # one storage, one row per block holding every member's page
                t, d = _view(m, g, base + row_off, (base, total), g.row, num_blocks)
                row_off += size
            else:  # one storage per member and layer
                t, d = _view(m, g, cursor, (cursor, num_blocks * size), size, num_blocks)
                cursor += num_blocks * size
            per[m.name] = t
            letters[m.name] = d
        if len(per) == 1 and "" in per:
            views[entry], dims[entry] = per[""], letters[""]
        elif "" in per:
            raise SpecError(f"{entry}: an unnamed member must be the only one of its group")
        else:
            views[entry], dims[entry] = per, letters
    # A spec file gives a replicated member's heads as the model's: its page holds every one.
    return _discover(views, g.replicated(), g.tp_rank, g.tp_size, g.layout, g.block_tokens, None, dims, _kv_heads(g),
                     True)
