"""Registered memory and descriptor lists: the only things a backend ever sees.

An :class:`Allocation` is one span handed to a backend's ``register``. A
:class:`DescriptorList` is an ``N x 3`` ``uint64`` array of ``(address, nbytes, device)``
spans of one memory kind, the unit that transports prepare and move. Keeping both as plain
numbers (no tensors, no layers) is what lets a backend stay a few hundred lines.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any, Final, Mapping

import numpy as np

from . import _wire
from .errors import InvalidArgumentError, OutOfRegistrationError, SpecError

__all__ = ["MemoryKind", "Op", "Allocation", "DescriptorList", "as_op"]

_U64_MAX = (1 << 64) - 1
#: The one integer rule (:func:`kvxfer._wire.integer`) for geometry values, which callers may
#: give as numpy integers: a :class:`SpecError` otherwise.
spec_int: Final = functools.partial(_wire.integer, error=SpecError, integral=True)


class MemoryKind(str, enum.Enum):
    """Where bytes live. Backends declare which kinds they can move."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class Op(str, enum.Enum):
    """Direction seen from the initiator: READ pulls peer bytes in, WRITE pushes local bytes."""

    READ = "READ"
    WRITE = "WRITE"

    @classmethod
    def _missing_(cls, value: object) -> "Op":
        """``"read"`` is READ; anything else is a typed refusal naming the two directions."""
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise InvalidArgumentError(f"op must be Op.READ or Op.WRITE ('READ' or 'WRITE'), got {value!r}")


def as_op(value: object) -> Op:
    """``Op(value)``, typed for any value: enum lookup compares a numpy array elementwise and
    raises numpy's own ValueError before :meth:`Op._missing_` can refuse it."""
    if type(value) is Op:
        return value
    if not isinstance(value, str):
        raise InvalidArgumentError(f"op must be Op.READ or Op.WRITE ('READ' or 'WRITE'), got {type(value).__name__}")
    return Op(value)


@dataclass(frozen=True)
class Allocation:
    """One registered span: ``(address, nbytes, kind, device)``.

    Views over one storage must become one allocation: registration pins memory and creates
    remote keys, so it is expensive and transports handle few, large spans best.
    """

    address: int
    nbytes: int
    kind: MemoryKind = MemoryKind.DRAM
    device: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "address", spec_int(self.address, "address"))
        object.__setattr__(self, "nbytes", spec_int(self.nbytes, "nbytes", lo=1))
        object.__setattr__(self, "device", spec_int(self.device, "device", hi=(1 << 31) - 1))
        try:
            object.__setattr__(self, "kind", MemoryKind(self.kind))
        except ValueError:
            raise SpecError(f"unknown memory kind {self.kind!r}") from None
        if self.address + self.nbytes > _U64_MAX:
            raise SpecError("allocation wraps around the address space")

    @property
    def end(self) -> int:
        return self.address + self.nbytes

    def to_dict(self) -> dict[str, Any]:
        return {"address": self.address, "nbytes": self.nbytes, "kind": self.kind.value,
                "device": self.device}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Allocation":
        _expect_keys("allocation", d, {"address", "nbytes", "kind", "device"})
        return cls(d["address"], d["nbytes"], d["kind"], d["device"])


