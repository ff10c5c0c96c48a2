"""What one peer's metadata may cost us, and the caps that keep it there.

A peer's metadata is a few kilobytes, but a valid spec may describe 2^26 blocks. If the core
expanded such a spec into one descriptor per block and member for a backend that takes
plain lists, a kilobyte of metadata would cost gigabytes and seconds on the first transfer.
The core therefore keeps each peer's cost within a stated bound (64 MB and 1 s for
``add_peer`` plus the first transfer; measured in BENCHMARKS.md):

* metadata size, JSON items and members are capped when it is decoded
  (:mod:`kvxfer.metadata`);
* a whole prepared list is built only for backends that take strided lists, or when its
  expansion stays under :data:`MAX_PREPARED_DESCRIPTORS`; otherwise each transfer prepares
  only its own spans (:meth:`kvxfer.memory.DescriptorList.take`), so the cost follows the
  request, which the local caller chooses, not the peer's advertised size.
"""

from __future__ import annotations

__all__ = ["MAX_PREPARED_DESCRIPTORS"]

#: Plain descriptors a fully prepared list may hold: 24 MiB as an N x 3 uint64 array, and
#: about 64 MiB at the peak of expanding it.
MAX_PREPARED_DESCRIPTORS = 1 << 20
