"""A plan's legs: one class per shape, each able to list and to prepare itself.

A leg is one backend post's worth of a plan: index arrays into one local and one remote
prepared list, or the lists themselves. Three shapes exist, and each is a class here, so
that nothing asks a leg what it is before using it:

* :class:`SpecLeg`: indices into the lists every spec prepares once per (granularity, kind);
* :class:`SlicedLeg`: indices into a gather's sliced page lists (:mod:`kvxfer.pairing._sliced`),
  prepared once per peer;
* :class:`ExplicitLeg`: explicit descriptor lists (a coalesced plan), prepared per transfer.

How a list is prepared, kept or released is the caller's (:class:`Lists`, implemented by
:mod:`kvxfer._posts`, which carries the bound on prepared lists); which list a leg needs is
the leg's.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from .geometry import Granularity, KVCacheSpec
from .memory import DescriptorList, MemoryKind
from .pairing import SlicedLists

__all__ = ["ExplicitLeg", "Leg", "Lists", "SlicedLeg", "SpecLeg"]


class Lists(Protocol):
    """Prepared lists for one leg of one transfer (both sides; ``remote`` picks the side)."""

    def of_spec(self, remote: bool, granularity: Granularity, kind: MemoryKind,
                idx: np.ndarray) -> tuple[Any, np.ndarray]:
        """A prepared list of that side's spec and the indices into it for ``idx``."""
        ...

    def for_peer(self, key: Any, remote: bool, make: Callable[[], DescriptorList]) -> Any:
        """A list kept as long as the peer is (both sides of a gather's lists belong to it)."""
        ...

    def once(self, remote: bool, descs: DescriptorList) -> Any:
        """A list prepared for this transfer only, released with it."""
        ...

    @property
    def strided(self) -> bool:
        """Whether the backend takes strided lists."""
        ...


class Leg:
    """What every leg has: the two sides' granularity and kind, and what it moves.

    Descriptors are in block-major order (block ``i``'s pieces, ``sizes``, then block
    ``i+1``'s) or, when ``member_major``, piece by piece (every block of piece 0, then of
    piece 1), whichever lets more of them merge. ``descriptors`` and ``nbytes`` are plain
    attributes, computed once: every transfer reads them.
    """

    __slots__ = ("local_granularity", "local_kind", "remote_granularity", "remote_kind", "sizes", "blocks",
                 "member_major", "descriptors", "nbytes")

    def __init__(self, local_granularity: Granularity, local_kind: MemoryKind, remote_granularity: Granularity,
                 remote_kind: MemoryKind, sizes: np.ndarray, blocks: int, member_major: bool, descriptors: int,
                 nbytes: int) -> None:
        self.local_granularity = local_granularity
        self.local_kind = local_kind
        self.remote_granularity = remote_granularity
        self.remote_kind = remote_kind
        self.sizes = sizes
        self.blocks = blocks
        self.member_major = member_major
        self.descriptors = descriptors
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.local_kind.value}/{self.local_granularity.value} <-> "
                f"{self.remote_kind.value}/{self.remote_granularity.value}, {self.descriptors} descriptors)")

    @property
    def lengths(self) -> np.ndarray:
        """Bytes of every descriptor, in order."""
        if self.member_major:
            return np.repeat(self.sizes, self.blocks)
        return np.tile(self.sizes, self.blocks)

    def explicit(self, local: KVCacheSpec, remote: KVCacheSpec) -> tuple[DescriptorList, DescriptorList]:
        """``(local, remote)`` explicit ``N x 3`` lists of this leg of a plan between ``local`` and ``remote``."""
        raise NotImplementedError

    def prepare(self, lists: Lists) -> tuple[Any, np.ndarray, Any, np.ndarray]:
        """``(local list, local indices, remote list, remote indices)`` for one post."""
        raise NotImplementedError