def _expect_keys(what: str, d: Any, keys: set[str], optional: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    if not isinstance(d, Mapping):
        raise SpecError(f"{what} must be a mapping, got {type(d).__name__}")
    missing = keys - d.keys()
    extra = d.keys() - keys - optional
    if missing or extra:
        raise SpecError(f"{what}: missing keys {sorted(missing)}, unexpected keys {sorted(map(str, extra))}")


class DescriptorList:
    """``N x 3`` (or strided ``N x 5``) ``uint64`` spans of one memory kind.

    The strided form ``(address, nbytes, device, stride, count)`` stands for ``count`` spans
    ``stride`` bytes apart. It lets a backend that understands it (NIXL >= 1.5) prepare a
    whole region as one row; :meth:`expand` turns it into the plain form for the others.
    """

    __slots__ = ("array", "kind")

    def __init__(self, array: Any, kind: MemoryKind | str = MemoryKind.DRAM):
        arr = np.asarray(array)
        if arr.ndim == 1 and arr.size == 0:
            arr = arr.reshape(0, 3)
        if arr.ndim != 2 or arr.shape[1] not in (3, 5):
            raise SpecError(f"descriptor array must be N x 3 or N x 5, got shape {arr.shape}")
        if arr.dtype != np.uint64:
            if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0):
                raise SpecError("descriptor values must be non-negative integers")
            arr = arr.astype(np.uint64)
        self.array: np.ndarray = np.ascontiguousarray(arr)
        self.array.flags.writeable = False
        self.kind = MemoryKind(kind)

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def __repr__(self) -> str:
        form = "strided" if self.strided else "plain"
        return f"DescriptorList({len(self)} {form} rows, {self.kind.value}, {self.nbytes} bytes)"

    @property
    def strided(self) -> bool:
        return self.array.shape[1] == 5

    @property
    def addresses(self) -> np.ndarray:
        return self.array[:, 0]

    @property
    def lengths(self) -> np.ndarray:
        return self.array[:, 1]

    @property
    def devices(self) -> np.ndarray:
        return self.array[:, 2]

    @property
    def num_spans(self) -> int:
        return int(self.array[:, 4].sum()) if self.strided else len(self)

    @property
    def nbytes(self) -> int:
        if self.strided:
            return int((self.array[:, 1] * self.array[:, 4]).sum())
        return int(self.array[:, 1].sum())

    def expand(self) -> "DescriptorList":
        """The plain ``N x 3`` form (vectorized; no loop per span)."""
        if not self.strided:
            return self
        a = self.array
        counts = a[:, 4].astype(np.int64)
        rows = np.repeat(np.arange(len(a)), counts)
        # position of each span inside its strided row
        starts = np.cumsum(counts) - counts
        k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
        out = np.empty((len(rows), 3), dtype=np.uint64)
        out[:, 0] = a[rows, 0] + a[rows, 3] * k.astype(np.uint64)
        out[:, 1] = a[rows, 1]
        out[:, 2] = a[rows, 2]
        return DescriptorList(out, self.kind)

    def take(self, indices: Any) -> "DescriptorList":
        """Plain rows ``indices`` of the expanded list, computed without expanding the rest.

        Cost follows ``len(indices)``, not the list's length: a strided row of 2^26 spans
        costs nothing until a transfer touches some of them. An index past the end would
        address memory outside what the list describes, so it is refused.
        """
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise OutOfRegistrationError("descriptor indices must be a 1-D integer array")
        a = self.array
        total = self.num_spans
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= total):
            raise OutOfRegistrationError(f"descriptor index outside a list of {total} descriptors")
        if not self.strided:
            return DescriptorList(a[idx], self.kind)
        counts = a[:, 4]
        if (counts == counts[0]).all():  # every row the same length (the usual case): a division
            row, k = np.divmod(idx, int(counts[0]))
        else:
            ends = np.cumsum(counts.astype(np.int64))
            row = np.searchsorted(ends, idx, side="right")
            k = idx - (ends - counts.astype(np.int64))[row]
        # Gathers from the few strided rows, not from an expanded list: cache-friendly.
        out = np.empty((idx.shape[0], 3), dtype=np.uint64)
        np.multiply(a[:, 3][row], k.astype(np.uint64), out=out[:, 0])
        out[:, 0] += a[:, 0][row]
        out[:, 1] = a[:, 1][row]
        out[:, 2] = a[:, 2][row]
        return DescriptorList(out, self.kind)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "columns": int(self.array.shape[1]),
                "data": [int(x) for x in self.array.ravel()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DescriptorList":
        _expect_keys("descriptor list", d, {"kind", "columns", "data"})
        cols, data = d["columns"], d["data"]
        if type(cols) is not int or cols not in (3, 5) or not isinstance(data, list) or len(data) % cols:
            raise SpecError("descriptor list: bad columns/data")
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _U64_MAX for x in data):
            raise SpecError("descriptor list: values must be unsigned 64-bit integers")
        try:
            kind = MemoryKind(d["kind"])
        except ValueError:
            raise SpecError(f"unknown memory kind {d['kind']!r}") from None
        return cls(np.array(data, dtype=np.uint64).reshape(-1, cols), kind)
