"""What the bytes of one page mean: element type, axes and shape, and which KV heads they hold.

A byte copy is only correct when both sides agree on what the bytes are. Two pages of the
same size can still differ in element type (bf16 against fp16), in the order of their axes
(tokens-major ``NHD`` against heads-major ``HND``) or in the heads they hold (another
tensor-parallel rank's slice). These objects travel in the wire format with every member so
that the planner can refuse such pairings instead of moving scrambled bytes.

Axis letters of a page, outermost first:

==== ======================================================================
``N`` tokens of the block
``H`` KV heads held by this rank (SSM heads for state pages)
``D`` head dimension, or the latent channels of an MLA page
``K`` the K/V pair (size 2, K first) when one page holds both
``S`` a state dimension (SSM conv taps, state size); may repeat
``X`` untyped or unnamed extent; may repeat
==== ======================================================================
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import SpecError
from ..memory import _expect_keys, spec_int

__all__ = ["PageFormat", "Shard", "PAGE_AXES", "OPAQUE_DTYPE"]

PAGE_AXES = "NHDKSX"
_UNIQUE_AXES = "NHDK"
_REPEATABLE = "SX"
MAX_AXES = 8
MAX_EXTENT = (1 << 31) - 1
MAX_HEADS = 1 << 20
MAX_TP = 1 << 16
#: Element type of pages described only by their size (raw pointers).
OPAQUE_DTYPE = "bytes"
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class PageFormat:
    """Element type and logical shape of one page, axes listed outermost first.

    ``axes`` and ``shape`` describe the page as it lies in memory, so ``"NHD"`` with shape
    ``(16, 8, 128)`` and ``"HND"`` with ``(8, 16, 128)`` hold the same values in a
    different byte order, and are never paired by a plain copy.
    """

    dtype: str
    itemsize: int
    axes: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or not _DTYPE.fullmatch(self.dtype):
            raise SpecError(f"dtype {self.dtype!r} must be a short lowercase name such as 'bfloat16'")
        object.__setattr__(self, "itemsize", spec_int(self.itemsize, "itemsize", lo=1, hi=16))
        if not isinstance(self.axes, str) or not 0 < len(self.axes) <= MAX_AXES:
            raise SpecError(f"page axes must be 1 to {MAX_AXES} letters, got {self.axes!r}")
        bad = set(self.axes) - set(PAGE_AXES)
        if bad:
            raise SpecError(f"page axes {self.axes!r}: unknown letters {''.join(sorted(bad))} (known: {PAGE_AXES})")
        for a in _UNIQUE_AXES:
            if self.axes.count(a) > 1:
                raise SpecError(f"page axes {self.axes!r}: {a!r} appears more than once")
        if not isinstance(self.shape, (tuple, list)) or len(self.shape) != len(self.axes):
            raise SpecError(f"page shape must have one extent per axis of {self.axes!r}")
        shape = tuple(spec_int(s, "page extent", lo=1, hi=MAX_EXTENT) for s in self.shape)
        if "K" in self.axes and shape[self.axes.index("K")] != 2:
            raise SpecError("the K/V axis 'K' must have extent 2")
        object.__setattr__(self, "shape", shape)

    @classmethod
    def opaque(cls, nbytes: int) -> "PageFormat":
        """A page known only by its size: pairs only with another opaque page of that size."""
        return cls(OPAQUE_DTYPE, 1, "X", (nbytes,))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def is_opaque(self) -> bool:
        return set(self.axes) <= set(_REPEATABLE)

    def extent(self, axis: str) -> int | None:
        """Extent of a named axis, or None when the page has no such axis."""
        return self.shape[self.axes.index(axis)] if axis in self.axes and axis in _UNIQUE_AXES else None

    def describe(self) -> str:
        dims = ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))
        return f"{self.dtype}[{dims}]"

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "itemsize": self.itemsize, "axes": self.axes, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PageFormat":
        _expect_keys("page format", d, {"dtype", "itemsize", "axes", "shape"})
        if not isinstance(d["shape"], list) or len(d["shape"]) > MAX_AXES:
            raise SpecError("page format: shape must be a short list")
        return cls(d["dtype"], d["itemsize"], d["axes"], tuple(d["shape"]))


@dataclass(frozen=True)
class Shard:
    """Which slice of a head-split member this rank holds.

    ``heads`` is the half-open range ``[first, stop)`` of the model's ``total_heads`` KV
    heads held here; both are None when the page does not name its heads (raw pointers),
    and then only the same ``(tp_rank, tp_size)`` identifies the same slice. When the tensor
    parallel size exceeds the number of KV heads, several ranks hold the same range.
    """

    tp_rank: int
    tp_size: int
    heads: tuple[int, int] | None = None
    total_heads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tp_size", spec_int(self.tp_size, "shard tp_size", lo=1, hi=MAX_TP))
        object.__setattr__(self, "tp_rank", spec_int(self.tp_rank, "shard tp_rank", hi=self.tp_size - 1))
        if (self.heads is None) != (self.total_heads is None):
            raise SpecError("shard: heads and total_heads are given together or not at all")
        if self.heads is not None:
            if not isinstance(self.heads, (tuple, list)) or len(self.heads) != 2:
                raise SpecError("shard heads must be a [first, stop) pair")
            total = spec_int(self.total_heads, "shard total_heads", lo=1, hi=MAX_HEADS)
            first = spec_int(self.heads[0], "shard first head", hi=total - 1)
            stop = spec_int(self.heads[1], "shard head stop", lo=first + 1, hi=total)
            object.__setattr__(self, "heads", (first, stop))
            object.__setattr__(self, "total_heads", total)

    @property
    def whole(self) -> bool:
        """True when this slice is every head (a TP size of 1, or the full range)."""
        if self.heads is not None:
            return self.heads == (0, self.total_heads)
        return self.tp_size == 1

    def describe(self) -> str:
        tp = f"TP rank {self.tp_rank} of {self.tp_size}"
        if self.heads is None:
            return f"{tp} (heads not described)"
        return f"heads [{self.heads[0]}, {self.heads[1]}) of {self.total_heads} ({tp})"

    def to_dict(self) -> dict[str, Any]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "heads": list(self.heads) if self.heads is not None else None, "total_heads": self.total_heads}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Shard":
        _expect_keys("shard", d, {"tp_rank", "tp_size", "heads", "total_heads"})
        heads = d["heads"]
        if heads is not None and not isinstance(heads, list):
            raise SpecError("shard heads must be a list or null")
        return cls(d["tp_rank"], d["tp_size"], tuple(heads) if heads is not None else None, d["total_heads"])