class SpecLeg(Leg):
    """Indices into the lists each spec prepares once per (granularity, kind)."""

    __slots__ = ("local_idx", "remote_idx")

    def __init__(self, local_granularity: Granularity, local_kind: MemoryKind, remote_granularity: Granularity,
                 remote_kind: MemoryKind, local_idx: np.ndarray, remote_idx: np.ndarray, sizes: np.ndarray,
                 blocks: int, *, block_bytes: int | None = None, member_major: bool = False) -> None:
        super().__init__(local_granularity, local_kind, remote_granularity, remote_kind, sizes, blocks, member_major,
                         blocks * int(sizes.shape[0]),
                         blocks * (int(sizes.sum()) if block_bytes is None else block_bytes))
        self.local_idx, self.remote_idx = local_idx, remote_idx

    def explicit(self, local: KVCacheSpec, remote: KVCacheSpec) -> tuple[DescriptorList, DescriptorList]:
        # From the strided lists: the cost follows the request, not the specs' sizes.
        ld = local.descriptor_list(self.local_granularity, self.local_kind, strided=True)
        rd = remote.descriptor_list(self.remote_granularity, self.remote_kind, strided=True)
        return ld.take(self.local_idx), rd.take(self.remote_idx)

    def prepare(self, lists: Lists) -> tuple[Any, np.ndarray, Any, np.ndarray]:
        lp, li = lists.of_spec(False, self.local_granularity, self.local_kind, self.local_idx)
        rp, ri = lists.of_spec(True, self.remote_granularity, self.remote_kind, self.remote_idx)
        return lp, li, rp, ri


class SlicedLeg(Leg):
    """Indices into a gather's sliced page lists (both sides exist only for one peer)."""

    __slots__ = ("local_idx", "remote_idx", "lists")

    def __init__(self, local_kind: MemoryKind, remote_kind: MemoryKind, local_idx: np.ndarray,
                 remote_idx: np.ndarray, sizes: np.ndarray, blocks: int, lists: SlicedLists) -> None:
        super().__init__(Granularity.MEMBERS, local_kind, Granularity.MEMBERS, remote_kind, sizes, blocks, True,
                         blocks * int(sizes.shape[0]), blocks * int(sizes.sum()))
        self.local_idx, self.remote_idx, self.lists = local_idx, remote_idx, lists

    def explicit(self, local: KVCacheSpec, remote: KVCacheSpec) -> tuple[DescriptorList, DescriptorList]:
        la, ra = self.lists.local().array[self.local_idx], self.lists.remote().array[self.remote_idx]
        return DescriptorList(la, self.local_kind), DescriptorList(ra, self.remote_kind)

    def prepare(self, lists: Lists) -> tuple[Any, np.ndarray, Any, np.ndarray]:
        sl, strided = self.lists, lists.strided
        lp = lists.for_peer((sl, "local"), False, lambda: sl.local(strided))
        rp = lists.for_peer((sl, "remote"), True, lambda: sl.remote(strided))
        return lp, self.local_idx, rp, self.remote_idx


class ExplicitLeg(Leg):
    """Explicit descriptor lists (a coalesced plan): prepared for the transfer at hand."""

    __slots__ = ("local_descs", "remote_descs")

    def __init__(self, local_granularity: Granularity, local_kind: MemoryKind, remote_granularity: Granularity,
                 remote_kind: MemoryKind, local_descs: DescriptorList, remote_descs: DescriptorList,
                 sizes: np.ndarray, blocks: int, *, member_major: bool = False) -> None:
        super().__init__(local_granularity, local_kind, remote_granularity, remote_kind, sizes, blocks, member_major,
                         len(local_descs), local_descs.nbytes)
        self.local_descs, self.remote_descs = local_descs, remote_descs

    @property
    def lengths(self) -> np.ndarray:
        return self.local_descs.lengths.astype(np.int64)

    def explicit(self, local: KVCacheSpec, remote: KVCacheSpec) -> tuple[DescriptorList, DescriptorList]:
        return self.local_descs, self.remote_descs

    def prepare(self, lists: Lists) -> tuple[Any, np.ndarray, Any, np.ndarray]:
        idx = np.arange(self.descriptors, dtype=np.int32)
        return lists.once(False, self.local_descs), idx, lists.once(True, self.remote_descs), idx
